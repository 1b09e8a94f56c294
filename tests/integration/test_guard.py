"""One guard answers for both transports; one client base maps every answer back.

A handler raising the same exception over gRPC and over the data plane gives
the caller the same typed error (class, status code, reason), and the server
keeps serving. Real servers on 127.0.0.1 port 0.
"""

from __future__ import annotations

import ast
import pathlib
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest

from jaxdist.base import errors as E
from jaxdist.proto import common_pb2, ps_pb2
from jaxdist.ps_server.client import PSClient
from jaxdist.sync.coordination import CoordinationClient
from jaxdist.transport import dataplane
from jaxdist.transport.client import ServiceClient
from jaxdist.transport.handlers import unary_handler
from jaxdist.transport.server import Server
from jaxdist.worker.client import WorkerClient
from jaxdist.worker.coordinator_client import CoordinatorClient

from conftest import CREDS

pytestmark = pytest.mark.timeout(60)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _garbage() -> None:
    ps_pb2.PullRequest.FromString(b"\xff\xff\xff")  # a protobuf DecodeError


RAISED = {
    "not_found": lambda: (_ for _ in ()).throw(E.VariableNotFoundError("no variable 'x'")),
    "shape": lambda: (_ for _ in ()).throw(E.ShapeMismatchError("bad shape")),
    "too_large": lambda: (_ for _ in ()).throw(E.PayloadTooLargeError("too big")),
    "garbage": _garbage,
    "bug": lambda: (_ for _ in ()).throw(ZeroDivisionError("a bug")),
}
EXPECTED = {
    "not_found": (E.VariableNotFoundError, grpc.StatusCode.NOT_FOUND),
    "shape": (E.ShapeMismatchError, grpc.StatusCode.INVALID_ARGUMENT),
    "too_large": (E.PayloadTooLargeError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    "garbage": (E.InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    "bug": (E.RemoteError, grpc.StatusCode.INTERNAL),
}
METHOD = {name: 10 + i for i, name in enumerate(RAISED)}  # data-plane method numbers (1-3 are taken)


class _Client(ServiceClient):
    SERVICE = "test.Guarded"
    ROLE = "ps"

    def empty_call(self, method: str) -> None:
        """One unary call of ``method`` with an empty request, through the shared client path."""
        self._call(self._unary(method, common_pb2.Empty, common_pb2.Empty), common_pb2.Empty(), timeout=5)


@contextmanager
def _servers() -> Iterator[tuple[Server, dataplane.DataPlaneServer]]:
    def grpc_handler(name: str) -> grpc.RpcMethodHandler:
        def fn(request: common_pb2.Empty, context: grpc.ServicerContext) -> common_pb2.Empty:
            RAISED[name]()
            return common_pb2.Empty()

        return unary_handler(name, common_pb2.Empty.FromString, fn)

    def dp_handler(name: str) -> dataplane.Handler:
        @contextmanager
        def fn(header: bytes, payload: dataplane.Payload) -> Iterator[tuple[bytes, list]]:
            RAISED[name]()
            yield b"", []

        return fn

    server = Server(credentials=CREDS)
    server.add_service("test.Guarded", {name: grpc_handler(name) for name in RAISED})
    dp = dataplane.DataPlaneServer({METHOD[name]: dp_handler(name) for name in RAISED}, credentials=CREDS)
    server.start()
    dp.start()
    try:
        yield server, dp
    finally:
        dp.stop(grace=None)
        server.stop(grace=None)


@pytest.mark.parametrize("case", list(RAISED))
def test_same_exception_same_typed_error_on_both_transports(case: str) -> None:
    with _servers() as (server, dp), _Client(server.address, CREDS, task="ps:7") as client:
        dpc = dataplane.DataPlaneClient("127.0.0.1", dp.port, CREDS, shared_memory=False)  # type: ignore[arg-type]
        try:
            with pytest.raises(E.JaxdistError) as over_grpc:
                client.empty_call(case)
            with pytest.raises(dataplane.DataPlaneError) as raw:
                dpc.call(METHOD[case], b"", (), timeout=5)
            over_dp = client.status_error(raw.value.code, raw.value.details, raw.value.reason)
            cls, code = EXPECTED[case]
            for err in (over_grpc.value, over_dp):
                assert type(err) is cls and err.grpc_code == code and err.task == "ps:7"  # type: ignore[attr-defined]
            # Both servers still answer on the same connection / channel.
            with pytest.raises(type(over_grpc.value)):
                client.empty_call(case)
            with pytest.raises(dataplane.DataPlaneError):
                dpc.call(METHOD[case], b"", (), timeout=5)
        finally:
            dpc.close()


def test_unreachable_task_is_typed_by_its_role() -> None:
    with _servers() as (server, _):
        address = server.address
    with PSClient(address, CREDS, task="ps:3", data_plane=False) as ps, WorkerClient(address, CREDS, task="worker:2") as w:
        with pytest.raises(E.PSUnavailableError, match="ps:3"):
            ps.status(timeout=2)
        with pytest.raises(E.WorkerUnavailableError, match="worker:2"):
            w.heartbeat(timeout=2)


def test_every_client_uses_the_base_and_maps_errors_nowhere_else() -> None:
    assert all(issubclass(c, ServiceClient) for c in (PSClient, WorkerClient, CoordinationClient, CoordinatorClient))
    # Mapping a failed gRPC call to a typed error happens in the base (and the status module) only.
    allowed = {
        "transport/client.py",
        "proto/status.py",
        # The sans-IO failure handler classifies a failed RunClosures by the (code, reason) the
        # dispatch loop reports to it: classification, not a client's call.
        "coordinator/cluster_coordinator/failure_handler.py",
    }
    offenders = []
    for pkg in ("base", "coordinator", "keras_integration", "proto", "ps_server", "sync", "tools", "transport", "worker"):
        for path in (ROOT / pkg).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel in allowed or path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in (
                        "error_from_rpc", "error_from_status"):
                    offenders.append(f"{rel}:{node.lineno}")
    assert not offenders, f"map errors with ServiceClient.error/status_error instead: {offenders}"


@pytest.mark.parametrize("case", ["not_found", "bug"])
@pytest.mark.parametrize("after_frames", [0, 2])
def test_a_streamed_response_that_fails_gets_its_typed_status(case: str, after_frames: int) -> None:
    """An exception while a server stream (Pull) is being sent, before its first frame or
    after some, is answered with its typed status (INTERNAL for a bug), never gRPC's UNKNOWN
    "Exception iterating responses"."""
    from jaxdist.transport.handlers import stream_out_handler

    def fn(request: common_pb2.Empty, context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in range(after_frames):
            yield b"frame"
        RAISED[case]()

    server = Server(credentials=CREDS)
    server.add_service("test.Streamed", {"Out": stream_out_handler("Out", common_pb2.Empty.FromString, fn)})
    server.start()
    try:
        with grpc.insecure_channel(server.address) as ch:
            call = ch.unary_stream("/test.Streamed/Out")
            frames = []
            with pytest.raises(grpc.RpcError) as err:
                for frame in call(b"", metadata=CREDS.metadata, timeout=10):
                    frames.append(frame)
            assert frames == [b"frame"] * after_frames
            assert err.value.code() == EXPECTED[case][1], err.value  # type: ignore[attr-defined]
    finally:
        server.stop(grace=None)
