"""Keras fit/evaluate under ParameterServerStrategy with a worker SIGKILLed mid-fit and mid-evaluate.

A real ``LocalCluster`` (2 PS, 2 worker processes); the coordinator is a child
process (``python tests/multiprocess/test_keras_ps_multiprocess.py <out>``)
because the pytest process never imports Keras. The kills are driven by events
(:mod:`kill_points`), not by time: a worker reading its 6th training batch (the
second step of its third closure, after the first step's push) stops there; the
worker that got there is SIGKILLed while it holds that closure, declared failed,
and restarted at the epoch's end. Then the worker reading evaluation batch 8 is
SIGKILLed the same way. The checks: ``fit`` completes, the PS applied exactly
``epochs * steps_per_epoch`` steps (its step counter is pushed with every step's
gradients, atomically and at most once per step), each epoch's metrics count
exactly ``steps_per_epoch`` batches, the closures the killed workers held ran
again, and ``evaluate`` counts every example exactly once and equals Keras's own
single-device evaluation of the same weights.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

BATCH = 16
STEPS_PER_EPOCH = 30
EPOCHS = 2
EVAL_EXAMPLES = 500  # 32 batches of 16, the last one short
#: Where the kills land: a worker's 6th training batch of a pass (steps_per_execution=2: the second step
#: of its third closure), and evaluation batch 8.
FIT_KILL_BATCH, EVAL_KILL_BATCH = 5, 8


class KilledBatches:
    """Per-worker training data: fixed batches; reading batch FIT_KILL_BATCH of a pass waits at kill point 0
    (module-level: it pickles by value)."""

    def __init__(self, x: Any, y: Any, kill_points: Any) -> None:
        self.items = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]
        self.kill_points = kill_points

    def __call__(self, input_context: Any) -> Any:
        return self

    def __iter__(self) -> Any:
        for i, item in enumerate(self.items):
            if i == FIT_KILL_BATCH:
                self.kill_points.hold(0)  # on a worker, inside the closure reading it (passes once killed)
            yield item


class KilledSequence:
    """The evaluation set as a sequence of batches (exactly-once evaluation); reading batch EVAL_KILL_BATCH
    waits at kill point 1."""

    def __init__(self, x: Any, y: Any, kill_points: Any) -> None:
        self.x, self.y, self.kill_points = x, y, kill_points

    def __call__(self, input_context: Any) -> Any:
        return self

    def __len__(self) -> int:
        return -(-len(self.x) // BATCH)

    def __getitem__(self, i: int) -> Any:
        if i == EVAL_KILL_BATCH:
            self.kill_points.hold(1)
        return self.x[i * BATCH:(i + 1) * BATCH], self.y[i * BATCH:(i + 1) * BATCH]


class _Killer:
    """Makes the next kill of ``kill_points`` on a thread of its own (the closures wait for it, not Keras's
    loop); :meth:`victim` waits for it and returns the worker killed."""

    def __init__(self, kill_points: Any, cluster: Any, coord: Any) -> None:
        self._out: dict[str, Any] = {}

        def kill() -> None:
            try:
                self._out["victim"] = kill_points.kill(cluster, coord)
            except BaseException as e:  # noqa: BLE001 - re-raised by victim()
                self._out["error"] = e

        self._thread = threading.Thread(target=kill, name="test-killer", daemon=True)
        self._thread.start()

    def victim(self) -> int:
        self._thread.join(180)
        if "error" in self._out:
            raise self._out["error"]
        assert "victim" in self._out, "the kill was not made within 180 s"
        return int(self._out["victim"])


def _child(out: str) -> None:
    import jaxdist.keras  # noqa: F401  (KERAS_BACKEND=jax, also for the worker processes it starts)

    import keras
    import numpy as np

    import jaxdist
    from jaxdist.testing import poll_for

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: kill_points
    from kill_points import KillPoints

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
        # Reported in files: a closure re-run on another worker reads other batches, so it would not push a
        # kill point's variable where its first attempt did (exactly-once pushes refuse that).
        kill_points = KillPoints(strategy, 2, report_dir=str(Path(out).parent))
        with strategy.scope():
            model = make()

        class KillMidEpoch(keras.callbacks.Callback):
            """Kill point 0 (in epoch 0: every worker stops at it); restart its victim at the epoch's end."""

            def __init__(self) -> None:
                super().__init__()
                self.counts: list[list[float]] = []

            def on_train_begin(self, logs: Any = None) -> None:
                self.killer = _Killer(kill_points, cluster, coord)

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                self.counts.append([float(v.numpy()) for v in self.model.metrics_variables if v.path.endswith("count")])
                if epoch == 0:
                    result["fit_victim"] = self.killer.victim()  # declared failed before its closure went on
                    cluster.restart(f"worker:{result['fit_victim']}")

        cb = KillMidEpoch()
        hist = model.fit(jaxdist.keras.DatasetCreator(KilledBatches(x, y, kill_points)), epochs=EPOCHS,
                         steps_per_epoch=STEPS_PER_EPOCH, callbacks=[cb], verbose=0)
        victim = result["fit_victim"]
        result["iterations"] = int(model.optimizer.iterations.numpy())
        result["fit_counts"] = cb.counts
        result["loss"] = hist.history["loss"]
        result["fit_retried"] = coord.closure_counts.retried
        result["fit_failures_victim"] = coord.status()[victim]["failures"]
        poll_for(lambda: coord.status()[victim]["healthy"], 60, what=f"worker:{victim} taken back")

        class KillMidEval(keras.callbacks.Callback):
            def on_test_begin(self, logs: Any = None) -> None:
                self.killer = _Killer(kill_points, cluster, coord)

            def on_test_end(self, logs: Any = None) -> None:
                result["eval_victim"] = self.killer.victim()

        retried_before = coord.closure_counts.retried
        sequence = KilledSequence(xe, ye, kill_points)
        got = model.evaluate(jaxdist.keras.DatasetCreator(sequence), steps=len(sequence),
                             callbacks=[KillMidEval()], return_dict=True, verbose=0)
        result["kills"] = kill_points.kills
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
    assert r["kills"] == 2 and "eval_victim" in r, r
    assert r["fit_failures_victim"] >= 1, r
    assert r["fit_retried"] >= 1, r  # the victim held a closure (kill point 0) when it died: it ran again
    # Exactly epochs * steps_per_epoch steps applied on the PS: none lost, none applied twice.
    assert r["iterations"] == EPOCHS * STEPS_PER_EPOCH, r
    assert r["fit_counts"] == [[STEPS_PER_EPOCH * BATCH * 1.0] * 2] * EPOCHS, r
    assert len(r["loss"]) == EPOCHS
    # Every evaluation example exactly once, with the kill in the middle.
    assert r["eval_counts"] == [float(EVAL_EXAMPLES)] * 2, r
    assert r["eval_retried"] >= 1, r  # the victim held an evaluation closure (kill point 1) when it died
    for key in ("loss", "accuracy"):
        assert abs(r["eval"][key] - r["eval_ref"][key]) <= 1e-5 * max(1.0, abs(r["eval_ref"][key])), r


if __name__ == "__main__":
    _child(sys.argv[1])
