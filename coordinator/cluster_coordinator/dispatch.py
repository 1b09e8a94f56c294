"""Dispatch: every call the coordinator makes to its workers, on one event loop.

One thread, ``jaxdist-dispatch``, runs an asyncio loop with a ``grpc.aio``
channel per worker. Whatever the number of workers, nothing else waits or
polls on their behalf (the loop and its thread are shared by the
coordinators of a process, see :class:`_SharedLoop`):

- **Closures.** The loop keeps the set of *idle* workers (healthy, no call
  in flight), oldest first. When the closure queue says closures may be
  available (its listener, :meth:`Dispatcher.kick`), or a worker becomes
  idle, it hands each idle worker a batch: its tagged (per-worker resource)
  closure alone, else up to ``closures_per_rpc`` closures, never more than
  the worker's fair share of the queue (so long closures still spread
  out), sent in one RunClosures call, except closures of a function that
  workers measured as short (a batch of them runs within :data:`BATCH_RUN_S`):
  those go up to ``closures_per_rpc`` whatever the queue's depth, since
  spreading them gains nothing and every call costs both ends far more
  than such a closure. The answer is reported to the failure handler and
  the worker is idle again.
- **Liveness.** A tick (every :data:`TICK_S`) asks the failure handler
  which workers to probe and which have been silent too long; probes are
  Heartbeat calls on the same loop. Each worker's channel is watched: a
  connection that leaves READY (a SIGKILLed process's connections are reset
  by its kernel) is reported at once, and the handler probes it. From the
  ticks' spacing the handler measures how late the loop runs: that is the
  coordinator's own stall, never counted against a worker. A heartbeat that
  fails UNAVAILABLE is followed by a fresh TCP connect to the worker's
  address: refused means nobody listens (the worker is dead at once);
  anything else (a connection dropped by keepalive on a loaded machine, a
  slow accept) counts towards the failure timeout like a timeout does.
- **Recovery.** A worker that is not healthy (new, declared dead) is
  (re)configured with backoff by a coroutine of its own until it answers.

Nothing here decides anything: every answer, failure and missed heartbeat
goes to the :class:`~jaxdist.cluster_coordinator.failure_handler.FailureHandler`
and its decisions are carried out by the :class:`DispatchHost` (the
coordinator's ``Cluster``). A worker's state on the loop (idle, busy, its
call in flight, the functions it holds) is touched only by the loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import threading
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import cloudpickle
import grpc
from jaxdist.base import errors as E
from jaxdist.cluster_coordinator.closure_queue import Closure, ClosureQueue
from jaxdist.cluster_coordinator.failure_handler import ClosureReport, Decision, FailureHandler, Outcome
from jaxdist.cluster_coordinator.remote_value import resolve_per_worker
from jaxdist.proto import common_pb2, worker_pb2
from jaxdist.proto.status import reason_of
from jaxdist.transport.channel import channel_options
from jaxdist.transport.credentials import Credentials
from jaxdist.worker import closure_args

logger = logging.getLogger(__name__)

__all__ = ["BATCH_RUN_S", "CONNECT_CHECK_S", "DispatchHost", "DispatchSettings", "Dispatcher", "TICK_S", "WorkerHandle",
           "nobody_listens"]

T = TypeVar("T")

_OUTCOMES = {
    worker_pb2.CLOSURE_OK: Outcome.OK,
    worker_pb2.CLOSURE_ERROR: Outcome.ERROR,
    worker_pb2.FUNCTION_UNKNOWN: Outcome.FUNCTION_UNKNOWN,
    worker_pb2.RESOURCE_UNKNOWN: Outcome.RESOURCE_UNKNOWN,
    worker_pb2.SKIPPED: Outcome.SKIPPED,
}

_SVC = "/jaxdist.Worker/"

#: Seconds between two liveness ticks: the resolution of probe times and of the failure timeout.
TICK_S = 0.1
#: Longest a fresh TCP connect to a worker whose heartbeat failed UNAVAILABLE may take (the kernel
#: accepts or refuses at once even for a frozen process; slower is not proof of anything).
CONNECT_CHECK_S = 1.0
#: First and longest wait between attempts to (re)configure an unreachable worker.
_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0
#: Configure calls in flight at once when every worker is told something (serve_registration, a PS
#: failover): enough to reconfigure 1,000 workers in well under a second, few enough that the
#: answers do not queue behind each other.
_CONFIGURE_CONCURRENCY = 64
#: Longest an address is probed before it may join through registration.
ADMIT_TIMEOUT_S = 5.0
#: Closures of a function whose measured run time (workers report each batch's) times the batch
#: stays under this go out ``closures_per_rpc`` at a time even when the queue holds less than that
#: per worker: a worker idles at most this long for a batch another worker could have split, while
#: each call spared saves ~0.3 ms or more of CPU on each side (measured at 1,000 simulated workers:
#: the fair share alone made batches of 7.8 on average out of 16, and the machine ran out of CPU on calls).
BATCH_RUN_S = 0.01
#: Weight of a new measurement in a function's run-time estimate (a moving average: one batch slowed
#: down by the host's other services does not end the batching; a closure that became 10 times
#: slower ends it after one or two batches).
_RUN_S_WEIGHT = 0.25
#: Functions whose run time is remembered (oldest forgotten first).
_RUN_S_KEEP = 1024


@dataclass(frozen=True)
class DispatchSettings:
    """How the coordinator talks to its workers (see :class:`ClusterCoordinator`'s arguments)."""

    closures_per_rpc: int
    heartbeat_interval: float
    failure_timeout: float
    closure_timeout: float | None


class DispatchHost(Protocol):
    """What the dispatcher needs from the coordinator that owns it (called on the loop thread)."""

    @property
    def active_workers(self) -> int:
        """Workers taking part in the job (a worker's fair share of the queue divides by it)."""
        ...

    def configure_request(self, handle: WorkerHandle) -> worker_pb2.ConfigureRequest:
        """The Configure request for ``handle``'s worker (cluster, index, run id, registration)."""
        ...

    def worker_configured(self, handle: WorkerHandle, incarnation: str) -> None:
        """``handle``'s worker answered Configure as process ``incarnation``."""
        ...

    def apply(self, decisions: Sequence[Decision]) -> None:
        """Carry out the failure handler's decisions, in order."""
        ...


def _rebuild_error(r: worker_pb2.ClosureResult, task: str) -> BaseException:
    """The closure's own exception (type and all) from the worker's answer, with its remote traceback."""
    exc: BaseException | None = None
    if r.error:
        try:
            exc = cloudpickle.loads(r.error)
        except Exception:  # noqa: BLE001 - class not importable here
            exc = None
    if not isinstance(exc, BaseException):
        last = r.traceback.strip().splitlines()[-1] if r.traceback.strip() else r.error_type
        exc = E.ClosureError(f"closure failed on {task}: {last}", r.traceback)
    try:
        exc.add_note(f"Remote traceback ({task}):\n{r.traceback}")
    except AttributeError:  # pragma: no cover - Python < 3.11
        pass
    return exc


async def nobody_listens(address: str, timeout: float = CONNECT_CHECK_S) -> bool:
    """Whether nothing listens at ``address`` (``host:port``): a fresh TCP connection is refused, or
    the host or its network is unreachable. That is the evidence a dead process leaves (its kernel,
    or the machine's absence, refuses). Accepted (a process holds the port: frozen, starved or
    restarted), timed out, or any other error: not proven, False. An address that is not
    ``host:port`` (a gRPC target such as ``unix:...``) cannot be checked this way: True, the
    unavailable call's own evidence."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return True
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), timeout)
    except ConnectionRefusedError:
        return True
    except OSError as e:
        return e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH)
    except asyncio.TimeoutError:
        return False
    writer.close()
    try:
        await writer.wait_closed()
    except OSError:
        pass
    return False


def make_aio_channel(address: str, credentials: Credentials) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``address`` with the options of every jaxdist channel (call on the loop)."""
    options = channel_options()
    cfg = credentials.tls
    if cfg is None:
        return grpc.aio.insecure_channel(address, options=options)
    if cfg.server_name:
        options.append(("grpc.ssl_target_name_override", cfg.server_name))
    return grpc.aio.secure_channel(address, cfg.channel_credentials(), options=options)


class WorkerHandle:
    """The coordinator's end of one worker task: its channel and its state on the dispatch loop.

    Made by the coordinator (any thread); its channel is opened, used and
    closed by the :class:`Dispatcher`'s loop. ``elastic``: it joined through
    registration.
    """

    def __init__(self, index: int, address: str, credentials: Credentials, *, elastic: bool = False) -> None:
        self.index = index
        self.address = address
        self.task = f"worker:{index}"
        self.elastic = elastic
        self._credentials = credentials
        self.metadata = credentials.metadata
        self.channel: grpc.aio.Channel | None = None
        # Loop-thread state.
        self.shipped: set[str] = set()  # digests of the functions this worker process holds
        self.busy = False  # a RunClosures call is in flight
        self.leaving = False  # removed: takes nothing more
        self.call: grpc.aio.UnaryUnaryCall | None = None
        self.batch_done: asyncio.Future[None] | None = None  # set while a batch is in flight
        self.recovering: asyncio.Task[None] | None = None
        self.watching: asyncio.Task[None] | None = None
        self.probing: asyncio.Task[None] | None = None

    @property
    def functions_shipped(self) -> int:
        """Functions this worker process holds, as far as the coordinator knows."""
        return len(self.shipped)

    def open(self) -> None:
        """Make the channel and its methods (on the loop)."""
        ch = self.channel = make_aio_channel(self.address, self._credentials)
        self.run = ch.unary_unary(_SVC + "RunClosures", request_serializer=worker_pb2.RunRequest.SerializeToString,
                                  response_deserializer=worker_pb2.RunResponse.FromString)
        self.heartbeat = ch.unary_unary(_SVC + "Heartbeat", request_serializer=common_pb2.Empty.SerializeToString,
                                        response_deserializer=common_pb2.TaskStatus.FromString)
        self.configure = ch.unary_unary(_SVC + "Configure", request_serializer=worker_pb2.ConfigureRequest.SerializeToString,
                                        response_deserializer=worker_pb2.ConfigureResponse.FromString)
        self.shutdown = ch.unary_unary(_SVC + "Shutdown", request_serializer=common_pb2.ShutdownRequest.SerializeToString,
                                       response_deserializer=common_pb2.ShutdownResponse.FromString)


class _SharedLoop:
    """The process's dispatch event loop, run by the ``jaxdist-dispatch`` thread while any
    :class:`Dispatcher` uses it (the thread ends with the last one; the loop object is kept).

    Why one loop per process, never closed: grpcio's asyncio poller (1.85) binds every event loop
    that ever made an aio call to one shared wake-up socket for the rest of the process, and
    hands a closed loop's late completions to whichever loop wakes next, whose handler then
    raises "Event loop is closed" with the other events of that wake-up still queued. A loop
    that is only stopped, never closed, takes late completions of dead calls quietly (they
    complete nothing) and is run again by the next coordinator.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.ident: int | None = None

    def acquire(self) -> asyncio.AbstractEventLoop:
        """The loop, running (its thread is started by the first user)."""
        with self._lock:
            if self.loop is None:
                self.loop = asyncio.new_event_loop()
            if self._users == 0:
                if self._thread is not None:  # the last release timed out waiting for it to stop
                    self._thread.join(5.0)
                    if self._thread.is_alive():
                        raise RuntimeError("the previous dispatch loop thread has not stopped")
                started = threading.Event()
                self.loop.call_soon_threadsafe(started.set)
                self._thread = threading.Thread(target=self._run, name="jaxdist-dispatch", daemon=True)
                self._thread.start()
                started.wait()
            self._users += 1
            return self.loop

    def release(self, timeout: float = 5.0) -> None:
        """One user less; the last one stops the loop and joins its thread."""
        with self._lock:
            self._users -= 1
            if self._users > 0 or self.loop is None or self._thread is None:
                return
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout)
            if self._thread.is_alive():  # the next acquire waits for it (one thread runs the loop)
                logger.warning("dispatch loop thread still running %.0fs after it was asked to stop", timeout)
                return
            self._thread = None
            self.ident = None

    def _run(self) -> None:
        assert self.loop is not None
        asyncio.set_event_loop(self.loop)
        self.ident = threading.get_ident()
        self.loop.run_forever()


_SHARED = _SharedLoop()


class Dispatcher:
    """Every call to every worker of one coordinator, on the process's dispatch loop.

    ``start``/``stop``. Thread-safe entry points: :meth:`kick`, :meth:`add`,
    :meth:`remove`, :meth:`call` (run a coroutine on the loop and wait),
    :meth:`configure_all`, :meth:`admit`, :meth:`quiesce`,
    :meth:`shutdown_workers`. :meth:`probe` and :meth:`declare_dead` are
    carried out on the loop whichever thread asks.
    """

    def __init__(self, queue: ClosureQueue, failures: FailureHandler, settings: DispatchSettings, host: DispatchHost,
                 credentials: Credentials) -> None:
        self._queue = queue
        self._failures = failures
        self._settings = settings
        self._host = host
        self._credentials = credentials
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = False
        self._handles: dict[int, WorkerHandle] = {}
        self._idle: dict[int, WorkerHandle] = {}  # insertion order: longest idle first
        self._kick_pending = False
        self._stopping = False
        self._tick_handle: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._run_s: dict[str, float] = {}  # function digest -> estimated run time of one closure (loop thread)
        #: Figures for benchmarks: RunClosures calls made, closures sent, heartbeats sent.
        self.calls = 0
        self.closures_sent = 0
        self.probes = 0

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._loop = _SHARED.acquire()
        self._running = True
        self._loop.call_soon_threadsafe(self._start_ticks)

    def _start_ticks(self) -> None:
        self._tick_handle = self.loop.call_at(self.loop.time() + TICK_S, self._tick)

    def quiesce(self, timeout: float) -> None:
        """Stop dispatching: cancel every call in flight (the queue was stopped, so their closures
        are cancelled) and wait for their batches to settle. Channels stay open (:meth:`shutdown_workers`)."""
        if self._running:
            self.call(self._quiesce(), timeout)

    async def _quiesce(self) -> None:
        self._stopping = True
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        self._idle.clear()
        waits = []
        for h in self._handles.values():
            for task in (h.recovering, h.watching, h.probing):
                if task is not None:
                    task.cancel()
            if h.call is not None:
                h.call.cancel()
            if h.batch_done is not None:
                waits.append(h.batch_done)
        if waits:
            await asyncio.wait(waits)

    def stop(self, timeout: float = 5.0) -> None:
        """Close every channel and let go of the loop (after :meth:`quiesce`). Idempotent."""
        if not self._running:
            return
        try:
            self.call(self._close_all(), timeout)
        except TimeoutError:
            logger.warning("dispatcher: channels not closed within %.0fs", timeout)
        self._running = False
        _SHARED.release(timeout)

    async def _close_all(self) -> None:
        await self._quiesce()
        # Closing a channel ends its calls and watches; the coroutines waiting on them then finish.
        await asyncio.gather(*(h.channel.close() for h in self._handles.values() if h.channel is not None),
                             return_exceptions=True)
        tasks = [t for t in self._tasks if not t.done()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=1.0)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    # ---------------------------------------------------------- thread bridges
    @property
    def on_loop(self) -> bool:
        return threading.get_ident() == _SHARED.ident

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise RuntimeError("the dispatcher was not started")
        return self._loop

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None) -> T:
        """Run ``coro`` on the loop and return its result (from any thread but the loop's)."""
        if self.on_loop:  # pragma: no cover - a bug: the loop would wait on itself
            raise RuntimeError("Dispatcher.call() from the dispatch loop")
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise TimeoutError(f"dispatch loop did not finish within {timeout}s") from None

    def _soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` on the loop: now if this is the loop thread, else as soon as it can."""
        if self.on_loop:
            fn(*args)
        else:
            self.loop.call_soon_threadsafe(fn, *args)

    def _spawn(self, coro: Coroutine[Any, Any, T]) -> asyncio.Task[T]:
        task: asyncio.Task[T] = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def kick(self) -> None:
        """Closures may be available: dispatch soon (any thread; cheap when a kick is pending)."""
        if self._kick_pending or self._stopping:
            return
        self._kick_pending = True
        if self.on_loop:
            self.loop.call_soon(self._dispatch)
        else:
            try:
                self.loop.call_soon_threadsafe(self._dispatch)
            except RuntimeError:  # the loop is closed (shutdown)
                pass

    # --------------------------------------------------------------- membership
    def add(self, handle: WorkerHandle) -> None:
        """Start working with ``handle``'s worker: open its channel, configure it (any thread)."""
        self._soon(self._add, handle)

    def _add(self, h: WorkerHandle) -> None:
        if self._stopping:
            return
        self._handles[h.index] = h
        h.open()
        h.watching = self._spawn(self._watch(h))
        self._recover(h)

    def remove(self, handle: WorkerHandle) -> concurrent.futures.Future[None] | None:
        """Take ``handle``'s worker out (it was marked left in the failure handler first): cancel
        its call in flight (its closures come back as retries), stop its coroutines, close its
        channel. Returns a future done when that is over (None when called on the loop)."""
        if self.on_loop:
            self._spawn(self._remove(handle))
            return None
        return asyncio.run_coroutine_threadsafe(self._remove(handle), self.loop)

    async def _remove(self, h: WorkerHandle) -> None:
        h.leaving = True
        self._idle.pop(h.index, None)
        for task in (h.recovering, h.watching, h.probing):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if h.call is not None:
            h.call.cancel()
        if h.batch_done is not None:
            await asyncio.shield(h.batch_done)
        self._handles.pop(h.index, None)
        if h.channel is not None:
            await h.channel.close()

    # ------------------------------------------------- failure handler's orders
    def declare_dead(self, index: int) -> None:
        """The worker was declared dead: it takes nothing; its call in flight is cancelled; it is
        reconfigured until it answers."""
        self._soon(self._declare_dead, index)

    def _declare_dead(self, index: int) -> None:
        h = self._handles.get(index)
        if h is None:
            return
        self._idle.pop(index, None)
        if h.call is not None:
            h.call.cancel()
        self._recover(h)

    def probe(self, index: int) -> None:
        """Send worker ``index`` a heartbeat; its outcome goes to the failure handler."""
        self._soon(self._start_probe, index)

    def _start_probe(self, index: int) -> None:
        h = self._handles.get(index)
        if h is None or h.leaving or self._stopping:
            return
        if h.probing is not None and not h.probing.done():
            return
        h.probing = self._spawn(self._probe(h))

    # ------------------------------------------------------------------ dispatch
    def _set_idle(self, h: WorkerHandle) -> None:
        if h.busy or h.leaving or self._stopping or not self._failures.is_healthy(h.index):
            return
        self._idle[h.index] = h
        self.kick()

    def _dispatch(self) -> None:
        self._kick_pending = False
        idle = self._idle
        q = self._queue
        if not idle or not q.handing_out:  # paused: nothing, unless a checkpoint's drain re-runs closures
            return
        for w in q.tagged_workers():  # resource closures, to their own worker
            h = idle.get(w)
            if h is not None:
                batch = q.take(w, 1)
                if batch:
                    del idle[w]
                    self._send(h, batch)
        cap = self._settings.closures_per_rpc
        active = max(1, self._host.active_workers)
        while idle and q.has_untagged():
            # Batch only what a worker's fair share allows, so long closures still spread out;
            # closures known to be short go up to the cap (see BATCH_RUN_S).
            n = max(1, min(cap, -(-q.queued // active)))
            fn = self._short_function(q.head(), cap) if n < cap else None
            index = next(iter(idle))
            batch = q.take(index, n, extend_to=cap, extend_fn=fn)
            if not batch:
                break
            self._send(idle.pop(index), batch)

    def _short_function(self, head: Closure | None, cap: int) -> Callable[..., Any] | None:
        """``head``'s function if ``cap`` closures of it are measured to run within BATCH_RUN_S."""
        if head is None:
            return None
        try:
            digest = head.function.digest
        except Exception:  # noqa: BLE001 - cannot be pickled: _request makes that the closure's error
            return None
        est = self._run_s.get(digest)
        return head.fn if est is not None and est * cap <= BATCH_RUN_S else None

    def _measured(self, digests: list[str], resp: worker_pb2.RunResponse) -> None:
        """Record how long the batch's closures ran on the worker (per closure, by function)."""
        ran = sum(r.status in (worker_pb2.CLOSURE_OK, worker_pb2.CLOSURE_ERROR) for r in resp.results)
        if resp.run_s <= 0 or ran == 0:
            return
        per = resp.run_s / ran
        est = self._run_s
        for d in set(digests[:ran]):
            old = est.pop(d, None)  # re-inserted: the dict's order is the order of use
            est[d] = per if old is None else old + _RUN_S_WEIGHT * (per - old)
        while len(est) > _RUN_S_KEEP:
            est.pop(next(iter(est)))

    def _send(self, h: WorkerHandle, batch: list[Closure]) -> None:
        h.busy = True
        h.batch_done = self.loop.create_future()
        self._spawn(self._run_batch(h, batch))

    def _request(self, h: WorkerHandle, batch: list[Closure]) -> tuple[worker_pb2.RunRequest, list[str]] | None:
        req = worker_pb2.RunRequest(incarnation=self._failures.incarnation(h.index))
        digests = []
        for i, cl in enumerate(batch):
            try:
                fp = cl.function
                args, kwargs = resolve_per_worker((cl.args, cl.kwargs), h.index) if cl.per_worker else (cl.args, cl.kwargs)
                payload = closure_args.dumps(args, kwargs)
            except Exception as e:  # noqa: BLE001 - a function or argument that cannot be pickled is the closure's error
                self._host.apply(self._failures.arguments_failed(batch, i, e))
                return None
            call = req.calls.add(closure_id=cl.id, attempt=cl.attempt, fn_digest=fp.digest, resource_id=cl.resource_id,
                                 args=payload)
            if fp.digest not in h.shipped:
                call.fn_payload = fp.payload
            digests.append(fp.digest)
        return req, digests

    async def _run_batch(self, h: WorkerHandle, batch: list[Closure]) -> None:
        index = h.index
        try:
            built = self._request(h, batch)
            if built is None:
                return
            req, digests = built
            if h.leaving:  # removed meanwhile: these go to the others
                self._host.apply(self._failures.not_sent(batch))
                return
            call = h.call = h.run(req, metadata=h.metadata, timeout=self._settings.closure_timeout)
            self.calls += 1
            self.closures_sent += len(batch)
            try:
                resp = await call
            except asyncio.CancelledError:
                if not call.cancelled():
                    raise  # the task itself was cancelled (shutdown); its closures are settled by the queue's stop
                decisions = self._failures.call_failed(index, batch, grpc.StatusCode.CANCELLED, details="declared failed")
            except grpc.aio.AioRpcError as e:
                decisions = self._failures.call_failed(index, batch, e.code(), reason_of(e), e.details() or "")
            else:
                h.shipped.update(digests)
                self._measured(digests, resp)
                decisions = self._failures.closures_returned(index, self._reports(h, batch, resp))
            finally:
                h.call = None
            self._host.apply(decisions)
        except Exception as e:  # noqa: BLE001 - a bug here must fail closures, never hang join()
            logger.exception("%s: unexpected error dispatching closures", h.task)
            self._host.apply(self._failures.dispatch_crashed(batch, e))
        finally:
            h.busy = False
            done, h.batch_done = h.batch_done, None
            if done is not None and not done.done():
                done.set_result(None)
            self._set_idle(h)

    def _reports(self, h: WorkerHandle, batch: list[Closure], resp: worker_pb2.RunResponse) -> list[ClosureReport]:
        reports = []
        for cl, r in zip(batch, resp.results):
            outcome = _OUTCOMES.get(r.status, Outcome.SKIPPED)
            if outcome is Outcome.OK:
                reports.append(ClosureReport(cl, outcome, r.value))
            elif outcome is Outcome.ERROR:
                reports.append(ClosureReport(cl, outcome, error=_rebuild_error(r, h.task), pushed=r.pushed))
            else:
                reports.append(ClosureReport(cl, outcome))
        # A short answer (a worker bug) must not strand closures: those without a result go back unrun.
        reports.extend(ClosureReport(cl, Outcome.SKIPPED) for cl in batch[len(resp.results):])
        return reports

    # ------------------------------------------------------------------ liveness
    def _tick(self) -> None:
        if self._stopping:
            return
        # The failure handler measures the loop's lateness from the ticks' spacing (it was made with
        # tick_interval=TICK_S): time this loop could not run is not counted against any worker.
        self._tick_handle = self.loop.call_at(self.loop.time() + TICK_S, self._tick)
        self._host.apply(self._failures.tick())

    async def _probe(self, h: WorkerHandle) -> None:
        self.probes += 1
        try:
            st = await h.heartbeat(common_pb2.Empty(), metadata=h.metadata, timeout=self._settings.failure_timeout,
                                   wait_for_ready=False)
        except grpc.aio.AioRpcError as e:
            if h.leaving or self._stopping:
                return
            # UNAVAILABLE is a refused connection (nobody listens: dead now) but also a connection that
            # keepalive or the peer dropped on a loaded machine (count it like a timeout). Tell them
            # apart by what a fresh connection attempt meets, never by the status's text.
            unreachable = e.code() == grpc.StatusCode.UNAVAILABLE and await nobody_listens(h.address)
            if h.leaving or self._stopping:
                return
            self._host.apply(self._failures.heartbeat_missed(h.index, unreachable=unreachable))
        else:
            self._host.apply(self._failures.heartbeat_answered(h.index, st.incarnation))

    async def _watch(self, h: WorkerHandle) -> None:
        """Report every time ``h``'s connection leaves READY (the failure handler probes it)."""
        ch = h.channel
        assert ch is not None
        ready = grpc.ChannelConnectivity.READY
        state = ch.get_state(try_to_connect=False)
        while not h.leaving:
            await ch.wait_for_state_change(state)
            new = ch.get_state(try_to_connect=False)
            if new is grpc.ChannelConnectivity.SHUTDOWN:
                return
            if state is ready and new is not ready:
                self._host.apply(self._failures.connection_lost(h.index))
            state = new

    # ------------------------------------------------------------------ recovery
    def _recover(self, h: WorkerHandle) -> None:
        if h.leaving or self._stopping or (h.recovering is not None and not h.recovering.done()):
            return
        h.recovering = self._spawn(self._reconfigure(h))

    async def _reconfigure(self, h: WorkerHandle) -> None:
        """(Re)configure the worker, with backoff, until it answers (or leaves)."""
        backoff = _MIN_BACKOFF_S
        timeout = max(2.0, self._settings.failure_timeout)
        while not h.leaving and not self._stopping:
            try:
                resp = await h.configure(self._host.configure_request(h), metadata=h.metadata, timeout=timeout)
            except grpc.aio.AioRpcError as e:
                logger.debug("%s not reachable yet: %s", h.task, e.code())
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            self._host.worker_configured(h, resp.incarnation)
            if self._failures.is_healthy(h.index):
                self._set_idle(h)
                return
            # Configured, not taken back (it could not join the synchronous steps yet): ask again.
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, _MAX_BACKOFF_S)

    # ---------------------------------------------------------------- to all workers
    def configure_all(self, handles: Sequence[WorkerHandle], timeout: float) -> list[tuple[WorkerHandle, grpc.StatusCode]]:
        """Send each worker its current configuration, in parallel; returns those that did not
        answer, with the status of their call (they get it when they are next recovered; what a
        failed call means is the failure handler's to say, from the calls it is told about)."""
        return self.call(self._to_all(handles, lambda h: h.configure(self._host.configure_request(h), metadata=h.metadata,
                                                                     timeout=timeout)), timeout * 2 + 5)

    def shutdown_workers(self, handles: Sequence[WorkerHandle], reason: str, exit_code: int, timeout: float) -> None:
        """Tell each worker the job is over (in parallel); unreachable ones are skipped."""
        req = common_pb2.ShutdownRequest(reason=reason, exit_code=exit_code)
        self.call(self._to_all(handles, lambda h: h.shutdown(req, metadata=h.metadata, timeout=timeout)), timeout * 2 + 5)

    async def _to_all(self, handles: Sequence[WorkerHandle],
                      send: Callable[[WorkerHandle], Awaitable[Any]]) -> list[tuple[WorkerHandle, grpc.StatusCode]]:
        gate = asyncio.Semaphore(_CONFIGURE_CONCURRENCY)
        failed: list[tuple[WorkerHandle, grpc.StatusCode]] = []

        async def one(h: WorkerHandle) -> None:
            if h.channel is None or h.leaving:
                return
            async with gate:
                try:
                    await send(h)
                except grpc.aio.AioRpcError as e:
                    failed.append((h, e.code()))

        await asyncio.gather(*(one(h) for h in handles))
        return failed

    def admit(self, address: str, timeout: float = ADMIT_TIMEOUT_S) -> common_pb2.TaskStatus:
        """Probe ``address`` before it may join (registration): one Heartbeat on a channel of its
        own, closed afterwards, so an address that does not answer costs nothing once refused.

        Raises:
            UnreachableWorkerAddressError: nothing answered there within ``timeout`` (not retryable:
                the worker must register an address the coordinator can dial).
            InvalidRequestError: what answered is not a jaxdist worker of this cluster.
        """
        return self.call(self._admit(address, timeout), timeout + 5)

    async def _admit(self, address: str, timeout: float) -> common_pb2.TaskStatus:
        ch = make_aio_channel(address, self._credentials)
        try:
            heartbeat = ch.unary_unary(_SVC + "Heartbeat", request_serializer=common_pb2.Empty.SerializeToString,
                                       response_deserializer=common_pb2.TaskStatus.FromString)
            try:
                st = await heartbeat(common_pb2.Empty(), metadata=self._credentials.metadata, timeout=timeout,
                                     wait_for_ready=False)
            except grpc.aio.AioRpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise E.UnreachableWorkerAddressError(
                        f"the coordinator cannot reach a worker at {address[:80]} ({e.code().name}: nothing listens "
                        "there, the host does not resolve, or nothing answered in time); register an address the "
                        "coordinator can dial (--advertise-address)", address=address) from None
                raise E.InvalidRequestError(f"{address[:80]} is not a jaxdist worker of this cluster: its Heartbeat "
                                            f"answered {e.code().name}") from None
            if st.role != "worker":
                raise E.InvalidRequestError(f"{address[:80]} is a {st.role or 'non-jaxdist'} task, not a worker")
            return st
        finally:
            await ch.close()
