"""The PS wire protocol without sockets: the Op enum, byte-for-byte compatibility of every message
with the encoding before it had one home, and the shards() view the variable API cuts updates with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import grpc
import ml_dtypes
import numpy as np
import optax
import pytest

from jaxdist.errors import InvalidRequestError
from jaxdist.partitioners import shard_of_indices, shard_offsets
from jaxdist.proto import codec, ps_pb2, ps_wire
from jaxdist.proto.ps_wire import CreateSpec, IfExists, Op, PullSpec, Update
from jaxdist.ps_server.optimizer import Optimizer
from jaxdist.sharded_variable import ShardedVariable
from jaxdist.transport.dataplane import framing, shm
from jaxdist.variables import SparseGradient, Variable, apply_gradients, locate_rows, split_update

pytestmark = pytest.mark.timeout(60)

BF16 = np.dtype(ml_dtypes.bfloat16)

# Bytes produced by the encoders as they were before ps_wire existed (ps_server/client.py's
# encode_push and PSClient.pull/create, ps_server/replication.py, the servicer's pull header,
# transport/dataplane.py's envelopes), captured at commit 590e03d. A PS from before and a
# client from after (and the other way round) exchange exactly these bytes.
GOLDEN = {
    "push_header": "0a0f0a017710051a0608011202020320010a180a016510071a0608011202020420012a05080812010230010a180a0167100b1a0608031202010420012a05080812010130010a0b0a016310041a0208082001120872756e2f63372f32",
    "push_payload": "000000000000803f0000004000004040000080400000a0400000803f0000803f0000803f0000803f0000803f0000803f0000803f0000803f03000000000000000100000000000000803f803f803f803f00000000000000000500000000000000",
    "pull_request": "0a030a01610a240a016210041a190a050808120102121001000000000000000200000000000000200128030a050a01632804",
    "pull_header": "0a0a0a0608011202030210010a0b0a050808120104100118010a0a0a0608031202030210010a0a0a060801120202021001",
    "pull_payload": "000000000000803f0000004000004040000080400000a0400000803f004040408040a040000080400000a040000000000000803f",
    "create_header": "0a150a017610011a0608011202020220015801620204000a0e0a016910013a0508071201035802",
    "create_payload": "0000803f0000803f0000803f0000803f",
    "replica_update": "08071a2f0a0e0a017710031a05080112010320010a180a0165100a1a0608021202010220012a05080812010130011203752f31",
    "replica_update_payload": "0000803f0000803f0000803f000000000000f03f000000000000f03f0400000000000000",
    "replica_install": "08031001221e0a01771205080112010318052204424c4f422a0364696732050801120103220c0a017812050807120102180130013a0269313a026932",
    "replica_install_payload": "0000803f0000803f0000803f0000000000000000000000000000000000000000",
    "hello": "4a58423103000000",
    "request": "4a585251020000000a0000000000000002000000",
    "response": "4a585253050000000100000004000000090000000000000052626f6479",
    "attach": "00002000000000006e6e6e6e6e6e6e6e6e6e6e6e6e6e6e6e",
}
#: UpdateOp codes by op name, as the client's table had them.
GOLDEN_OP_CODES = {"assign": 2, "assign_add": 3, "assign_sub": 4, "apply_gradient": 5, "scatter_update": 6, "scatter_add": 7,
                   "scatter_sub": 8, "scatter_min": 9, "scatter_max": 10, "sparse_apply_gradient": 11}


def _payload(arrays: list[np.ndarray]) -> str:
    return b"".join(np.ascontiguousarray(a).tobytes() for a in arrays).hex()


# ------------------------------------------------------------------------- Op
def test_op_is_one_enum_from_python_names_to_wire_codes() -> None:
    assert {op.value: op.wire for op in Op} == GOLDEN_OP_CODES
    for op in Op:
        assert Op(op.value) is op and Op.from_wire(op.wire) is op
        assert op.wire == ps_pb2.UpdateOp.Value(op.name)  # the proto enum spells them the same
    for code in (ps_pb2.OP_UNSPECIFIED, ps_pb2.CREATE, 99):
        with pytest.raises(InvalidRequestError, match="unknown update op"):
            Op.from_wire(code)
    assert Update("v", "assign_add", np.ones(1)).op is Op.ASSIGN_ADD  # a name is accepted and normalised
    with pytest.raises(ValueError):
        Update("v", "assign_mul", np.ones(1))
    assert {IfExists.from_wire(e.wire) for e in IfExists} == set(IfExists)
    assert CreateSpec("v", if_exists="keep").if_exists is IfExists.KEEP


# ------------------------------------------------------------------ messages
def test_push_encoding_is_unchanged_and_decodes_back() -> None:
    updates = [
        Update("w", Op.APPLY_GRADIENT, np.arange(6, dtype=np.float32).reshape(2, 3)),
        Update("e", Op.SCATTER_ADD, np.ones((2, 4), np.float32), np.array([3, 1])),
        Update("g", Op.SPARSE_APPLY_GRADIENT, np.ones((1, 4), BF16), np.array([0])),
        Update("c", Op.ASSIGN_SUB, np.int64(5)),
    ]
    header, arrays = ps_wire.encode_push(updates, "run/c7/2")
    assert header.SerializeToString().hex() == GOLDEN["push_header"]
    assert _payload(arrays) == GOLDEN["push_payload"]
    parsed = ps_pb2.PushHeader.FromString(header.SerializeToString())
    specs = ps_wire.push_payload_specs(parsed, 1 << 20)
    assert specs == [(a.shape, a.dtype) for a in arrays]
    back = ps_wire.decode_updates(parsed, iter(arrays))
    assert [(u.name, u.op) for u in back] == [(u.name, u.op) for u in updates]
    assert not ps_wire.is_create(parsed)


def test_pull_encoding_is_unchanged_and_decodes_back() -> None:
    specs = [PullSpec("a"), PullSpec("b", known_version=4, indices=np.array([1, 2]), as_dtype=BF16), PullSpec("c", as_dtype=np.float16)]
    req = ps_wire.encode_pull(specs)
    assert req.SerializeToString().hex() == GOLDEN["pull_request"]
    back = ps_wire.decode_pull(ps_pb2.PullRequest.FromString(req.SerializeToString()), 1 << 20)
    assert [(s.name, s.known_version, s.as_dtype) for s in back] == [("a", -1, None), ("b", 4, BF16), ("c", -1, np.dtype(np.float16))]
    assert back[1].indices.tolist() == [1, 2]

    @dataclass
    class Read:
        value: Any
        version: int
        shape: tuple[int, ...]
        dtype: np.dtype

    a = np.arange(6, dtype=np.float32).reshape(3, 2)
    reads = [Read(a, 1, (3, 2), a.dtype), Read(None, 1, (4,), np.dtype(np.int64)), Read(a.astype(BF16), 1, (3, 2), BF16),
             Read(a[[2, 0]], 1, (2, 2), a.dtype)]
    header, payload = ps_wire.encode_pull_header(reads)
    assert header.SerializeToString().hex() == GOLDEN["pull_header"] and _payload(payload) == GOLDEN["pull_payload"]
    wanted, _ = ps_wire.pull_payload_specs(header)
    assert wanted == [((3, 2), a.dtype), ((3, 2), BF16), ((2, 2), a.dtype)]
    results = ps_wire.pull_results(header, payload)
    assert [v is None for v, _ in results] == [False, True, False, False]


def test_create_encoding_is_unchanged() -> None:
    specs = [CreateSpec("v", value=np.ones((2, 2), np.float32), if_exists="keep", offset=(4, 0)),
             CreateSpec("i", shape=(3,), dtype=np.int32, initializer=None, if_exists=IfExists.REPLACE)]
    header, arrays = ps_wire.encode_create(specs)
    for e in header.entries:
        e.initializer = b""  # pickles are not stable bytes
    assert header.SerializeToString().hex() == GOLDEN["create_header"] and _payload(arrays) == GOLDEN["create_payload"]
    assert ps_wire.is_create(header)
    created = ps_wire.decode_creates(header, iter(arrays), 1 << 20)
    assert [(c.name, c.shape, c.if_exists, c.offset) for c in created] == [
        ("v", None, IfExists.KEEP, (4, 0)), ("i", (3,), IfExists.REPLACE, ())]
    header.entries.add(name="x", op=Op.ASSIGN.wire)
    with pytest.raises(InvalidRequestError, match="not both"):
        ps_wire.is_create(header)


def test_replication_encoding_is_unchanged_and_decodes_back() -> None:
    upd = [Update("w", Op.ASSIGN_ADD, np.ones(3, np.float32)), Update("e", Op.SCATTER_MAX, np.ones((1, 2), np.float64), np.array([4]))]
    header, arrays = ps_wire.encode_replica_update(upd, "u/1", 7)
    assert header.SerializeToString().hex() == GOLDEN["replica_update"] and _payload(arrays) == GOLDEN["replica_update_payload"]
    assert ps_wire.replica_payload_specs(header, 1 << 20) == [(a.shape, a.dtype) for a in arrays]

    opt = Optimizer(optax.sgd(0.1, momentum=0.9), "dig")
    state = opt.init(np.ones(3, np.float32))
    variables = [("w", np.ones(3, np.float32), opt, state, 5), ("x", np.zeros(2, np.int32), None, None, 1)]
    header, arrays = ps_wire.encode_replica_install(variables, 3, lambda o: b"BLOB", full_sync=True, applied_ids=["i1", "i2"])
    assert header.SerializeToString().hex() == GOLDEN["replica_install"] and _payload(arrays) == GOLDEN["replica_install_payload"]
    back = ps_wire.decode_replica_installs(header, arrays, lambda blob, digest: opt if digest else None)
    assert [(n, ver, o is opt) for n, _, o, _, ver in back] == [("w", 5, True), ("x", 1, False)]
    delete = ps_wire.encode_replica_delete(["a", "b"], 2)
    assert delete.kind == ps_pb2.REPLICA_DELETE and list(delete.deletes) == ["a", "b"]
    assert ps_wire.replica_payload_specs(delete, 1 << 20) == []


def test_data_plane_envelopes_are_unchanged() -> None:
    assert framing.HELLO.pack(framing.HELLO_MAGIC, 3).hex() == GOLDEN["hello"]
    assert framing.REQUEST.pack(framing.REQUEST_MAGIC, framing.PUSH, 10, 1 << 33).hex() == GOLDEN["request"]
    assert framing.response_envelope(grpc.StatusCode.NOT_FOUND, b"R", b"body", 9).hex() == GOLDEN["response"]
    assert shm.ATTACH.pack(2 << 20, b"n" * 16).hex() == GOLDEN["attach"]
    assert (framing.PULL, framing.PUSH, framing.SHM_ATTACH) == (1, 2, 3)


# ------------------------------------------------------------------- shards()
def _sharded(dim0: int, k: int, dtype: Any = np.float32, conns: Any = None) -> ShardedVariable:
    offsets = shard_offsets(dim0, k)
    return ShardedVariable("t", [Variable(f"t/part_{i}", (b - a, 3), dtype, ps_index=i % 2, conns=conns)
                                 for i, (a, b) in enumerate(zip(offsets[:-1], offsets[1:]))])


def test_every_handle_has_a_shards_view() -> None:
    v = Variable("v", (4, 3), np.float32, ps_index=1)
    assert v.shards() == [(v, 0)]
    t = _sharded(10, 4)
    assert [(s.name, row) for s, row in t.shards()] == [("t/part_0", 0), ("t/part_1", 3), ("t/part_2", 6), ("t/part_3", 8)]


@pytest.mark.parametrize("dim0,k", [(10, 4), (13, 5), (3, 4), (7, 1), (100, 7)])
def test_locate_rows_agrees_with_tf_layout(dim0: int, k: int) -> None:
    t = _sharded(dim0, k)
    ids = np.random.default_rng(dim0 * k).integers(0, dim0, size=50)
    shard, local = locate_rows(t.shards(), dim0, ids)
    want_shard, want_local = shard_of_indices(ids, dim0, k)
    assert np.array_equal(shard, want_shard) and np.array_equal(local, want_local)
    with pytest.raises(IndexError):
        locate_rows(t.shards(), dim0, np.array([dim0]))


def test_split_update_cuts_by_shards() -> None:
    t = _sharded(10, 4)
    full = np.arange(30, dtype=np.float32).reshape(10, 3)
    parts = split_update(t, Op.ASSIGN, full)
    assert [(s.name, a.shape) for s, _, a, _ in parts] == [("t/part_0", (3, 3)), ("t/part_1", (3, 3)), ("t/part_2", (2, 3)), ("t/part_3", (2, 3))]
    assert np.array_equal(np.concatenate([a for *_, a, _ in parts]), full)
    rows = split_update(t, Op.SCATTER_ADD, np.ones((3, 3)), [9, 0, 4])
    assert [(s.name, idx.tolist(), a.dtype) for s, _, a, idx in rows] == [
        ("t/part_0", [0], np.float32), ("t/part_1", [1], np.float32), ("t/part_3", [1], np.float32)]
    with pytest.raises(ValueError, match="shape"):
        split_update(t, Op.APPLY_GRADIENT, np.ones((9, 3), np.float32), broadcast=False)


def test_a_row_gradient_reaches_every_shard() -> None:
    """A gradient's rows go to their shards, and every other shard gets an empty push: each shard's optimizer
    steps once per push, as the whole variable's would (exact mode: its moments decay; counts stay equal)."""
    t = _sharded(10, 4)
    parts = split_update(t, Op.SPARSE_APPLY_GRADIENT, np.ones((2, 3), np.float32), [9, 8])
    assert [(s.name, idx.tolist(), a.shape) for s, _, a, idx in parts] == [
        ("t/part_0", [], (0, 3)), ("t/part_1", [], (0, 3)), ("t/part_2", [], (0, 3)), ("t/part_3", [1, 0], (2, 3))]
    # A table with fewer rows than shards has empty shards: they own nothing and get nothing.
    small = _sharded(2, 4)
    parts = split_update(small, Op.SPARSE_APPLY_GRADIENT, np.ones((1, 3), np.float32), [1])
    assert [(s.name, idx.tolist()) for s, _, _, idx in parts] == [("t/part_0", []), ("t/part_1", [0])]


class _Recorder:
    """Stands in for PSConnections: records the exact bytes each push would send."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, str]] = []

    def fan_out(self, calls: dict[int, Any]) -> dict[int, Any]:
        out = {}
        for ps, fn in sorted(calls.items()):
            rec = self

            class Client:
                def push(self, updates: list[Update], update_id: str = "") -> tuple[list[int], bool]:
                    header, arrays = ps_wire.encode_push(updates, update_id)
                    rec.sent.append((ps, header.SerializeToString().hex(), _payload(arrays)))
                    return [2] * len(updates), False

            out[ps] = fn(Client())
        return out


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("grad_dtype", [BF16, np.dtype(np.float16), np.dtype(np.float32)])
def test_apply_gradient_and_apply_gradients_send_the_same_bytes(sharded: bool, grad_dtype: np.dtype) -> None:
    """``v.apply_gradient(g)`` and ``apply_gradients(v, g)`` (dense and sparse) push identical bytes:
    a bf16/f16 gradient of a float32 variable travels narrow both ways (before, the method cast it up)."""
    rec = _Recorder()
    if sharded:
        v: Any = _sharded(10, 4, conns=rec)
    else:
        v = Variable("w", (10, 3), np.float32, ps_index=0, conns=rec)  # type: ignore[arg-type]
    g = np.random.default_rng(0).normal(size=(10, 3)).astype(grad_dtype)
    v.apply_gradient(g)
    apply_gradients(v, g)
    assert len(rec.sent) == 2 * (2 if sharded else 1)  # one push per PS task
    half = len(rec.sent) // 2
    assert rec.sent[:half] == rec.sent[half:]
    elem = 2 if grad_dtype != np.float32 else 4
    assert sum(len(p) // 2 for *_, p in rec.sent[:half]) == 10 * 3 * elem  # narrow gradients stay narrow
    rec.sent.clear()
    ids, rows = np.array([9, 0, 4]), g[[9, 0, 4]]
    v.apply_sparse_gradient(ids, rows)
    apply_gradients(v, SparseGradient(ids, rows))
    half = len(rec.sent) // 2
    assert rec.sent[:half] == rec.sent[half:]
    assert codec.canonical_dtype(grad_dtype) == grad_dtype


# ------------------------------------------------------------------ hostile input
def _restore_request(shape: tuple[int, ...], pieces: list[tuple[int, int, int]], name: str = "v") -> ps_pb2.RestoreRequest:
    req = ps_pb2.RestoreRequest(directory="/ckpt")
    e = req.entries.add(name=name)
    codec.spec_to_proto(shape, np.float32, e.spec)
    for start, stop, dst in pieces:
        e.pieces.add(file="f.npz", source="src", src_start=start, src_stop=stop, dst_start=dst)
    return req


@pytest.mark.parametrize("shape, pieces", [
    ((4, 2), [(0, 4, 0)]),
    ((4, 2), [(2, 4, 2), (0, 2, 0)]),        # in any order
    ((4, 2), [(5, 6, 3), (0, 3, 0)]),        # from other rows of the source
    ((0, 2), []),                            # no rows, no pieces
    ((), [(0, 0, 0)]),                       # a scalar: one piece, the whole array
])
def test_restore_pieces_that_tile_the_rows_decode(shape: tuple[int, ...], pieces: list[tuple[int, int, int]]) -> None:
    directory, [entry] = ps_wire.decode_restore(_restore_request(shape, pieces), 1 << 20)
    assert directory == "/ckpt" and entry.shape == shape and len(entry.pieces) == len(pieces)


@pytest.mark.parametrize("shape, pieces", [
    ((4, 2), [(0, 2, 0), (0, 2, 0)]),        # rows 0-1 twice, 2-3 never
    ((4, 2), [(0, 2, 0), (0, 2, 1)]),        # overlap by one row
    ((4, 2), [(0, 2, 0), (0, 1, 3)]),        # row 2 never written
    ((4, 2), [(0, 3, 0)]),                   # too few rows
    ((4, 2), [(0, 5, 0)]),                   # too many
    ((4, 2), [(0, 4, -2)]),                  # negative destination
    ((4, 2), [(2, 2, 0), (0, 4, 0)]),        # an empty piece
    ((4, 2), [(3, 1, 0)]),                   # reversed
    ((4, 2), [(-1, 3, 0)]),                  # negative source
    ((4, 2), []),                            # rows but no pieces
    ((), []),                                # a scalar without its piece
    ((), [(0, 0, 0), (0, 0, 0)]),            # a scalar from two pieces
])
def test_restore_pieces_that_do_not_tile_the_rows_are_invalid(shape: tuple[int, ...], pieces: list[tuple[int, int, int]]) -> None:
    with pytest.raises(InvalidRequestError):
        ps_wire.decode_restore(_restore_request(shape, pieces), 1 << 20)


@pytest.mark.parametrize("directory, file_name", [
    ("", "f.npz"), ("/d", ""), ("/d", "."), ("/d", ".."), ("/d", "a/b"), ("/d", "a\0b"), ("/d\0", "f.npz"),
    ("/d", "x" * (ps_wire.MAX_FILE_NAME_BYTES + 1)), ("/d", "é" * (ps_wire.MAX_FILE_NAME_BYTES // 2 + 1)),
])
def test_save_needs_a_directory_and_a_plain_file_name(directory: str, file_name: str) -> None:
    with pytest.raises(InvalidRequestError):
        ps_wire.decode_save(ps_pb2.SaveRequest(directory=directory, file_name=file_name))


def test_save_request_decodes() -> None:
    assert ps_wire.decode_save(ps_pb2.SaveRequest(directory="/d", file_name="ps-0.npz")) == ("/d", "ps-0.npz")


def _spec(shape: list[int], dtype: Any = np.float32) -> Any:
    s = codec.spec_to_proto((), dtype)
    s.shape.extend(shape)
    return s


@pytest.mark.parametrize("shape", [[0, 2**62, 2**62], [2**63 - 1, 0], [2**40, 0, 2**40], [0, 2**61]])
def test_empty_shapes_with_dims_no_array_can_have_are_invalid(shape: list[int]) -> None:
    with pytest.raises(InvalidRequestError):
        codec.spec_from_proto(_spec(shape), 1 << 20)
    with pytest.raises(InvalidRequestError):
        codec.spec_from_proto(_spec(shape))


def test_shapes_of_large_or_empty_tensors() -> None:
    from jaxdist.errors import PayloadTooLargeError

    assert codec.spec_from_proto(_spec([0, 2**40]), 1 << 20) == ((0, 2**40), np.dtype(np.float32))
    for shape in ([2**40], [2**31, 2**31], [2**62, 4]):
        with pytest.raises(PayloadTooLargeError):
            codec.spec_from_proto(_spec(shape), 1 << 20)
    with pytest.raises(PayloadTooLargeError):  # no limit given: still no array of 2**64 bytes
        codec.spec_from_proto(_spec([2**62, 4]))


def _push_header(**entry: Any) -> ps_pb2.PushHeader:
    header = ps_pb2.PushHeader()
    value = entry.pop("value", None)
    e = header.entries.add(**entry)
    if value is not None:
        codec.spec_to_proto(value, np.float32, e.value)
        e.has_value = True
    return header


@pytest.mark.parametrize("entry", [
    dict(name="x", op=ps_pb2.CREATE, value=(2,), if_exists=7),
    dict(name="x", op=ps_pb2.CREATE, value=(2,), if_exists=-1),
    dict(name="", op=ps_pb2.CREATE, value=(2,)),
    dict(name="x", op=ps_pb2.CREATE),
    dict(name="x", op=ps_pb2.CREATE, initializer=b"init"),
    dict(name="x", op=99, value=(2,)),
    dict(name="x", op=ps_pb2.ASSIGN),
    dict(name="x", op=ps_pb2.SCATTER_ADD, value=(1, 2)),
], ids=["if_exists=7", "if_exists=-1", "create-no-name", "create-from-nothing", "initializer-without-shape",
        "unknown-op", "assign-without-value", "scatter-without-indices"])
def test_malformed_push_headers_are_refused_before_any_payload(entry: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError):
        ps_wire.push_payload_specs(_push_header(**entry), 1 << 20)


def test_a_create_may_not_name_a_variable_twice() -> None:
    header, _ = ps_wire.encode_create([CreateSpec("a", value=np.ones(2, np.float32)), CreateSpec("a", value=np.ones(2, np.float32))])
    with pytest.raises(InvalidRequestError):
        ps_wire.push_payload_specs(header, 1 << 20)


def test_error_details_are_cut_to_fit_grpc_metadata() -> None:
    from jaxdist.errors import VariableNotFoundError
    from jaxdist.proto import status

    short = VariableNotFoundError("no variable named 'v'")
    assert status.details(short) == "no variable named 'v'"
    for text in ("n" * 20_000, "é" * 20_000, "\U0001f600" * 20_000):
        cut = status.details(VariableNotFoundError(f"no variable named {text!r}"))
        assert len(cut.encode()) <= status.MAX_DETAILS_BYTES and cut.endswith("more bytes]")
