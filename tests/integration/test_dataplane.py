"""The data plane (jaxdist.transport.dataplane): Pull/Push over plain TCP beside gRPC.

Real sockets on 127.0.0.1 port 0. The PS tests in test_ps_server.py also run
over it (the ``ps_client`` fixture is parametrized by transport); these cover
what is specific to it: discovery, fallback, restarts, framing, garbage,
limits, deadlines and concurrency.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any
from contextlib import contextmanager

import grpc
import numpy as np
import pytest

from jaxdist.errors import (
    AuthenticationError,
    DTypeMismatchError,
    PayloadTooLargeError,
    PSUnavailableError,
    ShapeMismatchError,
    UpdateMismatchError,
    VariableNotFoundError,
)
from jaxdist.proto import codec, ps_pb2
from jaxdist.transport import dataplane
from jaxdist.transport.dataplane import framing, shm
from jaxdist.proto.ps_wire import CreateSpec, Op, PullSpec, Update
from jaxdist.ps_server.client import PSClient
from jaxdist.ps_server.server import ParameterServer

from jaxdist.transport.credentials import Credentials
from conftest import CREDS, TOKEN, poll_for

pytestmark = pytest.mark.timeout(60)


def _hello(sock: socket.socket, token: str = TOKEN) -> tuple[int, str]:
    t = token.encode()
    sock.sendall(framing.HELLO.pack(dataplane.HELLO_MAGIC, len(t)) + t)
    return _read_status(sock)


def _read_status(sock: socket.socket) -> tuple[int, str]:
    """(status code, reason) of one response envelope; its body and payload are consumed."""
    magic, code, reason_len, body_len, payload_len = framing.RESPONSE.unpack(_recv(sock, framing.RESPONSE.size))
    assert magic == dataplane.RESPONSE_MAGIC
    reason = _recv(sock, reason_len).decode()
    _recv(sock, body_len + payload_len)
    return code, reason


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _request(method: int, header: bytes, payload: bytes = b"", payload_len: int | None = None) -> bytes:
    n = len(payload) if payload_len is None else payload_len
    return framing.REQUEST.pack(dataplane.REQUEST_MAGIC, method, len(header), n) + header + payload


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def client(ps_server: ParameterServer) -> Iterator[PSClient]:
    c = PSClient(ps_server.address, CREDS, task="ps:0")
    c.create([CreateSpec("v", value=np.zeros((4, 3), np.float32))])
    yield c
    c.close()


def _raw(ps: ParameterServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", ps.data_port), timeout=5)
    return s


def test_a_repeated_update_id_naming_another_variable_is_a_typed_error_on_both_transports(
    ps_server: ParameterServer, client: PSClient
) -> None:
    """A re-run closure that pushes another variable at a position is refused, typed
    (FAILED_PRECONDITION), on the data plane and on gRPC alike, and changes nothing."""
    client.create([CreateSpec("other", value=np.zeros(3, np.float32))])
    assert client.push([Update("v", Op.ASSIGN_ADD, np.ones((4, 3), np.float32))], update_id="run/9/1") == ([2], False)
    via_grpc = PSClient(ps_server.address, CREDS, task="ps:0", data_plane=False)
    try:
        for c in (client, via_grpc):
            with pytest.raises(UpdateMismatchError) as e:
                c.push([Update("other", Op.ASSIGN_ADD, np.ones(3, np.float32))], update_id="run/9/1")
            assert e.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert c.push([Update("v", Op.ASSIGN_ADD, np.ones((4, 3), np.float32))], update_id="run/9/1") == ([2], True)
        ((other, version),) = client.pull([PullSpec("other")])
        assert version == 1 and not other.any()
    finally:
        via_grpc.close()


def test_pull_and_push_use_the_data_plane_and_match_grpc(ps_server: ParameterServer, client: PSClient) -> None:
    assert ps_server.data_port and client.uses_data_plane
    assert client.status().data_port == ps_server.data_port
    big = np.random.default_rng(0).standard_normal((3000, 1000)).astype(np.float32)
    client.create([CreateSpec("big", value=big)])
    client.push([Update("big", Op.ASSIGN_ADD, big)], update_id="u1")
    assert client.push([Update("big", Op.ASSIGN_ADD, big)], update_id="u1") == ([2], True)  # deduped
    via_grpc = PSClient(ps_server.address, CREDS, task="ps:0", data_plane=False)
    try:
        ((a, va),) = client.pull([PullSpec("big")])
        ((b, vb),) = via_grpc.pull([PullSpec("big")])
        assert va == vb == 2 and np.array_equal(a, 2 * big) and np.array_equal(a, b)
        assert via_grpc.uses_data_plane is False
    finally:
        via_grpc.close()
    # In place into a caller's buffer, and "not modified" without payload.
    out = np.empty_like(big)
    ((got, _),) = client.pull([PullSpec("big")], out=[out])
    assert got is out and np.array_equal(out, 2 * big)
    assert client.pull([PullSpec("big", known_version=2)]) == [(None, 2)]
    assert ps_server.servicer.counters.snapshot()["pulls"] >= 4


def test_typed_errors_over_the_data_plane(ps_server: ParameterServer, client: PSClient) -> None:
    with pytest.raises(VariableNotFoundError):
        client.pull([PullSpec("nope")])
    with pytest.raises(ShapeMismatchError):
        client.push([Update("v", Op.ASSIGN, np.zeros((5, 3), np.float32))])
    with pytest.raises(DTypeMismatchError):
        client.push([Update("v", Op.ASSIGN, np.zeros((4, 3), np.int32))])
    with pytest.raises(PayloadTooLargeError):
        client.create([CreateSpec("huge", value=np.zeros(65 << 18, np.float32))])  # 65 MiB > the fixture's 64 MiB
    bad = PSClient(ps_server.address, Credentials("wrong"), task="ps:0")
    try:
        with pytest.raises(AuthenticationError):  # GetStatus (discovery) already refuses it
            bad.pull([PullSpec("v")])
    finally:
        bad.close()
    # After all that, the same connection still works.
    assert client.push([Update("v", Op.ASSIGN_ADD, np.ones((4, 3), np.float32))]) == ([2], False)
    assert client.uses_data_plane


def test_wrong_token_on_the_data_port_is_unauthenticated(ps_server: ParameterServer) -> None:
    with _raw(ps_server) as s:
        code, reason = _hello(s, "wrong")
        assert code == grpc.StatusCode.UNAUTHENTICATED.value[0] and reason == AuthenticationError.reason
        assert _closed(s)
    c = dataplane.DataPlaneClient("127.0.0.1", ps_server.data_port, Credentials("wrong"))
    with pytest.raises(dataplane.DataPlaneError) as e:
        c.call(dataplane.PULL, b"", (), timeout=5)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    c.close()


@pytest.mark.parametrize(
    "junk",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", os.urandom(64), framing.HELLO.pack(dataplane.HELLO_MAGIC, 1 << 30)],
    ids=["http", "random", "huge-token"],
)
def test_garbage_before_hello_ends_only_that_connection(ps_server: ParameterServer, client: PSClient, junk: bytes) -> None:
    with _raw(ps_server) as s:
        s.sendall(junk)
        try:
            code, _ = _read_status(s)
            assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        except (ConnectionError, struct.error):
            pass  # closed without an answer is fine too
    assert client.pull([PullSpec("v")])[0][1] == 1


def test_bad_requests_after_hello(ps_server: ParameterServer, client: PSClient) -> None:
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    with _raw(ps_server) as s:
        assert _hello(s) == (0, "")
        # Garbage header message: error, payload drained, connection kept.
        s.sendall(_request(dataplane.PUSH, b"\xff\xff\xff garbage", b"x" * 1000))
        assert _read_status(s)[0] == invalid
        # A push whose payload size disagrees with its header: error, drained, kept.
        header = ps_pb2.PushHeader()
        e = header.entries.add(name="v", op=ps_pb2.ASSIGN, has_value=True)
        codec.spec_to_proto((4, 3), np.float32, e.value)  # 48 bytes
        s.sendall(_request(dataplane.PUSH, header.SerializeToString(), b"\0" * 40))
        assert _read_status(s)[0] == invalid
        # Unknown variable in a pull: NOT_FOUND, kept.
        req = ps_pb2.PullRequest()
        req.entries.add(name="nope")
        s.sendall(_request(dataplane.PULL, req.SerializeToString()))
        assert _read_status(s) == (grpc.StatusCode.NOT_FOUND.value[0], VariableNotFoundError.reason)
        # A well-formed push on the same connection is applied.
        s.sendall(_request(dataplane.PUSH, header.SerializeToString(), np.ones((4, 3), np.float32).tobytes()))
        assert _read_status(s)[0] == 0
        # Unknown method: error, then the connection is closed (framing cannot be trusted).
        s.sendall(_request(99, b""))
        assert _read_status(s)[0] == invalid and _closed(s)
    with _raw(ps_server) as s:
        assert _hello(s) == (0, "")
        s.sendall(framing.REQUEST.pack(b"XXXX", dataplane.PULL, 0, 0))
        assert _read_status(s)[0] == invalid and _closed(s)
    with _raw(ps_server) as s:
        assert _hello(s) == (0, "")
        s.sendall(framing.REQUEST.pack(dataplane.REQUEST_MAGIC, dataplane.PULL, dataplane.MAX_HEADER_BYTES + 1, 0))
        assert _read_status(s)[0] == invalid and _closed(s)
    ((v, ver),) = client.pull([PullSpec("v")])
    assert ver == 2 and np.array_equal(v, np.ones((4, 3), np.float32))


def test_truncated_request_does_not_hurt_the_server(ps_server: ParameterServer, client: PSClient) -> None:
    header = ps_pb2.PushHeader()
    e = header.entries.add(name="v", op=ps_pb2.ASSIGN_ADD, has_value=True)
    codec.spec_to_proto((4, 3), np.float32, e.value)
    for _ in range(3):
        with _raw(ps_server) as s:
            assert _hello(s) == (0, "")
            s.sendall(_request(dataplane.PUSH, header.SerializeToString(), b"\0" * 10, payload_len=48))
    # None of the half-sent pushes was applied; the server still serves.
    assert client.pull([PullSpec("v")])[0][1] == 1
    poll_for(lambda: ps_server.data_plane.connections <= 1, 10, what="the extra connections to close")


def test_restarted_ps_is_rediscovered_on_its_new_data_port() -> None:
    ps = ParameterServer(credentials=CREDS)
    port = ps.start()
    c = PSClient(ps.address, CREDS, task="ps:0")
    try:
        c.create([CreateSpec("v", value=np.ones(3, np.float32))])
        first = ps.data_port
        ps.stop(grace=None)
        with pytest.raises(PSUnavailableError):
            c.pull([PullSpec("v")])
        ps = ParameterServer(credentials=CREDS, port=port)
        ps.start()
        assert ps.data_port != first
        # The client's gRPC channel saw the refused connect and reconnects after its backoff
        # (~1 s); callers retry UNAVAILABLE, as the strategy does.
        end = time.monotonic() + 20
        while True:
            try:
                c.status()
                break
            except PSUnavailableError:
                assert time.monotonic() < end, "the restarted PS never became reachable"
                time.sleep(0.05)
        c.create([CreateSpec("v", value=np.full(3, 7, np.float32))])
        ((v, _),) = c.pull([PullSpec("v")])
        assert v.tolist() == [7, 7, 7] and c.uses_data_plane
    finally:
        c.close()
        ps.stop(grace=None)


def test_unreachable_data_port_falls_back_to_grpc(ps_server: ParameterServer, client: PSClient, caplog: pytest.LogCaptureFixture) -> None:
    c = PSClient(ps_server.address, CREDS, task="ps:0")
    try:
        assert ps_server.data_plane is not None
        ps_server.data_plane.stop(grace=None)  # the port is still announced, as behind a firewall
        with caplog.at_level(logging.WARNING, logger="jaxdist.ps_server.client"):
            assert c.push([Update("v", Op.ASSIGN_ADD, np.ones((4, 3), np.float32))]) == ([2], False)
        assert c.uses_data_plane is False
        assert any("unreachable" in r.getMessage() for r in caplog.records)
        ((v, ver),) = c.pull([PullSpec("v")])
        assert ver == 2 and v.sum() == 12
    finally:
        c.close()


def test_data_plane_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dataplane.ENV_DATA_PLANE, "0")
    with ParameterServer(credentials=CREDS) as ps:
        assert ps.data_port is None
        with PSClient(ps.address, CREDS, task="ps:0", data_plane=True) as c:
            assert c.status().data_port == 0
            c.create([CreateSpec("v", value=np.ones(3, np.float32))])
            assert c.pull([PullSpec("v")])[0][1] == 1 and c.uses_data_plane is False
    monkeypatch.delenv(dataplane.ENV_DATA_PLANE)
    with ParameterServer(credentials=CREDS, data_port=None) as ps:
        assert ps.data_port is None


def test_pull_snapshot_is_consistent_while_pushes_update_in_place(ps_server: ParameterServer, client: PSClient) -> None:
    """A pull in flight keeps the array it started with: in-place updates never tear it."""
    n = 4 << 20
    client.create([CreateSpec("c", value=np.zeros(n, np.float32))])
    stop = threading.Event()
    errors: list[str] = []

    def puller() -> None:
        with PSClient(ps_server.address, CREDS, task="ps:0") as c:
            while not stop.is_set():
                ((a, ver),) = c.pull([PullSpec("c")])
                if not (a[0] == a[-1] == a[n // 2] == ver - 1):
                    errors.append(f"torn pull: version {ver}, values {a[0]}, {a[n // 2]}, {a[-1]}")

    threads = [threading.Thread(target=puller) for _ in range(2)]
    for t in threads:
        t.start()
    ones = np.ones(n, np.float32)
    for _ in range(30):
        client.push([Update("c", Op.ASSIGN_ADD, ones)])
    stop.set()
    for t in threads:
        t.join(30)
    assert not errors, errors[:3]
    assert client.pull([PullSpec("c")])[0][1] == 31


def test_concurrent_pushes_through_one_client_are_exact(ps_server: ParameterServer, client: PSClient) -> None:
    client.create([CreateSpec("k", value=np.zeros(1000, np.int64))])
    ones = np.ones(1000, np.int64)

    def work() -> None:
        for _ in range(50):
            client.push([Update("k", Op.ASSIGN_ADD, ones)])

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ((k, ver),) = client.pull([PullSpec("k")])
    assert ver == 401 and (k == 400).all()


#: When set, every echo call waits here after reading its payload (forces calls to overlap).
_echo_gate: list[threading.Barrier] = []


@contextmanager
def _echo_handler(header: bytes, payload: dataplane.Payload) -> Iterator[tuple[bytes, list]]:
    """Answers with the request's header and its payload's bytes reversed."""
    arr = np.empty(payload.nbytes, np.uint8)
    payload.read_into([arr])
    if _echo_gate:
        _echo_gate[0].wait()
    yield header, [arr[::-1].copy()]


@contextmanager
def _server(handlers: dict, **kw: object) -> Iterator[dataplane.DataPlaneServer]:
    s = dataplane.DataPlaneServer(handlers, credentials=CREDS, **kw)  # type: ignore[arg-type]
    s.start()
    try:
        yield s
    finally:
        s.stop(grace=None)


def test_call_deadline_is_enforced() -> None:
    """A call whose handler has not answered by the caller's deadline ends DEADLINE_EXCEEDED then, not
    when the handler answers (it answers only once the test lets it, after the call has ended)."""
    release, answered = threading.Event(), threading.Event()

    @contextmanager
    def slow(header: bytes, payload: dataplane.Payload) -> Iterator[tuple[bytes, list]]:
        release.wait(120)
        answered.set()
        yield b"", []

    with _server({dataplane.PULL: slow}) as s:
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        with pytest.raises(dataplane.DataPlaneError) as e:
            c.call(dataplane.PULL, b"", (), timeout=0.5)
        assert not answered.is_set(), "the call waited for the handler's answer, past its deadline"
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        release.set()
        c.close()


def test_handler_bug_is_internal_and_server_survives() -> None:
    @contextmanager
    def broken(header: bytes, payload: dataplane.Payload) -> Iterator[tuple[bytes, list]]:
        raise ZeroDivisionError("bug")
        yield b"", []  # pragma: no cover

    with _server({dataplane.PULL: broken, dataplane.PUSH: _echo_handler}) as s:
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        with pytest.raises(dataplane.DataPlaneError) as e:
            c.call(dataplane.PULL, b"h", (np.arange(5, dtype=np.uint8),), timeout=5)
        assert e.value.code == grpc.StatusCode.INTERNAL
        data = np.arange(1 << 20, dtype=np.uint32)
        body, (out,) = c.call(dataplane.PUSH, b"hdr", (data,), timeout=5, receive=lambda b: [np.empty(data.nbytes, np.uint8)])
        assert body == b"hdr" and np.array_equal(out[::-1].copy().view(np.uint32), data)
        c.close()


def test_connection_limit_and_stop() -> None:
    @contextmanager
    def ok(header: bytes, payload: dataplane.Payload) -> Iterator[tuple[bytes, list]]:
        yield b"ok", []

    with _server({dataplane.PULL: ok}, max_connections=1) as s:
        first = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        assert _hello(first) == (0, "")
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as second:
            # The cap counts authenticated connections only: a token holder is told after its hello.
            assert _hello(second)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        # A client refused at connect learns that nothing was sent (PSClient then uses gRPC).
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        with pytest.raises(dataplane.DataPlaneError) as e:
            c.call(dataplane.PULL, b"", (), timeout=5)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not e.value.connected
        c.close()
        first.sendall(_request(dataplane.PULL, b""))
        assert _read_status(first) == (0, "")
        s.stop(grace=1.0)
        assert _closed(first) and s.connections == 0
        first.close()


# ----------------------------------------------------------- shared memory
needs_shm = pytest.mark.skipif(not dataplane.shm_enabled(), reason="no /dev/shm on this host (or JAXDIST_SHM=0)")
needs_sealed = pytest.mark.skipif(not dataplane.sealed_enabled(),
                                  reason="no memfd with file seals or no /proc here (or JAXDIST_SHM[_SEALED]=0)")
#: Both region kinds: sealed (the server maps it) and, with sealed regions off, named (the server copies).
REGION_KINDS = [pytest.param(shm.SEALED, marks=needs_sealed, id="sealed"), pytest.param(shm.NAMED, id="named")]


def _only(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make clients created from here on offer ``kind`` first (named: sealed regions off)."""
    if kind == shm.NAMED:
        monkeypatch.setenv(dataplane.ENV_SHM_SEALED, "0")


def _regions() -> set[str]:
    try:
        return {n for n in os.listdir(dataplane.SHM_DIR) if n.startswith("jaxdist-")}
    except OSError:
        return set()


@contextmanager
def _echo_server(**kw: object) -> Iterator[dataplane.DataPlaneServer]:
    """PUSH echoes the payload back reversed; PULL fails with a typed error before reading it."""

    @contextmanager
    def refuse(header: bytes, payload: dataplane.Payload) -> Iterator[tuple[bytes, list]]:
        raise ShapeMismatchError("refused before reading")
        yield b"", []  # pragma: no cover

    with _server({dataplane.PUSH: _echo_handler, dataplane.PULL: refuse}, **kw) as s:
        yield s


def _echo(c: dataplane.DataPlaneClient, arrays: list[np.ndarray]) -> np.ndarray:
    n = sum(a.nbytes for a in arrays)
    _, (out,) = c.call(dataplane.PUSH, b"h", arrays, timeout=10, receive=lambda b: [np.empty(n, np.uint8)])
    return out[::-1].copy()  # the server reversed it


@needs_shm
@pytest.mark.parametrize("kind", REGION_KINDS)
def test_same_host_payloads_move_through_shared_memory_exactly(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _only(kind, monkeypatch)
    before = _regions()
    with _echo_server() as s:
        # Small slots: payloads span many chunks, and chunk edges fall inside arrays.
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS, shm_slot_bytes=64 << 10)  # type: ignore[arg-type]
        rng = np.random.default_rng(1)
        arrays = [rng.integers(0, 255, n, dtype=np.uint8) for n in (100_003, 0, 7, 65_536, 300_001)]
        assert np.array_equal(_echo(c, arrays), np.concatenate(arrays))
        assert c.shm_connections == 1 and s.shm_connections == 1
        mapped = 1 if kind == shm.SEALED else 0  # only a sealed region is mapped by the server
        assert c.mapped_connections == s.mapped_connections == mapped
        small = [np.arange(10, dtype=np.float64)]  # below SHM_MIN_PAYLOAD: on the socket, same connection
        assert np.array_equal(_echo(c, small).view(np.float64), small[0])
        # A typed error before the server reads a shared-memory payload: drained, connection kept in step.
        big = np.ones(1 << 20, np.float32)
        with pytest.raises(dataplane.DataPlaneError) as e:
            c.call(dataplane.PULL, b"", [big], timeout=10)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert np.array_equal(_echo(c, [big]).view(np.float32), big)
        # Concurrent calls get a connection (and a region) each: the handler holds each call until
        # all three are inside it, so they cannot share a pooled connection.
        out: list[bool] = []
        _echo_gate.append(threading.Barrier(3, timeout=60))
        try:
            threads = [threading.Thread(target=lambda k=k: out.append(
                np.array_equal(_echo(c, [np.full(200_000 + k, k, np.uint8)]), np.full(200_000 + k, k, np.uint8))))
                for k in range(3)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
        finally:
            _echo_gate.clear()
        assert out == [True] * 3 and s.shm_connections == c.shm_connections == 3
        assert s.mapped_connections == c.mapped_connections == 3 * mapped
        assert _regions() == before  # files are unlinked once both ends mapped them
        c.close()
        poll_for(lambda: s.shm_connections == 0 and s.mapped_connections == 0, 10, what="the region to be released")


@needs_shm
def test_server_without_shared_memory_makes_clients_stop_offering() -> None:
    with _echo_server(shared_memory=False) as s:
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        data = np.arange(1 << 18, dtype=np.int32)
        assert np.array_equal(_echo(c, [data]).view(np.int32), data)
        assert c.shm_connections == 0 and s.shm_connections == 0 and not c.offers_shared_memory
        c.close()


@needs_shm
def test_shared_memory_budget_falls_back_to_the_socket() -> None:
    with _echo_server(max_shm_connections=1) as s:
        a = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        b = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        data = np.arange(1 << 18, dtype=np.int32)
        for c in (a, b):
            assert np.array_equal(_echo(c, [data]).view(np.int32), data)
        assert (a.shm_connections, b.shm_connections, s.shm_connections) == (1, 0, 1)
        assert b.offers_shared_memory  # RESOURCE_EXHAUSTED is not "another host": later connections offer again
        a.close()
        poll_for(lambda: s.shm_connections == 0, 10, what="the region to be released")
        b.close()


@needs_shm
def test_client_without_shm_space_uses_the_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    before = _regions()
    with _echo_server() as s:
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        data = np.arange(1 << 18, dtype=np.int32)
        assert np.array_equal(_echo(c, [data]).view(np.int32), data)
        assert c.shm_connections == 0 and not c.offers_shared_memory and _regions() == before
        c.close()


def test_shared_memory_is_off_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(dataplane.ENV_SHM, "0")
    assert not dataplane.shm_enabled()
    with _echo_server() as s:
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        assert not c.offers_shared_memory
        data = np.arange(1 << 18, dtype=np.int32)
        assert np.array_equal(_echo(c, [data]).view(np.int32), data)
        c.close()


def _attach(sock: socket.socket, name: str, nonce: bytes = bytes(16), slot: int = 64 << 10) -> tuple[int, str]:
    header = shm.ATTACH.pack(slot, nonce) + name.encode()
    sock.sendall(_request(dataplane.SHM_ATTACH, header))
    return _read_status(sock)


@needs_shm
def test_bad_shm_attach_requests_get_typed_errors_and_the_connection_survives(tmp_path: object) -> None:
    bad_arg = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    precondition = grpc.StatusCode.FAILED_PRECONDITION.value[0]
    made = shm.create_region(64 << 10)
    assert made is not None
    path, region = made
    link = os.path.join(dataplane.SHM_DIR, "jaxdist-" + "ab" * 16)
    try:
        os.symlink(path, link)
        with _echo_server() as s, _raw_to(s) as sock:
            assert _hello(sock) == (0, "")
            assert _attach(sock, "../../etc/passwd")[0] == bad_arg
            assert _attach(sock, "jaxdist-" + "0" * 32)[0] == precondition  # no such file: another host
            assert _attach(sock, os.path.basename(path), nonce=b"x" * 16)[0] == precondition  # not the client's region
            assert _attach(sock, os.path.basename(path), nonce=region.nonce(), slot=128 << 10)[0] == bad_arg  # wrong size
            assert _attach(sock, os.path.basename(path), nonce=region.nonce(), slot=1000)[0] == bad_arg  # not pages
            assert _attach(sock, os.path.basename(link), nonce=region.nonce())[0] == precondition  # symlinks refused
            assert s.shm_connections == 0
            # The right region maps; a second one on the same connection is refused.
            assert _attach(sock, os.path.basename(path), nonce=region.nonce()) == (0, "")
            assert s.shm_connections == 1
            assert _attach(sock, os.path.basename(path), nonce=region.nonce())[0] == bad_arg
            # Payload through the region by hand: one chunk of 70,000 bytes, then the response back.
            data = np.arange(70_000, dtype=np.uint8)
            sock.sendall(_request(dataplane.PUSH, b"h", payload_len=data.nbytes))
            region.slots[0][:65536] = data[:65536]
            sock.sendall(b"D")
            assert _recv(sock, 1) == b"A"
            region.slots[1][:data.nbytes - 65536] = data[65536:]
            sock.sendall(b"D")
            assert _recv(sock, 1) == b"A"
            magic, code, reason_len, body_len, payload_len = framing.RESPONSE.unpack(_recv(sock, framing.RESPONSE.size))
            assert (code, payload_len) == (0, data.nbytes) and _recv(sock, reason_len + body_len) == b"h"
            got = bytearray()
            for i in range(2):
                assert _recv(sock, 1) == b"D"
                got += region.slots[i][: min(65536, data.nbytes - 65536 * i)].tobytes()
                sock.sendall(b"A")
            assert bytes(got) == data[::-1].tobytes()
    finally:
        shm.unlink(link)
        shm.unlink(path)
        region.close()


@contextmanager
def _raw_to(s: dataplane.DataPlaneServer) -> Iterator[socket.socket]:
    sock = socket.create_connection(("127.0.0.1", s.port), timeout=5)
    try:
        yield sock
    finally:
        sock.close()


@needs_shm
def test_client_vanishing_mid_transfer_leaves_the_server_serving() -> None:
    with _echo_server() as s:
        made = shm.create_region(64 << 10)
        assert made is not None
        path, region = made
        try:
            with _raw_to(s) as sock:
                assert _hello(sock) == (0, "")
                assert _attach(sock, os.path.basename(path), nonce=region.nonce()) == (0, "")
                sock.sendall(_request(dataplane.PUSH, b"h", payload_len=1 << 20))
                sock.sendall(b"D")  # one chunk of sixteen, then the client is gone
                assert _recv(sock, 1) == b"A"
        finally:
            shm.unlink(path)
            region.close()
        poll_for(lambda: s.shm_connections == 0 and s.connections == 0, 10, what="the region to be released")
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        data = np.arange(1 << 18, dtype=np.int32)
        assert np.array_equal(_echo(c, [data]).view(np.int32), data) and c.shm_connections == 1
        c.close()


def _shm_in_use() -> list[bool]:
    """Inside a closure: whether each of the worker's PS clients uses shared memory."""
    from jaxdist.worker.context import current_ps

    return [c.uses_shared_memory for c in current_ps().clients]


@needs_shm
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_local_cluster_workers_and_coordinator_use_shared_memory() -> None:
    import optax

    import jaxdist

    with jaxdist.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            w0 = np.random.default_rng(3).standard_normal((512, 256)).astype(np.float32)  # 256 KB per shard
            with strategy.scope():
                v = jaxdist.create_variables({"w": w0}, name="shm", optimizer=optax.sgd(1.0))
            coord = jaxdist.ClusterCoordinator(strategy)

            def step() -> list[bool]:
                p = jaxdist.pull(v)
                jaxdist.apply_gradients(v, {"w": np.ones_like(p["w"])})
                return _shm_in_use()

            rv = coord.schedule(step)
            coord.join()
            assert rv.fetch() == [True, True]  # the worker's clients, in its own process
            np.testing.assert_allclose(jaxdist.pull(v)["w"], w0 - 1.0)
            assert [c.uses_shared_memory for c in strategy.connections.clients] == [True, True]  # the coordinator's
            coord.shutdown()
        finally:
            strategy.close()


@needs_shm
@pytest.mark.parametrize("kind", REGION_KINDS)
def test_server_that_cannot_map_a_region_keeps_the_connection(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A read of the region that fails on the server (e.g. ENOMEM; the nonce is the first read of
    # either kind) refuses the region, and the connection goes on over the socket.
    _only(kind, monkeypatch)

    def read_failing(*args: object) -> bytes:
        raise OSError(12, "Cannot allocate memory")

    if kind == shm.SEALED:
        monkeypatch.setattr(os, "pread", read_failing)  # the client never preads: only the server's check fails
    else:
        monkeypatch.setattr(shm.PeerRegion, "nonce", read_failing)
    with _echo_server() as s:
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        data = np.arange(1 << 18, dtype=np.int32)
        assert np.array_equal(_echo(c, [data]).view(np.int32), data)
        assert c.shm_connections == 0 and s.shm_connections == 0 and c.offers_shared_memory
        assert c.offered_kinds[0] == kind  # not "another host": the same kind is offered again
        c.close()


@needs_sealed
def test_server_that_cannot_reach_sealed_regions_gets_named_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # What a server in another PID namespace answers (FAILED_PRECONDITION, it cannot reach
    # /proc/<pid>/fd/<fd>): the client offers a named region on the same connection, and new
    # connections offer only named ones.
    def unreachable(pid: int, fd: int, slot_bytes: int, nonce: bytes) -> shm.Region:
        raise shm._elsewhere(f"cannot reach /proc/{pid}/fd/{fd} here")

    monkeypatch.setattr(shm, "_open_sealed", unreachable)
    with _echo_server() as s:
        c = dataplane.DataPlaneClient("127.0.0.1", s.port, CREDS)  # type: ignore[arg-type]
        assert c.offered_kinds == (shm.SEALED, shm.NAMED)
        data = np.arange(1 << 18, dtype=np.int32)
        assert np.array_equal(_echo(c, [data]).view(np.int32), data)
        assert (c.shm_connections, c.mapped_connections, s.shm_connections, s.mapped_connections) == (1, 0, 1, 0)
        assert c.offered_kinds == (shm.NAMED,)
        c.close()


def _sealed_memfd(size: int, nonce: bytes, seals: int) -> int:
    fd = os.memfd_create("jaxdist-test", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    os.pwrite(fd, nonce, 0)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


@needs_sealed
def test_bad_sealed_shm_attach_requests_get_typed_errors_and_the_connection_survives(tmp_path: Any) -> None:
    """A sealed region's name points into /proc: whatever else it points at is refused before
    anything is written, with FAILED_PRECONDITION (the client then offers a named region)."""
    bad_arg = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    precondition = grpc.StatusCode.FAILED_PRECONDITION.value[0]
    slot, pid = 64 << 10, os.getpid()
    size = shm.Region.size(slot)
    nonce = os.urandom(16)
    sealed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    unsealed = _sealed_memfd(size, nonce, 0)
    grow_only = _sealed_memfd(size, nonce, fcntl.F_SEAL_GROW)
    short = _sealed_memfd(size - 4096, nonce, sealed)
    good = _sealed_memfd(size, nonce, sealed)
    plain = tmp_path / "plain"
    plain.write_bytes(nonce + bytes(size - 16))
    plain_fd = os.open(plain, os.O_RDWR)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    fifo_fd = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)
    fds = [unsealed, grow_only, short, good, plain_fd, fifo_fd]
    try:
        with _echo_server() as s, _raw_to(s) as sock:
            assert _hello(sock) == (0, "")
            for name in (f"fd:0/{good}", f"fd:{pid}/-1", f"fd:{pid}/{good}/x", f"fd:{pid}", "fd:1/99999999999"):
                assert _attach(sock, name, nonce, slot)[0] == bad_arg, name
            for name, why in ((f"fd:{pid}/{unsealed}", "not sealed against shrinking"),
                              (f"fd:{pid}/{grow_only}", "sealed, but shrinkable"),
                              (f"fd:{pid}/{short}", "the wrong size"),
                              (f"fd:{pid}/{plain_fd}", "a plain file with the nonce"),
                              (f"fd:{pid}/{fifo_fd}", "a FIFO"),
                              (f"fd:{pid}/{sock.fileno()}", "a socket"),
                              (f"fd:{pid}/999999", "no such descriptor"),
                              ("fd:4194999/3", "no such process")):
                assert _attach(sock, name, nonce, slot)[0] == precondition, why
            assert _attach(sock, f"fd:{pid}/{good}", os.urandom(16), slot)[0] == precondition  # another region's nonce
            assert not _readable(fifo_fd)  # nothing was written into the FIFO
            assert plain.read_bytes() == nonce + bytes(size - 16)  # nor into the plain file
            assert s.shm_connections == 0
            # The real one is mapped; from now on no process can shrink it under the server.
            assert _attach(sock, f"fd:{pid}/{good}", nonce, slot) == (0, "")
            assert (s.shm_connections, s.mapped_connections) == (1, 1)
            with pytest.raises(PermissionError):
                os.ftruncate(good, 0)
            with pytest.raises(PermissionError):
                fcntl.fcntl(good, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)  # sealed against more seals too
            # A payload through the mapped region: one chunk in, reversed chunk back.
            mm = mmap.mmap(good, size)
            view = np.frombuffer(mm, np.uint8)
            data = (np.arange(slot) % 251).astype(np.uint8)  # one whole slot (at least SHM_MIN_PAYLOAD)
            sock.sendall(_request(dataplane.PUSH, b"h", payload_len=data.nbytes))
            view[4096:4096 + data.nbytes] = data
            sock.sendall(b"D")
            assert _recv(sock, 1) == b"A"
            magic, code, reason_len, body_len, payload_len = framing.RESPONSE.unpack(_recv(sock, framing.RESPONSE.size))
            assert (code, payload_len) == (0, data.nbytes) and _recv(sock, reason_len + body_len) == b"h"
            assert _recv(sock, 1) == b"D"
            assert bytes(view[4096:4096 + data.nbytes]) == data[::-1].tobytes()
            sock.sendall(b"A")
            del view
            mm.close()
    finally:
        for fd in fds:
            os.close(fd)


def _readable(fd: int) -> bool:
    import select

    return bool(select.select([fd], [], [], 0)[0])

