"""Process lifecycle: a PS drains on SIGTERM (in-flight pushes finish, later ones are refused, nothing is
half-applied, exit 0), and the coordinator's ``shutdown(exit_code=...)`` is every task's exit code."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import CREDS, TOKEN, poll_for

import jaxdist
from jaxdist.errors import PSUnavailableError
from jaxdist.proto.ps_wire import CreateSpec, Op, Update
from jaxdist.ps_server.client import PSClient
from jaxdist.base.task_process import ENV_PARENT_PID

pytestmark = [pytest.mark.multiprocess]


def _start_ps(log_path: str) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "JAXDIST_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu", ENV_PARENT_PID: str(os.getpid())}
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "jaxdist.ps_server", "--port", "0", "--drain-timeout", "20"],
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("JAXDIST_READY"), f"no ready line: {line!r}"
    return proc, f"127.0.0.1:{line.split('port=')[1].split()[0]}"


@pytest.mark.timeout(120)
def test_ps_sigterm_mid_push_stream_drains_and_exits_0(tmp_path: Any) -> None:
    log_path = str(tmp_path / "ps.log")
    proc, address = _start_ps(log_path)
    try:
        with PSClient(address, CREDS, task="ps:0") as c:
            c.create([CreateSpec("a", value=np.zeros(1 << 20, np.float32)), CreateSpec("b", value=np.zeros(1 << 20, np.float32))])
            ones = np.ones(1 << 20, np.float32)  # 4 MiB per variable: each push is several frames
            acked: list[list[int]] = []

            def push(client: PSClient, uid: str, timeout: float | None = None) -> list[int]:
                versions, dup = client.push([Update("a", Op.ASSIGN_ADD, ones), Update("b", Op.ASSIGN_ADD, ones)],
                                            update_id=uid, timeout=timeout)
                assert not dup
                return versions

            for i in range(5):
                acked.append(push(c, f"warm-{i}"))

            # A push whose stream is open when SIGTERM arrives: header and the first frames now, the rest later.
            # Over gRPC (its frames are what the gate holds back; the data plane would send it whole).
            gate = threading.Event()
            slow_client = PSClient(address, CREDS, task="ps:0", data_plane=False)
            plain_stream = slow_client._frames

            holding = threading.Event()

            def gated(header: Any, arrays: list[np.ndarray]) -> Iterator[bytes]:
                frames = plain_stream(header, arrays)
                yield next(frames)
                yield next(frames)
                holding.set()  # gRPC asked for the third frame: the first two are sent
                gate.wait(30)
                yield from frames

            slow_client._frames = gated  # type: ignore[method-assign]
            slow: dict[str, Any] = {}

            def run_slow() -> None:
                try:
                    # Its stream stays open on purpose for as long as the test needs: no deadline race.
                    slow["versions"] = push(slow_client, "slow", timeout=110)
                except Exception as e:  # noqa: BLE001 - reported by the assertion below
                    slow["error"] = e

            slow_thread = threading.Thread(target=run_slow)
            slow_thread.start()
            poll_for(holding.is_set, 30, what="the slow push to have sent its first frames")
            acked.append(push(c, "after-slow-started"))  # the PS serves others while that stream waits

            # A client pushing back-to-back through the signal: every push is acknowledged or refused.
            refused: list[BaseException] = []

            def hammer() -> None:
                n = 0
                while True:
                    try:
                        acked.append(push(c, f"loop-{n}"))
                    except PSUnavailableError as e:
                        refused.append(e)
                        return
                    n += 1

            hammer_thread = threading.Thread(target=hammer)
            hammer_thread.start()
            poll_for(lambda: len(acked) >= 10, 30, what="pushes before SIGTERM")
            proc.send_signal(signal.SIGTERM)
            hammer_thread.join(30)
            assert not hammer_thread.is_alive() and refused, "pushes after SIGTERM were not refused"
            assert proc.poll() is None, "the PS exited with a push stream still open (no drain)"

            gate.set()  # the in-flight stream now sends its remaining frames: it must be applied and acknowledged
            slow_thread.join(30)
            assert "error" not in slow, f"the push in flight at SIGTERM failed: {slow.get('error')!r}"
            acked.append(slow["versions"])
            slow_client.close()
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()
    # Atomic: every acknowledged push moved both variables together, one version each, in order.
    assert all(a == b for a, b in acked), acked
    first = min(a for a, _ in acked)
    assert sorted(a for a, _ in acked) == list(range(first, first + len(acked)))
    with open(log_path) as f:
        log = f.read()
    final = re.search(r"ps:0 stopped \(exit 0\): pushes=(\d+) updates_applied=(\d+) duplicates=(\d+)", log)
    assert final is not None, log[-2000:]
    # Every acknowledged push is reflected, and nothing else was applied (refused pushes left no trace).
    assert int(final.group(2)) == len(acked)
    assert int(final.group(3)) == 0
    assert "draining" in log


@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["shutdown_exit_code", "with_block_raises"])
def test_coordinator_shutdown_code_is_every_tasks_exit_code(how: str) -> None:
    cluster = jaxdist.LocalCluster(num_workers=1, num_ps=1, metrics=False)
    with cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coord = jaxdist.ClusterCoordinator(strategy)
        assert coord.schedule(lambda: 41 + 1).fetch() == 42
        if how == "shutdown_exit_code":
            coord.shutdown(exit_code=7)
            expected = 7
        else:
            with pytest.raises(RuntimeError), coord:
                raise RuntimeError("the training script failed")
            expected = 1  # what `with ClusterCoordinator(...)` sends when its block raises
        assert cluster.wait_exit(30) == {"ps:0": expected, "worker:0": expected}
    # The exits were awaited and judged here: a clean stop, so the cluster's own log folder is gone.
    assert not os.path.exists(cluster.log_dir)
