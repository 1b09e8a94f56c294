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
- **No caller can starve it**: one gate (:mod:`jaxdist.transport.admission`)
  checks the token before a call gets a thread, caps each method's concurrent
  calls (RESOURCE_EXHAUSTED beyond) and runs health, liveness methods, each
  streaming method and the rest on separate thread lanes.
- **Metrics** (optional): given a Prometheus registry, a server times every
  call per method (``jaxdist_rpc_server_latency_seconds``) in that gate, for a
  few microseconds per call.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from jaxdist.base import errors as E
from jaxdist.transport.channel import DEFAULT_MAX_MESSAGE_BYTES, dialable_host, is_loopback
from jaxdist.transport.admission import HEALTH_PREFIX, Gate
from jaxdist.transport.credentials import PLAINTEXT, Credentials, TLSConfig

__all__ = ["HEALTH_PREFIX", "RPC_LATENCY_BUCKETS", "Server"]


#: Buckets of the RPC latency histogram, 50 us .. 30 s.
logger = logging.getLogger(__name__)

#: Seconds past ``grace`` that stop() waits for grpc to confirm the server stopped.
_STOP_CONFIRM_S = 5.0

RPC_LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _RpcMetrics:
    """``jaxdist_rpc_server_latency_seconds{method}`` and ``jaxdist_rpc_server_errors_total{method}``.

    Streaming calls are timed until their last message (health Watch, served
    without a thread, until the stream ends). Calls that end with an exception
    (an aborted status included) also count as errors. The gate
    (:mod:`jaxdist.transport.admission`) asks for each method's hooks once, so a
    call costs two clock reads and one histogram observation.
    """

    def __init__(self, registry: Any) -> None:
        from prometheus_client import Counter, Histogram

        self._hist = Histogram("jaxdist_rpc_server_latency_seconds", "Server-side latency of RPCs, by method",
                               ["method"], registry=registry, buckets=RPC_LATENCY_BUCKETS)
        self._errors = Counter("jaxdist_rpc_server_errors", "RPCs that ended with an error status, by method",
                               ["method"], registry=registry)

    def timer(self, method: str) -> tuple[Callable[[float], None], Callable[[], None]]:
        return self._hist.labels(method).observe, self._errors.labels(method).inc

    def observe(self, method: str, seconds: float, failed: bool) -> None:
        """Record one call served outside gRPC (the data plane) under ``method``."""
        self._hist.labels(method).observe(seconds)
        if failed:
            self._errors.labels(method).inc()


class Server:
    """A gRPC server with auth, health and explicit ``start``/``stop``.

    Args:
        host: address to bind ("127.0.0.1", "0.0.0.0", "[::]").
        port: port to bind; 0 picks a free one (see :attr:`port` after start).
        credentials: the cluster token every call must carry (none: no auth,
            loopback or ``insecure`` only) and the TLS material to serve with
            (none: plaintext). The token is checked either way.
        insecure: allow binding a non-loopback host without a token.
        max_workers: threads of the lane that serves the methods with no lane of their own
            (see :mod:`jaxdist.transport.admission`).
        max_message_bytes: largest message sent or received.
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
        self._latency = _RpcMetrics(metrics_registry) if metrics_registry is not None else None
        # Auth, per-method caps and thread lanes, decided before any pool thread is given to a call.
        self._gate = Gate(token, max_workers, self._latency)
        self._server = grpc.server(
            self._gate.default_pool,
            interceptors=[self._gate],
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

    def add_service(self, name: str, handlers: dict[str, grpc.RpcMethodHandler], liveness: Iterable[str] = ()) -> None:
        """Serve ``handlers`` as service ``name`` (before :meth:`start`).

        ``liveness``: names of its methods that tell a caller this task is alive (a PS's
        ``GetStatus``, a worker's ``Heartbeat``). They get their own small thread lane, so
        stalled or slow calls of other methods never delay them; they must answer at once.
        """
        unknown = set(liveness) - set(handlers)
        if unknown:
            raise E.ConfigurationError(f"liveness methods {sorted(unknown)} are not methods of {name}")
        self._gate.add_liveness({f"/{name}/{m}" for m in liveness})
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        self._services.append(name)

    def in_flight(self, method: str) -> int:
        """Calls of ``method`` (``"/pkg.Service/Method"``) admitted and not yet ended (see
        :mod:`jaxdist.transport.admission`: each method admits a bounded number)."""
        return self._gate.in_flight(method)

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
        # grpc sets this event from its serving thread. At interpreter exit (a strategy shut down by its
        # atexit hook) that thread can already be dead: concurrent.futures refuses new work once its own
        # exit hook ran, and a call arriving then kills the thread. An unbounded wait hung the process.
        bound = (grace or 0.0) + _STOP_CONFIRM_S
        if not self._server.stop(grace).wait(bound):
            logger.warning("gRPC server on port %s: no stop confirmation within %.0f s; going on", self.port, bound)
        # Not waiting: a handler still running user code (a closure) must not hold stop() up;
        # idle lane threads exit now, busy ones when their call returns.
        self._gate.close()

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    def __enter__(self) -> Server:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
