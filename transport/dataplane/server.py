"""The data plane's server: a listening socket and one thread per connection, calls answered through the guard.

Connection budgets. A connection is *pending* from accept until
its hello is done and *authenticated* after:

- Pending connections have a budget of their own (:data:`DEFAULT_MAX_PENDING`) and
  never take one of the ``max_connections`` slots, so peers without the token
  cannot hold the slots token holders need. When the pending budget is full, the
  oldest pending connection is closed to admit the new one: a flood of idle
  connections then only churns among themselves, while a real client's hello
  (sent right after connect) completes long before it could become the oldest.
- The whole hello (with the TLS handshake before it) has one deadline,
  :data:`HELLO_TIMEOUT_S`, however the bytes are dribbled in.
- The ``max_connections`` cap is checked after the hello: a token holder beyond it
  is told RESOURCE_EXHAUSTED (and its client comes back later,
  :class:`jaxdist.ps_server.client.PSClient` backs off and retries); a peer without
  the token learns nothing about it.
"""

from __future__ import annotations

import hmac
import logging
import select
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import grpc
import numpy as np

from jaxdist.base import errors as E
from jaxdist.transport.credentials import PLAINTEXT, Credentials
from jaxdist.transport.dataplane.framing import (
    HELLO,
    HELLO_MAGIC,
    MAX_HEADER_BYTES,
    MAX_TOKEN_BYTES,
    METHOD_NAMES,
    REQUEST,
    REQUEST_MAGIC,
    SHM_ATTACH,
    error_response,
    recv_exact,
    response_envelope,
    set_buffers,
    shutdown,
    tune,
)
from jaxdist.transport.dataplane.shm import DEFAULT_MAX_SHM_CONNECTIONS, NAMED, SEALED, Channel, Region, open_region, shm_enabled
from jaxdist.transport.guard import guard

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_CONNECTIONS", "DataPlaneServer", "Handler", "Payload"]

#: Authenticated connections one server keeps at once; more are refused RESOURCE_EXHAUSTED after their hello.
DEFAULT_MAX_CONNECTIONS = 1024
#: Connections still before or in their hello; beyond this the oldest is closed.
DEFAULT_MAX_PENDING = 64
#: A client that connected must have finished its hello (TLS handshake included) within this time.
HELLO_TIMEOUT_S = 10.0
#: Largest payload one request may announce (bigger: RESOURCE_EXHAUSTED, connection closed, since it
#: cannot be drained); far above any tensor a PS holds, and it keeps every deadline computable.
DEFAULT_MAX_PAYLOAD_BYTES = 1 << 40
#: Server side bound on one started request: base + bytes at a slow rate.
_REQUEST_BASE_S = 30.0
_REQUEST_MIN_RATE = 20e6


class Payload:
    """The payload bytes of one request, read straight into arrays the handler provides."""

    def __init__(self, channel: Channel, nbytes: int, deadline: float) -> None:
        self._channel = channel
        self.nbytes = nbytes
        self.remaining = nbytes
        self._deadline = deadline

    def read_into(self, arrays: Sequence[np.ndarray]) -> None:
        """Fill ``arrays`` (C-contiguous, writable) with the whole payload.

        Raises:
            InvalidRequestError: their sizes do not add up to the payload's
                announced length (the payload is left to be drained).
        """
        want = sum(a.nbytes for a in arrays)
        if want != self.remaining:
            raise E.InvalidRequestError(
                f"request announces {self.remaining} payload bytes but its header describes {want}"
            )
        self._channel.recv_into(arrays, self._deadline)
        self.remaining = 0

    def drain(self) -> None:
        """Read and drop what is left, so the connection can carry the next call."""
        if self.remaining:
            self._channel.discard(self.remaining, self._deadline)
            self.remaining = 0


#: A handler gets the request's header message and its payload, and returns a
#: context manager giving ``(response message bytes, response arrays)``; the
#: arrays are sent while the context is open (a PS keeps its read snapshot).
Handler = Callable[[bytes, Payload], AbstractContextManager[tuple[bytes, Sequence[np.ndarray]]]]


class DataPlaneServer:
    """Serves the data plane for one task: a listening socket and one thread per connection.

    Args:
        handlers: method number -> :data:`Handler`.
        host/port: where to listen; port 0 picks a free one (:attr:`port` after start).
        credentials: the cluster token clients must present (none: no check; loopback
            only) and, when it has TLS material, the certificate to serve TLS with (the
            handshake precedes the hello).
        observe: optional ``observe(method_name, seconds, failed)`` per call (metrics).
        max_connections: authenticated connections at once (RESOURCE_EXHAUSTED after the hello beyond).
        max_pending: connections before or in their hello at once (the oldest is closed beyond).
        max_payload_bytes: largest payload a request may announce (RESOURCE_EXHAUSTED beyond).
        shared_memory: accept same-host clients' shared-memory regions (also needs
            :func:`shm_enabled`); at most ``max_shm_connections`` at once.

    ``start``/``stop`` or a context manager. ``stop`` closes the listener and
    every connection and joins the threads.
    """

    def __init__(
        self,
        handlers: dict[int, Handler],
        host: str = "127.0.0.1",
        port: int = 0,
        credentials: Credentials = PLAINTEXT,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        max_pending: int = DEFAULT_MAX_PENDING,
        max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES,
        observe: Callable[[str, float, bool], None] | None = None,
        shared_memory: bool = True,
        max_shm_connections: int = DEFAULT_MAX_SHM_CONNECTIONS,
    ) -> None:
        self._handlers = dict(handlers)
        # Built now so bad TLS files fail at construction, like the gRPC server's.
        self._tls = credentials.tls.server_ssl_context() if credentials.tls is not None else None
        self._shared_memory = shared_memory and shm_enabled()
        self._max_shm = max_shm_connections
        self._shm_conns = 0
        self._mapped_conns = 0
        self.host = host
        self.requested_port = port
        self.port: int | None = None
        self._token = credentials.token.encode() if credentials.token else None
        self._max_connections = max_connections
        self._max_pending = max(1, max_pending)
        self._max_payload = max_payload_bytes
        # Pending connections, oldest first (dicts keep insertion order); the value is unused.
        self._pending: dict[_Pending, None] = {}
        self._observe = observe
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._busy: set[socket.socket] = set()  # connections inside a call
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._accept_thread: threading.Thread | None = None

    def start(self) -> int:
        family = socket.AF_INET6 if ":" in self.host.strip("[]") else socket.AF_INET
        ls = socket.socket(family, socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            set_buffers(ls)  # accepted connections inherit them
            ls.bind((self.host.strip("[]"), self.requested_port))
            ls.listen(128)
        except OSError as e:
            ls.close()
            raise E.ConfigurationError(f"data plane: could not bind {self.host}:{self.requested_port} ({e})") from None
        self._listener = ls
        self.port = ls.getsockname()[1]
        self._accept_thread = threading.Thread(target=self._accept_loop, name="jaxdist-dataplane-accept", daemon=True)
        self._accept_thread.start()
        return self.port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting, let calls in flight finish for up to ``grace`` seconds, then close everything."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        deadline = time.monotonic() + (grace or 0.0)
        while True:
            with self._lock:
                idle = [c for c in self._conns if c not in self._busy]
                busy = len(self._busy)
            for c in idle:  # a thread blocked waiting for the next request wakes up and exits
                shutdown(c)
            if not busy or time.monotonic() >= deadline:
                break
            time.sleep(0.01)
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
            conns += [p.sock for p in self._pending]
        for c in conns:
            shutdown(c)
        end = time.monotonic() + 5.0
        if self._accept_thread is not None:
            self._accept_thread.join(max(0.0, end - time.monotonic()))
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))

    def __enter__(self) -> DataPlaneServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def connections(self) -> int:
        """Authenticated connections (those that count against ``max_connections``)."""
        with self._lock:
            return len(self._conns)

    @property
    def pending(self) -> int:
        """Connections before or in their hello."""
        with self._lock:
            return len(self._pending)

    @property
    def shm_connections(self) -> int:
        """Connections whose payloads currently move through shared memory."""
        with self._lock:
            return self._shm_conns

    @property
    def mapped_connections(self) -> int:
        """Of :attr:`shm_connections`, those whose region this server maps (sealed regions; the others
        are copied through their file)."""
        with self._lock:
            return self._mapped_conns

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopped.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._stopped.is_set():
                    return
                time.sleep(0.01)  # e.g. EMFILE: do not spin
                continue
            pending = _Pending(conn)
            with self._lock:
                evict = None
                if len(self._pending) >= self._max_pending:
                    evict = next(iter(self._pending))
                    del self._pending[evict]
                self._pending[pending] = None
            if evict is not None:
                shutdown(evict.sock)  # its thread wakes up and ends that connection
            t = threading.Thread(target=self._serve, args=(pending,), name="jaxdist-dataplane-conn", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _hello(self, conn: socket.socket, deadline: float) -> bool:
        """Read and check the hello (all of it before ``deadline``); answer it unless the cap is full."""
        magic, token_len = HELLO.unpack(recv_exact(conn, HELLO.size, deadline))
        if magic != HELLO_MAGIC or token_len > MAX_TOKEN_BYTES:
            conn.sendall(error_response(E.InvalidRequestError("data plane: not a jaxdist data-plane client (bad hello)")))
            return False
        token = recv_exact(conn, token_len, deadline)
        if self._token is not None and not hmac.compare_digest(token, self._token):
            conn.sendall(error_response(E.AuthenticationError(
                "data plane: missing or wrong auth token; set JAXDIST_TOKEN to the cluster's token")))
            return False
        return True

    def _promote(self, pending: _Pending) -> str:
        """Move a connection whose hello passed from the pending budget to the authenticated one."""
        with self._lock:
            if pending not in self._pending:
                return "evicted"  # closed meanwhile as the oldest pending (or by stop)
            del self._pending[pending]
            if self._stopped.is_set():
                return "stopped"
            if len(self._conns) >= self._max_connections:
                return "full"
            self._conns.add(pending.sock)
            return "ok"

    def _serve(self, pending: _Pending) -> None:
        chan: Channel | None = None
        conn = pending.sock
        try:
            tune(conn)
            deadline = time.monotonic() + HELLO_TIMEOUT_S  # one deadline for the handshake and the whole hello
            if self._tls is not None:
                conn.settimeout(HELLO_TIMEOUT_S)
                secure = self._tls.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
                with self._lock:
                    pending.sock = secure  # ``conn`` is detached: eviction must shut the TLS socket down
                conn = secure
                _handshake(secure, deadline)
            chan = Channel(conn)
            if not self._hello(conn, deadline):
                return
            promoted = self._promote(pending)
            if promoted == "full":
                conn.settimeout(max(0.001, deadline - time.monotonic()))
                conn.sendall(error_response(E.PayloadTooLargeError(
                    f"data plane: {self._max_connections} connections already open; use gRPC and retry later")))
                return
            if promoted != "ok":
                return
            conn.settimeout(max(0.001, deadline - time.monotonic()))
            conn.sendall(response_envelope(grpc.StatusCode.OK, b"", b"", 0))
            while not self._stopped.is_set():
                conn.settimeout(None)  # idle between calls; keepalive finds dead peers
                try:
                    chan.settle()  # the last response's slot acknowledgements come first
                    head = recv_exact(conn, REQUEST.size)
                except ConnectionError:
                    return  # the client closed its connection
                with self._lock:
                    if self._stopped.is_set():
                        return
                    self._busy.add(conn)
                try:
                    if not self._call(chan, head):
                        return
                finally:
                    with self._lock:
                        self._busy.discard(conn)
        except (OSError, struct.error):
            return  # peer vanished, timed out, or sent garbage before hello: only this connection ends
        except Exception:  # noqa: BLE001 - a connection's failure must never take the server down
            logger.exception("data plane connection failed")
        finally:
            conn.close()
            with self._lock:
                if chan is not None and chan.region is not None:
                    self._shm_conns -= 1
                    self._mapped_conns -= chan.kind == SEALED
                self._pending.pop(pending, None)
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            if chan is not None:
                chan.close()

    def _attach(self, chan: Channel, header: bytes) -> None:
        """ShmAttach: open the client's region, mapped if sealed (typed error: the client keeps using the socket)."""
        if not self._shared_memory:
            raise E.RemoteError("ShmAttach: shared memory is off on this server",
                                code=grpc.StatusCode.FAILED_PRECONDITION)
        if chan.region is not None:
            raise E.InvalidRequestError("ShmAttach: this connection already has a region")
        with self._lock:
            if self._shm_conns >= self._max_shm:
                raise E.PayloadTooLargeError(f"ShmAttach: {self._max_shm} connections already use shared memory")
            self._shm_conns += 1
        try:
            region = open_region(header)
        except BaseException:
            with self._lock:
                self._shm_conns -= 1
            raise
        kind = SEALED if isinstance(region, Region) else NAMED
        chan.attach(region, kind)
        with self._lock:
            self._mapped_conns += kind == SEALED

    def _call(self, chan: Channel, head: bytes) -> bool:
        """Serve one request; False when the connection must end."""
        conn = chan.sock
        magic, method, header_len, payload_len = REQUEST.unpack(head)
        handler = self._handlers.get(method)
        if method == SHM_ATTACH and magic == REQUEST_MAGIC and header_len <= MAX_TOKEN_BYTES and not payload_len:
            conn.settimeout(HELLO_TIMEOUT_S)
            header = recv_exact(conn, header_len)
            with guard("ShmAttach", lambda exc: chan.write(error_response(exc)), reraise=_connection_lost):
                self._attach(chan, header)
                chan.write(response_envelope(grpc.StatusCode.OK, b"", b"", 0))
            return True
        if magic != REQUEST_MAGIC or handler is None or header_len > MAX_HEADER_BYTES:
            what = "bad request magic" if magic != REQUEST_MAGIC else (
                "malformed ShmAttach request" if method == SHM_ATTACH else
                f"unknown method {method}" if handler is None else f"header of {header_len} bytes is too large")
            chan.write(error_response(E.InvalidRequestError(f"data plane: {what}")))
            return False
        if payload_len > self._max_payload:
            # Cannot be drained (nor could its deadline be computed): answer, then end the connection.
            chan.write(error_response(E.PayloadTooLargeError(
                f"data plane: request announces {payload_len} payload bytes, more than this server's "
                f"limit of {self._max_payload}")))
            return False
        t0 = time.perf_counter()
        deadline = time.monotonic() + _REQUEST_BASE_S + (header_len + payload_len) / _REQUEST_MIN_RATE
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        header = recv_exact(conn, header_len)
        payload = Payload(chan, payload_len, deadline)
        name = METHOD_NAMES.get(method, str(method))
        failed = True
        try:
            # Handler errors are raised before the response starts (the sending code below
            # raises only connection errors, which pass through), so an error envelope is
            # still well-framed once the unread payload is drained.
            with guard(name, lambda exc: self._fail(chan, payload, exc), reraise=_connection_lost):
                with handler(header, payload) as (body, arrays):
                    if payload.remaining:
                        raise E.InvalidRequestError(f"{name}: request carries {payload.remaining} payload bytes it does not use")
                    conn.settimeout(max(0.001, deadline - time.monotonic()))
                    chan.send(arrays, deadline, prefix=response_envelope(grpc.StatusCode.OK, b"", body, sum(a.nbytes for a in arrays)))
                    failed = False
        finally:
            if self._observe is not None:
                self._observe(name, time.perf_counter() - t0, failed)
        return True

    @staticmethod
    def _fail(chan: Channel, payload: Payload, exc: E.JaxdistError) -> None:
        payload.drain()
        chan.write(error_response(exc))  # after the acknowledgement owed for the payload read, if any


class _Pending:
    """One connection while it counts in the pending budget (its socket changes when TLS wraps it)."""

    __slots__ = ("sock",)

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock


def _handshake(sock: ssl.SSLSocket, deadline: float) -> None:
    """The TLS handshake, finished before ``deadline`` however slowly the peer sends its bytes."""
    sock.setblocking(False)
    try:
        while True:
            try:
                sock.do_handshake()
                return
            except ssl.SSLWantReadError:
                events = select.POLLIN
            except ssl.SSLWantWriteError:
                events = select.POLLOUT
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("data plane: TLS handshake took longer than the hello deadline")
            poller = select.poll()
            poller.register(sock, events)
            poller.poll(left * 1000)
    finally:
        sock.setblocking(True)


def _connection_lost(exc: Exception) -> bool:
    """This connection itself failed (peer gone, timeout, garbage framing): nothing can be answered."""
    return isinstance(exc, (OSError, struct.error))
