"""PS failure without restart (checkpoint mode) and coordinator restart, with real SIGKILLs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.testing import InProcessCluster, poll_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]

TRUE_W = np.arange(8, dtype=np.float32)[:, None]


def _data(seed: int, n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, x @ TRUE_W + 1.0


def _run(kill_ps: bool, tmp_path) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    # The run without a failure needs no processes; the one with a SIGKILL does.
    with (jaxdist.LocalCluster(num_workers=2, num_ps=2) if kill_ps else InProcessCluster(num_workers=2, num_ps=2)) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            params = jaxdist.create_variables({"w": np.zeros((8, 1), np.float32), "b": np.zeros(1, np.float32)}, optimizer=optax.sgd(0.02))
        assert params["w"].ps_index != params["b"].ps_index
        coord = jaxdist.ClusterCoordinator(strategy)
        mgr = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy), str(tmp_path / ("killed" if kill_ps else "clean")))
        mgr.save(0)
        coord.enable_ps_recovery(mgr, poll_interval=0.2)

        @jax.jit
        def grads(p, x, y):  # type: ignore[no-untyped-def]
            return jax.grad(lambda p: jnp.mean((x @ p["w"] + p["b"] - y) ** 2))(p)

        def step(seed: int) -> None:
            x, y = _data(seed)
            time.sleep(0.005)
            jaxdist.apply_gradients(params, grads(jaxdist.pull(params), x, y))

        for r in range(8):
            for i in range(40):
                coord.schedule(step, args=(r * 40 + i,))
            if kill_ps and r == 4:
                poll_for(lambda: coord.closure_counts.running > 0, 30, what="closures in flight")
                cluster.kill("ps:1")
                # The watcher (or a closure meeting the dead PS) holds dispatch until ps:1 is restored.
                poll_for(lambda: not coord.dispatching, 30, what="dispatch held while ps:1 is down")
                cluster.restart("ps:1")
            coord.join()
            mgr.save(r + 1)
        x, y = _data(10_000, 512)
        p = jaxdist.pull(params)
        loss = float(np.mean((x @ p["w"] + p["b"] - y) ** 2))
        recoveries = coord.ps_recoveries
        assert coord.dispatching
        coord.shutdown()
        return loss, recoveries


def test_ps_sigkill_mid_training_recovers_from_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    clean_loss, r0 = _run(False, tmp_path)
    killed_loss, r1 = _run(True, tmp_path)
    assert r0 == 0 and r1 == 1
    assert clean_loss < 0.05
    assert killed_loss < 0.05, (killed_loss, clean_loss)


COORDINATOR = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np, optax, jax, jax.numpy as jnp
    import jaxdist
    ckpt_dir, total = sys.argv[1], int(sys.argv[2])
    # Logs beside the checkpoint: a SIGKILLed coordinator cannot remove its cluster's log directory.
    with jaxdist.LocalCluster(num_workers=1, num_ps=2, log_dir=ckpt_dir + "-logs") as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            params = jaxdist.create_variables({"w": np.zeros((8, 1), np.float32), "b": np.zeros(1, np.float32)},
                                              optimizer=optax.sgd(0.05, momentum=0.9))
        coord = jaxdist.ClusterCoordinator(strategy)
        def dataset_fn(ctx):
            rng = np.random.default_rng(0)
            x = rng.normal(size=(total * 16, 8)).astype(np.float32)
            y = x @ np.arange(8, dtype=np.float32)[:, None] + 1.0
            return [(x[i:i + 16], y[i:i + 16]) for i in range(0, len(x), 16)]
        ds = coord.create_per_worker_dataset(dataset_fn, exactly_once=True, num_batches=total)
        it = iter(ds)
        mgr = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy, coord, ledger=ds.ledger), ckpt_dir, max_to_keep=2)
        resumed = mgr.restore_or_initialize()
        step = mgr.checkpoint.step
        print("RESUMED" if resumed else "FRESH", step, flush=True)
        grads = jax.jit(jax.grad(lambda p, x, y: jnp.mean((x @ p["w"] + p["b"] - y) ** 2)))
        def train(iterator):
            x, y = next(iterator)
            jaxdist.apply_gradients(params, grads(jaxdist.pull(params), x, y))
        while step < total:
            for _ in range(10):
                coord.schedule(train, args=(it,))
            coord.join()
            step += 10
            mgr.save(step)
            print("STEP", step, flush=True)
        p = jaxdist.pull(params)
        print("FINAL", json.dumps({k: v.ravel().tolist() for k, v in p.items()}), flush=True)
        coord.shutdown()
    """
)


def test_coordinator_sigkill_and_restart_reaches_the_same_state(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "coord.py"
    script.write_text(COORDINATOR)
    total = 60

    def final(out: str) -> dict:
        return json.loads([ln for ln in out.splitlines() if ln.startswith("FINAL")][0].split(" ", 1)[1])

    clean = subprocess.run([sys.executable, str(script), str(tmp_path / "a"), str(total)], capture_output=True, text=True, timeout=200)
    assert clean.returncode == 0, clean.stderr[-3000:]
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "b"), str(total)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("STEP 30"):
            proc.send_signal(signal.SIGKILL)  # the coordinator dies mid-run (and its local cluster with it)
            break
    proc.communicate(timeout=30)  # reaps it and closes the pipe
    assert proc.returncode == -signal.SIGKILL, seen
    again = subprocess.run([sys.executable, str(script), str(tmp_path / "b"), str(total)], capture_output=True, text=True, timeout=200)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "RESUMED 30" in again.stdout
    assert final(again.stdout) == final(clean.stdout)  # exactly: deterministic SGD + exactly-once data
