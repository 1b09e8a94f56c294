"""Test harness: wait for conditions, and a whole cluster inside the test process.

:func:`poll_for` replaces sleeps in tests: it waits for a condition, never
for a time.

:class:`InProcessCluster` (in the spirit of dask's ``gen_cluster``) runs PS
and worker services as real gRPC servers on ``127.0.0.1`` port 0 in *this*
process, each with its own port, token check, data plane and
:class:`~jaxdist.worker.context.TaskContext`, so a coordinator, its
variables, checkpoints and transfers can be tested without starting
processes. Closures run in the worker's server threads, in that worker's
context. Use :class:`jaxdist.LocalCluster` (real processes) where a test
needs SIGKILL, a frozen process, a partition or a second Python.

    with InProcessCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        ...

Stopping a task (:meth:`InProcessCluster.stop_task`) closes its server at
once (calls in flight fail as a crashed task's would); :meth:`restart_task`
starts a new, empty one at the same address.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

from jaxdist.base.cluster_resolver import ClusterSpec, SimpleClusterResolver
from jaxdist.base.errors import ConfigurationError
from jaxdist.ps_server.server import ParameterServer
from jaxdist.ps_server.store import DEFAULT_MAX_VARIABLE_BYTES
from jaxdist.transport.credentials import Credentials
from jaxdist.worker.server import WorkerServer

__all__ = ["InProcessCluster", "Leftovers", "poll_for"]


def poll_for(predicate: Callable[[], Any], timeout: float, interval: float = 0.02, what: str = "condition") -> None:
    """Wait until ``predicate()`` is true; raise AssertionError after ``timeout`` seconds.

    Tests wait for conditions, never for time: ``interval`` only bounds how
    often the condition is checked.
    """
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def _child_processes() -> frozenset[tuple[int, str]]:
    """This process's direct children (zombies included: an unreaped child is a leftover too),
    as ``(pid, start time)`` so a reused pid is not mistaken for an old child. Linux /proc only."""
    me = os.getpid()
    pids: set[int] = set()
    try:
        # Each thread's children file lists the children it forked (cheap, unlike a scan of /proc).
        for tid in os.listdir(f"/proc/{me}/task"):
            try:
                with open(f"/proc/{me}/task/{tid}/children") as f:
                    pids.update(int(p) for p in f.read().split())
            except OSError:  # the thread ended meanwhile
                continue
    except OSError:  # no /proc: nothing to say
        return frozenset()
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:  # exited and reaped meanwhile
            continue
        # After the command name (which may hold spaces and parentheses): state ppid ... starttime (22nd field).
        rest = stat[stat.rfind(")") + 2 :].split()
        if int(rest[1]) == me:
            out.add((pid, rest[19]))
    return frozenset(out)


@dataclass(frozen=True)
class Leftovers:
    """What a test started that is still running: ``jaxdist-*`` threads and child processes.

    ``Leftovers.now()`` before a test, then ``since.wait_gone(...)`` after it: the test's threads
    and children must be gone (they are given ``timeout`` to finish stopping).
    """

    threads: frozenset[threading.Thread]
    children: frozenset[tuple[int, str]]

    @staticmethod
    def now() -> Leftovers:
        threads = frozenset(t for t in threading.enumerate() if t.name.startswith("jaxdist-") and t.is_alive())
        return Leftovers(threads, _child_processes())

    def new_since(self, before: Leftovers) -> Leftovers:
        return Leftovers(self.threads - before.threads, self.children - before.children)

    def __bool__(self) -> bool:
        return bool(self.threads or self.children)

    def describe(self) -> str:
        parts = [f"thread {t.name}" for t in sorted(self.threads, key=lambda t: t.name)]
        for pid, _ in sorted(self.children):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            parts.append(f"child pid {pid} ({cmd[:120]})")
        return ", ".join(parts)

    def wait_gone(self, timeout: float) -> Leftovers:
        """Wait up to ``timeout`` for everything started since ``self`` to end; return what is left."""
        deadline = time.monotonic() + timeout
        while True:
            left = Leftovers.now().new_since(self)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)


def _parse(task: str) -> tuple[str, int]:
    role, sep, index = task.partition(":")
    if not sep or not index.isdigit():
        raise ConfigurationError(f"a task is named like 'ps:0' or 'worker:1', got {task!r}")
    return role, int(index)


class InProcessCluster:
    """``num_ps`` PS and ``num_workers`` worker services in this process.

    Args:
        num_workers: worker services.
        num_ps: PS services.
        ps_backups: also one backup PS per PS (job ``ps_backup``): the
            strategy then replicates every shard.
        credentials: what every task checks and every client sends (default:
            a random token, plaintext).
        max_variable_bytes: the largest variable (shard) each PS accepts.
        data_plane: serve the PS data plane beside gRPC (as ``jaxdist ps`` does).

    ``start``/``stop`` or a context manager; ``stop`` stops every service.
    """

    def __init__(
        self,
        num_workers: int = 2,
        num_ps: int = 1,
        *,
        ps_backups: bool = False,
        credentials: Credentials | None = None,
        max_variable_bytes: int = DEFAULT_MAX_VARIABLE_BYTES,
        data_plane: bool = True,
    ) -> None:
        if num_workers < 0 or num_ps < 0:
            raise ConfigurationError("num_workers and num_ps must be >= 0")
        self.credentials = credentials if credentials is not None else Credentials(secrets.token_hex(16))
        self._max_variable_bytes = max_variable_bytes
        self._data_plane = data_plane
        roles = [("ps", num_ps)] + ([("ps_backup", num_ps)] if ps_backups else []) + [("worker", num_workers)]
        self._order = [(role, i) for role, n in roles for i in range(n)]
        self._servers: dict[tuple[str, int], ParameterServer | WorkerServer | None] = {k: None for k in self._order}
        self._ports: dict[tuple[str, int], int] = {}
        self._started = False

    # --------------------------------------------------------------- lifecycle
    def _make(self, key: tuple[str, int], port: int) -> ParameterServer | WorkerServer:
        role, index = key
        if role == "worker":
            return WorkerServer(port=port, credentials=self.credentials, task_index=index)
        return ParameterServer(port=port, credentials=self.credentials, task_index=index,
                               max_variable_bytes=self._max_variable_bytes, data_port=0 if self._data_plane else None)

    def start(self) -> InProcessCluster:
        """Start every service (ports picked by the kernel); returns self."""
        if self._started:
            return self
        self._started = True
        try:
            for key in self._order:
                server = self._make(key, 0)
                server.start()
                self._servers[key] = server
                self._ports[key] = server.port  # type: ignore[assignment]
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop every service at once (idempotent)."""
        for key, server in self._servers.items():
            if server is not None:
                server.stop(grace=None)
                self._servers[key] = None

    def __enter__(self) -> InProcessCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ views
    @property
    def cluster_spec(self) -> ClusterSpec:
        jobs: dict[str, list[str]] = {}
        for role, index in self._order:
            jobs.setdefault(role, []).append(f"127.0.0.1:{self._ports[(role, index)]}")
        return ClusterSpec(jobs)

    def cluster_resolver(self) -> SimpleClusterResolver:
        """A resolver carrying this cluster's spec and credentials."""
        return SimpleClusterResolver(self.cluster_spec, token=self.credentials.token, tls=self.credentials.tls)

    def address(self, task: str) -> str:
        return f"127.0.0.1:{self._ports[_parse(task)]}"

    def server(self, task: str) -> ParameterServer | WorkerServer:
        """The running service of ``task`` (e.g. ``"ps:0"``), to read its counters.

        Raises:
            RuntimeError: the task is stopped.
        """
        server = self._servers[_parse(task)]
        if server is None:
            raise RuntimeError(f"{task} is not running")
        return server

    def ps(self, index: int) -> ParameterServer:
        return self.server(f"ps:{index}")  # type: ignore[return-value]

    def worker(self, index: int) -> WorkerServer:
        return self.server(f"worker:{index}")  # type: ignore[return-value]

    # --------------------------------------------------------- fault injection
    def stop_task(self, task: str) -> None:
        """Stop ``task``'s service at once, as if its process died (calls in flight fail)."""
        key = _parse(task)
        server = self._servers[key]
        if server is not None:
            server.stop(grace=None)
            self._servers[key] = None

    def restart_task(self, task: str) -> None:
        """Start a new, empty service for ``task`` at its old address (stopping the old one first)."""
        key = _parse(task)
        self.stop_task(task)
        server = self._make(key, self._ports[key])
        server.start()
        self._servers[key] = server
