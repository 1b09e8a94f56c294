"""The PS service over real gRPC on 127.0.0.1 port 0: data path, bad input, auth."""

from __future__ import annotations

import threading

import grpc
import numpy as np
import optax
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxdist.errors import (
    AuthenticationError,
    ConfigurationError,
    DTypeMismatchError,
    InvalidRequestError,
    PayloadTooLargeError,
    PSUnavailableError,
    ShapeMismatchError,
    VariableExistsError,
    VariableNotFoundError,
)
from jaxdist.proto import ps_pb2
from jaxdist.transport.channel import make_channel
from jaxdist.proto.status import REASON_KEY
from jaxdist.proto.ps_wire import CreateSpec, Op, PullSpec, Update
from jaxdist.ps_server.client import PSClient
from jaxdist.ps_server.server import ParameterServer

from jaxdist.transport.credentials import Credentials
from conftest import CREDS

pytestmark = pytest.mark.timeout(120)


def test_create_pull_push_roundtrip(ps_client: PSClient) -> None:
    big = np.random.default_rng(0).standard_normal(3_000_000).astype(np.float32)  # > several 4 MiB frames
    ps_client.create([CreateSpec("big", value=big), CreateSpec("w", value=np.ones((2, 3), np.float32), optimizer=optax.sgd(0.5))])
    ((got, ver),) = ps_client.pull([PullSpec("big")])
    assert ver == 1 and np.array_equal(got, big)
    versions, dup = ps_client.push([Update("big", Op.ASSIGN_ADD, big), Update("w", Op.APPLY_GRADIENT, np.ones((2, 3), np.float32))])
    assert versions == [2, 2] and not dup
    (b2, _), (w2, _) = ps_client.pull([PullSpec("big"), PullSpec("w")])
    assert np.array_equal(b2, 2 * big) and np.allclose(w2, 0.5)
    # Cached pull: unchanged version -> no payload.
    ((none, v),) = ps_client.pull([PullSpec("w", known_version=2)])
    assert none is None and v == 2
    ((rows, _),) = ps_client.pull([PullSpec("big", indices=np.array([5, 0]))])
    assert np.array_equal(rows, 2 * big[[5, 0]])


def test_initializer_runs_on_ps(ps_client: PSClient) -> None:
    ps_client.create([CreateSpec("t", shape=(4, 2), dtype=np.int32, initializer=lambda s, d, o: np.arange(8, dtype=d).reshape(s) + o[0], offset=(10, 0))])
    ((t, _),) = ps_client.pull([PullSpec("t")])
    assert t.tolist() == [[10, 11], [12, 13], [14, 15], [16, 17]]


def test_concurrent_pushes_from_many_clients(ps_server: ParameterServer) -> None:
    clients = [PSClient(ps_server.address, CREDS) for _ in range(6)]
    clients[0].create([CreateSpec("c", value=np.zeros(10_000, np.float32))])

    def work(c: PSClient) -> None:
        for _ in range(40):
            c.push([Update("c", Op.ASSIGN_ADD, np.ones(10_000, np.float32))])

    threads = [threading.Thread(target=work, args=(c,)) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ((c, v),) = clients[0].pull([PullSpec("c")])
    assert np.all(c == 240) and v == 241
    for cl in clients:
        cl.close()


def _assert_still_serving(c: PSClient) -> None:
    c.create([CreateSpec("probe", value=np.zeros(1, np.float32), if_exists="keep")])
    assert c.pull([PullSpec("probe")])[0][1] >= 1


@pytest.mark.parametrize(
    "bad, exc, code",
    [
        (lambda c: c.pull([PullSpec("nope")]), VariableNotFoundError, grpc.StatusCode.NOT_FOUND),
        (lambda c: c.push([Update("v", Op.ASSIGN, np.ones((3, 3), np.float32))]), ShapeMismatchError, grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.push([Update("v", Op.ASSIGN, np.ones((2, 2), np.int32))]), DTypeMismatchError, grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.push([Update("nope", Op.ASSIGN, np.ones(1, np.float32))]), VariableNotFoundError, grpc.StatusCode.NOT_FOUND),
        (lambda c: c.create([CreateSpec("v", value=np.ones(1, np.float32))]), VariableExistsError, grpc.StatusCode.ALREADY_EXISTS),
        (lambda c: c.create([CreateSpec("huge", value=np.zeros(20 << 20, np.float32))]), PayloadTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
        (lambda c: c.pull([PullSpec("v", indices=np.array([7]))]), InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
        (lambda c: c.push([Update("v", Op.APPLY_GRADIENT, np.ones((2, 2), np.float32))]), InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    ],
    ids=["pull-unknown", "shape", "dtype", "push-unknown", "exists", "oversized", "index-range", "no-optimizer"],
)
def test_bad_input_gets_typed_error_and_server_keeps_serving(ps_client: PSClient, bad: object, exc: type, code: grpc.StatusCode) -> None:
    ps_client.create([CreateSpec("v", value=np.zeros((2, 2), np.float32))])
    with pytest.raises(exc) as info:
        bad(ps_client)  # type: ignore[operator]
    assert info.value.grpc_code == code  # type: ignore[attr-defined]
    assert info.value.task == "ps:0"  # type: ignore[attr-defined]
    assert np.array_equal(ps_client.pull([PullSpec("v")])[0][0], np.zeros((2, 2)))  # nothing changed
    _assert_still_serving(ps_client)


def _raw_channel(ps_server: ParameterServer) -> grpc.Channel:
    return make_channel(ps_server.address)


def test_garbage_bytes_and_truncated_streams(ps_server: ParameterServer, ps_client: PSClient) -> None:
    ps_client.create([CreateSpec("v", value=np.zeros(4, np.float32))])
    md = CREDS.metadata
    with _raw_channel(ps_server) as ch:
        push = ch.stream_unary("/jaxdist.ParameterServer/Push")
        pull = ch.unary_stream("/jaxdist.ParameterServer/Pull")
        lst = ch.unary_unary("/jaxdist.ParameterServer/ListVariables")
        header = ps_pb2.PushHeader()
        e = header.entries.add(name="v", op=ps_pb2.ASSIGN, has_value=True)
        e.value.dtype = 1
        e.value.shape.append(4)
        cases = [
            (lambda: push(iter([b"\xff\xfe garbage"]), metadata=md, timeout=5), "garbage header"),
            (lambda: push(iter([]), metadata=md, timeout=5), "empty stream"),
            (lambda: push(iter([header.SerializeToString(), b"\0" * 8]), metadata=md, timeout=5), "truncated"),
            (lambda: push(iter([header.SerializeToString(), b"\0" * 20]), metadata=md, timeout=5), "over-long"),
            (lambda: list(pull(b"\x0a\xff\xff", metadata=md, timeout=5)), "garbage pull"),
            (lambda: lst(b"\xff\xff\xff", metadata=md, timeout=5), "garbage unary"),
        ]
        for call, what in cases:
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
            assert dict(info.value.trailing_metadata() or ())[REASON_KEY] == "INVALID_REQUEST", what
    assert np.array_equal(ps_client.pull([PullSpec("v")])[0][0], np.zeros(4))
    _assert_still_serving(ps_client)


def test_oversized_message_is_resource_exhausted() -> None:
    with ParameterServer(credentials=CREDS, max_message_bytes=1 << 20) as ps, make_channel(ps.address) as ch:
        lst = ch.unary_unary("/jaxdist.ParameterServer/ListVariables")
        with pytest.raises(grpc.RpcError) as info:
            lst(b"\0" * (2 << 20), metadata=CREDS.metadata, timeout=5)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        c = PSClient(ps.address, CREDS)
        assert c.list_variables() == []
        c.close()


def test_unauthenticated_calls_are_rejected_and_do_nothing(ps_server: ParameterServer, ps_client: PSClient) -> None:
    ps_client.create([CreateSpec("v", value=np.zeros(2, np.float32))])
    for token in (None, "wrong"):
        bad = PSClient(ps_server.address, Credentials(token))
        with pytest.raises(AuthenticationError) as info:
            bad.push([Update("v", Op.ASSIGN, np.ones(2, np.float32))])
        assert info.value.grpc_code == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        with pytest.raises(AuthenticationError):
            bad.pull([PullSpec("v")])
        with pytest.raises(AuthenticationError):
            bad.shutdown()
        bad.close()
    assert np.array_equal(ps_client.pull([PullSpec("v")])[0][0], np.zeros(2))
    assert not ps_server.servicer.shutdown_event.is_set()


def test_health_is_open_without_token(ps_server: ParameterServer) -> None:
    with _raw_channel(ps_server) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "jaxdist.ParameterServer"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=svc), timeout=5).status == health_pb2.HealthCheckResponse.SERVING


def test_refuses_non_loopback_without_token() -> None:
    with pytest.raises(ConfigurationError, match="insecure"):
        ParameterServer(host="0.0.0.0", port=0)
    ps = ParameterServer(host="0.0.0.0", port=0, insecure=True)  # explicit opt-out works
    ps.start()
    ps.stop(grace=None)


def test_unreachable_ps_is_ps_unavailable() -> None:
    ps = ParameterServer(credentials=CREDS)
    ps.start()
    addr = ps.address
    ps.stop(grace=None)
    c = PSClient(addr, CREDS, task="ps:3")
    with pytest.raises(PSUnavailableError) as info:
        c.list_variables(timeout=2)
    assert info.value.task == "ps:3"
    c.close()
