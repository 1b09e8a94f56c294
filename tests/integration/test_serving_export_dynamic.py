"""Incremental exports of dynamic tables (jaxdist.DynamicEmbedding) on in-process PS services: the
deltas (keys inserted or pushed since the previous export with their rows, keys evicted since),
applied to the first full export, equal the PS tasks' tables and the latest full export exactly,
through inserts, updates, admission and evictions by capacity (LRU, LFU) and time-to-live; a table
restored or created since the previous export forces a full export; hostile or truncated table
files raise typed errors and change nothing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np
import pytest

import jaxdist
from jaxdist import serving_export as se
from jaxdist.testing import InProcessCluster, poll_for

pytestmark = [pytest.mark.timeout(240)]

DIM = 3


def _keys(rng: np.random.Generator, n: int, string: bool) -> Any:
    if not string:
        return rng.integers(0, 60, size=n).astype(np.int64)
    ks = (rng.zipf(1.4, size=n) % 150).astype(np.int64)
    return np.asarray([f"user-{k}" for k in ks.tolist()], dtype=object)


def _push(table: jaxdist.DynamicEmbedding, rng: np.random.Generator, batches: int, string: bool) -> None:
    for _ in range(batches):
        ks = _keys(rng, 8, string)
        table.apply_gradients(ks, rng.standard_normal((len(ks), DIM)).astype(np.float32))


def _truth(cluster: InProcessCluster, name: str, num_ps: int) -> tuple[np.ndarray, np.ndarray]:
    """The table's rows on the PS tasks, keys ascending."""
    parts = [(e["keys"], e["values"]) for e in (cluster.ps(i).servicer.dynamic.get(name).export() for i in range(num_ps))]
    keys = np.concatenate([k for k, _ in parts])
    if keys.dtype == object:
        keys = np.asarray(keys.tolist(), dtype=str)
    order = np.argsort(keys, kind="stable")
    return keys[order], np.concatenate([v for _, v in parts])[order]


def _assert_rows(got: se.KeyedRows, want: tuple[np.ndarray, np.ndarray]) -> None:
    assert got.keys.tolist() == want[0].tolist()
    assert got.values.dtype == want[1].dtype
    np.testing.assert_array_equal(got.values, want[1])


def _shard_stats(cluster: InProcessCluster, name: str, num_ps: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for i in range(num_ps):
        for k, v in cluster.ps(i).servicer.dynamic.get(name).stats().items():
            out[k] = out.get(k, 0) + v
    return out


def test_deltas_applied_to_the_first_full_export_give_the_tables_and_the_latest_full_export(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        s = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with s.scope():
            ids = jaxdist.DynamicEmbedding(DIM, name="ids", min_count=2, capacity=8, eviction_policy="lru",
                                           optimizer="adagrad", learning_rate=0.1)
            users = jaxdist.DynamicEmbedding(DIM, name="users", key_dtype="string", admit_probability=0.7,
                                             capacity=4, eviction_policy="lfu", ttl_steps=6, optimizer="lazy_adam",
                                             learning_rate=0.05, seed=3)
            dense = jaxdist.create_variable(np.zeros((4, DIM), np.float32), name="dense")
        tables = {"ids": (ids, False), "users": (users, True)}
        rng = np.random.default_rng(7)
        for t, string in tables.values():
            _push(t, rng, 3, string)
        ex = se.IncrementalExporter(s, str(tmp_path / "exports"))
        first = ex.export()
        assert first.kind == "full"
        state = se.load_export(first.path)
        assert sorted(state.tables) == ["ids", "users"]
        for name in tables:
            _assert_rows(state.tables[name], _truth(cluster, name, 2))
        assert state.tables["users"].keys.dtype.kind == "U"  # numpy strings: no pickle to read them

        evicted_seen = {name: 0 for name in tables}
        smaller = {name: False for name in tables}
        for k in range(5):
            for t, string in tables.values():
                _push(t, rng, 3, string)
            if k == 2:
                dense.assign_add(np.ones((4, DIM), np.float32))
            d = ex.export()
            assert d.kind == "delta", d.reason
            m = json.loads((tmp_path / "exports" / d.name / "manifest.json").read_text())
            for name in tables:
                for sh in m["tables"][name]["shards"]:
                    with np.load(os.path.join(d.path, sh["file"])) as npz:
                        evicted_seen[name] += len(npz[sh["evicted"]])
                        n_keys = len(npz[sh["keys"]])
                    smaller[name] |= n_keys < len(state.tables[name].keys)
            se.apply_delta(state, d.path)
            for name in tables:
                _assert_rows(state.tables[name], _truth(cluster, name, 2))
            np.testing.assert_array_equal(state.variables["dense"], dense.numpy())

        # The run went through admission refusals, capacity evictions (LRU and LFU) and TTL evictions,
        # and the deltas carried evicted keys and fewer keys than the table holds.
        st_ids, st_users = _shard_stats(cluster, "ids", 2), _shard_stats(cluster, "users", 2)
        assert st_ids["admissions_refused"] > 0 and st_ids["evictions_capacity"] > 0
        assert st_users["admissions_refused"] > 0 and st_users["evictions_capacity"] > 0 and st_users["evictions_ttl"] > 0
        assert all(evicted_seen.values()) and all(smaller.values()), (evicted_seen, smaller)

        last = ex.export(full=True)
        full_state = se.load_export(last.path)
        for name in tables:
            _assert_rows(state.tables[name], (full_state.tables[name].keys, full_state.tables[name].values))
        for t, string in tables.values():
            _push(t, rng, 2, string)
        assert ex.export().kind == "delta"
        latest = se.load_latest(str(tmp_path / "exports"))
        for name in tables:
            _assert_rows(latest.tables[name], _truth(cluster, name, 2))
        s.close()


def test_a_restored_or_new_table_forces_a_full_export(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        s = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with s.scope():
            t = jaxdist.DynamicEmbedding(DIM, name="t", capacity=10)
        rng = np.random.default_rng(1)
        _push(t, rng, 3, False)
        ckpt = jaxdist.Checkpoint(s).write(str(tmp_path / "ckpt"))
        ex = se.IncrementalExporter(s, str(tmp_path / "exports"))
        ex.export()
        _push(t, rng, 2, False)
        assert ex.export().kind == "delta"
        jaxdist.Checkpoint(s).restore(ckpt)  # the shards replaced whole: a delta cannot say what they lost
        info = ex.export()
        assert info.kind == "full" and "'t' changed as a whole" in info.reason
        _assert_rows(se.load_export(info.path).tables["t"], _truth(cluster, "t", 2))
        _push(t, rng, 2, False)
        assert ex.export().kind == "delta"
        with s.scope():
            jaxdist.DynamicEmbedding(DIM, name="t2")
        info = ex.export()
        assert info.kind == "full" and "'t2'" in info.reason
        assert sorted(se.load_latest(str(tmp_path / "exports")).tables) == ["t", "t2"]
        s.close()


def test_hostile_or_truncated_table_files_raise_typed_errors_and_change_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        s = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with s.scope():
            t = jaxdist.DynamicEmbedding(DIM, name="t", capacity=8)
            u = jaxdist.DynamicEmbedding(DIM, name="u", key_dtype="string", capacity=8)
        rng = np.random.default_rng(2)
        _push(t, rng, 2, False)
        _push(u, rng, 2, True)
        ex = se.IncrementalExporter(s, str(tmp_path / "exports"))
        full = ex.export()
        _push(t, rng, 3, False)
        _push(u, rng, 3, True)
        d2 = ex.export()
        assert d2.kind == "delta"
        state = se.load_export(full.path)
        before = {n: (r.keys.copy(), r.values.copy()) for n, r in state.tables.items()}

        def tampered(src: str, edit) -> str:  # type: ignore[no-untyped-def]
            out = tmp_path / f"t{len(os.listdir(tmp_path))}" / os.path.basename(src)
            shutil.copytree(src, out)
            edit(out)
            return str(out)

        def rewritten(table: str, change):  # type: ignore[no-untyped-def]
            """Rewrite the table's arrays, with a consistent sha256 (a crafted file, not a corrupt one)."""
            def edit(d):  # type: ignore[no-untyped-def]
                m = json.loads((d / "manifest.json").read_text())
                sh = m["tables"][table]["shards"][0]
                with np.load(d / sh["file"]) as npz:
                    arrays = {k: npz[k] for k in npz.files}
                change(arrays, sh)
                np.savez(d / sh["file"], **arrays)
                m["files"][sh["file"]]["sha256"] = hashlib.sha256((d / sh["file"]).read_bytes()).hexdigest()
                (d / "manifest.json").write_text(json.dumps(m))
            return edit

        def truncated(consistent: bool):  # type: ignore[no-untyped-def]
            def edit(d):  # type: ignore[no-untyped-def]
                p = d / "ps-0.npz"
                p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
                if consistent:
                    m = json.loads((d / "manifest.json").read_text())
                    m["files"]["ps-0.npz"]["sha256"] = hashlib.sha256(p.read_bytes()).hexdigest()
                    (d / "manifest.json").write_text(json.dumps(m))
            return edit

        def float_keys(a, sh):  # type: ignore[no-untyped-def]
            a[sh["keys"]] = a[sh["keys"]].astype(np.float64)

        def fewer_rows(a, sh):  # type: ignore[no-untyped-def]
            a[sh["values"]] = a[sh["values"]][:-1]

        def repeated_key(a, sh):  # type: ignore[no-untyped-def]
            k = a[sh["keys"]]
            a[sh["keys"]] = np.concatenate([k, k[:1]])
            a[sh["values"]] = np.concatenate([a[sh["values"]]] * 2)[: len(k) + 1]

        def no_evicted(a, sh):  # type: ignore[no-untyped-def]
            del a[sh["evicted"]]

        def string_evicted(a, sh):  # type: ignore[no-untyped-def]
            a[sh["evicted"]] = np.asarray(["x"])

        def int_keys_for_strings(a, sh):  # type: ignore[no-untyped-def]
            a[sh["keys"]] = np.arange(len(a[sh["keys"]]), dtype=np.int64)

        def wider_rows(a, sh):  # type: ignore[no-untyped-def]
            a[sh["values"]] = np.zeros((len(a[sh["keys"]]), DIM + 1), np.float32)

        def two_dim_evicted(a, sh):  # type: ignore[no-untyped-def]
            a[sh["evicted"]] = np.zeros((1, 2), np.int64)

        cases = [
            (truncated(False), "sha256"), (truncated(True), "numpy archive|no array|malformed"),
            (rewritten("t", float_keys), "keys float64"), (rewritten("t", fewer_rows), "do not match"),
            (rewritten("t", repeated_key), "twice"), (rewritten("t", no_evicted), "no array"),
            (rewritten("t", string_evicted), "evicted keys"), (rewritten("u", int_keys_for_strings), "keys are int64"),
            (rewritten("t", wider_rows), "rows float32"), (rewritten("t", two_dim_evicted), "evicted keys are"),
        ]
        for edit, match in cases:
            with pytest.raises(se.ExportFormatError, match=match):
                se.apply_delta(state, tampered(d2.path, edit))
            for n, (k, v) in before.items():
                assert state.tables[n].keys.tolist() == k.tolist() and np.array_equal(state.tables[n].values, v)
        for edit, match in cases[:5]:  # the same in a full export
            with pytest.raises(se.ExportFormatError, match=match):
                se.load_export(tampered(full.path, edit))
        se.apply_delta(state, d2.path)  # the real one still applies
        for n in ("t", "u"):
            _assert_rows(state.tables[n], _truth(cluster, n, 1))
        s.close()


def test_a_failover_between_exports_forces_a_full_export_of_the_tables(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The promoted backup's tables hold every acknowledged push, but its change tracking began at its
    full sync: the next export is full, and the deltas after it follow the new primary."""
    with InProcessCluster(num_workers=1, num_ps=1, ps_backups=True) as cluster:
        s = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        replicas = s.replicas
        assert replicas is not None
        with s.scope():
            t = jaxdist.DynamicEmbedding(DIM, name="t", capacity=20, key_dtype="string")
        rng = np.random.default_rng(5)

        def state_matches(state: se.ExportState) -> None:
            keys = state.tables["t"].keys
            assert len(keys) == t.stats()["rows"] > 0
            np.testing.assert_array_equal(t.lookup(np.asarray(keys.tolist(), dtype=object)), state.tables["t"].values)

        with jaxdist.ClusterCoordinator(s) as coord:
            poll_for(lambda: replicas.status(0)[1], 30, what="the backup attached")
            d = str(tmp_path / "exports")
            ex = se.IncrementalExporter(s, d)
            ex.export()
            _push(t, rng, 3, True)
            assert ex.export().kind == "delta"
            _push(t, rng, 3, True)
            cluster.stop_task("ps:0")
            ks = _keys(rng, 8, True)
            coord.schedule(lambda: t.apply_gradients(ks, np.ones((8, DIM), np.float32)) and None)
            poll_for(lambda: replicas.failovers == 1, 30, what="the failover")
            coord.join()
            info = ex.export()
            assert info.kind == "full" and info.reason.startswith("ps:0 cannot answer a delta"), info
            state_matches(se.load_latest(d))
            _push(t, rng, 3, True)
            assert ex.export().kind == "delta"  # the new primary's chain goes on
            state_matches(se.load_latest(d))
        s.close()
