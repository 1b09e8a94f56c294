"""The gRPC server's gate (jaxdist.transport.admission): per-method caps, lanes, the token-less read deadline."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from conftest import CREDS, TOKEN, poll_for
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxdist.base import errors as E
from jaxdist.proto import status
from jaxdist.transport import admission
from jaxdist.transport.client import ServiceClient
from jaxdist.transport.handlers import stream_in_handler, stream_stream_handler, unary_handler
from jaxdist.transport.server import Server

pytestmark = pytest.mark.timeout(60)

MD = (("authorization", f"Bearer {TOKEN}"),)


class _Empty:
    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf method name
        return b""


def _drain(frames: Iterator[bytes], context: grpc.ServicerContext) -> _Empty:
    for _ in frames:
        pass
    return _Empty()


def _echo(frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
    """Streams back what it was sent, once the request ends (as PushPull answers after its push)."""
    got = list(frames)
    yield from got


@pytest.fixture
def server() -> Iterator[Server]:
    s = Server(credentials=CREDS)
    s.add_service("t.Svc", {
        "Drain": stream_in_handler("Drain", _drain),
        "Echo": stream_stream_handler("Echo", _echo),
        "Ping": unary_handler("Ping", lambda raw: raw, lambda req, ctx: _Empty()),
    }, liveness=["Ping"])
    s.start()
    yield s
    s.stop(grace=None)


class _Held:
    """Calls whose request never ends until ``close``."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls: list[Any] = []

    def frames(self) -> Iterator[bytes]:
        yield b"x"
        self.release.wait()

    def close(self) -> None:
        self.release.set()
        for c in self.calls:
            c.cancel()


def test_a_method_admits_at_most_its_cap_and_releases_on_end(server: Server) -> None:
    ch = grpc.insecure_channel(server.address)
    held = _Held()
    drain = ch.stream_unary("/t.Svc/Drain")
    ping = ch.unary_unary("/t.Svc/Ping")
    try:
        for _ in range(admission.STREAMS.cap):
            held.calls.append(drain.future(held.frames(), metadata=MD))
        poll_for(lambda: server.in_flight("/t.Svc/Drain") == admission.STREAMS.cap, 30, what="the streams to be admitted")
        with pytest.raises(grpc.RpcError) as e:
            drain(iter([b"y"]), metadata=MD, timeout=10)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Typed as "busy, retry later" (not a payload over the size limit): clients may ask again.
        assert isinstance(status.error_from_rpc(e.value, "t:0", "ps"), E.ServerBusyError)
        assert ping(b"", metadata=MD, timeout=2) == b""  # another lane: answers at once
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status == 1
    finally:
        held.close()
    poll_for(lambda: server.in_flight("/t.Svc/Drain") == 0, 30, what="the ended streams to leave the cap")
    assert drain(iter([b"y"]), metadata=MD, timeout=10) == b""
    ch.close()


def test_a_denied_call_takes_no_slot_and_reads_nothing(server: Server) -> None:
    ch = grpc.insecure_channel(server.address)
    held = _Held()
    try:
        for _ in range(3 * admission.STREAMS.cap):  # token-less: refused before anything is read
            held.calls.append(ch.stream_unary("/t.Svc/Drain").future(held.frames()))
        for c in held.calls:
            assert c.exception(timeout=10).code() == grpc.StatusCode.UNAUTHENTICATED
        assert server.in_flight("/t.Svc/Drain") == 0
    finally:
        held.close()
        ch.close()


def test_a_tokenless_request_that_never_arrives_is_cancelled(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(admission, "TOKENLESS_REQUEST_TIMEOUT_S", 0.5)
    ch = grpc.insecure_channel(server.address)
    held = _Held()

    def nothing() -> Iterator[bytes]:
        held.release.wait()
        yield b""

    try:
        call = ch.stream_unary("/grpc.health.v1.Health/Check").future(nothing())
        poll_for(lambda: call.done(), 30, what="the stalled health Check to be cancelled")
        # The client sees the cancellation before the server's handler thread has left the call and
        # freed its slot (fresh-clone run r5 read 1 here): wait for the slot, which must come back.
        poll_for(lambda: server.in_flight("/grpc.health.v1.Health/Check") == 0, 30, what="the cancelled call's slot")
    finally:
        held.close()
        ch.close()



class _DrainClient(ServiceClient):
    """A jaxdist client of the test service that counts the refusals it saw."""

    SERVICE = "t.Svc"
    ROLE = "ps"

    def __init__(self, address: str) -> None:
        super().__init__(address, CREDS, task="ps:0")
        self.busy = 0
        self._drain = self.channel.stream_unary(self._path("Drain"))
        self._echo = self.channel.stream_stream(self._path("Echo"))

    def error(self, e: grpc.RpcError) -> E.JaxdistError:
        err = super().error(e)
        self.busy += isinstance(err, E.ServerBusyError)
        return err

    def drain(self, request: Any, timeout: float) -> bytes:
        return self._call(self._drain, request, timeout)

    def echo(self, frames: list[bytes], timeout: float) -> list[bytes]:
        """A response stream read whole (as PSClient's gRPC Pull and PushPull)."""
        return self._read_stream(lambda md, left: list(self._echo(iter(frames), metadata=md, timeout=left)), timeout)


def _fill_cap(server: Server, ch: grpc.Channel, held: _Held, method: str = "Drain") -> None:
    if method == "Drain":
        call = ch.stream_unary("/t.Svc/Drain").future
    else:
        call = ch.stream_stream(f"/t.Svc/{method}")
    for _ in range(admission.STREAMS.cap):
        held.calls.append(call(held.frames(), metadata=MD))
    poll_for(lambda: server.in_flight(f"/t.Svc/{method}") == admission.STREAMS.cap, 30, what="the streams to be admitted")


def test_a_call_refused_as_busy_is_made_again_until_a_slot_frees(server: Server) -> None:
    held, result = _Held(), []
    with grpc.insecure_channel(server.address) as ch, _DrainClient(server.address) as client:
        try:
            _fill_cap(server, ch, held)
            t = threading.Thread(target=lambda: result.append(client.drain(lambda: iter([b"y"]), timeout=60)))
            t.start()
            poll_for(lambda: client.busy >= 2, 30, what="the call to be refused and made again")
            assert not result  # still waiting: refused, not failed
            held.close()  # the held streams end: the next attempt is admitted
            t.join(30)
            assert result == [b""] and not t.is_alive()
        finally:
            held.close()


def test_a_busy_call_gives_up_at_its_deadline_and_a_stream_iterator_is_not_resent(server: Server) -> None:
    held = _Held()
    with grpc.insecure_channel(server.address) as ch, _DrainClient(server.address) as client:
        try:
            _fill_cap(server, ch, held)
            with pytest.raises(E.ServerBusyError):
                client.drain(lambda: iter([b"y"]), timeout=0.5)  # refused until its deadline
            assert client.busy >= 2
            before = client.busy
            with pytest.raises(E.ServerBusyError):  # an iterator cannot be sent twice: raised at the first refusal
                client.drain(iter([b"y"]), timeout=30)
            assert client.busy == before + 1
        finally:
            held.close()


def test_a_response_stream_refused_as_busy_is_read_again_until_a_slot_frees(server: Server) -> None:
    held, result = _Held(), []
    with grpc.insecure_channel(server.address) as ch, _DrainClient(server.address) as client:
        try:
            _fill_cap(server, ch, held, "Echo")
            t = threading.Thread(target=lambda: result.append(client.echo([b"a", b"b"], timeout=60)))
            t.start()
            poll_for(lambda: client.busy >= 2, 30, what="the stream to be refused and made again")
            assert not result  # still waiting: refused, not failed
            held.close()
            t.join(30)
            assert result == [[b"a", b"b"]] and not t.is_alive()
            poll_for(lambda: server.in_flight("/t.Svc/Echo") == 0, 30, what="the held streams to end")
            held = _Held()
            _fill_cap(server, ch, held, "Echo")
            before = client.busy
            with pytest.raises(E.ServerBusyError):  # and at its deadline it gives up, typed
                client.echo([b"c"], timeout=0.5)
            assert client.busy >= before + 2
        finally:
            held.close()
