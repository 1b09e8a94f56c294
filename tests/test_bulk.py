"""The bulk data plane (jaxdist.proto.bulk): Pull/Push over plain TCP beside gRPC.

Real sockets on 127.0.0.1 port 0. The PS tests in test_ps_server.py also run
over it (the ``ps_client`` fixture is parametrized by transport); these cover
what is specific to it: discovery, fallback, restarts, framing, garbage,
limits, deadlines and concurrency.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import numpy as np
import pytest

from jaxdist.errors import (
    AuthenticationError,
    DTypeMismatchError,
    InvalidRequestError,
    PayloadTooLargeError,
    PSUnavailableError,
    ShapeMismatchError,
    VariableNotFoundError,
)
from jaxdist.proto import bulk, codec, ps_pb2
from jaxdist.ps_server.client import CreateSpec, PSClient, PullSpec, PushSpec
from jaxdist.ps_server.server import ParameterServer

from conftest import TOKEN

pytestmark = pytest.mark.timeout(60)


def _hello(sock: socket.socket, token: str = TOKEN) -> tuple[int, str]:
    t = token.encode()
    sock.sendall(bulk._HELLO.pack(bulk.HELLO_MAGIC, len(t)) + t)
    return _read_status(sock)


def _read_status(sock: socket.socket) -> tuple[int, str]:
    """(status code, reason) of one response envelope; its body and payload are consumed."""
    magic, code, reason_len, body_len, payload_len = bulk._RESPONSE.unpack(_recv(sock, bulk._RESPONSE.size))
    assert magic == bulk.RESPONSE_MAGIC
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
    return bulk._REQUEST.pack(bulk.REQUEST_MAGIC, method, len(header), n) + header + payload


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


@pytest.fixture
def client(ps_server: ParameterServer) -> Iterator[PSClient]:
    c = PSClient(ps_server.address, token=TOKEN, task="ps:0")
    c.create([CreateSpec("v", value=np.zeros((4, 3), np.float32))])
    yield c
    c.close()


def _raw(ps: ParameterServer) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", ps.data_port), timeout=5)
    return s


def test_pull_and_push_use_the_data_plane_and_match_grpc(ps_server: ParameterServer, client: PSClient) -> None:
    assert ps_server.data_port and client.uses_data_plane
    assert client.status().data_port == ps_server.data_port
    big = np.random.default_rng(0).standard_normal((3000, 1000)).astype(np.float32)
    client.create([CreateSpec("big", value=big)])
    client.push([PushSpec("big", "assign_add", big)], update_id="u1")
    assert client.push([PushSpec("big", "assign_add", big)], update_id="u1") == ([2], True)  # deduped
    via_grpc = PSClient(ps_server.address, token=TOKEN, task="ps:0", data_plane=False)
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
    assert ps_server.servicer.stats["pulls"] >= 4


def test_typed_errors_over_the_data_plane(ps_server: ParameterServer, client: PSClient) -> None:
    with pytest.raises(VariableNotFoundError):
        client.pull([PullSpec("nope")])
    with pytest.raises(ShapeMismatchError):
        client.push([PushSpec("v", "assign", np.zeros((5, 3), np.float32))])
    with pytest.raises(DTypeMismatchError):
        client.push([PushSpec("v", "assign", np.zeros((4, 3), np.int32))])
    with pytest.raises(PayloadTooLargeError):
        client.create([CreateSpec("huge", value=np.zeros(65 << 18, np.float32))])  # 65 MiB > the fixture's 64 MiB
    bad = PSClient(ps_server.address, token="wrong", task="ps:0")
    try:
        with pytest.raises(AuthenticationError):  # GetStatus (discovery) already refuses it
            bad.pull([PullSpec("v")])
    finally:
        bad.close()
    # After all that, the same connection still works.
    assert client.push([PushSpec("v", "assign_add", np.ones((4, 3), np.float32))]) == ([2], False)
    assert client.uses_data_plane


def test_wrong_token_on_the_data_port_is_unauthenticated(ps_server: ParameterServer) -> None:
    with _raw(ps_server) as s:
        code, reason = _hello(s, "wrong")
        assert code == grpc.StatusCode.UNAUTHENTICATED.value[0] and reason == AuthenticationError.reason
        assert _closed(s)
    c = bulk.BulkClient("127.0.0.1", ps_server.data_port, "wrong")
    with pytest.raises(bulk.BulkError) as e:
        c.call(bulk.PULL, b"", (), timeout=5)
    assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
    c.close()


@pytest.mark.parametrize(
    "junk",
    [b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", os.urandom(64), bulk._HELLO.pack(bulk.HELLO_MAGIC, 1 << 30)],
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
        s.sendall(_request(bulk.PUSH, b"\xff\xff\xff garbage", b"x" * 1000))
        assert _read_status(s)[0] == invalid
        # A push whose payload size disagrees with its header: error, drained, kept.
        header = ps_pb2.PushHeader()
        e = header.entries.add(name="v", op=ps_pb2.ASSIGN, has_value=True)
        codec.spec_to_proto((4, 3), np.float32, e.value)  # 48 bytes
        s.sendall(_request(bulk.PUSH, header.SerializeToString(), b"\0" * 40))
        assert _read_status(s)[0] == invalid
        # Unknown variable in a pull: NOT_FOUND, kept.
        req = ps_pb2.PullRequest()
        req.entries.add(name="nope")
        s.sendall(_request(bulk.PULL, req.SerializeToString()))
        assert _read_status(s) == (grpc.StatusCode.NOT_FOUND.value[0], VariableNotFoundError.reason)
        # A well-formed push on the same connection is applied.
        s.sendall(_request(bulk.PUSH, header.SerializeToString(), np.ones((4, 3), np.float32).tobytes()))
        assert _read_status(s)[0] == 0
        # Unknown method: error, then the connection is closed (framing cannot be trusted).
        s.sendall(_request(99, b""))
        assert _read_status(s)[0] == invalid and _closed(s)
    with _raw(ps_server) as s:
        assert _hello(s) == (0, "")
        s.sendall(bulk._REQUEST.pack(b"XXXX", bulk.PULL, 0, 0))
        assert _read_status(s)[0] == invalid and _closed(s)
    with _raw(ps_server) as s:
        assert _hello(s) == (0, "")
        s.sendall(bulk._REQUEST.pack(bulk.REQUEST_MAGIC, bulk.PULL, bulk.MAX_HEADER_BYTES + 1, 0))
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
            s.sendall(_request(bulk.PUSH, header.SerializeToString(), b"\0" * 10, payload_len=48))
    # None of the half-sent pushes was applied; the server still serves.
    assert client.pull([PullSpec("v")])[0][1] == 1
    assert _wait(lambda: ps_server.bulk.connections <= 1)


def _wait(cond: object, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_restarted_ps_is_rediscovered_on_its_new_data_port() -> None:
    ps = ParameterServer(token=TOKEN)
    port = ps.start()
    c = PSClient(ps.address, token=TOKEN, task="ps:0")
    try:
        c.create([CreateSpec("v", value=np.ones(3, np.float32))])
        first = ps.data_port
        ps.stop(grace=None)
        with pytest.raises(PSUnavailableError):
            c.pull([PullSpec("v")])
        ps = ParameterServer(token=TOKEN, port=port)
        ps.start()
        assert ps.data_port != first
        c.create([CreateSpec("v", value=np.full(3, 7, np.float32))])
        ((v, _),) = c.pull([PullSpec("v")])
        assert v.tolist() == [7, 7, 7] and c.uses_data_plane
    finally:
        c.close()
        ps.stop(grace=None)


def test_unreachable_data_port_falls_back_to_grpc(ps_server: ParameterServer, client: PSClient, caplog: pytest.LogCaptureFixture) -> None:
    c = PSClient(ps_server.address, token=TOKEN, task="ps:0")
    try:
        assert ps_server.bulk is not None
        ps_server.bulk.stop(grace=None)  # the port is still announced, as behind a firewall
        with caplog.at_level(logging.WARNING, logger="jaxdist.ps_server.client"):
            assert c.push([PushSpec("v", "assign_add", np.ones((4, 3), np.float32))]) == ([2], False)
        assert c.uses_data_plane is False
        assert any("unreachable" in r.getMessage() for r in caplog.records)
        ((v, ver),) = c.pull([PullSpec("v")])
        assert ver == 2 and v.sum() == 12
    finally:
        c.close()


def test_data_plane_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(bulk.ENV_DATA_PLANE, "0")
    with ParameterServer(token=TOKEN) as ps:
        assert ps.data_port is None
        with PSClient(ps.address, token=TOKEN, task="ps:0", data_plane=True) as c:
            assert c.status().data_port == 0
            c.create([CreateSpec("v", value=np.ones(3, np.float32))])
            assert c.pull([PullSpec("v")])[0][1] == 1 and c.uses_data_plane is False
    monkeypatch.delenv(bulk.ENV_DATA_PLANE)
    with ParameterServer(token=TOKEN, data_port=None) as ps:
        assert ps.data_port is None


def test_pull_snapshot_is_consistent_while_pushes_update_in_place(ps_server: ParameterServer, client: PSClient) -> None:
    """A pull in flight keeps the array it started with: in-place updates never tear it."""
    n = 4 << 20
    client.create([CreateSpec("c", value=np.zeros(n, np.float32))])
    stop = threading.Event()
    errors: list[str] = []

    def puller() -> None:
        with PSClient(ps_server.address, token=TOKEN, task="ps:0") as c:
            while not stop.is_set():
                ((a, ver),) = c.pull([PullSpec("c")])
                if not (a[0] == a[-1] == a[n // 2] == ver - 1):
                    errors.append(f"torn pull: version {ver}, values {a[0]}, {a[n // 2]}, {a[-1]}")

    threads = [threading.Thread(target=puller) for _ in range(2)]
    for t in threads:
        t.start()
    ones = np.ones(n, np.float32)
    for _ in range(30):
        client.push([PushSpec("c", "assign_add", ones)])
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
            client.push([PushSpec("k", "assign_add", ones)])

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    ((k, ver),) = client.pull([PullSpec("k")])
    assert ver == 401 and (k == 400).all()


@contextmanager
def _server(handlers: dict, **kw: object) -> Iterator[bulk.BulkServer]:
    s = bulk.BulkServer(handlers, token=TOKEN, **kw)  # type: ignore[arg-type]
    s.start()
    try:
        yield s
    finally:
        s.stop(grace=None)


def test_call_deadline_is_enforced() -> None:
    release = threading.Event()

    @contextmanager
    def slow(header: bytes, payload: bulk.Payload) -> Iterator[tuple[bytes, list]]:
        release.wait(10)
        yield b"", []

    with _server({bulk.PULL: slow}) as s:
        c = bulk.BulkClient("127.0.0.1", s.port, TOKEN)  # type: ignore[arg-type]
        t0 = time.monotonic()
        with pytest.raises(bulk.BulkError) as e:
            c.call(bulk.PULL, b"", (), timeout=0.5)
        assert e.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 5
        release.set()
        c.close()


def test_handler_bug_is_internal_and_server_survives() -> None:
    @contextmanager
    def broken(header: bytes, payload: bulk.Payload) -> Iterator[tuple[bytes, list]]:
        raise ZeroDivisionError("bug")
        yield b"", []  # pragma: no cover

    @contextmanager
    def echo(header: bytes, payload: bulk.Payload) -> Iterator[tuple[bytes, list]]:
        arr = np.empty(payload.nbytes, np.uint8)
        payload.read_into([arr])
        yield header, [arr[::-1].copy()]

    with _server({bulk.PULL: broken, bulk.PUSH: echo}) as s:
        c = bulk.BulkClient("127.0.0.1", s.port, TOKEN)  # type: ignore[arg-type]
        with pytest.raises(bulk.BulkError) as e:
            c.call(bulk.PULL, b"h", (np.arange(5, dtype=np.uint8),), timeout=5)
        assert e.value.code == grpc.StatusCode.INTERNAL
        data = np.arange(1 << 20, dtype=np.uint32)
        body, (out,) = c.call(bulk.PUSH, b"hdr", (data,), timeout=5, receive=lambda b: [np.empty(data.nbytes, np.uint8)])
        assert body == b"hdr" and np.array_equal(out[::-1].copy().view(np.uint32), data)
        c.close()


def test_connection_limit_and_stop() -> None:
    @contextmanager
    def ok(header: bytes, payload: bulk.Payload) -> Iterator[tuple[bytes, list]]:
        yield b"ok", []

    with _server({bulk.PULL: ok}, max_connections=1) as s:
        first = socket.create_connection(("127.0.0.1", s.port), timeout=5)
        assert _hello(first) == (0, "")
        with socket.create_connection(("127.0.0.1", s.port), timeout=5) as second:
            assert _read_status(second)[0] == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        # A client refused at connect learns that nothing was sent (PSClient then uses gRPC).
        c = bulk.BulkClient("127.0.0.1", s.port, TOKEN)  # type: ignore[arg-type]
        with pytest.raises(bulk.BulkError) as e:
            c.call(bulk.PULL, b"", (), timeout=5)
        assert e.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and not e.value.connected
        c.close()
        first.sendall(_request(bulk.PULL, b""))
        assert _read_status(first) == (0, "")
        s.stop(grace=1.0)
        assert _closed(first) and s.connections == 0
        first.close()
