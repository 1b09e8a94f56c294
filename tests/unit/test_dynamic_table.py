"""Dynamic embedding table shards (PS side, no sockets): rules against a plain reference, admission and
eviction counts, determinism (a replayed sequence of pushes = a backup), checkpoint 2 -> 3 shards,
hostile input."""

from __future__ import annotations

import numpy as np
import pytest

from jaxdist.errors import DTypeMismatchError, InvalidRequestError, PayloadTooLargeError, ShapeMismatchError
from jaxdist.base.errors import ConfigurationError
from jaxdist.ps_server.dynamic_table import (
    AdmissionConfig,
    DynamicTableConfig,
    DynamicTableShard,
    EvictionConfig,
    RowOptimizer,
    hash_keys,
    initial_rows,
    shard_of,
)

pytestmark = pytest.mark.timeout(120)


class Reference:
    """The documented rules, written the plain way (dicts and per-key loops), for one shard."""

    def __init__(self, cfg: DynamicTableConfig) -> None:
        self.cfg = cfg
        self.rows: dict[int, dict] = {}
        self.pending: dict[int, int] = {}
        self.step = 0
        self.refused = self.inserts = self.evicted = 0

    def init_row(self, k: int) -> np.ndarray:
        return initial_rows(self.cfg, hash_keys(np.asarray([k], dtype=np.int64)))[0].astype(np.float32)

    def lookup(self, k: int) -> np.ndarray:
        if k in self.rows:
            return self.rows[k]["w"]
        if self.cfg.admission.min_count <= 1:
            return self.init_row(k)
        return np.full(self.cfg.row_shape, self.cfg.default_value, np.float32)

    def push(self, keys: list[int], grads: np.ndarray) -> None:
        opt, adm = self.cfg.optimizer, self.cfg.admission
        self.step += 1
        summed: dict[int, np.ndarray] = {}
        count: dict[int, int] = {}
        for k, g in zip(keys, grads):
            summed[k] = summed.get(k, np.zeros(self.cfg.row_shape, np.float32)) + g.astype(np.float32)
            count[k] = count.get(k, 0) + 1
        for k, g in summed.items():
            if k not in self.rows:
                if adm.min_count > 1:
                    self.refused += count[k]
                    self.pending[k] = self.pending.get(k, 0) + count[k]
                    if self.pending[k] >= adm.min_count:
                        del self.pending[k]
                        self.rows[k] = self._new(k)
                    continue
                self.rows[k] = self._new(k)
            r = self.rows[k]
            r["t"] += 1
            r["freq"] += count[k]
            r["last"] = self.step
            lr = np.float32(opt.learning_rate)
            if opt.name == "sgd":
                r["w"] = r["w"] - lr * g
            elif opt.name == "adagrad":
                r["acc"] = r["acc"] + g * g
                r["w"] = r["w"] - lr * g / np.sqrt(r["acc"] + np.float32(opt.eps))
            else:
                b1, b2, t = np.float32(opt.b1), np.float32(opt.b2), np.float32(r["t"])
                r["m"] = b1 * r["m"] + (1 - b1) * g
                r["v"] = b2 * r["v"] + (1 - b2) * g * g
                r["w"] = r["w"] - lr * (r["m"] / (1 - b1**t)) / (np.sqrt(r["v"] / (1 - b2**t)) + np.float32(opt.eps))
        ev = self.cfg.eviction
        if ev.ttl_steps is not None:
            for k in [k for k, r in self.rows.items() if r["last"] < self.step - ev.ttl_steps]:
                del self.rows[k]
                self.evicted += 1

    def _new(self, k: int) -> dict:
        self.inserts += 1
        z = np.zeros(self.cfg.row_shape, np.float32)
        return {"w": self.init_row(k), "acc": z + np.float32(self.cfg.optimizer.initial_accumulator),
                "m": z.copy(), "v": z.copy(), "t": 0, "freq": 0, "last": self.step}


def _run(cfg: DynamicTableConfig, steps: int = 30, seed: int = 1, check: bool = True) -> tuple[DynamicTableShard, Reference]:
    rng = np.random.default_rng(seed)
    table, ref = DynamicTableShard(cfg), Reference(cfg)
    for _ in range(steps):
        keys = rng.zipf(1.3, size=12).astype(np.int64) % 40
        vals, _ = table.lookup(keys)
        for k, v in zip(keys.tolist(), vals if check else []):
            # float32 rounding: the shard works on arrays, the reference row by row.
            np.testing.assert_allclose(v.astype(np.float32), ref.lookup(k), rtol=1e-5, atol=1e-6)
        grads = (vals * 0.5 + rng.normal(size=vals.shape)).astype(np.float32)
        table.apply(keys, grads)
        ref.push(keys.tolist(), grads)
    return table, ref


@pytest.mark.parametrize("opt", ["sgd", "adagrad", "lazy_adam"])
@pytest.mark.parametrize("min_count", [1, 3])
def test_rules_equal_the_plain_reference(opt: str, min_count: int) -> None:
    cfg = DynamicTableConfig(
        "t", (2, 3), optimizer=RowOptimizer(opt, learning_rate=0.1), admission=AdmissionConfig(min_count=min_count),
        eviction=EvictionConfig(ttl_steps=5), default_value=0.25,
    )
    table, ref = _run(cfg)
    exp = table.export()
    assert sorted(exp["keys"].tolist()) == sorted(ref.rows)
    for k, w in zip(exp["keys"].tolist(), exp["values"]):
        np.testing.assert_allclose(w, ref.rows[k]["w"], rtol=1e-5, atol=1e-6)
    s = table.stats()
    assert (s["inserts"], s["admissions_refused"], s["evictions_ttl"]) == (ref.inserts, ref.refused, ref.evicted)
    assert s["rows"] == len(ref.rows) and s["pending_keys"] == len(ref.pending)


def test_admission_counts_exact_and_gradient_dropped() -> None:
    cfg = DynamicTableConfig("t", (2,), initializer="zeros", admission=AdmissionConfig(min_count=3), default_value=7.0)
    t = DynamicTableShard(cfg)
    g = np.ones((1, 2), np.float32)
    assert t.apply([5], g) == {"applied": 0, "refused": 1, "inserted": 0, "evicted": 0}
    np.testing.assert_array_equal(t.lookup([5])[0], [[7.0, 7.0]])
    assert t.apply([5, 5], np.ones((2, 2), np.float32)) == {"applied": 0, "refused": 2, "inserted": 1, "evicted": 0}
    vals, admitted = t.lookup([5])
    np.testing.assert_array_equal(vals, [[0.0, 0.0]])  # the initializer, gradient dropped
    assert admitted.tolist() == [True]
    t.apply([5], g)
    np.testing.assert_allclose(t.lookup([5])[0], [[-0.01, -0.01]])
    assert t.stats()["admissions_refused"] == 3 and t.stats()["inserts"] == 1


def test_probability_admission_is_decided_by_the_key() -> None:
    cfg = DynamicTableConfig("t", (1,), admission=AdmissionConfig(probability=0.3), seed=3)
    a, b = DynamicTableShard(cfg), DynamicTableShard(cfg)
    keys = np.arange(2000, dtype=np.int64)
    _, adm_a = a.lookup(keys)
    _, adm_b = b.lookup(keys[::-1])
    assert adm_a.tolist() == adm_b[::-1].tolist()
    assert 0.25 < adm_a.mean() < 0.35
    r = a.apply(keys, np.zeros((2000, 1), np.float32))
    assert r["inserted"] == int(adm_a.sum()) and r["refused"] == 2000 - int(adm_a.sum())


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_capacity_eviction(policy: str) -> None:
    cfg = DynamicTableConfig("t", (1,), eviction=EvictionConfig(capacity=3, policy=policy))
    t = DynamicTableShard(cfg)
    g = lambda n: np.zeros((n, 1), np.float32)  # noqa: E731
    t.apply([1, 1, 1], g(3))  # key 1: pushed 3 times, oldest
    t.apply([2], g(1))
    t.apply([3], g(1))
    assert t.apply([4], g(1))["evicted"] == 1
    kept = sorted(t.export()["keys"].tolist())
    assert kept == ([2, 3, 4] if policy == "lru" else [1, 3, 4])
    assert t.stats()["evictions_capacity"] == 1 and t.stats()["rows"] == 3


def test_initializer_is_deterministic_and_independent_of_sharding() -> None:
    cfg = DynamicTableConfig("t", (4,), seed=9, key_dtype="string")
    keys = ["user:1", "user:2", "ü"]
    rows = initial_rows(cfg, hash_keys(keys))
    assert np.array_equal(rows, initial_rows(cfg, hash_keys(list(reversed(keys))))[::-1])
    assert not np.array_equal(rows[0], rows[1])
    other = initial_rows(DynamicTableConfig("t", (4,), seed=10, key_dtype="string"), hash_keys(keys))
    assert not np.array_equal(rows, other)
    assert abs(float(initial_rows(cfg, hash_keys([str(i) for i in range(4000)])).std()) - 0.05) < 0.005


def test_replayed_pushes_give_an_identical_shard() -> None:
    cfg = DynamicTableConfig("t", (3,), optimizer=RowOptimizer("lazy_adam"), admission=AdmissionConfig(min_count=2),
                             eviction=EvictionConfig(capacity=20, policy="lfu", ttl_steps=8))
    a, _ = _run(cfg, steps=40, seed=4, check=False)  # the reference has no capacity eviction
    b, _ = _run(cfg, steps=40, seed=4, check=False)
    assert a.stats()["evictions_capacity"] > 0 and a.stats()["evictions_ttl"] > 0
    assert a.digest() == b.digest()


def test_checkpoint_into_a_different_number_of_shards() -> None:
    cfg = DynamicTableConfig("t", (2,), optimizer=RowOptimizer("adagrad"), admission=AdmissionConfig(min_count=2))
    rng = np.random.default_rng(0)
    old = [DynamicTableShard(cfg, s, 2) for s in range(2)]
    single = DynamicTableShard(cfg)
    for _ in range(20):
        keys = rng.integers(0, 50, size=10).astype(np.int64)
        grads = rng.normal(size=(10, 2)).astype(np.float32)
        single.apply(keys, grads)
        route = shard_of(hash_keys(keys), 2)
        for s in range(2):
            if (route == s).any():
                old[s].apply(keys[route == s], grads[route == s])
    exports = [t.export() for t in old]
    new = [DynamicTableShard.restore(cfg, exports, s, 3) for s in range(3)]
    assert sum(len(t) for t in new) == sum(len(t) for t in old) == len(single)
    probe = np.arange(50, dtype=np.int64)
    route3 = shard_of(hash_keys(probe), 3)
    for k, s in zip(probe, route3):
        np.testing.assert_allclose(new[s].lookup([k])[0], single.lookup([k])[0], rtol=1e-6)
    total = lambda ts, c: sum(t.stats()[c] for t in ts)  # noqa: E731
    for c in ("inserts", "admissions_refused", "pending_keys"):
        assert total(new, c) == total(old, c)
    # Back to 2 shards: the same state as before.
    back = [DynamicTableShard.restore(cfg, [t.export() for t in new], s, 2) for s in range(2)]
    for a, b in zip(old, back):
        ea, eb = a.export(), b.export()
        order_a, order_b = np.argsort(ea["keys"]), np.argsort(eb["keys"])
        for name in ("keys", "values", "slot_acc", "freq", "last"):
            np.testing.assert_array_equal(ea[name][order_a], eb[name][order_b])


def test_hostile_input_is_refused_and_changes_nothing() -> None:
    cfg = DynamicTableConfig("t", (2,), max_bytes=10 * 2 * 4 + 8 * 4 + 1, optimizer=RowOptimizer("adagrad"))
    t = DynamicTableShard(cfg)
    t.apply(np.arange(4), np.ones((4, 2), np.float32))
    before = t.digest()
    bad = [
        (["a", "b"], np.ones((2, 2), np.float32), DTypeMismatchError),
        (np.array([1.5, 2.0]), np.ones((2, 2), np.float32), DTypeMismatchError),
        (np.arange(4).reshape(2, 2), np.ones((4, 2), np.float32), ShapeMismatchError),
        (np.arange(3), np.ones((2, 2), np.float32), ShapeMismatchError),
        (np.arange(2), np.ones((2, 3), np.float32), ShapeMismatchError),
        (np.arange(2), np.array([[1, 2], [3, 4]]), DTypeMismatchError),
        (np.arange(2), np.array([[np.nan, 0], [0, 0]], np.float32), InvalidRequestError),
        (np.arange(100, 108), np.ones((8, 2), np.float32), PayloadTooLargeError),
    ]
    for keys, grads, err in bad:
        with pytest.raises(err) as info:
            t.apply(keys, grads)
        assert info.value.code.name in ("INVALID_ARGUMENT", "RESOURCE_EXHAUSTED")
        assert t.digest() == before
    with pytest.raises(DTypeMismatchError):
        t.lookup(["x"])
    other_shard = DynamicTableShard(cfg, 0, 2)
    k = np.arange(20)[shard_of(hash_keys(np.arange(20)), 2) == 1][:1]
    with pytest.raises(InvalidRequestError):
        other_shard.lookup(k)
    with pytest.raises(ConfigurationError):
        DynamicTableConfig("t", (2,), dtype="int32")
    with pytest.raises(ConfigurationError):
        RowOptimizer("rmsprop")


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_changes_since_turn_an_earlier_state_into_the_current_one(key_dtype: str) -> None:
    cfg = DynamicTableConfig("c", (2,), key_dtype=key_dtype, optimizer=RowOptimizer("adagrad", 0.1),
                             admission=AdmissionConfig(min_count=2), eviction=EvictionConfig(capacity=25, ttl_steps=12))
    t = DynamicTableShard(cfg)
    rng = np.random.default_rng(4)

    def keys(n: int) -> object:
        k = (rng.zipf(1.3, size=n) % 90).astype(np.int64)
        return k if key_dtype == "int64" else [f"s{x}" for x in k.tolist()]

    def state() -> dict[object, list[float]]:
        e = t.export()
        return {k: v.tolist() for k, v in zip(e["keys"].tolist(), e["values"])}

    for _ in range(20):
        t.apply(keys(8), rng.standard_normal((8, 2)).astype(np.float32))
    evictions_before = t.stats()["evictions"]
    mark, snapshot = t.step, state()
    for _ in range(30):
        t.apply(keys(8), rng.standard_normal((8, 2)).astype(np.float32))
    assert t.stats()["evictions"] > evictions_before  # the delta has evictions to carry
    changed, rows, evicted = t.changes_since(mark)
    for k in list(evicted):
        snapshot.pop(k, None)  # a key inserted and evicted after the mark was never in the snapshot
    for k, r in zip(list(changed), rows):
        snapshot[k] = r.tolist()
    assert snapshot == state()
    assert len(t.changes_since(t.step)[0]) == 0 and len(t.changes_since(t.step)[2]) == 0


def test_changes_since_refuses_a_step_older_than_its_eviction_log() -> None:
    cfg = DynamicTableConfig("c", (1,), eviction=EvictionConfig(capacity=1))
    t = DynamicTableShard(cfg)
    t.EVICTION_LOG = 3  # type: ignore[misc]
    for k in range(10):
        t.apply(np.array([k]), np.ones((1, 1), np.float32))
    t.changes_since(7)
    with pytest.raises(ConfigurationError):
        t.changes_since(2)
    restored = DynamicTableShard.restore(cfg, [t.export()])
    with pytest.raises(ConfigurationError):
        restored.changes_since(restored.step - 1)
    assert len(restored.changes_since(restored.step)[0]) == 0


# ----------------------------------------------------------------- storage at scale (vectorised shard)
def _grads(n: int, dim: int = 2, value: float = 1.0) -> np.ndarray:
    return np.full((n, dim), value, np.float32)


def test_growth_through_many_doublings_keeps_every_row() -> None:
    """40k keys in uneven batches: the columns double 12 times and the hash index is rebuilt many
    times; every row is still found, equal to its initializer minus the pushes it received."""
    cfg = DynamicTableConfig("g", (2,), optimizer=RowOptimizer("sgd", learning_rate=0.5), seed=3)
    t = DynamicTableShard(cfg)
    rng = np.random.default_rng(0)
    keys = rng.permutation(np.arange(-20_000, 20_000, dtype=np.int64) * 7919)
    at = 0
    while at < keys.size:
        n = int(rng.integers(1, 3000))
        batch = keys[at:at + n]
        again = keys[rng.integers(0, min(at + n, keys.size), size=n // 3)]  # some seen before (maybe this batch)
        t.apply(np.concatenate([batch, again]), _grads(batch.size + again.size))
        at += n
    assert len(t) == keys.size == t.stats()["inserts"]
    assert t._rows.capacity >= keys.size and t._rows.index.size >= 2 * keys.size * 0.7
    exp = t.export()
    assert sorted(exp["keys"].tolist()) == sorted(keys.tolist())
    vals, admitted = t.lookup(keys)
    assert admitted.all()
    init = initial_rows(cfg, hash_keys(keys))
    pushed = dict(zip(exp["keys"].tolist(), exp["freq"].tolist()))
    for k, v, r in zip(keys.tolist()[::97], vals[::97], init[::97]):
        np.testing.assert_allclose(v, r - 0.5 * pushed[k], rtol=1e-5, atol=1e-5)
    absent = np.arange(1, 5000, dtype=np.int64) * 7919 + 1
    np.testing.assert_array_equal(t.lookup(absent)[0], initial_rows(cfg, hash_keys(absent)))
    assert len(t) == keys.size  # lookups never insert


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_eviction_under_growth_matches_a_plain_reference(policy: str) -> None:
    """Capacity and TTL eviction while the table grows past its capacity again and again (freed
    slots reused, tombstones in the index): kept keys, order, counts as a dict-based reference."""
    cap, ttl = 1500, 40
    cfg = DynamicTableConfig("e", (1,), optimizer=RowOptimizer("sgd", 0.1),
                             eviction=EvictionConfig(capacity=cap, policy=policy, ttl_steps=ttl))
    t = DynamicTableShard(cfg)
    order: dict[int, None] = {}  # recency, least recent first
    last: dict[int, int] = {}
    freq: dict[int, int] = {}
    ev_ttl = ev_cap = 0
    rng = np.random.default_rng(1)
    for step in range(1, 121):
        fresh = rng.integers(0, 1 << 40, size=int(rng.integers(50, 400)))
        hot = rng.zipf(1.5, size=100) % 3000
        keys = np.concatenate([fresh, hot]).astype(np.int64)
        t.apply(keys, np.zeros((keys.size, 1), np.float32))
        for k in dict.fromkeys(keys.tolist()):
            order.pop(k, None)
            order[k] = None
            last[k] = step
            freq[k] = freq.get(k, 0) + int((keys == k).sum())
        for k in [k for k in order if last[k] < step - ttl]:
            del order[k], last[k], freq[k]
            ev_ttl += 1
        over = len(order) - cap
        if over > 0:
            if policy == "lru":
                victims = list(order)[:over]
            else:
                ks = np.asarray(list(order), dtype=np.int64)
                victims = ks[np.lexsort((hash_keys(ks), [last[k] for k in ks.tolist()],
                                         [freq[k] for k in ks.tolist()]))][:over].tolist()
            for k in victims:
                del order[k], last[k], freq[k]
            ev_cap += over
    exp = t.export()
    assert exp["keys"].tolist() == list(order)
    assert exp["freq"].tolist() == [freq[k] for k in order] and exp["last"].tolist() == [last[k] for k in order]
    s = t.stats()
    assert (s["rows"], s["evictions_ttl"], s["evictions_capacity"]) == (len(order), ev_ttl, ev_cap)
    assert ev_cap > 10 * cap  # the table went past its capacity many times over
    assert t._rows.hi <= cap + 500  # freed slots are reused: storage stays bounded
    assert DynamicTableShard.copy_of(cfg, exp).digest() == t.digest()


def test_hash_collisions_long_probe_chains_and_tombstones() -> None:
    """Keys whose hashes all start probing at the same index position: long linear-probing chains,
    several keys of one push contending for one free position, removals (tombstones) in the middle
    of a chain and their reuse; every key still maps to its own row."""
    size = 1 << 12
    cand = np.arange(4_000_000, dtype=np.int64)
    same = cand[(hash_keys(cand) & np.uint64(size - 1)) == 5][:300]
    assert same.size == 300
    cfg = DynamicTableConfig("c", (1,), optimizer=RowOptimizer("sgd", 1.0), initializer="zeros",
                             eviction=EvictionConfig(capacity=200))
    t = DynamicTableShard(cfg)
    t._rows.index.reserve(1500, t._rows.alive, t._rows.cols["ident"], t._rows.capacity)  # size 1 << 12
    assert t._rows.index.size == size
    # One push: all 300 contend for position 5, and the 100 least recent are evicted (tombstones).
    t.apply(same, -np.arange(1, 301, dtype=np.float32).reshape(300, 1))
    assert len(t) == 200 and t._rows.index.tombs == 100
    vals, _ = t.lookup(same[100:])
    np.testing.assert_array_equal(vals[:, 0], np.arange(101, 301, dtype=np.float32))
    # The evicted ones come back into tombstones of the chain; the 50 least recent go.
    t.apply(same[:50], -np.full((50, 1), 1000.0, np.float32))
    vals, _ = t.lookup(same)
    np.testing.assert_array_equal(vals[:50, 0], np.full(50, 1000.0, np.float32))
    np.testing.assert_array_equal(vals[50:150, 0], np.zeros(100, np.float32))  # evicted: initializer
    np.testing.assert_array_equal(vals[150:, 0], np.arange(151, 301, dtype=np.float32))
    index = t._rows.index
    assert (index.live, index.tombs, index.size) == (200, 100, size)  # the 50 inserts reused tombstones
    assert sorted(t.export()["keys"].tolist()) == sorted(same[:50].tolist() + same[150:].tolist())


def test_bounded_pending_keys_forget_the_oldest_first() -> None:
    """``max_pending`` reached within a push: keys are appended in first-occurrence order and the
    least recent is forgotten at each append; a key forgotten earlier in the same push and sighted
    later in it starts again from its new sightings (a dict-based FIFO reference)."""
    cfg = DynamicTableConfig("p", (1,), admission=AdmissionConfig(min_count=3, max_pending=8))
    t = DynamicTableShard(cfg)
    pending: dict[int, int] = {}
    forgotten = inserted = 0
    rng = np.random.default_rng(2)
    for _ in range(60):
        keys = rng.integers(0, 40, size=int(rng.integers(1, 12))).astype(np.int64)
        have = set(t.export()["keys"].tolist())
        count = {k: int((keys == k).sum()) for k in dict.fromkeys(keys.tolist())}
        waiting = [k for k in count if k not in have]
        reach = {k for k in waiting if pending.get(k, 0) + count[k] >= 3}  # planned before any change
        t.apply(keys, np.zeros((keys.size, 1), np.float32))
        for k in waiting:
            if k in reach:
                pending.pop(k, None)
                inserted += 1
                continue
            pending[k] = pending.pop(k, 0) + count[k]
            while len(pending) > 8:
                pending.pop(next(iter(pending)))
                forgotten += 1
        exp = t.export()
        assert dict(zip(exp["pending_keys"].tolist(), exp["pending_counts"].tolist())) == pending
        assert exp["pending_keys"].tolist() == list(pending)  # least recent first
    assert t.stats()["pending_forgotten"] == forgotten > 0 and t.stats()["inserts"] == inserted


def test_slot_numbers_past_int32_widen_the_index_and_the_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The index, the ticks and the recency log hold int32 until slot numbers or log positions need
    more (here: past 300, patched): then int64, with every row and the order unchanged."""
    import jaxdist.ps_server.dynamic_table as dt

    cfg = DynamicTableConfig("w", (2,), optimizer=RowOptimizer("adagrad"), eviction=EvictionConfig(capacity=900))
    narrow, wide = DynamicTableShard(cfg), DynamicTableShard(cfg)
    monkeypatch.setattr(dt, "_INT32_SLOTS", 300)
    rng = np.random.default_rng(5)
    for _ in range(30):
        keys = rng.integers(0, 3000, size=100).astype(np.int64)
        grads = rng.normal(size=(100, 2)).astype(np.float32)
        wide.apply(keys, grads)
        with monkeypatch.context() as m:
            m.setattr(dt, "_INT32_SLOTS", (1 << 31) - 1)
            narrow.apply(keys, grads)
    assert wide._rows._log.dtype == np.int64 and wide._rows.cols["tick"].dtype == np.int64
    assert wide._rows.index._table.dtype == np.int64
    assert narrow._rows._log.dtype == np.int32 and narrow._rows.index._table.dtype == np.int32
    assert wide.digest() == narrow.digest() and wide.stats()["evictions"] > 0
