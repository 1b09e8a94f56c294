"""Change tracking for incremental exports, without sockets: what a push marks, what a cut answers and
keeps, a backup's full sync, concurrent pushes during cuts (nothing missed, nothing twice), keyed
(dynamic) tables through the cut-participant interface, and the reader applying keyed deltas."""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import numpy as np
import optax
import pytest

from jaxdist import serving_export as se
from jaxdist.proto import ps_pb2
from jaxdist.ps_server import save_restore
from jaxdist.ps_server.export_rows import ALL, ChangeTracker, KeyChanges, RowChanges
from jaxdist.ps_server.optimizer import Optimizer, lazy_rows
from jaxdist.ps_server.store import Op, Update, VariableStore

pytestmark = [pytest.mark.timeout(120)]


def _ids(part: Any) -> list[int]:
    return [] if part.ids is None else part.ids.tolist()


def _cut(store: VariableStore, names: list[str], base: tuple[str, int] | None, delta: bool = True) -> tuple[Any, dict[str, Any]]:
    gen, cut = base if base is not None else ("", 0)
    with store.export_cut(names, gen, cut, delta) as (result, parts, _):
        return result, {p.name: p for p in parts}


def _store() -> VariableStore:
    s = VariableStore()
    s.create("lazy", value=np.zeros((10, 2), np.float32), optimizer=Optimizer(lazy_rows(optax.sgd(1.0))))
    s.create("exact", value=np.zeros((10, 2), np.float32), optimizer=Optimizer(optax.sgd(1.0)))
    s.create("plain", value=np.zeros((10, 2), np.float32))
    s.create("scalar", value=np.float32(0))
    return s


def test_what_each_op_marks() -> None:
    s = _store()
    names = ["lazy", "exact", "plain", "scalar"]
    r0, parts = _cut(s, names, None, delta=False)  # the first export: whole
    assert all(p.value is not None for p in parts.values())
    base = (r0.generation, r0.cut)
    g = np.ones((2, 2), np.float32)
    s.apply([Update("lazy", Op.SPARSE_APPLY_GRADIENT, g, np.array([3, 7]))])
    s.apply([Update("plain", Op.SCATTER_ADD, g, np.array([7, 7]))])
    r1, parts = _cut(s, names, base)
    assert _ids(parts["lazy"]) == [3, 7] and _ids(parts["plain"]) == [7]
    np.testing.assert_array_equal(parts["lazy"].rows, s.read("lazy")[[3, 7]])
    assert _ids(parts["exact"]) == [] and _ids(parts["scalar"]) == []  # unchanged: no rows
    # The exact mode's dense rule may move any row: whole. So does a dense gradient, an assign.
    s.apply([Update("exact", Op.SPARSE_APPLY_GRADIENT, g, np.array([1, 2]))])
    s.apply([Update("plain", Op.ASSIGN_ADD, np.ones((10, 2), np.float32))])
    s.apply([Update("scalar", Op.ASSIGN, np.float32(3))])
    r2, parts = _cut(s, names, (r1.generation, r1.cut))
    assert parts["exact"].value is not None and parts["plain"].value is not None and parts["scalar"].value is not None
    assert _ids(parts["lazy"]) == []
    # A duplicate push (same identity) changes nothing and marks nothing.
    s.apply([Update("lazy", Op.SPARSE_APPLY_GRADIENT, g, np.array([5, 6]))], "u1")
    r3, parts = _cut(s, names, (r2.generation, r2.cut))
    assert _ids(parts["lazy"]) == [5, 6]
    s.apply([Update("lazy", Op.SPARSE_APPLY_GRADIENT, g, np.array([5, 6]))], "u1")
    _, parts = _cut(s, names, (r3.generation, r3.cut))
    assert _ids(parts["lazy"]) == []


def test_a_base_may_be_named_again_and_older_or_foreign_bases_are_refused() -> None:
    s = _store()
    r1, _ = _cut(s, ["lazy"], None, delta=False)
    g = np.ones((1, 2), np.float32)
    s.apply([Update("lazy", Op.SPARSE_APPLY_GRADIENT, g, np.array([1]))])
    r2, parts = _cut(s, ["lazy"], (r1.generation, r1.cut))  # export 2 (say it is never published)
    assert _ids(parts["lazy"]) == [1]
    s.apply([Update("lazy", Op.SPARSE_APPLY_GRADIENT, g, np.array([2]))])
    # Export 2 failed: the retry names export 1's cut again and gets the changes of both rounds.
    r3, parts = _cut(s, ["lazy"], (r1.generation, r1.cut))
    assert _ids(parts["lazy"]) == [1, 2] and r3.cut == r2.cut + 1
    # Export 2's cut was merged away: naming it is refused, as is another generation's, and nothing changes.
    for base in [(r2.generation, r2.cut), ("f" * 32, r3.cut), (r3.generation, r3.cut + 5)]:
        bad, parts = _cut(s, ["lazy"], base)
        assert not bad.available and parts == {}
    s.apply([Update("lazy", Op.SPARSE_APPLY_GRADIENT, g, np.array([4]))])
    _, parts = _cut(s, ["lazy"], (r3.generation, r3.cut))
    assert _ids(parts["lazy"]) == [4]


def test_a_full_sync_starts_a_new_generation_and_new_variables_are_whole() -> None:
    s = _store()
    r1, _ = _cut(s, ["lazy"], None, delta=False)
    s.create("late", value=np.zeros((4, 2), np.float32))
    _, parts = _cut(s, ["lazy", "late"], (r1.generation, r1.cut))
    assert parts["late"].value is not None and _ids(parts["lazy"]) == []
    backup = VariableStore()
    with s.frozen() as snap:
        backup.replace_all([(n, v, s.optimizer_of(n), st, ver) for n, v, st, ver in snap], s.applied_ids())
    gen_before = backup.changes.generation
    with s.frozen() as snap:
        backup.replace_all([(n, v, s.optimizer_of(n), st, ver) for n, v, st, ver in snap], s.applied_ids())
    assert backup.changes.generation != gen_before  # every full sync: a delta of the old history is refused
    bad, _ = _cut(backup, ["lazy"], (gen_before, backup.changes.cut_number))
    assert not bad.available


def test_concurrent_pushes_are_in_exactly_one_export() -> None:
    """Pushes of +1 to random rows while exports cut: the rows' sums over the deltas equal the final table."""
    s = VariableStore()
    s.create("t", value=np.zeros((200, 1), np.float64))
    r, _ = _cut(s, ["t"], None, delta=False)
    base = (r.generation, r.cut)
    state = np.zeros((200, 1))
    stop = threading.Event()
    errors: list[BaseException] = []

    def pusher(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            while not stop.is_set():
                s.apply([Update("t", Op.SCATTER_ADD, np.ones((3, 1)), rng.integers(0, 200, 3))])
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=pusher, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(30):
            res, parts = _cut(s, ["t"], base)
            assert res.available
            state[parts["t"].ids] = parts["t"].rows
            base = (res.generation, res.cut)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    _, parts = _cut(s, ["t"], base)
    state[parts["t"].ids] = parts["t"].rows
    np.testing.assert_array_equal(state, s.read("t"))


class FakeKeyedTable:
    """A keyed table as a dynamic table would plug in: marks its changes under its lock."""

    def __init__(self, name: str, changes: KeyChanges) -> None:
        self.name, self.changes, self.lock = name, changes, threading.Lock()
        self.rows: dict[int, np.ndarray] = {}

    def push(self, keys: list[int], value: float) -> None:
        with self.lock:
            for k in keys:
                self.rows[k] = np.full(3, value, np.float32)
            self.changes.mark_updated(keys)

    def evict(self, keys: list[int]) -> None:
        with self.lock:
            for k in keys:
                self.rows.pop(k, None)
            self.changes.mark_evicted(keys)

    def gather(self, keys: set[Any] | None) -> tuple[np.ndarray, np.ndarray]:
        ks = sorted(self.rows if keys is None else (k for k in keys if k in self.rows))
        return np.asarray(ks, np.int64), np.asarray([self.rows[k] for k in ks], np.float32).reshape(len(ks), 3)


def _export_dir(tmp: Any, store: VariableStore, tables: list[FakeKeyedTable], seq: int, prev: dict[str, Any] | None) -> dict[str, Any]:
    """What IncrementalExporter writes, for one PS and its keyed tables: a published export directory."""
    kind = "full" if prev is None else "delta"
    name = f"{seq:08d}-{kind}"
    d = os.path.join(tmp, name)
    req = ps_pb2.ExportRequest(directory=d, file_name="ps-0.npz", delta=prev is not None)
    if prev is not None:
        req.base_generation, req.base_cut = prev["ps"][0]["generation"], prev["ps"][0]["cut"]
    r = save_restore.export(store, req, tables)
    assert not r.delta_unavailable
    m = {"format": se.FORMAT, "name": name, "kind": kind, "sequence": seq, "chain": "c1",
         "base": prev["base"] if prev else name, "previous": prev["name"] if prev else None,
         "previous_sequence": prev["sequence"] if prev else None, "files": {"ps-0.npz": {"sha256": r.sha256, "bytes": r.bytes}},
         "variables": {}, "ps": [{"generation": r.generation, "cut": r.cut}],
         "tables": {t: {"shards": [{"file": "ps-0.npz", "keys": f"keys/{t}", "values": f"rows/{t}", "evicted": f"evicted/{t}"}]}
                    for t in r.tables}}
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(m, f)
    return m


def test_keyed_tables_plug_into_the_cut_and_their_deltas_apply(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = VariableStore()
    table = FakeKeyedTable("dyn", store.changes.new_keys())
    table.push([1, 2, 3], 1.0)
    m = _export_dir(str(tmp_path), store, [table], 1, None)
    state = se.load_export(str(tmp_path / m["name"]))
    assert state.tables["dyn"].keys.tolist() == [1, 2, 3]
    table.push([2, 9], 2.0)
    table.evict([3])
    table.push([3], 5.0)  # evicted, then inserted again: updated
    table.evict([9])      # inserted, then evicted before any export: evicted (absent from the base: no-op)
    table.evict([1])
    m = _export_dir(str(tmp_path), store, [table], 2, m)
    se.apply_delta(state, str(tmp_path / m["name"]))
    assert state.tables["dyn"].keys.tolist() == [2, 3]
    np.testing.assert_array_equal(state.tables["dyn"].values, [[2.0] * 3, [5.0] * 3])
    want_k, want_v = table.gather(None)
    np.testing.assert_array_equal(state.tables["dyn"].keys, want_k)
    np.testing.assert_array_equal(state.tables["dyn"].values, want_v)


def test_segments_unions() -> None:
    r = RowChanges(5, 2)
    assert r.union(0) is ALL and r.segments == [ALL, ALL]
    r.compact(None)
    assert r.union(0) is None
    r.mark_rows(np.array([1]))
    r.compact(0)
    r.mark_rows(np.array([3]))
    assert np.flatnonzero(r.union(0)).tolist() == [1, 3] and np.flatnonzero(r.union(1)).tolist() == [3]
    k = KeyChanges(1)
    k.compact(None)
    k.mark_updated([1, 2])
    k.compact(0)
    k.mark_evicted([2])
    k.mark_updated([7])
    u = k.union(0)
    assert u.updated == {1, 7} and u.evicted == {2}
    t = ChangeTracker()
    res, unions = t.cut("", 0, True, [r])
    assert not res.available and unions is None


def _dyn_cut(store: VariableStore, tables: Any, base: Any, delta: bool) -> tuple[Any, Any]:
    gen, cut = (base.generation, base.cut) if base is not None else ("", 0)
    with store.export_cut([], gen, cut, delta, tables.participants()) as (result, _, keyed):
        return result, keyed


def _apply_keyed(state: dict[Any, np.ndarray], keyed: tuple[np.ndarray, np.ndarray, Any]) -> None:
    keys, values, evicted = keyed
    assert evicted is not None  # changes, not the whole table
    for k in evicted:
        state.pop(k, None)
    for k, v in zip(keys.tolist(), values):
        state[k] = v


@pytest.mark.parametrize("key_dtype", ["int64", "string"])
def test_dynamic_table_changes_under_concurrent_pushes_are_in_exactly_one_cut(key_dtype: str) -> None:
    from jaxdist.ps_server.dynamic_table import AdmissionConfig, DynamicTableConfig, EvictionConfig
    from jaxdist.ps_server.dynamic_tables import DynamicTables

    store = VariableStore()
    tables = DynamicTables(store)
    cfg = DynamicTableConfig("d", (2,), key_dtype=key_dtype, admission=AdmissionConfig(min_count=2),
                             eviction=EvictionConfig(capacity=30, ttl_steps=40))
    tables.create(cfg, 0, 1)
    base, keyed = _dyn_cut(store, tables, None, delta=False)
    assert keyed[0][2] is None and len(keyed[0][0]) == 0  # a full cut: every row (none yet)
    state: dict[Any, np.ndarray] = {}
    stop = threading.Event()
    errors: list[BaseException] = []

    def pusher(seed: int) -> None:
        rng = np.random.default_rng(seed)
        n = 0
        try:
            while not stop.is_set() or n < 30:
                ks = rng.integers(0, 80, size=6)
                keys: Any = ks if key_dtype == "int64" else [f"key-{k}" for k in ks.tolist()]
                tables.push("d", keys, rng.standard_normal((6, 2)).astype(np.float32), f"u{seed}-{n}")
                n += 1
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=pusher, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(15):
            base, keyed = _dyn_cut(store, tables, base, delta=True)
            assert base.available
            _apply_keyed(state, keyed[0])
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors
    base, keyed = _dyn_cut(store, tables, base, delta=True)
    _apply_keyed(state, keyed[0])
    e = tables.get("d").export()
    keys, values = e["keys"].tolist(), e["values"]
    assert sorted(state) == sorted(keys) and len(keys) > 0
    np.testing.assert_array_equal(np.asarray([state[k] for k in keys]), values)
    st = tables.get("d").stats()
    assert st["evictions_capacity"] > 0 and st["admissions_refused"] > 0


def test_a_dynamic_shard_whose_eviction_log_no_longer_reaches_the_base_is_exported_whole() -> None:
    from jaxdist.ps_server.dynamic_table import DynamicTableConfig, EvictionConfig
    from jaxdist.ps_server.dynamic_tables import DynamicTables

    store = VariableStore()
    tables = DynamicTables(store)
    tables.create(DynamicTableConfig("d", (2,), eviction=EvictionConfig(capacity=2)), 0, 1)
    shard = tables.get("d")
    shard.EVICTION_LOG = 3  # this shard's log keeps the latest 3 evictions
    g = np.ones((1, 2), np.float32)
    base, _ = _dyn_cut(store, tables, None, delta=False)
    for k in range(4):  # 2 evictions: the log still reaches the base
        tables.push("d", np.asarray([k]), g, f"a{k}")
    base, keyed = _dyn_cut(store, tables, base, delta=True)
    assert keyed[0][0].tolist() == [2, 3] and keyed[0][2] == [0, 1]
    for k in range(4, 10):  # 6 evictions: the oldest are forgotten
        tables.push("d", np.asarray([k]), g, f"a{k}")
    result, keyed = _dyn_cut(store, tables, base, delta=True)
    assert result.available and keyed[0][2] is None  # whole: the exporter writes a full export
    assert keyed[0][0].tolist() == [8, 9]
    # Replaced whole (a restore): whole again in the next delta, then changes again.
    tables.install([type(shard).restore(shard.config, [shard.export()])])
    result, keyed = _dyn_cut(store, tables, result, delta=True)
    assert keyed[0][2] is None
    tables.push("d", np.asarray([11]), g, "b")
    _, keyed = _dyn_cut(store, tables, result, delta=True)
    assert keyed[0][0].tolist() == [11] and keyed[0][2] == [8]
