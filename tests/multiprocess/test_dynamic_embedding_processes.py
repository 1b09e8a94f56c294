"""jaxdist.DynamicEmbedding on a cluster of processes: training equals DynamicTableShards used
directly, and under worker SIGKILLs every push is applied exactly once (rows and counters exact)."""

from __future__ import annotations

import numpy as np
import pytest
from kill_points import KillPoints

import jaxdist
from jaxdist.ps_server.dynamic_table import DynamicTableShard, hash_keys, shard_of

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]

DIM = 3


def _reference(table: jaxdist.DynamicEmbedding) -> list[DynamicTableShard]:
    return [DynamicTableShard(table.config, i, table.num_shards) for i in range(table.num_shards)]


def _ref_apply(shards: list[DynamicTableShard], keys: np.ndarray, grads: np.ndarray) -> None:
    where = shard_of(hash_keys(keys), len(shards))
    for s, sh in enumerate(shards):
        at = np.flatnonzero(where == s)
        if len(at):
            sh.apply(keys[at], grads[at])


def _ref_lookup(shards: list[DynamicTableShard], keys: np.ndarray) -> np.ndarray:
    where = shard_of(hash_keys(keys), len(shards))
    out = np.empty((len(keys), DIM), np.float32)
    for s, sh in enumerate(shards):
        at = np.flatnonzero(where == s)
        if len(at):
            out[at] = sh.lookup(keys[at])[0]
    return out


def test_training_in_processes_matches_the_shards_used_directly() -> None:
    with jaxdist.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            table = jaxdist.DynamicEmbedding(DIM, name="emb", seed=11, optimizer="adagrad", learning_rate=0.2,
                                             min_count=2, capacity=30, ttl_steps=15)
        coord = jaxdist.ClusterCoordinator(strategy)
        ref = _reference(table)
        target = np.array([0.5, -1.0, 2.0], np.float32)

        def step(ids: np.ndarray) -> None:
            rows = table.lookup(ids)
            table.apply_gradients(ids, 2.0 * (rows - target))  # d/drow of ||row - target||^2

        rng = np.random.default_rng(1)
        for _ in range(40):
            ids = (rng.zipf(1.4, size=12) % 200).astype(np.int64)
            coord.schedule(step, args=(ids,))
            coord.join()  # one step at a time: the shards see the reference's order
            _ref_apply(ref, ids, 2.0 * (_ref_lookup(ref, ids) - target))
        probe = np.arange(200, dtype=np.int64)
        assert np.array_equal(table.lookup(probe), _ref_lookup(ref, probe))
        stats = table.stats()
        want = [sh.stats() for sh in ref]
        assert stats == {k: sum(w[k] for w in want) for k in stats}
        assert stats["evictions"] > 0 and stats["admissions_refused"] > 0
        coord.shutdown()


def test_worker_sigkill_every_push_exactly_once() -> None:
    """Each closure pushes -1 to the rows of its keys, twice (two pushes to the table); a worker is
    SIGKILLed between a closure's two pushes, the closure re-runs elsewhere: every row ends at minus
    the exact number of times its key was pushed, and the shards count exactly the pushes made."""
    with jaxdist.LocalCluster(num_workers=3, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            table = jaxdist.DynamicEmbedding(DIM, name="exact", initializer="zeros", learning_rate=1.0)
        coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)
        chaos = KillPoints(strategy, 2)
        n = 240
        kill_at = {n // 3: 0, 2 * n // 3: 1}

        def keys_of(i: int) -> np.ndarray:
            return np.array([i % 50, (i * 7) % 50, 100 + i % 3], np.int64)

        def work(i: int) -> int:
            k = keys_of(i)
            table.apply_gradients(k, np.ones((3, DIM), np.float32))
            if i in kill_at:
                chaos.hold(kill_at[i])
            table.apply_gradients(k[:1], np.ones((1, DIM), np.float32))
            return i

        rvs = [coord.schedule(work, args=(i,)) for i in range(n)]
        chaos.run(cluster, coord)
        coord.join()
        assert sorted(rv.fetch() for rv in rvs) == list(range(n))
        assert coord.closure_counts.retried >= chaos.count
        expected: dict[int, int] = {}
        shard_pushes = [0, 0]
        for i in range(n):
            k = keys_of(i)
            for key in k.tolist() + [int(k[0])]:
                expected[key] = expected.get(key, 0) + 1
            for part in (k, k[:1]):
                for s in set(shard_of(hash_keys(part), 2).tolist()):
                    shard_pushes[s] += 1
        keys = np.array(sorted(expected), np.int64)
        got = table.lookup(keys)
        assert np.array_equal(got, -np.array([expected[k] for k in keys.tolist()], np.float32)[:, None]
                              * np.ones((1, DIM), np.float32))
        stats = table.stats()
        assert stats["pushes"] == sum(shard_pushes) and stats["rows"] == len(expected) == stats["inserts"]
        coord.shutdown()


def test_ps_failover_keeps_every_push_exactly_once() -> None:
    """Closures push to a dynamic table on 2 replicated PS tasks; the primary of ps:0 is SIGKILLed
    (its backup takes over), restarted (attached again as the backup: full sync), then the promoted
    backup is SIGKILLed too: every row ends at exactly minus the pushes of its key."""
    import time

    from jaxdist.testing import poll_for

    n = 240
    with jaxdist.LocalCluster(num_workers=2, num_ps=2, ps_backups=True) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            table = jaxdist.DynamicEmbedding(DIM, name="fo", initializer="zeros", learning_rate=1.0,
                                             key_dtype="string")
        coord = jaxdist.ClusterCoordinator(strategy)

        def keys_of(i: int) -> list[str]:
            return [f"k{i % 40}", f"k{(i * 3) % 40}", "hot"]

        def work(i: int) -> None:
            time.sleep(0.01)  # pacing only: the kills below wait for progress, not for time
            table.apply_gradients(keys_of(i), np.ones((3, DIM), np.float32))

        rvs = [coord.schedule(work, args=(i,)) for i in range(n)]

        def finished() -> int:
            return sum(1 for rv in rvs if rv.done())

        poll_for(lambda: finished() >= n // 4, timeout=120)
        cluster.kill("ps:0")
        poll_for(lambda: strategy.replicas.failovers >= 1, timeout=60)  # type: ignore[union-attr]
        cluster.restart("ps:0")
        poll_for(lambda: strategy.replicas.status(0)[1], timeout=60)  # type: ignore[union-attr]
        poll_for(lambda: finished() >= n // 2, timeout=120)
        cluster.kill("ps_backup:0")
        poll_for(lambda: strategy.replicas.failovers >= 2, timeout=60)  # type: ignore[union-attr]
        coord.join()
        assert [rv.fetch() for rv in rvs] == [None] * n
        expected: dict[str, int] = {}
        for i in range(n):
            for k in keys_of(i):
                expected[k] = expected.get(k, 0) + 1
        keys = sorted(expected)
        got = table.lookup(keys)
        assert np.array_equal(got[:, 0], -np.array([expected[k] for k in keys], np.float32)), got[:, 0]
        assert table.stats()["rows"] == len(expected)
        coord.shutdown()
        strategy.close()
