"""Simulated big cluster: one coordinator and one PS against 1 .. 1,000 workers, JSON lines.

Workers are real gRPC services hosted by ``python -m jaxdist.worker.host`` processes of up to
``--per-host`` (100) services each; the coordinator is this process (its CPU, RSS and threads come
from /proc/self); the PS is a ``LocalCluster`` process. Workers run with ``JAXDIST_SHM=0``: on a real
cluster they are on other machines, so their PS data-plane connections are plain TCP sockets (and
1,000 shared-memory regions of 4 MB each would not be a simulation of anything).

Measurements per worker count N (``--measure``, default all):
  startup  hosts up; coordinator built; every worker configured and healthy (status() rows)
  idle     nothing queued, every worker healthy: coordinator CPU (% of one core) over --idle-seconds,
           RSS, threads (/proc/self/status), context switches/s (thread wake-ups), heartbeats/s it
           should be sending; each host process's CPU, RSS and threads (the worker host's own cost per
           service; its RSS over its services includes the ~185 MB Python + jax process); the PS's
  noop     no-op closures/s: schedule(noop) x --noop-closures then join (after a warm-up), median of
           --repeats; coordinator CPU during the runs
  pull     every worker pulls a small variable once (from a per-worker dataset_fn, so each holds a
           data-plane connection to the PS); then the PS's threads and sockets, and the latency of
           pulling that variable from the coordinator (200 pulls) and from inside one closure (100)
  failure  closures push +1 to "started", block on the 100 workers of one host process (until it
           dies) and return at once elsewhere, then push +1 to "done"; once each of the 100 holds one,
           that host is SIGKILLed (``--failure-mode stop``: SIGSTOPped, a frozen host that sends no
           RST). Times from the signal to: all 100 rows unhealthy, the last re-run closure started
           on a survivor, join() returned; both counters must end exact (each = closures scheduled).
           With N >= 200 the victim is host 0; below, the 100 workers that joined in "join"
  kills2   (N >= 300) exactly --kills2-closures (2,000) closures of the "failure" kind, blocking on the
           workers of two 100-worker hosts; host A is SIGKILLed, then (once A's closures have run again
           elsewhere) host B. Per kill: seconds to all 100 declared failed and to the last re-run of its
           closures started; both counters must end exactly at the number of closures
  join     a host process of 100 workers registers all at once through serve_registration() while
           the others are kept busy (a feeder keeps short closures queued): times from its ready line
           to all 100 registered, all healthy, all having finished a closure

Every record carries the load average at that moment (the machine is shared: figures are noisy).
Usage: python bench/scale.py [--workers 1,10,100,300] [--measure idle,noop] [--out bench/results/scale.jsonl]
       [--profile-dir DIR]   (py-spy record of the coordinator during idle and noop, N >= 100)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

MEASUREMENTS = ("startup", "idle", "noop", "pull", "failure", "join", "kills2", "detect")
HOST_ENV = {"JAXDIST_SHM": "0"}
_CLK = os.sysconf("SC_CLK_TCK")
_out: Any = None


def emit(**kv: Any) -> None:
    kv.setdefault("loadavg", [round(x, 2) for x in os.getloadavg()])
    line = json.dumps(kv)
    print(line, flush=True)
    if _out is not None:
        _out.write(line + "\n")
        _out.flush()


# ------------------------------------------------------------------ /proc
def proc_stats(pid: int | str = "self") -> dict[str, float]:
    """CPU seconds (utime + stime), RSS (MB) and threads of a process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _CLK  # utime, stime (fields 14, 15 of stat)
    rss = threads = 0.0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("Threads:"):
                threads = int(line.split()[1])
    return {"cpu_s": cpu, "rss_mb": round(rss, 1), "threads": threads}


def context_switches(pid: int | str = "self") -> int:
    """Context switches (voluntary + involuntary) summed over every thread of a process: each wake-up
    of a waiting thread is one, so this counts wake-ups (timed waits, notify_all herds)."""
    n = 0
    base = f"/proc/{pid}/task"
    for tid in os.listdir(base):
        with contextlib.suppress(OSError), open(f"{base}/{tid}/status") as f:
            for line in f:
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    n += int(line.split()[1])
    return n


def sockets_of(pid: int) -> int:
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                n += 1
    return n


def child_pid(marker: str) -> int:
    """The pid of this process's child whose command line contains ``marker``."""
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            if ppid != me:
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    return int(pid)
    raise RuntimeError(f"no child process running {marker}")


class CpuMeter:
    """CPU % of one core used by a process between ``__enter__`` and ``__exit__``."""

    def __init__(self, pid: int | str = "self") -> None:
        self.pid = pid
        self.percent = 0.0

    def __enter__(self) -> CpuMeter:
        self._t, self._c = time.monotonic(), proc_stats(self.pid)["cpu_s"]
        return self

    def __exit__(self, *exc: object) -> None:
        self.percent = round(100 * (proc_stats(self.pid)["cpu_s"] - self._c) / max(1e-9, time.monotonic() - self._t), 1)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.02) -> float:
    """Poll ``predicate`` until true; returns seconds waited. Raises TimeoutError."""
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"{what}: not within {timeout:.0f}s")
        time.sleep(interval)
    return time.monotonic() - t0


def none_healthy(c: Any, rows: list[int]) -> bool:
    """Whether none of ``rows`` is healthy, from one status() snapshot: status() builds every row
    (O(workers)), and polling it per row would take the coordinator's CPU it is timing."""
    status = c.coord.status()
    return not any(status[i]["healthy"] for i in rows)


def failures(c: Any) -> int:
    """Failures the coordinator has declared so far, summed over every worker (status() rows)."""
    return sum(r["failures"] for r in c.coord.status())


# ------------------------------------------------------------------ closures
def _noop() -> None:
    return None


def _make_failure_closure(started: Any, held: Any, done: Any, victims: frozenset[int], hold_s: float) -> Any:
    """A closure that blocks on the victim host's workers (so each holds one when it dies) and
    returns at once elsewhere (so survivors are free to re-run what the victims held)."""

    def closure() -> tuple[int, float]:
        import time as _t

        import jaxdist as _jd

        t = _t.time()  # wall clock: compared with the kill's, on this same machine
        me = _jd.current_worker_index()
        started.assign_add(1)
        # Every attempt makes the same sequence of pushes: a push's identity is its position in the
        # closure, so a re-run that skipped this one would have its "done" deduplicated as "held".
        held.assign_add(1 if me in victims else 0)
        if me in victims:
            _t.sleep(hold_s)  # until the SIGKILL
        done.assign_add(1)
        return me, t

    return closure


def _make_sleep(seconds: float) -> Any:
    def closure() -> None:
        import time as _t

        _t.sleep(seconds)

    return closure


def _make_connect_fn(small: Any, connected: Any) -> Any:
    def dataset_fn() -> list[int]:
        import jaxdist as _jd

        _jd.pull(small)  # opens this worker's data-plane connection to the PS, kept pooled
        connected.assign_add(1)
        return [0]

    return dataset_fn


def _make_timed_pulls(small: Any, pulls: int) -> Any:
    def closure() -> list[float]:
        import time as _t

        import jaxdist as _jd

        _jd.pull(small)
        out = []
        for _ in range(pulls):
            t = _t.perf_counter()
            _jd.pull(small)
            out.append(_t.perf_counter() - t)
        return out

    return closure


def _pcts(times: list[float]) -> dict[str, float]:
    s = sorted(times)
    return {"p50_ms": round(1e3 * statistics.median(s), 3), "p90_ms": round(1e3 * s[int(0.9 * (len(s) - 1))], 3),
            "p99_ms": round(1e3 * s[int(0.99 * (len(s) - 1))], 3), "max_ms": round(1e3 * s[-1], 3)}


# ------------------------------------------------------------------ the cluster
class ScaleCluster:
    """One PS process, worker host processes for ``n`` workers, a strategy and a coordinator (here)."""

    def __init__(self, n: int, per_host: int, args: argparse.Namespace) -> None:
        self.n = n
        self.per_host = per_host
        self.args = args
        self.hosts: list[Any] = []
        self.extra_hosts: list[Any] = []
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> ScaleCluster:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _start(self) -> None:
        import jaxdist
        from jaxdist.base.cluster_resolver import ClusterSpec, SimpleClusterResolver
        from jaxdist.transport.credentials import Credentials
        from jaxdist.worker.host import HostProcess

        t0 = time.monotonic()
        self.cluster = self._stack.enter_context(jaxdist.LocalCluster(num_workers=0, num_ps=1))
        self.creds = Credentials(self.cluster.token)
        self.ps_pid = child_pid("jaxdist.ps_server")
        sizes = [min(self.per_host, self.n - i) for i in range(0, self.n, self.per_host)]
        first = 0
        # Host processes start one after another: 10 imports of jax at once would only thrash 2 cores.
        for size in sizes:
            h = HostProcess(size, self.creds, first_index=first, env=HOST_ENV)
            self._stack.callback(h.stop)
            h.start()
            self.hosts.append(h)
            first += size
        t_hosts = time.monotonic() - t0
        addresses = [a for h in self.hosts for a in h.addresses]
        spec = ClusterSpec({"ps": [self.cluster.address("ps:0")], "worker": addresses})
        self.strategy = jaxdist.ParameterServerStrategy(SimpleClusterResolver(spec, token=self.cluster.token))
        self._stack.callback(self.strategy.close)
        t1 = time.monotonic()
        self.coord = jaxdist.ClusterCoordinator(self.strategy, closures_per_rpc=self.args.closures_per_rpc)
        self._stack.callback(self._shutdown)
        t_built = time.monotonic() - t1
        # Where the coordinator cannot keep every worker healthy (heartbeats late, workers declared
        # failed and reconfigured over and over), say so and measure anyway: that is the finding.
        try:
            t_healthy: float | None = wait_until(lambda: self.healthy() == self.n, self.args.startup_timeout,
                                                 "all workers healthy", 0.1)
        except TimeoutError:
            t_healthy = None
        t_reg = time.monotonic()
        self.registration = self.coord.serve_registration()
        t_reg = time.monotonic() - t_reg
        st = proc_stats()
        if "startup" in self.args.measure:
            emit(kind="startup", workers=self.n, hosts=len(self.hosts), hosts_up_s=round(t_hosts, 2),
                 coordinator_built_s=round(t_built, 2),
                 all_healthy_s=None if t_healthy is None else round(t_built + t_healthy, 2), healthy=self.healthy(),
                 false_failures=failures(self),
                 serve_registration_s=round(t_reg, 2), coordinator_threads=st["threads"],
                 coordinator_rss_mb=st["rss_mb"])

    def _shutdown(self) -> None:
        for h in self.hosts + self.extra_hosts:  # a stopped host would make every Shutdown call wait
            if h.proc is not None and h.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(h.pid, signal.SIGCONT)
        t = time.monotonic()
        self.coord.shutdown(exit_tasks=True)
        emit(kind="shutdown", workers=self.n, coordinator_shutdown_s=round(time.monotonic() - t, 2))

    def healthy(self) -> int:
        return sum(r["healthy"] for r in self.coord.status())

    def add_host(self, size: int, register: bool) -> Any:
        from jaxdist.worker.host import HostProcess

        first = sum(h.count for h in self.hosts + self.extra_hosts)
        h = HostProcess(size, self.creds, first_index=first, env=HOST_ENV,
                        register_with=self.registration if register else None)
        self._stack.callback(h.stop)
        h.start()
        self.extra_hosts.append(h)
        return h


# ------------------------------------------------------------------ measurements
def measure_idle(c: ScaleCluster) -> None:
    a = c.args
    c.coord.join()
    hosts = {h.pid: proc_stats(h.pid) for h in c.hosts}
    ps0 = proc_stats(c.ps_pid)
    f0 = failures(c)
    healthy0 = c.healthy()
    cs0 = context_switches()
    t0 = time.monotonic()
    with CpuMeter() as coord_cpu:
        time.sleep(a.idle_seconds)  # the measurement itself: CPU spent while nothing is queued
    wall = time.monotonic() - t0
    wakeups = (context_switches() - cs0) / wall
    st = proc_stats()
    host_cpu = [100 * (proc_stats(pid)["cpu_s"] - s0["cpu_s"]) / wall for pid, s0 in hosts.items()]
    host_now = [proc_stats(h.pid) for h in c.hosts]
    services = sum(h.count for h in c.hosts)
    ps1 = proc_stats(c.ps_pid)
    hb = getattr(c.coord, "heartbeat_interval", 0.5)
    emit(kind="idle", workers=c.n, seconds=round(wall, 1), healthy_before=healthy0, healthy=c.healthy(),
         false_failures=failures(c) - f0,
         coordinator_cpu_percent=coord_cpu.percent, coordinator_rss_mb=st["rss_mb"], coordinator_threads=st["threads"],
         coordinator_context_switches_per_s=round(wakeups),
         coordinator_python_threads=threading.active_count(), heartbeats_per_s_expected=round(c.n / hb, 1),
         hosts=len(c.hosts), host_cpu_percent_total=round(sum(host_cpu), 1),
         host_cpu_percent_per_100_services=round(100 * sum(host_cpu) / services, 2),
         host_threads_per_service=round(sum(s["threads"] for s in host_now) / services, 2),
         host_rss_mb_per_service=round(sum(s["rss_mb"] for s in host_now) / services, 2),
         host_rss_mb=[s["rss_mb"] for s in host_now],
         ps_cpu_percent=round(100 * (ps1["cpu_s"] - ps0["cpu_s"]) / wall, 1), ps_threads=ps1["threads"], ps_rss_mb=ps1["rss_mb"])


def noop_rate(c: ScaleCluster, n: int, budget_s: float) -> tuple[float, int]:
    """``(closures/s, closures run)``: schedule up to ``n`` no-ops, stopping early after ``budget_s``
    seconds (where the coordinator can barely schedule, the rate is still measured), then join."""
    t = time.perf_counter()
    scheduled = 0
    while scheduled < n and time.perf_counter() - t < budget_s:
        c.coord.schedule(_noop)
        scheduled += 1
    c.coord.join(timeout=c.args.phase_timeout)
    return scheduled / (time.perf_counter() - t), scheduled


def measure_noop(c: ScaleCluster) -> None:
    sizes = [int(x) for x in str(c.args.noop_closures).split(",") if int(x) > 0] or [max(5000, 10 * c.n)]
    for i, n in enumerate(sizes):
        measure_noop_size(c, n, warm=i == 0)


def measure_noop_size(c: ScaleCluster, n: int, warm: bool) -> None:
    a = c.args
    if warm:
        noop_rate(c, max(c.n, n // 5), a.noop_budget_s)  # warm: every worker has the function cached
    f0 = failures(c)
    rates, cpus, switches, counts, batches, host_us, coord_us = [], [], [], [], [], [], []
    for _ in range(a.repeats):
        cs0 = context_switches()
        d0 = c.coord.dispatch_counters()
        h0 = sum(proc_stats(h.pid)["cpu_s"] for h in c.hosts)
        with CpuMeter() as m:
            rate, ran = noop_rate(c, n, a.noop_budget_s)
        host_us.append(1e6 * (sum(proc_stats(h.pid)["cpu_s"] for h in c.hosts) - h0) / ran)
        coord_us.append(1e4 * m.percent * (ran / rate) / ran)
        d1 = c.coord.dispatch_counters()
        batches.append((d1["closures_sent"] - d0["closures_sent"]) / max(1, d1["run_calls"] - d0["run_calls"]))
        rates.append(rate)
        counts.append(ran)
        switches.append((context_switches() - cs0) / ran)
        cpus.append(m.percent)
    st = proc_stats()
    done = [r["closures_done"] for r in c.coord.status()]
    emit(kind="noop", workers=c.n, closures=n, ran=counts, budget_s=a.noop_budget_s, closures_per_rpc=a.closures_per_rpc,
         median=round(statistics.median(rates), 1), runs=[round(r, 1) for r in rates],
         coordinator_cpu_percent=round(statistics.median(cpus), 1), coordinator_rss_mb=st["rss_mb"],
         coordinator_context_switches_per_closure=round(statistics.median(switches), 1),
         closures_per_call=[round(b, 2) for b in batches],
         coordinator_cpu_us_per_closure=round(statistics.median(coord_us), 1),
         hosts_cpu_us_per_closure=round(statistics.median(host_us), 1),
         coordinator_threads=st["threads"], workers_that_ran_closures=sum(d > 0 for d in done),
         false_failures=failures(c) - f0)


def measure_pull(c: ScaleCluster) -> None:
    """Every worker holds a data-plane connection to the PS (``--pull-connect closures``: each pulls
    once from a per-worker dataset_fn; ``direct``: a helper process opens one client per worker
    instead, for where the coordinator cannot dispatch), then pull latency of a 1 KB variable from
    a fresh client in a process of its own, from this process and (closures) from one worker."""
    import jaxdist

    a = c.args
    with c.strategy.scope():
        small = jaxdist.create_variable(np.zeros(256, np.float32), name="small")  # 1 KB
        connected = jaxdist.create_variable(np.zeros((), np.int64), name="connected")
    before = proc_stats(c.ps_pid)
    t0 = time.monotonic()
    helper = None
    worker_pull = None
    try:
        if a.pull_connect == "closures":
            c.coord.create_per_worker_dataset(_make_connect_fn(small, connected))
            try:
                wait_until(lambda: int(connected.numpy()) >= c.healthy(), a.phase_timeout, "every worker connected", 0.1)
            except TimeoutError as e:
                raise TimeoutError(f"{e} ({int(connected.numpy())} of {c.healthy()} healthy workers connected, "
                                   f"dispatch {c.coord.dispatch_counters()})") from None
            n_connected = int(connected.numpy())
        else:
            helper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--pull-helper", c.cluster.address("ps:0"),
                                       "--pull-helper-clients", str(c.n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      env={**os.environ, "JAXDIST_TOKEN": c.cluster.token, **HOST_ENV}, text=True)
            assert helper.stdout is not None
            n_connected = json.loads(helper.stdout.readline())["connected"]
        t_conn = time.monotonic() - t0
        ps = proc_stats(c.ps_pid)
        socks = sockets_of(c.ps_pid)
        # A fresh client in a light process: the PS's latency, not this (busy) process's.
        probe = subprocess.run([sys.executable, os.path.abspath(__file__), "--pull-helper", c.cluster.address("ps:0"),
                                "--pull-helper-clients", "1", "--pull-helper-pulls", "200"], capture_output=True, text=True,
                               env={**os.environ, "JAXDIST_TOKEN": c.cluster.token, **HOST_ENV}, timeout=a.phase_timeout,
                               input="")
        probe_times = json.loads(probe.stdout.splitlines()[-1])["times"]
        coord_times = []
        jaxdist.pull(small)
        for _ in range(200):
            t = time.perf_counter()
            jaxdist.pull(small)
            coord_times.append(time.perf_counter() - t)
        if a.pull_connect == "closures":
            rv = c.coord.schedule(_make_timed_pulls(small, 100))
            c.coord.join(timeout=a.phase_timeout)
            worker_pull = _pcts(list(rv.fetch()))
    finally:
        if helper is not None:
            helper.communicate(timeout=60)  # EOF on stdin: it closes its clients and exits
    emit(kind="pull", workers=c.n, connect=a.pull_connect, connected=n_connected, all_connected_s=round(t_conn, 2),
         ps_threads_before=before["threads"], ps_threads=ps["threads"], ps_sockets=socks, ps_rss_mb=ps["rss_mb"],
         variable_bytes=1024, probe_pull=_pcts(probe_times), coordinator_pull=_pcts(coord_times), worker_pull=worker_pull)


def pull_helper(address: str, clients: int, pulls: int) -> int:
    """``--pull-helper``: open ``clients`` PS clients that each pull "small" once (one data-plane
    connection each), print ``{"connected": n}``; with ``pulls``, time that many pulls on the first
    and print ``{"times": [...]}``; then hold the connections until stdin closes."""
    from jaxdist.ps_server.client import PSClient, PullSpec
    from jaxdist.transport.credentials import Credentials

    creds = Credentials.from_env()
    conns = [PSClient(address, creds, task="ps:0") for _ in range(clients)]
    try:
        for cl in conns:
            cl.pull([PullSpec("small")])
        print(json.dumps({"connected": sum(bool(cl.uses_data_plane) for cl in conns)}), flush=True)
        if pulls:
            times = []
            for _ in range(pulls):
                t = time.perf_counter()
                conns[0].pull([PullSpec("small")])
                times.append(time.perf_counter() - t)
            print(json.dumps({"times": times}), flush=True)
        sys.stdin.read()
    finally:
        for cl in conns:
            cl.close()
    return 0


def measure_failure(c: ScaleCluster, victim: Any) -> None:
    import jaxdist

    a = c.args
    c.coord.join()
    with c.strategy.scope():
        counters = {k: jaxdist.create_variable(np.zeros((), np.int64), name=f"{k}{victim.first_index}")
                    for k in ("started", "held", "done")}
    alive = c.healthy()
    victim_addresses = set(victim.addresses)
    rows = [i for i, r in enumerate(c.coord.status()) if r["address"] in victim_addresses]
    others0 = sum(r["failures"] for i, r in enumerate(c.coord.status()) if i not in rows)
    closure = _make_failure_closure(counters["started"], counters["held"], counters["done"], frozenset(rows),
                                    a.phase_timeout)
    rvs: list[Any] = []
    k_before = c.coord.closure_counts  # its figures count since the coordinator started
    t0 = time.monotonic()
    # Survivors finish their closures at once and may drain the queue before a victim asks: top it
    # up until every victim worker holds one.
    while int(counters["held"].numpy()) < len(rows):
        if time.monotonic() - t0 > a.phase_timeout:
            raise TimeoutError("victim workers did not all take a closure")
        rvs.extend(c.coord.schedule(closure) for _ in range(2 * alive))
        with contextlib.suppress(TimeoutError):
            wait_until(lambda: int(counters["held"].numpy()) >= len(rows), 2.0, "victims hold closures", 0.05)
    t_held = time.monotonic() - t0
    # The survivors finish the backlog first: what starts after the kill is then only the re-runs
    # of what the victims held (else "last re-run" would time the backlog too).
    k_start_finished = k_before.finished

    def settled() -> bool:
        k = c.coord.closure_counts
        return k.queued == 0 and (k.finished - k_start_finished) + k.running == len(rvs)

    wait_until(settled, a.phase_timeout, "survivors to finish the backlog", 0.05)
    sig = signal.SIGKILL if a.failure_mode == "kill" else signal.SIGSTOP
    wall_kill, t_kill = time.time(), time.monotonic()
    os.kill(victim.pid, sig)
    t_declared = wait_until(lambda: none_healthy(c, rows), a.phase_timeout, "victims declared failed", 0.02)
    c.coord.join(timeout=a.phase_timeout)
    t_join = time.monotonic() - t_kill
    results = [rv.fetch() for rv in rvs]
    reruns = [t for (_, t) in results if t > wall_kill]
    if sig == signal.SIGSTOP:
        victim.kill()
    got = {k: int(v.numpy()) for k, v in counters.items()}
    emit(kind="failure", workers=c.n, alive_before=alive, killed=len(rows), mode=a.failure_mode, closures=len(rvs),
         all_victims_held_s=round(t_held, 2), all_declared_failed_s=round(t_declared, 3), reruns=len(reruns),
         last_rerun_started_s=round(max(reruns) - wall_kill, 3) if reruns else None, join_after_kill_s=round(t_join, 3),
         started=got["started"], done=got["done"], exact=got["started"] == got["done"] == len(rvs),
         false_failures=sum(r["failures"] for i, r in enumerate(c.coord.status()) if i not in rows) - others0)


def _kill_and_rerun(c: ScaleCluster, host: Any, victim_rows: list[int]) -> dict[str, Any]:
    """SIGKILL ``host``; seconds until its rows are all unhealthy and until every closure it held
    (counted by the queue as retried) has finished again elsewhere."""
    a = c.args
    k0 = c.coord.closure_counts
    wall, t0 = time.time(), time.monotonic()
    os.kill(host.pid, signal.SIGKILL)
    t_declared = wait_until(lambda: none_healthy(c, victim_rows), a.phase_timeout, "victims declared failed", 0.02)

    def rerun_done() -> bool:
        k = c.coord.closure_counts
        retried = k.retried - k0.retried
        return retried > 0 and k.queued == 0 and k.finished - k0.finished >= retried

    wait_until(rerun_done, a.phase_timeout, "the killed host's closures to run again", 0.01)
    return {"wall": wall, "declared_s": round(t_declared, 3), "reruns_finished_s": round(time.monotonic() - t0, 3),
            "closures_retried": c.coord.closure_counts.retried - k0.retried}


def measure_kills2(c: ScaleCluster, hosts: list[Any]) -> None:
    """An exact counter of ``--kills2-closures`` closures through two SIGKILLs of 100-worker hosts."""
    import jaxdist

    a = c.args
    c.coord.join()
    total = a.kills2_closures
    with c.strategy.scope():
        counters = {k: jaxdist.create_variable(np.zeros((), np.int64), name=f"kills2_{k}") for k in ("started", "held", "done")}
    by_address = {r["address"]: i for i, r in enumerate(c.coord.status()) if not r["left"]}
    rows = [[by_address[ad] for ad in h.addresses] for h in hosts]
    others = [i for i in range(len(c.coord.status())) if i not in set(rows[0] + rows[1])]
    status = c.coord.status()
    f0 = sum(status[i]["failures"] for i in others)
    closure = _make_failure_closure(counters["started"], counters["held"], counters["done"],
                                    frozenset(rows[0] + rows[1]), a.phase_timeout)
    k_start = c.coord.closure_counts  # its figures count since the coordinator started
    rvs = [c.coord.schedule(closure) for _ in range(total)]

    # Every victim that took a batch is blocked in its first closure; everything else has finished.
    def settled() -> bool:
        k = c.coord.closure_counts
        return k.queued == 0 and k.running > 0 and (k.finished - k_start.finished) + k.running == total

    wait_until(settled, a.phase_timeout, "survivors to finish the rest", 0.05)
    held = int(counters["held"].numpy())
    kills = [_kill_and_rerun(c, h, victim_rows) for h, victim_rows in zip(hosts, rows)]
    c.coord.join(timeout=a.phase_timeout)
    starts = [t for (_, t) in (rv.fetch() for rv in rvs)]
    for i, k in enumerate(kills):
        until = kills[i + 1]["wall"] if i + 1 < len(kills) else float("inf")
        mine = [t for t in starts if k["wall"] < t < until]
        k["last_rerun_started_s"] = round(max(mine) - k["wall"], 3) if mine else None
        del k["wall"]
    got = {k: int(v.numpy()) for k, v in counters.items()}
    emit(kind="kills2", workers=c.n, closures=total, victims_holding=held, kills=kills, started=got["started"],
         done=got["done"], exact=got["started"] == got["done"] == total,
         false_failures=sum(r["failures"] for i, r in enumerate(c.coord.status()) if i in set(others)) - f0)


def measure_detect(c: ScaleCluster, victim: Any) -> None:
    """Nothing queued: SIGKILL (or SIGSTOP) a host of idle workers; seconds until all its rows are
    unhealthy. Idle workers hold no call that a connection reset could fail, so this is the
    heartbeat path (failure_timeout after the last answer)."""
    a = c.args
    victim_addresses = set(victim.addresses)
    rows = [i for i, r in enumerate(c.coord.status()) if r["address"] in victim_addresses]
    f0 = sum(r["failures"] for i, r in enumerate(c.coord.status()) if i not in rows)
    sig = signal.SIGKILL if a.failure_mode == "kill" else signal.SIGSTOP
    os.kill(victim.pid, sig)
    t_declared = wait_until(lambda: none_healthy(c, rows), a.phase_timeout, "victims declared failed", 0.02)
    if sig == signal.SIGSTOP:
        victim.kill()
    emit(kind="detect", workers=c.n, killed=len(rows), mode=a.failure_mode, all_declared_failed_s=round(t_declared, 3),
         failure_timeout_s=getattr(c.coord, "failure_timeout", None),
         false_failures=sum(r["failures"] for i, r in enumerate(c.coord.status()) if i not in rows) - f0)


class Feeder:
    """Keeps about ``2 * workers`` short closures outstanding (so joining workers find work)."""

    def __init__(self, c: ScaleCluster, seconds: float) -> None:
        self.c = c
        self.fn = _make_sleep(seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="jaxdist-bench-feeder", daemon=True)

    def _run(self) -> None:
        pending: list[Any] = []
        while not self._stop.is_set():
            pending = [rv for rv in pending if not rv.done()]
            want = 2 * self.c.coord.active_workers - len(pending)
            for _ in range(max(0, want)):
                if self._stop.is_set():  # schedule() may crawl (a saturated coordinator): stop between calls
                    return
                pending.append(self.c.coord.schedule(self.fn))
            self._stop.wait(0.05)

    def __enter__(self) -> Feeder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.c.coord.join(timeout=self.c.args.phase_timeout)


def measure_join(c: ScaleCluster) -> Any:
    a = c.args
    c.coord.join()
    done_before = {r["address"]: r["closures_done"] for r in c.coord.status()}
    f0 = failures(c)
    with Feeder(c, a.feeder_closure_s):
        h = c.add_host(100, register=True)
        assert h.ready_at is not None
        t0 = h.ready_at
        mine = set(h.addresses)

        def rows() -> list[dict[str, Any]]:
            # A port freed by a killed host can be handed to a joining service: the coordinator then
            # takes it as that dead worker coming back (same address) and reuses its row, so rows are
            # matched by address, not by position.
            latest = {r["address"]: r for r in c.coord.status() if r["address"] in mine}
            return list(latest.values())

        wait_until(lambda: len(rows()) == 100, a.phase_timeout, "100 registered", 0.05)
        t_reg = time.monotonic() - t0  # from the ready line (registration starts right after it)
        wait_until(lambda: all(r["healthy"] for r in rows()), a.phase_timeout, "100 healthy", 0.05)
        t_healthy = time.monotonic() - t0

        def working() -> int:
            return sum(r["closures_done"] > done_before.get(r["address"], 0) for r in rows())

        try:
            wait_until(lambda: working() == 100, a.join_work_timeout, "100 working", 0.05)
            t_working: float | None = time.monotonic() - t0
        except TimeoutError:
            t_working = None
        took_work = working()
    emit(kind="join", workers=c.n, joined=100, reused_addresses=len(mine & set(done_before)), registered_s=round(t_reg, 3),
         all_healthy_s=round(t_healthy, 3), all_took_work_s=None if t_working is None else round(t_working, 3),
         took_work=took_work, feeder_closure_s=a.feeder_closure_s,
         false_failures=failures(c) - f0, coordinator_threads=proc_stats()["threads"])
    return h


@contextlib.contextmanager
def profiled(args: argparse.Namespace, n: int, phase: str, seconds: float, pid: int | None = None,
             who: str = "coordinator") -> Iterator[None]:
    """py-spy record of ``pid`` (default: this process) for ``seconds`` (collapsed stacks, one file),
    when --profile-dir is given and N >= 100."""
    if not args.profile_dir or n < 100:
        yield
        return
    os.makedirs(args.profile_dir, exist_ok=True)
    path = os.path.join(args.profile_dir, f"{who}-{n}-{phase}.txt")
    # Sampling 2 threads per worker is itself costly: a low rate keeps py-spy's share small.
    proc = subprocess.Popen(["py-spy", "record", "--pid", str(pid or os.getpid()), "--duration", str(int(seconds)),
                             "--rate", str(args.profile_rate), "--format", "raw", "--nonblocking",
                             "--output", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield
    finally:
        try:
            proc.wait(seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        emit(kind="profile", workers=n, phase=phase, who=who, path=path)


def run_size(n: int, args: argparse.Namespace) -> None:
    t0 = time.monotonic()
    with ScaleCluster(n, args.per_host, args) as c:
        if "idle" in args.measure:
            with profiled(args, n, "idle", args.idle_seconds), \
                    profiled(args, n, "idle", args.idle_seconds, c.hosts[0].pid, "host"):
                measure_idle(c)
        if "noop" in args.measure:
            with profiled(args, n, "noop", args.profile_seconds), \
                    profiled(args, n, "noop", args.profile_seconds, c.hosts[0].pid, "host"):
                measure_noop(c)
        if "pull" in args.measure:
            measure_pull(c)
        if "failure" in args.measure and n >= 200:
            measure_failure(c, c.hosts[0])
        joined = None
        if "join" in args.measure:
            with profiled(args, n, "join", args.profile_seconds):
                joined = measure_join(c)
        if "kills2" in args.measure and n >= 300:
            measure_kills2(c, c.hosts[-2:])
        if "failure" in args.measure and n < 200:
            if joined is None:
                joined = c.add_host(100, register=True)
                wait_until(lambda: c.healthy() >= n + 100, args.phase_timeout, "100 joined")
            measure_failure(c, joined)
        if "detect" in args.measure and n >= 100:
            alive = [h for h in c.hosts + c.extra_hosts if h.count == 100 and h.proc is not None and h.proc.poll() is None]
            if alive:
                measure_detect(c, alive[-1])
    emit(kind="size_done", workers=n, elapsed_s=round(time.monotonic() - t0, 1))


def main(argv: list[str] | None = None) -> int:
    global _out
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="1,10,100,300", help="comma-separated worker counts (e.g. 1,10,100,300,1000)")
    ap.add_argument("--per-host", type=int, default=100, help="worker services per host process")
    ap.add_argument("--measure", default=",".join(MEASUREMENTS), help=f"subset of {','.join(MEASUREMENTS)}")
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file (e.g. bench/results/scale.jsonl)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--noop-closures", default="0",
                    help="closures per no-op run (default max(5000, 10 N)); a comma-separated list measures each size "
                         "in turn (one noop record each; the warm-up runs before the first only)")
    ap.add_argument("--closures-per-rpc", type=int, default=16)
    ap.add_argument("--idle-seconds", type=float, default=10.0)
    ap.add_argument("--failure-mode", choices=("kill", "stop"), default="kill",
                    help="kill: SIGKILL the host (loopback sends RST); stop: SIGSTOP it (a frozen host, no RST)")
    ap.add_argument("--kills2-closures", type=int, default=2000, help="closures of the two-kill counter run")
    ap.add_argument("--feeder-closure-s", type=float, default=0.05, help="seconds each feeder closure sleeps in 'join'")
    ap.add_argument("--phase-timeout", type=float, default=300.0)
    ap.add_argument("--noop-budget-s", type=float, default=120.0,
                    help="stop scheduling a no-op run after this many seconds (the rate is of what ran)")
    ap.add_argument("--pull-connect", choices=("closures", "direct"), default="closures",
                    help="how every worker gets its PS connection in 'pull' (direct: a helper process, one client per worker)")
    ap.add_argument("--join-work-timeout", type=float, default=120.0,
                    help="seconds to wait for all 100 joined workers to finish a closure (null past it)")
    ap.add_argument("--pull-helper", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--pull-helper-clients", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--pull-helper-pulls", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--startup-timeout", type=float, default=120.0,
                    help="seconds to wait for every worker to be healthy before measuring anyway")
    ap.add_argument("--profile-dir", default=None, help="py-spy record the coordinator during idle and noop (N >= 100)")
    ap.add_argument("--profile-rate", type=int, default=50)
    ap.add_argument("--profile-seconds", type=float, default=15.0)
    args = ap.parse_args(argv)
    if args.pull_helper:
        return pull_helper(args.pull_helper, args.pull_helper_clients, args.pull_helper_pulls)
    args.measure = [m.strip() for m in args.measure.split(",") if m.strip()]
    unknown = set(args.measure) - set(MEASUREMENTS)
    if unknown:
        ap.error(f"unknown measurements {sorted(unknown)}; choose from {','.join(MEASUREMENTS)}")
    sizes = [int(x) for x in args.workers.split(",") if x.strip()]
    # A SIGTERM unwinds the with-blocks (coordinator, hosts, PS, temporary logs) instead of leaving them.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        _out = open(args.out, "a")  # noqa: SIM115 - closed below
    try:
        import grpc
        import jax

        import jaxdist

        emit(kind="meta", started=time.strftime("%Y-%m-%dT%H:%M:%S"), cpus=os.cpu_count(), machine=os.uname().nodename,
             jaxdist_version=jaxdist.__version__, jax_version=jax.__version__, grpc_version=grpc.__version__,
             python=sys.version.split()[0], sizes=sizes, per_host=args.per_host, measure=args.measure,
             failure_mode=args.failure_mode, host_env=HOST_ENV)
        for n in sizes:
            try:
                run_size(n, args)
            except Exception as e:  # noqa: BLE001 - record where a size breaks, then try the next one
                emit(kind="error", workers=n, error=f"{type(e).__name__}: {e}")
    finally:
        if _out is not None:
            _out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
