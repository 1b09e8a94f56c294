"""MultiWorkerMirroredStrategy across real processes on loopback.

Each process is ``python tests/test_sync_multiprocess.py <mode> ...`` with
its own ``TF_CONFIG`` and fake CPU devices (``XLA_FLAGS``), so nothing here
depends on the JAX already imported by the pytest process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from mwms_util import finish, free_port, spawn, two_worker_configs

GLOBAL_BATCH = 32
#: How long a survivor of a killed peer gets to exit. Failing fast means being ended by a failure
#: detector (jaxdist's peer heartbeats, 3 s by default, or JAX's own runtime client), which the tests
#: check by the message it prints, not by a time: this bound only tells "detected" from "never" (a hang,
#: or a step that waits out the 900 s collective timeout conftest.XLA_TEST_FLAGS gives XLA).
SURVIVOR_EXIT_S = 120
NUM_EXAMPLES = 100  # 3 full global batches, then a short one of 4 rows
EPOCHS = 2


# ---------------------------------------------------------------------------------------
# Child process
# ---------------------------------------------------------------------------------------


def _tpu_strategy() -> Any:
    """TF's TPU set-up on a fake TPU VM slice (2 hosts x 4 fake CPU devices, see _tpu_env)."""
    import jaxdist

    resolver = jaxdist.TPUClusterResolver(tpu="", coordinator_address=os.environ["TEST_TPU_COORDINATOR"])
    jaxdist.experimental_connect_to_cluster(resolver)
    topology = jaxdist.initialize_tpu_system(resolver)
    assert topology.mesh_shape.tolist() == [2, 2, 2, 1] and topology.num_tasks == 2, topology
    # RING walks each host's 2x2 chips in a snake: replica order 0, 1, 3, 2 on each host.
    da = jaxdist.DeviceAssignment.build(topology, num_replicas=8, device_order_mode="RING")
    strategy = jaxdist.TPUStrategy(resolver, experimental_device_assignment=da)
    import jax

    per_host = {p: sorted(d.id for d in jax.devices() if d.process_index == p) for p in range(jax.process_count())}
    ordinals = [per_host[d.process_index].index(d.id) for d in strategy.devices]
    assert ordinals == [0, 1, 3, 2, 0, 1, 3, 2], ordinals
    assert strategy.num_replicas_in_sync == 8 and jax.process_count() == 2
    return strategy


def _child_train(out_path: str, tpu: bool = False) -> None:
    import jaxdist.sync as sd

    strategy = _tpu_strategy() if tpu else sd.MultiWorkerMirroredStrategy(init_timeout_s=60, peer_timeout_s=30)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, 12)).astype(np.float32)
    y = rng.integers(0, 4, size=(NUM_EXAMPLES,)).astype(np.int32)
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    params = {
        "w1": jax.random.normal(k1, (12, 16)) * 0.3,
        "b1": jnp.zeros((16,)),
        "w2": jax.random.normal(k2, (16, 4)) * 0.3,
        "b2": jnp.zeros((4,)),
    }
    tx = optax.sgd(0.1, momentum=0.9)

    def step(p: Any, o: Any, batch: Any) -> Any:
        (bx, by), mask = batch

        def loss_fn(p: Any) -> Any:
            h = jax.nn.relu(bx @ p["w1"] + p["b1"])
            per_example = optax.softmax_cross_entropy_with_integer_labels(h @ p["w2"] + p["b2"], by)
            return sd.compute_average_loss(per_example, GLOBAL_BATCH, sample_weight=mask)

        loss, g = jax.value_and_grad(loss_fn)(p)
        g = sd.get_replica_context().all_reduce(sd.ReduceOp.SUM, g)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    with strategy.scope():
        p = strategy.replicate(jax.tree.map(np.asarray, params))
        o = strategy.replicate(tx.init(p))
    batches = [(x[i : i + GLOBAL_BATCH], y[i : i + GLOBAL_BATCH]) for i in range(0, NUM_EXAMPLES, GLOBAL_BATCH)]
    dist = strategy.experimental_distribute_dataset(batches, with_mask=True)
    losses = []
    for _ in range(EPOCHS):
        for batch in dist:
            p, o, loss = strategy.run(step, args=(p, o, batch))
            losses.append(float(strategy.reduce(sd.ReduceOp.SUM, loss)))

    def dataset_fn(ctx: sd.InputContext) -> Any:
        # One pipeline per process yielding per-replica batches: replica r of global batch g
        # gets rows [g + r*b, g + (r+1)*b), as the global split does, so results must agree.
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        local = ctx.num_replicas_in_sync // ctx.num_input_pipelines
        for g in range(0, NUM_EXAMPLES, GLOBAL_BATCH):
            for i in range(local):
                lo = g + (ctx.input_pipeline_id * local + i) * b
                hi = min(lo + b, NUM_EXAMPLES)
                if lo < hi:
                    yield x[lo:hi], y[lo:hi]

    for batch in strategy.distribute_datasets_from_function(dataset_fn, with_mask=True):
        p, o, loss = strategy.run(step, args=(p, o, batch))
        losses.append(float(strategy.reduce(sd.ReduceOp.SUM, loss)))
    out = {k: np.asarray(v) for k, v in p.items()}

    # Metrics over the data (short last batch, no mask), summed across replicas of every process.
    import jaxdist

    with strategy.scope():
        v = jaxdist.create_variables({k: np.asarray(a) for k, a in p.items()})
        acc = jaxdist.metrics.SparseCategoricalAccuracy()
        xent = jaxdist.metrics.SparseCategoricalCrossentropy(from_logits=True)

    def eval_step(batch: Any) -> None:
        bx, by = batch
        q = jaxdist.read_variables(v)
        logits = jax.nn.relu(bx @ q["w1"] + q["b1"]) @ q["w2"] + q["b2"]
        acc.update_state(by, logits)
        xent.update_state(by, logits)

    for batch in strategy.experimental_distribute_dataset(batches):
        strategy.run(eval_step, args=(batch,))
    metrics = [float(acc.result()), float(acc.count.value()), float(xent.result())]
    # One checkpoint for the job: every process calls save, process 0 writes it; every process restores it.
    ckpt = jaxdist.Checkpoint(strategy)
    ckpt.step = 7
    path = ckpt.write(os.path.join(os.environ["TEST_CKPT_DIR"], "ckpt-7"))
    for var in jax.tree.leaves(v):
        var.assign(np.zeros(var.shape, var.dtype))
    ckpt.restore(path)
    restored = all(np.array_equal(np.asarray(v[k]), out[k]) for k in out) and ckpt.step == 7
    np.savez(
        out_path,
        losses=np.asarray(losses),
        replicas=strategy.num_replicas_in_sync,
        processes=getattr(strategy, "num_processes", jax.process_count()),
        local=len(strategy.experimental_local_results(loss)),
        metrics=np.asarray(metrics),
        restored=restored,
        **out,
    )
    if hasattr(strategy, "shutdown"):
        strategy.shutdown()
    print("TRAIN_DONE", flush=True)


def _child_tpu(out_path: str) -> None:
    _child_train(out_path, tpu=True)


def _child_timeout(rank: str) -> None:
    """Process 1 keeps heartbeating but never joins the collective; process 0's step times out."""
    import jaxdist

    strategy = jaxdist.MultiWorkerMirroredStrategy(
        init_timeout_s=60, peer_timeout_s=60, communication_options=jaxdist.CommunicationOptions(timeout_seconds=2)
    )
    import jax
    import numpy as np

    if strategy.process_index == 1:
        sys.stdin.read()  # a peer that never joins the step; the parent kills it once process 0 has failed
        return
    x = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones((4,), np.float32))
    out = strategy.run(lambda v: jax.lax.psum(v, "replica"), args=(x,))
    print("STEP_DISPATCHED", flush=True)
    np.asarray(out)
    print("STEP_FINISHED (unexpected)", flush=True)


def _child_loop(progress_path: str, on_peer_failure: str = "abort") -> None:
    import jaxdist.sync as sd

    strategy = sd.MultiWorkerMirroredStrategy(init_timeout_s=60, on_peer_failure=on_peer_failure)
    import jax
    import numpy as np

    x = strategy.experimental_distribute_values_from_function(lambda ctx: np.ones((256,), np.float32))
    fn = lambda v: jax.lax.psum(v, "replica")  # noqa: E731
    step = 0
    try:
        while True:
            out = strategy.run(fn, args=(x,))
            if on_peer_failure == "abort":
                np.asarray(out)  # a failed collective surfaces here, outside jaxdist
            step += 1
            if step % 5 == 0:
                with open(progress_path, "a") as f:
                    f.write(f"{step}\n")
    except sd.PeerFailedError as e:
        print(f"CAUGHT PeerFailedError task={e.task} rank={e.rank}: {e}", flush=True)
        sys.exit(3)


def _child_loop_raise(progress_path: str) -> None:
    _child_loop(progress_path, on_peer_failure="raise")


# ---------------------------------------------------------------------------------------
# Parent helpers
# ---------------------------------------------------------------------------------------


def _spawn(
    mode: str, arg: str, devices: int, tf_config: dict[str, Any] | None, extra_env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    return spawn(__file__, [mode, arg], devices, tf_config, extra_env=extra_env, stdin=True)


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


def _tpu_env(i: int, port: int) -> dict[str, str]:
    """A fake Cloud TPU VM slice: 2 hosts (loopback) of 2x2 chips, stacked along z."""
    return {
        "JAXDIST_TPU_FAKE_DEVICES": "cpu",
        "TPU_WORKER_HOSTNAMES": "127.0.0.1,127.0.0.1",
        "TPU_WORKER_ID": str(i),
        "TPU_ACCELERATOR_TYPE": "v4-16",
        "TPU_CHIPS_PER_HOST_BOUNDS": "2,2,1",
        "TPU_HOST_BOUNDS": "1,1,2",
        "TEST_TPU_COORDINATOR": f"127.0.0.1:{port}",
    }


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_processes_match_one_process(tmp_path: Path) -> None:
    """2 processes x 4 devices (MultiWorkerMirrored, and TPUStrategy on a fake 2-host TPU VM slice) train to
    the same parameters as 1 process x 8 devices; metrics agree exactly; one checkpoint per job, restored."""
    import numpy as np

    cfgs = two_worker_configs()
    tpu_port = free_port()
    dirs = {g: tmp_path / f"ckpt_{g}" for g in ("ref", "mw", "tpu")}
    procs = [
        _spawn("train", str(tmp_path / "ref.npz"), 8, None, {"TEST_CKPT_DIR": str(dirs["ref"])}),
        _spawn("train", str(tmp_path / "w0.npz"), 4, cfgs[0], {"TEST_CKPT_DIR": str(dirs["mw"])}),
        _spawn("train", str(tmp_path / "w1.npz"), 4, cfgs[1], {"TEST_CKPT_DIR": str(dirs["mw"])}),
        _spawn("tpu", str(tmp_path / "t0.npz"), 4, None, {**_tpu_env(0, tpu_port), "TEST_CKPT_DIR": str(dirs["tpu"])}),
        _spawn("tpu", str(tmp_path / "t1.npz"), 4, None, {**_tpu_env(1, tpu_port), "TEST_CKPT_DIR": str(dirs["tpu"])}),
    ]
    results = finish(procs, timeout=280)
    for name, (rc, so, se) in zip(("1x8", "worker:0", "worker:1", "tpu:0", "tpu:1"), results):
        assert rc == 0 and "TRAIN_DONE" in so, f"{name} failed (rc={rc}):\n{so[-2000:]}\n{se[-4000:]}"
    ref = np.load(tmp_path / "ref.npz")
    assert int(ref["replicas"]) == 8 and int(ref["processes"]) == 1 and int(ref["local"]) == 8
    assert bool(ref["restored"])
    for name in ("w0", "w1", "t0", "t1"):
        got = np.load(tmp_path / f"{name}.npz")
        assert int(got["replicas"]) == 8 and int(got["processes"]) == 2 and int(got["local"]) == 4, name
        assert len(got["losses"]) == (EPOCHS + 1) * 4
        for k in ("w1", "b1", "w2", "b2", "losses"):
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=f"{name}:{k}")
        assert got["metrics"][:2].tolist() == ref["metrics"][:2].tolist(), name  # accuracy and count: exact
        np.testing.assert_allclose(got["metrics"][2], ref["metrics"][2], rtol=1e-5)
        assert float(got["metrics"][1]) == NUM_EXAMPLES  # every real row counted once, padding never
        assert bool(got["restored"]), name
    for g in ("mw", "tpu"):  # one checkpoint for the job, written once (by process 0)
        assert sorted(p.name for p in dirs[g].iterdir()) == ["ckpt-7"]
        assert sorted(f.name for f in (dirs[g] / "ckpt-7").iterdir()) == ["manifest.json", "vars-0.npz"]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_collective_timeout_fails_the_job(tmp_path: Path) -> None:
    """CommunicationOptions(timeout_seconds=2): a step stuck waiting for a peer ends process 0 with EXIT_PEER_FAILED."""
    from jaxdist.sync import EXIT_PEER_FAILED

    cfgs = two_worker_configs()
    procs = [_spawn("timeout", str(i), 1, cfgs[i]) for i in range(2)]
    try:
        try:
            rc = procs[0].wait(timeout=120)
        except subprocess.TimeoutExpired:
            rc = None
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    so, se = procs[0].communicate()
    procs[1].communicate()
    assert rc == EXIT_PEER_FAILED, f"rc={rc}\n{so[-1000:]}\n{se[-3000:]}"
    assert "STEP_FINISHED" not in so  # (with gloo the wait may already be inside the dispatch: watched too)
    assert "timeout_seconds=2" in se, se[-2000:]


def _start_loop_pair(tmp_path: Path, mode: str = "loop") -> tuple[list[subprocess.Popen[str]], list[Path]]:
    cfgs = two_worker_configs()
    progress = [tmp_path / "p0.txt", tmp_path / "p1.txt"]
    procs = [_spawn(mode, str(progress[i]), 4, cfgs[i]) for i in range(2)]
    deadline = time.monotonic() + 90
    while not all(p.exists() and p.read_text().count("\n") >= 2 for p in progress):
        for proc in procs:
            if proc.poll() is not None:
                so, se = proc.communicate()
                raise AssertionError(f"a worker exited early (rc={proc.returncode}):\n{so[-2000:]}\n{se[-4000:]}")
        if time.monotonic() > deadline:
            for proc in procs:
                proc.kill()
            raise AssertionError("workers did not start stepping within 90s")
        time.sleep(0.1)
    return procs, progress


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killed_worker_makes_survivor_fail_fast(tmp_path: Path) -> None:
    """SIGKILL worker:1 mid-training: worker:0 exits with EXIT_PEER_FAILED and a clear message within seconds."""
    from jaxdist.sync import EXIT_PEER_FAILED

    procs, _ = _start_loop_pair(tmp_path)
    os.kill(procs[1].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        procs[0].wait(timeout=SURVIVOR_EXIT_S)
    except subprocess.TimeoutExpired:
        pass
    elapsed = time.monotonic() - killed_at
    (rc, _so, se), _ = finish(procs, timeout=5)
    assert rc == EXIT_PEER_FAILED, f"survivor rc={rc} after {elapsed:.1f}s:\n{se[-4000:]}"
    # Ended by the peer heartbeats (process 0 hosts their state): worker:1 fell silent, not a timed-out step.
    assert "PeerFailedError" in se and "worker:1 (process 1) sent no heartbeat" in se and "presumed dead" in se, se[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killed_chief_makes_survivor_fail_fast(tmp_path: Path) -> None:
    """SIGKILL process 0 (which hosts both coordination services): worker:1 exits non-zero within seconds.

    JAX's runtime client notices first here and aborts the process itself
    (SIGABRT, "JAX distributed service detected fatal errors ... another task
    died"); jaxdist's heartbeat watchdog (exit 138) is the backstop.
    """
    procs, _ = _start_loop_pair(tmp_path)
    os.kill(procs[0].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        procs[1].wait(timeout=SURVIVOR_EXIT_S)
    except subprocess.TimeoutExpired:
        pass
    elapsed = time.monotonic() - killed_at
    _, (rc, _so, se) = finish(procs, timeout=5)
    assert rc != 0 and rc is not None, f"survivor rc={rc} after {elapsed:.1f}s"
    # Ended by a failure detector (JAX's runtime client, or jaxdist's heartbeats as the backstop), not a hang.
    assert "another task died" in se or "PeerFailedError" in se, se[-3000:]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_killed_worker_raises_typed_error_in_raise_mode(tmp_path: Path) -> None:
    """With on_peer_failure="raise", the survivor's next strategy.run raises PeerFailedError naming worker:1.

    The child catches it and calls sys.exit(3); a process that saw a peer
    failure still ends with EXIT_PEER_FAILED (JAX's own shutdown barrier would
    otherwise wait for the dead peer).
    """
    from jaxdist.sync import EXIT_PEER_FAILED

    procs, _ = _start_loop_pair(tmp_path, mode="loop_raise")
    os.kill(procs[1].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        procs[0].wait(timeout=SURVIVOR_EXIT_S)
    except subprocess.TimeoutExpired:
        pass
    elapsed = time.monotonic() - killed_at
    (rc, so, se), _ = finish(procs, timeout=5)
    assert "CAUGHT PeerFailedError task=worker:1 rank=1" in so, f"rc={rc}\n{so[-1000:]}\n{se[-3000:]}"
    assert rc == EXIT_PEER_FAILED, f"rc={rc} after {elapsed:.1f}s\n{se[-3000:]}"
    assert "worker:1 (process 1) sent no heartbeat" in so and "presumed dead" in so, so[-3000:]  # the heartbeats ended it


if __name__ == "__main__":
    mode, arg = sys.argv[1], sys.argv[2]
    {"train": _child_train, "tpu": _child_tpu, "timeout": _child_timeout, "loop": _child_loop, "loop_raise": _child_loop_raise}[mode](arg)
