"""Nemesis soak: a parameter-server job under a seeded schedule of mixed faults, then exact invariants.

The job (``--job``, started by the driver in its own network namespace) is a coordinator script that
owns a :class:`jaxdist.LocalCluster` of 2 PS with backups (``ps_backup``) and 4 workers, every task in
a network namespace of its own, joined by a bridge. It trains closures that read an exactly-once data
set (``num_batches`` batches a epoch) and push exactly-once updates, saves a checkpoint after every
epoch and starts with ``restore_or_initialize()``. Each closure ``c`` that reads batch ``b``:

* adds 1 to row ``b`` of ``seen`` and the sum of the batch's example ids to row ``b`` of ``idsum``;
* adds 1 to row ``c`` of ``per_closure`` (one counter per closure);
* adds 1 to every element of ``payload`` (128 KiB: a push that a rate-limited link slows down, and that
  goes through a shared-memory region where the data plane has one).

The driver (the default mode) builds the namespaces, runs the job, and injects faults from a schedule
drawn from ``random.Random(seed)``: the kinds in a shuffled order, round after round, each with a random
target and duration. ``--lanes`` faults (default 3) are in progress at once, each on a unit no other holds
(a worker; a shard, its primary and backup together; the coordinator): a host frozen while a link drops
and a PS primary is killed. A coordinator fault waits for the others and holds the whole job until its
re-run answers; other faults overlap its recovery:

=================== ===========================================================================
``worker_kill``     SIGKILL a worker, restart it after a while
``worker_stop``     SIGSTOP a worker, SIGCONT it after a while (a frozen host)
``ps_primary_kill`` SIGKILL the current primary of a shard, restart it (it rejoins as the backup)
``ps_primary_stop`` freeze the current primary of a shard
``ps_backup_kill``  SIGKILL the current backup of a shard, restart it
``ps_backup_stop``  freeze the current backup of a shard
``coordinator_kill`` SIGKILL the job (its cluster dies with it) and run it again: it resumes
``coordinator_stop`` freeze the job
``partition``       cut the link between two tasks (coordinator included) in both directions:
                    each drops the other's packets silently (a bogus neighbour entry)
``slow_link``       rate-limit a task's link both ways with ``tc tbf``
=================== ===========================================================================

After each fault is lifted its lane waits (generously, for a condition, never for a time) until
the job has recovered from it: what it touched healthy again (the worker; the shard's primary
answering with its backup attached; after a coordinator fault, every unit no other fault holds) and
more closures finished than when it was lifted; that wait is the fault's recovery time, and the unit
stays held until then. When the time is up the job finishes its epoch, and the driver checks invariants that
cannot be faked:

* every batch of every epoch trained exactly once (``seen == epochs`` and ``idsum`` exact per batch);
* every acknowledged closure's updates present exactly once (``per_closure`` is 1 for every closure
  of the finished epochs, 0 beyond; ``payload`` equals the number of closures);
* both replicas of every shard identical (the values read from each primary, then from its backup
  after promoting it by hand);
* no checkpoint acknowledged by ``save()`` lost by a coordinator restart;
* no process left in any namespace and no ``/dev/shm/jaxdist-*`` file that a job process held left.

Output: JSON lines (stdout and ``--out``): the seed and the command that replays it, one line per
fault (kind, target, outage, recovery seconds), one summary (counts and recovery median/max per kind,
violations). Exit status 0 when there are no violations. Needs root (network namespaces, ``tc``).

    sudo python bench/nemesis.py --minutes 30                 # a new seed, printed first
    sudo python bench/nemesis.py --seed 1234 --minutes 30     # the same schedule again
    sudo python bench/nemesis.py --faults worker_kill,partition --minutes 5
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

KINDS = ("worker_kill", "worker_stop", "ps_primary_kill", "ps_primary_stop", "ps_backup_kill", "ps_backup_stop",
         "coordinator_kill", "coordinator_stop", "partition", "slow_link")
NUM_PS, NUM_WORKERS = 2, 4
BATCH = 8  # examples per batch; example ids are 0 .. num_batches * BATCH - 1
PAYLOAD = 32768  # float32 elements of the bulk variable: 128 KiB a push, over the shared-memory threshold (64 KiB)

#: Every node: a short namespace suffix and a host number on the lab's /24.
NODES: dict[str, tuple[str, int]] = {"coordinator": ("co", 10)}
NODES.update({f"ps:{i}": (f"ps{i}", 2 + i) for i in range(NUM_PS)})
NODES.update({f"ps_backup:{i}": (f"pb{i}", 4 + i) for i in range(NUM_PS)})
NODES.update({f"worker:{i}": (f"w{i}", 6 + i) for i in range(NUM_WORKERS)})

#: What faults put at risk: a worker, a shard (its primary and backup together), the coordinator.
ALL_UNITS = ("coordinator", *(f"worker:{i}" for i in range(NUM_WORKERS)), *(f"shard:{i}" for i in range(NUM_PS)))

BOGUS_MAC = "02:00:00:00:00:01"  # a neighbour entry pointing here drops a peer's packets silently


_EMIT_LOCK = threading.Lock()


def emit(obj: dict[str, Any]) -> None:
    """One JSON line on stdout (threads of the job and the driver share it)."""
    with _EMIT_LOCK:
        print(json.dumps(obj), flush=True)


# =====================================================================================  the lab


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r


def _tc(ns: str, *args: str, check: bool = True) -> None:
    r = subprocess.run(["tc", "-n", ns, *args], capture_output=True, text=True, timeout=60)
    if check and r.returncode != 0:
        raise RuntimeError(f"tc -n {ns} {' '.join(args)}: {r.stderr.strip()}")


def netns_unavailable() -> str | None:
    """Why this machine cannot run the soak (None: it can)."""
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the `{tool}` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_SYS_ADMIN/CAP_NET_ADMIN)"
    probe = f"jdnm{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()!r}"
    try:
        r = subprocess.run(["ip", "-n", probe, "link", "add", "name", "a", "type", "veth", "peer", "name", "b"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return f"veth pairs are not permitted here: {r.stderr.strip()!r}"
        r = subprocess.run(["tc", "-n", probe, "qdisc", "add", "dev", "b", "root", "tbf", "rate", "8mbit", "burst", "32kbit",
                            "latency", "400ms"], capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            return f"`tc qdisc ... tbf` is not available here: {r.stderr.strip()!r}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=30)
    return None


class Lab:
    """One namespace per node, a bridge in a switch namespace; :meth:`close` removes all of it."""

    def __init__(self) -> None:
        self.tag = f"jn{os.getpid() % 100000:05d}"
        self.subnet = random.SystemRandom().randint(1, 254)  # not from the seed: the schedule must not depend on it
        self.namespaces: list[str] = []
        self.partitions: set[tuple[str, str]] = set()
        self.slow: set[str] = set()

    def ns(self, node: str) -> str:
        return f"{self.tag}-{NODES[node][0]}"

    def ip(self, node: str) -> str:
        return f"10.214.{self.subnet}.{NODES[node][1]}"

    def iface(self, node: str, switch_side: bool) -> str:
        return f"{self.tag}{NODES[node][0]}" + ("" if switch_side else "p")  # <= 15 characters

    def build(self) -> None:
        sw = f"{self.tag}-sw"
        _ip("netns", "add", sw)
        self.namespaces.append(sw)
        _ip("-n", sw, "link", "add", "name", "br0", "type", "bridge")
        _ip("-n", sw, "link", "set", "dev", "br0", "up")
        for node in NODES:
            ns = self.ns(node)
            _ip("netns", "add", ns)
            self.namespaces.append(ns)
            _ip("-n", ns, "link", "set", "dev", "lo", "up")
            a, b = self.iface(node, True), self.iface(node, False)
            _ip("-n", sw, "link", "add", "name", a, "type", "veth", "peer", "name", b, "netns", ns)
            _ip("-n", sw, "link", "set", "dev", a, "master", "br0")
            _ip("-n", sw, "link", "set", "dev", a, "up")
            _ip("-n", ns, "addr", "add", f"{self.ip(node)}/24", "dev", b)
            _ip("-n", ns, "link", "set", "dev", b, "up")

    def cut(self, a: str, b: str) -> None:
        """Each of ``a`` and ``b`` sends the other's packets to a MAC nobody has: silently lost."""
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.ns(x), "neigh", "replace", self.ip(y), "lladdr", BOGUS_MAC, "nud", "permanent",
                "dev", self.iface(x, False))
        self.partitions.add((a, b))

    def heal(self, a: str, b: str) -> None:
        for x, y in ((a, b), (b, a)):
            _ip("-n", self.ns(x), "neigh", "del", self.ip(y), "dev", self.iface(x, False), check=False)
        self.partitions.discard((a, b))

    def throttle(self, node: str, rate: str) -> None:
        """Rate-limit ``node``'s link both ways (its egress and the switch port's egress toward it)."""
        for ns, dev in ((self.ns(node), self.iface(node, False)), (f"{self.tag}-sw", self.iface(node, True))):
            _tc(ns, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "32kbit", "latency", "500ms")
        self.slow.add(node)

    def unthrottle(self, node: str) -> None:
        for ns, dev in ((self.ns(node), self.iface(node, False)), (f"{self.tag}-sw", self.iface(node, True))):
            _tc(ns, "qdisc", "del", "dev", dev, "root", check=False)
        self.slow.discard(node)

    def pids(self) -> list[int]:
        """Every process in any of the lab's namespaces."""
        out: list[int] = []
        for ns in self.namespaces:
            r = _ip("netns", "pids", ns, check=False)
            out += [int(p) for p in r.stdout.split()]
        return out

    def close(self) -> None:
        for pid in self.pids():  # only after a failed run: a clean one leaves none (checked)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=60)
        self.namespaces.clear()


# =====================================================================================  the job


def run_job(args: argparse.Namespace) -> int:
    """The coordinator script: LocalCluster in the namespaces, exactly-once training, checkpoints."""
    import numpy as np

    import jaxdist
    from jaxdist.errors import JaxdistError

    hosts: dict[str, str] = json.loads(args.hosts)
    namespaces: dict[str, str] = json.loads(args.namespaces)
    n_batches, epochs = args.batches, args.epochs
    total = n_batches * epochs
    tasks = [n for n in hosts if n != "coordinator"]
    check_now = threading.Event()
    finish = threading.Event()
    stop_status = threading.Event()

    with jaxdist.LocalCluster(num_workers=NUM_WORKERS, num_ps=NUM_PS, ps_backups=True, metrics=False,
                              log_dir=args.log_dir, start_timeout=300.0,
                              hosts={n: hosts[n] for n in tasks},
                              launch_prefix=lambda name: ["ip", "netns", "exec", namespaces[name]]) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            seen = jaxdist.create_variable(np.zeros((n_batches, 1), np.float32), name="seen")
            idsum = jaxdist.create_variable(np.zeros((n_batches, 1), np.float32), name="idsum")
            per_closure = jaxdist.create_variable(np.zeros((total, 1), np.float32), name="per_closure")
            payload = jaxdist.create_variable(np.zeros(PAYLOAD, np.float32), name="payload")
        replicas = strategy.replicas
        assert replicas is not None, "the soak needs ps_backup tasks"
        coord = jaxdist.ClusterCoordinator(strategy)

        def dataset_fn(ctx: Any) -> list[Any]:
            return [np.arange(b * BATCH, (b + 1) * BATCH, dtype=np.int32) for b in range(n_batches)]

        ds = coord.create_per_worker_dataset(dataset_fn, exactly_once=True, num_batches=n_batches, epochs=epochs)
        it = iter(ds)
        mgr = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy, coord, ledger=ds.ledger), args.ckpt, max_to_keep=2)
        resumed = mgr.restore_or_initialize()
        step = int(mgr.checkpoint.step)
        emit({"ev": "started", "resumed": bool(resumed), "step": step, "t": time.time(), "path": resumed})

        def status_loop() -> None:
            while not stop_status.wait(0.3):
                try:
                    # The time is taken after the probes: a line describes the cluster at or before its "t".
                    shards = [list(replicas.status(i)) for i in range(NUM_PS)]
                    pids = {n: cluster.pid(n) for n in tasks}
                    healthy = [w["healthy"] for w in coord.status()]
                    finished = coord.closure_counts.finished
                    emit({"ev": "status", "t": time.time(), "finished": finished, "healthy": healthy, "shards": shards,
                          "pairs": [list(p) for p in replicas.pairs], "pids": pids,
                          # Each pid's start time: the driver signals a pid only while it is still that process.
                          "started": {n: start_time(p) if p else None for n, p in pids.items()},
                          "addresses": {n: cluster.address(n) for n in tasks}})
                except Exception as e:  # a status line is best effort; the driver waits for the next one
                    emit({"ev": "status_error", "error": repr(e)})

        def execute(cmd: dict[str, Any]) -> None:
                try:
                    if cmd["op"] == "kill":
                        cluster.kill(cmd["task"])
                    elif cmd["op"] == "restart":
                        cluster.restart(cmd["task"], timeout=300.0)
                    elif cmd["op"] == "check":
                        check_now.set()
                        return
                    elif cmd["op"] == "finish":
                        finish.set()
                    emit({"ev": "done", "id": cmd["id"]})
                except Exception as e:
                    emit({"ev": "done", "id": cmd["id"], "error": repr(e)})

        def commands() -> None:
            # One thread a command: the background worker chaos and the nemesis' own faults overlap.
            for line in sys.stdin:
                threading.Thread(target=execute, args=(json.loads(line),), daemon=True).start()

        threading.Thread(target=status_loop, daemon=True).start()
        threading.Thread(target=commands, daemon=True).start()

        def train(iterator: Any, cid: int) -> None:
            ids = next(iterator)
            b = int(ids[0]) // BATCH
            seen.scatter_add(np.array([b]), np.ones((1, 1), np.float32))
            idsum.scatter_add(np.array([b]), np.full((1, 1), float(ids.sum()), np.float32))
            per_closure.scatter_add(np.array([cid]), np.ones((1, 1), np.float32))
            payload.assign_add(np.ones(PAYLOAD, np.float32))

        save_retries = 0
        while step < total and not finish.is_set():
            for j in range(n_batches):  # one epoch a round: a checkpoint after each
                coord.schedule(train, args=(it, step + j))
            coord.join()
            step += n_batches
            deadline = time.monotonic() + 300
            while True:
                try:
                    mgr.save(step)
                    break
                except JaxdistError as e:  # documented: a save during a PS failover may fail; retry it
                    save_retries += 1
                    emit({"ev": "save_retry", "step": step, "error": repr(e)})
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.5)
            emit({"ev": "saved", "step": step, "t": time.time()})
        emit({"ev": "trained", "step": step, "save_retries": save_retries})
        if not check_now.wait(900):
            raise TimeoutError("the driver never asked for the final check")
        stop_status.set()
        # Every shard's backup attached (a full sync at the latest) before the replicas are compared.
        give_up = time.monotonic() + 300
        while not all(replicas.status(i) == (True, True) for i in range(NUM_PS)):
            if time.monotonic() > give_up:
                raise TimeoutError(f"backups not attached: {[replicas.status(i) for i in range(NUM_PS)]}")
            time.sleep(0.1)
        variables = {"seen": seen, "idsum": idsum, "per_closure": per_closure, "payload": payload}
        on_primary = {k: v.numpy().copy() for k, v in variables.items()}
        read_first = [p[0] for p in replicas.pairs]
        for i in range(NUM_PS):  # promote each backup by hand, then read the same variables from it
            replicas.fail_over(i)
        on_backup = {k: v.numpy().copy() for k, v in variables.items()}
        read_second = [p[0] for p in replicas.pairs]
        differ = sorted(k for k in variables if not np.array_equal(on_primary[k], on_backup[k]))
        pc = on_primary["per_closure"].ravel()
        runs: list[list[float]] = []
        for x in pc.tolist():
            if runs and runs[-1][0] == x:
                runs[-1][1] += 1
            else:
                runs.append([x, 1])
        emit({"ev": "final", "step": step, "seen": on_primary["seen"].ravel().tolist(),
              "idsum": on_primary["idsum"].ravel().tolist(), "per_closure_runs": runs,
              "payload_values": sorted(set(on_primary["payload"].tolist())), "replicas_differ": differ,
              "read_from": [read_first, read_second]})
        coord.shutdown()
    return 0


# =====================================================================================  the driver


class JobGone(RuntimeError):
    """The job run a command was meant for has exited (a coordinator_kill overtook it)."""


class Job:
    """A run of the job in the coordinator namespace; a thread reads its JSON lines."""

    def __init__(self, soak: Soak, run: int) -> None:
        self.soak = soak
        self.run = run
        a = soak.args
        self.log = open(soak.workdir / f"job-{run}.log", "w")
        lab = soak.lab
        argv = [sys.executable, os.path.abspath(__file__), "--job", "--ckpt", str(soak.workdir / "ckpt"),
                "--log-dir", str(soak.workdir / f"logs-{run}"), "--batches", str(a.batches), "--epochs", str(a.epochs),
                "--hosts", json.dumps({n: lab.ip(n) for n in NODES}),
                "--namespaces", json.dumps({n: lab.ns(n) for n in NODES})]
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        # The job's cluster inherits this environment: "named" makes every data-plane client offer
        # /dev/shm/jaxdist-* files (the kind a SIGKILL could leave behind), "sealed" the default
        # memfd kind first, "off" no shared memory.
        env.update({"named": {"JAXDIST_SHM": "1", "JAXDIST_SHM_SEALED": "0"}, "sealed": {"JAXDIST_SHM": "1"},
                    "off": {"JAXDIST_SHM": "0"}}[a.shm])
        self.proc = subprocess.Popen(["ip", "netns", "exec", lab.ns("coordinator"), *argv], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env)
        self.started_at = time.time()
        self._answers: dict[int, dict[str, Any]] = {}
        self._answers_cv = threading.Condition()
        self._send_lock = threading.Lock()
        self.status: dict[str, Any] | None = None
        self.status_cv = threading.Condition()
        self.started: dict[str, Any] | None = None
        self.trained: dict[str, Any] | None = None
        self.final: dict[str, Any] | None = None
        self.saved_before = 0  # the latest step runs before this one saved (set by Soak.start_job)
        self._next_id = 0
        self._pump = threading.Thread(target=self._read, daemon=True)
        self._pump.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            kind = ev.get("ev")
            if kind == "status":
                with self.status_cv:
                    self.status = ev
                    self.status_cv.notify_all()
                self.soak.note_pids(ev["pids"].values())
            elif kind == "saved":
                self.soak.last_saved = max(self.soak.last_saved, ev["step"])
            elif kind == "started":
                self.started = ev
            elif kind == "trained":
                self.trained = ev
            elif kind == "final":
                self.final = ev
            elif kind == "save_retry":
                self.soak.save_retries += 1
            elif kind == "done":
                with self._answers_cv:
                    self._answers[ev["id"]] = ev
                    self._answers_cv.notify_all()
        with self.status_cv:
            self.status_cv.notify_all()
        with self._answers_cv:
            self._answers_cv.notify_all()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def command(self, op: str, task: str = "", timeout: float = 400.0) -> None:
        """Send ``op`` to the job and wait for its answer (kill/restart of a task it owns); thread-safe.

        Raises:
            JobGone: the job exited (or its stdin closed) before it answered.
            RuntimeError: the job answered with an error, or did not answer within ``timeout``.
        """
        assert self.proc.stdin is not None
        with self._send_lock:
            self._next_id += 1
            cid = self._next_id
            try:
                self.proc.stdin.write(json.dumps({"op": op, "task": task, "id": cid}) + "\n")
                self.proc.stdin.flush()
            except (OSError, ValueError) as e:  # a killed job's pipe
                raise JobGone(f"job run {self.run} gone before {op} {task}: {e!r}") from None
        if op in ("check", "finish"):
            return
        deadline = time.monotonic() + timeout
        with self._answers_cv:
            while cid not in self._answers:
                left = deadline - time.monotonic()
                if not self.alive():
                    raise JobGone(f"job run {self.run} exited before it answered {op} {task}")
                if left <= 0:
                    raise RuntimeError(f"job gave no answer to {op} {task} within {timeout:.0f} s")
                self._answers_cv.wait(min(left, 1.0))
            ev = self._answers.pop(cid)
        if "error" in ev:
            raise RuntimeError(f"job: {op} {task}: {ev['error']}")

    def wait_status(self, pred: Any, timeout: float, after: float = 0.0) -> dict[str, Any] | None:
        """The first status line (emitted after ``after``) that satisfies ``pred``; None on timeout/exit."""
        deadline = time.monotonic() + timeout
        with self.status_cv:
            while True:
                st = self.status
                if st is not None and st["t"] > after and pred(st):
                    return st
                left = deadline - time.monotonic()
                if left <= 0 or not self.alive():
                    return None
                self.status_cv.wait(min(left, 1.0))

    def kill(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.close()

    def close(self) -> None:
        self.proc.wait()
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        self._pump.join(timeout=60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self.log.close()

    def tail(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return (self.soak.workdir / f"job-{self.run}.log").read_text(errors="replace")[-4000:]


def healthy(st: dict[str, Any]) -> bool:
    return all(st["healthy"]) and all(s == [True, True] for s in st["shards"])


class Soak:
    def __init__(self, args: argparse.Namespace, lab: Lab, workdir: Path) -> None:
        self.args = args
        self.lab = lab
        self.workdir = workdir
        self.rng = random.Random(args.seed)
        self.kinds = [k for k in KINDS if k in args.faults]
        self.t0 = time.time()
        self.fault_deadline = self.t0 + args.minutes * 60
        self.records: list[dict[str, Any]] = []
        self.violations: list[str] = []
        # pid -> its start time: a pid alive at the end is ours only if it started then (the machine's
        # other processes reuse pids: pid_max may be 32768).
        self.pids_seen: dict[int, str] = {}
        self.shm_seen: set[str] = set()
        self.last_saved = 0
        self.save_retries = 0
        self.run = 0
        self.job: Job | None = None
        self._stop_sampler = threading.Event()
        # Background worker chaos (--worker-chaos): runs while a fault is held and between faults,
        # paused (its cycle in flight finished first) while the nemesis waits for a recovery.
        self.chaos_rng = random.Random(args.seed + 1)
        self.chaos_paused = threading.Event()
        self.chaos_cycle = threading.Lock()
        self.chaos_kills = 0
        # Workers a fault is acting on: the chaos and the nemesis never restart one task at once
        # (two restarts of one task would race for its port).
        self.busy: set[str] = set()
        self.busy_cv = threading.Condition()
        self.chaos_skipped = 0
        self.measuring = 0  # recoveries being measured (the chaos waits while any is)
        # Units (ALL_UNITS) that faults in progress hold, from their injection to their recovery.
        self.claims: set[str] = set()
        self.whole_waiting = 0  # coordinator faults waiting for every other fault to end
        self.plan_lock = threading.Lock()
        self.planned = 0
        self.stopping = False
        self.out = open(args.out, "a") if args.out else None

    def log(self, obj: dict[str, Any]) -> None:
        emit(obj)
        if self.out is not None:
            self.out.write(json.dumps(obj) + "\n")
            self.out.flush()

    def note_pids(self, pids: Any) -> None:
        for p in pids:
            if p and p not in self.pids_seen:
                started = start_time(p)
                if started is not None:
                    self.pids_seen[p] = started

    def _sample_shm(self) -> None:
        """Remember every /dev/shm/jaxdist-* file a process of the lab holds (mapped or open)."""
        while not self._stop_sampler.wait(1.0):
            for pid in self.lab.pids():
                self.note_pids([pid])
                try:
                    with open(f"/proc/{pid}/maps") as f:
                        for line in f:
                            if "/dev/shm/jaxdist-" in line:
                                self.shm_seen.add(line.split()[-1])
                    for fd in os.listdir(f"/proc/{pid}/fd"):
                        target = os.readlink(f"/proc/{pid}/fd/{fd}")
                        if target.startswith("/dev/shm/jaxdist-"):
                            self.shm_seen.add(target.split(" ")[0])
                except OSError:
                    continue

    # ------------------------------------------------------------------ job runs
    def start_job(self) -> Job:
        """Launch the next run. The previous run's process is gone and its output read (kill() and
        close() wait for both), so ``saved_before`` is every step an earlier run acknowledged."""
        self.run += 1
        saved_before = self.last_saved
        self.job = Job(self, self.run)
        self.job.saved_before = saved_before
        return self.job

    def wait_started(self, job: Job, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while job.started is None:
            if time.monotonic() > deadline or not job.alive():
                raise RuntimeError(f"job run {job.run} did not start; log:\n{job.tail()}")
            time.sleep(0.1)
        # Against what earlier runs saved, not self.last_saved: by the time this poll sees the
        # "started" line, the new run may have trained an epoch and saved it already.
        if job.started["step"] < job.saved_before:
            self.violations.append(f"run {job.run} resumed at step {job.started['step']} but step {job.saved_before} "
                                   f"was saved (an acknowledged checkpoint lost): {job.started}")

    def _worker_chaos(self) -> None:
        while not self._stop_sampler.wait(self.chaos_rng.uniform(0.5, 1.5) * self.args.worker_chaos):
            victim = f"worker:{self.chaos_rng.randrange(NUM_WORKERS)}"
            downtime = self.chaos_rng.uniform(0.2, 2.0)
            if self.chaos_paused.is_set():
                continue
            with self.busy_cv:
                if victim in self.busy:
                    continue  # the nemesis is acting on it
                self.busy.add(victim)
            try:
                self._chaos_cycle(victim, downtime)
            finally:
                with self.busy_cv:
                    self.busy.discard(victim)
                    self.busy_cv.notify_all()

    def _chaos_cycle(self, victim: str, downtime: float) -> None:
        with self.chaos_cycle:
            job = self.job
            if job is None or not job.alive():
                return
            try:
                job.command("kill", victim)
                self.chaos_kills += 1
                time.sleep(downtime)  # the worker's downtime, not a synchronisation
                job.command("restart", victim)
            except JobGone:
                self.chaos_skipped += 1  # a coordinator_kill overtook it: its cluster is gone anyway
            except RuntimeError as e:
                self.violations.append(f"background chaos: {e}")

    def pause_chaos(self) -> None:
        """A recovery is being measured: the background chaos waits (its cycle in flight, if any, ends first)."""
        with self.busy_cv:
            self.measuring += 1
            self.chaos_paused.set()
        with self.chaos_cycle:  # the cycle in flight (if any) has restarted its worker
            pass

    def resume_chaos(self) -> None:
        with self.busy_cv:
            self.measuring -= 1
            if not self.measuring:
                self.chaos_paused.clear()

    # ------------------------------------------------------------------ faults
    def plan(self) -> Any:
        """The fault schedule: the kinds in a seeded shuffled order, round after round, each with its
        choices (target, length, the gap before it) drawn from the seed in the same order, whichever
        lane injects it."""
        rng = self.rng
        while True:
            order = list(self.kinds)
            rng.shuffle(order)
            for kind in order:
                # Downtimes on both sides of the failure timeout (3 s) and of the PS failover delay (1.5 s).
                item: dict[str, Any] = {"kind": kind, "gap": rng.uniform(*self.args.interval),
                                        "hold": rng.uniform(0.5, 3.0) if kind.endswith("_kill") else rng.uniform(0.5, 8.0)}
                if kind in ("worker_kill", "worker_stop"):
                    item["target"] = f"worker:{rng.randrange(NUM_WORKERS)}"
                elif kind.startswith("ps_"):
                    item["shard"] = rng.randrange(NUM_PS)
                elif kind.startswith("coordinator"):
                    item["target"] = "coordinator"
                elif kind == "partition":
                    a, b = rng.sample(sorted(NODES), 2)
                    item["target"] = f"{a}|{b}"
                    item["hold"] = rng.uniform(2.0, 8.0)
                else:
                    item["target"] = rng.choice(sorted(NODES))
                    item["rate"] = rng.choice(["1mbit", "2mbit", "4mbit"])
                    item["hold"] = rng.uniform(2.0, 8.0)
                yield item

    @staticmethod
    def unit(node: str) -> str:
        """What a fault on ``node`` puts at risk: its worker, its shard (primary and backup together), or
        the coordinator. Two faults overlap only on different units."""
        role, _, index = node.partition(":")
        return f"shard:{index}" if role in ("ps", "ps_backup") else node

    def units_of(self, item: dict[str, Any]) -> set[str]:
        if item["kind"].startswith("coordinator"):
            return set(ALL_UNITS)  # the whole job: no other fault overlaps a coordinator fault's injection
        if "shard" in item:
            return {f"shard:{item['shard']}"}
        return {self.unit(n) for n in item["target"].split("|")}

    def claim(self, units: set[str]) -> int:
        """Wait until no other fault holds any of ``units``, then hold them; returns how many other units
        were held by faults in progress at that moment (the overlap)."""
        with self.busy_cv:
            whole = units == set(ALL_UNITS)
            if whole:
                self.whole_waiting += 1
            try:
                # A fault on the whole job waits for every other fault, and new faults wait for it (no starving).
                while (self.claims & units) or (not whole and self.whole_waiting):
                    self.busy_cv.wait()
            finally:
                if whole:
                    self.whole_waiting -= 1
            overlap = len(self.claims)
            self.claims |= units
            return overlap

    def release(self, units: set[str]) -> None:
        with self.busy_cv:
            self.claims -= units
            self.busy_cv.notify_all()

    def unit_ok(self, st: dict[str, Any], unit: str) -> bool:
        role, _, index = unit.partition(":")
        if role == "worker":
            return bool(st["healthy"][int(index)])
        if role == "shard":
            return st["shards"][int(index)] == [True, True]
        return True  # the coordinator: it answers (this status line is its own)

    def _act(self, kind: str, target: str, rec: dict[str, Any], hold: float, job: Job, st: dict[str, Any]) -> tuple[float, float]:
        """Inject ``kind`` on ``target`` for ``hold`` seconds and lift it; returns (when it was injected,
        when it was lifted: for a coordinator_kill the re-run's launch)."""
        t_inject = time.time()
        if kind.endswith("_kill") and target != "coordinator":
            job.command("kill", target)
            time.sleep(hold)  # the downtime (the fault's length), not a synchronisation
            job.command("restart", target)
        elif kind.endswith("_stop"):
            # The job is this driver's child (its pid stays its own until it is waited for); a task's pid is
            # from a status line, and that task may have exited since and its pid gone to another process.
            if target == "coordinator":
                proc = SameProcess.open(job.proc.pid, start_time(job.proc.pid))
            else:
                proc = SameProcess.open(st["pids"][target], st.get("started", {}).get(target))
            if proc is None:
                rec["not_injected"] = f"{target}'s process (pid from the status line) exited since: its pid may be another's"
                return t_inject, time.time()
            with proc:
                proc.send(signal.SIGSTOP)
                try:
                    time.sleep(hold)
                finally:
                    proc.send(signal.SIGCONT)
        elif kind == "coordinator_kill":
            pids = [p for p in st.get("pids", {}).values() if p]
            job.kill()
            # The tasks poll their launcher: they exit by themselves. The re-run starts once all are gone.
            if not poll(lambda: not any(alive(p) for p in pids) and not self.lab.pids(), 120):
                self.violations.append(f"tasks of run {job.run} still alive 120 s after its coordinator was killed")
            relaunched = time.time()
            job = self.start_job()
            self.wait_started(job, 600)
            # Faults on its tasks need their pids and the shards' pairs: the re-run's first status line.
            if job.wait_status(lambda s: True, 600, after=relaunched) is None:
                raise RuntimeError(f"job run {job.run} gave no status; log:\n{job.tail()}")
            return t_inject, relaunched
        elif kind == "partition":
            a, b = target.split("|")
            self.lab.cut(a, b)
            try:
                time.sleep(hold)
            finally:
                self.lab.heal(a, b)
        else:
            self.lab.throttle(target, rec["rate"])
            try:
                time.sleep(hold)
            finally:
                self.lab.unthrottle(target)
        return t_inject, time.time()

    def inject(self, item: dict[str, Any]) -> dict[str, Any]:
        """Inject one fault of the plan, lift it and wait for the recovery of what it touched; returns its
        record. Faults of other lanes may be in progress on other units meanwhile."""
        kind, hold = item["kind"], item["hold"]
        units = self.units_of(item)
        overlap = self.claim(units)
        try:
            job = self.job
            assert job is not None
            st = job.status or {}
            rec: dict[str, Any] = {"ev": "fault", "kind": kind, "run": job.run}
            if "shard" in item:
                address = st["pairs"][item["shard"]][0 if kind.startswith("ps_primary") else 1]
                target = next(n for n, a in st["addresses"].items() if a == address)
            else:
                target = item["target"]
            if "rate" in item:
                rec["rate"] = item["rate"]
            workers = [n for n in target.split("|") if n.startswith("worker:")] if kind.startswith("worker") else []
            claimed = time.time()
            with self.busy_cv:
                while any(w in self.busy for w in workers):  # the background chaos' cycle on it ends with a restart
                    self.busy_cv.wait()
                self.busy.update(workers)
            try:
                # A stopped worker's pid from a status line newer than the claim: a restart changes it.
                if kind == "worker_stop":
                    st = job.wait_status(lambda s: True, self.args.recovery_timeout, after=claimed) or st
                rec["target"] = target
                rec["hold_s"] = round(hold, 2)
                rec["overlap"] = overlap
                t_inject, t_heal = self._act(kind, target, rec, hold, job, st)
            finally:
                with self.busy_cv:
                    self.busy.difference_update(workers)
                    self.busy_cv.notify_all()
            job = self.job
            assert job is not None
            # A re-run coordinator has recovered once it trains again (from its launch: cluster start and
            # restore included) with every unit that no other fault holds healthy; every other fault once
            # what it touched is healthy and the job trained more closures than when it was lifted.
            finished_at_heal = job.status["finished"] if (job.status and kind != "coordinator_kill") else 0
            if kind.startswith("coordinator"):
                # Faults on the tasks may start on the job while it recovers; another coordinator fault
                # (or a link fault of the coordinator) waits: it would end the run this one measures.
                self.release(units - {"coordinator"})
                units = {"coordinator"}

                def recovered(s: dict[str, Any]) -> bool:
                    with self.busy_cv:
                        others = set(self.claims)
                    return s["finished"] > finished_at_heal and all(self.unit_ok(s, u) for u in ALL_UNITS if u not in others)
            else:
                def recovered(s: dict[str, Any]) -> bool:
                    return s["finished"] > finished_at_heal and all(self.unit_ok(s, u) for u in units)
            self.pause_chaos()
            try:
                rec["at_s"] = round(t_inject - self.t0, 1)  # when it was injected, from the soak's start
                rec["outage_s"] = round(t_heal - t_inject, 3)
                got = job.wait_status(recovered, self.args.recovery_timeout, after=t_heal)
                if got is None:
                    if job.trained is not None and job.status is not None and healthy(job.status):
                        rec["recovery_s"] = None  # training ended meanwhile: nothing left to make progress on
                    elif not job.alive():
                        self.violations.append(f"job run {job.run} exited while recovering from {kind} of {target}; "
                                               f"log:\n{job.tail()}")
                        rec["recovery_s"] = None
                    else:
                        self.violations.append(f"no recovery within {self.args.recovery_timeout:.0f} s after {kind} of "
                                               f"{target} (last status {job.status})")
                        rec["recovery_s"] = None
                else:
                    rec["recovery_s"] = round(got["t"] - t_heal, 3)
            finally:
                self.resume_chaos()
            rec["run"] = job.run
            return rec
        finally:
            self.release(units)

    # ------------------------------------------------------------------ the soak
    def _lane(self, plan: Any) -> None:
        """One lane of faults: take the plan's next fault, wait its gap, inject it, until the time is up."""
        args = self.args
        while True:
            with self.plan_lock:
                if self.stopping or time.time() >= self.fault_deadline or (self.job and self.job.trained is not None):
                    return
                if args.rounds and self.planned >= args.rounds * len(self.kinds):
                    return
                item = next(plan)
                self.planned += 1
            time.sleep(item["gap"])  # the nemesis' cadence
            try:
                rec = self.inject(item)
            except Exception as e:
                with self.plan_lock:
                    self.stopping = True
                self.violations.append(f"soak error: {e!r}")
                with self.busy_cv:
                    self.busy_cv.notify_all()
                return
            with self.plan_lock:
                self.records.append(rec)
                self.log(rec)
                if self.violations:
                    self.stopping = True

    def go(self) -> int:
        args = self.args
        self.log({"ev": "seed", "seed": args.seed, "faults": self.kinds, "minutes": args.minutes,
                  "replay": f"{sys.executable} {os.path.abspath(__file__)} --seed {args.seed} --minutes {args.minutes} "
                            f"--rounds {args.rounds} --faults {','.join(self.kinds)} "
                            f"--interval {','.join(str(x) for x in args.interval)} --lanes {args.lanes} "
                            f"--batches {args.batches} --epochs {args.epochs} --shm {args.shm} "
                            f"--worker-chaos {args.worker_chaos}"})
        sampler = threading.Thread(target=self._sample_shm, daemon=True)
        sampler.start()
        chaos = threading.Thread(target=self._worker_chaos, daemon=True) if args.worker_chaos else None
        self.chaos_paused.set()  # until the job trains
        if chaos is not None:
            chaos.start()
        job = self.start_job()
        try:
            self.wait_started(job, 600)
            if job.wait_status(lambda s: healthy(s) and s["finished"] > 0, 600) is None:
                raise RuntimeError(f"the job never trained; log:\n{job.tail()}")
            self.chaos_paused.clear()
            plan = self.plan()
            lanes = [threading.Thread(target=self._lane, args=(plan,), daemon=True) for _ in range(args.lanes)]
            for lane in lanes:
                lane.start()
            for lane in lanes:
                lane.join()
            job = self.job  # type: ignore[assignment]
            assert job is not None
            self.pause_chaos()
            if not self.violations:
                self.finish(job)
        except Exception as e:
            self.violations.append(f"soak error: {e!r}")
        finally:
            if self.job is not None and self.job.alive():
                self.job.kill()
            self._stop_sampler.set()
            sampler.join()
            if chaos is not None:
                chaos.join()
            self.leftovers()
        summary = self.summary()
        self.log(summary)
        if self.violations and self.job is not None:
            sys.stderr.write(f"last job log:\n{self.job.tail()}\n")
        return 0 if not self.violations else 1

    def finish(self, job: Job) -> None:
        job.command("finish")
        if not poll(lambda: job.trained is not None or not job.alive(), 900):
            raise RuntimeError("the job did not finish its last epoch")
        if job.trained is None:
            raise RuntimeError(f"the job exited before the end; log:\n{job.tail()}")
        job.command("check", timeout=0)
        if not poll(lambda: job.final is not None or not job.alive(), 600):
            raise RuntimeError("no final values from the job")
        if job.final is None:
            raise RuntimeError(f"the job exited without its final values; log:\n{job.tail()}")
        if job.proc.wait(300) != 0:
            self.violations.append(f"job exited {job.proc.returncode}; log:\n{job.tail()}")
        job.close()
        self.check(job.final)

    def check(self, final: dict[str, Any]) -> None:
        n, step = self.args.batches, final["step"]
        done_epochs = step // n
        if step % n:
            self.violations.append(f"final step {step} is not a whole number of epochs")
        for b, (s, ids) in enumerate(zip(final["seen"], final["idsum"])):
            want_ids = done_epochs * sum(range(b * BATCH, (b + 1) * BATCH))
            if s != done_epochs or ids != want_ids:
                self.violations.append(f"batch {b}: trained {s} times (want {done_epochs}), id sum {ids} (want {want_ids})")
        want_runs = [[1.0, step]] + ([[0.0, self.args.batches * self.args.epochs - step]] if step < n * self.args.epochs else [])
        if final["per_closure_runs"] != want_runs:
            self.violations.append(f"per-closure counters {final['per_closure_runs'][:20]} (want {want_runs})")
        if final["payload_values"] != [float(step)]:
            self.violations.append(f"payload elements {final['payload_values'][:10]} (want all {step})")
        first, second = final["read_from"]
        if any(a == b for a, b in zip(first, second)):
            self.violations.append(f"the replicas were not both read: {first} then {second}")
        if final["replicas_differ"]:
            self.violations.append(f"primary and backup differ in {final['replicas_differ']}")
        self.final_step = step

    def leftovers(self) -> None:
        if not poll(lambda: not self.lab.pids(), 120):
            self.violations.append(f"processes left in the namespaces: {self.lab.pids()}")
        left = sorted(p for p, started in self.pids_seen.items() if alive(p) and start_time(p) == started)
        if left:
            self.violations.append(f"processes left behind: {left}")
        shm = sorted(f for f in self.shm_seen if os.path.exists(f))
        if shm:
            self.violations.append(f"shared-memory files left behind: {shm}")

    def summary(self) -> dict[str, Any]:
        by_kind: dict[str, list[float]] = {k: [] for k in self.kinds}
        counts = Counter(r["kind"] for r in self.records if "not_injected" not in r)
        for r in self.records:
            if r.get("recovery_s") is not None and "not_injected" not in r:
                by_kind[r["kind"]].append(r["recovery_s"])
        rec = {k: {"n": len(v), "median_s": round(statistics.median(v), 3), "max_s": round(max(v), 3)}
               for k, v in by_kind.items() if v}
        return {"ev": "summary", "seed": self.args.seed, "elapsed_s": round(time.time() - self.t0, 1),
                "faults": {k: counts.get(k, 0) for k in self.kinds}, "total_faults": sum(counts.values()),
                "recovery": rec, "coordinator_runs": self.run, "closures": getattr(self, "final_step", None),
                "lanes": self.args.lanes, "overlapped_faults": sum(1 for r in self.records if r.get("overlap")),
                "not_injected": sum(1 for r in self.records if "not_injected" in r),
                "save_retries": self.save_retries, "background_worker_kills": self.chaos_kills,
                "background_cycles_overtaken": self.chaos_skipped, "shm_files_seen": len(self.shm_seen),
                "violations": self.violations}


class SameProcess:
    """One process, named by its pid and its start time; signals reach it, never a process that took the
    pid after it exited. On Linux a pidfd holds the process itself (checked against the start time once
    opened, so no later reuse of the pid can redirect a signal); elsewhere the start time is checked
    before each signal."""

    def __init__(self, pid: int, started: str, fd: int | None) -> None:
        self.pid, self.started, self._fd = pid, started, fd

    @classmethod
    def open(cls, pid: int | None, started: str | None) -> SameProcess | None:
        """The process with ``pid`` if it is still the one that started at ``started`` (field 22 of
        /proc/PID/stat), else None (it exited; its pid may be another process's now)."""
        if not pid or started is None:
            return None
        fd = None
        if hasattr(os, "pidfd_open"):
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return None
            except OSError:  # no pidfd support (old kernel): the start-time check before each signal
                fd = None
        if start_time(pid) != started:
            if fd is not None:
                os.close(fd)
            return None
        return cls(pid, started, fd)

    def send(self, sig: int) -> bool:
        """Signal the process; False when it has exited meanwhile (nothing else is signalled)."""
        try:
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, sig)
            elif start_time(self.pid) == self.started:
                os.kill(self.pid, sig)
            else:
                return False
        except ProcessLookupError:
            return False
        return True

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> SameProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_time(pid: int) -> str | None:
    """The process' start time (clock ticks since boot, /proc/PID/stat field 22); None: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def poll(pred: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--seed", type=int, default=None, help="the schedule's seed (default: a new one, printed)")
    p.add_argument("--minutes", type=float, default=10.0, help="how long faults are injected")
    p.add_argument("--rounds", type=int, default=0,
                   help="stop after this many rounds of every kind (default 0: only --minutes ends the faults)")
    p.add_argument("--shm", choices=("named", "sealed", "off"), default="named",
                   help="shared-memory kind the job's processes offer (default named: /dev/shm files, checked for leftovers)")
    p.add_argument("--faults", default=",".join(KINDS), help=f"comma-separated kinds (default all: {','.join(KINDS)})")
    p.add_argument("--interval", type=lambda s: tuple(float(x) for x in s.split(",")), default=(0.2, 1.0),
                   help="seconds a lane waits between one fault's recovery and its next fault, drawn from this range "
                        "(default 0.2,1)")
    p.add_argument("--lanes", type=int, default=3,
                   help="faults in progress at once, at most (default 3): each lane injects the schedule's next fault "
                        "on a worker, shard or link that no other fault holds; a coordinator fault waits for the others "
                        "and holds the whole job until its re-run answers")
    p.add_argument("--worker-chaos", type=float, default=0.0, metavar="SECONDS",
                   help="also SIGKILL and restart a random worker about every SECONDS in the background, overlapping "
                        "the other faults (a coordinator_kill included); 0 (default): off")
    p.add_argument("--batches", type=int, default=16, help="batches an epoch")
    p.add_argument("--epochs", type=int, default=0,
                   help="the most epochs (training ends after the faults; default: enough for --minutes at 120 closures/s, "
                        "at most the 2**24 / (examples a batch * largest id) that keeps float32 sums exact)")
    p.add_argument("--recovery-timeout", type=float, default=300.0, help="a fault not recovered from by then is a violation")
    p.add_argument("--out", default=None, help="also append the JSON lines to this file")
    p.add_argument("--workdir", default=None, help="checkpoints and logs (default: a temporary folder, kept on failure)")
    # The job's own arguments (the driver passes them).
    p.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ckpt", help=argparse.SUPPRESS)
    p.add_argument("--log-dir", help=argparse.SUPPRESS)
    p.add_argument("--hosts", help=argparse.SUPPRESS)
    p.add_argument("--namespaces", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.lanes < 1:
        p.error("--lanes must be >= 1")
    if args.job:
        return run_job(args)
    args.faults = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(args.faults) - set(KINDS))
    if unknown or not args.faults:
        p.error(f"unknown fault kinds {unknown}; choose from {list(KINDS)}")
    exact_limit = (1 << 24) // sum(range((args.batches - 1) * BATCH, args.batches * BATCH))
    if not args.epochs:
        args.epochs = min(exact_limit, int(args.minutes * 60 * 120 / args.batches) + 100)
    if args.epochs > exact_limit:
        p.error(f"--epochs above {exact_limit} would make the float32 id sums inexact")
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(1 << 31)
    why = netns_unavailable()
    if why:
        print(f"nemesis: cannot run here: {why}", file=sys.stderr)
        return 77
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="jaxdist-nemesis-"))
    workdir.mkdir(parents=True, exist_ok=True)
    lab = Lab()
    # A SIGTERM (a timeout) still removes the namespaces: the finally below runs.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        lab.build()
        code = Soak(args, lab, workdir).go()
    finally:
        lab.close()
    if code == 0 and args.workdir is None:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"nemesis: checkpoints and logs in {workdir}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
