"""LocalCluster: a real cluster of PS and worker processes on this machine.

Each task is a separate ``python -m jaxdist.ps_server`` / ``python -m
jaxdist.worker`` process bound to ``127.0.0.1`` port 0; the cluster waits until
every task answers its gRPC health check, then hands back a resolver. A
random token authenticates every call.

Nothing outlives the cluster: ``stop()`` (or leaving the ``with`` block)
terminates every task, an ``atexit`` hook does the same when the script ends
without stopping it, and each task asks the kernel to kill it when its
launcher dies (it polls its parent pid), so even a SIGKILLed coordinator leaves
no process behind.

With ``tls_dir`` every task serves mutual TLS with certificates from that
directory (made by :func:`jaxdist.tools.certs.generate` when missing); the
cluster's :attr:`~LocalCluster.credentials` (token and TLS) are what its
resolver hands to a strategy in this process. With ``metrics`` (the default)
every task serves Prometheus metrics on a free port: :meth:`metrics_address`.

Logs: each task logs to ``<log_dir>/<role>-<index>.log``. A temporary log
folder is removed when the cluster stops cleanly, and kept (its path logged)
when it did not: a task died on its own, start-up failed, or the ``with``
block raised.

Fault injection for tests and SREs: :meth:`kill` (SIGKILL), :meth:`restart`
(same address), :meth:`partition` (freeze a task with SIGSTOP for some
seconds: its peers see a silent, unreachable task, as in a network cut).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import random
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

from jaxdist.base.cluster_resolver import ClusterSpec, SimpleClusterResolver
from jaxdist.base.cluster_resolver.base import ENV_TOKEN
from jaxdist.base.cluster_resolver.tfconfig import ENV_JAXDIST_CLUSTER
from jaxdist.base.errors import ConfigurationError
from jaxdist.transport.channel import wait_healthy
from jaxdist.base.task_process import ENV_PARENT_PID, task_environment
from jaxdist.transport.credentials import Credentials, TLSConfig

logger = logging.getLogger(__name__)

__all__ = ["LocalCluster"]

_MODULES = {"ps": "jaxdist.ps_server", "ps_backup": "jaxdist.ps_server", "worker": "jaxdist.worker"}


@dataclass
class _Task:
    role: str
    index: int
    host: str = "127.0.0.1"
    port: int = 0
    metrics_port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log_path: str = ""
    log_file: IO[bytes] | None = field(default=None, repr=False)
    reader: threading.Thread | None = field(default=None, repr=False)  # reads the ready line, then to EOF
    extra_args: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"{self.role}:{self.index}"

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


def _parse_task(task: str | tuple[str, int]) -> tuple[str, int]:
    if isinstance(task, tuple):
        return task
    role, _, idx = task.partition(":")
    if role not in _MODULES or not idx.isdigit():
        raise ValueError(f"task must look like 'worker:0', 'ps:1' or 'ps_backup:1', got {task!r}")
    return role, int(idx)


class LocalCluster:
    """``num_ps`` PS and ``num_workers`` worker processes on loopback.

    Args:
        num_workers: worker processes.
        num_ps: parameter-server processes.
        token: auth token; a random one by default.
        start_timeout: seconds to wait for every task to be healthy.
        log_dir: where task logs go (created if missing; default: a temporary
            folder, removed after a clean stop; see :meth:`logs`).
        env: extra environment for the tasks.
        ps_args: extra command-line arguments for every PS task.
        ps_backups: also start one backup PS per PS task (job ``ps_backup``):
            the strategy then replicates every shard (primary/backup).
        tls_dir: serve mutual TLS with the certificates in this directory
            (``jaxdist certs`` layout; generated for 127.0.0.1/localhost when
            missing); :attr:`credentials` and :meth:`cluster_resolver` carry
            them for clients in this process.
        metrics: every task serves Prometheus metrics on a free port
            (:meth:`metrics_address`).
        hosts: task name (``"ps:0"``) -> the address that task binds and is
            reached at (default ``127.0.0.1``); for tasks on other interfaces,
            e.g. each in its own network namespace.
        launch_prefix: task name -> the argv that runs the task's command
            (e.g. ``["ip", "netns", "exec", "ns0"]``); the prefix must exec the
            command in place (the launched pid is the task's), as ``ip netns
            exec`` and ``env`` do, so kill, restart and partition reach the task.
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        *,
        token: str | None = None,
        start_timeout: float = 120.0,
        log_dir: str | None = None,
        env: dict[str, str] | None = None,
        ps_args: list[str] | None = None,
        tls_dir: str | None = None,
        metrics: bool = True,
        ps_backups: bool = False,
        hosts: Mapping[str, str] | None = None,
        launch_prefix: Callable[[str], Sequence[str]] | None = None,
    ) -> None:
        if num_workers < 0 or num_ps < 0:
            raise ConfigurationError("num_workers and num_ps must be >= 0")
        self.token = token or secrets.token_hex(16)
        self.start_timeout = start_timeout
        self._own_log_dir = log_dir is None
        if log_dir is not None:
            try:
                os.makedirs(log_dir, exist_ok=True)
            except OSError as e:
                raise ConfigurationError(f"LocalCluster: cannot create log_dir {log_dir!r}: {e}") from None
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="jaxdist-cluster-")
        # Whether the logs are worth keeping: start-up failed, the with-block raised, or a task died
        # on its own (not through kill()/restart()/terminate()/stop()).
        self._failed = False
        self._expected_exit: set[tuple[str, int]] = set()
        self._env = dict(env or {})
        self._ps_args = list(ps_args or [])
        self.tls_dir = tls_dir
        self.tls: TLSConfig | None = None
        self.metrics = metrics
        self._tasks = {("ps", i): _Task("ps", i) for i in range(num_ps)}
        if ps_backups:
            self._tasks.update({("ps_backup", i): _Task("ps_backup", i) for i in range(num_ps)})
        self._tasks.update({("worker", i): _Task("worker", i) for i in range(num_workers)})
        self._hosts = dict(hosts or {})
        unknown = sorted(set(self._hosts) - {t.name for t in self._tasks.values()})
        if unknown:
            raise ConfigurationError(f"LocalCluster: hosts names tasks the cluster does not have: {unknown}")
        for t in self._tasks.values():
            t.host = self._hosts.get(t.name, t.host)
        self._launch_prefix = launch_prefix
        self._lock = threading.Lock()
        self._started = False
        self._timers: list[threading.Timer] = []

    # --------------------------------------------------------------- lifecycle
    def start(self) -> LocalCluster:
        """Start every task and wait until all are healthy; returns self."""
        if self._started:
            return self
        self._started = True
        atexit.register(self.stop)
        try:
            if self.tls_dir is not None:
                from jaxdist.tools import certs

                if not certs.exists(self.tls_dir):
                    certs.generate(self.tls_dir, ["127.0.0.1", "localhost"])
                self.tls = certs.paths(self.tls_dir).server_tls()
            ready: queue.Queue[tuple[_Task, int | None]] = queue.Queue()
            for t in self._tasks.values():
                self._spawn(t, ready)
            self._await_ready(list(self._tasks.values()), ready)
        except BaseException:
            self._failed = True
            self.stop()
            raise
        logger.info("local cluster up: %s", self.cluster_spec)
        return self

    def _spawn(self, t: _Task, ready: queue.Queue[tuple[_Task, int | None]], extra: list[str] | None = None) -> None:
        env = dict(os.environ)
        env.update(self._env)
        env = task_environment(env)  # malloc settings up front: no re-exec in the task
        env[ENV_TOKEN] = self.token
        env[ENV_PARENT_PID] = str(os.getpid())
        env.setdefault("JAX_PLATFORMS", "cpu")
        env.pop(ENV_JAXDIST_CLUSTER, None)
        if self.tls is not None:
            env.update(self.tls.env())
        cmd = [sys.executable, "-m", _MODULES[t.role], "--host", t.host, "--port", str(t.port), "--task-index", str(t.index)]
        if self.metrics:
            cmd += ["--metrics-port", "0"]
        if t.role in ("ps", "ps_backup"):
            cmd += self._ps_args
        cmd += extra or t.extra_args
        if self._launch_prefix is not None:
            cmd = [*self._launch_prefix(t.name), *cmd]
        t.extra_args = list(extra or t.extra_args)
        self._expected_exit.discard((t.role, t.index))  # a new process: its own death would be news
        t.log_path = os.path.join(self.log_dir, f"{t.role}-{t.index}.log")
        self._reap(t)  # a previous process of this task (restart): close what it held
        t.log_file = open(t.log_path, "ab")
        t.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=t.log_file, stdin=subprocess.DEVNULL, env=env)
        t.reader = threading.Thread(target=self._read_ready, args=(t, t.proc, ready), name=f"jaxdist-launch-{t.name}", daemon=True)
        t.reader.start()

    @staticmethod
    def _reap(t: _Task) -> None:
        """Release the pipe, log file and reader thread of ``t``'s process once it has exited."""
        if t.proc is None or t.proc.poll() is None:
            return
        if t.reader is not None:
            t.reader.join(10.0)  # it ends at EOF, which the exit delivers
            t.reader = None
        if t.proc.stdout is not None and not t.proc.stdout.closed:
            t.proc.stdout.close()
        if t.log_file is not None:
            t.log_file.close()
            t.log_file = None

    @staticmethod
    def _read_ready(t: _Task, proc: subprocess.Popen[bytes], ready: queue.Queue[tuple[_Task, int | None]]) -> None:
        assert proc.stdout is not None
        port = None
        for raw in proc.stdout:
            line = raw.decode(errors="replace").strip()
            if line.startswith("JAXDIST_READY") and port is None:
                fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
                port = int(fields["port"])
                t.metrics_port = int(fields.get("metrics_port", 0))
                ready.put((t, port))
        if port is None:
            ready.put((t, None))  # exited before announcing a port

    def _await_ready(self, tasks: list[_Task], ready: queue.Queue[tuple[_Task, int | None]]) -> None:
        deadline = time.monotonic() + self.start_timeout
        pending = {t.name for t in tasks}
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"tasks {sorted(pending)} did not start within {self.start_timeout:.0f}s; logs in {self.log_dir}")
            try:
                t, port = ready.get(timeout=left)
            except queue.Empty:
                continue
            if port is None:
                raise RuntimeError(f"{t.name} exited during start-up (code {t.proc.poll() if t.proc else '?'}):\n{self.logs(t.name)[-3000:]}")
            t.port = port
            pending.discard(t.name)
        for t in tasks:
            wait_healthy(t.address, max(1.0, deadline - time.monotonic()), self.credentials)

    @property
    def credentials(self) -> Credentials:
        """The cluster's token and TLS material, for clients in this process."""
        return Credentials(self.token, self.tls)

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate every task (SIGTERM, then SIGKILL after ``timeout``). Idempotent."""
        for timer in self._timers:
            timer.cancel()
        procs = [t for t in self._tasks.values() if t.proc is not None]
        for t in procs:
            code = t.proc.poll()  # type: ignore[union-attr]
            if code not in (None, 0) and (t.role, t.index) not in self._expected_exit:
                self._failed = True  # it died on its own: keep its log
            if code is None:
                try:
                    t.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
                    t.proc.terminate()  # type: ignore[union-attr]
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + timeout
        for t in procs:
            try:
                t.proc.wait(max(0.1, deadline - time.monotonic()))  # type: ignore[union-attr]
            except subprocess.TimeoutExpired:
                t.proc.kill()  # type: ignore[union-attr]
                t.proc.wait()  # type: ignore[union-attr]
            self._reap(t)
        atexit.unregister(self.stop)
        if self._own_log_dir and procs:
            if self._failed:
                logger.warning("local cluster logs kept in %s", self.log_dir)
            else:
                shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is not None:
            self._failed = True
        self.stop()

    # ------------------------------------------------------------------ views
    @property
    def cluster_spec(self) -> ClusterSpec:
        jobs: dict[str, list[str]] = {}
        for role in ("ps", "ps_backup", "worker"):
            ts = sorted((t for t in self._tasks.values() if t.role == role), key=lambda t: t.index)
            if ts:
                jobs[role] = [t.address for t in ts]
        return ClusterSpec(jobs)

    def cluster_resolver(self) -> SimpleClusterResolver:
        """A resolver for a coordinator in this process (carries the token and TLS material)."""
        return SimpleClusterResolver(self.cluster_spec, token=self.token, tls=self.tls)

    def coordinator_env(self) -> dict[str, str]:
        """Environment for a coordinator script in another process (``jaxdist launch``)."""
        env = {
            ENV_JAXDIST_CLUSTER: json.dumps({"cluster": self.cluster_spec.as_dict(), "task": {}}),
            ENV_TOKEN: self.token,
        }
        if self.tls is not None:
            env.update(self.tls.env())
        return env

    def pid(self, task: str | tuple[str, int]) -> int | None:
        t = self._tasks[_parse_task(task)]
        return t.proc.pid if t.proc is not None else None

    def is_running(self, task: str | tuple[str, int]) -> bool:
        t = self._tasks[_parse_task(task)]
        return t.proc is not None and t.proc.poll() is None

    def exit_code(self, task: str | tuple[str, int]) -> int | None:
        t = self._tasks[_parse_task(task)]
        return None if t.proc is None else t.proc.poll()

    def wait_exit(self, timeout: float) -> dict[str, int | None]:
        """Wait for every task to exit by itself (e.g. after the coordinator's shutdown).

        Returns each task's exit code (None: still running). Exits reported here are the
        caller's to judge: a non-zero code seen by ``wait_exit`` does not mark the cluster
        failed (its logs are removed at a clean ``stop``); a task still running does not either.
        """
        deadline = time.monotonic() + timeout
        out: dict[str, int | None] = {}
        for t in self._tasks.values():
            if t.proc is None:
                continue
            try:
                out[t.name] = t.proc.wait(max(0.0, deadline - time.monotonic()))
                self._expected_exit.add((t.role, t.index))
            except subprocess.TimeoutExpired:
                out[t.name] = None
        return out

    def logs(self, task: str | tuple[str, int]) -> str:
        t = self._tasks[_parse_task(task)]
        try:
            with open(t.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    # --------------------------------------------------------- fault injection
    def kill(self, task: str | tuple[str, int]) -> None:
        """SIGKILL a task (no cleanup, as a machine failure)."""
        t = self._tasks[_parse_task(task)]
        if t.proc is not None and t.proc.poll() is None:
            self._expected_exit.add((t.role, t.index))
            t.proc.send_signal(signal.SIGCONT)
            t.proc.kill()
            t.proc.wait()

    def restart(self, task: str | tuple[str, int], timeout: float | None = None) -> None:
        """Start a killed (or running: it is killed first) task again at the same address."""
        t = self._tasks[_parse_task(task)]
        self.kill(task)
        ready: queue.Queue[tuple[_Task, int | None]] = queue.Queue()
        for attempt in range(20):  # the old socket may linger for a moment
            self._spawn(t, ready)
            try:
                _, port = ready.get(timeout=timeout or self.start_timeout)
            except queue.Empty:
                raise TimeoutError(f"{t.name} did not restart; logs in {t.log_path}") from None
            if port is not None:
                wait_healthy(t.address, timeout or self.start_timeout, self.credentials)
                return
            time.sleep(0.1 * (attempt + 1))
        raise RuntimeError(f"{t.name} could not bind {t.address} again:\n{self.logs(task)[-2000:]}")

    def add_worker(self, register_with: str | None = None) -> str:
        """Start one more worker process while the cluster runs; returns its task name.

        With ``register_with`` (a coordinator's :meth:`ClusterCoordinator.serve_registration`
        address) the worker joins the running job by itself; otherwise pass
        ``cluster.address(name)`` to ``coordinator.add_worker``.
        """
        with self._lock:
            index = 1 + max((i for (r, i) in self._tasks if r == "worker"), default=-1)
            t = _Task("worker", index, host=self._hosts.get(f"worker:{index}", "127.0.0.1"))
            self._tasks[("worker", index)] = t
        ready: queue.Queue[tuple[_Task, int | None]] = queue.Queue()
        self._spawn(t, ready, ["--register-with", register_with] if register_with else [])
        self._await_ready([t], ready)
        return t.name

    def address(self, task: str | tuple[str, int]) -> str:
        return self._tasks[_parse_task(task)].address

    def metrics_address(self, task: str | tuple[str, int]) -> str:
        """``host:port`` of the task's Prometheus endpoint (``http://.../metrics``); changes when it restarts.

        Raises:
            RuntimeError: metrics are off (``metrics=False``) or the task has not started.
        """
        t = self._tasks[_parse_task(task)]
        if not t.metrics_port:
            raise RuntimeError(f"{t.name} serves no metrics (LocalCluster(metrics=True) and a started task needed)")
        return f"{t.host}:{t.metrics_port}"

    def terminate(self, task: str | tuple[str, int], timeout: float = 30.0) -> int | None:
        """SIGTERM a task (a graceful leave: a registered worker deregisters first); returns its exit code."""
        t = self._tasks[_parse_task(task)]
        if t.proc is None or t.proc.poll() is not None:
            return None if t.proc is None else t.proc.returncode
        self._expected_exit.add((t.role, t.index))
        t.proc.terminate()
        return t.proc.wait(timeout)

    def partition(self, task: str | tuple[str, int], seconds: float) -> None:
        """Make a task unreachable for ``seconds`` (frozen with SIGSTOP, then SIGCONT)."""
        t = self._tasks[_parse_task(task)]
        if t.proc is None or t.proc.poll() is not None:
            raise RuntimeError(f"{t.name} is not running")
        t.proc.send_signal(signal.SIGSTOP)
        proc = t.proc

        def resume() -> None:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)

        timer = threading.Timer(seconds, resume)
        timer.daemon = True
        timer.start()
        self._timers.append(timer)

    def chaos(self, roles: tuple[str, ...] = ("worker",), every: float = 2.0, downtime: float = 0.5, seed: int | None = None) -> _Chaos:
        """Start killing a random task of ``roles`` every ``every`` seconds and restarting it
        after ``downtime``; returns a handle with ``stop()`` (also a context manager).
        """
        return _Chaos(self, [n for (r, i), t in self._tasks.items() if r in roles for n in [t.name]], every, downtime, seed)


class _Chaos:
    def __init__(self, cluster: LocalCluster, tasks: list[str], every: float, downtime: float, seed: int | None) -> None:
        self.cluster = cluster
        self.tasks = tasks
        self.every = every
        self.downtime = downtime
        self.kills = 0
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="jaxdist-chaos", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            victim = self._rng.choice(self.tasks)
            logger.info("chaos: killing %s", victim)
            self.cluster.kill(victim)
            self.kills += 1
            if self._stop.wait(self.downtime):
                self.cluster.restart(victim)
                return
            self.cluster.restart(victim)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> _Chaos:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
