"""Many worker services in one process: ``jaxdist workers`` / ``python -m jaxdist.worker.host``.

Why: a big cluster can be simulated on a few machines (e.g. 1,000 workers
as 10 processes of 100) with real gRPC and real closures, and a SIGKILL of one
such process takes down all its workers at once, as a machine failure would.

Contract:

- :class:`WorkerHost` runs ``count`` :class:`~jaxdist.worker.server.WorkerServer`
  services. Each has its own gRPC server and port, its own servicer (so its own
  incarnation, function cache, per-worker resources and PS connections) and runs
  its closures in its own :class:`~jaxdist.worker.context.TaskContext`. They
  share the process: its GIL, CPU, memory and death.
- Ports: ``port=0`` lets each service pick a free one; ``port=P`` binds
  ``P, P+1, ..., P+count-1``. Task indices are ``first_index + i`` (the
  worker's own label; the coordinator assigns the job's index at Configure).
- :meth:`WorkerHost.register` joins every service to a running job through the
  coordinator's ``serve_registration()`` address, all at once (one channel,
  ``count`` concurrent RegisterWorker calls: a join storm).
  :meth:`WorkerHost.leave` deregisters each service that joined, or that was
  configured by a coordinator accepting registrations, as ``jaxdist worker``
  does on SIGTERM.
- The process (:func:`main`) prints one ready line,
  ``JAXDIST_READY role=worker index=<first> count=<n> port=<first port> ports=<p0,p1,...>``
  (``port`` keeps the single-task format's field), then registers when given
  ``--register-with``. It exits 0 on SIGTERM/SIGINT after leaving and
  draining (calls in flight get ``--drain-timeout`` seconds); when every service
  has been told to Shutdown by the coordinator (the job is over) it exits with
  the largest code asked; with ``JAXDIST_PARENT_PID`` set it exits 3 as soon as
  that process is gone (:mod:`jaxdist.base.task_process`).
- :class:`HostProcess` starts such a process and hands back its addresses
  (benchmarks, tests).

Cost per service (measured with ``bench/scale.py`` on 2 cores, 100 services per
process): one gRPC server, i.e. one completion-queue polling thread (which wakes
every 200 ms to check for signals) plus a handler pool of up to 16 threads made on
demand (one in steady state: heartbeats and RunClosures of one worker rarely
overlap), and once configured one channel and one fan-out pool per PS. That is
about 2.1 threads and 0.15 MB of RSS per service on top of the ~185 MB
process, and ~1.2% of a core per 100 idle services, ~10-12% per 100 services
answering the coordinator's heartbeats (0.5 s each).
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO

from jaxdist.base import task_process
from jaxdist.base.errors import ConfigurationError, JaxdistError
from jaxdist.transport.channel import dialable_host
from jaxdist.transport.credentials import PLAINTEXT, Credentials
from jaxdist.worker.coordinator_client import CoordinatorClient
from jaxdist.worker.server import WorkerServer

logger = logging.getLogger(__name__)

__all__ = ["HostProcess", "WorkerHost", "main", "parse_ready_line"]

#: How often the host checks whether the coordinator told every service to shut down.
_WATCH_S = 0.25


class WorkerHost:
    """``count`` worker services in this process. ``start``/``stop`` or a context manager.

    Args:
        count: worker services (>= 1).
        host: address every service binds.
        port: 0: each picks a free port; else service ``i`` binds ``port + i``.
        credentials: token and TLS of every service and of its own clients.
        insecure: allow a non-loopback bind without a token.
        first_index: task index of service 0 (service ``i`` is ``first_index + i``).
    """

    def __init__(self, count: int, host: str = "127.0.0.1", port: int = 0, credentials: Credentials = PLAINTEXT,
                 insecure: bool = False, first_index: int = 0) -> None:
        if count < 1:
            raise ConfigurationError(f"a worker host runs at least 1 worker service, got count={count}")
        self.count = count
        self.host = host
        self.credentials = credentials
        self.first_index = first_index
        self._requested_port = port
        self._insecure = insecure
        self.servers: list[WorkerServer] = []
        #: Services this host registered (index into :attr:`servers`) -> the coordinator that took them.
        self._joined: dict[int, str] = {}
        self._started = False
        self._stopped = False

    # --------------------------------------------------------------- lifecycle
    def start(self) -> list[int]:
        """Bind and start every service; returns their ports (in task-index order).

        Raises:
            ConfigurationError: a port could not be bound (the services started so far are stopped).
        """
        if self._started:
            return self.ports
        self._started = True
        try:
            for i in range(self.count):
                port = self._requested_port + i if self._requested_port else 0
                server = WorkerServer(self.host, port, self.credentials, insecure=self._insecure,
                                      task_index=self.first_index + i)
                self.servers.append(server)
                server.start()
        except BaseException:
            self.stop(grace=None)
            raise
        logger.info("%d worker services serving on %s, ports %d..%d", self.count, self.host, self.ports[0], self.ports[-1])
        return self.ports

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop every service at once: calls in flight get ``grace`` seconds (all services drain in
        parallel, so the whole stop takes about ``grace``, not ``count * grace``). Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        # A gRPC server's stop blocks for its own drain; one short-lived thread each lets them drain together.
        stoppers = [threading.Thread(target=s.stop, args=(grace,), name=f"jaxdist-host-stop-{s.servicer.task_index}",
                                     daemon=True) for s in self.servers]
        for t in stoppers:
            t.start()
        for t in stoppers:
            t.join()

    def __enter__(self) -> WorkerHost:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ views
    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.servers if s.port is not None]

    def addresses(self, advertise_host: str | None = None) -> list[str]:
        """``host:port`` of every service, as a client on this machine (or ``advertise_host``) dials it."""
        h = advertise_host or dialable_host(self.host)
        return [f"{h}:{p}" for p in self.ports]

    @property
    def shutdown_requested(self) -> bool:
        """True once the coordinator has told every service to shut down (the job is over)."""
        return all(s.servicer.shutdown_event.is_set() for s in self.servers)

    @property
    def exit_code(self) -> int:
        """The largest exit code the coordinator asked of any service (0 when none was asked)."""
        return max((s.servicer.exit_code for s in self.servers if s.servicer.shutdown_event.is_set()), default=0)

    def stats(self) -> dict[str, float]:
        """Counters summed over every service (closures done and failed, bytes in and out)."""
        out: dict[str, float] = {}
        for s in self.servers:
            for k, v in s.servicer.stats.items():
                out[k] = out.get(k, 0.0) + v
        return out

    # ----------------------------------------------------------- registration
    def register(self, coordinator: str, advertise_host: str | None = None, timeout: float = 60.0) -> list[int]:
        """Join every service to the job served at ``coordinator`` (its ``serve_registration()``
        address), all at once; returns the worker indices the coordinator gave them.

        Raises:
            JaxdistError: a registration failed (the others may have joined; :meth:`leave` takes
                back those that did).
        """
        addresses = self.addresses(advertise_host)
        with CoordinatorClient(coordinator, self.credentials) as client:
            results = client.register_many(addresses, timeout=timeout)
        indices: list[int] = []
        first_error: JaxdistError | None = None
        for i, r in enumerate(results):
            if isinstance(r, JaxdistError):
                first_error = first_error or r
            else:
                indices.append(r)
                self._joined[i] = coordinator
        if first_error is not None:
            raise first_error
        logger.info("joined the job at %s as workers %d..%d", coordinator, min(indices), max(indices))
        return indices

    def leave(self, advertise_host: str | None = None, timeout: float = 5.0) -> None:
        """Deregister, all at once, every service that joined through :meth:`register` or was configured
        by a coordinator that accepts registrations (and was not told to shut down). Never raises: the
        coordinator may be gone already."""
        addresses = self.addresses(advertise_host)
        leaving: dict[str, list[str]] = {}
        for i, s in enumerate(self.servers):
            if s.servicer.shutdown_event.is_set():
                continue
            if i in self._joined:
                leaving.setdefault(self._joined[i], []).append(addresses[i])
            elif s.servicer.registration[0]:
                coordinator, me = s.servicer.registration
                leaving.setdefault(coordinator, []).append(me)
        for coordinator, mine in leaving.items():
            try:
                with CoordinatorClient(coordinator, self.credentials) as client:
                    failed = sum(isinstance(r, JaxdistError) for r in client.deregister_many(mine, timeout=timeout))
                if failed:
                    logger.info("%d of %d services could not deregister from %s", failed, len(mine), coordinator)
            except Exception as e:  # noqa: BLE001 - leaving is best effort
                logger.info("could not deregister from %s: %s", coordinator, e)
        self._joined.clear()


# ---------------------------------------------------------------- the process
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdist workers",
                                description="Run many worker tasks in one process (a simulated big cluster).")
    p.add_argument("--count", type=int, required=True, help="worker services in this process")
    task_process.add_server_args(p)
    p.add_argument("--register-with", default=None, metavar="HOST:PORT",
                   help="coordinator registration address: every service joins the running job (and leaves on SIGTERM)")
    p.add_argument("--advertise-host", default=None, metavar="HOST",
                   help="host the coordinator should dial (default: --host); each service adds its own port")
    return p


def ready_line(first_index: int, ports: Sequence[int]) -> str:
    """The line a host process prints once every service is bound."""
    return (f"JAXDIST_READY role=worker index={first_index} count={len(ports)} port={ports[0]} "
            f"ports={','.join(map(str, ports))}")


def parse_ready_line(line: str) -> list[int] | None:
    """The ports of a host's ready line (None: not a host's ready line)."""
    if not line.startswith("JAXDIST_READY"):
        return None
    fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
    if "ports" not in fields:
        return None
    return [int(p) for p in fields["ports"].split(",")]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    task_process.setup_logging(args.log_level, "workers", args.task_index)
    if args.metrics_port is not None:
        print("jaxdist workers: --metrics-port is not supported by a worker host (one exporter per service "
              "would be one HTTP server each)", file=sys.stderr)
        return task_process.EXIT_CONFIG
    try:
        host = WorkerHost(args.count, args.host, args.port, task_process.credentials_from_args(args),
                          insecure=args.insecure, first_index=args.task_index)
    except ConfigurationError as e:
        print(f"jaxdist workers: {e}", file=sys.stderr)
        return task_process.EXIT_CONFIG
    stop = task_process.stop_on_signals()
    try:
        ports = host.start()
    except ConfigurationError as e:
        print(f"jaxdist workers: {e}", file=sys.stderr)
        return task_process.EXIT_CONFIG
    print(ready_line(args.task_index, ports), flush=True)
    if args.register_with:
        try:
            host.register(args.register_with, args.advertise_host)
        except JaxdistError as e:
            logger.error("registration with %s failed: %s", args.register_with, e)
            host.leave(args.advertise_host)
            host.stop(grace=None)
            return 1
    # One thread watches every service (not one per service): the job is over when all were told so.
    while not stop.wait(_WATCH_S):
        if host.shutdown_requested:
            break
    code = host.exit_code if host.shutdown_requested else 0
    host.leave(args.advertise_host)
    logger.info("draining %d services (up to %.1fs for calls in flight)", host.count, args.drain_timeout)
    host.stop(grace=args.drain_timeout)
    stats = host.stats()
    logger.info("stopped (exit %d): closures_done=%.0f closures_failed=%.0f", code, stats.get("closures_done", 0),
                stats.get("closures_failed", 0))
    return code


# -------------------------------------------------------------- the launcher
class HostProcess:
    """A ``python -m jaxdist.worker.host`` child process. ``start``/``stop`` or a context manager.

    It dies with this process (``JAXDIST_PARENT_PID``). Its log (stderr) goes
    to ``log_path`` (default: a temporary file, removed by :meth:`stop`).

    Args:
        count: worker services in it.
        credentials: what its services check and send (token and TLS passed in the environment).
        first_index: task index of its first service.
        register_with: a coordinator's registration address to join at start.
        env: extra environment (e.g. ``JAXDIST_SHM=0``).
        start_timeout: seconds to wait for the ready line.
    """

    def __init__(self, count: int, credentials: Credentials = PLAINTEXT, *, first_index: int = 0,
                 register_with: str | None = None, env: Mapping[str, str] | None = None,
                 log_path: str | None = None, start_timeout: float = 120.0, log_level: str = "WARNING") -> None:
        self.count = count
        self.credentials = credentials
        self.first_index = first_index
        self.register_with = register_with
        self._env = dict(env or {})
        self._own_log = log_path is None
        self.log_path = log_path or ""
        self.start_timeout = start_timeout
        self.log_level = log_level
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: list[int] = []
        #: ``time.monotonic()`` when the ready line arrived (services bound; registration starts next).
        self.ready_at: float | None = None
        self._ready = threading.Event()
        self._reader: threading.Thread | None = None
        self._log: IO[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{p}" for p in self.ports]

    def start(self) -> HostProcess:
        """Start the process and wait for its ready line.

        Raises:
            RuntimeError: it exited before announcing its ports.
            TimeoutError: no ready line within ``start_timeout``.
        """
        env = task_process.task_environment({**os.environ, **self._env})
        env.update(self.credentials.env())
        env[task_process.ENV_PARENT_PID] = str(os.getpid())
        env.setdefault("JAX_PLATFORMS", "cpu")
        cmd = [sys.executable, "-m", "jaxdist.worker.host", "--count", str(self.count), "--task-index",
               str(self.first_index), "--log-level", self.log_level]
        if self.register_with:
            cmd += ["--register-with", self.register_with]
        if self._own_log:
            fd, self.log_path = tempfile.mkstemp(prefix="jaxdist-workers-", suffix=".log")
            os.close(fd)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL, env=env)
        self._reader = threading.Thread(target=self._read, name=f"jaxdist-host-reader-{self.first_index}", daemon=True)
        self._reader.start()
        if not self._ready.wait(self.start_timeout):
            text = self.logs()[-3000:]
            self.stop()
            raise TimeoutError(f"worker host {self.first_index} did not start within {self.start_timeout:.0f}s:\n{text}")
        if not self.ports:
            code = self.proc.wait()
            text = self.logs()[-3000:]
            self.stop()
            raise RuntimeError(f"worker host {self.first_index} exited during start-up (code {code}):\n{text}")
        return self

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:  # to EOF, so the child never blocks on a full pipe
            ports = parse_ready_line(raw.decode(errors="replace").strip())
            if ports is not None and not self._ready.is_set():
                self.ports = ports
                self.ready_at = time.monotonic()
                self._ready.set()
        self._ready.set()  # exited (before or after announcing)

    def kill(self) -> None:
        """SIGKILL the process: every worker service in it dies at once, with no cleanup."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM (services leave the job and drain), SIGKILL after ``timeout``; release the pipe, the
        reader thread and the log (a temporary log is removed). Returns the exit code. Idempotent."""
        code = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            code = self.proc.returncode
            if self._reader is not None:
                self._reader.join(10.0)
                self._reader = None
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None
            if self._own_log:
                os.unlink(self.log_path)
        return code

    def logs(self) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def __enter__(self) -> HostProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    task_process.reexec_with_task_environment()  # glibc reads its malloc settings only at start-up
    sys.exit(main())
