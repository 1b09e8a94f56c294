"""What a failed heartbeat proves: the dispatcher asks a fresh TCP connection, never the status's text.

A heartbeat that fails UNAVAILABLE because nothing listens (the process is gone) fails its worker at
once; one that fails UNAVAILABLE while a process still holds the port (a connection that keepalive
or the peer dropped on a loaded machine) only counts towards the failure timeout. Both kinds are made
here with real gRPC calls on loopback sockets.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections.abc import Iterator

import grpc
import pytest
from jaxdist.cluster_coordinator.dispatch import make_aio_channel, nobody_listens
from jaxdist.proto import common_pb2
from jaxdist.transport.credentials import PLAINTEXT

pytestmark = pytest.mark.timeout(60)


def _closed_port() -> int:
    """A port nothing listens on (bound, then closed: the kernel refuses connections to it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def dropping_listener() -> Iterator[int]:
    """A process that holds a port, accepts every connection and drops it at once (no HTTP/2):
    gRPC calls to it fail UNAVAILABLE although something listens there."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    stop = threading.Event()

    def serve() -> None:
        srv.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.close()

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    try:
        yield int(srv.getsockname()[1])
    finally:
        stop.set()
        t.join(5)
        srv.close()


async def _heartbeat(address: str) -> grpc.StatusCode:
    ch = make_aio_channel(address, PLAINTEXT)
    try:
        hb = ch.unary_unary("/jaxdist.Worker/Heartbeat", request_serializer=common_pb2.Empty.SerializeToString,
                            response_deserializer=common_pb2.TaskStatus.FromString)
        try:
            await hb(common_pb2.Empty(), timeout=5.0, wait_for_ready=False)
        except grpc.aio.AioRpcError as e:
            return e.code()
        raise AssertionError(f"{address} answered a heartbeat")
    finally:
        await ch.close()


def test_a_refused_connection_is_nobody_listening() -> None:
    address = f"127.0.0.1:{_closed_port()}"
    assert asyncio.run(_heartbeat(address)) == grpc.StatusCode.UNAVAILABLE
    assert asyncio.run(nobody_listens(address)) is True


def test_unavailable_while_a_process_holds_the_port_is_not_proof_of_death(dropping_listener: int) -> None:
    address = f"127.0.0.1:{dropping_listener}"
    assert asyncio.run(_heartbeat(address)) == grpc.StatusCode.UNAVAILABLE  # the same code as a refusal
    assert asyncio.run(nobody_listens(address)) is False


def test_bracketed_ipv6_and_other_targets() -> None:
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    with socket.socket(socket.AF_INET6) as s:
        try:
            s.bind(("::1", 0))
        except OSError:
            pytest.skip("no IPv6 loopback on this host")
        s.listen(1)
        assert asyncio.run(nobody_listens(f"[::1]:{s.getsockname()[1]}")) is False
    # Not host:port (a gRPC target such as a unix socket): no connect test, the call's evidence stands.
    assert asyncio.run(nobody_listens("unix:/nonexistent/socket")) is True
