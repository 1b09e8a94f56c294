"""Server side of gRPC: a server with auth, health, metrics and an explicit lifecycle.

- Servers bind a given port (0 picks a free one) and report the bound port.
- Every RPC except ``grpc.health.v1`` needs ``authorization: Bearer <token>``;
  the health service stays open because Kubernetes' native gRPC probes cannot
  send metadata, and it reveals nothing.
- A server asked to bind a non-loopback address without a token refuses to
  start unless ``insecure=True``.
- Handlers are registered with raw-bytes (de)serializers and built by
  :mod:`jaxdist.transport.handlers`, so garbage bytes and failures become typed
  statuses (:mod:`jaxdist.transport.guard`).
- **Credentials** (:class:`jaxdist.transport.credentials.Credentials`: the
  token and optional TLS) are given explicitly; there is no process-wide default.
- **Metrics** (optional): given a Prometheus registry, a server times every
  call per method (``jaxdist_rpc_server_latency_seconds``) with an
  interceptor that costs a few microseconds per call.
"""

from __future__ import annotations

import hmac
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxdist.base import errors as E
from jaxdist.proto import status
from jaxdist.transport.channel import DEFAULT_MAX_MESSAGE_BYTES, dialable_host, is_loopback
from jaxdist.transport.credentials import AUTH_KEY, PLAINTEXT, Credentials, TLSConfig

__all__ = ["HEALTH_PREFIX", "RPC_LATENCY_BUCKETS", "Server"]

HEALTH_PREFIX = "/grpc.health.v1.Health/"


class _AuthInterceptor(grpc.ServerInterceptor):
    """Rejects every call without the cluster token (health checks excepted)."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            status.abort(context, E.AuthenticationError("missing or wrong auth token; set JAXDIST_TOKEN to the cluster's token"))

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream_in = grpc.stream_unary_rpc_method_handler(deny)
        self._deny_stream_out = grpc.unary_stream_rpc_method_handler(deny)
        self._deny_bidi = grpc.stream_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        if details.method.startswith(HEALTH_PREFIX):
            return continuation(details)
        for key, value in details.invocation_metadata or ():
            if key == AUTH_KEY:
                got = value.encode() if isinstance(value, str) else value
                if hmac.compare_digest(got, self._expected):
                    return continuation(details)
                break
        handler = continuation(details)
        if handler is None:
            return None
        if handler.request_streaming and handler.response_streaming:
            return self._deny_bidi
        if handler.request_streaming:
            return self._deny_stream_in
        if handler.response_streaming:
            return self._deny_stream_out
        return self._deny_unary


#: Buckets of the RPC latency histogram, 50 us .. 30 s.
RPC_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _LatencyInterceptor(grpc.ServerInterceptor):
    """Times every call per method into ``jaxdist_rpc_server_latency_seconds{method}``.

    Streaming calls are timed until their last message. Calls that end with
    an exception (an aborted status included) also count in
    ``jaxdist_rpc_server_errors_total{method}``. Wrapped handlers are cached
    per (method, handler), so a call costs two clock reads and one
    histogram observation.
    """

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        self._hist = Histogram("jaxdist_rpc_server_latency_seconds", "Server-side latency of RPCs, by method",
                               ["method"], registry=registry, buckets=RPC_LATENCY_BUCKETS)
        self._errors = Counter("jaxdist_rpc_server_errors", "RPCs that ended with an error status, by method",
                               ["method"], registry=registry)
        self._cache: dict[tuple[str, int], grpc.RpcMethodHandler] = {}

    def observe(self, method: str, seconds: float, failed: bool) -> None:
        """Record one call served outside gRPC (the data plane) under ``method``."""
        self._hist.labels(method).observe(seconds)
        if failed:
            self._errors.labels(method).inc()

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        key = (details.method, id(handler))
        wrapped = self._cache.get(key)
        if wrapped is None:
            wrapped = self._cache[key] = self._wrap(details.method.lstrip("/"), handler)
        return wrapped

    def _wrap(self, method: str, h: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        observe = self._hist.labels(method).observe
        error = self._errors.labels(method).inc
        clock = time.perf_counter
        if h.response_streaming:
            inner = h.stream_stream if h.request_streaming else h.unary_stream

            def streaming(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
                t0 = clock()
                try:
                    yield from inner(request, context)
                except BaseException:
                    error()
                    raise
                finally:
                    observe(clock() - t0)

            make = grpc.stream_stream_rpc_method_handler if h.request_streaming else grpc.unary_stream_rpc_method_handler
            return make(streaming, request_deserializer=h.request_deserializer, response_serializer=h.response_serializer)
        inner = h.stream_unary if h.request_streaming else h.unary_unary

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            t0 = clock()
            try:
                return inner(request, context)
            except BaseException:
                error()
                raise
            finally:
                observe(clock() - t0)

        make = grpc.stream_unary_rpc_method_handler if h.request_streaming else grpc.unary_unary_rpc_method_handler
        return make(unary, request_deserializer=h.request_deserializer, response_serializer=h.response_serializer)


class Server:
    """A gRPC server with auth, health and explicit ``start``/``stop``.

    Args:
        host: address to bind ("127.0.0.1", "0.0.0.0", "[::]").
        port: port to bind; 0 picks a free one (see :attr:`port` after start).
        credentials: the cluster token every call must carry (none: no auth,
            loopback or ``insecure`` only) and the TLS material to serve with
            (none: plaintext). The token is checked either way.
        insecure: allow binding a non-loopback host without a token.
        metrics_registry: a Prometheus ``CollectorRegistry``; when given, every
            call is timed into it (``jaxdist_rpc_server_latency_seconds``).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        credentials: Credentials = PLAINTEXT,
        insecure: bool = False,
        max_workers: int = 16,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        metrics_registry: Any = None,
    ) -> None:
        token = credentials.token
        if not token and not insecure and not is_loopback(host):
            raise E.ConfigurationError(
                f"refusing to serve on non-loopback address {host!r} without an auth token: "
                "workers run shipped code, so an open port is remote code execution. "
                "Set JAXDIST_TOKEN (or --token-file), or pass --insecure on a trusted network."
            )
        self.credentials = credentials
        self.tls: TLSConfig | None = credentials.tls
        self._credentials = self.tls.server_credentials() if self.tls is not None else None  # fail early on bad files
        interceptors: list[grpc.ServerInterceptor] = []
        self._latency: _LatencyInterceptor | None = None
        if metrics_registry is not None:
            self._latency = _LatencyInterceptor(metrics_registry)
            interceptors.append(self._latency)
        if token:
            interceptors.append(_AuthInterceptor(token))
        # Kept to shut it down in stop(): grpc's server.stop() leaves its executor's threads alive.
        self._executor = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="jaxdist-rpc")
        self._server = grpc.server(
            self._executor,
            interceptors=interceptors,
            options=[
                ("grpc.max_send_message_length", max_message_bytes),
                ("grpc.max_receive_message_length", max_message_bytes),
                ("grpc.so_reuseport", 0),
                ("grpc.keepalive_permit_without_calls", 1),
                ("grpc.http2.min_ping_interval_without_data_ms", 4_000),
                ("grpc.http2.min_recv_ping_interval_without_data_ms", 4_000),
                ("grpc.http2.max_ping_strikes", 0),
            ],
            maximum_concurrent_rpcs=None,
        )
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self._stopped = threading.Event()
        self._services: list[str] = []

    def observe_call(self, method: str, seconds: float, failed: bool) -> None:
        """Count a call served beside gRPC (e.g. ``"jaxdist.ParameterServer/Pull"`` over the data plane)
        in this server's latency metrics, when it has them."""
        if self._latency is not None:
            self._latency.observe(method, seconds, failed)

    def add_service(self, name: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        self._services.append(name)

    def start(self) -> int:
        bind = f"{self.host}:{self.requested_port}"
        if self._credentials is not None:
            port = self._server.add_secure_port(bind, self._credentials)
        else:
            port = self._server.add_insecure_port(bind)
        if port == 0:
            raise E.ConfigurationError(f"could not bind {bind} (address in use or not available)")
        self.port = port
        self._server.start()
        for name in ["", *self._services]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        return port

    @property
    def address(self) -> str:
        """``host:port`` a client on this machine dials (after :meth:`start`)."""
        return f"{dialable_host(self.host)}:{self.port}"

    def stop(self, grace: float | None = 1.0) -> None:
        """Mark NOT_SERVING, let in-flight calls finish for ``grace`` seconds, stop."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self._server.stop(grace).wait()
        # Not waiting: a handler still running user code (a closure) must not hold stop() up;
        # idle threads exit now, busy ones when their call returns.
        self._executor.shutdown(wait=False, cancel_futures=True)

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
