"""Hostile peers of the PS data plane (raw TCP, the framing documented in
``jaxdist/transport/dataplane/__init__.py``): the connection budgets (hello deadline, connection
cap, the client refused at the cap coming back), typed statuses for malformed requests, and a
peer that truncates its shared-memory region.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import select
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import CREDS, TOKEN, poll_for
from hostile_util import (
    ATTACH,
    DP_PULL,
    DP_PUSH,
    DP_SHM_ATTACH,
    EXHAUSTED,
    INVALID,
    NOT_FOUND,
    OK,
    PRECONDITION,
    PS,
    SHM_HEAD,
    SHM_MIN_PAYLOAD,
    channel,
    closed_by_peer,
    counter_changes,
    create,
    dp_connect,
    dp_push_header,
    dp_read,
    dp_request,
    hello_bytes,
    open_sockets,
    ps_status,
    ps_variables,
    recv_exact,
    state_counters,
    task_process,
    unary,
)

from jaxdist.proto import common_pb2, ps_pb2
from jaxdist.ps_server.server import ParameterServer

pytestmark = pytest.mark.timeout(120)

F32 = common_pb2.FLOAT32
I64 = common_pb2.INT64
#: The data plane's documented limits: a connection must say hello within 10 s, a PS serves at most 1,024.
HELLO_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 1024


@pytest.fixture
def ps(ps_server: ParameterServer) -> Iterator[tuple[ParameterServer, grpc.Channel, int]]:
    """The conftest PS with ``v`` = float32 [0, 1, 2, 3], a raw gRPC channel, and its data port (from GetStatus)."""
    ch = channel(ps_server.address)
    create(ch, "v", np.arange(4, dtype=np.float32).tobytes(), F32, [4])
    port = ps_status(ch).data_port
    assert port, "the PS announces no data port"
    yield ps_server, ch, port
    ch.close()


@pytest.fixture
def log_dir(tmp_path: Any) -> str:
    return str(tmp_path)


# ------------------------------------------------------------------------------ connection budgets
@pytest.mark.slow
@pytest.mark.timeout(60)
def test_hello_deadline_bounds_the_whole_hello(ps: Any) -> None:
    """The hello deadline bounds the whole hello, not each ``recv`` (per ``recv``, a client sending one
    byte every 2 s stayed connected indefinitely without a token): the server closes it once the
    hello took longer than its deadline (10 s)."""
    _, _, port = ps
    hello = hello_bytes(TOKEN)
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        t0 = time.monotonic()
        closed_at = None
        for i in range(8):  # 16 s of dribbling, well past the 10 s hello deadline
            try:
                sock.sendall(hello[i : i + 1])
            except OSError:
                closed_at = time.monotonic() - t0
                break
            if closed_by_peer(sock, 2.0):  # also paces the dribble: one byte per 2 s
                closed_at = time.monotonic() - t0
                break
        assert closed_at is not None, (f"a client sending one hello byte every 2 s is still connected after "
                                       f"{time.monotonic() - t0:.0f}s (hello deadline {HELLO_TIMEOUT_S:.0f}s)")
        assert closed_at <= HELLO_TIMEOUT_S + 3.0, f"closed only after {closed_at:.1f}s"
    finally:
        sock.close()


def _answered_or_closed(socks: list[socket.socket]) -> int:
    """How many of our connections the server has answered or closed (readable without blocking)."""
    poller = select.poll()
    for s in socks:
        poller.register(s, select.POLLIN | select.POLLHUP | select.POLLERR)
    return len(poller.poll(0))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tokenless_connections_do_not_take_the_connection_cap(log_dir: str) -> None:
    """Unauthenticated connections do not count against the 1,024-connection cap (when they did, one
    peer without the token could hold every slot, and a token holder connecting then was refused
    RESOURCE_EXHAUSTED): a token holder is served while 1,024 token-less connections are open."""
    with task_process("ps", log_dir, metrics=False) as task:
        ch = channel(task.address)
        socks: list[socket.socket] = []
        try:
            port = ps_status(ch).data_port
            base = open_sockets(task.pid)
            for _ in range(MAX_CONNECTIONS):
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=30))
            # Every connection has been taken by the PS (held) or answered/closed by it: none is still
            # waiting in the listen queue, so the token holder below comes after all of them.
            poll_for(lambda: open_sockets(task.pid) - base + _answered_or_closed(socks) >= MAX_CONNECTIONS, 60,
                     what="the PS to take the token-less connections")
            for s in socks:  # one byte of hello each (none of them has a token); would restart a per-recv timer
                try:
                    s.sendall(b"J")
                except OSError:
                    pass  # refused or closed by the PS: fine
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
            try:
                sock.sendall(hello_bytes(TOKEN))
                a = dp_read(sock)
            finally:
                sock.close()
            assert a.code == OK, f"with {MAX_CONNECTIONS} token-less connections open, a token holder is refused: {a}"
        finally:
            for s in socks:
                s.close()
            ch.close()


def _fill_cap(port: int, limit: int) -> list[socket.socket]:
    """Idle token-holder connections until the PS refuses one RESOURCE_EXHAUSTED (its cap is full)."""
    held = []
    for _ in range(limit):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        sock.sendall(hello_bytes(TOKEN))
        try:
            a = dp_read(sock)
        except ConnectionError:
            a = None
        if a is not None and a.code == OK:
            held.append(sock)
            continue
        sock.close()
        assert a is not None and a.code == EXHAUSTED, f"connection {len(held) + 1} got {a}"
        return held
    for s in held:
        s.close()
    raise AssertionError(f"the PS took {limit} idle connections without reaching its cap; the test proves nothing")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_client_refused_at_the_cap_comes_back_to_the_data_plane(log_dir: str) -> None:
    """A PSClient refused at the connection cap falls back to gRPC (~4-5x slower), but not for good:
    once the cap has room again it returns to the data plane (within 30 s of calls here)."""
    from jaxdist.ps_server.client import PSClient, PullSpec

    with task_process("ps", log_dir, metrics=False) as task:
        ch = channel(task.address)
        create(ch, "w", np.zeros(1024, np.float32).tobytes(), F32, [1024])
        port = ps_status(ch).data_port
        base = open_sockets(task.pid)
        held = _fill_cap(port, MAX_CONNECTIONS + 64)
        client = PSClient(task.address, CREDS, task="ps:0")
        try:
            client.pull([PullSpec("w")])  # refused on the data plane at the cap: served over gRPC
            assert client.uses_data_plane is False, "the client was not refused at the cap; the test proves nothing"
            for s in held:
                s.close()
            held.clear()
            poll_for(lambda: open_sockets(task.pid) <= base + 4, 60, what="the PS to drop the idle connections")
            deadline = time.monotonic() + 30
            while client.uses_data_plane is not True and time.monotonic() < deadline:
                client.pull([PullSpec("w")])
                time.sleep(0.2)  # pacing of the calls, not a synchronisation
            assert client.uses_data_plane is True, "30 s after the cap had room again the client still moves tensors over gRPC"
        finally:
            client.close()
            for s in held:
                s.close()
            ch.close()


# ------------------------------------------------------------------------------ typed statuses
def _dp_call(port: int, method: int, header: bytes, payload: bytes = b"", payload_len: int | None = None) -> Any:
    sock = dp_connect(port)
    try:
        sock.sendall(dp_request(method, header, payload, payload_len))
        return dp_read(sock)
    finally:
        sock.close()


@pytest.mark.parametrize("if_exists", [7, -1])
def test_create_with_an_unknown_if_exists_is_invalid_argument_on_the_data_plane(ps: Any, if_exists: int) -> None:
    """A CREATE with an unknown ``if_exists`` is INVALID_ARGUMENT on the data plane too (once INTERNAL)."""
    _, ch, port = ps
    before = ps_variables(ch)
    header = dp_push_header([dict(name="x", op=ps_pb2.CREATE, value=(F32, [2]), if_exists=if_exists)])
    a = _dp_call(port, DP_PUSH, header, b"\0" * 8)
    assert a.code == INVALID, f"CREATE with if_exists={if_exists} answered {a}"
    assert ps_variables(ch) == before


HUGE_EMPTY_SHAPES = [[0, 2**62, 2**62], [2**63 - 1, 0]]


@pytest.mark.parametrize("shape", HUGE_EMPTY_SHAPES, ids=str)
def test_push_of_a_zero_element_shape_with_huge_dims_is_invalid_argument_on_the_data_plane(ps: Any, shape: list[int]) -> None:
    """A zero-element value with huge dimensions is INVALID_ARGUMENT on the data plane (once INTERNAL)."""
    _, ch, port = ps
    before = ps_variables(ch)
    a = _dp_call(port, DP_PUSH, dp_push_header([dict(name="v", op=ps_pb2.ASSIGN, value=(F32, shape))]))
    assert a.code == INVALID, f"Push of a {shape} value answered {a}"
    assert ps_variables(ch) == before


@pytest.mark.parametrize("shape", HUGE_EMPTY_SHAPES, ids=str)
def test_pull_with_zero_element_indices_of_huge_dims_is_invalid_argument_on_the_data_plane(ps: Any, shape: list[int]) -> None:
    """Pull with zero-element indices of huge dimensions is INVALID_ARGUMENT on the data plane (once INTERNAL)."""
    _, _, port = ps
    req = ps_pb2.PullRequest()
    e = req.entries.add(name="v", has_indices=True)
    e.indices.spec.dtype = I64
    e.indices.spec.shape.extend(shape)
    a = _dp_call(port, DP_PULL, req.SerializeToString())
    assert a.code == INVALID, f"Pull with {shape} indices answered {a}"


@pytest.mark.parametrize("payload_len", [2**63, 2**64 - 1], ids=["2**63", "2**64-1"])
def test_request_announcing_an_impossible_payload_gets_a_typed_status(ps: Any, payload_len: int, caplog: pytest.LogCaptureFixture) -> None:
    """A data-plane request announcing 2**63 payload bytes is answered RESOURCE_EXHAUSTED (an oversized
    payload), without a traceback, the PS unchanged. It once raised OverflowError in ``settimeout``,
    logged as a traceback, and the connection was closed without a status."""
    _, ch, port = ps
    before, variables = state_counters(ch), ps_variables(ch)
    header = dp_push_header([dict(name="v", op=ps_pb2.ASSIGN, value=(F32, [4]))])
    with caplog.at_level(logging.WARNING):
        sock = dp_connect(port)
        try:
            sock.sendall(dp_request(DP_PUSH, header, payload_len=payload_len))
            try:
                a = dp_read(sock)
            except ConnectionError as e:
                raise AssertionError(f"a request announcing {payload_len} payload bytes got no status: {e}") from None
            assert a.code == EXHAUSTED, f"a request announcing {payload_len} payload bytes answered {a}"
        finally:
            sock.close()
    tracebacks = [r.getMessage() for r in caplog.records if r.exc_info]
    assert not tracebacks, f"the server logged tracebacks: {tracebacks}"
    assert not counter_changes(before, state_counters(ch)) and ps_variables(ch) == variables


@pytest.mark.parametrize("case", ["unknown-variable", "wrong-shape", "wrong-dtype"])
def test_rejected_pushes_are_not_counted_on_the_data_plane(ps: Any, case: str) -> None:
    """Rejected pushes are not counted in ``pushes`` / ``bytes_pushed`` (data plane), as they once were."""
    _, ch, port = ps
    entry = {"unknown-variable": dict(name="nope", op=ps_pb2.ASSIGN, value=(F32, [4])),
             "wrong-shape": dict(name="v", op=ps_pb2.ASSIGN, value=(F32, [2, 2])),
             "wrong-dtype": dict(name="v", op=ps_pb2.ASSIGN, value=(common_pb2.INT32, [4]))}[case]
    before = state_counters(ch)
    a = _dp_call(port, DP_PUSH, dp_push_header([entry]), b"\1" * 16)
    assert a.code == (NOT_FOUND if case == "unknown-variable" else INVALID), a
    changed = counter_changes(before, state_counters(ch))
    assert not changed, f"a rejected push ({case}) changed the counters: {changed}"


# ------------------------------------------------------------------------------ shared memory
@pytest.mark.multiprocess
@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="this host has no /dev/shm (no shared-memory path)")
def test_truncated_shared_memory_region_does_not_kill_the_ps(log_dir: str) -> None:
    """A same-user client that truncates its shared-memory region after attaching could SIGBUS a PS
    that mapped it. The PS survives its peer's mistake (typed error or that connection closed),
    keeps serving, and leaves the variable unchanged."""
    slot = SHM_MIN_PAYLOAD  # 64 KiB slots; a 64 KiB payload moves through slot 0
    with task_process("ps", log_dir, metrics=False) as task:
        ch = channel(task.address)
        create(ch, "big", np.zeros(slot // 4, np.float32).tobytes(), F32, [slot // 4])
        before = ps_variables(ch)
        port = ps_status(ch).data_port
        name = f"jaxdist-{secrets.token_hex(16)}"
        path = os.path.join("/dev/shm", name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        mm = None
        sock = dp_connect(port)
        try:
            size = SHM_HEAD + 2 * slot
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size)
            nonce = secrets.token_bytes(16)
            mm[:16] = nonce
            sock.sendall(dp_request(DP_SHM_ATTACH, ATTACH.pack(slot, nonce) + name.encode()))
            a = dp_read(sock)
            assert a.code == OK, f"ShmAttach refused: {a}"
            mm[SHM_HEAD : SHM_HEAD + slot] = np.ones(slot // 4, np.float32).tobytes()
            os.ftruncate(fd, 0)  # the peer's mistake: its mapping of slot 0 now lies past the file's end
            header = dp_push_header([dict(name="big", op=ps_pb2.ASSIGN, value=(F32, [slot // 4]))])
            sock.sendall(dp_request(DP_PUSH, header, payload_len=slot) + b"D")
            sock.settimeout(10)
            try:  # a slot token, a typed error, the end of this connection, or nothing: all fine if the PS lives
                answer: Any = sock.recv(4096)
            except OSError as e:
                answer = e
            alive = unary(ch, PS + "GetStatus", common_pb2.Empty(), timeout=10)
            if alive.code != OK:
                try:
                    code: Any = task.proc.wait(timeout=10)
                    code = signal.Signals(-code).name if code < 0 else f"exit {code}"
                except subprocess.TimeoutExpired:
                    code = "still running"
                raise AssertionError(f"the PS stopped answering ({alive.code.name}; process: {code}) when its peer "
                                     f"truncated the shared-memory region; the push got {answer!r}")
            assert ps_variables(ch) == before, "the variable changed"
        finally:
            sock.close()
            if mm is not None:
                mm.close()
            os.close(fd)
            os.unlink(path)
            ch.close()


@pytest.mark.multiprocess
@pytest.mark.skipif(not (hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd")),
                    reason="no memfd_create or /proc here (no sealed shared-memory regions)")
def test_sealed_region_the_ps_maps_cannot_be_shrunk_and_an_unsealed_one_is_refused(log_dir: str) -> None:
    """The shared-memory fast path: the PS maps only a memfd sealed against shrinking (``fd:<pid>/<fd>``).
    An unsealed one is refused before anything is read or written (FAILED_PRECONDITION); once a
    sealed one is mapped, its owner can no longer truncate it, and a push through it lands."""
    import fcntl

    slot = SHM_MIN_PAYLOAD
    size = SHM_HEAD + 2 * slot
    with task_process("ps", log_dir, metrics=False) as task:
        ch = channel(task.address)
        create(ch, "big", np.zeros(slot // 4, np.float32).tobytes(), F32, [slot // 4])
        before = ps_variables(ch)
        port = ps_status(ch).data_port
        nonce = secrets.token_bytes(16)
        fds = []
        for seals in (0, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL):
            fd = os.memfd_create("jaxdist-hostile", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
            fds.append(fd)
            os.ftruncate(fd, size)
            os.pwrite(fd, nonce, 0)
            if seals:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        unsealed, sealed = fds
        sock = dp_connect(port)
        mm = None
        try:
            sock.sendall(dp_request(DP_SHM_ATTACH, ATTACH.pack(slot, nonce) + f"fd:{os.getpid()}/{unsealed}".encode()))
            refused = dp_read(sock)
            assert refused.code == PRECONDITION, f"an unsealed region was not refused: {refused}"
            assert ps_variables(ch) == before
            sock.sendall(dp_request(DP_SHM_ATTACH, ATTACH.pack(slot, nonce) + f"fd:{os.getpid()}/{sealed}".encode()))
            a = dp_read(sock)
            assert a.code == OK, f"a sealed region was refused: {a}"
            with pytest.raises(PermissionError):  # the peer's mistake of the other test is impossible here
                os.ftruncate(sealed, 0)
            mm = mmap.mmap(sealed, size)
            mm[SHM_HEAD:SHM_HEAD + slot] = np.ones(slot // 4, np.float32).tobytes()
            header = dp_push_header([dict(name="big", op=ps_pb2.ASSIGN, value=(F32, [slot // 4]))])
            sock.sendall(dp_request(DP_PUSH, header, payload_len=slot) + b"D")
            sock.settimeout(10)
            assert recv_exact(sock, 1) == b"A"
            pushed = dp_read(sock)
            assert pushed.code == OK, f"the push through the mapped region failed: {pushed}"
            (_, _, shape, data), = ps_variables(ch).values()
            assert shape == (slot // 4,) and np.array_equal(np.frombuffer(data, np.float32), np.ones(slot // 4, np.float32))
        finally:
            sock.close()
            if mm is not None:
                mm.close()
            for fd in fds:
                os.close(fd)
            ch.close()
