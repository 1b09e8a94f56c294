"""Who may hold a gRPC server's threads, and how many: auth, per-method caps and thread lanes.

A synchronous gRPC server serves each call on a pool thread, and that thread is
held while the call waits for its request messages. One shared pool lets any
caller that stops mid-request (a stalled Push stream, a unary request that never
completes, a health Watch wrapped into a blocking generator) take every thread,
health checks and heartbeats included. This module is
the one gate every call passes, in gRPC's polling thread, *before* any pool
thread is given to it:

1. **Auth first.** A call without the cluster token (health excepted) is denied
   UNAUTHENTICATED by a handler that never reads the request: it runs for
   microseconds on the small ``reject`` lane, whatever the caller sends or
   withholds afterwards.
2. **A cap per method.** Each method admits at most ``cap`` calls at once
   (from admission until the call ends, queued time included); one more is
   answered RESOURCE_EXHAUSTED at once, again without reading it. Callers retry
   later; nothing was done.
3. **Thread lanes.** Admitted calls run on their lane's own pool
   (``experimental_thread_pool``, honoured by grpcio's server), so a full lane
   only delays its own calls:

   ========== ====================================== ========= ===========
   lane       methods                                threads   cap/method
   ========== ====================================== ========= ===========
   health     grpc.health.v1 Check (no token)        32        32
   watch      grpc.health.v1 Watch (no token)        16        256
   liveness   the service's liveness methods         4         64
              (PS GetStatus, worker Heartbeat)
   streams    each request-streaming method          64 each   64
              (Push, Replicate): its own lane
   calls      every other method                     max_workers 256
   reject     denials and RESOURCE_EXHAUSTED         2         -
   ========== ====================================== ========= ===========

   Threads are made on demand and the caps are at least the lane's threads
   except for ``calls`` and ``liveness``, whose calls queue (as all calls did
   before) behind a held thread of their own lane only.
4. **Token-less requests have a deadline.** A health call's one request
   message must arrive within :data:`TOKENLESS_REQUEST_TIMEOUT_S`, else the
   call is cancelled (``context.cancel()``) and its thread freed: a caller
   without the token cannot hold a health thread for longer than that.
5. **The request is read inside the handler.** Every admitted handler is served
   as request-streaming, so gRPC starts the behaviour at once and this gate
   reads the single request message of a unary method itself; that is what
   lets the cap, the lane and the deadline cover the read. A unary call with no
   request message is INVALID_ARGUMENT.

Health's Watch keeps grpcio's non-blocking mode (it answers through a callback
and gives its thread back at once), also with metrics on.

What remains possible: a token-less peer that keeps 32 health Checks stalled
(re-opening each after its 5 s) keeps further Checks RESOURCE_EXHAUSTED, but
never the service's own calls nor its liveness lane; a token holder that stalls
its calls fills that method's cap and lane only.
"""

from __future__ import annotations

import heapq
import hmac
import logging
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from jaxdist.base import errors as E
from jaxdist.proto import status
from jaxdist.transport.credentials import AUTH_KEY

logger = logging.getLogger(__name__)

__all__ = ["HEALTH_PREFIX", "TOKENLESS_REQUEST_TIMEOUT_S", "CallTimer", "Gate", "LanePolicy"]

HEALTH_PREFIX = "/grpc.health.v1.Health/"
#: A token-less (health) call's request message must arrive within this many seconds.
TOKENLESS_REQUEST_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class LanePolicy:
    """A lane's thread budget and the concurrent calls each of its methods admits."""

    threads: int
    cap: int


#: The lanes' budgets (see the module docstring); ``calls`` takes the server's ``max_workers``.
HEALTH_CHECK = LanePolicy(threads=32, cap=32)
HEALTH_WATCH = LanePolicy(threads=16, cap=256)
LIVENESS = LanePolicy(threads=4, cap=64)
STREAMS = LanePolicy(threads=64, cap=64)
CALLS_CAP = 256
REJECT_THREADS = 2


class CallTimer(Protocol):
    """Per-method metrics hooks: ``timer(method) -> (observe(seconds), error())``."""

    def timer(self, method: str) -> tuple[Callable[[float], None], Callable[[], None]]: ...


class _Count:
    """Calls of one method admitted and not yet ended."""

    __slots__ = ("cap", "_n", "_lock")

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self._n = 0
        self._lock = threading.Lock()

    def acquire(self) -> bool:
        with self._lock:
            if self._n >= self.cap:
                return False
            self._n += 1
            return True

    def release(self) -> None:
        with self._lock:
            self._n -= 1

    @property
    def value(self) -> int:
        with self._lock:
            return self._n


class _Deadlines:
    """One thread that cancels calls whose request did not arrive in time (no thread per call)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, grpc.ServicerContext]] = []
        self._done: set[int] = set()
        self._cond = threading.Condition()
        self._seq = 0
        self._stopped = False
        self._thread: threading.Thread | None = None

    def arm(self, context: grpc.ServicerContext, seconds: float) -> int:
        with self._cond:
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._run, name="jaxdist-rpc-deadlines", daemon=True)
                self._thread.start()
            self._seq += 1
            heapq.heappush(self._heap, (time.monotonic() + seconds, self._seq, context))
            self._cond.notify()
            return self._seq

    def disarm(self, ticket: int) -> None:
        with self._cond:
            self._done.add(ticket)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(None if not self._heap else max(0.0, self._heap[0][0] - time.monotonic()))
                if self._stopped:
                    return
                _, ticket, context = heapq.heappop(self._heap)
                if ticket in self._done:
                    self._done.discard(ticket)
                    continue
            context.cancel()  # the reader wakes up (RpcError) and its thread is freed

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._done.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=5)


@dataclass(frozen=True)
class _Route:
    pool: futures.ThreadPoolExecutor
    count: _Count
    read_timeout: float | None


class Gate(grpc.ServerInterceptor):
    """The server's one interceptor: auth, per-method caps, lanes, request deadlines, metrics.

    Args:
        token: the cluster token every non-health call must carry (None: no check).
        max_workers: threads of the ``calls`` lane.
        liveness: full method names (``"/pkg.Service/Method"``) served on the
            liveness lane; they must be quick and never block.
        metrics: optional per-method timing hooks.

    Call :meth:`close` after the server stopped (frees the lanes' threads).
    """

    def __init__(self, token: str | None, max_workers: int, metrics: CallTimer | None = None) -> None:
        self._expected = f"Bearer {token}".encode() if token else None
        self._metrics = metrics
        self._liveness: set[str] = set()
        self._deadlines = _Deadlines()
        self._pools: dict[str, futures.ThreadPoolExecutor] = {}
        self._routes: dict[str, _Route] = {}
        self._wrapped: dict[tuple[str, int], grpc.RpcMethodHandler] = {}
        self._lock = threading.Lock()
        self._max_workers = max_workers
        self._reject_pool = self._pool("reject", REJECT_THREADS)
        self._rejects: dict[tuple[str, str], grpc.RpcMethodHandler] = {}

    @property
    def default_pool(self) -> futures.ThreadPoolExecutor:
        """The ``calls`` lane: also what gRPC uses for a handler this gate did not wrap."""
        return self._pool("calls", self._max_workers)

    def add_liveness(self, methods: set[str]) -> None:
        """Serve these full method names on the liveness lane."""
        with self._lock:
            self._liveness |= methods

    def in_flight(self, method: str) -> int:
        """Calls of ``method`` (full name) admitted and not yet ended (0 if none so far)."""
        route = self._routes.get(method)
        return route.count.value if route is not None else 0

    def close(self) -> None:
        self._deadlines.stop()
        with self._lock:
            pools = list(self._pools.values())
        for p in pools:
            p.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ intercept
    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        method = details.method
        handler = continuation(details)
        if handler is None:
            return None  # UNIMPLEMENTED, token or not (as gRPC answers an unknown method)
        if self._expected is not None and not method.startswith(HEALTH_PREFIX) and not self._authorized(details):
            return self._rejecting(method, "unauthenticated")
        route = self._route(method, handler)
        if not route.count.acquire():
            return self._rejecting(method, "exhausted", route.count.cap)
        key = (method, id(handler))
        wrapped = self._wrapped.get(key)
        if wrapped is None:
            wrapped = self._wrapped[key] = self._wrap(method, handler, route)
        return wrapped

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        expected = self._expected
        if expected is None:
            return True
        for key, value in details.invocation_metadata or ():
            if key == AUTH_KEY:
                got = value.encode() if isinstance(value, str) else value
                return hmac.compare_digest(got, expected)
        return False

    def _pool(self, name: str, threads: int) -> futures.ThreadPoolExecutor:
        with self._lock:
            pool = self._pools.get(name)
            if pool is None:
                pool = self._pools[name] = futures.ThreadPoolExecutor(threads, thread_name_prefix=f"jaxdist-rpc-{name}")
            return pool

    def _route(self, method: str, handler: grpc.RpcMethodHandler) -> _Route:
        route = self._routes.get(method)
        if route is not None:
            return route
        read_timeout: float | None = None
        if method.startswith(HEALTH_PREFIX):
            read_timeout = TOKENLESS_REQUEST_TIMEOUT_S
            if handler.response_streaming:  # Watch
                pool, cap = self._pool("watch", HEALTH_WATCH.threads), HEALTH_WATCH.cap
            else:
                pool, cap = self._pool("health", HEALTH_CHECK.threads), HEALTH_CHECK.cap
        elif method in self._liveness:
            pool, cap = self._pool("liveness", LIVENESS.threads), LIVENESS.cap
        elif handler.request_streaming:
            pool, cap = self._pool("stream-" + method.rsplit("/", 1)[-1], STREAMS.threads), STREAMS.cap
        else:
            pool, cap = self.default_pool, CALLS_CAP
        with self._lock:
            return self._routes.setdefault(method, _Route(pool, _Count(cap), read_timeout))

    # ------------------------------------------------------------------ handlers
    def _rejecting(self, method: str, why: str, cap: int = 0) -> grpc.RpcMethodHandler:
        """A handler of ``method`` that refuses the call without reading its request (request-streaming:
        gRPC waits for nothing), counted as an error of ``method`` in the metrics."""
        key = (method, why)
        handler = self._rejects.get(key)
        if handler is not None:
            return handler
        name = method.lstrip("/")
        if why == "unauthenticated":
            exc: E.JaxdistError = E.AuthenticationError("missing or wrong auth token; set JAXDIST_TOKEN to the cluster's token")
        else:
            exc = E.ServerBusyError(f"{name}: {cap} calls already in flight; retry later")
        observe, error = self._metrics.timer(name) if self._metrics is not None else (None, None)

        def reject(requests: Iterator[Any], context: grpc.ServicerContext) -> None:
            if observe is not None:
                observe(0.0)
                error()  # type: ignore[misc]
            status.abort(context, exc)

        reject.experimental_thread_pool = self._reject_pool  # type: ignore[attr-defined]
        handler = self._rejects[key] = grpc.stream_stream_rpc_method_handler(reject)
        return handler

    def _one(self, method: str, requests: Iterator[Any], context: grpc.ServicerContext, route: _Route) -> Any:
        """The single request message of a unary method, read under the route's deadline."""
        ticket = self._deadlines.arm(context, route.read_timeout) if route.read_timeout is not None else None
        try:
            return next(requests)
        except StopIteration:
            status.abort(context, E.InvalidRequestError(f"{method.lstrip('/')}: the call carries no request message"))
        finally:
            if ticket is not None:
                self._deadlines.disarm(ticket)

    def _wrap(self, method: str, h: grpc.RpcMethodHandler, route: _Route) -> grpc.RpcMethodHandler:
        """``h`` served request-streaming on its lane, releasing its admission when the call ends."""
        inner: Callable[..., Any] = h.unary_unary or h.unary_stream or h.stream_unary or h.stream_stream
        unary_in = not h.request_streaming
        release = route.count.release
        observe, error = self._metrics.timer(method.lstrip("/")) if self._metrics is not None else (None, None)
        clock = time.perf_counter
        one = self._one

        def admitted(context: grpc.ServicerContext) -> None:
            if not context.add_callback(release):  # the call already ended
                release()

        if h.response_streaming and getattr(inner, "experimental_non_blocking", False):
            # grpcio's non-blocking streaming (health Watch): answers go through the callback and the
            # thread returns at once; time it until the call ends.
            def non_blocking(requests: Iterator[Any], context: grpc.ServicerContext, send_response_callback: Callable) -> None:
                admitted(context)
                request = one(method, requests, context, route) if unary_in else requests
                if observe is not None:
                    t0 = clock()
                    context.add_callback(lambda: observe(clock() - t0))
                try:
                    inner(request, context, send_response_callback)
                except BaseException:
                    if error is not None:
                        error()
                    raise

            non_blocking.experimental_non_blocking = True  # type: ignore[attr-defined]
            non_blocking.experimental_thread_pool = route.pool  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(non_blocking, h.request_deserializer, h.response_serializer)

        if h.response_streaming:
            def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
                admitted(context)
                request = one(method, requests, context, route) if unary_in else requests
                if observe is None:
                    return inner(request, context)
                return _timed(inner, request, context, observe, error)

            streaming.experimental_thread_pool = route.pool  # type: ignore[attr-defined]
            return grpc.stream_stream_rpc_method_handler(streaming, h.request_deserializer, h.response_serializer)

        def unary(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
            admitted(context)
            request = one(method, requests, context, route) if unary_in else requests
            if observe is None:
                return inner(request, context)
            t0 = clock()
            try:
                return inner(request, context)
            except BaseException:
                error()  # type: ignore[misc]
                raise
            finally:
                observe(clock() - t0)

        unary.experimental_thread_pool = route.pool  # type: ignore[attr-defined]
        return grpc.stream_unary_rpc_method_handler(unary, h.request_deserializer, h.response_serializer)


def _timed(inner: Callable[..., Iterator[Any]], request: Any, context: grpc.ServicerContext,
           observe: Callable[[float], None], error: Callable[[], None] | None) -> Iterator[Any]:
    """A response stream timed until its last message; one that fails counts as an error."""
    t0 = time.perf_counter()
    try:
        yield from inner(request, context)
    except BaseException:
        if error is not None:
            error()
        raise
    finally:
        observe(time.perf_counter() - t0)
