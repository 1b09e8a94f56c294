"""Malformed requests over gRPC: every one gets its typed status and changes nothing.

Real gRPC servers on 127.0.0.1 port 0 in this process (``ParameterServer``, ``WorkerServer``,
the coordinator's registration service), called with raw bytes and the generated messages.
The data plane's typed statuses are in ``test_hostile_dataplane.py``.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from conftest import CREDS, TOKEN, poll_for
from hostile_util import (
    COORDINATOR,
    EXHAUSTED,
    INVALID,
    NOT_FOUND,
    OK,
    PRECONDITION,
    PS,
    UNAVAILABLE,
    WORKER,
    channel,
    counter_changes,
    create,
    ps_counters,
    ps_variables,
    push_frames,
    state_counters,
    stream_in,
    stream_out,
    unary,
)

from jaxdist.base import errors as E
from jaxdist.proto import common_pb2, coordinator_pb2, ps_pb2, worker_pb2
from jaxdist.ps_server.server import ParameterServer
from jaxdist.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(120)

F32 = common_pb2.FLOAT32
I64 = common_pb2.INT64
V_VALUE = np.arange(4, dtype=np.float32)


@pytest.fixture
def ps(ps_server: ParameterServer) -> Iterator[tuple[ParameterServer, grpc.Channel]]:
    """The conftest PS with ``v`` = float32 [0, 1, 2, 3], and a raw channel to it."""
    ch = channel(ps_server.address)
    create(ch, "v", V_VALUE.tobytes(), F32, [4])
    yield ps_server, ch
    ch.close()


# ------------------------------------------------------------------ Restore
def _checkpoint_file(directory: str) -> np.ndarray:
    """``directory/f.npz`` holding ``param/src``, a float32 [4, 2] array (a PS checkpoint file)."""
    src = np.arange(8, dtype=np.float32).reshape(4, 2) + 10
    with open(os.path.join(directory, "f.npz"), "wb") as f:
        np.savez(f, **{"param/src": src})
    return src


def _restore(directory: str, name: str, shape: list[int], pieces: list[tuple[int, int, int]], source: str = "src") -> ps_pb2.RestoreRequest:
    req = ps_pb2.RestoreRequest(directory=directory)
    e = req.entries.add(name=name)
    e.spec.dtype = F32
    e.spec.shape.extend(shape)
    for start, stop, dst in pieces:
        e.pieces.add(file="f.npz", source=source, src_start=start, src_stop=stop, dst_start=dst)
    return req


@pytest.mark.parametrize("pieces", [
    [(0, 2, 0), (0, 2, 0)],   # both pieces write rows 0-1, rows 2-3 never written
    [(0, 2, 0), (0, 2, 1)],   # rows 0-2 written (row 1 twice), row 3 never written
], ids=["same-rows-twice", "overlap-by-one"])
def test_restore_pieces_that_do_not_tile_the_variable_are_invalid_argument(ps: Any, tmp_path: Any, pieces: list) -> None:
    """Two pieces that both write rows 0-1 of a 4-row variable pass a row-count check (the PS once
    answered OK, leaving rows 2-3 uninitialised memory). Pieces must tile the destination
    exactly, or INVALID_ARGUMENT, and the variable being restored is left as it was."""
    server, ch = ps
    _checkpoint_file(str(tmp_path))
    create(ch, "dst", np.full((4, 2), -1, np.float32).tobytes(), F32, [4, 2])
    before = ps_variables(ch)
    a = unary(ch, PS + "Restore", _restore(str(tmp_path), "dst", [4, 2], pieces))
    assert a.code == INVALID, f"Restore with pieces {pieces} (they do not tile 4 rows) answered {a}"
    assert ps_variables(ch) == before


def test_restore_of_a_scalar_entry_without_pieces_is_invalid_argument(ps: Any, tmp_path: Any) -> None:
    """Restore of a scalar entry with no pieces is INVALID_ARGUMENT (once INTERNAL: an IndexError)."""
    _, ch = ps
    _checkpoint_file(str(tmp_path))
    before = ps_variables(ch)
    a = unary(ch, PS + "Restore", _restore(str(tmp_path), "scalar", [], []))
    assert a.code == INVALID, f"Restore of a scalar without pieces answered {a}"
    assert ps_variables(ch) == before


def test_restore_with_a_negative_dst_start_is_invalid_argument(ps: Any, tmp_path: Any) -> None:
    """Restore with ``dst_start=-2`` is INVALID_ARGUMENT (once INTERNAL: a numpy broadcast error)."""
    _, ch = ps
    _checkpoint_file(str(tmp_path))
    before = ps_variables(ch)
    a = unary(ch, PS + "Restore", _restore(str(tmp_path), "neg", [4, 2], [(0, 4, -2)]))
    assert a.code == INVALID, f"Restore with dst_start=-2 answered {a}"
    assert ps_variables(ch) == before


# ---------------------------------------------------------------- SetBackup
def test_rejected_set_backup_leaves_the_epoch_unchanged(ps: Any) -> None:
    """``SetBackup(address=<a closed port>, epoch=5)`` fails UNAVAILABLE and changes nothing: it once
    left ``replica_epoch`` at 5, so that a later valid ``SetBackup(epoch=1)`` was refused."""
    server, ch = ps
    before = state_counters(ch)
    with socket.socket() as closed:  # a bound, not listening port: connections are refused
        closed.bind(("127.0.0.1", 0))
        a = unary(ch, PS + "SetBackup", ps_pb2.SetBackupRequest(address=f"127.0.0.1:{closed.getsockname()[1]}", epoch=5), timeout=30)
    assert a.code == UNAVAILABLE, f"SetBackup to a closed port answered {a}"
    problems = []
    if changed := counter_changes(before, state_counters(ch)):
        problems.append(f"the rejected SetBackup changed the PS: {changed}")
    with ParameterServer(credentials=CREDS) as backup:
        a = unary(ch, PS + "SetBackup", ps_pb2.SetBackupRequest(address=backup.address, epoch=1), timeout=30)
        if a.code != OK:
            problems.append(f"a valid SetBackup(epoch=1) after it answered {a}")
        elif ps_counters(ch)["replica_epoch"] != 1.0:
            problems.append(f"replica_epoch is {ps_counters(ch)['replica_epoch']:g} after SetBackup(epoch=1)")
    assert not problems, "; ".join(problems)


@pytest.mark.parametrize("bad", ["garbage-optimizer", "extra-state-leaf", "wrong-state-shape", "empty-name"])
def test_rejected_full_sync_leaves_the_primary_as_it_was(ps: Any, bad: str) -> None:
    """A malformed Replicate full sync is refused INVALID_ARGUMENT and leaves the primary as it was. It
    once made the PS a backup (role and epoch set) before its installs were decoded, so a refused one
    still left the PS a backup refusing every client call (NOT_PRIMARY)."""
    import optax

    from jaxdist.proto.ps_wire import optimizer_payload

    _, ch = ps
    before, variables = state_counters(ch), ps_variables(ch)
    blob, digest = optimizer_payload(optax.adam(0.1))  # state: count, mu [4], nu [4]
    header = ps_pb2.ReplicaHeader(epoch=3, kind=ps_pb2.REPLICA_INSTALL, full_sync=True)
    e = header.installs.add(name="" if bad == "empty-name" else "w", version=1,
                            optimizer=b"\xff not a pickle" if bad == "garbage-optimizer" else blob, optimizer_digest=digest)
    e.value.dtype = F32
    e.value.shape.extend([4])
    leaves = [(common_pb2.INT32, []), (F32, [4]), (F32, [4])] + ([(F32, [4])] if bad == "extra-state-leaf" else [])
    if bad == "wrong-state-shape":
        leaves[1] = (F32, [2])
    payload = b"\0" * 16
    for dtype, shape in leaves:
        leaf = e.state.add(dtype=dtype)
        leaf.shape.extend(shape)
        payload += b"\0" * (4 * int(np.prod(shape)))
    a = stream_in(ch, PS + "Replicate", [header.SerializeToString(), payload])
    assert a.code == INVALID, f"a malformed full sync ({bad}) answered {a}"
    changed = counter_changes(before, state_counters(ch))
    assert not changed, f"a rejected full sync ({bad}) changed the PS: {changed}"
    assert ps_variables(ch) == variables  # and it still serves clients (a backup refuses pulls)


# ----------------------------------------------------------- typed statuses
@pytest.mark.parametrize("if_exists", [7, -1])
def test_create_with_an_unknown_if_exists_is_invalid_argument(ps: Any, if_exists: int) -> None:
    """A CREATE whose ``if_exists`` is not FAIL/KEEP/REPLACE is INVALID_ARGUMENT (once INTERNAL: a ValueError)."""
    _, ch = ps
    before = ps_variables(ch)
    frames = push_frames([dict(name="x", op=ps_pb2.CREATE, value=(F32, [2]), if_exists=if_exists)], b"\0" * 8)
    a = stream_in(ch, PS + "Push", frames)
    assert a.code == INVALID, f"CREATE with if_exists={if_exists} answered {a}"
    assert ps_variables(ch) == before


HUGE_EMPTY_SHAPES = [[0, 2**62, 2**62], [2**63 - 1, 0]]


@pytest.mark.parametrize("shape", HUGE_EMPTY_SHAPES, ids=str)
def test_push_of_a_zero_element_shape_with_huge_dims_is_invalid_argument(ps: Any, shape: list[int]) -> None:
    """A pushed value of zero elements but huge dimensions is INVALID_ARGUMENT (once INTERNAL: "array is too big")."""
    _, ch = ps
    before = ps_variables(ch)
    a = stream_in(ch, PS + "Push", push_frames([dict(name="v", op=ps_pb2.ASSIGN, value=(F32, shape))]))
    assert a.code == INVALID, f"Push of a {shape} value answered {a}"
    assert ps_variables(ch) == before


@pytest.mark.parametrize("shape", HUGE_EMPTY_SHAPES, ids=str)
def test_pull_with_zero_element_indices_of_huge_dims_is_invalid_argument(ps: Any, shape: list[int]) -> None:
    """Pull with such indices is INVALID_ARGUMENT (once UNKNOWN on gRPC, "Exception iterating responses":
    any exception other than a jaxdist error while a Pull streams)."""
    _, ch = ps
    req = ps_pb2.PullRequest()
    e = req.entries.add(name="v", has_indices=True)
    e.indices.spec.dtype = I64
    e.indices.spec.shape.extend(shape)
    a = stream_out(ch, PS + "Pull", req)
    assert a.code == INVALID, f"Pull with {shape} indices answered {a}"


@pytest.mark.parametrize("file_name", [".", "..", "a\0b", "x" * 10240], ids=["dot", "dotdot", "nul", "10KB"])
def test_save_with_a_bad_file_name_is_invalid_argument(ps: Any, tmp_path: Any, file_name: str) -> None:
    """Save with file_name ".", "..", a NUL or 10 KB is INVALID_ARGUMENT (once INTERNAL); nothing is written."""
    _, ch = ps
    directory = tmp_path / "ckpt"
    a = unary(ch, PS + "Save", ps_pb2.SaveRequest(directory=str(directory), file_name=file_name))
    assert a.code == INVALID, f"Save with file_name {file_name[:12]!r} answered {a}"
    assert not directory.exists() or not os.listdir(directory), f"files left behind: {os.listdir(directory)}"


def test_save_into_a_directory_that_is_a_file_is_invalid_argument(ps: Any, tmp_path: Any) -> None:
    """Save with a ``directory`` that is a file is INVALID_ARGUMENT (once INTERNAL: a FileExistsError)."""
    _, ch = ps
    afile = tmp_path / "afile"
    afile.write_bytes(b"not a directory")
    a = unary(ch, PS + "Save", ps_pb2.SaveRequest(directory=str(afile), file_name="ps-0.npz"))
    assert a.code == INVALID, f"Save into a file answered {a}"
    assert afile.read_bytes() == b"not a directory"


@pytest.mark.parametrize("case", ["unknown-variable", "wrong-shape", "wrong-dtype"])
def test_rejected_pushes_are_not_counted(ps: Any, case: str) -> None:
    """Rejected pushes are not counted in ``pushes`` / ``bytes_pushed`` (GetStatus, metrics), as they once were."""
    _, ch = ps
    entry = {"unknown-variable": dict(name="nope", op=ps_pb2.ASSIGN, value=(F32, [4])),
             "wrong-shape": dict(name="v", op=ps_pb2.ASSIGN, value=(F32, [2, 2])),
             "wrong-dtype": dict(name="v", op=ps_pb2.ASSIGN, value=(common_pb2.INT32, [4]))}[case]
    before = state_counters(ch)
    a = stream_in(ch, PS + "Push", push_frames([entry], b"\1" * 16))
    assert a.code == (NOT_FOUND if case == "unknown-variable" else INVALID), a
    changed = counter_changes(before, state_counters(ch))
    assert not changed, f"a rejected push ({case}) changed the counters: {changed}"


# ------------------------------------------------------------ worker Configure
@pytest.fixture
def worker() -> Iterator[tuple[WorkerServer, grpc.Channel]]:
    """A configured worker (in this process) and a raw channel to it."""
    with WorkerServer(credentials=CREDS) as w:
        ch = channel(w.address)
        a = unary(ch, WORKER + "Configure", worker_pb2.ConfigureRequest(cluster_json='{"ps": []}', worker_index=0,
                                                                        num_workers=1, coordinator_id="hostile"))
        assert a.code == OK, a
        yield w, ch
        ch.close()


DEEP = '{"ps": ' + "[" * 100_000 + "]" * 100_000 + "}"


@pytest.mark.parametrize("cluster_json", ['{"ps": [1]}', '{"ps": [null]}', '{"ps": [["h:1"]]}', DEEP],
                         ids=["int", "null", "nested-list", "deeply-nested"])
def test_configure_with_a_malformed_cluster_is_invalid_argument(worker: Any, cluster_json: str) -> None:
    """Worker Configure with ``{"ps": [1]}``, ``[null]``, ``[["h:1"]]`` or deeply nested JSON is
    INVALID_ARGUMENT (once INTERNAL, a RecursionError for the last); the worker keeps its
    configuration and keeps serving."""
    w, ch = worker
    hb = unary(ch, WORKER + "Heartbeat", common_pb2.Empty())
    a = unary(ch, WORKER + "Configure", worker_pb2.ConfigureRequest(cluster_json=cluster_json, worker_index=0,
                                                                    num_workers=1, coordinator_id="hostile"))
    assert a.code == INVALID, f"Configure with cluster_json {cluster_json[:24]!r} answered {a}"
    after = unary(ch, WORKER + "Heartbeat", common_pb2.Empty())
    assert after.code == OK, after
    assert common_pb2.TaskStatus.FromString(after.response).incarnation == common_pb2.TaskStatus.FromString(hb.response).incarnation


# ------------------------------------------------------------ RegisterWorker
@pytest.fixture
def coordinator(ps_server: ParameterServer) -> Iterator[tuple[Any, grpc.Channel, str]]:
    """A ClusterCoordinator (one PS, one worker, in this process) serving registration; a raw channel
    to its registration service, and that service's address."""
    import jaxdist

    with WorkerServer(credentials=CREDS) as w:
        resolver = jaxdist.SimpleClusterResolver({"ps": [ps_server.address], "worker": [w.address]}, token=TOKEN)
        strategy = jaxdist.ParameterServerStrategy(resolver)
        coord = jaxdist.ClusterCoordinator(strategy)
        try:
            address = coord.serve_registration()
            ch = channel(address)
            poll_for(lambda: coord.status()[0]["healthy"], 30, what="the worker to be configured")
            yield coord, ch, address
            ch.close()
        finally:
            coord.shutdown(exit_tasks=False)
            strategy.close()


def _threads() -> int:
    """Threads of this process, less the gRPC servers' pool threads: a pool starts its threads as
    calls come (at most ``max_workers`` each), which is no thread kept for a registration."""
    return sum(not t.name.startswith("jaxdist-rpc") for t in threading.enumerate())


BAD_ADDRESSES = {
    "empty": "",
    "nul": "127.0.0.1:\0",
    "10KB": "h" * 10240,
    "unix": "unix:/tmp/jaxdist-hostile.sock",
    "own": None,  # the coordinator's own registration address
    "no-port": "127.0.0.1",
    "port-out-of-range": "127.0.0.1:99999",
}


@pytest.mark.parametrize("kind", list(BAD_ADDRESSES))
def test_register_worker_refuses_addresses_that_are_not_a_worker(coordinator: Any, kind: str) -> None:
    """RegisterWorker refuses (INVALID_ARGUMENT) an address that is not a worker's (empty, NUL, 10 KB,
    ``unix:``, the coordinator's own), adding no worker and no thread: it once accepted any address
    and started threads retrying it until it was deregistered."""
    coord, ch, own = coordinator
    address = BAD_ADDRESSES[kind]
    if address is None:
        address = own
    workers, threads = coord.num_workers, _threads()
    a = unary(ch, COORDINATOR + "RegisterWorker", coordinator_pb2.RegisterWorkerRequest(address=address))
    assert a.code == INVALID, f"RegisterWorker({address[:24]!r}) answered {a}"
    assert coord.num_workers == workers
    assert _threads() <= threads


def test_registrations_of_unreachable_workers_are_capped(coordinator: Any) -> None:
    """Registrations of unreachable workers are capped (each once kept ~3 threads retrying its address
    until deregistered, without a cap): 100 registrations of addresses where nothing listens must not cost the coordinator more than
    64 threads (a cap on pending registrations, or no threads for a worker that never answered);
    every registration is answered OK or with a typed refusal."""
    coord, ch, _ = coordinator
    ports = []
    try:
        for _ in range(100):  # bound, never listening: connections to them are refused
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            ports.append(s)
        threads = _threads()
        answers = [unary(ch, COORDINATOR + "RegisterWorker",
                         coordinator_pb2.RegisterWorkerRequest(address=f"127.0.0.1:{s.getsockname()[1]}"), timeout=30)
                   for s in ports]
        odd = [str(a) for a in answers if a.code not in (OK, EXHAUSTED, PRECONDITION, INVALID)]
        assert not odd, f"untyped answers to RegisterWorker: {odd[:5]}"
        accepted = sum(a.code == OK for a in answers)
        extra = _threads() - threads
        assert extra <= 64, (f"{accepted} of 100 registrations of unreachable addresses accepted; the coordinator "
                             f"now runs {extra} more threads ({coord.num_workers} workers)")
    finally:
        for s in ports:
            s.close()


@pytest.mark.parametrize("address", ["127.0.0.1:1", "no-such-host.invalid:5000"], ids=["nothing-listens", "unresolvable"])
def test_register_worker_at_an_unreachable_address_is_a_typed_non_retryable_refusal(coordinator: Any, address: str) -> None:
    """RegisterWorker at an address nobody listens on, or whose host does not resolve, answered
    UNAVAILABLE: the status every gRPC client reads as "the server is down, retry". It is a refusal
    of this request: FAILED_PRECONDITION with its own reason, naming the address, and nothing joins."""
    coord, ch, own = coordinator
    workers, threads = coord.num_workers, _threads()
    a = unary(ch, COORDINATOR + "RegisterWorker", coordinator_pb2.RegisterWorkerRequest(address=address), timeout=60)
    assert (a.code, a.reason) == (PRECONDITION, "WORKER_ADDRESS_UNREACHABLE"), f"RegisterWorker({address}) answered {a}"
    assert address in a.details and "--advertise-address" in a.details, a.details
    assert coord.num_workers == workers
    assert _threads() <= threads
    # The worker's own client raises the typed error, which is a configuration error, never "unavailable".
    from jaxdist.worker.coordinator_client import CoordinatorClient

    with CoordinatorClient(own, CREDS) as client:
        with pytest.raises(E.UnreachableWorkerAddressError, match=address.replace(".", r"\.")) as info:
            client.register(address, timeout=60)
    assert isinstance(info.value, E.ConfigurationError) and not isinstance(info.value, E.TaskUnavailableError)
    assert coord.num_workers == workers


# --------------------------------------------------------------- found while fuzzing
@pytest.mark.parametrize("bad", ["uncached-optimizer", "garbage-optimizer", "empty-name"])
def test_create_batch_with_a_bad_entry_creates_nothing(ps: Any, bad: str) -> None:
    """Found by the fuzz test: a CREATE push whose second entry is rejected has already created its
    first entry (entries are created one by one), although a rejected request must change nothing."""
    _, ch = ps
    before = ps_variables(ch)
    second = {"uncached-optimizer": dict(name="b", optimizer_digest="ab" * 32),
              "garbage-optimizer": dict(name="b", optimizer=b"\xff not a pickle"),
              "empty-name": dict(name="")}[bad]
    frames = push_frames([dict(name="a", op=ps_pb2.CREATE, value=(F32, [2])),
                          dict(op=ps_pb2.CREATE, value=(F32, [2]), **second)], b"\0" * 16)
    a = stream_in(ch, PS + "Push", frames)
    assert a.code == INVALID, a
    after = ps_variables(ch)
    assert after == before, f"a rejected CREATE batch created {sorted(set(after) - set(before))}"


@pytest.mark.parametrize("method", ["Pull", "Push", "DeleteVariables"])
def test_typed_status_survives_a_long_unknown_name(ps: Any, method: str) -> None:
    """Found by the fuzz test: error details echo the request's names; over gRPC's 16 KB metadata
    limit the client gets RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") instead
    of NOT_FOUND (randomly so between 8 and 16 KB), and loses the jaxdist reason."""
    _, ch = ps
    long_name = "n" * 20_000
    if method == "Pull":
        a = stream_out(ch, PS + "Pull", ps_pb2.PullRequest(entries=[ps_pb2.PullEntry(name=long_name)]))
    elif method == "Push":
        a = stream_in(ch, PS + "Push", push_frames([dict(name=long_name, op=ps_pb2.ASSIGN, value=(F32, [4]))], b"\0" * 16))
    else:
        a = unary(ch, PS + "DeleteVariables", ps_pb2.DeleteVariablesRequest(names=[long_name]))
    assert (a.code, a.reason) == (NOT_FOUND, "VARIABLE_NOT_FOUND"), f"{method} of an unknown 20 KB name answered {a}"


def test_rejected_run_closures_are_not_counted(worker: Any) -> None:
    """Found by the fuzz test: a RunClosures rejected INVALID_ARGUMENT (function digest not matching
    its payload) is counted in the worker's ``bytes_in`` / ``bytes_out``."""
    w, ch = worker
    incarnation = common_pb2.TaskStatus.FromString(unary(ch, WORKER + "Heartbeat", common_pb2.Empty()).response).incarnation
    before = dict(common_pb2.TaskStatus.FromString(unary(ch, WORKER + "Heartbeat", common_pb2.Empty()).response).counters)
    run = worker_pb2.RunRequest(incarnation=incarnation, calls=[worker_pb2.ClosureCall(closure_id=1, fn_digest="00" * 32, fn_payload=b"x" * 1000)])
    a = unary(ch, WORKER + "RunClosures", run)
    assert a.code == INVALID, a
    after = dict(common_pb2.TaskStatus.FromString(unary(ch, WORKER + "Heartbeat", common_pb2.Empty()).response).counters)
    changed = counter_changes(before, after)
    assert not changed, f"a rejected RunClosures changed the worker's counters: {changed}"
