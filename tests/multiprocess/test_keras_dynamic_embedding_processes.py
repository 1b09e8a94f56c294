"""Keras fit with a ``jaxdist.keras.layers.DynamicEmbedding`` on a cluster of processes, a worker SIGKILLed
mid-fit: every push to the dynamic table is applied exactly once.

A real ``LocalCluster`` (2 PS, 2 worker processes); the coordinator is a child process
(``python tests/multiprocess/test_keras_dynamic_embedding_processes.py <out>``) because the pytest process
never imports Keras. The model makes every push countable: rows start at zero, the prediction is the sum of
the example's rows (a frozen all-ones kernel), the loss is the mean absolute error against a far target, and
SGD's learning rate is the batch size, so each key occurrence of a step adds exactly +1 to its row. Every
batch holds the same keys (in another order), so a run that applies each step's push once ends with every
row at ``steps x occurrences per batch``, whichever worker ran which step. The kill (:mod:`kill_points`)
lands inside a closure of two steps after its first step's pushes: the re-run on the other worker must
have that step's pushes refused as duplicates.
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
STEPS_PER_EPOCH = 12
EPOCHS = 2
#: A worker's 6th training batch of a pass: the second step of its third closure (steps_per_execution=2).
KILL_BATCH = 5


def batch_keys(seed: int) -> Any:
    """One batch's keys: rows ``[i, 100 + i, 7]`` for ``i < BATCH``, in an order of its own (key 7 occurs
    ``BATCH + 1`` times, every other key once)."""
    import numpy as np

    rows = np.array([[i, 100 + i, 7] for i in range(BATCH)], np.int64) + (1 << 35)
    return rows[np.random.default_rng(seed).permutation(BATCH)]


class KilledBatches:
    """Per-worker training data: the batches in order; reading batch KILL_BATCH of a pass waits at kill point 0
    (module-level: it pickles by value)."""

    def __init__(self, items: list[Any], kill_points: Any) -> None:
        self.items = items
        self.kill_points = kill_points

    def __call__(self, input_context: Any) -> Any:
        return self

    def __iter__(self) -> Any:
        for i, item in enumerate(self.items):
            if i == KILL_BATCH:
                self.kill_points.hold(0)  # on a worker, inside the closure reading it (passes once killed)
            yield item


def _child(out: str) -> None:
    import jaxdist.keras  # noqa: F401  (KERAS_BACKEND=jax, also for the worker processes it starts)

    import keras
    import numpy as np

    import jaxdist

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: kill_points
    from kill_points import KillPoints

    items = [(batch_keys(b), np.full((BATCH, 1), 1e6, np.float32)) for b in range(STEPS_PER_EPOCH)]
    result: dict[str, Any] = {}
    with jaxdist.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)
        # Reported in files: a closure re-run on another worker reads another batch (see kill_points).
        kill_points = KillPoints(strategy, 1, report_dir=str(Path(out).parent))
        with strategy.scope():
            model = keras.Sequential([
                keras.Input((3,), dtype="int64"),
                jaxdist.keras.layers.DynamicEmbedding(1, initializer="zeros", name="items"),
                keras.layers.Flatten(),
                keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", trainable=False)])
            model.compile(keras.optimizers.SGD(float(BATCH)), "mae", steps_per_execution=2)
        victim: dict[str, Any] = {}

        def kill() -> None:
            try:
                victim["worker"] = kill_points.kill(cluster, coord)
            except BaseException as e:  # noqa: BLE001 - reported below
                victim["error"] = repr(e)

        killer = threading.Thread(target=kill, name="test-killer", daemon=True)
        killer.start()
        model.fit(jaxdist.keras.DatasetCreator(KilledBatches(items, kill_points)), epochs=EPOCHS,
                  steps_per_epoch=STEPS_PER_EPOCH, verbose=0)
        killer.join(180)
        result["victim"] = victim
        result["kills"] = kill_points.kills
        result["retried"] = coord.closure_counts.retried
        result["iterations"] = int(model.optimizer.iterations.numpy())
        table = jaxdist.keras.dynamic_tables(model)["items"]
        keys = batch_keys(0)
        distinct = np.unique(keys)
        result["keys"] = [int(k) for k in distinct]
        result["occurrences"] = [int((keys == k).sum()) for k in distinct]
        result["rows"] = table.lookup(distinct)[:, 0].tolist()
        result["stats"] = table.stats()
        coord.shutdown()
    Path(out).write_text(json.dumps(result))


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_worker_sigkill_mid_fit_applies_every_dynamic_push_exactly_once(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    for k in ("TF_CONFIG", "JAXDIST_CLUSTER", "KERAS_BACKEND"):
        env.pop(k, None)
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=380)
    assert proc.returncode == 0, proc.stderr[-6000:]
    r = json.loads(out.read_text())
    assert r["kills"] == 1 and "worker" in r["victim"], r
    assert r["retried"] >= 1, r  # the victim held a closure when it died: it ran again elsewhere
    steps = EPOCHS * STEPS_PER_EPOCH
    assert r["iterations"] == steps, r  # every step once (the dense push's step counter)
    # Every step's table push once: each key occurrence of each step added exactly +1.
    assert r["rows"] == [float(steps * n) for n in r["occurrences"]], r
    assert max(r["occurrences"]) == BATCH + 1 and len(r["keys"]) == 2 * BATCH, r
    stats = r["stats"]
    assert stats["rows"] == stats["inserts"] == 2 * BATCH, stats
    assert stats["pushes"] == 2 * steps, stats  # one push per step to each of the 2 PS tasks, none twice
    assert stats["admissions_refused"] == 0 and stats["evictions"] == 0, stats


if __name__ == "__main__":
    _child(sys.argv[1])
