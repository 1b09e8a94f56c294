"""Seeded fuzz of every jaxdist service: thousands of malformed requests per
service, each with the exact status class its mutation kind must get, then the server must be
alive and its state unchanged.

Services: the PS over gRPC, the PS data plane over raw TCP, the worker over gRPC, and the
coordinator's registration service (``coordinator.serve_registration()``). The servers are real
gRPC / TCP servers on 127.0.0.1 port 0 in this process; requests are raw bytes and the generated
messages of ``jaxdist.proto.*_pb2`` (the data-plane framing is in ``hostile_util``).

Each service has a table ``kind -> expected status`` (below, with why); a case is generated per
kind in turn from one seeded ``random.Random``, so a run is reproducible. Every answer is
tallied; the test fails listing each kind that got anything but its expected status (never
INTERNAL, never UNKNOWN), then checks that the server answers health checks and that its state
(variables, versions, GetStatus counters; the worker's incarnation and counters; the
coordinator's workers) is what it was before the first case.

Long strings in the cases are 17-60 KB, past gRPC's hard 16 KB limit on status details, so that
an error that echoes them fails the same way every run (between 8 and 16 KB gRPC drops them at random).

Runtime: about 10 s for the four services (13,000 requests) on the 2-core development machine.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import socket
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import grpc
import numpy as np
import optax
import pytest
from conftest import CREDS, TOKEN, poll_for
from hostile_util import (
    ATTACH,
    COORDINATOR,
    DP_PULL,
    DP_PUSH,
    DP_SHM_ATTACH,
    HELLO,
    HELLO_MAGIC,
    MD,
    OK,
    PS,
    REQUEST,
    REQUEST_MAGIC,
    WORKER,
    WRONG_MD,
    Answer,
    channel,
    counter_changes,
    dp_connect,
    dp_read,
    dp_request,
    health_check,
    hello_bytes,
    ps_variables,
    push_frames,
    spec,
    state_counters,
    stream_in,
    stream_out,
    unary,
)

from jaxdist.proto import common_pb2, coordinator_pb2, ps_pb2, worker_pb2
from jaxdist.ps_server.server import ParameterServer
from jaxdist.worker.server import WorkerServer

pytestmark = pytest.mark.timeout(180)

SEED = 19
S = grpc.StatusCode
INVALID, NOT_FOUND, EXHAUSTED = S.INVALID_ARGUMENT, S.NOT_FOUND, S.RESOURCE_EXHAUSTED
PRECONDITION, UNAUTH, EXISTS, UNIMPLEMENTED = S.FAILED_PRECONDITION, S.UNAUTHENTICATED, S.ALREADY_EXISTS, S.UNIMPLEMENTED

F32, F64, BF16, I32, I64 = common_pb2.FLOAT32, common_pb2.FLOAT64, common_pb2.BFLOAT16, common_pb2.INT32, common_pb2.INT64
ITEMSIZE = {F32: 4, F64: 8, BF16: 2, I32: 4, I64: 8}
#: Limits of the fuzzed PS (small, so oversized cases are cheap).
MAX_VARIABLE_BYTES = 1 << 20
MAX_MESSAGE_BYTES = 64 << 10


# --------------------------------------------------------------------------- common
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def garbage(rng: random.Random) -> bytes:
    """Bytes that are not a protobuf message of any type (checked for every request type we use):
    an invalid wire type, a length past the end, or an unterminated varint."""
    tail = rng.randbytes(rng.randrange(0, 48))
    field_no = rng.randrange(1, 16)
    k = rng.randrange(3)
    if k == 0:
        return bytes([(field_no << 3) | rng.choice((6, 7))]) + tail
    if k == 1:
        return bytes([(field_no << 3) | 2]) + _varint(len(tail) + rng.randrange(1, 1000)) + tail
    return bytes([field_no << 3]) + b"\xff" * rng.randrange(1, 9)


def bad_utf8(rng: random.Random) -> bytes:
    return rng.choice([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xe2\x82", b"\x80abc"])


def name(rng: random.Random, prefix: str = "nope") -> str:
    return f"{prefix}-{rng.getrandbits(48):012x}"


def zeros(dtype: int, shape: list[int]) -> bytes:
    return b"\0" * (ITEMSIZE[dtype] * int(np.prod(shape, dtype=np.int64)))


@dataclass
class Req:
    """One gRPC request: ``style`` unary / in (client stream) / out (server stream)."""

    style: str
    path: str
    body: Any
    md: Any = MD


def send(ch: grpc.Channel, r: Req) -> Answer:
    if r.style == "in":
        return stream_in(ch, r.path, r.body, md=r.md)
    if r.style == "out":
        return stream_out(ch, r.path, r.body, md=r.md)
    return unary(ch, r.path, r.body, md=r.md)


@dataclass
class Tally:
    """Answers per mutation kind, against the kind's expected status."""

    expected: dict[str, Any]
    seen: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    example: dict[tuple[str, str], str] = field(default_factory=dict)
    cases: int = 0

    def record(self, kind: str, got: str, detail: str) -> None:
        self.cases += 1
        self.seen[kind][got] += 1
        self.example.setdefault((kind, got), detail[:200])

    def wrong(self) -> list[str]:
        out = []
        for kind, exp in self.expected.items():
            want = exp.name if hasattr(exp, "name") else str(exp)
            bad = {g: n for g, n in self.seen[kind].items() if g != want}
            if bad:
                got = ", ".join(f"{g} x{n}" for g, n in sorted(bad.items()))
                out.append(f"  {kind}: expected {want}, got {got} (of {sum(self.seen[kind].values())}); "
                           f"e.g. {self.example[(kind, next(iter(sorted(bad))))]}")
        return out


def run_cases(tally: Tally, n: int, rng: random.Random, make: dict[str, Callable[[random.Random], Any]],
              execute: Callable[[str, Any], tuple[str, str]], caps: dict[str, int] | None = None) -> None:
    """``n`` cases, the kinds in turn, each made by ``make[kind](rng)``; a kind in ``caps`` runs at
    most that many times (slow ones)."""
    assert set(make) == set(tally.expected), "every kind needs an expected status and a generator"
    caps = caps or {}
    done: Counter = Counter()
    kinds = list(make)
    i = 0
    while sum(done.values()) < n:
        kind = kinds[i % len(kinds)]
        i += 1
        if done[kind] >= caps.get(kind, n):
            continue
        done[kind] += 1
        got, detail = execute(kind, make[kind](rng))
        tally.record(kind, got, detail)


def report(service: str, tally: Tally, started: float, after: list[str]) -> None:
    wrong = tally.wrong()
    took = time.monotonic() - started
    msg = [f"{service}: {tally.cases} malformed requests in {took:.1f}s; {len(wrong)} of {len(tally.expected)} kinds got the wrong status"]
    msg += wrong
    if after:
        msg.append("  afterwards: " + "; ".join(after))
    assert not wrong and not after, "\n".join(msg)


# ============================================================================ PS gRPC
#: PS over gRPC: mutation kind -> the status it must get.
PS_EXPECTED: dict[str, grpc.StatusCode] = {
    # authentication first, whatever the body (README: wrong token UNAUTHENTICATED, nothing happens)
    "no_token": UNAUTH,
    "wrong_token": UNAUTH,
    # bytes that are no message of the method's type (README: garbage bytes INVALID_ARGUMENT)
    "garbage_unary": INVALID,
    "garbage_pull": INVALID,
    "garbage_push_header": INVALID,
    "garbage_replicate_header": INVALID,
    "invalid_utf8_string": INVALID,
    "unknown_method": UNIMPLEMENTED,
    "oversized_message": EXHAUSTED,             # over the server's message limit (~0.1 s each: a few only)
    # Push: malformed or mismatched updates (README: unknown variable NOT_FOUND, shape/dtype INVALID_ARGUMENT,
    # oversized RESOURCE_EXHAUSTED, truncated stream INVALID_ARGUMENT)
    "push_empty_stream": INVALID,
    "push_no_entries": INVALID,
    "push_unknown_variable": NOT_FOUND,
    "push_wrong_shape": INVALID,
    "push_wrong_dtype": INVALID,
    "push_unknown_dtype": INVALID,
    "push_negative_dim": INVALID,
    "push_rank_over_limit": INVALID,
    "push_oversized_spec": EXHAUSTED,
    "push_zero_size_huge_dims": INVALID,        # once INTERNAL
    "push_truncated_payload": INVALID,
    "push_overlong_payload": INVALID,
    "push_unknown_op": INVALID,
    "push_without_value": INVALID,
    "push_scatter_without_indices": INVALID,
    "push_scatter_bad_indices": INVALID,
    "push_gradient_without_optimizer": INVALID,
    "push_create_mixed_with_update": INVALID,
    # CREATE
    "create_unknown_if_exists": INVALID,        # once INTERNAL
    "create_existing": EXISTS,                  # if_exists=FAIL on a taken name
    "create_empty_name": INVALID,
    "create_garbage_optimizer": INVALID,
    "create_optimizer_digest_mismatch": INVALID,
    "create_uncached_optimizer_digest": INVALID,
    "create_garbage_initializer": INVALID,
    "create_from_nothing": INVALID,
    "create_oversized": EXHAUSTED,
    "create_batch_with_a_bad_entry": INVALID,   # and nothing of the batch is created
    # Pull
    "pull_unknown_variable": NOT_FOUND,
    # found while fuzzing: the status details echo the name, and details over gRPC's 16 KB metadata limit
    # reach the client as RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") instead
    "unknown_variable_long_name": NOT_FOUND,
    "pull_bad_indices": INVALID,
    "pull_bad_as_dtype": INVALID,
    "pull_zero_size_huge_indices": INVALID,     # once UNKNOWN
    # DeleteVariables: all or nothing
    "delete_unknown_variable": NOT_FOUND,
    # Save
    "save_missing_fields": INVALID,
    "save_file_name_with_slash": INVALID,
    "save_bad_file_name": INVALID,              # ".", "..", NUL, 20 KB: once INTERNAL
    "save_directory_is_a_file": INVALID,        # once INTERNAL
    # Restore (a real checkpoint file f.npz with param/src float32 [4, 2]; target "r" float32 [4, 2])
    "restore_missing_directory": INVALID,
    "restore_bad_file": INVALID,
    "restore_missing_source": INVALID,
    "restore_piece_out_of_range": INVALID,
    "restore_pieces_do_not_tile": INVALID,      # once OK, with uninitialised rows
    "restore_negative_dst": INVALID,            # once INTERNAL
    "restore_scalar_without_pieces": INVALID,   # once INTERNAL
    "restore_wrong_trailing_shape": INVALID,
    "restore_bad_spec": INVALID,
    "restore_oversized": EXHAUSTED,
    "restore_garbage_optimizer": INVALID,
    # replication control, out of turn (STALE_EPOCH is FAILED_PRECONDITION)
    "set_backup_stale_epoch": PRECONDITION,
    "promote_stale_epoch": PRECONDITION,
    "replicate_before_full_sync": PRECONDITION,
    "replicate_empty_stream": INVALID,
    "replicate_bad_specs": INVALID,
    # found while fixing SetBackup: a malformed full sync made the PS a backup before it was refused
    "replicate_malformed_full_sync": INVALID,
}

PS_UNARY = ["ListVariables", "DeleteVariables", "GetStatus", "Save", "Restore", "Shutdown", "SetBackup", "Promote",
            "CreateDynamicTable", "DynamicLookup", "DynamicPush"]
PS_ALL = PS_UNARY + ["Pull", "Push", "Replicate"]


def _ps_any(method: str, body: bytes, md: Any) -> Req:
    if method in ("Push", "Replicate"):
        return Req("in", PS + method, [body], md)
    if method == "Pull":
        return Req("out", PS + method, body, md)
    return Req("unary", PS + method, body, md)


def _wrong_md(rng: random.Random) -> Any:
    return rng.choice([WRONG_MD, (("authorization", f"Bearer {name(rng, 't')}"),), (("authorization", TOKEN),),
                       (("authorization", f"Basic {TOKEN}"),), (("authorization", f"bearer {TOKEN}"),),
                       (("authorization", "Bearer"),), (("x-token", TOKEN),)])


def _push(entries: list[dict[str, Any]], payload: bytes = b"", uid: str = "") -> Req:
    return Req("in", PS + "Push", push_frames(entries, payload, uid))


def _pull(entry: dict[str, Any], indices: tuple[int, list[int], bytes] | None = None) -> Req:
    req = ps_pb2.PullRequest()
    e = req.entries.add(**entry)
    if indices is not None:
        e.has_indices = True
        spec(indices[0], indices[1], out=e.indices.spec)
        e.indices.data = indices[2]
    return Req("out", PS + "Pull", req)


@dataclass
class PSWorld:
    """The fuzzed PS: variables f (float32 [8, 4], SGD), i (int32 [5]), s (float32 scalar) and
    r (float32 [4, 2], restore target only); a checkpoint file; a directory Save cases aim at."""

    ckpt: str
    saves: str
    afile: str
    opt_blob: bytes
    opt_digest: str


def _restore(w: PSWorld, entry: dict[str, Any], pieces: list[tuple[str, str, int, int, int, str]], directory: str | None = None) -> Req:
    req = ps_pb2.RestoreRequest(directory=w.ckpt if directory is None else directory)
    e = req.entries.add(name=entry.get("name", "r"), optimizer=entry.get("optimizer", b""),
                        optimizer_digest=entry.get("optimizer_digest", ""), with_optimizer_state=entry.get("with_state", False))
    spec(entry.get("dtype", F32), entry.get("shape", [4, 2]), out=e.spec)
    for file, source, start, stop, dst, sha in pieces:
        e.pieces.add(file=file, source=source, src_start=start, src_stop=stop, dst_start=dst, sha256=sha)
    return Req("unary", PS + "Restore", req)


def ps_generators(w: PSWorld) -> dict[str, Callable[[random.Random], Req]]:
    f_shape = [8, 4]
    whole = ("f.npz", "src", 0, 4, 0, "")

    def f_value(rng: random.Random) -> tuple[dict[str, Any], bytes]:
        return dict(name="f", op=rng.choice([ps_pb2.ASSIGN, ps_pb2.ASSIGN_ADD, ps_pb2.ASSIGN_SUB]), value=(F32, f_shape)), zeros(F32, f_shape)

    def wrong_shape(rng: random.Random) -> list[int]:
        while True:
            shape = [rng.randrange(0, 9) for _ in range(rng.randrange(0, 4))]
            if shape != f_shape:
                return shape

    def bad_pull_indices(rng: random.Random) -> Req:
        k = rng.randrange(6)
        if k == 0:
            return _pull(dict(name="f", has_indices=True), (F32, [2], zeros(F32, [2])))
        if k == 1:
            return _pull(dict(name="f"), (I64, [2, 1], zeros(I64, [2, 1])))
        if k == 2:
            bad = rng.choice([8, 9, 2**40, -1, -(2**40)])
            return _pull(dict(name="f"), (I64, [1], np.asarray([bad], np.int64).tobytes()))
        if k == 3:
            return _pull(dict(name="f"), (I64, [3], zeros(I64, [2])))
        if k == 4:
            return _pull(dict(name="s"), (I64, [1], zeros(I64, [1])))
        return _pull(dict(name="f"), (rng.choice([0, 14, 99]), [1], zeros(I64, [1])))

    def scatter_bad_indices(rng: random.Random) -> Req:
        k = rng.randrange(3)
        if k == 0:
            bad = rng.choice([8, 100, -1])
            return _push([dict(name="f", op=ps_pb2.SCATTER_ADD, value=(F32, [1, 4]), indices=(I64, [1]))],
                         zeros(F32, [1, 4]) + np.asarray([bad], np.int64).tobytes())
        if k == 1:
            return _push([dict(name="f", op=ps_pb2.SCATTER_UPDATE, value=(F32, [1, 4]), indices=(F32, [1]))],
                         zeros(F32, [1, 4]) + zeros(F32, [1]))
        return _push([dict(name="f", op=ps_pb2.SCATTER_MAX, value=(F32, [2, 4]), indices=(I64, [2, 1]))],
                     zeros(F32, [2, 4]) + zeros(I64, [2, 1]))

    def create(rng: random.Random, **kw: Any) -> dict[str, Any]:
        entry = dict(name=name(rng, "fz-new"), op=ps_pb2.CREATE, value=(F32, [2]))
        entry.update(kw)
        return entry

    def bad_create_entry(rng: random.Random) -> dict[str, Any]:
        return rng.choice([
            create(rng, if_exists=rng.choice([3, 7, -1])),
            create(rng, optimizer=b"\xff" + rng.randbytes(8)),
            create(rng, optimizer_digest=rng.randbytes(32).hex()),
            create(rng, name=""),
        ])

    def malformed_full_sync(rng: random.Random) -> Req:
        header = ps_pb2.ReplicaHeader(epoch=rng.randrange(0, 100), kind=ps_pb2.REPLICA_INSTALL, full_sync=True)
        k = rng.randrange(3)
        e = header.installs.add(name="" if k == 0 else name(rng, "fz-sync"), version=1,
                                optimizer=b"\xff" + rng.randbytes(8) if k == 1 else w.opt_blob,
                                optimizer_digest="" if k == 1 else w.opt_digest)
        spec(F32, [2], out=e.value)
        if k == 2:  # a state leaf the optimizer (SGD: no state) does not have
            spec(F32, [2], out=e.state.add())
        return Req("in", PS + "Replicate", [header.SerializeToString(), zeros(F32, [2]) * (2 if k == 2 else 1)])

    return {
        "no_token": lambda rng: _ps_any(rng.choice(PS_ALL), rng.choice([b"", garbage(rng)]), None),
        "wrong_token": lambda rng: _ps_any(rng.choice(PS_ALL), rng.choice([b"", garbage(rng)]), _wrong_md(rng)),
        "garbage_unary": lambda rng: Req("unary", PS + rng.choice(PS_UNARY), garbage(rng)),
        "garbage_pull": lambda rng: Req("out", PS + "Pull", garbage(rng)),
        "garbage_push_header": lambda rng: Req("in", PS + "Push", [garbage(rng)] + [rng.randbytes(16)] * rng.randrange(2)),
        "garbage_replicate_header": lambda rng: Req("in", PS + "Replicate", [garbage(rng)]),
        "invalid_utf8_string": lambda rng: rng.choice([
            Req("unary", PS + rng.choice(["Save", "Restore", "SetBackup", "DeleteVariables", "Shutdown"]), b"\x0a\x01" + b"\xff"),
            Req("unary", PS + "Save", b"\x0a\x01a\x12" + _varint(len(u := bad_utf8(rng))) + u),
            Req("out", PS + "Pull", b"\x0a" + _varint(len(u := bad_utf8(rng)) + 2) + b"\x0a" + _varint(len(u)) + u),
            Req("in", PS + "Push", [b"\x12" + _varint(len(u := bad_utf8(rng))) + u]),
        ]),
        "unknown_method": lambda rng: Req("unary", PS + rng.choice(["Nope", "pull", "PushX", ""]) , b""),
        "oversized_message": lambda rng: Req("unary", PS + rng.choice(["ListVariables", "GetStatus", "Save"]),
                                             b"\x0a" + _varint(MAX_MESSAGE_BYTES) + b"a" * MAX_MESSAGE_BYTES),
        "push_empty_stream": lambda rng: Req("in", PS + "Push", []),
        "push_no_entries": lambda rng: Req("in", PS + "Push", [ps_pb2.PushHeader(update_id=name(rng, "u")).SerializeToString()]),
        "push_unknown_variable": lambda rng: _push([dict(name=name(rng), op=ps_pb2.ASSIGN, value=(F32, [2]))], zeros(F32, [2]),
                                                   rng.choice(["", name(rng, "u")])),
        "push_wrong_shape": lambda rng: _push([dict(name="f", op=ps_pb2.ASSIGN_ADD, value=(F32, s := wrong_shape(rng)))], zeros(F32, s)),
        "push_wrong_dtype": lambda rng: _push([dict(name="f", op=ps_pb2.ASSIGN, value=(d := rng.choice([F64, I32, I64]), f_shape))],
                                              zeros(d, f_shape)),
        "push_unknown_dtype": lambda rng: _push([dict(name="f", op=ps_pb2.ASSIGN, value=(rng.choice([0, 14, 15, 99, 2**31 - 1]), [2]))], b"\0" * 8),
        "push_negative_dim": lambda rng: _push([dict(name="f", op=ps_pb2.ASSIGN, value=(F32, [8, -rng.randrange(1, 2**62)]))]),
        "push_rank_over_limit": lambda rng: _push([dict(name="f", op=ps_pb2.ASSIGN, value=(F32, [1] * rng.randrange(33, 64)))], b"\0" * 4),
        "push_oversized_spec": lambda rng: _push([dict(name="f", op=ps_pb2.ASSIGN,
                                                       value=(F32, rng.choice([[MAX_VARIABLE_BYTES], [2**31, 2**31], [2**40]])))]),
        "push_zero_size_huge_dims": lambda rng: _push([dict(name="f", op=ps_pb2.ASSIGN,
                                                            value=(F32, rng.choice([[0, 2**62, 2**62], [2**63 - 1, 0], [2**40, 0, 2**40]])))]),
        "push_truncated_payload": lambda rng: _push([f_value(rng)[0]], zeros(F32, f_shape)[: rng.randrange(0, 128)]),
        "push_overlong_payload": lambda rng: _push([f_value(rng)[0]], zeros(F32, f_shape) + b"\0" * rng.randrange(1, 64)),
        "push_unknown_op": lambda rng: _push([dict(name="f", op=rng.choice([0, 12, 13, 99]), value=(F32, f_shape))], zeros(F32, f_shape)),
        "push_without_value": lambda rng: _push([dict(name="f", op=rng.choice([ps_pb2.ASSIGN, ps_pb2.APPLY_GRADIENT]))]),
        "push_scatter_without_indices": lambda rng: _push([dict(name="f", op=ps_pb2.SCATTER_ADD, value=(F32, [2, 4]))], zeros(F32, [2, 4])),
        "push_scatter_bad_indices": scatter_bad_indices,
        "push_gradient_without_optimizer": lambda rng: _push([dict(name="i", op=ps_pb2.APPLY_GRADIENT, value=(I32, [5]))], zeros(I32, [5])),
        "push_create_mixed_with_update": lambda rng: _push([create(rng), f_value(rng)[0]], zeros(F32, [2]) + zeros(F32, f_shape)),
        "create_unknown_if_exists": lambda rng: _push([create(rng, if_exists=rng.choice([3, 7, 100, -1]))], zeros(F32, [2])),
        "create_existing": lambda rng: _push([dict(name=rng.choice(["f", "i", "s"]), op=ps_pb2.CREATE, value=(F32, [2]))], zeros(F32, [2])),
        "create_empty_name": lambda rng: _push([create(rng, name="")], zeros(F32, [2])),
        "create_garbage_optimizer": lambda rng: _push([create(rng, optimizer=b"\xff" + rng.randbytes(rng.randrange(0, 32)))], zeros(F32, [2])),
        "create_optimizer_digest_mismatch": lambda rng: _push([create(rng, optimizer=w.opt_blob, optimizer_digest=rng.randbytes(32).hex())],
                                                              zeros(F32, [2])),
        "create_uncached_optimizer_digest": lambda rng: _push([create(rng, optimizer_digest=rng.randbytes(32).hex())], zeros(F32, [2])),
        "create_garbage_initializer": lambda rng: _push([dict(name=name(rng, "fz-new"), op=ps_pb2.CREATE, create_spec=(F32, [2]),
                                                              initializer=b"\xff" + rng.randbytes(8))]),
        "create_from_nothing": lambda rng: _push([dict(name=name(rng, "fz-new"), op=ps_pb2.CREATE)]),
        "create_oversized": lambda rng: _push([dict(name=name(rng, "fz-new"), op=ps_pb2.CREATE, value=(F32, [MAX_VARIABLE_BYTES]))]),
        "create_batch_with_a_bad_entry": lambda rng: _push([create(rng), bad_create_entry(rng)], zeros(F32, [2]) * 2),
        "pull_unknown_variable": lambda rng: rng.choice([_pull(dict(name=name(rng))),
                                                         Req("out", PS + "Pull", ps_pb2.PullRequest(entries=[ps_pb2.PullEntry(name="f"),
                                                                                                           ps_pb2.PullEntry(name=name(rng))]))]),
        "unknown_variable_long_name": lambda rng: rng.choice([
            _pull(dict(name=name(rng) * rng.randrange(1000, 2400))),
            _push([dict(name=name(rng) * rng.randrange(1000, 2400), op=ps_pb2.ASSIGN, value=(F32, [2]))], zeros(F32, [2])),
            Req("unary", PS + "DeleteVariables", ps_pb2.DeleteVariablesRequest(names=[name(rng) * rng.randrange(1000, 2400)]))]),
        "pull_bad_indices": bad_pull_indices,
        "pull_bad_as_dtype": lambda rng: rng.choice([_pull(dict(name="f", as_dtype=rng.choice([14, 99, -3]))),
                                                     _pull(dict(name="i", as_dtype=BF16)), _pull(dict(name="f", as_dtype=rng.choice([F64, I32])))]),
        "pull_zero_size_huge_indices": lambda rng: _pull(dict(name="f"), (I64, rng.choice([[0, 2**62, 2**62], [2**63 - 1, 0]]), b"")),
        "delete_unknown_variable": lambda rng: Req("unary", PS + "DeleteVariables",
                                                   ps_pb2.DeleteVariablesRequest(names=rng.choice([[name(rng)], ["f", name(rng)], ["s", "i", name(rng)]]))),
        "save_missing_fields": lambda rng: Req("unary", PS + "Save", rng.choice([ps_pb2.SaveRequest(directory=w.saves),
                                                                                 ps_pb2.SaveRequest(file_name="ps-0.npz")])),
        "save_file_name_with_slash": lambda rng: Req("unary", PS + "Save", ps_pb2.SaveRequest(directory=w.saves,
                                                                                              file_name=rng.choice(["a/b", "/etc/x", "../x", "x/"]))),
        "save_bad_file_name": lambda rng: Req("unary", PS + "Save", ps_pb2.SaveRequest(directory=w.saves,
                                                                                       file_name=rng.choice([".", "..", "a\0b", "\0", "x" * 20480]))),
        "save_directory_is_a_file": lambda rng: Req("unary", PS + "Save", ps_pb2.SaveRequest(directory=rng.choice([w.afile, os.path.join(w.afile, "sub")]),
                                                                                             file_name="ps-0.npz")),
        "restore_missing_directory": lambda rng: _restore(w, {}, [whole], directory=os.path.join(w.ckpt, name(rng, "missing"))),
        "restore_bad_file": lambda rng: _restore(w, {}, [rng.choice([("nope.npz", "src", 0, 4, 0, ""), ("../f.npz", "src", 0, 4, 0, ""),
                                                                     ("f.npz", "src", 0, 4, 0, "0" * 64), ("", "src", 0, 4, 0, "")])]),
        "restore_missing_source": lambda rng: _restore(w, {}, [("f.npz", name(rng), 0, 4, 0, "")]),
        "restore_piece_out_of_range": lambda rng: _restore(w, {}, [rng.choice([("f.npz", "src", 0, 5, 0, ""), ("f.npz", "src", 3, 2, 0, ""),
                                                                               ("f.npz", "src", -1, 3, 0, ""), ("f.npz", "src", 0, 4, 1, "")])]),
        "restore_pieces_do_not_tile": lambda rng: _restore(w, {}, rng.choice([
            [("f.npz", "src", 0, 2, 0, ""), ("f.npz", "src", 0, 2, 0, "")],
            [("f.npz", "src", 0, 2, 0, ""), ("f.npz", "src", 0, 2, 1, "")],
            [("f.npz", "src", 1, 3, 0, ""), ("f.npz", "src", 2, 4, 1, "")],
            [("f.npz", "src", 0, 2, 2, ""), ("f.npz", "src", 2, 4, 2, "")]])),
        "restore_negative_dst": lambda rng: _restore(w, {}, [("f.npz", "src", 0, 4, rng.choice([-1, -2, -4, -(2**40)]), "")]),
        "restore_scalar_without_pieces": lambda rng: _restore(w, dict(shape=[]), []),
        "restore_wrong_trailing_shape": lambda rng: _restore(w, dict(shape=[4, rng.choice([1, 3, 5])]), [whole]),
        "restore_bad_spec": lambda rng: _restore(w, rng.choice([dict(dtype=rng.choice([0, 99])), dict(shape=[4, -2])]), [whole]),
        "restore_oversized": lambda rng: _restore(w, dict(shape=[MAX_VARIABLE_BYTES, 2]), [whole]),
        "restore_garbage_optimizer": lambda rng: _restore(w, dict(optimizer=b"\xff" + rng.randbytes(8), with_state=rng.random() < 0.5), [whole]),
        "set_backup_stale_epoch": lambda rng: Req("unary", PS + "SetBackup", ps_pb2.SetBackupRequest(
            address=rng.choice(["", "127.0.0.1:1", name(rng)]), epoch=-rng.randrange(1, 2**62))),
        "promote_stale_epoch": lambda rng: Req("unary", PS + "Promote", ps_pb2.PromoteRequest(epoch=-rng.randrange(0, 2**62))),
        "replicate_before_full_sync": lambda rng: Req("in", PS + "Replicate", rng.choice([
            [ps_pb2.ReplicaHeader(epoch=rng.randrange(0, 100), kind=ps_pb2.REPLICA_DELETE, deletes=["f"]).SerializeToString()],
            [ps_pb2.ReplicaHeader(epoch=rng.randrange(-100, 100), kind=rng.choice([3, 9])).SerializeToString()],
            [ps_pb2.ReplicaHeader(epoch=rng.randrange(0, 100), kind=ps_pb2.REPLICA_UPDATE,
                                  push=ps_pb2.PushHeader.FromString(push_frames([f_value(rng)[0]])[0])).SerializeToString(), zeros(F32, f_shape)],
        ])),
        "replicate_empty_stream": lambda rng: Req("in", PS + "Replicate", []),
        "replicate_malformed_full_sync": malformed_full_sync,
        "replicate_bad_specs": lambda rng: Req("in", PS + "Replicate", [ps_pb2.ReplicaHeader(
            epoch=1, kind=ps_pb2.REPLICA_UPDATE, push=ps_pb2.PushHeader.FromString(
                push_frames([dict(name="f", op=ps_pb2.ASSIGN, value=(F32, [8, -4]))])[0])).SerializeToString()]),
    }


@pytest.fixture
def fuzz_ps(tmp_path: Any) -> Iterator[tuple[ParameterServer, grpc.Channel, PSWorld]]:
    with ParameterServer(credentials=CREDS, max_variable_bytes=MAX_VARIABLE_BYTES, max_message_bytes=MAX_MESSAGE_BYTES) as ps:
        ch = channel(ps.address)
        opt_blob = cloudpickle.dumps(optax.sgd(0.1))
        opt_digest = hashlib.sha256(opt_blob).hexdigest()
        frames = push_frames([dict(name="f", op=ps_pb2.CREATE, value=(F32, [8, 4]), optimizer=opt_blob, optimizer_digest=opt_digest),
                              dict(name="i", op=ps_pb2.CREATE, value=(I32, [5])),
                              dict(name="s", op=ps_pb2.CREATE, value=(F32, [])),
                              dict(name="r", op=ps_pb2.CREATE, value=(F32, [4, 2]))],
                             np.arange(32, dtype=np.float32).tobytes() + np.arange(5, dtype=np.int32).tobytes()
                             + np.float32(7).tobytes() + np.full(8, 3, np.float32).tobytes())
        a = stream_in(ch, PS + "Push", frames)
        assert a.code == OK, a
        ckpt, saves = tmp_path / "ckpt", tmp_path / "saves"
        ckpt.mkdir()
        with open(ckpt / "f.npz", "wb") as f:
            np.savez(f, **{"param/src": np.arange(8, dtype=np.float32).reshape(4, 2)})
        (tmp_path / "afile").write_bytes(b"a file")
        yield ps, ch, PSWorld(str(ckpt), str(saves), str(tmp_path / "afile"), opt_blob, opt_digest)
        ch.close()


def _files_under(path: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs)


def test_fuzz_ps_grpc(fuzz_ps: Any) -> None:
    ps, ch, world = fuzz_ps
    rng = random.Random(SEED)
    counters, variables = state_counters(ch), ps_variables(ch)
    ckpt_files = _files_under(world.ckpt)
    tally = Tally(PS_EXPECTED)
    started = time.monotonic()

    def execute(kind: str, r: Req) -> tuple[str, str]:
        a = send(ch, r)
        return a.code.name, f"{r.path} -> {a}"

    run_cases(tally, 3000, rng, ps_generators(world), execute, caps={"oversized_message": 6})
    after = []
    h = health_check(ch, "jaxdist.ParameterServer", timeout=5)
    if h.code != OK:
        after.append(f"health check {h}")
    else:
        if changed := counter_changes(counters, state_counters(ch)):
            after.append(f"counters changed: {changed}")
        now = ps_variables(ch)
        changed_vars = sorted((n not in variables, n) for n in set(now) | set(variables) if now.get(n) != variables.get(n))
        if changed_vars:
            after.append(f"{len(changed_vars)} variables changed or appeared: " + ", ".join(
                f"{n} (new)" if new else f"{n} (version {variables[n][0]} -> {now[n][0] if n in now else 'deleted'}, values "
                f"{'differ' if n in now and now[n][3] != variables[n][3] else 'same'})" for new, n in changed_vars[:6])
                + (", ..." if len(changed_vars) > 6 else ""))
        if _files_under(world.saves):
            after.append(f"Save left files: {_files_under(world.saves)[:3]}")
        if _files_under(world.ckpt) != ckpt_files:
            after.append("the checkpoint directory changed")
    assert not ps.servicer.shutdown_event.is_set(), "a rejected request shut the PS down"
    report("PS gRPC", tally, started, after)


# ============================================================================ worker
#: Worker over gRPC: mutation kind -> the status it must get.
WORKER_EXPECTED: dict[str, grpc.StatusCode] = {
    "no_token": UNAUTH,                         # valid Shutdown requests included: nothing may happen
    "wrong_token": UNAUTH,
    "garbage": INVALID,
    "invalid_utf8_string": INVALID,
    "unknown_method": UNIMPLEMENTED,
    "configure_not_json": INVALID,
    "configure_not_an_object": INVALID,
    "configure_ps_not_a_list": INVALID,
    "configure_ps_entries_not_strings": INVALID,   # once INTERNAL
    "configure_deeply_nested": INVALID,            # once INTERNAL (RecursionError)
    "run_wrong_incarnation": PRECONDITION,         # WorkerRestartedError
    "run_digest_mismatch": INVALID,
}
WORKER_METHODS = ["Configure", "RunClosures", "Heartbeat", "Shutdown"]


def _configure(cluster_json: str) -> Req:
    return Req("unary", WORKER + "Configure", worker_pb2.ConfigureRequest(cluster_json=cluster_json, worker_index=3, num_workers=5,
                                                                          coordinator_id="fuzz"))


def worker_generators(incarnation: str) -> dict[str, Callable[[random.Random], Req]]:
    def any_request(rng: random.Random, md: Any) -> Req:
        method = rng.choice(WORKER_METHODS)
        body = rng.choice([garbage(rng), b"", common_pb2.ShutdownRequest(reason="fuzz", exit_code=rng.randrange(3)).SerializeToString()])
        return Req("unary", WORKER + method, body, md)

    def nested(rng: random.Random) -> str:
        depth = rng.choice([5_000, 50_000, 200_000])
        kind = rng.choice(["[]", "{}"])
        inner = kind[0] * depth + kind[1] * depth if kind == "[]" else '{"a":' * depth + "1" + "}" * depth
        return rng.choice(['{"ps": ' + inner + "}", inner, '{"ps": [], "x": ' + inner + "}"])

    return {
        "no_token": lambda rng: any_request(rng, None),
        "wrong_token": lambda rng: any_request(rng, _wrong_md(rng)),
        "garbage": lambda rng: Req("unary", WORKER + rng.choice(WORKER_METHODS), garbage(rng)),
        "invalid_utf8_string": lambda rng: rng.choice([
            Req("unary", WORKER + "Configure", b"\x0a" + _varint(len(u := bad_utf8(rng))) + u),
            Req("unary", WORKER + "RunClosures", b"\x12" + _varint(len(u := bad_utf8(rng))) + u),
            Req("unary", WORKER + "Shutdown", b"\x0a" + _varint(len(u := bad_utf8(rng))) + u),
        ]),
        "unknown_method": lambda rng: Req("unary", WORKER + rng.choice(["Nope", "heartbeat", "Run"]), b""),
        "configure_not_json": lambda rng: _configure(rng.choice(["{", "ps", '{"ps": [}', "{'ps': []}", "\0", "[1,]", '{"ps": NaN'])),
        "configure_not_an_object": lambda rng: _configure(rng.choice(["[]", "1", '"ps"', "null", "true", "[{}]"])),
        "configure_ps_not_a_list": lambda rng: _configure(json.dumps({"ps": rng.choice(["h:1", 1, {}, None, True])})),
        "configure_ps_entries_not_strings": lambda rng: _configure(json.dumps({"ps": [rng.choice([1, None, ["h:1"], {}, 1.5, True])]})),
        "configure_deeply_nested": lambda rng: _configure(nested(rng)),
        "run_wrong_incarnation": lambda rng: Req("unary", WORKER + "RunClosures", worker_pb2.RunRequest(incarnation=rng.randbytes(16).hex())),
        "run_digest_mismatch": lambda rng: Req("unary", WORKER + "RunClosures", worker_pb2.RunRequest(
            incarnation=incarnation, calls=[worker_pb2.ClosureCall(closure_id=1, fn_digest=rng.randbytes(32).hex(), fn_payload=rng.randbytes(16))])),
    }


def _worker_index_closure() -> int:
    import jaxdist

    return jaxdist.current_worker_index()


def test_fuzz_worker_grpc() -> None:
    with WorkerServer(credentials=CREDS) as w:
        ch = channel(w.address)
        try:
            a = send(ch, _configure('{"ps": []}'))
            assert a.code == OK, a
            status = common_pb2.TaskStatus.FromString(unary(ch, WORKER + "Heartbeat", common_pb2.Empty()).response)
            rng = random.Random(SEED)
            tally = Tally(WORKER_EXPECTED)
            started = time.monotonic()

            def execute(kind: str, r: Req) -> tuple[str, str]:
                a = send(ch, r)
                return a.code.name, f"{r.path} -> {a}"

            run_cases(tally, 2000, rng, worker_generators(status.incarnation), execute)
            after = []
            hb = unary(ch, WORKER + "Heartbeat", common_pb2.Empty(), timeout=5)
            if hb.code != OK:
                after.append(f"Heartbeat {hb}")
            else:
                now = common_pb2.TaskStatus.FromString(hb.response)
                if now.incarnation != status.incarnation:
                    after.append("the worker restarted")
                if changed := counter_changes(dict(status.counters), dict(now.counters)):
                    after.append(f"counters changed by rejected requests: {changed}")
                # Still configured as before: a closure sees worker index 3.
                payload = cloudpickle.dumps(_worker_index_closure)
                run = worker_pb2.RunRequest(incarnation=status.incarnation, calls=[worker_pb2.ClosureCall(
                    closure_id=7, fn_digest=hashlib.sha256(payload).hexdigest(), fn_payload=payload)])
                got = unary(ch, WORKER + "RunClosures", run)
                result = worker_pb2.RunResponse.FromString(got.response).results[0] if got.code == OK else None
                if result is None or result.status != worker_pb2.CLOSURE_OK or cloudpickle.loads(result.value) != 3:
                    after.append(f"the worker's configuration changed (probe closure: {got} {result})")
            if w.servicer.shutdown_event.is_set():
                after.append("a rejected request shut the worker down")
            report("worker gRPC", tally, started, after)
        finally:
            ch.close()


# ======================================================================= coordinator
#: Coordinator registration service: mutation kind -> the status it must get.
COORDINATOR_EXPECTED: dict[str, grpc.StatusCode] = {
    "no_token": UNAUTH,                          # with real addresses too: nobody joins or leaves
    "wrong_token": UNAUTH,
    "garbage": INVALID,
    "invalid_utf8_address": INVALID,
    "unknown_method": UNIMPLEMENTED,
    "register_malformed_address": INVALID,       # once accepted (OK)
    "deregister_unknown_address": PRECONDITION,  # "no active worker at ..." (a ConfigurationError)
    "deregister_unknown_long_address": PRECONDITION,  # the same with a 17-40 KB address (details echo it)
}


def coordinator_generators(own: str, worker: str) -> dict[str, Callable[[random.Random], Req]]:
    # A fixed pool, so that addresses accepted by mistake stay few (each costs the coordinator threads).
    malformed = ["", "\0", "127.0.0.1:\0", "h" * 20480, "unix:/tmp/jaxdist-fuzz.sock", "unix:", own, "127.0.0.1",
                 "127.0.0.1:99999", "127.0.0.1:-5", "127.0.0.1:http", "127.0.0.1 :80", "[::1", ":", "host:port:1", "\n:1"]

    def any_request(rng: random.Random, md: Any) -> Req:
        body = rng.choice([garbage(rng), coordinator_pb2.RegisterWorkerRequest(address=rng.choice([worker, own, "127.0.0.1:1"])).SerializeToString()])
        return Req("unary", COORDINATOR + rng.choice(["RegisterWorker", "DeregisterWorker"]), body, md)

    return {
        "no_token": lambda rng: any_request(rng, None),
        "wrong_token": lambda rng: any_request(rng, _wrong_md(rng)),
        "garbage": lambda rng: Req("unary", COORDINATOR + rng.choice(["RegisterWorker", "DeregisterWorker"]), garbage(rng)),
        "invalid_utf8_address": lambda rng: Req("unary", COORDINATOR + rng.choice(["RegisterWorker", "DeregisterWorker"]),
                                                b"\x0a" + _varint(len(u := bad_utf8(rng))) + u),
        "unknown_method": lambda rng: Req("unary", COORDINATOR + rng.choice(["Register", "Nope"]), b""),
        "register_malformed_address": lambda rng: Req("unary", COORDINATOR + "RegisterWorker",
                                                      coordinator_pb2.RegisterWorkerRequest(address=rng.choice(malformed))),
        "deregister_unknown_address": lambda rng: Req("unary", COORDINATOR + "DeregisterWorker", coordinator_pb2.RegisterWorkerRequest(
            address=rng.choice([f"127.0.0.1:{rng.randrange(1, 65536)}", name(rng, "unregistered")]))),
        "deregister_unknown_long_address": lambda rng: Req("unary", COORDINATOR + "DeregisterWorker", coordinator_pb2.RegisterWorkerRequest(
            address=name(rng, "unregistered") * rng.randrange(1000, 2400))),
    }


def _threads() -> int:
    """Threads of this process, less the gRPC servers' pool threads (started as calls come, at most
    ``max_workers`` per server: none is kept for a request)."""
    return sum(not t.name.startswith("jaxdist-rpc") for t in threading.enumerate())


def test_fuzz_coordinator_registration(ps_server: ParameterServer) -> None:
    import jaxdist

    with WorkerServer(credentials=CREDS) as w:
        strategy = jaxdist.ParameterServerStrategy(jaxdist.SimpleClusterResolver({"ps": [ps_server.address], "worker": [w.address]}, token=TOKEN))
        coord = jaxdist.ClusterCoordinator(strategy)
        try:
            own = coord.serve_registration()
            ch = channel(own)
            poll_for(lambda: coord.status()[0]["healthy"], 30, what="the worker to be configured")
            workers, active, threads = coord.num_workers, coord.active_workers, _threads()
            rng = random.Random(SEED)
            tally = Tally(COORDINATOR_EXPECTED)
            started = time.monotonic()

            def execute(kind: str, r: Req) -> tuple[str, str]:
                a = send(ch, r)
                return a.code.name, f"{r.path} -> {a}"

            run_cases(tally, 2000, rng, coordinator_generators(own, w.address), execute)
            after = []
            h = health_check(ch, "", timeout=5)
            if h.code != OK:
                after.append(f"health check {h}")
            if (coord.num_workers, coord.active_workers) != (workers, active):
                after.append(f"workers changed: {workers} slots / {active} active -> {coord.num_workers} / {coord.active_workers}")
            if _threads() > threads:
                after.append(f"{_threads() - threads} more threads than before")
            if not coord.status()[0]["healthy"] or coord.status()[0]["left"]:
                after.append("the real worker left or is unhealthy")
            report("coordinator registration", tally, started, after)
            ch.close()
        finally:
            coord.shutdown(exit_tasks=False)
            strategy.close()


# ======================================================================== data plane
SHM_ON = os.path.isdir("/dev/shm") and os.environ.get("JAXDIST_SHM", "1").strip().lower() not in ("0", "false", "no", "off")
#: Data plane (raw TCP): mutation kind -> (status of the response envelope, what the server then does
#: with the connection). "close": the framing can no longer be trusted (docstring of jaxdist.transport.dataplane);
#: "stay": the payload is drained and the connection serves the next call (checked with a real Pull).
DP_EXPECTED: dict[str, tuple[grpc.StatusCode, str]] = {
    # before or instead of the hello
    "hello_bad_magic": (INVALID, "close"),
    "hello_token_too_long": (INVALID, "close"),
    "hello_wrong_token": (UNAUTH, "close"),
    "hello_empty_token": (UNAUTH, "close"),
    # framing broken after the hello
    "bad_request_magic": (INVALID, "close"),
    "unknown_method": (INVALID, "close"),
    "header_too_large": (INVALID, "close"),
    "shm_attach_malformed_framing": (INVALID, "close"),
    "impossible_payload_length": (EXHAUSTED, "close"),        # once no status (OverflowError)
    # well framed, bad content: typed error, the connection stays usable
    "garbage_header": (INVALID, "stay"),
    "push_unknown_variable": (NOT_FOUND, "stay"),
    "push_payload_size_mismatch": (INVALID, "stay"),
    "push_wrong_shape": (INVALID, "stay"),
    "push_wrong_dtype": (INVALID, "stay"),
    "push_bad_spec": (INVALID, "stay"),
    "push_oversized_spec": (EXHAUSTED, "stay"),
    "push_zero_size_huge_dims": (INVALID, "stay"),           # once INTERNAL
    "push_unknown_op": (INVALID, "stay"),
    "push_scatter_bad_indices": (INVALID, "stay"),
    "create_unknown_if_exists": (INVALID, "stay"),           # once INTERNAL
    "create_existing": (EXISTS, "stay"),
    "pull_unknown_variable": (NOT_FOUND, "stay"),
    "pull_with_payload": (INVALID, "stay"),
    "pull_bad_indices": (INVALID, "stay"),
    "pull_zero_size_huge_indices": (INVALID, "stay"),        # once INTERNAL
    "shm_attach_short_header": (INVALID if SHM_ON else PRECONDITION, "stay"),
    "shm_attach_bad_name": (INVALID if SHM_ON else PRECONDITION, "stay"),
    "shm_attach_bad_slot_size": (INVALID if SHM_ON else PRECONDITION, "stay"),
    "shm_attach_no_such_region": (PRECONDITION, "stay"),
    "shm_attach_not_a_sealed_region": (PRECONDITION, "stay"),
}


@dataclass
class DPCase:
    data: bytes
    pre_hello: bool = False


def _dp_push(entries: list[dict[str, Any]], payload: bytes = b"", payload_len: int | None = None) -> DPCase:
    return DPCase(dp_request(DP_PUSH, push_frames(entries)[0], payload, payload_len))


def _dp_pull(entry: dict[str, Any], indices: tuple[int, list[int], bytes] | None = None, payload: bytes = b"") -> DPCase:
    r = _pull(entry, indices)
    return DPCase(dp_request(DP_PULL, r.body.SerializeToString(), payload))


def dp_generators() -> dict[str, Callable[[random.Random], DPCase]]:
    f_shape = [8, 4]

    def attach(rng: random.Random, slot: int, region: str, short: bool = False) -> DPCase:
        header = ATTACH.pack(slot, rng.randbytes(16))[: rng.randrange(0, ATTACH.size)] if short else ATTACH.pack(slot, rng.randbytes(16)) + region.encode()
        return DPCase(dp_request(DP_SHM_ATTACH, header))

    return {
        "hello_bad_magic": lambda rng: DPCase(HELLO.pack(rng.choice([b"JXB2", b"JXRQ", b"\0\0\0\0", b"GET "]), 0), True),
        "hello_token_too_long": lambda rng: DPCase(HELLO.pack(HELLO_MAGIC, rng.choice([4097, 1 << 20, 2**32 - 1])), True),
        "hello_wrong_token": lambda rng: DPCase(hello_bytes(rng.choice([TOKEN + "x", TOKEN[:-1], name(rng), TOKEN.upper()])), True),
        "hello_empty_token": lambda rng: DPCase(hello_bytes(b""), True),
        "bad_request_magic": lambda rng: DPCase(REQUEST.pack(rng.choice([b"JXRS", b"JXB1", b"\0\0\0\0"]), DP_PULL, 0, 0)),
        # Method ids the data plane does not serve (1-4: Pull, Push, ShmAttach, PushPull).
        "unknown_method": lambda rng: DPCase(REQUEST.pack(REQUEST_MAGIC, rng.choice([0, 5, 6, 127, 255]), 0, 0)),
        "header_too_large": lambda rng: DPCase(REQUEST.pack(REQUEST_MAGIC, rng.choice([DP_PULL, DP_PUSH]), rng.choice([(64 << 20) + 1, 2**32 - 1]), 0)),
        "shm_attach_malformed_framing": lambda rng: DPCase(REQUEST.pack(REQUEST_MAGIC, DP_SHM_ATTACH, rng.choice([4097, 1 << 20]),
                                                                       rng.choice([0, 1]))),
        "impossible_payload_length": lambda rng: _dp_push([dict(name="f", op=ps_pb2.ASSIGN, value=(F32, f_shape))],
                                                          payload_len=rng.choice([2**63, 2**63 + 7, 2**64 - 1])),
        "garbage_header": lambda rng: DPCase(dp_request(rng.choice([DP_PULL, DP_PUSH]), garbage(rng), rng.randbytes(rng.randrange(0, 64)))),
        "push_unknown_variable": lambda rng: _dp_push([dict(name=name(rng), op=ps_pb2.ASSIGN, value=(F32, [2]))], zeros(F32, [2])),
        "push_payload_size_mismatch": lambda rng: _dp_push([dict(name="f", op=ps_pb2.ASSIGN, value=(F32, f_shape))],
                                                           zeros(F32, f_shape)[: rng.randrange(0, 128)] if rng.random() < 0.5
                                                           else zeros(F32, f_shape) + b"\0" * rng.randrange(1, 200)),
        "push_wrong_shape": lambda rng: _dp_push([dict(name="f", op=ps_pb2.ASSIGN, value=(F32, [4, 8]))], zeros(F32, [4, 8])),
        "push_wrong_dtype": lambda rng: _dp_push([dict(name="f", op=ps_pb2.ASSIGN, value=(I32, f_shape))], zeros(I32, f_shape)),
        "push_bad_spec": lambda rng: _dp_push([dict(name="f", op=ps_pb2.ASSIGN, value=rng.choice([(0, [2]), (99, [2]), (F32, [-1]), (F32, [1] * 40)]))]),
        "push_oversized_spec": lambda rng: _dp_push([dict(name="f", op=ps_pb2.ASSIGN, value=(F32, [MAX_VARIABLE_BYTES]))]),
        "push_zero_size_huge_dims": lambda rng: _dp_push([dict(name="f", op=ps_pb2.ASSIGN,
                                                               value=(F32, rng.choice([[0, 2**62, 2**62], [2**63 - 1, 0]])))]),
        "push_unknown_op": lambda rng: _dp_push([dict(name="f", op=rng.choice([0, 12, 99]), value=(F32, f_shape))], zeros(F32, f_shape)),
        "push_scatter_bad_indices": lambda rng: _dp_push([dict(name="f", op=ps_pb2.SCATTER_ADD, value=(F32, [1, 4]), indices=(I64, [1]))],
                                                         zeros(F32, [1, 4]) + np.asarray([rng.choice([8, -1, 2**40])], np.int64).tobytes()),
        "create_unknown_if_exists": lambda rng: _dp_push([dict(name=name(rng, "fz-new"), op=ps_pb2.CREATE, value=(F32, [2]),
                                                               if_exists=rng.choice([3, 7, -1]))], zeros(F32, [2])),
        "create_existing": lambda rng: _dp_push([dict(name="f", op=ps_pb2.CREATE, value=(F32, [2]))], zeros(F32, [2])),
        "pull_unknown_variable": lambda rng: _dp_pull(dict(name=name(rng))),
        "pull_with_payload": lambda rng: _dp_pull(dict(name="f"), payload=rng.randbytes(rng.randrange(1, 64))),
        "pull_bad_indices": lambda rng: _dp_pull(dict(name="f"), rng.choice([(F32, [1], zeros(F32, [1])), (I64, [1], np.asarray([9], np.int64).tobytes()),
                                                                            (I64, [2], zeros(I64, [1]))])),
        "pull_zero_size_huge_indices": lambda rng: _dp_pull(dict(name="f"), (I64, rng.choice([[0, 2**62, 2**62], [2**63 - 1, 0]]), b"")),
        "shm_attach_short_header": lambda rng: attach(rng, 64 << 10, "", short=True),
        "shm_attach_bad_name": lambda rng: attach(rng, 64 << 10, rng.choice(["../../etc/passwd", "jaxdist-XYZ", "jaxdist-" + "0" * 31, "x" * 200])),
        "shm_attach_bad_slot_size": lambda rng: attach(rng, rng.choice([0, 4096, 1000, (64 << 20) + 4096, 2**64 - 1]), f"jaxdist-{rng.randbytes(16).hex()}"),
        "shm_attach_no_such_region": lambda rng: attach(rng, 64 << 10, f"jaxdist-{rng.randbytes(16).hex()}"),
        # Sealed-region names lead into /proc: any process's descriptors (this test process's
        # sockets, pipes and files, init's, no process at all), none a region with this nonce.
        "shm_attach_not_a_sealed_region": lambda rng: attach(
            rng, 64 << 10, f"fd:{rng.choice([1, os.getpid(), rng.randrange(2, 1 << 22)])}/{rng.randrange(0, 64)}"),
    }


def test_fuzz_ps_data_plane(fuzz_ps: Any) -> None:
    ps, ch, _ = fuzz_ps
    port = common_pb2.TaskStatus.FromString(unary(ch, PS + "GetStatus", common_pb2.Empty()).response).data_port
    assert port, "the PS announces no data port"
    probe = dp_request(DP_PULL, ps_pb2.PullRequest(entries=[ps_pb2.PullEntry(name="s")]).SerializeToString())
    counters, variables = state_counters(ch), ps_variables(ch)
    rng = random.Random(SEED)
    tally = Tally({k: f"{code.name}+{then}" for k, (code, then) in DP_EXPECTED.items()})
    conn: list[socket.socket] = []
    started = time.monotonic()

    def execute(kind: str, case: DPCase) -> tuple[str, str]:
        if case.pre_hello:
            sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        else:
            if not conn:
                conn.append(dp_connect(port))
            sock = conn[0]
        try:
            sock.sendall(case.data)
            try:
                a = dp_read(sock)
                got, detail = a.code.name, str(a)
            except (ConnectionError, OSError) as e:
                got, detail = "NO_STATUS", f"connection ended without a response ({e})"
            if got == "NO_STATUS":
                then = "close"
            else:  # does the connection still serve? (a Pull of the scalar s)
                try:
                    sock.sendall(probe)
                    then = "stay" if dp_read(sock).code == OK else "broken"
                except (ConnectionError, OSError):
                    then = "close"
        finally:
            if case.pre_hello:
                sock.close()
        if not case.pre_hello and then != "stay":
            conn.pop().close()
        return f"{got}+{then}", f"{kind} -> {detail}"

    try:
        run_cases(tally, 4000, rng, dp_generators(), execute)
        # A connection that vanished mid-request and one that sent half a hello never get answers;
        # the server must simply go on.
        for _ in range(20):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                s.sendall(hello_bytes(TOKEN)[: rng.randrange(1, 12)])
            with dp_connect(port) as s:
                s.sendall(dp_request(DP_PUSH, push_frames([dict(name="f", op=ps_pb2.ASSIGN, value=(F32, [8, 4]))])[0],
                                     payload_len=128)[: -rng.randrange(1, 8)])
    finally:
        for s in conn:
            s.close()
    after = []
    h = health_check(ch, "jaxdist.ParameterServer", timeout=5)
    if h.code != OK:
        after.append(f"health check {h}")
    else:
        if changed := counter_changes(counters, state_counters(ch)):
            after.append(f"counters changed: {changed}")
        if ps_variables(ch) != variables:
            after.append("variables changed")
        with dp_connect(port) as s:  # and the data plane still serves
            s.sendall(probe)
            if (a := dp_read(s)).code != OK:
                after.append(f"a valid Pull then got {a}")
    report("PS data plane", tally, started, after)
