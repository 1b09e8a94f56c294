"""Data-plane framing: the hello, request and response envelopes, method numbers, and socket I/O.

The byte layout is the package docstring's (:mod:`jaxdist.transport.dataplane`);
this module is its one implementation, used by both ends.
"""

from __future__ import annotations

import os
import socket
import struct
import time

import grpc

from jaxdist.base import errors as E
from jaxdist.proto import status

__all__ = [
    "ENV_DATA_PLANE",
    "HELLO",
    "HELLO_MAGIC",
    "MAX_HEADER_BYTES",
    "MAX_TOKEN_BYTES",
    "METHOD_NAMES",
    "PULL",
    "PUSH",
    "PUSH_PULL",
    "REQUEST",
    "REQUEST_MAGIC",
    "RESPONSE",
    "RESPONSE_MAGIC",
    "SHM_ATTACH",
    "SOCKET_BUFFER_BYTES",
    "DataPlaneError",
    "enabled",
    "env_on",
    "error_response",
    "recv_exact",
    "recv_into",
    "response_envelope",
    "set_buffers",
    "shutdown",
    "status_code",
    "tune",
]

#: ``JAXDIST_DATA_PLANE=0`` turns the data plane off in this process (PS: not served; client: not used).
ENV_DATA_PLANE = "JAXDIST_DATA_PLANE"


def env_on(name: str) -> bool:
    """Whether environment variable ``name`` is unset or not a "no" (``0``, ``false``, ``no``, ``off``)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def enabled() -> bool:
    """Whether this process may serve or use the data plane (``JAXDIST_DATA_PLANE`` is not ``0``)."""
    return env_on(ENV_DATA_PLANE)


HELLO_MAGIC = b"JXB1"
REQUEST_MAGIC = b"JXRQ"
RESPONSE_MAGIC = b"JXRS"
#: hello: magic, u32 token length (the token follows).
HELLO = struct.Struct("<4sI")
#: request: magic, u8 method, 3 pad bytes, u32 header length, u64 payload length.
REQUEST = struct.Struct("<4sB3xIQ")
#: response: magic, u32 status code, u32 reason length, u32 body length, u64 payload length.
RESPONSE = struct.Struct("<4sIIIQ")

#: Method numbers on the wire.
PULL = 1
PUSH = 2
SHM_ATTACH = 3  # served by DataPlaneServer itself, see the module docstring
PUSH_PULL = 4  # fused push-then-pull: a Push's request, a Pull's answer
METHOD_NAMES = {PULL: "Pull", PUSH: "Push", SHM_ATTACH: "ShmAttach", PUSH_PULL: "PushPull"}

#: Largest token in a hello; also bounds a response's reason and a ShmAttach header (all short).
MAX_TOKEN_BYTES = 4096
#: Largest header message; bigger means garbage or abuse (the gRPC limit for messages is the same).
MAX_HEADER_BYTES = 64 << 20


class DataPlaneError(Exception):
    """A data-plane call failed with gRPC status ``code``.

    ``connected`` is False when no connection could be made at all (nothing
    was sent); the caller may then fall back to gRPC or rediscover the port.
    """

    def __init__(self, code: grpc.StatusCode, details: str, reason: str = "", connected: bool = True) -> None:
        super().__init__(details)
        self.code = code
        self.details = details
        self.reason = reason
        self.connected = connected


_CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


def status_code(value: int) -> grpc.StatusCode:
    """The gRPC status code numbered ``value`` on the wire (UNKNOWN for numbers gRPC does not define)."""
    return _CODE_BY_VALUE.get(value, grpc.StatusCode.UNKNOWN)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """Exactly ``n`` bytes from ``sock`` (ConnectionError when the peer closes first)."""
    buf = bytearray(n)
    recv_into(sock, memoryview(buf), deadline)
    return bytes(buf)


def recv_into(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; ``socket.timeout`` once ``deadline`` (monotonic) passes."""
    pos, n = 0, len(view)
    while pos < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("deadline exceeded")
            sock.settimeout(left)
        got = sock.recv_into(view[pos:], n - pos)
        if got == 0:
            raise ConnectionError("peer closed the connection")
        pos += got


#: Socket buffers asked for (the kernel caps them at net.core.[rw]mem_max). Measured on
#: loopback with 4 MB messages: ~2x less CPU per byte than the autotuned defaults,
#: since each wakeup moves more bytes.
SOCKET_BUFFER_BYTES = 4 << 20


def set_buffers(sock: socket.socket) -> None:
    # Set before connect/listen: the receive buffer decides the TCP window scale of the handshake.
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, SOCKET_BUFFER_BYTES)


def tune(sock: socket.socket) -> None:
    """No Nagle delay (envelopes are small and answered at once) and TCP keepalive."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    # Dead peers (a host that froze or vanished) are noticed in ~25 s even when idle.
    for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def response_envelope(code: grpc.StatusCode, reason: bytes, body: bytes, payload_len: int) -> bytes:
    """A response envelope with its reason and body (the payload follows separately)."""
    return RESPONSE.pack(RESPONSE_MAGIC, code.value[0], len(reason), len(body), payload_len) + reason + body


def error_response(exc: E.JaxdistError) -> bytes:
    """The response for a typed error: its status code and reason, its text as the body, no payload."""
    return response_envelope(exc.code, exc.reason.encode(), status.details(exc).encode(errors="replace"), 0)


def shutdown(sock: socket.socket) -> None:
    """Shut both directions down (wakes a thread blocked reading it); errors ignored."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
