"""Counted dynamic pushes (each distinct key once, its rows summed, its occurrence count) against the
uncounted form (one gradient row per key occurrence, the PS summing and counting): the same batches
pushed both ways into two shards give bit-identical shards, answers and counters; malformed counts
are refused with typed errors and change nothing."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from jaxdist.base.errors import InvalidRequestError
from jaxdist.ps_server.dynamic_table import (
    MAX_PUSH_OCCURRENCES,
    AdmissionConfig,
    DynamicTableConfig,
    DynamicTableShard,
    EvictionConfig,
    RowOptimizer,
    hash_keys,
    reduce_push,
    shard_of,
    validate_keys,
)

pytestmark = pytest.mark.timeout(120)

# (optimizer, admission, eviction): every admission and eviction rule, over the three row rules.
CASES: dict[str, tuple[RowOptimizer, AdmissionConfig, EvictionConfig]] = {
    "sgd-count-lru": (RowOptimizer("sgd", 0.1), AdmissionConfig(min_count=3), EvictionConfig(capacity=40)),
    "adagrad-prob-lfu": (RowOptimizer("adagrad", 0.1), AdmissionConfig(probability=0.6),
                         EvictionConfig(capacity=40, policy="lfu")),
    "adam-count-lfu-ttl": (RowOptimizer("lazy_adam", 0.05), AdmissionConfig(min_count=2),
                           EvictionConfig(capacity=50, policy="lfu", ttl_steps=6)),
    "adam-both-lru": (RowOptimizer("lazy_adam", 0.05), AdmissionConfig(min_count=2, probability=0.7),
                      EvictionConfig(capacity=30, policy="lru")),
    # A pending FIFO shorter than a batch's new keys: the key-by-key replay path.
    "sgd-count-bounded-pending": (RowOptimizer("sgd", 0.1), AdmissionConfig(min_count=4, max_pending=12),
                                  EvictionConfig(capacity=60, ttl_steps=9)),
    "adagrad-none": (RowOptimizer("adagrad", 0.1), AdmissionConfig(), EvictionConfig()),
}


def _cfg(case: str, key_dtype: str) -> DynamicTableConfig:
    opt, adm, ev = CASES[case]
    return DynamicTableConfig("t", row_shape=(3,), key_dtype=key_dtype, seed=5, optimizer=opt, admission=adm,
                              eviction=ev)


def _batch(rng: np.random.Generator, n: int, key_dtype: str, step: int) -> tuple[Any, np.ndarray]:
    """Zipf keys (hot keys repeated many times), keys past 2**40, and gradient rows with -0.0, zeros and
    values whose float32 sum depends on the order of addition; some batches in float64 or float16."""
    ids = (rng.zipf(1.15, size=n) % 300).astype(np.int64) + (1 << 41)
    keys: Any = ids if key_dtype == "int64" else [f"k:{i}" for i in ids.tolist()]
    g = (rng.standard_normal((n, 3)) * 10.0 ** rng.integers(-4, 5, size=(n, 1))).astype(np.float32)
    g[rng.random(n) < 0.1] = -0.0
    g[rng.random(n) < 0.05] = 0.0
    if step % 5 == 3:
        return keys, g.astype(np.float64) * (1 + 1e-9)  # float64: rounded to float32 before summing
    if step % 5 == 4:
        return keys, g.astype(np.float16)
    return keys, g


def _same(a: DynamicTableShard, b: DynamicTableShard, probe: Any) -> None:
    assert a.digest() == b.digest()
    assert a.stats() == b.stats()
    la, lb = a.lookup(probe), b.lookup(probe)
    assert np.array_equal(la[0], lb[0]) and np.array_equal(la[1], lb[1])


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_counted_pushes_equal_uncounted_ones_bit_for_bit(case: str, key_dtype: str) -> None:
    cfg = _cfg(case, key_dtype)
    old, new = DynamicTableShard(cfg), DynamicTableShard(cfg)
    rng = np.random.default_rng(11)
    probe_ids = np.arange(300, dtype=np.int64) + (1 << 41)
    probe: Any = probe_ids if key_dtype == "int64" else [f"k:{i}" for i in probe_ids.tolist()]
    sent = occurrences = 0
    for step in range(40):
        keys, g = _batch(rng, 64 if step % 7 else 1, key_dtype, step)
        want = old.apply(keys, g)
        red = reduce_push(validate_keys(keys, key_dtype), g)
        assert red.grads.dtype == np.float32 and red.counts.sum() == len(keys)
        got = new.apply(red.keys, red.grads, red.counts)
        assert got == want, step
        _same(old, new, probe)
        sent, occurrences = sent + len(red.keys), occurrences + len(keys)
    # The comparison covered what it claims: duplicates, admission refusals, inserts and evictions.
    st = old.stats()
    assert sent < 0.8 * occurrences  # many duplicates
    assert st["inserts"] > 0 and st["pushes"] == 40
    if case != "adagrad-none":
        assert st["admissions_refused"] > 0 and st["evictions"] > 0
    if case == "sgd-count-bounded-pending":
        assert st["pending_forgotten"] > 0
    ea, eb = old.export(), new.export()
    assert sorted(ea) == sorted(eb)
    for k in ea:
        assert np.array_equal(np.asarray(ea[k]), np.asarray(eb[k])), k
    for since in (0, 20, 35):
        ca, cb = old.changes_since(since), new.changes_since(since)
        assert [np.asarray(x).tolist() for x in ca] == [np.asarray(x).tolist() for x in cb]


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_counted_pushes_split_over_shards_equal_the_uncounted_ones(key_dtype: str) -> None:
    """A client reduces the whole batch, then sends each shard its distinct keys: each shard gets the
    same as reducing its own part of the occurrences (sums and counts are per key)."""
    cfg = _cfg("adam-count-lfu-ttl", key_dtype)
    olds = [DynamicTableShard(cfg, s, 2) for s in range(2)]
    news = [DynamicTableShard(cfg, s, 2) for s in range(2)]
    rng = np.random.default_rng(3)
    for step in range(25):
        keys, g = _batch(rng, 80, key_dtype, step)
        flat = validate_keys(keys, key_dtype)
        route = shard_of(hash_keys(flat), 2)
        red = reduce_push(flat, g)
        red_route = shard_of(red.hashes, 2)
        for s in range(2):
            at = np.flatnonzero(route == s)
            part = flat[at] if isinstance(flat, np.ndarray) else [flat[int(i)] for i in at]
            want = olds[s].apply(part, g[at])
            mine = np.flatnonzero(red_route == s)
            rk = red.keys[mine] if isinstance(red.keys, np.ndarray) else [red.keys[int(i)] for i in mine]
            assert news[s].apply(rk, red.grads[mine], red.counts[mine]) == want
            assert olds[s].digest() == news[s].digest()


def test_colliding_string_keys_are_merged_as_a_shard_merges_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two strings with one 64-bit hash are one key to a shard: the reduction merges them the same way."""
    import jaxdist.ps_server.dynamic_table as dt

    real = dt.hash_keys

    def colliding(keys: Any) -> np.ndarray:
        h = real(keys)
        if not isinstance(keys, np.ndarray):
            h[[k == "b" for k in keys]] = real(["a"])[0]
        return h

    monkeypatch.setattr(dt, "hash_keys", colliding)
    cfg = _cfg("sgd-count-lru", "string")
    old, new = DynamicTableShard(cfg), DynamicTableShard(cfg)
    keys = ["c", "b", "a", "b", "c", "a", "a"]
    g = np.arange(21, dtype=np.float32).reshape(7, 3) - 10.0
    red = reduce_push(keys, g)
    assert red.keys == ["c", "b"] and red.counts.tolist() == [2, 5]
    assert new.apply(red.keys, red.grads, red.counts) == old.apply(keys, g)
    assert old.digest() == new.digest()


def test_malformed_counts_are_refused_and_change_nothing() -> None:
    cfg = _cfg("adam-count-lfu-ttl", "int64")
    t = DynamicTableShard(cfg)
    t.apply(np.array([1, 2, 2, 3], np.int64), np.ones((4, 3), np.float32))
    before = t.digest()
    g2 = np.ones((2, 3), np.float32)
    bad: list[tuple[Any, Any]] = [
        (np.array([1, 2], np.int64), np.array([1], np.int64)),  # fewer counts than keys
        (np.array([1, 2], np.int64), np.array([1, 1, 1], np.int64)),  # more
        (np.array([1, 2], np.int64), np.array([], np.int64)),  # none, as an explicit empty list
        (np.array([1, 2], np.int64), np.array([[1, 1]], np.int64)),  # not one-dimensional
        (np.array([1, 2], np.int64), np.array([1, 0], np.int64)),  # a count of 0
        (np.array([1, 2], np.int64), np.array([1, -3], np.int64)),  # negative
        (np.array([1, 2], np.int64), np.array([1.0, 2.0])),  # not integers
        (np.array([1, 1], np.int64), np.array([1, 1], np.int64)),  # a key repeated with counts
        (np.array([1, 2], np.int64), np.array([1 << 62, 1 << 62], np.int64)),  # the sum wraps int64
        (np.array([1, 2], np.int64), np.array([MAX_PUSH_OCCURRENCES, 1], np.int64)),  # over the bound
        (np.array([1, 2], np.int64), np.array([np.iinfo(np.uint64).max, 1], np.uint64)),
    ]
    for keys, counts in bad:
        with pytest.raises(InvalidRequestError):
            t.apply(keys, g2, counts)
        assert t.digest() == before, (keys, counts)
    s = DynamicTableShard(_cfg("sgd-count-lru", "string"))
    with pytest.raises(InvalidRequestError, match="repeated"):
        s.apply(["a", "b", "a"], np.ones((3, 3), np.float32), np.ones(3, np.int64))
    assert s.stats()["pushes"] == 0
    # The bound itself is accepted; duplicates without counts still are (the uncounted form).
    assert t.apply(np.array([7], np.int64), np.ones((1, 3), np.float32),
                   np.array([MAX_PUSH_OCCURRENCES], np.int64))["inserted"] == 1
    assert t.apply(np.array([9, 9, 9], np.int64), np.ones((3, 3), np.float32)) == {
        "applied": 0, "refused": 3, "inserted": 1, "evicted": 0}  # min_count 2: reached, its rows dropped


def test_reduce_push_refuses_what_a_shard_would() -> None:
    from jaxdist.base.errors import DTypeMismatchError, ShapeMismatchError

    with pytest.raises(DTypeMismatchError):
        reduce_push(np.array([1, 2], np.int64), np.ones((2, 3), np.int32))
    with pytest.raises(ShapeMismatchError):
        reduce_push(np.array([1, 2], np.int64), np.ones((3, 3), np.float32))
    empty = reduce_push(np.zeros(0, np.int64), np.zeros((0, 3), np.float32))
    assert empty.grads.shape == (0, 3) and empty.counts.shape == (0,)


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_the_keras_layers_counted_push_equals_its_old_one_row_per_occurrence(key_dtype: str) -> None:
    """A Keras step's push (jaxdist.keras.layers.DynamicEmbedding): the compact table's gradient as each
    distinct key once with its count gives the shard what one row per occurrence gave it (the key's row at
    its first occurrence, zeros at its other occurrences), bit for bit."""
    from types import SimpleNamespace

    from jaxdist.keras.ps_embedding import DynamicSlot, compact_batch

    cfg = _cfg("adam-both-lru", key_dtype)
    old, new = DynamicTableShard(cfg), DynamicTableShard(cfg)
    slot = DynamicSlot("items", 0, SimpleNamespace(config=cfg))
    rng = np.random.default_rng(8)
    for step in range(25):
        ids = (rng.zipf(1.2, size=(16, 3)) % 90).astype(np.int64)
        x = ids if key_dtype == "int64" else np.asarray([[f"k{i}".encode() for i in r] for r in ids.tolist()], object)
        got = compact_batch(x, [], [slot], 1)
        assert got is not None
        k = got[2][0]
        n = len(k.distinct)
        g = rng.standard_normal((k.size, 3)).astype(np.float32)  # the compact table's gradient, padding included
        g[rng.random(k.size) < 0.1] = -0.0
        occurrences = np.zeros((len(k.keys), 3), np.float32)  # the push before counts
        occurrences[k.first] = g[:n]
        want = old.apply(k.keys, occurrences)
        keys, rows, counts = k.counted_grads(g)
        assert len(keys) == n < len(k.keys) and counts.sum() == len(k.keys)
        assert new.apply(keys, rows, counts) == want
        assert old.digest() == new.digest(), step
    assert old.stats()["admissions_refused"] > 0 and old.stats()["evictions"] > 0
