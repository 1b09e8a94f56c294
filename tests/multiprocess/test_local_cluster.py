"""LocalCluster, `jaxdist launch` and `jaxdist demo` as real processes; nothing is left running."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from conftest import poll_for

from jaxdist.transport.credentials import Credentials

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def test_context_manager_starts_and_stops_everything() -> None:
    from jaxdist import LocalCluster

    with LocalCluster(num_workers=2, num_ps=1) as c:
        pids = [c.pid(t) for t in ("ps:0", "worker:0", "worker:1")]
        assert all(pid and _alive(pid) for pid in pids)
        spec = c.cluster_spec.as_dict()
        assert len(spec["worker"]) == 2 and all(a.startswith("127.0.0.1:") for a in spec["ps"] + spec["worker"])
        assert c.cluster_resolver().token == c.token
    assert not any(_alive(pid) for pid in pids if pid)


def test_nothing_left_when_coordinator_script_is_sigkilled(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "coord.py"
    script.write_text(textwrap.dedent("""
        import os, sys, time
        from jaxdist import LocalCluster
        # A SIGKILLed launcher cannot remove its log directory: keep it in the test's tmp_path.
        c = LocalCluster(num_workers=1, num_ps=1, log_dir=sys.argv[1]).start()
        print("PIDS", c.pid("ps:0"), c.pid("worker:0"), flush=True)
        time.sleep(600)
    """))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path / "logs")], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("PIDS"), line
    pids = [int(p) for p in line.split()[1:]]
    assert all(_alive(p) for p in pids)
    proc.send_signal(signal.SIGKILL)
    proc.communicate()  # waits and closes the pipe
    poll_for(lambda: not any(_alive(p) for p in pids), 10, what="tasks to die with their launcher")


def test_nothing_left_when_coordinator_script_crashes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "crash.py"
    script.write_text(textwrap.dedent("""
        from jaxdist import LocalCluster
        c = LocalCluster(num_workers=1, num_ps=1).start()
        print("PIDS", c.pid("ps:0"), c.pid("worker:0"), flush=True)
        raise RuntimeError("coordinator bug")
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "coordinator bug" in r.stderr
    pids = [int(p) for p in r.stdout.split()[1:3]]
    poll_for(lambda: not any(_alive(p) for p in pids), 10, what="tasks to stop after the crash")


def test_kill_restart_partition() -> None:
    from jaxdist import LocalCluster
    from jaxdist.transport.channel import wait_healthy

    with LocalCluster(num_workers=1, num_ps=1) as c:
        addr = c.cluster_spec.task_address("worker", 0)
        old = c.pid("worker:0")
        c.kill("worker:0")
        assert not c.is_running("worker:0")
        c.restart("worker:0")
        assert c.is_running("worker:0") and c.pid("worker:0") != old
        assert c.cluster_spec.task_address("worker", 0) == addr
        wait_healthy(addr, 10)
        c.partition("ps:0", 1.5)
        with pytest.raises(TimeoutError):
            wait_healthy(c.cluster_spec.task_address("ps", 0), 0.5)
        wait_healthy(c.cluster_spec.task_address("ps", 0), 10)
        # chaos() kills and restarts workers on its own timer (the tests drive theirs by events:
        # tests/kill_points.py); once stopped, every worker runs again.
        before = c.pid("worker:0")
        with c.chaos(every=0.2, downtime=0.1, seed=1) as chaos:
            poll_for(lambda: chaos.kills >= 2, 60, what="two kills by chaos()")
        assert c.is_running("worker:0") and c.pid("worker:0") != before
        wait_healthy(addr, 10)


def test_launch_runs_a_coordinator_script(tmp_path) -> None:  # type: ignore[no-untyped-def]
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import numpy as np, optax, jax, jax.numpy as jnp
        import jaxdist
        from jaxdist.cluster_resolver import detect
        strategy = jaxdist.ParameterServerStrategy(detect())
        with strategy.scope():
            w = jaxdist.create_variables({"w": np.zeros(3, np.float32)}, optimizer=optax.sgd(1.0))
        coord = jaxdist.ClusterCoordinator(strategy)
        def step():
            jaxdist.apply_gradients(w, {"w": -np.ones(3, np.float32)})
        for _ in range(10):
            coord.schedule(step)
        coord.join()
        print("RESULT", w["w"].numpy().tolist(), flush=True)
        coord.shutdown()
    """))
    r = subprocess.run(
        [sys.executable, "-m", "jaxdist.tools.cli", "launch", "--workers", "2", "--ps", "1", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=180,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RESULT [10.0, 10.0, 10.0]" in r.stdout


def test_task_command_reads_tf_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """`jaxdist task` serves as the PS that TF_CONFIG names, on its port, and exits 0 on Shutdown."""
    import json
    import socket

    from jaxdist.ps_server.client import PSClient
    from jaxdist.transport.channel import wait_healthy

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tf_config = {"cluster": {"ps": [f"127.0.0.1:{port}"], "worker": ["127.0.0.1:1"]}, "task": {"type": "ps", "index": 0}}
    env = {**os.environ, "TF_CONFIG": json.dumps(tf_config), "JAXDIST_TOKEN": "tok"}
    env.pop("JAXDIST_CLUSTER", None)
    proc = subprocess.Popen([sys.executable, "-m", "jaxdist.tools.cli", "task", "--host", "127.0.0.1"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_healthy(f"127.0.0.1:{port}", 60)
        c = PSClient(f"127.0.0.1:{port}", Credentials("tok"))
        assert c.status().role == "ps"
        c.shutdown("job finished", 0)
        c.close()
        proc.communicate(timeout=30)  # waits and closes both pipes
        assert proc.returncode == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()


@pytest.mark.slow
def test_demo_trains_to_95_percent_and_exits_clean() -> None:
    r = subprocess.run([sys.executable, "-m", "jaxdist.tools.cli", "demo"], capture_output=True, text=True, timeout=220)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    acc_line = [ln for ln in r.stdout.splitlines() if ln.startswith("held-out accuracy")]
    assert acc_line and float(acc_line[0].split()[2].rstrip("%")) >= 95.0
    assert "all 4 task processes exited: ps:0=0, ps:1=0, worker:0=0, worker:1=0" in r.stdout
    assert "steps/s" in r.stderr  # the progress display


def test_readme_example_trains() -> None:
    from pathlib import Path

    example = Path(__file__).resolve().parents[2] / "examples" / "ps_quickstart.py"
    r = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=200)
    assert r.returncode == 0, r.stderr[-3000:]
    final = float(r.stdout.split("->")[1].split(";")[0])
    assert final < 1e-2, r.stdout
