"""PSClient: typed calls to one parameter-server task, with deadlines.

Every call has a deadline that grows with the payload. Errors come back as
typed :mod:`jaxdist.base.errors` exceptions, classified by status code and by the
fact that a PS was called (an unreachable PS is ``PSUnavailableError``; see
:class:`~jaxdist.transport.client.ServiceClient`). Pull is idempotent and
retried by gRPC on UNAVAILABLE (service config); Push is retried by callers
only with an ``update_id`` so the PS drops duplicates.

Pull and Push (and creates) travel over the PS's data plane
(:mod:`jaxdist.transport.dataplane`) when it announces one and this process may use it
(``JAXDIST_DATA_PLANE`` not ``0``); the port is learnt once from GetStatus.
When the announced port cannot be reached although gRPC can (a firewall, a
port not exposed by a Kubernetes Service), the client logs a warning and
moves tensors over gRPC from then on. The messages are the same on both
paths (:mod:`jaxdist.proto.ps_wire`), and so are the typed errors.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import grpc
import numpy as np

from jaxdist.base.errors import (
    ConfigurationError,
    InvalidRequestError,
    JaxdistError,
    ServerBusyError,
    StepBarrierTimeoutError,
)
from jaxdist.proto import codec, common_pb2, ps_pb2, ps_wire
from jaxdist.proto.ps_wire import CreateSpec, PullSpec, Update
from jaxdist.ps_server.dynamic_table import DynamicTableConfig
from jaxdist.ps_server.dynamic_tables import encode_counts, encode_keys
from jaxdist.transport import dataplane
from jaxdist.transport.client import ServiceClient
from jaxdist.transport.credentials import PLAINTEXT, Credentials

logger = logging.getLogger(__name__)

__all__ = ["CreateSpec", "DEFAULT_BARRIER_TIMEOUT_S", "DEFAULT_PUSH_WORK_TIMEOUT_S", "PSClient", "PUSH_WORK_TIMEOUT_ENV",
           "PullSpec", "Update", "create_deadline", "deadline_for", "push_work_timeout"]

_R = TypeVar("_R")

#: Deadline = base + bytes / rate: generous for loopback, still bounded. A dead
#: peer is not always announced by a connection reset (e.g. a frozen or cut-off
#: host), so deadlines, with keepalive, are what bound a call to a lost PS.
_BASE_DEADLINE_S = 10.0
#: After the data plane refused or could not be reached while gRPC works, tensors move over gRPC
#: and the data plane is tried again after a back-off, doubling per failure up to a maximum:
#: (first, maximum) seconds. A refusal (the PS's connection cap is full) is soon over; a port
#: that cannot be reached (a firewall) rarely heals, and each try may wait a connect timeout.
_DP_RETRY_REFUSED_S = (1.0, 30.0)
_DP_RETRY_UNREACHABLE_S = (30.0, 600.0)
_MIN_RATE_BYTES_PER_S = 50e6
#: Deadline of the GetStatus that finds the data plane's port. A PS answering "busy" (its liveness
#: lane admits 64 GetStatus at once; 200-1,000 workers starting their first closures together ask
#: more) is asked again until then (ServiceClient's busy retry); past it this call goes
#: over gRPC and the next one asks again.
_DISCOVERY_TIMEOUT_S = 5.0


#: How long a pull may wait at the step barrier (synchronous / bounded-stale training) in all,
#: and how long one call waits there before the PS answers "still waiting" and it asks again.
DEFAULT_BARRIER_TIMEOUT_S = 600.0
_BARRIER_POLL_S = 2.0


def deadline_for(nbytes: int) -> float:
    """Seconds a call moving ``nbytes`` may take."""
    return _BASE_DEADLINE_S + nbytes / _MIN_RATE_BYTES_PER_S


#: A push's deadline (:func:`deadline_for`) bounds moving its bytes, not the PS's work on it: an
#: optimizer step the PS runs for a few gradient rows may touch a whole table (the exact mode's
#: dense rule: Adam on a 10M x 16 table is 160M elements and its two slots), which on a loaded
#: host outlasts any transfer deadline. So a push with an ``update_id`` whose deadline passes is
#: not failed while the PS still answers a health check (GetStatus within
#: :data:`_LIVENESS_TIMEOUT_S`): it is sent again under the same id, and the PS, which
#: applies an id at most once, holds the resent copy until the first is applied and answers it as
#: a duplicate. A dead PS fails the push at once (connection lost) and a frozen or cut-off one
#: within one deadline plus one health check, as before; a PS that answers health checks but never
#: finishes the push fails it after this many seconds of work (``JAXDIST_PUSH_WORK_TIMEOUT_S``).
PUSH_WORK_TIMEOUT_ENV = "JAXDIST_PUSH_WORK_TIMEOUT_S"
DEFAULT_PUSH_WORK_TIMEOUT_S = 1800.0
#: Deadline of the health check made when a push's deadline passed.
_LIVENESS_TIMEOUT_S = 5.0


def push_work_timeout() -> float:
    """Seconds a PS that answers health checks may work on one identified push (see
    :data:`PUSH_WORK_TIMEOUT_ENV`; default :data:`DEFAULT_PUSH_WORK_TIMEOUT_S`).

    Raises:
        ConfigurationError: the variable is set but not a positive number of seconds.
    """
    raw = os.environ.get(PUSH_WORK_TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_PUSH_WORK_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigurationError(f"{PUSH_WORK_TIMEOUT_ENV}={raw!r}: expected a positive, finite number of seconds")
    return value


#: The PS materialises a created variable whatever travels: an initializer runs there, in numpy,
#: on the whole shard (a 2M x 64 table's third is 170 MB, with temporaries several times that), and
#: its optimizer state is made beside it. On a loaded host that was seen to take over 10 s: the
#: deadline of a create follows the bytes created, at this much slower rate than a transfer's.
_MIN_CREATE_RATE_BYTES_PER_S = 4e6


def create_deadline(specs: Sequence[CreateSpec]) -> float:
    """Seconds a create of ``specs`` may take: by the bytes the PS materialises, not the bytes sent.

    Raises:
        InvalidRequestError: a spec's dtype cannot travel (as encoding the create would).
    """
    nbytes = 0
    for spec in specs:
        if spec.value is not None:
            nbytes += int(np.asarray(spec.value).nbytes)
        elif spec.shape is not None:
            nbytes += codec.nbytes_of(tuple(spec.shape), codec.canonical_dtype(spec.dtype or np.float32))
    return _BASE_DEADLINE_S + nbytes / _MIN_CREATE_RATE_BYTES_PER_S


def _dial_host(address: str) -> str | None:
    """The host of a plain ``host:port`` / ``[v6]:port`` address; None for gRPC target URIs (``dns:///...``)."""
    if "/" in address or address.count(":") == 0:
        return None
    host, _, port = address.rpartition(":")
    if not port.isdigit() or not host or (":" in host and not host.startswith("[")):
        return None
    return host.strip("[]")


class PSClient(ServiceClient):
    """Client for one PS task. Thread-safe; create one per (process, PS task).

    Args:
        address: the PS's gRPC address.
        credentials: the token sent with every call and the TLS material of both the
            gRPC channel and the data plane (pass the same ones that made ``channel``
            when you give one).
        task: the task called (``"ps:0"``), named by every error.
        channel: an existing gRPC channel to use.
        data_plane: use the PS's data plane when it has one (default: yes unless
            ``JAXDIST_DATA_PLANE=0``).
        shared_memory: on it, offer a shared-memory region when the PS is on this host
            (see :mod:`jaxdist.transport.dataplane`; ``JAXDIST_SHM=0`` also turns that off).
    """

    SERVICE = "jaxdist.ParameterServer"
    ROLE = "ps"

    def __init__(
        self,
        address: str,
        credentials: Credentials = PLAINTEXT,
        task: str = "ps:?",
        channel: grpc.Channel | None = None,
        data_plane: bool | None = None,
        shared_memory: bool = True,
    ) -> None:
        super().__init__(address, credentials, task, channel)
        if data_plane is None:
            data_plane = dataplane.enabled()
        # The data plane's host, until this client knows it must use gRPC (then None).
        self._dp_host = _dial_host(address) if data_plane else None
        self._dp: dataplane.DataPlaneClient | None = None
        self._dp_lock = threading.Lock()
        #: Identified pushes sent again because their deadline passed while the PS, alive, worked.
        self.push_resends = 0
        self.pull_retries = 0  # pulls asked again while the PS was busy (see _pull_following_work)
        # Back-off of the data plane (see _DP_RETRY_REFUSED_S): when to try it again (0: not backing
        # off) and the next wait (0: the schedule's first).
        self._dp_retry_at = 0.0
        self._dp_backoff = 0.0
        self._shared_memory = shared_memory
        ch = self.channel
        self._pull = ch.unary_stream(self._path("Pull"), request_serializer=ps_pb2.PullRequest.SerializeToString)
        self._push = ch.stream_unary(self._path("Push"), response_deserializer=ps_pb2.PushResponse.FromString)
        self._push_pull = ch.stream_stream(self._path("PushPull"))
        self._replicate = ch.stream_unary(self._path("Replicate"), response_deserializer=ps_pb2.PushResponse.FromString)
        self._list = self._unary("ListVariables", ps_pb2.ListVariablesRequest, ps_pb2.ListVariablesResponse)
        self._delete = self._unary("DeleteVariables", ps_pb2.DeleteVariablesRequest, common_pb2.Empty)
        self._status = self._unary("GetStatus", common_pb2.Empty, common_pb2.TaskStatus)
        self._shutdown = self._unary("Shutdown", common_pb2.ShutdownRequest, common_pb2.ShutdownResponse)
        self._save = self._unary("Save", ps_pb2.SaveRequest, ps_pb2.SaveResponse)
        self._restore = self._unary("Restore", ps_pb2.RestoreRequest, ps_pb2.RestoreResponse)
        self._export = self._unary("Export", ps_pb2.ExportRequest, ps_pb2.ExportResponse)
        self._set_backup = self._unary("SetBackup", ps_pb2.SetBackupRequest, ps_pb2.SetBackupResponse)
        self._promote = self._unary("Promote", ps_pb2.PromoteRequest, ps_pb2.PromoteResponse)
        self._begin_run = self._unary("BeginRun", ps_pb2.BeginRunRequest, ps_pb2.BeginRunResponse)
        self._sync_steps = self._unary("SyncSteps", ps_pb2.SyncStepsRequest, ps_pb2.SyncStepsResponse)
        self._dyn_create = self._unary(
            "CreateDynamicTable", ps_pb2.CreateDynamicTableRequest, ps_pb2.CreateDynamicTableResponse)
        self._dyn_lookup = self._unary("DynamicLookup", ps_pb2.DynamicLookupRequest, ps_pb2.DynamicLookupResponse)
        self._dyn_push = self._unary("DynamicPush", ps_pb2.DynamicPushRequest, ps_pb2.DynamicPushResponse)

    def close(self) -> None:
        with self._dp_lock:
            dp, self._dp, self._dp_host = self._dp, None, None
        if dp is not None:
            dp.close()
        super().close()

    # ------------------------------------------------------------- data plane
    @property
    def uses_data_plane(self) -> bool | None:
        """True once calls go over the data plane, False when they use gRPC (for good, or while backing
        off after the data plane refused or could not be reached), None before the first call."""
        if self._dp is not None:
            return True
        return None if self._dp_host is not None and not self._dp_retry_at else False

    @property
    def uses_shared_memory(self) -> bool:
        """True when at least one of this client's data-plane connections moves payloads through shared memory."""
        dp = self._dp
        return dp is not None and dp.shm_connections > 0

    def _data_plane(self) -> dataplane.DataPlaneClient | None:
        """The data-plane client, discovering the PS's port on first use (one GetStatus)."""
        dp = self._dp
        if dp is not None or self._dp_host is None:
            return dp
        if self._dp_retry_at and time.monotonic() < self._dp_retry_at:
            return None  # backing off: this call goes over gRPC
        with self._dp_lock:
            if self._dp is None and self._dp_host is not None:
                port = self._discover_port()  # a PS that cannot be reached raises its typed error here
                if port is None:
                    return None  # the PS stayed busy: gRPC for this call, the next one asks again
                if port:
                    self._dp = dataplane.DataPlaneClient(self._dp_host, port, self.credentials,
                                                         shared_memory=self._shared_memory)
                else:
                    self._dp_host = None  # this PS serves no data plane: gRPC only
            return self._dp

    def _discover_port(self) -> int | None:
        """The PS's data port from GetStatus (None: the PS answered busy until the call's deadline).

        GetStatus is made again while the PS answers busy (:meth:`ServiceClient._call`): many
        workers' first calls to one PS each ask it at once, more than its liveness lane admits."""
        try:
            return self.status(timeout=_DISCOVERY_TIMEOUT_S).data_port
        except ServerBusyError:
            logger.info("%s: busy for %.0fs while this client looked up its data plane; this call goes over gRPC",
                        self.task, _DISCOVERY_TIMEOUT_S)
            return None

    def _data_plane_call(
        self, method: int, header: bytes, arrays: Sequence[np.ndarray], timeout: float,
        receive: Callable[[bytes], Sequence[np.ndarray]] | None = None,
    ) -> tuple[bytes, Sequence[np.ndarray]] | None:
        """One data-plane call; None when this client uses gRPC (the caller then does)."""
        found = self._data_plane()
        if found is None:
            return None
        dp: dataplane.DataPlaneClient = found
        try:
            res = dp.call(method, header, arrays, timeout, receive)
            if self._dp_retry_at:
                self._dp_served()
            return res
        except dataplane.DataPlaneError as e:
            if e.connected:
                raise self.status_error(e.code, e.details, e.reason) from None
            first = e
        # Nothing was sent: the PS restarted on another port, or its port is not reachable from here.
        with self._dp_lock:
            if self._dp is dp:
                self._dp = None
        dp.close()
        dp2 = self._data_plane()
        if dp2 is not None and dp2.port != dp.port:
            try:
                return dp2.call(method, header, arrays, timeout, receive)
            except dataplane.DataPlaneError as e:
                raise self.status_error(e.code, e.details, e.reason) from None
        if dp2 is not None:
            self._back_off(dp2, first)
        return None

    def _back_off(self, dp: dataplane.DataPlaneClient, why: dataplane.DataPlaneError) -> None:
        """The data plane refused (e.g. its connection cap) or is unreachable while gRPC works: move tensors
        over gRPC and try the data plane again after a back-off (never give it up for good)."""
        with self._dp_lock:
            if self._dp is dp:
                self._dp = None
            first = not self._dp_retry_at
            start, most = _DP_RETRY_REFUSED_S if why.code == grpc.StatusCode.RESOURCE_EXHAUSTED else _DP_RETRY_UNREACHABLE_S
            wait = min(most, max(start, self._dp_backoff))
            self._dp_backoff = min(most, wait * 2)
            self._dp_retry_at = time.monotonic() + wait
        dp.close()
        log = logger.warning if first else logger.debug
        log("%s: data plane %s:%d refused or unreachable (%s: %s) while gRPC works; moving tensors over gRPC and "
            "trying the data plane again in %.0fs", self.task, dp.host, dp.port, why.code.name, why.details, wait)

    def _dp_served(self) -> None:
        """A data-plane call succeeded after a back-off: back to the data plane, back-off reset."""
        with self._dp_lock:
            if self._dp_retry_at:
                logger.info("%s: the data plane serves again; tensors move over it", self.task)
            self._dp_retry_at = 0.0
            self._dp_backoff = 0.0

    # -------------------------------------------------------------------- pull
    def pull(
        self, specs: Sequence[PullSpec], timeout: float | None = None, out: Sequence[np.ndarray | None] | None = None
    ) -> list[tuple[np.ndarray | None, int]]:
        """Read variables; returns ``(array or None if not modified, version)`` per spec.

        ``out`` optionally gives, per spec, an array to receive the value in
        place (it is returned when it matches the variable's shape and dtype).
        """
        header, arrays = self._pull_following_work(ps_wire.encode_pull(specs), timeout, 0.0, out)
        return ps_wire.pull_results(header, arrays)

    def pull_at_barrier(
        self, specs: Sequence[PullSpec], contributor: int, timeout: float | None = None,
        out: Sequence[np.ndarray | None] | None = None, barrier_timeout: float = DEFAULT_BARRIER_TIMEOUT_S,
    ) -> tuple[list[tuple[np.ndarray | None, int]], int]:
        """:meth:`pull` for worker ``contributor``'s closure: on a PS running synchronous steps it
        first waits at the step barrier (asking again every few seconds, up to ``barrier_timeout``);
        returns the results and the step the worker's next gradients belong to (-1: no steps).

        Raises:
            StepBarrierTimeoutError: the barrier stayed closed for ``barrier_timeout`` seconds.
        """
        req = ps_wire.encode_pull(specs, contributor, _BARRIER_POLL_S)
        deadline = time.monotonic() + barrier_timeout
        while True:
            header, arrays = self._pull_following_work(req, timeout, _BARRIER_POLL_S, out)
            if not header.barrier_waiting:
                return ps_wire.pull_results(header, arrays), header.step if header.synchronous else -1
            if time.monotonic() > deadline:
                raise StepBarrierTimeoutError(
                    f"{self.task}: worker {contributor} waited {barrier_timeout:.0f}s at the step barrier (step "
                    f"{header.step}); the slowest worker never committed its step")

    def _pull_following_work(
        self, req: ps_pb2.PullRequest, timeout: float | None, extra: float, out: Sequence[np.ndarray | None] | None
    ) -> tuple[ps_pb2.PullHeader, Sequence[np.ndarray]]:
        """One pull (``extra`` seconds added to its deadline). Without a ``timeout``, a pull that outlasts its
        deadline while the PS answers a health check is asked again with a doubled deadline, up to
        :func:`push_work_timeout`: a pull of variables a push is updating waits for that push's optimizer step
        (a PS applies a push atomically), which on a loaded host can outlast the deadline as the push does (the
        exact mode's dense Adam over a 10M-row table). A pull changes nothing, so asking again is safe. A dead
        or cut-off PS fails it as before; a given ``timeout`` bounds the call."""
        first = timeout or _BASE_DEADLINE_S * 6
        if timeout is not None:
            return self._pull_once(req, first + extra, out)

        def asked_again(wait: float) -> None:
            with self._dp_lock:
                self.pull_retries += 1
            logger.info("%s: a pull outlasted its %.1fs deadline while the PS answers health checks (a push it "
                        "waits for is slow); asking again with a %.1fs deadline", self.task, first, wait)

        return self._following_work(first, lambda wait: self._pull_once(req, wait + extra, out), asked_again)

    def start_pull(
        self, specs: Sequence[PullSpec], contributor: int = -1, timeout: float | None = None,
        out: Sequence[np.ndarray | None] | None = None,
    ) -> Callable[[], tuple[list[tuple[np.ndarray | None, int]], int]] | None:
        """Send a pull over the data plane and return at once a function that reads its answer: with
        several PS tasks, every request is out before any answer is read, with no thread per task
        (one wake-up per task instead of a thread hand-off each way). The function returns what
        :meth:`pull_at_barrier` does (``contributor`` -1: what :meth:`pull` does, and step -1); it must be
        called (it releases the connection). None: this client does not use the data plane now (call
        :meth:`pull` / :meth:`pull_at_barrier`, which also find it again or fall back to gRPC).

        An answer read this way should fit the connection's buffers (the shared-memory slots, the
        socket's buffer: a few MB), as a PS's answer to a lookup does: a larger one waits for its
        turn to be read, which is correct but no faster than pulls on threads.
        """
        dp = self._dp if self._dp is not None else (self._data_plane() if self._dp_host is not None else None)
        if dp is None:
            return None
        barrier = _BARRIER_POLL_S if contributor >= 0 else 0.0
        req = ps_wire.encode_pull(specs, contributor, barrier)
        wait = (timeout or _BASE_DEADLINE_S * 6) + barrier
        try:
            started = dp.start(dataplane.PULL, req.SerializeToString(), (), wait)
        except dataplane.DataPlaneError:
            return None  # nothing to read: the caller's plain pull handles a lost or moved data plane
        got: dict[str, ps_pb2.PullHeader] = {}

        def receive(body: bytes) -> list[np.ndarray]:
            header = got["header"] = ps_pb2.PullHeader.FromString(body)
            return codec.destination_arrays(*ps_wire.pull_payload_specs(header, out), recycle=True)

        def finish() -> tuple[list[tuple[np.ndarray | None, int]], int]:
            try:
                _, arrays = dp.finish(started, receive)
            except dataplane.DataPlaneError as e:
                raise self.status_error(e.code, e.details, e.reason) from None
            header = got["header"]
            if header.barrier_waiting:  # a synchronous step's barrier is closed: wait there as pull_at_barrier does
                return self.pull_at_barrier(specs, contributor, timeout, out)
            return ps_wire.pull_results(header, arrays), header.step if header.synchronous else -1

        return finish

    def _pull_once(
        self, req: ps_pb2.PullRequest, timeout: float, out: Sequence[np.ndarray | None] | None
    ) -> tuple[ps_pb2.PullHeader, Sequence[np.ndarray]]:
        if self._dp_host is not None:
            got: dict[str, ps_pb2.PullHeader] = {}

            def receive(body: bytes) -> list[np.ndarray]:
                header = got["header"] = ps_pb2.PullHeader.FromString(body)
                return codec.destination_arrays(*ps_wire.pull_payload_specs(header, out), recycle=True)

            res = self._data_plane_call(dataplane.PULL, req.SerializeToString(), (), timeout, receive)
            if res is not None:
                return got["header"], res[1]
        return self._read_stream(lambda metadata, left: self._read_pull(
            self._pull(req, metadata=metadata, timeout=left), out), timeout)

    @staticmethod
    def _read_pull(stream: Iterator[bytes], out: Sequence[np.ndarray | None] | None
                   ) -> tuple[ps_pb2.PullHeader, Sequence[np.ndarray]]:
        """A gRPC Pull's (or PushPull's) answer: its header message, then raw frames into their arrays."""
        header = ps_pb2.PullHeader.FromString(next(stream))
        reader = codec.FrameReader(*ps_wire.pull_payload_specs(header, out), recycle=True)
        for frame in stream:
            reader.feed(frame)
        return header, reader.finish()

    # -------------------------------------------------------------------- push
    @staticmethod
    def _frames(header: Any, arrays: list[np.ndarray]) -> Iterator[bytes]:
        yield header.SerializeToString()
        yield from codec.iter_frames(arrays)

    def _send(self, header: Any, arrays: list[np.ndarray], timeout: float | None,
              method: grpc.StreamUnaryMultiCallable | None = None) -> ps_pb2.PushResponse:
        """A header and its payload: over the data plane when ``method`` is Push (the default) and
        the PS has one, else as a gRPC stream of raw frames.

        Without a ``timeout``, a push with an update id is sent again while the PS is alive and
        working on it (see :data:`PUSH_WORK_TIMEOUT_ENV`); a given ``timeout`` bounds the call."""
        first = timeout or deadline_for(sum(a.nbytes for a in arrays))
        update_id = getattr(header, "update_id", "")
        if timeout is not None or method is not None or not update_id:
            return self._send_once(header, arrays, first, method)
        return self._resending(update_id, first, lambda wait: self._send_once(header, arrays, wait, method))

    def _resending(self, update_id: str, first: float, send: Callable[[float], _R]) -> _R:
        """``send(deadline)``, sent again under the same ``update_id`` while its deadline passes and
        the PS answers health checks (see :data:`PUSH_WORK_TIMEOUT_ENV`)."""

        def resent(wait: float) -> None:
            with self._dp_lock:
                self.push_resends += 1
            logger.info("%s: push %s outlasted its %.1fs deadline while the PS answers health checks (its update "
                        "step is slow); sending it again under the same id (which the PS applies once) with a "
                        "%.1fs deadline", self.task, update_id, first, wait)

        return self._following_work(first, send, resent)

    def _following_work(self, first: float, call: Callable[[float], _R], again: Callable[[float], None]) -> _R:
        """``call(deadline)``, made again (``again(new deadline)`` first) while its deadline passes and
        the PS answers health checks, up to :func:`push_work_timeout` in all; any other error, a PS that
        does not answer, or the limit reached: raised."""
        limit = time.monotonic() + push_work_timeout()
        wait = first
        while True:
            try:
                return call(wait)
            except JaxdistError as e:
                if getattr(e, "grpc_code", None) != grpc.StatusCode.DEADLINE_EXCEEDED or time.monotonic() >= limit:
                    raise
                self._check_alive(e)
            # Each copy made again holds a PS thread until the first is done: the deadline doubles each
            # time, so a long step costs a few copies (log2 of work / deadline), not one per deadline.
            wait = min(2 * wait, max(first, limit - time.monotonic()))
            again(wait)

    def _check_alive(self, cause: JaxdistError) -> None:
        """Raise ``cause`` (a push's deadline error) unless this PS answers a health check: a dead or
        cut-off PS fails the push now. A busy answer is an answer."""
        try:
            self.status(timeout=_LIVENESS_TIMEOUT_S)
        except ServerBusyError:
            return
        except JaxdistError:
            raise cause from None

    def _send_once(self, header: Any, arrays: list[np.ndarray], timeout: float,
                   method: grpc.StreamUnaryMultiCallable | None) -> ps_pb2.PushResponse:
        if method is None and self._dp_host is not None:
            res = self._data_plane_call(dataplane.PUSH, header.SerializeToString(), arrays, timeout)
            if res is not None:
                return ps_pb2.PushResponse.FromString(res[0])
        # A function, not the iterator: a push refused as busy is sent again (the refusal did nothing).
        return self._call(method or self._push, lambda: self._frames(header, arrays), timeout)

    def push(self, updates: Sequence[Update], update_id: str = "", timeout: float | None = None) -> tuple[list[int], bool]:
        """Apply updates atomically on this PS; returns (new versions, duplicate).

        Values travel as given: convert them with :func:`jaxdist.proto.ps_wire.wire_value`
        (the variable API does) or the PS refuses a dtype other than the variable's.
        """
        header, arrays = ps_wire.encode_push(updates, update_id)
        resp = self._send(header, arrays, timeout)
        return list(resp.versions), resp.duplicate

    def push_pull(
        self, updates: Sequence[Update], pull_after: Sequence[PullSpec], update_id: str = "", contributor: int = -1,
        timeout: float | None = None, out: Sequence[np.ndarray | None] | None = None,
    ) -> tuple[ps_pb2.PushResponse, list[tuple[np.ndarray | None, int]]]:
        """Fused push-then-pull, one round trip: apply ``updates`` as :meth:`push` does (same
        ``update_id`` dedupe: a re-sent call is answered ``duplicate`` and changes nothing), then
        read ``pull_after``; returns the push's answer and ``(value, version)`` per read, as
        :meth:`pull`. ``out``: per read, an array to receive the value in place.

        Not for a worker of a PS running synchronous steps (the PS refuses it: ConfigurationError).
        """
        header, arrays = ps_wire.encode_push_pull(updates, pull_after, update_id, contributor)
        timeout = timeout or 2 * deadline_for(sum(a.nbytes for a in arrays))
        answer, values = self._push_pull_once(header, arrays, timeout, out)
        return answer.push, ps_wire.pull_results(answer, values)

    def _push_pull_once(
        self, header: ps_pb2.PushHeader, arrays: list[np.ndarray], timeout: float, out: Sequence[np.ndarray | None] | None
    ) -> tuple[ps_pb2.PullHeader, Sequence[np.ndarray]]:
        if self._dp_host is not None:
            got: dict[str, ps_pb2.PullHeader] = {}

            def receive(body: bytes) -> list[np.ndarray]:
                answer = got["header"] = ps_pb2.PullHeader.FromString(body)
                return codec.destination_arrays(*ps_wire.pull_payload_specs(answer, out), recycle=True)

            res = self._data_plane_call(dataplane.PUSH_PULL, header.SerializeToString(), arrays, timeout, receive)
            if res is not None:
                return got["header"], res[1]
        # The request stream is built anew for each attempt: a call refused as busy is made again.
        return self._read_stream(lambda metadata, left: self._read_pull(
            self._push_pull(self._frames(header, arrays), metadata=metadata, timeout=left), out), timeout)

    def push_step(
        self, updates: Sequence[Update], update_id: str, contributor: int, commit: bool = False, step: int = -1,
        timeout: float | None = None,
    ) -> ps_pb2.PushResponse:
        """:meth:`push` from worker ``contributor``'s closure: on a PS running synchronous steps its
        gradients are staged for its step and, with ``commit``, the step
        is committed in the same call; ``staged`` in the answer: the contribution waits for its
        member's commit (also when the push was a duplicate of a staged, uncommitted one). ``step`` (-1: unknown): the step its pull reported; the PS
        refuses the push (:class:`StepMembershipError`) when the worker is no longer at it."""
        header, arrays = ps_wire.encode_push(updates, update_id, contributor=contributor, commit=commit, step=step)
        return self._send(header, arrays, timeout)

    def sync_steps(
        self, kind: ps_wire.SyncKind, contributor: int = -1, staleness: int = 0, members: Sequence[int] = (),
        step: int = -1, timeout: float = 10.0,
    ) -> ps_wire.SyncReport:
        """One ``SyncSteps`` request (see :mod:`jaxdist.ps_server.sync_steps`); the PS's step clock after it."""
        req = ps_wire.encode_sync_request(kind, contributor, staleness, members, step)
        return ps_wire.decode_sync_report(self._call(self._sync_steps, req, timeout))

    def create(self, specs: Sequence[CreateSpec], timeout: float | None = None) -> list[int]:
        """Create variables (values travel as payload; initializers run on the PS)."""
        header, arrays = ps_wire.encode_create(specs)
        return list(self._send(header, arrays, timeout or create_deadline(specs)).versions)

    # ---------------------------------------------------------- dynamic tables
    def create_dynamic_table(self, config: DynamicTableConfig, shard: int, num_shards: int,
                             timeout: float = 60.0) -> bool:
        """Create this task's shard of a dynamic table; False: it existed with the same config (kept)."""
        req = ps_pb2.CreateDynamicTableRequest(config_json=json.dumps(config.to_json()), shard=shard,
                                               num_shards=num_shards)
        return bool(self._call(self._dyn_create, req, timeout).created)

    def dynamic_lookup(self, table: str, keys: np.ndarray | Sequence[str],
                       timeout: float | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Rows of ``keys`` (the default vector where not admitted) and whether each was admitted."""
        req = ps_pb2.DynamicLookupRequest(table=table)
        encode_keys(keys, req.keys)
        resp = self._call(self._dyn_lookup, req, timeout or deadline_for(len(keys) * 1024))
        return codec.tensor_from_proto(resp.rows), codec.tensor_from_proto(resp.admitted)

    def dynamic_push(self, table: str, keys: np.ndarray | Sequence[str], grads: np.ndarray, update_id: str = "",
                     timeout: float | None = None, counts: np.ndarray | None = None) -> ps_pb2.DynamicPushResponse:
        """Push gradient rows of ``keys`` (applied at most once per ``update_id``); the PS's counts.

        ``counts`` None: one gradient row per key occurrence (duplicates summed by the PS). Else a
        *counted* push: each key once, with its rows summed and its occurrences in ``counts`` (what
        :func:`~jaxdist.ps_server.dynamic_table.reduce_push` makes of the former; same effect, fewer
        bytes). Sent as given: the PS validates it."""
        req = ps_pb2.DynamicPushRequest(table=table, update_id=update_id)
        encode_keys(keys, req.keys)
        codec.tensor_to_proto(grads, req.grads)
        if counts is not None:
            if len(counts) != len(keys):  # no counts on the wire reads as an uncounted push
                raise InvalidRequestError(f"{len(counts)} push counts for {len(keys)} keys: one count per key")
            encode_counts(counts, req)
        first = timeout or deadline_for(np.asarray(grads).nbytes)
        if timeout is not None or not update_id:
            return self._call(self._dyn_push, req, first)
        # Like a variable push: a shard's step can outlast the transfer's deadline (a table growing
        # past a doubling copies its columns, a hash index rebuild re-inserts every key).
        return self._resending(update_id, first, lambda wait: self._call(self._dyn_push, req, wait))

    # ------------------------------------------------------------- replication
    def replicate(self, header: ps_pb2.ReplicaHeader, arrays: list[np.ndarray], timeout: float | None = None) -> None:
        """Send one replication message (primary -> backup); see :mod:`jaxdist.ps_server.backup`."""
        self._send(header, arrays, timeout, method=self._replicate)

    def set_backup(self, address: str, epoch: int, timeout: float = 600.0) -> ps_pb2.SetBackupResponse:
        """Attach ``address`` as this primary's backup (full sync first; ``""`` detaches)."""
        return self._call(self._set_backup, ps_pb2.SetBackupRequest(address=address, epoch=epoch), timeout)

    def promote(self, epoch: int, timeout: float = 10.0) -> int:
        """Make this backup the primary at ``epoch``; returns its epoch."""
        return self._call(self._promote, ps_pb2.PromoteRequest(epoch=epoch), timeout).epoch

    def begin_run(self, run_id: str, timeout: float = 60.0) -> str:
        """Begin coordinator run ``run_id`` here: pushes of other runs are refused from now on
        (:class:`~jaxdist.base.errors.StaleRunError`). Returns the run served before ("" for none)."""
        return self._call(self._begin_run, ps_pb2.BeginRunRequest(run_id=run_id), timeout).previous_run_id

    # -------------------------------------------------------------- checkpoint
    def save(self, directory: str, file_name: str, timeout: float = 600.0) -> ps_pb2.SaveResponse:
        return self._call(self._save, ps_pb2.SaveRequest(directory=directory, file_name=file_name), timeout)

    def restore(self, req: ps_pb2.RestoreRequest, timeout: float = 600.0) -> int:
        return self._call(self._restore, req, timeout).restored

    def export(self, req: ps_pb2.ExportRequest, timeout: float = 600.0) -> ps_pb2.ExportResponse:
        """This PS's part of an export for serving (:func:`jaxdist.ps_server.save_restore.export`)."""
        return self._call(self._export, req, timeout)

    # ----------------------------------------------------------------- control
    def list_variables(self, timeout: float = 10.0) -> list[ps_pb2.VariableInfo]:
        return list(self._call(self._list, ps_pb2.ListVariablesRequest(), timeout).variables)

    def delete(self, names: Sequence[str], timeout: float = 10.0) -> None:
        self._call(self._delete, ps_pb2.DeleteVariablesRequest(names=list(names)), timeout)

    def status(self, timeout: float = 5.0) -> common_pb2.TaskStatus:
        return self._call(self._status, common_pb2.Empty(), timeout)

    def shutdown(self, reason: str = "", exit_code: int = 0, timeout: float = 5.0) -> None:
        self._call(self._shutdown, common_pb2.ShutdownRequest(reason=reason, exit_code=exit_code), timeout)
