"""The fused push-then-pull (PushPull) on a real PS over both transports (gRPC and the data plane):
one round trip applies a push and answers the values read after it; exactly-once as a push;
hostile input gets a typed error and changes nothing."""

from __future__ import annotations

import socket

import grpc
import numpy as np
import optax
import pytest

from jaxdist.errors import (
    ConfigurationError,
    DTypeMismatchError,
    InvalidRequestError,
    ShapeMismatchError,
    UpdateMismatchError,
    VariableNotFoundError,
)
from jaxdist.proto import codec, ps_pb2, ps_wire
from jaxdist.proto.ps_wire import CreateSpec, Op, PullSpec, SyncKind, Update
from jaxdist.proto.status import REASON_KEY
from jaxdist.ps_server.client import PSClient
from jaxdist.ps_server.server import ParameterServer
from jaxdist.transport import dataplane
from jaxdist.transport.channel import make_channel
from jaxdist.transport.dataplane import framing
from conftest import CREDS, TOKEN

pytestmark = pytest.mark.timeout(120)

ONES = np.ones((2, 3), np.float32)


def _setup(c: PSClient) -> None:
    c.create([CreateSpec("w", value=np.zeros((2, 3), np.float32), optimizer=optax.sgd(0.5)),
              CreateSpec("e", value=np.arange(12, dtype=np.float32).reshape(4, 3)),
              CreateSpec("i", value=np.zeros(3, np.int32))])


def _w(c: PSClient) -> tuple[np.ndarray, int]:
    ((w, ver),) = c.pull([PullSpec("w")])
    return w, ver


def test_push_pull_applies_then_answers_the_values_read_after_it(ps_client: PSClient) -> None:
    _setup(ps_client)
    big = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)  # several 4 MiB frames each way
    ps_client.create([CreateSpec("big", value=np.zeros_like(big))])
    pushed, reads = ps_client.push_pull(
        [Update("w", Op.APPLY_GRADIENT, ONES), Update("big", Op.ASSIGN_ADD, big)],
        [PullSpec("w"), PullSpec("big"), PullSpec("e", indices=np.array([3, 0])), PullSpec("w", as_dtype=np.dtype("float16"))],
        update_id="c1/1")
    assert list(pushed.versions) == [2, 2] and not pushed.duplicate
    (w, wv), (b, bv), (rows, ev), (w16, _) = reads
    assert wv == 2 and np.allclose(w, -0.5)  # sgd(0.5) of a gradient of ones, applied before the read
    assert bv == 2 and np.array_equal(b, big)
    assert ev == 1 and np.array_equal(rows, np.arange(12, dtype=np.float32).reshape(4, 3)[[3, 0]])
    assert w16.dtype == np.float16 and np.allclose(w16, -0.5)


def test_a_retried_push_pull_is_applied_once_and_still_answers_values(ps_client: PSClient) -> None:
    _setup(ps_client)
    first = ps_client.push_pull([Update("w", Op.APPLY_GRADIENT, ONES)], [PullSpec("w")], update_id="c7/1")
    again = ps_client.push_pull([Update("w", Op.APPLY_GRADIENT, ONES)], [PullSpec("w")], update_id="c7/1")
    assert not first[0].duplicate and again[0].duplicate
    assert np.allclose(first[1][0][0], -0.5) and np.allclose(again[1][0][0], -0.5)  # applied once
    assert again[1][0][1] == 2
    # A plain Push of the same identity is the same update: also a duplicate (one dedupe table).
    _, dup = ps_client.push([Update("w", Op.APPLY_GRADIENT, ONES)], update_id="c7/1")
    assert dup
    # The same identity naming another variable is refused, as for a push (digest rule).
    with pytest.raises(UpdateMismatchError) as info:
        ps_client.push_pull([Update("e", Op.ASSIGN_ADD, np.ones((4, 3), np.float32))], [PullSpec("w")], update_id="c7/1")
    assert info.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
    w, ver = _w(ps_client)
    assert ver == 2 and np.allclose(w, -0.5)


@pytest.mark.parametrize(
    "updates, reads, exc, code",
    [
        ([Update("w", Op.APPLY_GRADIENT, ONES)], [PullSpec("nope")], VariableNotFoundError, grpc.StatusCode.NOT_FOUND),
        ([Update("w", Op.APPLY_GRADIENT, ONES)], [PullSpec("e", indices=np.array([4]))], InvalidRequestError,
         grpc.StatusCode.INVALID_ARGUMENT),
        ([Update("w", Op.APPLY_GRADIENT, ONES)], [PullSpec("i", as_dtype=np.dtype("float16"))], InvalidRequestError,
         grpc.StatusCode.INVALID_ARGUMENT),
        ([Update("w", Op.APPLY_GRADIENT, ONES)], [], InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
        ([Update("w", Op.APPLY_GRADIENT, np.ones((3, 3), np.float32))], [PullSpec("w")], ShapeMismatchError,
         grpc.StatusCode.INVALID_ARGUMENT),
        ([Update("w", Op.APPLY_GRADIENT, np.ones((2, 3), np.int32))], [PullSpec("w")], DTypeMismatchError,
         grpc.StatusCode.INVALID_ARGUMENT),
        ([Update("e", Op.APPLY_GRADIENT, np.ones((4, 3), np.float32))], [PullSpec("w")], InvalidRequestError,
         grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["read-unknown", "read-index-range", "read-dtype", "no-reads", "shape", "dtype", "no-optimizer"],
)
def test_bad_push_pull_gets_a_typed_error_and_changes_nothing(
    ps_client: PSClient, updates: list[Update], reads: list[PullSpec], exc: type, code: grpc.StatusCode
) -> None:
    _setup(ps_client)
    with pytest.raises(exc) as info:
        ps_client.push_pull(updates, reads, update_id="bad/1")
    assert info.value.grpc_code == code  # type: ignore[attr-defined]
    w, ver = _w(ps_client)
    assert ver == 1 and np.array_equal(w, np.zeros((2, 3)))  # the push was not applied
    # ... nor recorded: the identity is still free for the real update.
    pushed, _ = ps_client.push_pull([Update("w", Op.APPLY_GRADIENT, ONES)], [PullSpec("w")], update_id="bad/1")
    assert not pushed.duplicate


def test_a_worker_push_pull_under_synchronous_steps_is_refused(ps_client: PSClient) -> None:
    _setup(ps_client)
    ps_client.sync_steps(SyncKind.CONFIGURE, staleness=0, members=[0])
    try:
        with pytest.raises(ConfigurationError) as info:
            ps_client.push_pull([Update("w", Op.APPLY_GRADIENT, ONES)], [PullSpec("w")], update_id="s/1", contributor=0)
        assert info.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
        assert _w(ps_client)[1] == 1
    finally:
        ps_client.sync_steps(SyncKind.CONFIGURE, staleness=-1)


def _push_pull_header(reads: bool = True) -> ps_pb2.PushHeader:
    header, _ = ps_wire.encode_push_pull([Update("w", Op.APPLY_GRADIENT, ONES)], [PullSpec("w")] if reads else [])
    return header


def test_garbage_and_misrouted_messages_over_grpc(ps_server: ParameterServer) -> None:
    c = PSClient(ps_server.address, CREDS, data_plane=False)
    try:
        _setup(c)
        md = CREDS.metadata
        create, _ = ps_wire.encode_create([CreateSpec("x", value=np.zeros(2, np.float32))])
        create.pull_after.add(name="x")
        with make_channel(ps_server.address) as ch:
            push_pull = ch.stream_stream("/jaxdist.ParameterServer/PushPull")
            push = ch.stream_unary("/jaxdist.ParameterServer/Push")
            body = ONES.tobytes()
            cases = [
                (lambda: list(push_pull(iter([b"\xff\xfe garbage"]), metadata=md, timeout=5)), "garbage header"),
                (lambda: list(push_pull(iter([]), metadata=md, timeout=5)), "empty stream"),
                (lambda: list(push_pull(iter([_push_pull_header().SerializeToString(), body[:8]]), metadata=md, timeout=5)),
                 "truncated"),
                (lambda: list(push_pull(iter([_push_pull_header().SerializeToString(), body + b"\0" * 4]), metadata=md,
                                        timeout=5)), "over-long"),
                (lambda: list(push_pull(iter([create.SerializeToString(), b"\0" * 8]), metadata=md, timeout=5)),
                 "create with reads"),
                (lambda: push(iter([_push_pull_header().SerializeToString(), body]), metadata=md, timeout=5),
                 "reads on a plain Push"),
            ]
            for call, what in cases:
                with pytest.raises(grpc.RpcError) as info:
                    call()
                assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
                assert dict(info.value.trailing_metadata() or ())[REASON_KEY] == "INVALID_REQUEST", what
            with pytest.raises(grpc.RpcError) as info:  # no token
                list(push_pull(iter([_push_pull_header().SerializeToString(), body]), timeout=5))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        w, ver = _w(c)
        assert ver == 1 and np.array_equal(w, np.zeros((2, 3)))
        assert c.list_variables() and "x" not in {v.name for v in c.list_variables()}
    finally:
        c.close()


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("closed")
        buf += chunk
    return buf


def _status(sock: socket.socket) -> tuple[int, str, bytes, bytes]:
    magic, code, reason_len, body_len, payload_len = framing.RESPONSE.unpack(_recv(sock, framing.RESPONSE.size))
    assert magic == dataplane.RESPONSE_MAGIC
    return code, _recv(sock, reason_len).decode(), _recv(sock, body_len), _recv(sock, payload_len)


def _request(method: int, header: bytes, payload: bytes = b"") -> bytes:
    return framing.REQUEST.pack(dataplane.REQUEST_MAGIC, method, len(header), len(payload)) + header + payload


def test_garbage_and_misrouted_messages_over_the_data_plane(ps_server: ParameterServer) -> None:
    c = PSClient(ps_server.address, CREDS, data_plane=False)
    invalid = grpc.StatusCode.INVALID_ARGUMENT.value[0]
    try:
        _setup(c)
        with socket.create_connection(("127.0.0.1", ps_server.data_port), timeout=5) as s:
            t = TOKEN.encode()
            s.sendall(framing.HELLO.pack(dataplane.HELLO_MAGIC, len(t)) + t)
            assert _status(s)[0] == 0
            body = ONES.tobytes()
            s.sendall(_request(dataplane.PUSH_PULL, b"\xff\xff\xff garbage", body))
            assert _status(s)[0] == invalid
            s.sendall(_request(dataplane.PUSH_PULL, _push_pull_header().SerializeToString(), body[:8]))
            assert _status(s)[0] == invalid
            s.sendall(_request(dataplane.PUSH_PULL, _push_pull_header(reads=False).SerializeToString(), body))
            assert _status(s)[0] == invalid
            s.sendall(_request(dataplane.PUSH, _push_pull_header().SerializeToString(), body))
            assert _status(s)[0] == invalid
            bad_read, _ = ps_wire.encode_push_pull([Update("w", Op.APPLY_GRADIENT, ONES)], [PullSpec("nope")])
            s.sendall(_request(dataplane.PUSH_PULL, bad_read.SerializeToString(), body))
            assert _status(s)[:2] == (grpc.StatusCode.NOT_FOUND.value[0], VariableNotFoundError.reason)
            # The connection still serves: a well-formed PushPull is applied and answered with the value.
            s.sendall(_request(dataplane.PUSH_PULL, _push_pull_header().SerializeToString(), body))
            code, _, answer, payload = _status(s)
            assert code == 0
            header = ps_pb2.PullHeader.FromString(answer)
            assert header.has_push and list(header.push.versions) == [2]
            (spec,) = ps_wire.pull_payload_specs(header)[0]
            assert spec == ((2, 3), np.dtype(np.float32))
            assert np.allclose(np.frombuffer(payload, np.float32), -0.5)
        assert _w(c)[1] == 2
    finally:
        c.close()


def test_payload_codec_roundtrip_sanity() -> None:
    # The answer's specs come from the header alone, as for a Pull (the receiver preallocates).
    header = ps_pb2.PullHeader(has_push=True)
    codec.spec_to_proto((4,), np.float32, header.entries.add(version=3).spec)
    assert ps_wire.pull_payload_specs(header)[0] == [((4,), np.dtype(np.float32))]
