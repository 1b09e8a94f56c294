"""Multi-host on one machine: PS, workers and coordinator each in their own network namespace, joined by a
bridge, talking over real (virtual) links with a token and mutual TLS. One worker's link is cut for 10 s:
training goes on, the worker rejoins, and the final counter is exact (nothing applied twice or lost).

Topology (all of it inside namespaces this test creates; the root namespace gets no address and sends
nothing to them):

    ns <tag>-sw:  bridge br0 ── veth ──> ns <tag>-ps0  (10.213.X.2)  jaxdist ps
                             ── veth ──> ns <tag>-w0   (10.213.X.3)  jaxdist worker
                             ── veth ──> ns <tag>-w1   (10.213.X.4)  jaxdist worker   <- link cut here
                             ── veth ──> ns <tag>-co   (10.213.X.10) coordinator script, jaxdist status
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("cryptography", reason="the `tls` extra (cryptography) generates the test certificates")

from jaxdist.tools import certs  # noqa: E402
from jaxdist.transport.credentials import TLSConfig  # noqa: E402
from jaxdist.base.task_process import ENV_PARENT_PID  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(300)]

TOKEN = "netns-test-token"
CUT_SECONDS = 10.0

COORDINATOR_SCRIPT = r'''
import collections, json, os, sys, threading, time
import numpy as np
import jaxdist
from jaxdist.cluster_resolver import detect

strategy = jaxdist.ParameterServerStrategy(detect())          # JAXDIST_CLUSTER, JAXDIST_TOKEN; TLS from JAXDIST_TLS_*
with strategy.scope():
    counter = jaxdist.create_variable(np.zeros((), np.float32), name="counter")
coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=3.0)

ARM, HOLDING, RELEASE = sys.argv[1:4]   # files shared with the test (namespaces share the file system)

def step():
    time.sleep(0.002)
    counter.assign_add(np.float32(1.0))                      # exactly-once per closure, even when re-run
    if jaxdist.current_worker_index() == 1:
        try:
            os.rename(ARM, HOLDING)                           # one closure on worker:1 claims the hold...
        except FileNotFoundError:
            pass
        else:                                                 # ...and, its push applied, waits for the cut:
            deadline = time.time() + 60                       # its result never reaches the coordinator
            while not os.path.exists(RELEASE) and time.time() < deadline:
                time.sleep(0.01)
    return jaxdist.current_worker_index()

finish = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), finish.set()), daemon=True).start()
scheduled, by_worker = 0, collections.Counter()
while not finish.is_set():
    rvs = [coord.schedule(step) for _ in range(20)]
    coord.join()
    scheduled += len(rvs)
    by_worker.update(rv.fetch() for rv in rvs)
    print(json.dumps({"event": "batch", "scheduled": scheduled, "by_worker": by_worker, "workers": coord.status(),
                      "retried": coord.closure_counts.retried}), flush=True)
print(json.dumps({"event": "final", "scheduled": scheduled, "counter": float(counter.numpy()),
                  "workers": coord.status(), "retried": coord.closure_counts.retried}), flush=True)
coord.shutdown()
'''


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


class _Lab:
    """Namespaces, bridge and links; :meth:`close` removes everything it made."""

    def __init__(self) -> None:
        self.tag = f"jd{os.getpid() % 100000:05d}"
        self.subnet = random.randint(1, 254)
        self.namespaces: list[str] = []
        self.links: list[str] = []  # root-side names, for cleanup if moving them failed

    def ns(self, short: str) -> str:
        return f"{self.tag}-{short}"

    def addr(self, host: int) -> str:
        return f"10.213.{self.subnet}.{host}"

    def add_namespace(self, short: str) -> str:
        name = self.ns(short)
        _ip("netns", "add", name)
        self.namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def build(self, hosts: dict[str, int]) -> None:
        sw = self.add_namespace("sw")
        _ip("-n", sw, "link", "add", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "br0", "up")
        for short, host in hosts.items():
            node = self.add_namespace(short)
            a, b = f"{self.tag}{short}", f"{self.tag}{short}p"  # <= 15 characters
            _ip("link", "add", a, "type", "veth", "peer", "name", b)
            self.links += [a, b]
            _ip("link", "set", a, "netns", sw)
            _ip("link", "set", b, "netns", node)
            _ip("-n", sw, "link", "set", a, "master", "br0")
            _ip("-n", sw, "link", "set", a, "up")
            _ip("-n", node, "addr", "add", f"{self.addr(host)}/24", "dev", b)
            _ip("-n", node, "link", "set", b, "up")

    def set_link(self, short: str, up: bool) -> None:
        """Take the switch-side end of ``short``'s link down (a pulled cable) or up again."""
        _ip("-n", self.ns("sw"), "link", "set", f"{self.tag}{short}", "up" if up else "down")

    def close(self) -> None:
        for name in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
        for link in self.links:  # only still in the root namespace if moving it failed
            subprocess.run(["ip", "link", "del", link], capture_output=True, timeout=30)


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN/CAP_NET_ADMIN)"
    probe = f"jdprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()!r} (exit {r.returncode})"
    try:
        r = subprocess.run(["ip", "link", "add", f"{probe}a", "type", "veth", "peer", "name", f"{probe}b"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return f"veth pairs are not permitted here: {r.stderr.strip()!r} (exit {r.returncode})"
        subprocess.run(["ip", "link", "del", f"{probe}a"], capture_output=True, timeout=30)
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


@pytest.fixture
def lab() -> Iterator[_Lab]:
    why = _netns_unavailable()
    if why:
        pytest.skip(why)
    lab = _Lab()
    try:
        lab.build({"ps0": 2, "w0": 3, "w1": 4, "co": 10})
        yield lab
    finally:
        lab.close()


class _Proc:
    """A process in a namespace; its stdout lines arrive on a queue (no blocking reads in the test)."""

    def __init__(self, ns: str, argv: list[str], env: dict[str, str], log: Path, stdin: bool = False) -> None:
        self.log = log
        self._log_file = open(log, "w")
        self.proc = subprocess.Popen(["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE, stderr=self._log_file,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, text=True, env=env)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._pumper = threading.Thread(target=self._pump, daemon=True)
        self._pumper.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def next_line(self, timeout: float, what: str) -> str:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}; log:\n{self.tail()}") from None
        if line is None:
            raise AssertionError(f"process exited ({self.proc.wait()}) while waiting for {what}; log:\n{self.tail()}")
        return line

    def tail(self) -> str:
        self._log_file.flush()
        return self.log.read_text(errors="replace")[-3000:]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        # The pump reaches EOF once the process (and anything it left holding the pipe) is
        # gone; the pipes are closed here, not left to the garbage collector's warning.
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self._pumper.join(timeout=30)
        if self.proc.stdout is not None and not self._pumper.is_alive():
            self.proc.stdout.close()
        self._log_file.close()


def _events(coordinator: _Proc, timeout: float, what: str, until: Any) -> dict[str, Any]:
    """Read the coordinator's JSON lines until ``until(event)``; returns that event."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise AssertionError(f"timed out waiting for {what}; log:\n{coordinator.tail()}")
        event = json.loads(coordinator.next_line(left, what))
        if until(event):
            return event


def test_cut_worker_link_for_10s_training_goes_on_and_counter_is_exact(lab: _Lab, tmp_path: Path) -> None:
    pki = certs.generate(str(tmp_path / "pki"), [lab.addr(h) for h in (2, 3, 4, 10)])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "TF_CONFIG"))}
    env.update({"JAXDIST_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu", ENV_PARENT_PID: str(os.getpid())})
    env.update(pki.server_tls().env())  # type: ignore[attr-defined]
    procs: list[_Proc] = []
    try:
        addresses: dict[str, str] = {}
        for short, module, host, index in (("ps0", "jaxdist.ps_server", 2, 0), ("w0", "jaxdist.worker", 3, 0),
                                           ("w1", "jaxdist.worker", 4, 1)):
            p = _Proc(lab.ns(short), [sys.executable, "-m", module, "--host", lab.addr(host), "--port", "0",
                                      "--task-index", str(index), "--metrics-port", "0"], env, tmp_path / f"{short}.log")
            procs.append(p)
            addresses[short] = p.next_line(120, f"{short} ready line")
        ports = {s: re.search(r" port=(\d+)", line).group(1) for s, line in addresses.items()}  # type: ignore[union-attr]
        assert all("metrics_port=" in line for line in addresses.values())
        cluster = {"ps": [f"{lab.addr(2)}:{ports['ps0']}"], "worker": [f"{lab.addr(3)}:{ports['w0']}", f"{lab.addr(4)}:{ports['w1']}"]}
        co_env = {**env, "JAXDIST_CLUSTER": json.dumps({"cluster": cluster, "task": {}})}
        co_env.pop(ENV_PARENT_PID)
        script = tmp_path / "coordinator.py"
        script.write_text(COORDINATOR_SCRIPT)
        arm, holding, release = (str(tmp_path / n) for n in ("arm", "holding", "release"))
        co = _Proc(lab.ns("co"), [sys.executable, str(script), arm, holding, release], co_env, tmp_path / "coordinator.log",
                   stdin=True)
        procs.append(co)

        # Phase 1: both workers train.
        ev = _events(co, 180, "both workers training", lambda e: all(e["by_worker"].get(str(i), 0) >= 20 for i in (0, 1)))
        done_before = {w["task"]: w["closures_done"] for w in ev["workers"]}

        # Phase 2: pull worker:1's cable for 10 s while one of its closures has pushed but not reported back.
        # The coordinator declares worker:1 failed, re-runs that closure on worker:0 (whose push, with the
        # same identity, the PS drops), and training goes on.
        Path(arm).touch()
        deadline = time.monotonic() + 60
        while not os.path.exists(holding):
            assert time.monotonic() < deadline, f"worker:1 never held a closure; log:\n{procs[2].tail()}"
            time.sleep(0.01)
        lab.set_link("w1", up=False)
        cut_at = time.monotonic()
        Path(release).touch()
        ev = _events(co, 60, "worker:1 declared failed", lambda e: not e["workers"][1]["healthy"])
        during = _events(co, 30, "training without worker:1",
                         lambda e: e["workers"][0]["closures_done"] >= done_before["worker:0"] + 100)
        assert not during["workers"][1]["healthy"]
        # jaxdist status from the coordinator's namespace sees the cut too.
        status = subprocess.run(["ip", "netns", "exec", lab.ns("co"), sys.executable, "-m", "jaxdist.tools.cli", "status",
                                 "--timeout", "2"], env=co_env, capture_output=True, text=True, timeout=60)
        assert status.returncode == 1, status.stdout + status.stderr
        assert re.search(r"^worker:1\s+\S+\s+DOWN\s", status.stdout, re.M), status.stdout
        assert re.search(r"^worker:0\s+\S+\s+up\s", status.stdout, re.M) and re.search(r"^ps:0\s+\S+\s+up\s", status.stdout, re.M)
        time.sleep(max(0.0, CUT_SECONDS - (time.monotonic() - cut_at)))  # the cut lasts 10 s by design
        lab.set_link("w1", up=True)

        # Phase 3: worker:1 answers again (same process), is reconfigured and takes closures again.
        rejoined = _events(co, 90, "worker:1 back and training",
                           lambda e: e["workers"][1]["healthy"] and e["workers"][1]["closures_done"] > during["workers"][1]["closures_done"])
        assert rejoined["workers"][1]["failures"] >= 1
        assert co.proc.stdin is not None
        co.proc.stdin.write("finish\n")
        co.proc.stdin.flush()
        final = _events(co, 120, "final count", lambda e: e["event"] == "final")

        # Exactly once: one increment per closure, though closures in flight on worker:1 were re-run elsewhere.
        print(f"netns run: {json.dumps(final)}")
        assert final["counter"] == final["scheduled"], final
        assert final["retried"] >= 1, "no closure was in flight on worker:1 when its link went down"
        assert co.proc.wait(60) == 0, co.tail()
        for p in procs[:3]:  # the coordinator's shutdown() ends the job: every task exits 0
            assert p.proc.wait(60) == 0, p.tail()
        assert all(p.proc.returncode == 0 for p in procs)
        ps_log = procs[0].tail()
        last = re.search(r"ps:0 stopped \(exit 0\): pushes=(\d+) updates_applied=(\d+) duplicates=(\d+)", ps_log)
        assert last is not None, ps_log
        print(f"netns run: ps:0 {last.group(0)}")
        assert int(last.group(2)) == final["counter"]
        assert int(last.group(3)) >= 1, "the re-run closure's push was not dropped as a duplicate"
    finally:
        for p in procs:
            p.stop()
    assert TLSConfig.from_env(env) is not None  # the whole run used mutual TLS
