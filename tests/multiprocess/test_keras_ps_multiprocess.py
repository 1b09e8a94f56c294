"""Keras fit/evaluate under ParameterServerStrategy with a worker SIGKILLed mid-fit and mid-evaluate.

A real ``LocalCluster`` (2 PS, 2 worker processes); the coordinator is a child
process (``python tests/multiprocess/test_keras_ps_multiprocess.py <out>``)
because the pytest process never imports Keras. A Keras callback SIGKILLs
worker:1 in the middle of an epoch and restarts it at the epoch's end; then
again in the middle of ``evaluate``. The checks: ``fit`` completes, the PS
applied exactly ``epochs * steps_per_epoch`` steps (its step counter is
pushed with every step's gradients, atomically and at most once per step),
each epoch's metrics count exactly ``steps_per_epoch`` batches, and
``evaluate`` counts every example exactly once and equals Keras's own
single-device evaluation of the same weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

BATCH = 16
STEPS_PER_EPOCH = 30
EPOCHS = 2
EVAL_EXAMPLES = 500  # 32 batches of 16, the last one short
STEP_DELAY_S = 0.03  # per batch read: the kills land while closures run


class SlowBatches:
    """Per-worker training data: fixed batches, each read taking STEP_DELAY_S (module-level: it pickles by value)."""

    def __init__(self, x: Any, y: Any) -> None:
        self.items = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]

    def __call__(self, input_context: Any) -> Any:
        return self

    def __iter__(self) -> Any:
        for item in self.items:
            time.sleep(STEP_DELAY_S)
            yield item


class SlowSequence:
    """The evaluation set as a sequence of batches (exactly-once evaluation), each read taking STEP_DELAY_S."""

    def __init__(self, x: Any, y: Any) -> None:
        self.x, self.y = x, y

    def __call__(self, input_context: Any) -> Any:
        return self

    def __len__(self) -> int:
        return -(-len(self.x) // BATCH)

    def __getitem__(self, i: int) -> Any:
        time.sleep(STEP_DELAY_S)
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


def _child(out: str) -> None:
    import jaxdist.keras  # noqa: F401  (KERAS_BACKEND=jax, also for the worker processes it starts)

    import keras
    import numpy as np

    import jaxdist
    from jaxdist.testing import poll_for

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS_PER_EPOCH, 8)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    xe = rng.normal(size=(EVAL_EXAMPLES, 8)).astype(np.float32)
    ye = (xe[:, 0] + xe[:, 1] > 0).astype(np.int32)

    def make() -> Any:
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)])
        model.compile(keras.optimizers.Adam(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=2)
        return model

    result: dict[str, Any] = {}
    with jaxdist.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(),
                                                   variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)
        with strategy.scope():
            model = make()

        class KillMidEpoch(keras.callbacks.Callback):
            """SIGKILL worker:1 mid-epoch 0; restart it once it is declared failed, at the epoch's end."""

            def __init__(self) -> None:
                super().__init__()
                self.counts: list[list[float]] = []

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                if not result.get("killed_fit") and batch >= STEPS_PER_EPOCH // 3:
                    cluster.kill("worker:1")
                    result["killed_fit"] = True

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                self.counts.append([float(v.numpy()) for v in self.model.metrics_variables if v.path.endswith("count")])
                if epoch == 0:
                    poll_for(lambda: not coord.status()[1]["healthy"], 30, what="worker:1 declared failed")
                    cluster.restart("worker:1")

        cb = KillMidEpoch()
        hist = model.fit(jaxdist.keras.DatasetCreator(SlowBatches(x, y)), epochs=EPOCHS,
                         steps_per_epoch=STEPS_PER_EPOCH, callbacks=[cb], verbose=0)
        result["iterations"] = int(model.optimizer.iterations.numpy())
        result["fit_counts"] = cb.counts
        result["loss"] = hist.history["loss"]
        result["fit_retried"] = coord.closure_counts.retried
        result["fit_failures_worker1"] = coord.status()[1]["failures"]
        poll_for(lambda: coord.status()[1]["healthy"], 60, what="worker:1 taken back")

        class KillMidEval(keras.callbacks.Callback):
            def on_test_batch_end(self, batch: int, logs: Any = None) -> None:
                if not result.get("killed_eval") and batch >= 8:
                    cluster.kill("worker:1")
                    result["killed_eval"] = True

        retried_before = coord.closure_counts.retried
        got = model.evaluate(jaxdist.keras.DatasetCreator(SlowSequence(xe, ye)), steps=len(SlowSequence(xe, ye)),
                             callbacks=[KillMidEval()], return_dict=True, verbose=0)
        result["eval"] = got
        result["eval_counts"] = [float(v.numpy()) for v in model.metrics_variables if v.path.endswith("count")]
        result["eval_retried"] = coord.closure_counts.retried - retried_before
        weights = model.get_weights()
        coord.shutdown()
    ref = make()
    ref.set_weights(weights)
    result["eval_ref"] = ref.evaluate(xe, ye, batch_size=BATCH, return_dict=True, verbose=0)
    Path(out).write_text(json.dumps(result))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_keras_fit_and_evaluate_survive_worker_sigkill(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    for k in ("TF_CONFIG", "JAXDIST_CLUSTER", "KERAS_BACKEND"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["killed_fit"] and r["killed_eval"], r
    assert r["fit_failures_worker1"] >= 1, r
    assert r["fit_retried"] >= 1, r  # worker:1 held closures when it died: they ran again elsewhere
    # Exactly epochs * steps_per_epoch steps applied on the PS: none lost, none applied twice.
    assert r["iterations"] == EPOCHS * STEPS_PER_EPOCH, r
    assert r["fit_counts"] == [[STEPS_PER_EPOCH * BATCH * 1.0] * 2] * EPOCHS, r
    assert len(r["loss"]) == EPOCHS
    # Every evaluation example exactly once, with the kill in the middle.
    assert r["eval_counts"] == [float(EVAL_EXAMPLES)] * 2, r
    assert r["eval_retried"] >= 1, r  # worker:1 held evaluation closures when it died
    for key in ("loss", "accuracy"):
        assert abs(r["eval"][key] - r["eval_ref"][key]) <= 1e-5 * max(1.0, abs(r["eval_ref"][key])), r


if __name__ == "__main__":
    _child(sys.argv[1])
