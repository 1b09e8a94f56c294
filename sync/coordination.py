"""The coordination service that brings up a MultiWorkerMirroredStrategy job and watches it.

Process 0 (the chief, or worker 0 when there is no chief) serves
``jaxdist.SyncCoordination`` on its cluster-spec address. Every process:

1. ``Register(rank, task, incarnation)`` -> the session: number of processes
   and the address of JAX's own coordinator (a free port process 0 picked);
2. ``WaitAll`` until every process has registered (long poll);
3. ``Heartbeat`` every ``heartbeat_interval_s`` until it leaves; the answer
   lists failed peers;
4. ``Leave`` when it shuts down cleanly (it is then no longer watched).

Process 0 declares a registered peer failed when it has not heard from it for
``peer_timeout_s``; the others declare process 0 failed when its service has
not answered for ``peer_timeout_s``. Either way the process calls its
``on_failure`` callback with a :class:`PeerFailedError`.

Messages are JSON objects carried over raw-bytes gRPC unary calls
(:func:`jaxdist.transport.handlers.unary_handler`); each RPC's request and response
fields are the ``TypedDict``s below. Errors travel as gRPC statuses mapped by
:mod:`jaxdist.proto.status`.

:class:`CoordinationState` is the sans-IO core (clock injected); the server,
client and heartbeat threads are thin shells around it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import grpc

from jaxdist.base import errors as E
from jaxdist.transport.handlers import unary_handler
from jaxdist.transport.server import Server
from jaxdist.transport.client import ServiceClient
from jaxdist.transport.credentials import Credentials

logger = logging.getLogger(__name__)

__all__ = [
    "SERVICE",
    "DEFAULT_HEARTBEAT_INTERVAL_S",
    "DEFAULT_PEER_TIMEOUT_S",
    "PeerFailedError",
    "Failure",
    "CoordinationState",
    "CoordinationService",
    "CoordinationClient",
    "HeartbeatSender",
]

SERVICE = "jaxdist.SyncCoordination"

#: Seconds between heartbeats. Small enough that a dead peer is noticed within
#: a few seconds, large enough to cost nothing (one tiny RPC per process).
DEFAULT_HEARTBEAT_INTERVAL_S = 0.5

#: Seconds without a heartbeat after which a peer is declared dead: six missed
#: beats, so a GC pause or a busy core does not trigger it, while a killed
#: process is reported in ~3 s instead of JAX's default 100 s.
DEFAULT_PEER_TIMEOUT_S = 3.0

#: Longest a single WaitAll long poll blocks on the server before answering.
_WAIT_POLL_S = 2.0


class PeerFailedError(E.TaskUnavailableError):
    """Another process of a synchronous job died or stopped answering.

    The job cannot continue: its collectives need every process. Restart all
    processes (from the last checkpoint).

    Attributes:
        task: the failed task, e.g. ``"worker:1"``.
        rank: its process index in the job (or None when unknown).
    """

    reason = "PEER_FAILED"

    def __init__(self, message: str, task: str = "", rank: int | None = None) -> None:
        super().__init__(message, task=task)
        self.rank = rank


# -- wire messages -------------------------------------------------------------------------


class RegisterRequest(TypedDict):
    rank: int
    task: str
    incarnation: str


class RegisterResponse(TypedDict):
    num_processes: int
    jax_coordinator_address: str
    session_id: str


class WaitAllRequest(TypedDict):
    rank: int
    timeout_s: float


class FailureMessage(TypedDict):
    rank: int
    task: str
    message: str


class WaitAllResponse(TypedDict):
    ready: bool
    missing: list[str]
    failures: list[FailureMessage]


class HeartbeatRequest(TypedDict):
    rank: int
    incarnation: str


class HeartbeatResponse(TypedDict):
    failures: list[FailureMessage]


class LeaveRequest(TypedDict):
    rank: int


class _Json:
    """A JSON response with the ``SerializeToString`` method rpc handlers expect."""

    __slots__ = ("payload",)

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def SerializeToString(self) -> bytes:  # noqa: N802 - protobuf's method name
        return json.dumps(self.payload).encode()


def _parser(fields: dict[str, type | tuple[type, ...]]) -> Callable[[bytes], dict[str, Any]]:
    def parse(raw: bytes) -> dict[str, Any]:
        try:
            msg = json.loads(raw.decode() or "{}")
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise E.InvalidRequestError(f"request is not JSON ({e})") from None
        if not isinstance(msg, dict):
            raise E.InvalidRequestError("request must be a JSON object")
        for name, typ in fields.items():
            if name not in msg or not isinstance(msg[name], typ) or isinstance(msg[name], bool) and typ is int:
                raise E.InvalidRequestError(f"field {name!r} missing or not {typ}")
        return msg

    return parse


# -- sans-IO core ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Failure:
    """A peer declared failed."""

    rank: int
    task: str
    message: str

    def to_message(self) -> FailureMessage:
        return {"rank": self.rank, "task": self.task, "message": self.message}

    @staticmethod
    def from_message(m: FailureMessage) -> Failure:
        return Failure(int(m["rank"]), str(m["task"]), str(m["message"]))

    def error(self) -> PeerFailedError:
        return PeerFailedError(self.message, task=self.task, rank=self.rank)


@dataclass
class _Member:
    task: str
    incarnation: str
    last_seen: float
    left: bool = False


class CoordinationState:
    """Membership and liveness of one job; no I/O, thread-safe, clock injected.

    Args:
        num_processes: processes expected (ranks ``0..num_processes-1``).
        jax_coordinator_address: handed to every process on registration.
        peer_timeout_s: silence after which a registered peer is failed.
        session_id: identifies this job run (new on every start of process 0).
        clock: monotonic clock in seconds.
    """

    def __init__(
        self,
        num_processes: int,
        jax_coordinator_address: str,
        peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
        session_id: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.num_processes = num_processes
        self.jax_coordinator_address = jax_coordinator_address
        self.peer_timeout_s = peer_timeout_s
        self.session_id = session_id
        self._clock = clock
        self._members: dict[int, _Member] = {}
        self._failures: list[Failure] = []
        self._cond = threading.Condition()

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.num_processes:
            raise E.InvalidRequestError(f"rank {rank} is outside [0, {self.num_processes})")

    def register(self, rank: int, task: str, incarnation: str) -> RegisterResponse:
        """Add ``rank``; idempotent for the same incarnation.

        A second process claiming a rank that is registered under another
        incarnation (a restarted process) fails the old one: a running JAX
        multi-process session cannot take a new member, so every process must
        restart.
        """
        self._check_rank(rank)
        with self._cond:
            old = self._members.get(rank)
            if old is not None and old.incarnation != incarnation:
                self._fail(rank, old.task, f"{old.task} was restarted (a new process registered as rank {rank})")
                raise E.ConfigurationError(
                    f"rank {rank} ({task}) is already registered by another process; a restarted process "
                    "cannot join a running synchronous job: restart every process of the job"
                )
            if old is None:
                self._members[rank] = _Member(task, incarnation, self._clock())
                logger.info("coordination: %s registered as rank %d (%d/%d)", task, rank, len(self._members), self.num_processes)
                self._cond.notify_all()
            else:
                old.last_seen = self._clock()
        return {
            "num_processes": self.num_processes,
            "jax_coordinator_address": self.jax_coordinator_address,
            "session_id": self.session_id,
        }

    def missing(self) -> list[int]:
        with self._cond:
            return [r for r in range(self.num_processes) if r not in self._members]

    def wait_all(self, timeout: float) -> WaitAllResponse:
        """Block up to ``timeout`` seconds until every rank registered or a failure occurred."""
        deadline = self._clock() + timeout
        with self._cond:
            while len(self._members) < self.num_processes and not self._failures:
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.5))
            missing = [r for r in range(self.num_processes) if r not in self._members]
            return {
                "ready": not missing,
                "missing": [str(r) for r in missing],
                "failures": [f.to_message() for f in self._failures],
            }

    def heartbeat(self, rank: int, incarnation: str) -> HeartbeatResponse:
        """Record that ``rank`` is alive; answer with the failures known so far."""
        self._check_rank(rank)
        with self._cond:
            m = self._members.get(rank)
            if m is None or m.incarnation != incarnation:
                raise E.ConfigurationError(f"rank {rank} sent a heartbeat without being registered (or was restarted)")
            m.last_seen = self._clock()
            return {"failures": [f.to_message() for f in self._failures]}

    def leave(self, rank: int) -> None:
        """``rank`` shuts down cleanly: stop watching it."""
        self._check_rank(rank)
        with self._cond:
            m = self._members.get(rank)
            if m is not None:
                m.left = True
                logger.info("coordination: %s left", m.task)

    def check(self, exclude: int | None = 0) -> list[Failure]:
        """Fail registered peers silent for longer than ``peer_timeout_s``; return the new failures.

        ``exclude`` is the rank hosting the state (it does not heartbeat itself).
        """
        now = self._clock()
        new: list[Failure] = []
        with self._cond:
            for rank, m in self._members.items():
                if rank == exclude or m.left or any(f.rank == rank for f in self._failures):
                    continue
                silent = now - m.last_seen
                if silent > self.peer_timeout_s:
                    new.append(
                        self._fail(
                            rank,
                            m.task,
                            f"{m.task} (process {rank}) sent no heartbeat for {silent:.1f}s "
                            f"(timeout {self.peer_timeout_s:.1f}s): it is presumed dead",
                        )
                    )
        return new

    def _fail(self, rank: int, task: str, message: str) -> Failure:
        f = Failure(rank, task, message)
        self._failures.append(f)
        self._cond.notify_all()
        return f

    @property
    def failures(self) -> list[Failure]:
        with self._cond:
            return list(self._failures)

    def all_left(self, exclude: int | None = 0) -> bool:
        with self._cond:
            return all(m.left for r, m in self._members.items() if r != exclude)


# -- server ------------------------------------------------------------------------------------


class CoordinationService:
    """Serves :class:`CoordinationState` over gRPC and watches peers (runs in process 0).

    Args:
        state: the membership state to serve.
        host, port: where to bind (port 0 picks a free one, see :attr:`port`).
        credentials: the cluster token (required on non-loopback hosts) and TLS material.
        on_failure: called once, from the watchdog thread, with the first peer failure.
        check_interval_s: how often the watchdog looks for silent peers.
        insecure: allow a non-loopback bind without a token.
    """

    def __init__(
        self,
        state: CoordinationState,
        host: str,
        port: int,
        credentials: Credentials,
        on_failure: Callable[[PeerFailedError], None],
        check_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S / 2,
        insecure: bool = False,
    ) -> None:
        self.state = state
        self._on_failure = on_failure
        self._check_interval = check_interval_s
        self._server = Server(host, port, credentials, insecure=insecure, max_workers=8)
        self._server.add_service(
            SERVICE,
            {
                "Register": unary_handler(
                    "Register",
                    _parser({"rank": int, "task": str, "incarnation": str}),
                    lambda r, ctx: _Json(state.register(r["rank"], r["task"], r["incarnation"])),
                ),
                "WaitAll": unary_handler(
                    "WaitAll",
                    _parser({"rank": int, "timeout_s": (int, float)}),
                    lambda r, ctx: _Json(state.wait_all(min(float(r["timeout_s"]), _WAIT_POLL_S))),
                ),
                "Heartbeat": unary_handler(
                    "Heartbeat",
                    _parser({"rank": int, "incarnation": str}),
                    lambda r, ctx: _Json(state.heartbeat(r["rank"], r["incarnation"])),
                ),
                "Leave": unary_handler("Leave", _parser({"rank": int}), self._leave),
            },
            # Heartbeats on their own thread lane: ranks blocked in WaitAll never delay them.
            liveness=("Heartbeat",),
        )
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None
        self.port: int | None = None

    def _leave(self, request: dict[str, Any], context: grpc.ServicerContext) -> _Json:
        self.state.leave(request["rank"])
        return _Json({})

    def start(self) -> int:
        """Bind, serve and start the watchdog thread; returns the bound port."""
        self.port = self._server.start()
        self._watchdog = threading.Thread(target=self._watch, name="jaxdist-sync-watchdog", daemon=True)
        self._watchdog.start()
        return self.port

    def _watch(self) -> None:
        while not self._stop.wait(self._check_interval):
            new = self.state.check(exclude=0)
            if new:
                logger.error("coordination: %s", new[0].message)
                self._on_failure(new[0].error())
                return

    def stop(self, grace: float | None = 0.5) -> None:
        """Stop the watchdog and the server (idempotent)."""
        self._stop.set()
        if self._watchdog is not None and self._watchdog is not threading.current_thread():
            self._watchdog.join(timeout=5)
        self._server.stop(grace)


# -- client ------------------------------------------------------------------------------------


class CoordinationClient(ServiceClient):
    """Typed client of the coordination service in process 0.

    Args:
        address: ``host:port`` of process 0's coordination service.
        credentials: the cluster token and TLS material.
        server_task: the task hosting the service (for error messages), e.g. ``"worker:0"``.
    """

    SERVICE = SERVICE
    ROLE = "worker"

    def __init__(self, address: str, credentials: Credentials, server_task: str) -> None:
        super().__init__(address, credentials, server_task)
        self._calls = {m: self.channel.unary_unary(self._path(m)) for m in ("Register", "WaitAll", "Heartbeat", "Leave")}

    def _json_call(self, method: str, request: dict[str, Any], timeout: float, wait_for_ready: bool = False) -> Any:
        raw = self._call(self._calls[method], json.dumps(request).encode(), timeout, wait_for_ready=wait_for_ready)
        return json.loads(raw.decode())

    @property
    def server_task(self) -> str:
        """The task hosting the service, e.g. ``"worker:0"``."""
        return self.task

    def register(self, rank: int, task: str, incarnation: str, timeout: float) -> RegisterResponse:
        """Register, waiting up to ``timeout`` seconds for the service to come up."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                return self._json_call(
                    "Register",
                    {"rank": rank, "task": task, "incarnation": incarnation},
                    timeout=max(0.1, min(left, 5.0)),
                    wait_for_ready=True,
                )
            except E.TaskUnavailableError as e:
                if time.monotonic() >= deadline:
                    raise PeerFailedError(
                        f"the coordination service of {self.task} at {self.address} did not answer within "
                        f"{timeout:.0f}s ({e}); is {self.task} running?",
                        task=self.task,
                        rank=0,
                    ) from None

    def wait_all(self, rank: int, timeout: float) -> None:
        """Block until every process registered.

        Raises:
            PeerFailedError: a peer failed meanwhile, or processes are still
                missing after ``timeout`` seconds (the message names them).
        """
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            resp: WaitAllResponse = self._json_call(
                "WaitAll", {"rank": rank, "timeout_s": max(0.0, min(left, _WAIT_POLL_S))}, timeout=_WAIT_POLL_S + 5.0
            )
            if resp["failures"]:
                raise Failure.from_message(resp["failures"][0]).error()
            if resp["ready"]:
                return
            if time.monotonic() >= deadline:
                raise PeerFailedError(
                    f"processes {', '.join(resp['missing'])} did not join within {timeout:.0f}s; "
                    "start every task of the cluster spec (or raise init_timeout_s)",
                    task=",".join(resp["missing"]),
                )

    def heartbeat(self, rank: int, incarnation: str, timeout: float) -> list[Failure]:
        resp: HeartbeatResponse = self._json_call("Heartbeat", {"rank": rank, "incarnation": incarnation}, timeout=timeout)
        return [Failure.from_message(m) for m in resp["failures"]]

    def leave(self, rank: int, timeout: float = 2.0) -> None:
        self._json_call("Leave", {"rank": rank}, timeout=timeout)


class HeartbeatSender:
    """Thread that heartbeats process 0 and reports failures (runs in processes 1..n-1).

    Calls ``on_failure`` once, from its thread, when process 0 reports a
    failed peer or has not answered for ``peer_timeout_s``.
    """

    def __init__(
        self,
        client: CoordinationClient,
        rank: int,
        incarnation: str,
        on_failure: Callable[[PeerFailedError], None],
        interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
    ) -> None:
        self._client = client
        self._rank = rank
        self._incarnation = incarnation
        self._on_failure = on_failure
        self._interval = interval_s
        self._timeout = peer_timeout_s
        self._server_task = client.server_task
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"jaxdist-sync-heartbeat-{rank}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _loop(self) -> None:
        last_ok = time.monotonic()
        last_error: Exception | None = None
        while not self._stop.wait(self._interval):
            try:
                failures = self._client.heartbeat(self._rank, self._incarnation, timeout=max(self._interval * 2, 0.5))
            except E.JaxdistError as e:
                last_error = e
                silent = time.monotonic() - last_ok
                if silent > self._timeout and not self._stop.is_set():
                    err = PeerFailedError(
                        f"{self._server_task} (process 0) has not answered heartbeats for {silent:.1f}s "
                        f"(timeout {self._timeout:.1f}s): it is presumed dead (last error: {last_error})",
                        task=self._server_task,
                        rank=0,
                    )
                    logger.error("%s", err)
                    self._on_failure(err)
                    return
                continue
            last_ok = time.monotonic()
            if failures and not self._stop.is_set():
                logger.error("coordination: %s", failures[0].message)
                self._on_failure(failures[0].error())
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
