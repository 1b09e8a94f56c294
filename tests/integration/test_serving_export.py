"""Incremental exports for serving on in-process PS services: deltas applied to the first full export
equal the latest full export exactly; a PS whose tracking restarted forces a full export; failed
exports publish nothing and lose nothing; hostile or mismatched deltas raise typed errors."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any

import numpy as np
import optax
import pytest

import jaxdist
from jaxdist import serving_export as se
from jaxdist.base.errors import InvalidRequestError, VariableNotFoundError
from jaxdist.proto import ps_pb2
from jaxdist.testing import InProcessCluster, poll_for

pytestmark = [pytest.mark.timeout(180)]

ROWS, DIM = 40, 4


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    with InProcessCluster(num_workers=1, num_ps=2) as c:
        yield c


@pytest.fixture
def made(cluster):  # type: ignore[no-untyped-def]
    """``made(suffix)``: :func:`_make` on the cluster; the strategies are closed after the test."""
    strategies = []

    def make(suffix: str):  # type: ignore[no-untyped-def]
        s, v = _make(cluster, suffix)
        strategies.append(s)
        return s, v

    yield make
    for s in strategies:
        s.close()


def _make(cluster, suffix: str):  # type: ignore[no-untyped-def]
    """A sharded lazy-Adam table, a sharded SGD table (exact mode), a dense kernel (Adam), a scalar and
    a table only scattered into (no optimizer)."""
    s = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2))
    rng = np.random.default_rng(0)
    with s.scope():
        lazy = jaxdist.create_variables({"emb": rng.standard_normal((ROWS, DIM)).astype(np.float32)},
                                        name=f"lazy{suffix}", optimizer=jaxdist.lazy_rows(optax.adam(0.05)), if_exists="replace")
        exact = jaxdist.create_variables({"emb": rng.standard_normal((ROWS, DIM)).astype(np.float32)},
                                         name=f"exact{suffix}", optimizer=optax.sgd(0.1), if_exists="replace")
        dense = jaxdist.create_variables({"w": rng.standard_normal((DIM, 3)).astype(np.float32), "scale": np.float32(1.0)},
                                         name=f"dense{suffix}", optimizer=optax.adam(0.01), if_exists="replace")
        counts = jaxdist.create_variables({"c": np.zeros((ROWS, 2), np.int32)}, name=f"counts{suffix}", if_exists="replace")
    return s, {"lazy": lazy["emb"], "exact": exact["emb"], "dense": dense, "counts": counts["c"]}


def _train(v, rng, steps: int = 3, dense: bool = True) -> None:  # type: ignore[no-untyped-def]
    for _ in range(steps):
        ids = rng.integers(0, ROWS, size=6)
        v["lazy"].apply_sparse_gradient(ids, rng.standard_normal((6, DIM)).astype(np.float32))
        v["exact"].apply_sparse_gradient(ids[:3], rng.standard_normal((3, DIM)).astype(np.float32))
        v["counts"].scatter_add(ids, np.ones((6, 2), np.int32))
        if dense:
            jaxdist.apply_gradients(v["dense"], {"w": rng.standard_normal((DIM, 3)).astype(np.float32), "scale": np.float32(0.5)})


def _pulled(s) -> dict[str, np.ndarray]:  # type: ignore[no-untyped-def]
    return {name: np.asarray(var.numpy()) for name, var in s.variables.items()}


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_deltas_applied_to_the_first_full_export_give_the_latest_full_export(cluster, made, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s, v = made("_chain")
    rng = np.random.default_rng(1)
    _train(v, rng)
    ex = se.IncrementalExporter(s, str(tmp_path / "exports"))
    first = ex.export(step=3)
    assert (first.kind, first.reason, first.sequence) == ("full", "first", 1)
    state = se.load_export(first.path)
    _assert_same(state.variables, _pulled(s))

    seen = []
    for k in range(3):
        _train(v, rng, steps=2, dense=k != 1)  # export 3 follows pushes to the tables only
        d = ex.export(step=5 + 2 * k)
        assert d.kind == "delta" and d.previous == seen[-1].name if seen else first.name
        seen.append(d)
        se.apply_delta(state, d.path)
        _assert_same(state.variables, _pulled(s))  # every delta leaves the state equal to the PS's
    assert state.sequence == 4 and state.step == 9

    # The lazy table and the scattered one travel as rows (at most the 2 x 6 ids pushed since the
    # previous export), the exact-mode table and the dense weights whole.
    m = json.loads((tmp_path / "exports" / seen[-1].name / "manifest.json").read_text())
    lazy_name = next(n for n in m["variables"] if n.startswith("lazy_chain"))
    assert all(not sh["whole"] for sh in m["variables"][lazy_name]["shards"])
    assert 0 < seen[-1].changed_rows[lazy_name] <= 12
    exact_name = next(n for n in m["variables"] if n.startswith("exact_chain"))
    assert all(sh["whole"] for sh in m["variables"][exact_name]["shards"])
    # Export 3 had no dense push since export 2: the dense kernel's delta is empty, not whole.
    m3 = json.loads((tmp_path / "exports" / seen[1].name / "manifest.json").read_text())
    w = next(n for n in m3["variables"] if n.endswith("/w"))
    assert m3["variables"][w]["shards"][0]["rows"] == 0 and not m3["variables"][w]["shards"][0]["whole"]

    last_full = ex.export(full=True)
    assert (last_full.kind, last_full.reason) == ("full", "asked")
    _assert_same(state.variables, se.load_export(last_full.path).variables)
    # load_latest follows the newest chain (the last full export, no deltas after it yet).
    assert se.load_latest(str(tmp_path / "exports")).name == last_full.name
    # A delta after it continues the new chain.
    _train(v, rng, steps=1)
    d5 = ex.export()
    assert d5.kind == "delta" and d5.base == last_full.name
    _assert_same(se.load_latest(str(tmp_path / "exports")).variables, _pulled(s))


def test_exporter_continues_from_the_directory_and_a_restarted_tracker_forces_a_full_export(cluster, made, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s, v = made("_restart")
    rng = np.random.default_rng(2)
    d = str(tmp_path / "exports")
    se.IncrementalExporter(s, d).export()
    _train(v, rng)
    # A new exporter (a restarted coordinator) continues the chain: a delta.
    ex = se.IncrementalExporter(s, d)
    assert ex.export().kind == "delta"
    _train(v, rng)
    # ps:1's tracking starts over (what a restarted PS or a promoted backup has): never a partial delta.
    cluster.ps(1).store.changes.restart()
    info = ex.export()
    assert info.kind == "full" and info.reason.startswith("ps:1 cannot answer a delta"), info
    _assert_same(se.load_latest(d).variables, _pulled(s))
    _train(v, rng)
    assert ex.export().kind == "delta"
    _assert_same(se.load_latest(d).variables, _pulled(s))


def test_a_failed_export_publishes_nothing_and_loses_no_change(cluster, made, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    s, v = made("_fail")
    rng = np.random.default_rng(3)
    d = str(tmp_path / "exports")
    ex = se.IncrementalExporter(s, d)
    ex.export()
    _train(v, rng)

    # The PS tasks cut and wrote their files, then writing the manifest failed: nothing is published.
    def boom(*a, **k):  # type: ignore[no-untyped-def]
        raise OSError("disk full")

    monkeypatch.setattr(se, "AtomicFile", boom)
    with pytest.raises(OSError, match="disk full"):
        ex.export()
    monkeypatch.undo()
    assert [e.sequence for e in se.list_exports(d)] == [1]
    assert not [n for n in os.listdir(d) if ".tmp-" in n]  # the unpublished directory is removed
    _train(v, rng)
    # The next delta is relative to export 1 again and holds the changes of both rounds.
    d2 = ex.export()
    assert d2.kind == "delta" and d2.sequence == 2 and d2.previous == "00000001-full"
    _assert_same(se.load_latest(d).variables, _pulled(s))


def test_mismatched_and_hostile_deltas_raise_typed_errors(cluster, made, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s, v = made("_hostile")
    rng = np.random.default_rng(4)
    d = tmp_path / "exports"
    ex = se.IncrementalExporter(s, str(d))
    full1 = ex.export()
    _train(v, rng)
    d2 = ex.export()
    _train(v, rng)
    d3 = ex.export()
    state = se.load_export(full1.path)
    before = {k: a.copy() for k, a in state.variables.items()}

    with pytest.raises(se.ExportChainError, match="apply the deltas in order"):
        se.apply_delta(state, d3.path)  # skips d2
    with pytest.raises(se.ExportChainError, match="is a full export"):
        se.apply_delta(state, full1.path)
    with pytest.raises(se.ExportChainError, match="is a delta"):
        se.load_export(d2.path)
    other = se.IncrementalExporter(s, str(tmp_path / "other"))
    other.export()
    _train(v, rng)
    with pytest.raises(se.ExportChainError, match="chain"):
        se.apply_delta(state, other.export().path)  # a delta of another chain
    _assert_same(state.variables, before)  # nothing applied by the refusals

    def tampered(edit) -> str:  # type: ignore[no-untyped-def]
        """A copy of d2 with its manifest or a file changed by ``edit(directory)``."""
        t = tmp_path / f"t{len(os.listdir(tmp_path))}" / d2.name
        shutil.copytree(d2.path, t)
        edit(t)
        return str(t)

    def manifest_edit(fn):  # type: ignore[no-untyped-def]
        def edit(t):  # type: ignore[no-untyped-def]
            m = json.loads((t / "manifest.json").read_text())
            fn(m)
            (t / "manifest.json").write_text(json.dumps(m))
        return edit

    lazy = next(n for n in state.variables if n.startswith("lazy_hostile"))

    def corrupt(t):  # type: ignore[no-untyped-def]
        p = t / "ps-0.npz"
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0xFF
        p.write_bytes(bytes(b))

    def rows_out_of_range(m):  # type: ignore[no-untyped-def]
        m["variables"][lazy]["shards"][0]["shard_rows"] = 1  # the ids now fall outside the shard

    def other_file(m):  # type: ignore[no-untyped-def]
        m["variables"][lazy]["shards"][0]["file"] = "../../etc/passwd"

    def wrong_shape(m):  # type: ignore[no-untyped-def]
        m["variables"][lazy]["shape"] = [ROWS, DIM + 1]

    def no_array(m):  # type: ignore[no-untyped-def]
        m["variables"][lazy]["shards"][0]["ids"] = "ids/nothing"

    def wrong_format(m):  # type: ignore[no-untyped-def]
        m["format"] = "something/9"

    def rewritten(change):  # type: ignore[no-untyped-def]
        """An edit that rewrites the lazy table's shard-0 arrays (a consistent sha256: a crafted file)."""
        def edit(t):  # type: ignore[no-untyped-def]
            m = json.loads((t / "manifest.json").read_text())
            sh = m["variables"][lazy]["shards"][0]
            with np.load(t / sh["file"]) as npz:
                arrays = {k: npz[k] for k in npz.files}
            change(arrays, sh)
            np.savez(t / sh["file"], **arrays)
            m["files"][sh["file"]]["sha256"] = hashlib.sha256((t / sh["file"]).read_bytes()).hexdigest()
            (t / "manifest.json").write_text(json.dumps(m))
        return edit

    def negative_ids(arrays, sh):  # type: ignore[no-untyped-def]
        arrays[sh["ids"]] = arrays[sh["ids"]] - 1000

    def unsorted_ids(arrays, sh):  # type: ignore[no-untyped-def]
        ids = arrays[sh["ids"]]
        arrays[sh["ids"]] = np.concatenate([ids[1:], ids[:1]]) if len(ids) > 1 else np.array([3, 3])

    def wider_rows(arrays, sh):  # type: ignore[no-untyped-def]
        arrays[sh["values"]] = np.zeros((len(arrays[sh["ids"]]), DIM + 1), np.float32)

    def float64_rows(arrays, sh):  # type: ignore[no-untyped-def]
        arrays[sh["values"]] = arrays[sh["values"]].astype(np.float64)

    cases = [(corrupt, se.ExportFormatError, "sha256"),
             (rewritten(negative_ids), se.ExportFormatError, "outside"),
             (rewritten(unsorted_ids), se.ExportFormatError, "unsorted|the manifest says"),
             (rewritten(wider_rows), se.ExportFormatError, "rows"),
             (rewritten(float64_rows), se.ExportFormatError, "float64"), (manifest_edit(rows_out_of_range), se.ExportFormatError, "outside"),
             (manifest_edit(other_file), se.ExportFormatError, "does not list"),
             (manifest_edit(wrong_shape), se.ExportChainError, "in the state"),
             (manifest_edit(no_array), se.ExportFormatError, "no array"),
             (manifest_edit(wrong_format), se.ExportFormatError, "not a jaxdist.serving_export/1")]
    for edit, err, match in cases:
        with pytest.raises(err, match=match):
            se.apply_delta(state, tampered(edit))
        _assert_same(state.variables, before)
    with pytest.raises(se.ExportFormatError, match="no manifest.json"):
        se.apply_delta(state, str(tmp_path))
    se.apply_delta(state, d2.path)  # the real one still applies
    se.apply_delta(state, d3.path)
    assert state.sequence == 3


def test_export_rpc_refuses_bad_requests_and_changes_nothing(cluster, made, tmp_path) -> None:  # type: ignore[no-untyped-def]
    s, v = made("_rpc")
    shard = v["lazy"].shards()[0][0]
    client = s.connections.clients[shard.ps_index]
    ok = dict(directory=str(tmp_path / "x"), file_name="a.npz", variables=[ps_pb2.ExportVariable(name=shard.name)])
    bad = [
        dict(ok, file_name="../a.npz"), dict(ok, file_name=""), dict(ok, directory=""),
        dict(ok, variables=[ps_pb2.ExportVariable(name=shard.name)] * 2), dict(ok, variables=[ps_pb2.ExportVariable(name="")]),
        dict(ok, variables=[ps_pb2.ExportVariable(name=shard.name, row_offset=-1)]), dict(ok, delta=True),
        dict(ok, base_cut=-3),
    ]
    gen = client.export(ps_pb2.ExportRequest(**ok))  # a full export: the base of the check below
    for b in bad:
        with pytest.raises(InvalidRequestError):
            client.export(ps_pb2.ExportRequest(**b))
    with pytest.raises(VariableNotFoundError):
        client.export(ps_pb2.ExportRequest(**dict(ok, file_name="b.npz", variables=[ps_pb2.ExportVariable(name="nope")])))
    assert sorted(os.listdir(tmp_path / "x")) == ["a.npz"]
    # None of the refusals made a cut: a delta relative to the full export above still answers.
    r = client.export(ps_pb2.ExportRequest(**dict(ok, file_name="c.npz", delta=True, base_generation=gen.generation,
                                                  base_cut=gen.cut)))
    assert not r.delta_unavailable and r.cut == gen.cut + 1
    # Another generation's base is refused as unavailable (never answered), nothing written.
    r2 = client.export(ps_pb2.ExportRequest(**dict(ok, file_name="d.npz", delta=True, base_generation="0" * 32, base_cut=1)))
    assert r2.delta_unavailable and not os.path.exists(tmp_path / "x" / "d.npz")


def test_a_failover_to_the_backup_between_exports_forces_a_full_export(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The promoted backup holds every acknowledged push, but its change tracking began at its full
    sync, not at the previous export's cut on the old primary: the next export is a full one."""
    with InProcessCluster(num_workers=1, num_ps=1, ps_backups=True) as cluster:
        s = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        replicas = s.replicas
        assert replicas is not None
        with s.scope():
            t = jaxdist.create_variable(np.zeros((ROWS, DIM), np.float32), name="t")
        with jaxdist.ClusterCoordinator(s) as coord:
            poll_for(lambda: replicas.status(0)[1], 30, what="the backup attached")
            d = str(tmp_path / "exports")
            ex = se.IncrementalExporter(s, d)
            ex.export()
            t.scatter_add([1, 2], np.ones((2, DIM), np.float32))
            assert ex.export().kind == "delta"
            t.scatter_add([3], np.ones((1, DIM), np.float32))
            cluster.stop_task("ps:0")
            coord.schedule(lambda: t.scatter_add([5], np.ones((1, DIM), np.float32)) and None)
            poll_for(lambda: replicas.failovers == 1, 30, what="the failover")
            coord.join()
            info = ex.export()
            assert info.kind == "full" and info.reason.startswith("ps:0 cannot answer a delta"), info
            want = np.zeros((ROWS, DIM), np.float32)
            want[[1, 2, 3, 5]] = 1
            np.testing.assert_array_equal(se.load_latest(d).variables["t"], want)
            t.scatter_add([7], np.ones((1, DIM), np.float32))
            assert ex.export().kind == "delta"  # the new primary's chain goes on
            want[7] = 1
            np.testing.assert_array_equal(se.load_latest(d).variables["t"], want)


JUNK: list[object] = [None, "x", -1, 10**30, [], {}, [1, "a"], {"a": 1}, 1.5, True]


def test_every_manifest_field_made_junk_raises_an_export_error_or_applies(cluster, made, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Each field of a delta's manifest (top level, a variable, a shard) replaced by junk values: the
    delta applies (a field the reader does not need) or raises ExportError, and the state is unchanged then."""
    s, v = made("_junk")
    rng = np.random.default_rng(6)
    ex = se.IncrementalExporter(s, str(tmp_path / "exports"), full_every=2)
    full = ex.export()
    _train(v, rng)
    delta = ex.export()
    _train(v, rng)
    assert ex.export().kind == "full"  # full_every=2: a full export, then one delta
    good = json.loads((tmp_path / "exports" / delta.name / "manifest.json").read_text())
    lazy = next(n for n in good["variables"] if n.startswith("lazy_junk"))
    w = next(n for n in good["variables"] if n.endswith("/w"))
    where: list[tuple[Any, ...]] = [(k,) for k in good] + [("variables", lazy, k) for k in good["variables"][lazy]]
    where += [("variables", lazy, "shards", 0, k) for k in good["variables"][lazy]["shards"][0]]
    where += [("variables", w, "shards", 0, k) for k in good["variables"][w]["shards"][0]]
    t = tmp_path / "junk" / delta.name
    shutil.copytree(delta.path, t)
    base = se.load_export(full.path)
    applied = 0
    for path in where:
        for junk in JUNK:
            m = json.loads(json.dumps(good))
            node = m
            for p in path[:-1]:
                node = node[p]
            node[path[-1]] = junk
            (t / "manifest.json").write_text(json.dumps(m))
            state = se.ExportState(base.name, base.sequence, base.chain, {k: a.copy() for k, a in base.variables.items()})
            try:
                se.apply_delta(state, str(t))
                applied += 1
            except se.ExportError:
                _assert_same(state.variables, base.variables)
    assert 0 < applied < len(where) * len(JUNK)
