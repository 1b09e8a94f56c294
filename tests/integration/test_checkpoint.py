"""Checkpoints on in-process PS services: round trip, re-sharding, crash safety, quiet points, restore without a cluster."""

from __future__ import annotations

import json
import os
import threading

import jax
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist import checkpoint as ckpt
from jaxdist.testing import InProcessCluster, poll_for

import inprocess_gates as gates

pytestmark = [pytest.mark.timeout(120)]

RNG = np.random.default_rng(0)
TREE = {
    "emb": RNG.standard_normal((13, 4)).astype(np.float32),
    "dense": {"w": RNG.standard_normal((4, 3)).astype(np.float32), "b": np.zeros(3, np.float32)},
    "step_scale": np.float32(2.0),
}


@pytest.fixture(scope="module")
def clusters():  # type: ignore[no-untyped-def]
    with InProcessCluster(num_workers=1, num_ps=2) as two, InProcessCluster(num_workers=1, num_ps=3) as three:
        yield two, three


def _make(cluster, partitioner, init=None):  # type: ignore[no-untyped-def]
    s = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), variable_partitioner=partitioner)
    with s.scope():
        params = jaxdist.create_variables(init if init is not None else TREE, name="m", optimizer=optax.adam(0.1), if_exists="replace")
    _compile_optimizers(params)
    return s, params


def _compile_optimizers(params):  # type: ignore[no-untyped-def]
    """One zero-gradient push per variable, so each PS compiles its optimizer steps one push at a time.

    In-process, every PS compiles in this process, where tracing holds the GIL; a push whose deadline
    covered all the compiles of a PS at once missed it on a heavily loaded machine. (A zero first
    step of adam leaves the parameters as they are; the tests compare states after it.)
    """
    for var in jax.tree.leaves(params):
        jaxdist.apply_gradients(var, np.zeros(var.shape, var.dtype))


def _train(params, steps=3, seed=1):  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        jaxdist.apply_gradients(params, jax.tree.map(lambda x: rng.standard_normal(np.shape(x)).astype(np.float32), TREE))


def test_round_trip_with_optimizer_state(clusters, tmp_path) -> None:  # type: ignore[no-untyped-def]
    two, _ = clusters
    s, params = _make(two, jaxdist.FixedShardsPartitioner(2))
    assert isinstance(params["emb"], jaxdist.ShardedVariable)
    _train(params)
    saved = jaxdist.pull(params)
    c = jaxdist.Checkpoint(s)
    c.step = 3
    c.metadata = {"epoch": 1}
    path = c.write(str(tmp_path / "ckpt-3"))
    assert jaxdist.latest_checkpoint(str(tmp_path)) == path
    _train(params, steps=2, seed=9)  # move away, then restore
    c.restore(path)
    jax.tree.map(np.testing.assert_array_equal, jaxdist.pull(params), saved)
    # Optimizer state came back too: the next steps equal those of an uninterrupted run.
    _train(params, steps=2, seed=5)
    after_restore = jaxdist.pull(params)
    s2, p2 = _make(two, jaxdist.FixedShardsPartitioner(2))
    c2 = jaxdist.Checkpoint(s2)
    c2.restore(path)
    assert c2.step == 3 and c2.metadata == {"epoch": 1}
    _train(p2, steps=2, seed=5)
    jax.tree.map(np.testing.assert_array_equal, jaxdist.pull(p2), after_restore)
    s.close()
    s2.close()


@pytest.mark.parametrize("src, dst", [("2ps-4shards", "3ps-1shard"), ("3ps-1shard", "2ps-4shards"), ("2ps-2shards", "3ps-3shards")])
def test_resharding_on_restore(clusters, tmp_path, src, dst) -> None:  # type: ignore[no-untyped-def]
    two, three = clusters
    layouts = {
        "2ps-4shards": (two, jaxdist.FixedShardsPartitioner(4)),
        "2ps-2shards": (two, jaxdist.FixedShardsPartitioner(2)),
        "3ps-1shard": (three, None),
        "3ps-3shards": (three, jaxdist.FixedShardsPartitioner(3)),
    }
    s, params = _make(*layouts[src])
    _train(params)
    want = jaxdist.pull(params)
    path = jaxdist.Checkpoint(s).write(str(tmp_path / "ckpt-1"))
    s.close()
    zeros = jax.tree.map(np.zeros_like, TREE)
    s2, p2 = _make(*layouts[dst], init=zeros)
    jaxdist.Checkpoint(s2).restore(path)
    jax.tree.map(np.testing.assert_array_equal, jaxdist.pull(p2), want)
    # Optimizer state re-sharded too: one more identical step on both layouts agrees.
    g = jax.tree.map(lambda x: np.full(np.shape(x), 0.5, np.float32), TREE)
    jaxdist.apply_gradients(p2, g)
    s3, p3 = _make(*layouts[src], init=zeros)
    jaxdist.Checkpoint(s3).restore(path)
    jaxdist.apply_gradients(p3, g)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), jaxdist.pull(p2), jaxdist.pull(p3))
    s2.close()
    s3.close()


def test_crash_mid_save_leaves_previous_checkpoint(clusters, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    two, _ = clusters
    s, params = _make(two, jaxdist.FixedShardsPartitioner(2))
    mgr = jaxdist.CheckpointManager(jaxdist.Checkpoint(s), str(tmp_path), max_to_keep=2)
    first = mgr.save(step=1)
    good = jaxdist.pull(params)
    _train(params)

    def crash(*a, **k):  # the PS files are written; the process dies before the manifest
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(ckpt.json, "dump", crash)
    with pytest.raises(KeyboardInterrupt):
        mgr.save(step=2)
    monkeypatch.undo()
    assert mgr.latest_checkpoint == first
    assert not [n for n in os.listdir(tmp_path) if n.startswith("ckpt-2")]
    # A crash that leaves a half-written directory behind (killed process): ignored, then cleaned.
    os.makedirs(tmp_path / "ckpt-9.tmp-dead")
    (tmp_path / "ckpt-9.tmp-dead" / "ps-0.npz").write_bytes(b"partial")
    assert jaxdist.latest_checkpoint(str(tmp_path)) == first
    jaxdist.CheckpointManager(jaxdist.Checkpoint(s), str(tmp_path))
    assert not (tmp_path / "ckpt-9.tmp-dead").exists()
    jaxdist.Checkpoint(s).restore(first)
    jax.tree.map(np.testing.assert_array_equal, jaxdist.pull(params), good)
    # Corruption is detected by checksum.
    with open(os.path.join(first, "ps-0.npz"), "r+b") as f:
        f.seek(100)
        f.write(b"\xff\xff\xff")
    with pytest.raises(Exception, match="sha256"):
        ckpt.load(first)
    with pytest.raises(jaxdist.errors.InvalidRequestError, match="corrupt"):
        jaxdist.Checkpoint(s).restore(first)
    s.close()


def test_manager_keeps_last_n(clusters, tmp_path) -> None:  # type: ignore[no-untyped-def]
    two, _ = clusters
    s, params = _make(two, None)
    mgr = jaxdist.CheckpointManager(jaxdist.Checkpoint(s), str(tmp_path), max_to_keep=2)
    for step in (10, 20, 30):
        mgr.save(step)
    assert [os.path.basename(p) for p in mgr.checkpoints] == ["ckpt-20", "ckpt-30"]
    s.close()


def test_tf_guide_checkpoint_calls_on_parameter_servers(clusters, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """TF's guide: ``checkpoint.save(prefix)`` every few epochs, ``restore(latest_checkpoint(dir))`` to resume."""
    two, _ = clusters
    s, params = _make(two, jaxdist.FixedShardsPartitioner(2))
    checkpoint = jaxdist.Checkpoint(s)
    prefix = str(tmp_path / "ckpt")
    pulled = []
    for k in range(2):  # the second save under the same prefix used to raise FileExistsError
        _train(params, steps=1, seed=k)
        pulled.append(jaxdist.pull(params))
        assert checkpoint.save(prefix) == f"{prefix}-{k + 1}"
        assert checkpoint.save_counter == k + 1
    assert sorted(os.listdir(tmp_path)) == ["ckpt-1", "ckpt-2"]
    for k, want in enumerate(pulled):
        data = ckpt.load(f"{prefix}-{k + 1}")
        assert data["save_counter"] == k + 1
        jax.tree.map(np.testing.assert_array_equal, ckpt.unflatten(data["variables"], "m"), want)
    assert jaxdist.latest_checkpoint(str(tmp_path)) == f"{prefix}-2"
    # write: exactly at the path, the counter unchanged; an existing path is refused.
    assert checkpoint.write(str(tmp_path / "exact")) == str(tmp_path / "exact")
    assert checkpoint.save_counter == 2
    with pytest.raises(FileExistsError):
        checkpoint.write(f"{prefix}-1")

    _train(params, steps=1, seed=7)
    moved = jaxdist.pull(params)
    resumed = jaxdist.Checkpoint(s)
    assert resumed.restore(None) is None  # a fresh start: nothing restored, nothing changed
    assert resumed.save_counter == 0 and resumed.step == 0
    jax.tree.map(np.testing.assert_array_equal, jaxdist.pull(params), moved)
    resumed.restore(jaxdist.latest_checkpoint(str(tmp_path)))
    assert resumed.save_counter == 2  # restored: the next save is ckpt-3
    jax.tree.map(np.testing.assert_array_equal, jaxdist.pull(params), pulled[1])
    assert resumed.save(prefix) == f"{prefix}-3"
    # The manager's ckpt-<step> and numbered saves in one directory: the highest number wins.
    jaxdist.CheckpointManager(jaxdist.Checkpoint(s), str(tmp_path)).save(5)
    assert jaxdist.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-5")
    s.close()


def test_restore_without_the_cluster(clusters, tmp_path) -> None:  # type: ignore[no-untyped-def]
    two, _ = clusters
    s, params = _make(two, jaxdist.FixedShardsPartitioner(2))
    _train(params)
    want = jaxdist.pull(params)
    path = jaxdist.Checkpoint(s).write(str(tmp_path / "ckpt-7"))
    s.close()
    loaded = ckpt.load(path, with_optimizer_state=True)
    tree = ckpt.unflatten(loaded["variables"], "m")
    jax.tree.map(np.testing.assert_array_equal, tree, want)
    # Adam state: count (scalar) + mu + nu; mu of the sharded table is re-assembled to full shape.
    leaves = loaded["optimizer_state"]["m/emb"]
    assert [np.shape(x) for x in leaves] == [(), (13, 4), (13, 4)]
    # The format needs only numpy: each file is a plain .npz.
    with open(os.path.join(path, "manifest.json")) as mf:
        manifest = json.load(mf)
    shard = manifest["variables"]["m/emb"]["shards"][1]
    with np.load(os.path.join(path, shard["file"])) as f:
        np.testing.assert_array_equal(f[f"param/{shard['name']}"], want["emb"][shard["row_start"] :])


def test_save_waits_for_running_closures_and_holds_new_ones(clusters, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A save is one quiet point: closures running when it starts finish first, none starts meanwhile."""
    two, _ = clusters
    s = jaxdist.ParameterServerStrategy(two.cluster_resolver())
    with s.scope():
        counter = jaxdist.create_variable(np.zeros((), np.int64), name="quiet", if_exists="replace")
    coord = jaxdist.ClusterCoordinator(s)
    c = jaxdist.Checkpoint(s)  # the strategy's coordinator is paused
    assert c.coordinator is coord
    release = gates.new_name("release")

    def slow_add() -> None:
        gates.arrive(release)
        gates.event(release).wait(30)
        counter.assign_add(1)

    running = coord.schedule(slow_add)
    poll_for(lambda: gates.arrivals(release) == 1, 30, what="the closure to run")
    saved: dict[str, str] = {}
    saver = threading.Thread(target=lambda: saved.setdefault("path", c.write(str(tmp_path / "ckpt-1"))), name="saver")
    saver.start()
    poll_for(lambda: not coord.dispatching, 30, what="the save to pause dispatch")
    later = coord.schedule(lambda: counter.assign_add(10))
    gates.event(release).set()
    saver.join(30)
    assert not saver.is_alive()
    running.fetch(timeout=30)
    later.fetch(timeout=30)
    # The snapshot holds the running closure's update and not the one scheduled during the save.
    assert int(ckpt.load(saved["path"])["variables"]["quiet"]) == 1
    assert int(counter.numpy()) == 11
    coord.shutdown(exit_tasks=False)
    s.close()


def test_restore_brings_the_data_ledger_back(clusters, tmp_path) -> None:  # type: ignore[no-untyped-def]
    two, _ = clusters
    s = jaxdist.ParameterServerStrategy(two.cluster_resolver())
    with s.scope():
        jaxdist.create_variable(np.zeros((), np.int64), name="ledger-step", if_exists="replace")
    led = jaxdist.DataLedger(num_batches=4, epochs=1)
    for _ in range(3):
        led.take()
    led.mark_done(0)
    led.give_back(2)
    path = jaxdist.Checkpoint(s, ledger=led).write(str(tmp_path / "ckpt-5"))
    fresh = jaxdist.DataLedger(num_batches=4, epochs=1)
    jaxdist.Checkpoint(s, ledger=fresh).restore(path)
    # Handed out but not done (1 and 2) come first, then the rest; 0 is done.
    assert [fresh.take() for _ in range(4)] == [1, 2, 3, None]
    assert fresh.completed == 1
    s.close()
