"""jaxdist.DynamicEmbedding in an in-process cluster (2 PS, 2 workers): a small model trained with
closures gives the same rows and counters as DynamicTableShard used directly (one per PS task, keys
routed by shard_of); string keys; a re-run closure's push is applied once; hostile input."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist
from jaxdist.errors import (
    ConfigurationError,
    DTypeMismatchError,
    InvalidRequestError,
    PayloadTooLargeError,
    VariableExistsError,
)
from jaxdist.ps_server.dynamic_table import DynamicTableConfig, DynamicTableShard, hash_keys, shard_of
from jaxdist.testing import InProcessCluster

pytestmark = pytest.mark.timeout(180)

DIM = 4


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[jaxdist.ParameterServerStrategy, jaxdist.ClusterCoordinator]]:
    with InProcessCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coord = jaxdist.ClusterCoordinator(strategy)
        yield strategy, coord
        coord.shutdown(exit_tasks=False)
        strategy.close()


class ShardedReference:
    """The table as DynamicTableShards used directly: one per PS task, keys routed by shard_of."""

    def __init__(self, table: jaxdist.DynamicEmbedding) -> None:
        self.n = table.num_shards
        self.shards = [DynamicTableShard(table.config, i, self.n) for i in range(self.n)]

    def _split(self, keys: Any) -> list[np.ndarray]:
        flat = list(np.asarray(keys, dtype=object).reshape(-1)) if not isinstance(keys, np.ndarray) or keys.dtype == object else keys.reshape(-1)
        sh = shard_of(hash_keys(flat), self.n)
        return [np.flatnonzero(sh == s) for s in range(self.n)]

    def lookup(self, keys: np.ndarray) -> np.ndarray:
        flat = keys.reshape(-1)
        out = np.empty((len(flat), DIM), np.float32)
        for s, at in enumerate(self._split(flat)):
            if len(at):
                out[at] = self.shards[s].lookup(flat[at])[0]
        return out.reshape(keys.shape + (DIM,))

    def apply(self, keys: np.ndarray, grads: np.ndarray) -> dict[str, int]:
        flat, g = keys.reshape(-1), grads.reshape(-1, DIM)
        out = {"applied": 0, "refused": 0, "inserted": 0, "evicted": 0}
        for s, at in enumerate(self._split(flat)):
            if len(at):
                for k, v in self.shards[s].apply(flat[at], g[at]).items():
                    out[k] += v
        return out

    def stats(self) -> dict[str, int]:
        per = [sh.stats() for sh in self.shards]
        return {k: sum(p[k] for p in per) for k in ("rows", "bytes", "inserts", "admissions_refused", "evictions",
                                                   "pushes", "pending_keys")}


W = np.linspace(-1.0, 1.0, DIM).astype(np.float32)


def _loss(rows: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((rows.sum(axis=1) @ W - y) ** 2)


def _batches(n: int, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        ids = (rng.zipf(1.3, size=(8, 3)) % 500).astype(np.int64)  # repeats within and across batches
        out.append((ids, rng.standard_normal(8).astype(np.float32)))
    return out


def test_training_matches_the_shards_used_directly(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    with strategy.scope():
        table = jaxdist.DynamicEmbedding(
            DIM, name="items", seed=3, optimizer="lazy_adam", learning_rate=0.05, min_count=2, capacity=60,
            eviction_policy="lfu", ttl_steps=25)
    ref = ShardedReference(table)

    def step(ids: np.ndarray, y: np.ndarray) -> float:
        rows = table.lookup(ids)  # on the worker, through its connections
        loss, g = jax.value_and_grad(_loss)(jnp.asarray(rows), jnp.asarray(y))
        table.apply_gradients(ids, np.asarray(g))
        return float(loss)

    for ids, y in _batches(60):
        # One step at a time (join): the pushes reach the shards in the reference's order.
        rv = coord.schedule(step, args=(ids, y))
        coord.join()
        rows = ref.lookup(ids)
        loss, g = jax.value_and_grad(_loss)(jnp.asarray(rows), jnp.asarray(y))
        assert rv.fetch() == float(loss)
        ref.apply(ids, np.asarray(g))
    probe = np.arange(500, dtype=np.int64)
    assert np.array_equal(table.lookup(probe), ref.lookup(probe))
    stats = table.stats()
    assert stats == ref.stats()
    assert stats["evictions"] > 0 and stats["admissions_refused"] > 0 and stats["pushes"] > 60
    for s, sh in enumerate(ref.shards):  # each PS task holds exactly its shard's keys
        mine = probe[shard_of(hash_keys(probe), 2) == s]
        served = strategy.connections.client(s).dynamic_lookup("items", mine)
        want = sh.lookup(mine)
        assert np.array_equal(served[0], want[0]) and np.array_equal(served[1], want[1])


def test_string_keys_on_the_coordinator(env) -> None:  # type: ignore[no-untyped-def]
    strategy, _ = env
    with strategy.scope():
        table = jaxdist.DynamicEmbedding(DIM, name="users", key_dtype="string", optimizer="adagrad", learning_rate=0.1)
    ref = ShardedReference(table)
    keys = np.array([["u:1", "u:2"], ["u:1", "ü:3"]], dtype=object)
    g = np.ones((2, 2, DIM), np.float32)
    table.apply_gradients(keys, g)
    ref.apply(keys, g)
    got = table.lookup(keys)
    assert got.shape == (2, 2, DIM)
    assert np.array_equal(got, ref.lookup(keys))
    with pytest.raises(DTypeMismatchError):
        table.lookup(np.array([1, 2], np.int64))


def test_rerun_closure_push_is_applied_once(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    with strategy.scope():
        table = jaxdist.DynamicEmbedding(DIM, name="once", initializer="zeros", learning_rate=1.0)
    import pickle

    from jaxdist.worker.context import ClosureIdentity, TaskContext, use

    ids = np.arange(10, dtype=np.int64)
    worker_side = pickle.loads(pickle.dumps(table))  # no connections of its own, as in a closure
    for _attempt in range(2):  # the same closure identity twice: a re-run after a worker failure
        with use(TaskContext(ps=strategy.connections, identity=ClosureIdentity(f"{coord.run_id}/closure7"))):
            worker_side.apply_gradients(ids, np.ones((10, DIM), np.float32))
    assert np.array_equal(table.lookup(ids), -np.ones((10, DIM), np.float32))
    assert table.stats()["pushes"] == len(set(shard_of(hash_keys(ids), 2).tolist()))


def test_hostile_input_changes_nothing(env) -> None:  # type: ignore[no-untyped-def]
    strategy, _ = env
    with strategy.scope():
        table = jaxdist.DynamicEmbedding(DIM, name="bounded", max_bytes_per_shard=5 * DIM * 4)
        with pytest.raises(ConfigurationError):
            jaxdist.DynamicEmbedding(DIM, name="bad", optimizer="rmsprop")
    ids = np.arange(4, dtype=np.int64)
    table.apply_gradients(ids, np.ones((4, DIM), np.float32))
    before, stats = table.lookup(np.arange(40)), table.stats()
    with pytest.raises(DTypeMismatchError):
        table.lookup(np.array([1.5]))
    with pytest.raises(ConfigurationError):
        table.apply_gradients(ids, np.ones((3, DIM), np.float32))
    with pytest.raises(PayloadTooLargeError):
        table.apply_gradients(np.arange(100, 140), np.ones((40, DIM), np.float32))
    assert np.array_equal(table.lookup(np.arange(40)), before) and table.stats() == stats


def test_a_push_given_counted_equals_its_occurrences_and_bad_counts_change_nothing(env) -> None:  # type: ignore[no-untyped-def]
    """``apply_gradients(keys, rows, counts=...)`` (the Keras layer's push: each key once, its summed row,
    its count) equals pushing every occurrence (the row at the key's first occurrence, zeros at the
    others); malformed counts, a key given twice and rows summing past float32 are refused before any
    PS task is sent anything."""
    strategy, _ = env
    with strategy.scope():
        table = jaxdist.DynamicEmbedding(DIM, name="counted", seed=1, min_count=3, optimizer="adagrad",
                                         learning_rate=0.1)
    ref = ShardedReference(table)
    rng = np.random.default_rng(2)
    for _ in range(6):
        distinct = rng.choice(np.arange(40, dtype=np.int64), size=12, replace=False)
        counts = rng.integers(1, 4, size=12)
        rows = rng.standard_normal((12, DIM)).astype(np.float32)
        # Every occurrence: each key first in key order, then its repeats (zero rows), shuffled.
        repeats = np.repeat(np.arange(12), counts - 1)
        rng.shuffle(repeats)
        occ = np.concatenate([np.arange(12), repeats])
        expanded = np.zeros((occ.size, DIM), np.float32)
        expanded[:12] = rows
        want = ref.apply(distinct[occ], expanded)
        got = table.apply_gradients(distinct.reshape(3, 4), rows.reshape(3, 4, DIM), counts=counts.reshape(3, 4))
        assert got == want
    probe = np.arange(40, dtype=np.int64)
    assert np.array_equal(table.lookup(probe), ref.lookup(probe)) and table.stats() == ref.stats()
    assert table.stats()["admissions_refused"] > 0 and table.stats()["rows"] > 0
    before, stats = table.lookup(probe), table.stats()
    ones = np.ones((2, DIM), np.float32)
    with pytest.raises(ConfigurationError):
        table.apply_gradients(np.array([1, 2]), ones, counts=np.array([1]))
    for keys, g, counts in [(np.array([1, 1]), ones, np.array([1, 1])), (np.array([1, 2]), ones, np.array([1, 0])),
                            (np.array([1, 2]), ones, np.array([1 << 62, 1 << 62]))]:
        with pytest.raises(InvalidRequestError):
            table.apply_gradients(keys, g, counts=counts)
    big = np.full((2, DIM), 3e38, np.float32)  # each row finite, their sum not
    with pytest.raises(InvalidRequestError):
        table.apply_gradients(np.array([5, 5]), big)
    assert np.array_equal(table.lookup(probe), before) and table.stats() == stats


def _train_some(coord: jaxdist.ClusterCoordinator, table: jaxdist.DynamicEmbedding, keys: list[Any]) -> None:
    def step(ks: Any) -> None:
        rows = table.lookup(ks)
        table.apply_gradients(ks, rows - 1.0)

    for ks in keys:
        coord.schedule(step, args=(ks,))
    coord.join()


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_checkpoint_restores_into_three_ps_tasks(tmp_path, key_dtype: str) -> None:  # type: ignore[no-untyped-def]
    kw: dict[str, Any] = dict(name="ck", key_dtype=key_dtype, seed=5, optimizer="lazy_adam", learning_rate=0.1,
                              min_count=2, capacity=40, ttl_steps=30)
    rng = np.random.default_rng(3)
    batches: list[Any] = [(rng.zipf(1.3, size=10) % 120).astype(np.int64) for _ in range(40)]
    if key_dtype == "string":
        batches = [np.asarray([f"k{k}" for k in b.tolist()], dtype=object) for b in batches]
        probe: Any = np.asarray([f"k{k}" for k in range(120)], dtype=object)
    else:
        probe = np.arange(120, dtype=np.int64)
    # One worker: the batches reach the tables in the order given, so which rows the time-to-live
    # evicts is fixed (with two workers the order, and so the eviction count, was the dispatch's to say:
    # one run of the string case evicted nothing).
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            table = jaxdist.DynamicEmbedding(DIM, **kw)
        coord = jaxdist.ClusterCoordinator(strategy)
        _train_some(coord, table, batches)
        saved_rows, saved_stats = table.lookup(probe), table.stats()
        path = jaxdist.Checkpoint(strategy).write(str(tmp_path / "ckpt"))
        _check_load(path, [cluster.ps(i).servicer.dynamic.get("ck").export() for i in range(2)], key_dtype)
        _train_some(coord, table, batches[:5])  # changes after the save: a restore takes them back
        assert not np.array_equal(table.lookup(probe), saved_rows)
        jaxdist.Checkpoint(strategy).restore(path)
        assert np.array_equal(table.lookup(probe), saved_rows)
        coord.shutdown(exit_tasks=False)
        strategy.close()
    assert saved_stats["rows"] > 0 and saved_stats["evictions"] > 0 and saved_stats["pending_keys"] > 0
    with InProcessCluster(num_workers=1, num_ps=3) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            table = jaxdist.DynamicEmbedding(DIM, **kw)
        jaxdist.Checkpoint(strategy).restore(path)
        assert table.num_shards == 3
        assert np.array_equal(table.lookup(probe), saved_rows)
        assert table.stats() == saved_stats  # rows, bytes, pending keys; cumulative counters summed
        # Each key is on the shard its hash names among 3, with its optimizer state: a push applies as on
        # a shard restored directly from the saved exports.
        ref = [DynamicTableShard.restore(table.config, [_export_of(path, f, table.config) for f in ("ps-0.npz", "ps-1.npz")],
                                         s, 3) for s in range(3)]
        g = np.ones((len(probe), DIM), np.float32)
        table.apply_gradients(probe, g)
        where = shard_of(hash_keys(list(probe) if key_dtype == "string" else probe), 3)
        for s in range(3):
            at = np.flatnonzero(where == s)
            ks = probe[at] if key_dtype == "int64" else list(probe[at])
            ref[s].apply(ks, g[at])
            assert np.array_equal(strategy.connections.client(s).dynamic_lookup("ck", ks)[0], ref[s].lookup(ks)[0])
        strategy.close()


def _check_load(path: str, shards: list[dict[str, Any]], key_dtype: str) -> None:
    """jaxdist.checkpoint.load gives the saved table: every shard's keys, rows and per-row state, merged."""
    got = jaxdist.checkpoint.load(path, with_optimizer_state=True)["dynamic_tables"]
    assert list(got) == ["ck"]
    t = got["ck"]
    assert t["num_shards"] == 2 and t["config"]["name"] == "ck" and t["config"]["optimizer"]["name"] == "lazy_adam"
    assert t["keys"].dtype.kind == ("i" if key_dtype == "int64" else "U")  # numpy strings: no pickle
    want: dict[Any, tuple[np.ndarray, ...]] = {}
    for e in shards:
        for j, k in enumerate(e["keys"].tolist()):
            want[k] = (e["values"][j], e["t"][j], e["slot_m"][j], e["slot_v"][j])
    assert t["keys"].tolist() == sorted(want) and len(want) > 0
    st = t["optimizer_state"]
    assert sorted(st) == ["m", "t", "v"]
    for i, k in enumerate(t["keys"].tolist()):
        v, steps, m, var = want[k]
        assert np.array_equal(t["values"][i], v) and st["t"][i] == steps
        assert np.array_equal(st["m"][i], m) and np.array_equal(st["v"][i], var)
    assert jaxdist.checkpoint.load(path)["dynamic_tables"]["ck"].keys() == {"config", "num_shards", "keys", "values"}


def _export_of(path: str, file: str, config: Any) -> dict[str, Any]:
    import os

    from jaxdist.ps_server.dynamic_tables import unpack_export

    with np.load(os.path.join(path, file)) as f:
        return unpack_export(config, lambda k: f[k])


def test_a_create_refused_by_one_ps_is_completed_by_the_same_create_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Creation is idempotent, not rolled back: a PS that refuses leaves the other PS's (empty) shard,
    the handle is not made, and the same constructor again completes the table, keeping that shard."""
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            ps1 = cluster.ps(1).servicer.dynamic
            real_create = ps1.create
            refusals = []

            def refuse_once(*args: Any) -> bool:
                if not refusals:
                    refusals.append(args)
                    raise InvalidRequestError("refused by the test")
                return real_create(*args)

            monkeypatch.setattr(ps1, "create", refuse_once)
            with strategy.scope():
                with pytest.raises(InvalidRequestError, match="refused by the test") as info:
                    jaxdist.DynamicEmbedding(DIM, name="t")
            assert any("ps:0 hold their (empty) shard" in n and "again completes it" in n
                       for n in getattr(info.value, "__notes__", []))
            assert "t" not in strategy.dynamic_tables and ps1.names() == []
            kept = cluster.ps(0).servicer.dynamic.get("t")
            with strategy.scope():
                table = jaxdist.DynamicEmbedding(DIM, name="t")
            assert cluster.ps(0).servicer.dynamic.get("t") is kept  # kept as it was, not made again
            assert ps1.names() == ["t"] and strategy.dynamic_tables["t"] is table
            keys = np.arange(20, dtype=np.int64)
            table.apply_gradients(keys, np.ones((20, DIM), np.float32))
            assert table.stats()["rows"] == 20 and sorted(set(shard_of(hash_keys(keys), 2).tolist())) == [0, 1]

            # A PS holding a table of that name with another config refuses for good (ALREADY_EXISTS):
            # the error says which PS tasks hold the new shard; nothing is registered.
            strategy.connections.client(1).create_dynamic_table(DynamicTableConfig("u", (DIM + 1,)), 1, 2)
            with strategy.scope():
                with pytest.raises(VariableExistsError) as info2:
                    jaxdist.DynamicEmbedding(DIM, name="u")
            assert any("ps:0 hold their (empty) shard" in n for n in getattr(info2.value, "__notes__", []))
            assert "u" not in strategy.dynamic_tables and cluster.ps(0).servicer.dynamic.names() == ["t", "u"]
        finally:
            strategy.close()
