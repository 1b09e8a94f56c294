"""Incremental exports from PS processes: closures on 2 workers push row-sparse (lazy Adam) and dense
gradients between exports; the deltas applied to the first full export equal every later full export
and the PS's values; a PS SIGKILLed and restored from a checkpoint between two exports forces a full
export (its tracking restarted), and the chain goes on from there."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import jaxdist
from jaxdist import serving_export as se
from jaxdist.testing import poll_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess, pytest.mark.slow]

ROWS, DIM = 64, 8


def _pulled(strategy) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {name: np.asarray(var.numpy()) for name, var in strategy.variables.items()}


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_deltas_follow_training_on_ps_processes_and_a_ps_restart_forces_a_full_export(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with jaxdist.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(),
                                                   variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        rng = np.random.default_rng(0)
        with strategy.scope():
            emb = jaxdist.create_variables({"emb": rng.standard_normal((ROWS, DIM)).astype(np.float32)}, name="t",
                                           optimizer=jaxdist.lazy_rows(optax.adam(0.05)))["emb"]
            dense = jaxdist.create_variables({"w": rng.standard_normal((DIM, 1)).astype(np.float32)}, name="d",
                                             optimizer=optax.sgd(0.1))
        coord = jaxdist.ClusterCoordinator(strategy)
        mgr = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy), str(tmp_path / "ckpt"))
        coord.enable_ps_recovery(mgr, poll_interval=0.2)

        def step(seed: int, with_dense: bool) -> None:
            r = np.random.default_rng(seed)
            ids = r.integers(0, ROWS, size=5)
            rows = jaxdist.embedding_lookup(emb, ids)
            emb.apply_sparse_gradient(ids, (rows * 0.1 + r.standard_normal(rows.shape)).astype(np.float32))
            if with_dense:
                jaxdist.apply_gradients(dense, {"w": r.standard_normal((DIM, 1)).astype(np.float32)})

        seed = iter(range(10_000))

        def train(n: int, with_dense: bool = True) -> None:
            for _ in range(n):
                coord.schedule(step, args=(next(seed), with_dense))
            coord.join()

        out = str(tmp_path / "exports")
        ex = se.IncrementalExporter(strategy, out)
        train(6)
        first = ex.export(step=6)
        state = se.load_export(first.path)
        for k in range(3):
            train(5, with_dense=k != 2)  # training (closures on both workers) between exports
            d = ex.export()
            assert d.kind == "delta", d
            se.apply_delta(state, d.path)
            _assert_same(state.variables, _pulled(strategy))
        full = ex.export(full=True)
        _assert_same(state.variables, se.load_export(full.path).variables)

        # ps:1 dies and comes back restored from a checkpoint: its change tracking starts over, so the
        # next export is a full one, never a delta that misses what the restore changed.
        train(3)
        mgr.save(1)
        train(3)
        cluster.kill("ps:1")
        poll_for(lambda: not coord.dispatching, 60, what="dispatch held while ps:1 is down")
        cluster.restart("ps:1")
        poll_for(lambda: coord.ps_recoveries == 1 and coord.dispatching, 120, what="ps:1 restored from the checkpoint")
        train(3)
        after = ex.export()
        assert after.kind == "full" and after.reason.startswith("ps:1 cannot answer a delta"), after
        _assert_same(se.load_export(after.path).variables, _pulled(strategy))
        train(4)
        last = ex.export()
        assert last.kind == "delta" and last.base == after.name
        _assert_same(se.load_latest(out).variables, _pulled(strategy))
        coord.shutdown()
