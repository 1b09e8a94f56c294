"""The data plane's client: pooled connections to one task's data port, each offering shared memory."""

from __future__ import annotations

import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import grpc
import numpy as np
from google.protobuf.message import DecodeError

from jaxdist.transport.credentials import PLAINTEXT, Credentials, tls_handshake
from jaxdist.transport.dataplane.framing import (
    HELLO,
    HELLO_MAGIC,
    MAX_HEADER_BYTES,
    MAX_TOKEN_BYTES,
    REQUEST,
    REQUEST_MAGIC,
    RESPONSE,
    RESPONSE_MAGIC,
    SHM_ATTACH,
    DataPlaneError,
    recv_exact,
    set_buffers,
    status_code,
    tune,
)
from jaxdist.transport.dataplane.shm import NAMED, SEALED, SHM_SLOT_BYTES, Channel, make_offer, sealed_enabled, shm_enabled

logger = logging.getLogger(__name__)

__all__ = ["DataPlaneClient", "StartedCall"]


def _alive(sock: socket.socket) -> bool:
    """An idle connection is usable: nothing to read (EOF or stray bytes mean it is not)."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return False  # decrypted bytes nobody asked for
    try:
        poller = select.poll()  # not select(): it fails for descriptors above 1024
        poller.register(sock, select.POLLIN | select.POLLERR | select.POLLHUP)
        return not poller.poll(0)
    except (OSError, ValueError):
        return False


class DataPlaneClient:
    """Connections to one task's data plane; thread-safe, one call per connection at a time.

    Idle connections are pooled and checked before reuse. A call that fails
    for a connection-level reason raises :class:`DataPlaneError` with UNAVAILABLE
    (or DEADLINE_EXCEEDED); the connection is dropped. Nothing is retried
    here: callers decide (Pull is idempotent; Push is deduped by ``update_id``).

    Each new connection offers a shared-memory region (``shared_memory``,
    :func:`shm_enabled`): a sealed one first, which the server maps
    (:func:`sealed_enabled`), then a named one, which it copies through. Once a
    server answers that it cannot reach a kind (another host, PID namespace or
    user), this client stops offering that kind. :attr:`shm_connections` counts
    the connections that use a region, :attr:`mapped_connections` those whose
    region the server maps.

    With TLS in ``credentials`` every connection starts with a TLS handshake
    that checks the server's certificate against ``credentials.tls.server_name``
    (default: ``host``); the token goes in the hello either way.
    """

    def __init__(self, host: str, port: int, credentials: Credentials = PLAINTEXT, connect_timeout: float = 3.0,
                 max_idle: int = 8, shared_memory: bool = True, shm_slot_bytes: int = SHM_SLOT_BYTES) -> None:
        self.host = host
        tls = credentials.tls
        self._tls = tls.client_ssl_context() if tls is not None else None
        self._server_hostname = (tls.server_name if tls is not None else None) or host
        self.port = port
        self._token = credentials.token.encode() if credentials.token else b""
        self._connect_timeout = connect_timeout
        self._max_idle = max_idle
        # Region kinds still worth offering, best first; a kind leaves once a server cannot reach it.
        self._shm_kinds: list[str] = [] if not (shared_memory and shm_enabled()) else (
            [SEALED, NAMED] if sealed_enabled() else [NAMED])
        self._slot_bytes = shm_slot_bytes
        self.shm_connections = 0
        self.mapped_connections = 0
        self._idle: list[Channel] = []
        self._lock = threading.Lock()
        self._closed = False

    @property
    def offers_shared_memory(self) -> bool:
        """Whether new connections still offer a region (False after the server could reach no kind of region)."""
        return bool(self._shm_kinds)

    @property
    def offered_kinds(self) -> tuple[str, ...]:
        """The region kinds new connections still offer, in order (:data:`SEALED`, :data:`NAMED`)."""
        return tuple(self._shm_kinds)

    def _stop_offering(self, kind: str) -> None:
        with self._lock:
            if kind in self._shm_kinds:
                self._shm_kinds.remove(kind)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for c in idle:
            self._drop(c)

    def _drop(self, chan: Channel) -> None:
        chan.sock.close()
        if chan.region is not None:
            with self._lock:
                self.shm_connections -= 1
                self.mapped_connections -= chan.kind == SEALED
        chan.close()

    def _connect(self, deadline: float) -> Channel:
        timeout = max(0.001, min(self._connect_timeout, deadline - time.monotonic()))
        sock: socket.socket | None = None
        try:
            infos = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_STREAM)
            last: OSError | None = None
            for family, type_, proto, _, addr in infos:
                sock = socket.socket(family, type_, proto)
                try:
                    set_buffers(sock)
                    sock.settimeout(timeout)
                    sock.connect(addr)
                    break
                except OSError as e:
                    sock.close()
                    sock, last = None, e
            if sock is None:
                raise last or OSError(f"no address for {self.host}")
        except OSError as e:
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"data plane {self.host}:{self.port} unreachable: {e}",
                            connected=False) from None
        chan = Channel(sock)
        try:
            tune(sock)
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            if self._tls is not None:
                sock = chan.sock = tls_handshake(self._tls, sock, server_hostname=self._server_hostname)
            sock.sendall(HELLO.pack(HELLO_MAGIC, len(self._token)) + self._token)
            self._read_response(sock, deadline)
            if self._shm_kinds:
                self._attach(chan, deadline)
        except DataPlaneError as e:
            self._drop(chan)
            if e.code == grpc.StatusCode.UNAUTHENTICATED:
                raise
            # Refused before any call (e.g. the server's connection limit): nothing was sent.
            raise DataPlaneError(e.code, e.details, e.reason, connected=False) from None
        except (OSError, struct.error) as e:
            self._drop(chan)
            raise DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"data plane {self.host}:{self.port}: handshake failed: {e}",
                            connected=False) from None
        return chan

    def _attach(self, chan: Channel, deadline: float) -> None:
        """Offer a shared-memory region on a fresh connection, each kind in turn until one is taken;
        on any other refusal the connection stays on the socket."""
        for kind in self.offered_kinds:
            offer = make_offer(kind, self._slot_bytes)
            if offer is None:
                self._stop_offering(kind)  # this host cannot make this kind (no memory, no memfd): stop trying
                continue
            try:
                header = offer.header()
                chan.sock.sendall(REQUEST.pack(REQUEST_MAGIC, SHM_ATTACH, len(header), 0) + header)
                try:
                    self._read_response(chan.sock, deadline)
                except DataPlaneError as e:
                    offer.region.close()
                    logger.debug("data plane %s:%d: no %s shared memory (%s)", self.host, self.port, kind, e.details)
                    if e.code != grpc.StatusCode.FAILED_PRECONDITION:
                        return  # e.g. the server's region budget is full: this connection stays on the socket
                    self._stop_offering(kind)  # another host, PID namespace or user, or shared memory off there
                    continue
            except BaseException:
                offer.region.close()
                raise
            finally:
                offer.release()  # both ends have it mapped or open (or nobody needs it): nothing is left behind
            chan.attach(offer.region, kind)
            with self._lock:
                self.shm_connections += 1
                self.mapped_connections += kind == SEALED
            return

    def _checkout(self, deadline: float) -> Channel:
        while True:
            with self._lock:
                if self._closed:
                    raise DataPlaneError(grpc.StatusCode.CANCELLED, "data plane client is closed", connected=False)
                chan = self._idle.pop() if self._idle else None
            if chan is None:
                return self._connect(deadline)
            if _alive(chan.sock):
                return chan
            self._drop(chan)

    def _checkin(self, chan: Channel) -> None:
        with self._lock:
            if not self._closed and len(self._idle) < self._max_idle:
                self._idle.append(chan)
                return
        self._drop(chan)

    @staticmethod
    def _read_response(sock: socket.socket, deadline: float) -> tuple[bytes, int]:
        magic, code, reason_len, body_len, payload_len = RESPONSE.unpack(recv_exact(sock, RESPONSE.size, deadline))
        if magic != RESPONSE_MAGIC or reason_len > MAX_TOKEN_BYTES or body_len > MAX_HEADER_BYTES:
            raise ConnectionError("data plane: malformed response")
        reason = recv_exact(sock, reason_len, deadline).decode(errors="replace")
        body = recv_exact(sock, body_len, deadline)
        status = status_code(code)
        if status != grpc.StatusCode.OK:
            raise DataPlaneError(status, body.decode(errors="replace"), reason)
        return body, payload_len

    def call(
        self,
        method: int,
        header: bytes,
        arrays: Sequence[np.ndarray],
        timeout: float,
        receive: Callable[[bytes], Sequence[np.ndarray]] | None = None,
    ) -> tuple[bytes, Sequence[np.ndarray]]:
        """One call: send ``header`` and the arrays' bytes; return the response message and arrays.

        ``receive(response message)`` returns the arrays the response payload
        is read into (their sizes must add up to it); without it the response
        must carry no payload.

        Raises:
            DataPlaneError: the server's error status (connection kept), or
                UNAVAILABLE / DEADLINE_EXCEEDED for a lost or slow connection.
        """
        return self.finish(self.start(method, header, arrays, timeout), receive)

    def start(self, method: int, header: bytes, arrays: Sequence[np.ndarray], timeout: float) -> StartedCall:
        """The first half of :meth:`call`: send the request and return at once, so that calls to several
        servers run at the same time without a thread each. Every started call must be finished
        (:meth:`finish`), or its connection is held until it is garbage.

        Raises:
            DataPlaneError: as :meth:`call` (nothing to finish then).
        """
        deadline = time.monotonic() + timeout
        chan = self._checkout(deadline)
        try:
            chan.sock.settimeout(max(0.001, deadline - time.monotonic()))
            chan.send(arrays, deadline, prefix=REQUEST.pack(REQUEST_MAGIC, method, len(header), sum(a.nbytes for a in arrays)) + header)
        except (OSError, struct.error) as e:  # TimeoutError included
            self._drop(chan)
            raise self._lost(e, timeout) from None
        except BaseException:
            self._drop(chan)
            raise
        return StartedCall(chan, deadline, timeout)

    def finish(self, started: StartedCall, receive: Callable[[bytes], Sequence[np.ndarray]] | None = None
               ) -> tuple[bytes, Sequence[np.ndarray]]:
        """The second half of :meth:`call`: read the answer of a :meth:`start` ed call."""
        chan, deadline = started.chan, started.deadline
        sock = chan.sock
        keep = False
        try:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chan.settle(deadline)
            try:
                body, payload_len = self._read_response(sock, deadline)
            except DataPlaneError:
                keep = True  # a well-framed error response: the connection stays in step
                raise
            out: Sequence[np.ndarray] = ()
            if payload_len or receive is not None:
                try:
                    out = receive(body) if receive is not None else ()
                except DecodeError as e:
                    raise DataPlaneError(grpc.StatusCode.INTERNAL, f"data plane: malformed response message ({e})") from None
                if sum(a.nbytes for a in out) != payload_len:
                    raise ConnectionError(f"data plane: response payload of {payload_len} bytes does not match its header")
                chan.recv_into(out, deadline)
            keep = True
            return body, out
        except (OSError, struct.error) as e:  # TimeoutError included
            raise self._lost(e, started.timeout) from None
        finally:
            if keep:
                self._checkin(chan)
            else:
                self._drop(chan)

    def _lost(self, e: OSError | struct.error, timeout: float) -> DataPlaneError:
        """The error a call raises when its connection timed out or was lost."""
        if isinstance(e, TimeoutError):
            return DataPlaneError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                  f"data plane call to {self.host}:{self.port} timed out after {timeout:.1f}s")
        return DataPlaneError(grpc.StatusCode.UNAVAILABLE, f"data plane connection to {self.host}:{self.port} lost: {e}")


@dataclass
class StartedCall:
    """A call :meth:`DataPlaneClient.start` sent, to be read by :meth:`DataPlaneClient.finish`."""

    chan: Channel
    deadline: float
    timeout: float
