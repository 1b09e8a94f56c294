"""Client side of gRPC: addresses, channels and their options, health waits.

- Channels retry transient UNAVAILABLE on idempotent unary calls, declared in
  the service config (:data:`SERVICE_CONFIG`), never in hand-written loops.
- **Credentials** (:class:`jaxdist.transport.credentials.Credentials`) decide
  TLS; the token travels per call (``metadata=credentials.metadata``, which
  :class:`jaxdist.transport.client.ServiceClient` adds to every call).
"""

from __future__ import annotations

import ipaddress
import json
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxdist.transport.credentials import PLAINTEXT, Credentials

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "PLAINTEXT",
    "SERVICE_CONFIG",
    "channel_options",
    "dialable_host",
    "is_loopback",
    "make_channel",
    "unary_method",
    "wait_healthy",
]

#: Largest single gRPC message. Bulk payloads are chunked at 4 MiB, so this only
#: bounds headers and control messages; bigger ones get RESOURCE_EXHAUSTED.
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20

#: Retry transient UNAVAILABLE on idempotent unary calls, declared in the service
#: config (gRPC retries them transparently, with backoff) rather than hand-written
#: loops. The server-streaming Pull is not listed: with it listed we saw pulls hang
#: past their deadline after a PS restart at the same address (grpcio 1.85); callers
#: of Pull retry at their level (closures are re-run, PS recovery waits for the PS).
_IDEMPOTENT = [
    {"service": "jaxdist.ParameterServer", "method": m} for m in ("ListVariables", "GetStatus")
] + [{"service": "jaxdist.Worker", "method": m} for m in ("Heartbeat", "Configure")] + [
    {"service": "grpc.health.v1.Health", "method": "Check"}
]
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": _IDEMPOTENT,
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.service_config", SERVICE_CONFIG),
        ("grpc.enable_retries", 1),
        # Reconnect quickly after a peer restarts at the same address (a refused connection is
        # retried after 0.1 s, backing off to 1 s).
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # gRPC core reads this one as the *minimum connect timeout*: how long one connection
        # attempt may take to get the server's HTTP/2 SETTINGS. At 100 ms (it was set with the
        # backoffs above) a busy server fails attempts that are merely slow: 1,000 simulated
        # workers connecting to one PS at once on a loaded machine got PSUnavailableError
        # ("connection attempt timed out before receiving SETTINGS frame"). A refused
        # connection still fails at once; every call has its own deadline anyway.
        ("grpc.min_reconnect_backoff_ms", 5_000),
        # Detect a silently dead peer in ~8 s even mid-call (no RST arrives from a frozen host).
        ("grpc.keepalive_time_ms", 5_000),
        ("grpc.keepalive_timeout_ms", 3_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Each client object gets its own TCP connection (parallel streams to one PS).
        ("grpc.use_local_subchannel_pool", 1),
        # Server-streaming calls (Pull) are read in the calling thread instead of
        # starting a channel-spin thread per call: a thread start per pull was
        # ~15% of a 4 MB pull's client time (py-spy).
        ("grpc.experimental.single_threaded_unary_stream", 1),
    ]


def make_channel(
    address: str, credentials: Credentials = PLAINTEXT, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
) -> grpc.Channel:
    """A channel to ``address``, with TLS when ``credentials.tls`` is set (the token is per call:
    pass ``metadata=credentials.metadata``)."""
    options = channel_options(max_message_bytes)
    cfg = credentials.tls
    if cfg is None:
        return grpc.insecure_channel(address, options=options)
    if cfg.server_name:
        options.append(("grpc.ssl_target_name_override", cfg.server_name))
    return grpc.secure_channel(address, cfg.channel_credentials(), options=options)


def unary_method(channel: grpc.Channel, path: str, request_cls: Any, response_cls: Any) -> grpc.UnaryUnaryMultiCallable:
    """A unary client method whose messages are protobuf classes ``request_cls``/``response_cls``."""
    return channel.unary_unary(path, request_serializer=request_cls.SerializeToString, response_deserializer=response_cls.FromString)


#: Bind addresses that mean "every interface"; a client on this host dials loopback instead.
_WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})


def dialable_host(host: str | None) -> str:
    """The host a client on this machine dials for a server bound to ``host``."""
    return "127.0.0.1" if host is None or host in _WILDCARD_HOSTS else host


def is_loopback(host: str) -> bool:
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def wait_healthy(address: str, timeout: float, credentials: Credentials = PLAINTEXT, service: str = "") -> None:
    """Block until ``address`` answers SERVING to a health check, or raise TimeoutError.

    Only ``credentials.tls`` matters (health checks carry no token)."""
    deadline = time.monotonic() + timeout
    with make_channel(address, credentials) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        last: Exception | None = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{address} did not become healthy within {timeout:.0f}s (last error: {last})")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=min(left, 2.0), wait_for_ready=True)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as e:
                last = e
            time.sleep(0.05)
