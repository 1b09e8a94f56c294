"""The parameter-server wire protocol: operations, the transfer-dtype rule, and every PS message.

One home for what a PS client, a PS and a PS's backup must agree on:

- :class:`Op`, the update operations, used end to end: the variable API
  (``v.assign_add``), the client (:class:`Update`), the wire (``ps.proto``'s
  ``UpdateOp``, :attr:`Op.wire`), the store, and replication.
- :func:`transfer_dtype`, the one rule that decides the dtype a tensor travels
  in (mixed precision: bfloat16/float16 gradients and pulls of wider float
  variables). Clients use it to cast, the PS to accept or refuse.
- The encoding of Pull, Push (updates and creates) and Replicate messages,
  both ways. Both transports (gRPC and the data plane) carry exactly these
  messages: a header message, then the payload arrays in the order given
  here (gRPC cuts them into raw frames, the data plane sends them as they
  are), so the byte layout is defined once, in this module.

Nothing here does I/O. Layer: ``jaxdist.proto`` (imports only
``jaxdist.base.errors`` and the rest of ``jaxdist.proto``).
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import ml_dtypes
import numpy as np

from jaxdist.base.errors import InvalidRequestError
from jaxdist.proto import codec, common_pb2, pickling, ps_pb2

__all__ = [
    "Op",
    "GRADIENT_OPS",
    "SPARSE_OPS",
    "IfExists",
    "NARROW_FLOATS",
    "is_narrower_float",
    "transfer_dtype",
    "wire_value",
    "Update",
    "PullSpec",
    "CreateSpec",
    "Created",
    "optimizer_payload",
    "encode_pull",
    "decode_pull",
    "encode_pull_header",
    "pull_payload_specs",
    "pull_results",
    "encode_push",
    "encode_push_pull",
    "decode_pull_after",
    "encode_create",
    "push_payload_specs",
    "is_create",
    "decode_updates",
    "decode_creates",
    "MAX_FILE_NAME_BYTES",
    "check_file_name",
    "check_directory",
    "decode_save",
    "ExportSpec",
    "decode_export",
    "RestorePiece",
    "RestoreEntry",
    "decode_restore",
    "encode_replica_update",
    "encode_replica_install",
    "encode_replica_delete",
    "replica_payload_specs",
    "dynamic_install_specs",
    "out_of_band",
    "decode_replica_installs",
    "SyncKind",
    "SyncReport",
    "encode_sync_request",
    "decode_sync_request",
    "encode_sync_report",
    "decode_sync_report",
]

#: (shape, dtype) of one payload array, as the receiver allocates it.
ArraySpec = tuple[tuple[int, ...], np.dtype]


# ------------------------------------------------------------------ operations
class Op(enum.Enum):
    """An update a push applies to one variable. The value is its Python name (``Op("assign_add")``);
    :attr:`wire` is its ``UpdateOp`` code in ``ps.proto``."""

    ASSIGN = "assign"
    ASSIGN_ADD = "assign_add"
    ASSIGN_SUB = "assign_sub"
    APPLY_GRADIENT = "apply_gradient"
    SCATTER_UPDATE = "scatter_update"
    SCATTER_ADD = "scatter_add"
    SCATTER_SUB = "scatter_sub"
    SCATTER_MIN = "scatter_min"
    SCATTER_MAX = "scatter_max"
    SPARSE_APPLY_GRADIENT = "sparse_apply_gradient"

    @property
    def wire(self) -> int:
        """This op's ``UpdateOp`` code on the wire."""
        return _OP_TO_WIRE[self]

    @classmethod
    def from_wire(cls, code: int, variable: str = "") -> Op:
        """The op of wire code ``code``.

        Raises:
            InvalidRequestError: ``code`` names no update op (CREATE included: creates are
                decoded by :func:`decode_creates`).
        """
        try:
            return _WIRE_TO_OP[code]
        except KeyError:
            raise InvalidRequestError(f"unknown update op {code} for variable {variable!r}") from None


# Spelled out, not derived from names: the wire codes are frozen, the Python names are not.
_OP_TO_WIRE: dict[Op, int] = {
    Op.ASSIGN: ps_pb2.ASSIGN,
    Op.ASSIGN_ADD: ps_pb2.ASSIGN_ADD,
    Op.ASSIGN_SUB: ps_pb2.ASSIGN_SUB,
    Op.APPLY_GRADIENT: ps_pb2.APPLY_GRADIENT,
    Op.SCATTER_UPDATE: ps_pb2.SCATTER_UPDATE,
    Op.SCATTER_ADD: ps_pb2.SCATTER_ADD,
    Op.SCATTER_SUB: ps_pb2.SCATTER_SUB,
    Op.SCATTER_MIN: ps_pb2.SCATTER_MIN,
    Op.SCATTER_MAX: ps_pb2.SCATTER_MAX,
    Op.SPARSE_APPLY_GRADIENT: ps_pb2.SPARSE_APPLY_GRADIENT,
}
_WIRE_TO_OP = {code: op for op, code in _OP_TO_WIRE.items()}

#: Ops whose value is a gradient: the variable's optimizer turns it into the update.
GRADIENT_OPS = frozenset({Op.APPLY_GRADIENT, Op.SPARSE_APPLY_GRADIENT})
#: Ops that carry row indices (dim 0) beside their value.
SPARSE_OPS = frozenset(
    {Op.SCATTER_UPDATE, Op.SCATTER_ADD, Op.SCATTER_SUB, Op.SCATTER_MIN, Op.SCATTER_MAX, Op.SPARSE_APPLY_GRADIENT}
)


class IfExists(enum.Enum):
    """What a create does when the name is taken (``ps.proto``'s ``IfExists``)."""

    FAIL = "fail"  # VariableExistsError (ALREADY_EXISTS)
    KEEP = "keep"  # leave the existing variable and its optimizer state as they are
    REPLACE = "replace"  # overwrite value and optimizer state

    @property
    def wire(self) -> int:
        return _IF_EXISTS_TO_WIRE[self]

    @classmethod
    def from_wire(cls, code: int) -> IfExists:
        for k, v in _IF_EXISTS_TO_WIRE.items():
            if v == code:
                return k
        raise InvalidRequestError(f"unknown if_exists code {code}")


_IF_EXISTS_TO_WIRE = {IfExists.FAIL: ps_pb2.FAIL, IfExists.KEEP: ps_pb2.KEEP, IfExists.REPLACE: ps_pb2.REPLACE}


# --------------------------------------------------------------- transfer dtype
#: Float dtypes a tensor may travel in when narrower than its variable.
NARROW_FLOATS = frozenset({np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)})


def is_narrower_float(dtype: np.dtype, var_dtype: np.dtype) -> bool:
    """``dtype`` is bfloat16/float16 and ``var_dtype`` a wider float."""
    return dtype in NARROW_FLOATS and var_dtype.kind == "f" and var_dtype.itemsize > dtype.itemsize


def transfer_dtype(var_dtype: Any, op: Op | None, *offered: Any) -> np.dtype:
    """The dtype a tensor of a variable of ``var_dtype`` travels in: the one rule, both ends.

    Only gradients (``op`` in :data:`GRADIENT_OPS`) and pulled values (``op``
    None) may travel narrower than their variable, and only as bfloat16 or
    float16 for a wider float variable (mixed precision: the PS keeps the
    variable, and runs its optimizer, in the variable's dtype). The first of
    ``offered`` (None entries skipped) that is such a narrower float is the
    answer; otherwise ``var_dtype``.

    - A client pushing a value offers the value's dtype, then the transfer
      dtype the caller asked for: a gradient already in bf16 travels as it
      is, a float32 one is cast to the requested bf16, an assign always
      travels in the variable's dtype.
    - A client pulling offers the dtype asked for.
    - A PS accepts a pushed value (or a pull's ``as_dtype``) exactly when this
      function, offered that dtype, gives it back.
    """
    var = np.dtype(var_dtype)
    if op is None or op in GRADIENT_OPS:
        for d in offered:
            if d is not None and is_narrower_float(np.dtype(d), var):
                return np.dtype(d)
    return var


def wire_value(value: Any, var_dtype: Any, op: Op | None, requested: Any = None) -> np.ndarray:
    """``value`` as the numpy array that travels for ``op`` on a variable of ``var_dtype``.

    Its dtype is :func:`transfer_dtype` offered the value's own dtype, then
    ``requested``. A JAX array is cast by XLA before it leaves the device
    (half the bytes to copy out for bf16). Idempotent: a value already in its
    transfer dtype is returned without a copy.
    """
    if not hasattr(value, "dtype"):  # lists, Python scalars
        value = np.asarray(value)
    dt = transfer_dtype(var_dtype, op, value.dtype, requested)
    if value.dtype != dt:
        value = value.astype(dt)
    return np.asarray(value)


# --------------------------------------------------------------------- entries
@dataclass
class Update:
    """One entry of a push: ``op`` on variable ``name`` with ``value`` (rows ``indices`` for
    :data:`SPARSE_OPS`). ``op`` may be given by its name (``"assign_add"``)."""

    name: str
    op: Op
    value: Any
    indices: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.op = Op(self.op)


@dataclass
class PullSpec:
    """One variable to pull: whole (``indices=None``) or some dim-0 rows.

    ``known_version`` >= 0: the PS answers "not modified" without a payload
    when the variable is still at that version. ``as_dtype`` (bfloat16/float16):
    read a wider float variable rounded to it (see :func:`transfer_dtype`);
    None: as stored.
    """

    name: str
    known_version: int = -1
    indices: np.ndarray | None = None
    as_dtype: Any = None


@dataclass
class CreateSpec:
    """A variable to create: from ``value``, or from ``initializer(shape, dtype, offset)`` run on the PS.

    ``offset`` is where this shard starts in the full variable;
    ``optimizer`` an optax ``GradientTransformation`` (applied on the PS).
    """

    name: str
    value: Any = None
    shape: Sequence[int] | None = None
    dtype: Any = None
    initializer: Any = None
    offset: Sequence[int] = ()
    optimizer: Any = None
    if_exists: IfExists = IfExists.FAIL

    def __post_init__(self) -> None:
        self.if_exists = IfExists(self.if_exists)


@dataclass
class Created:
    """A create entry as the PS decodes it (pickles not yet loaded: the PS decides how)."""

    name: str
    value: np.ndarray | None
    shape: tuple[int, ...] | None
    dtype: np.dtype | None
    initializer: bytes
    offset: tuple[int, ...]
    optimizer: bytes
    optimizer_digest: str
    if_exists: IfExists


def optimizer_payload(optimizer: Any) -> tuple[bytes, str]:
    """``(cloudpickled optimizer, its sha256)``: the PS caches optimizers by that digest."""
    blob = pickling.dumps(optimizer)
    return blob, hashlib.sha256(blob).hexdigest()


# ------------------------------------------------------------------------ pull
def encode_pull(specs: Sequence[PullSpec], contributor: int = -1, barrier_wait_s: float = 0.0) -> ps_pb2.PullRequest:
    """A PullRequest for ``specs`` (indices travel inline: they are small).

    ``contributor`` (a worker index, -1: none) makes a PS running synchronous
    steps wait at the step barrier first, up to ``barrier_wait_s``.
    """
    req = ps_pb2.PullRequest(contributor=contributor + 1 if contributor >= 0 else 0,
                             barrier_wait_ms=int(barrier_wait_s * 1000) if contributor >= 0 else 0)
    for s in specs:
        _add_pull_entry(req.entries.add(), s)
    return req


def _add_pull_entry(e: ps_pb2.PullEntry, s: PullSpec) -> None:
    e.name = s.name
    e.known_version = s.known_version if s.known_version >= 0 else 0
    if s.as_dtype is not None:
        e.as_dtype = codec.dtype_to_proto(s.as_dtype)
    if s.indices is not None:
        codec.tensor_to_proto(np.asarray(s.indices, dtype=np.int64), e.indices)
        e.has_indices = True


def decode_pull(req: ps_pb2.PullRequest, max_bytes: int) -> list[PullSpec]:
    """The specs of a PullRequest (PS side); ``max_bytes`` bounds an inline index tensor.

    Raises:
        InvalidRequestError, PayloadTooLargeError: malformed indices or dtype.
    """
    return [
        PullSpec(
            e.name,
            known_version=e.known_version if e.known_version else -1,
            indices=codec.tensor_from_proto(e.indices, max_bytes) if e.has_indices else None,
            as_dtype=codec.dtype_from_proto(e.as_dtype) if e.as_dtype else None,
        )
        for e in req.entries
    ]


class Read(Protocol):
    """What the PS read for one pull entry (``value`` None: not modified)."""

    value: np.ndarray | None
    version: int
    shape: tuple[int, ...]
    dtype: np.dtype


def encode_pull_header(reads: Sequence[Read]) -> tuple[ps_pb2.PullHeader, list[np.ndarray]]:
    """A pull's response: the header and the payload arrays (the modified values, in order)."""
    header = ps_pb2.PullHeader()
    payload = []
    for r in reads:
        out = header.entries.add()
        codec.spec_to_proto(r.shape, r.dtype, out.spec)
        out.version = r.version
        out.not_modified = r.value is None
        if r.value is not None:
            payload.append(r.value)
    return header, payload


def pull_payload_specs(
    header: ps_pb2.PullHeader, out: Sequence[np.ndarray | None] | None = None
) -> tuple[list[ArraySpec], list[np.ndarray | None] | None]:
    """The (shape, dtype) of each tensor a pull response carries, and the caller's ``out`` arrays for them."""
    sent = [i for i, p in enumerate(header.entries) if not p.not_modified]
    wanted = [(tuple(header.entries[i].spec.shape), codec.dtype_from_proto(header.entries[i].spec.dtype)) for i in sent]
    return wanted, None if out is None else [out[i] if i < len(out) else None for i in sent]


def pull_results(header: ps_pb2.PullHeader, arrays: Sequence[np.ndarray]) -> list[tuple[np.ndarray | None, int]]:
    """``(value or None if not modified, version)`` per pulled entry."""
    it = iter(arrays)
    return [(None if p.not_modified else next(it), p.version) for p in header.entries]


# ------------------------------------------------------------------------ push
def _add_payload(e: ps_pb2.UpdateEntry, value: Any, indices: np.ndarray | None, arrays: list[np.ndarray]) -> None:
    arr = codec.as_wire_array(value)
    codec.spec_to_proto(arr.shape, arr.dtype, e.value)
    e.has_value = True
    arrays.append(arr)
    if indices is not None:
        idx = codec.as_wire_array(np.asarray(indices, dtype=np.int64))
        codec.spec_to_proto(idx.shape, idx.dtype, e.indices)
        e.has_indices = True
        arrays.append(idx)


def encode_push(
    updates: Sequence[Update], update_id: str = "", out: ps_pb2.PushHeader | None = None,
    contributor: int = -1, commit: bool = False, step: int = -1,
) -> tuple[ps_pb2.PushHeader, list[np.ndarray]]:
    """A push as its header (written into ``out`` if given) and payload arrays: per entry its
    value, then its indices (int64) if it has any. Values travel in their own dtype: convert
    them with :func:`wire_value` first.

    ``contributor`` (a worker index, -1: none): on a PS running synchronous steps, its
    gradients are staged for its current step; ``commit`` commits that step at once; ``step``
    (-1: unknown) is the step the contributor's pull reported, checked by the PS.
    """
    header = out if out is not None else ps_pb2.PushHeader()
    header.update_id = update_id
    if contributor >= 0:
        header.contributor = contributor + 1
        header.commit = commit
        header.step = step + 1 if step >= 0 else 0
    arrays: list[np.ndarray] = []
    for u in updates:
        e = header.entries.add(name=u.name, op=u.op.wire)
        _add_payload(e, u.value, u.indices, arrays)
    return header, arrays


def encode_push_pull(
    updates: Sequence[Update], pull_after: Sequence[PullSpec], update_id: str = "", contributor: int = -1,
) -> tuple[ps_pb2.PushHeader, list[np.ndarray]]:
    """A fused push-then-pull (the ``PushPull`` call): :func:`encode_push`'s header and payload,
    plus ``pull_after``, the variables the PS reads and sends back once the updates are applied.

    The push keeps every rule of a plain push (its ``update_id`` is applied at most once; a
    re-sent call is answered with the values as they are then, its push marked duplicate).
    """
    header, arrays = encode_push(updates, update_id, contributor=contributor)
    for s in pull_after:
        _add_pull_entry(header.pull_after.add(), s)
    return header, arrays


def decode_pull_after(header: ps_pb2.PushHeader, max_bytes: int) -> list[PullSpec]:
    """The reads of a ``PushPull`` header (PS side), checked like a PullRequest's entries.

    Raises:
        InvalidRequestError: no reads, or a read with malformed indices or dtype.
        PayloadTooLargeError: an inline index tensor over ``max_bytes``.
    """
    if not header.pull_after:
        raise InvalidRequestError("PushPull names no variable to read after its push (pull_after is empty)")
    return decode_pull(ps_pb2.PullRequest(entries=header.pull_after), max_bytes)


def encode_create(specs: Sequence[CreateSpec]) -> tuple[ps_pb2.PushHeader, list[np.ndarray]]:
    """Creates travel as a push of CREATE entries: a value as payload, or an initializer (pickled) with the shape and dtype."""
    header = ps_pb2.PushHeader()
    arrays: list[np.ndarray] = []
    for s in specs:
        e = header.entries.add(name=s.name, op=ps_pb2.CREATE, if_exists=s.if_exists.wire)
        e.offset.extend(int(o) for o in s.offset)
        if s.value is not None:
            value = codec.as_wire_array(s.value, s.dtype)
            codec.spec_to_proto(value.shape, value.dtype, e.value)
            e.has_value = True
            arrays.append(value)
        else:
            codec.spec_to_proto(tuple(s.shape or ()), s.dtype, e.create_spec)
            e.initializer = pickling.dumps(s.initializer)
        if s.optimizer is not None:
            e.optimizer, e.optimizer_digest = optimizer_payload(s.optimizer)
    return header, arrays


def push_payload_specs(header: ps_pb2.PushHeader, max_bytes: int) -> list[ArraySpec]:
    """Check a push header and give the (shape, dtype) of every payload array after it, in order (PS side).

    Everything a header can be wrong about on its own is checked here, before any
    payload is read or anything changes, for both transports: entries present, not a
    mix of creates and updates, known ops and ``if_exists`` codes, a value for every
    update, a name and a value (or an initializer with a shape) for every create, no
    name created twice, well-formed tensor specs. What needs the variables (names
    that exist, shapes and dtypes that match) is the store's to check.

    Raises:
        InvalidRequestError: a malformed header.
        PayloadTooLargeError: an array over ``max_bytes``.
    """
    if not header.entries:
        raise InvalidRequestError("PushHeader has no entries")
    create = is_create(header)
    if create and header.pull_after:
        raise InvalidRequestError("a push that creates variables cannot read any back (pull_after is for PushPull updates)")
    names: set[str] = set()
    specs = []
    for e in header.entries:
        if create:
            _check_create_entry(e, names, max_bytes)
        else:
            op = Op.from_wire(e.op, e.name)
            if not e.has_value:
                raise InvalidRequestError(f"{op.value} on {e.name!r} carries no value")
            if e.has_indices and op not in SPARSE_OPS:
                raise InvalidRequestError(f"{op.value} on {e.name!r} takes no indices")
            if not e.has_indices and op in SPARSE_OPS:
                raise InvalidRequestError(f"{op.value} on {e.name!r} needs indices")
        if e.has_value:
            specs.append(codec.spec_from_proto(e.value, max_bytes))
        if e.has_indices:
            specs.append(codec.spec_from_proto(e.indices, max_bytes))
    return specs


def _check_create_entry(e: ps_pb2.UpdateEntry, names: set[str], max_bytes: int) -> None:
    if not e.name:
        raise InvalidRequestError("variable name must not be empty")
    if e.name in names:
        raise InvalidRequestError(f"variable {e.name!r} is created twice in one push")
    names.add(e.name)
    IfExists.from_wire(e.if_exists)
    if e.has_indices:
        raise InvalidRequestError(f"the create of {e.name!r} carries indices")
    if e.has_value:
        if e.initializer or e.HasField("create_spec"):
            raise InvalidRequestError(f"variable {e.name!r}: give a value or an initializer, not both")
    elif not e.initializer or not e.HasField("create_spec"):
        raise InvalidRequestError(f"variable {e.name!r}: give a value, or an initializer with shape and dtype")
    else:
        codec.spec_from_proto(e.create_spec, max_bytes)


def is_create(header: ps_pb2.PushHeader) -> bool:
    """Whether a push creates variables (it may not mix creates and updates).

    Raises:
        InvalidRequestError: it mixes them.
    """
    creates = [e.op == ps_pb2.CREATE for e in header.entries]
    if any(creates) and not all(creates):
        raise InvalidRequestError("a push either creates variables or updates them, not both")
    return bool(creates) and all(creates)


def decode_updates(header: ps_pb2.PushHeader, arrays: Iterator[np.ndarray]) -> list[Update]:
    """The updates of a push header (checked by :func:`push_payload_specs`) whose payload
    arrays come from ``arrays`` (in payload order)."""
    updates = []
    for e in header.entries:
        op = Op.from_wire(e.op, e.name)
        if not e.has_value:
            raise InvalidRequestError(f"{op.value} on {e.name!r} carries no value")
        value = next(arrays)
        idx = next(arrays) if e.has_indices else None
        updates.append(Update(e.name, op, value, idx))
    return updates


def decode_creates(header: ps_pb2.PushHeader, arrays: Iterator[np.ndarray], max_bytes: int) -> list[Created]:
    """The creates of a CREATE push (checked by :func:`push_payload_specs`) whose payload arrays come from ``arrays``."""
    out = []
    for e in header.entries:
        shape = dtype = None
        if e.HasField("create_spec"):
            shape, dtype = codec.spec_from_proto(e.create_spec, max_bytes)
        out.append(Created(
            name=e.name,
            value=next(arrays) if e.has_value else None,
            shape=shape,
            dtype=dtype,
            initializer=e.initializer,
            offset=tuple(e.offset),
            optimizer=e.optimizer,
            optimizer_digest=e.optimizer_digest,
            if_exists=IfExists.from_wire(e.if_exists),
        ))
    return out


# ------------------------------------------------------------ save and restore
#: Longest checkpoint file name a Save may ask for, in UTF-8 bytes (file systems allow
#: 255; the PS writes ``<name>.tmp-<pid>`` first).
MAX_FILE_NAME_BYTES = 200


def check_file_name(file_name: str, what: str = "file name") -> str:
    """``file_name`` if it is a plain file name (no directory part, not ``.``/``..``, no NUL, not too long).

    Raises:
        InvalidRequestError: it is not.
    """
    if not file_name or file_name in (".", "..") or "/" in file_name or "\0" in file_name:
        raise InvalidRequestError(f"{what} {_short(file_name)} is not a plain file name")
    if len(file_name.encode()) > MAX_FILE_NAME_BYTES:
        raise InvalidRequestError(f"{what} {_short(file_name)} is longer than {MAX_FILE_NAME_BYTES} bytes")
    return file_name


def check_directory(directory: str) -> str:
    """``directory`` if it can name a directory (not empty, no NUL).

    Raises:
        InvalidRequestError: it cannot.
    """
    if not directory or "\0" in directory:
        raise InvalidRequestError(f"directory {_short(directory)} is not a path")
    return directory


def _short(text: str, keep: int = 64) -> str:
    return repr(text) if len(text) <= keep else f"{text[:keep]!r}... ({len(text)} characters)"


def decode_save(req: ps_pb2.SaveRequest) -> tuple[str, str]:
    """``(directory, file_name)`` of a SaveRequest.

    Raises:
        InvalidRequestError: no directory, or a file name that is not a plain name.
    """
    return check_directory(req.directory), check_file_name(req.file_name)


@dataclass
class ExportSpec:
    """A checked ExportRequest (:func:`decode_export`)."""

    directory: str
    file_name: str
    variables: list[tuple[str, int]]  # (name on the PS, first row in the whole variable)
    delta: bool
    base_generation: str
    base_cut: int


def decode_export(req: ps_pb2.ExportRequest) -> ExportSpec:
    """The export a request asks for.

    Raises:
        InvalidRequestError: no directory, a file name that is not a plain name, an empty or
            repeated variable name, a negative row offset or base cut, a delta without a base.
    """
    directory, file_name = check_directory(req.directory), check_file_name(req.file_name)
    names = [e.name for e in req.variables]
    if not all(names):
        raise InvalidRequestError("Export names a variable with an empty name")
    if len(set(names)) != len(names):
        raise InvalidRequestError("Export names a variable twice")
    if any(e.row_offset < 0 for e in req.variables):
        raise InvalidRequestError("Export: a negative row offset")
    if req.base_cut < 0:
        raise InvalidRequestError(f"Export: negative base cut {req.base_cut}")
    if req.delta and not req.base_generation:
        raise InvalidRequestError("Export: a delta needs the base it is relative to (base_generation, base_cut)")
    return ExportSpec(directory, file_name, [(e.name, int(e.row_offset)) for e in req.variables], bool(req.delta),
                      req.base_generation, int(req.base_cut))


@dataclass
class RestorePiece:
    """Rows ``[src_start, src_stop)`` of array ``source`` in checkpoint file ``file``, written at row ``dst_start``."""

    file: str
    sha256: str
    source: str
    src_start: int
    src_stop: int
    dst_start: int


@dataclass
class RestoreEntry:
    """One variable to restore from its pieces (checked: they tile its rows exactly)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    pieces: list[RestorePiece]
    optimizer: bytes
    optimizer_digest: str
    with_optimizer_state: bool


def decode_restore(req: ps_pb2.RestoreRequest, max_bytes: int) -> tuple[str, list[RestoreEntry]]:
    """``(directory, entries)`` of a RestoreRequest.

    A scalar entry has exactly one piece (the whole array). A variable with rows
    has pieces that tile its rows exactly: each non-empty, within the variable,
    none overlapping another, none missing; so a restored value never holds a
    row written twice or never written. Whether a piece's rows exist in its
    file is checked when the file is read.

    Raises:
        InvalidRequestError: a malformed entry or pieces that do not tile the variable.
        PayloadTooLargeError: a variable over ``max_bytes``.
    """
    directory = check_directory(req.directory)
    entries = []
    names: set[str] = set()
    for e in req.entries:
        if not e.name:
            raise InvalidRequestError("variable name must not be empty")
        if e.name in names:
            raise InvalidRequestError(f"variable {_short(e.name)} is restored twice in one request")
        names.add(e.name)
        shape, dtype = codec.spec_from_proto(e.spec, max_bytes)
        pieces = [RestorePiece(check_file_name(p.file, "checkpoint file"), p.sha256, p.source, p.src_start, p.src_stop, p.dst_start)
                  for p in e.pieces]
        _check_tiling(e.name, shape, pieces)
        entries.append(RestoreEntry(e.name, shape, dtype, pieces, e.optimizer, e.optimizer_digest, e.with_optimizer_state))
    return directory, entries


def _check_tiling(name: str, shape: tuple[int, ...], pieces: Sequence[RestorePiece]) -> None:
    if not shape:
        if len(pieces) != 1:
            raise InvalidRequestError(f"scalar {_short(name)} needs exactly one piece, got {len(pieces)}")
        return
    row = 0
    for p in sorted(pieces, key=lambda p: p.dst_start):
        if not 0 <= p.src_start < p.src_stop:
            raise InvalidRequestError(f"piece [{p.src_start}:{p.src_stop}] of {_short(name)} is empty or negative")
        if p.dst_start != row:
            gap = "overlaps the rows before it" if p.dst_start < row else f"leaves rows {row}-{p.dst_start - 1} unwritten"
            raise InvalidRequestError(f"piece at row {p.dst_start} of {_short(name)} {gap}")
        row += p.src_stop - p.src_start
    if row != shape[0]:
        raise InvalidRequestError(f"the pieces of {_short(name)} cover {row} rows, the variable has {shape[0]}")


# ----------------------------------------------------------------- replication
#: One variable as replicated: (name, value, optimizer, optimizer state, version).
#: The optimizer is the PS's own object (it has ``digest`` and ``init``).
InstalledVariable = tuple[str, np.ndarray, Any, Any, int]


def encode_replica_update(updates: Sequence[Update], update_id: str, epoch: int) -> tuple[ps_pb2.ReplicaHeader, list[np.ndarray]]:
    """An applied push as a REPLICA_UPDATE: the same entries and payload as the push."""
    header = ps_pb2.ReplicaHeader(epoch=epoch, kind=ps_pb2.REPLICA_UPDATE)
    _, arrays = encode_push(updates, update_id, out=header.push)
    return header, arrays


def encode_replica_install(
    variables: Sequence[InstalledVariable],
    epoch: int,
    optimizer_blob: Callable[[Any], bytes],
    full_sync: bool = False,
    applied_ids: Sequence[str] = (),
) -> tuple[ps_pb2.ReplicaHeader, list[np.ndarray]]:
    """Whole variables as a REPLICA_INSTALL: per variable its value, then its optimizer state's
    leaves (``jax.tree.leaves`` order); ``optimizer_blob`` gives an optimizer's pickled form."""
    header = ps_pb2.ReplicaHeader(epoch=epoch, kind=ps_pb2.REPLICA_INSTALL, full_sync=full_sync)
    header.applied_ids.extend(applied_ids)
    arrays: list[np.ndarray] = []
    for name, value, opt, state, version in variables:
        e = header.installs.add(name=name, version=version)
        value = codec.as_wire_array(value)
        codec.spec_to_proto(value.shape, value.dtype, e.value)
        arrays.append(value)
        if opt is not None:
            e.optimizer, e.optimizer_digest = optimizer_blob(opt), opt.digest
            for leaf in jax.tree.leaves(state):
                leaf = codec.as_wire_array(np.asarray(leaf))
                codec.spec_to_proto(leaf.shape, leaf.dtype, e.state.add())
                arrays.append(leaf)
    return header, arrays


def encode_replica_delete(names: Sequence[str], epoch: int) -> ps_pb2.ReplicaHeader:
    """Deleted variables as a REPLICA_DELETE (no payload)."""
    header = ps_pb2.ReplicaHeader(epoch=epoch, kind=ps_pb2.REPLICA_DELETE)
    header.deletes.extend(names)
    return header


def replica_payload_specs(header: ps_pb2.ReplicaHeader, max_bytes: int) -> list[ArraySpec]:
    """The (shape, dtype) of every payload array after a replication header, in order."""
    if header.kind == ps_pb2.REPLICA_UPDATE:
        return push_payload_specs(header.push, max_bytes) if header.push.entries else []
    specs = []
    if header.kind == ps_pb2.REPLICA_INSTALL:
        for e in header.installs:
            specs.append(codec.spec_from_proto(e.value, max_bytes))
            specs.extend(codec.spec_from_proto(s, max_bytes) for s in e.state)
    # Dynamic tables' whole shards (a full sync, a restore forwarded) after the variables' arrays.
    specs.extend(dynamic_install_specs(header.dynamic_installs, max_bytes))
    return specs


def out_of_band(t: common_pb2.Tensor, max_bytes: int | None = None) -> ArraySpec | None:
    """The spec of a dynamic install's array whose bytes travel as payload after the header (its
    ``tensor`` carries a spec and no data, for a non-empty array), else None (inline)."""
    if t.data or not t.HasField("spec"):
        return None
    spec = codec.spec_from_proto(t.spec, max_bytes)
    return spec if codec.nbytes_of(*spec) > 0 else None


def dynamic_install_specs(installs: Sequence[ps_pb2.DynamicInstall], max_bytes: int) -> list[ArraySpec]:
    """The (shape, dtype) of every out-of-band array of ``installs``, in order (see :func:`out_of_band`)."""
    out = []
    for m in installs:
        for a in m.arrays:
            spec = out_of_band(a.tensor, max_bytes)
            if spec is not None:
                out.append(spec)
    return out


def decode_replica_installs(
    header: ps_pb2.ReplicaHeader, arrays: Sequence[np.ndarray], optimizer: Callable[[bytes, str], Any]
) -> list[InstalledVariable]:
    """The variables of a REPLICA_INSTALL; ``optimizer(blob, digest)`` gives the PS's optimizer
    object (or None), whose ``init`` rebuilds the state's tree structure."""
    it = iter(arrays)
    out: list[InstalledVariable] = []
    for e in header.installs:
        if not e.name:
            raise InvalidRequestError("variable name must not be empty")
        value = next(it)
        leaves = [next(it) for _ in e.state]
        opt = optimizer(e.optimizer, e.optimizer_digest)
        state = None
        if opt is not None:
            template_leaves, treedef = jax.tree.flatten(opt.init(value))
            if len(template_leaves) != len(leaves):
                raise InvalidRequestError(
                    f"variable {e.name!r}: {len(leaves)} optimizer state leaves sent, its optimizer has {len(template_leaves)}"
                )
            for i, (leaf, want) in enumerate(zip(leaves, template_leaves)):
                if leaf.shape != np.shape(want):  # dtypes may differ (mixed precision moves them); shapes never
                    raise InvalidRequestError(f"variable {e.name!r}: optimizer state leaf {i} has shape {list(leaf.shape)}, "
                                              f"its optimizer makes {list(np.shape(want))}")
            state = jax.tree.unflatten(treedef, leaves)
        elif leaves:
            raise InvalidRequestError(f"variable {e.name!r}: optimizer state sent without an optimizer")
        out.append((e.name, value, opt, state, int(e.version)))
    return out


# ----------------------------------------------------------- synchronous steps
class SyncKind(enum.Enum):
    """A ``SyncSteps`` request (``ps.proto``'s ``SyncStepsKind``); see :mod:`jaxdist.ps_server.sync_steps`."""

    STATUS = "status"
    CONFIGURE = "configure"
    COMMIT = "commit"
    FENCE = "fence"
    DROP = "drop"
    JOIN = "join"
    SKIP = "skip"

    @property
    def wire(self) -> ps_pb2.SyncStepsKind:
        return _SYNC_TO_WIRE[self]

    @classmethod
    def from_wire(cls, code: int) -> SyncKind:
        for k, v in _SYNC_TO_WIRE.items():
            if v == code:
                return k
        raise InvalidRequestError(f"unknown SyncSteps kind {code}")


_SYNC_TO_WIRE: dict[SyncKind, ps_pb2.SyncStepsKind] = {
    SyncKind.STATUS: ps_pb2.SYNC_STATUS,
    SyncKind.CONFIGURE: ps_pb2.SYNC_CONFIGURE,
    SyncKind.COMMIT: ps_pb2.SYNC_COMMIT,
    SyncKind.FENCE: ps_pb2.SYNC_FENCE,
    SyncKind.DROP: ps_pb2.SYNC_DROP,
    SyncKind.JOIN: ps_pb2.SYNC_JOIN,
    SyncKind.SKIP: ps_pb2.SYNC_SKIP,
}


@dataclass
class SyncReport:
    """A PS's step clock (``SyncStepsResponse``): ``clocks`` maps each member to the steps it committed."""

    enabled: bool
    staleness: int
    applied: int
    clocks: dict[int, int]
    waiting: list[int]
    staged_steps: list[int]
    max_lead: int = 0
    uncommitted: int = 0


def encode_sync_request(kind: SyncKind, contributor: int = -1, staleness: int = 0,
                        members: Sequence[int] = (), step: int = -1) -> ps_pb2.SyncStepsRequest:
    return ps_pb2.SyncStepsRequest(kind=kind.wire, contributor=contributor, staleness=staleness,
                                   members=list(members), step=step)


def decode_sync_request(req: ps_pb2.SyncStepsRequest) -> tuple[SyncKind, int, int, list[int], int]:
    """``(kind, contributor, staleness, members, step)``.

    Raises:
        InvalidRequestError: an unknown kind, or a negative worker index where one is needed.
    """
    kind = SyncKind.from_wire(req.kind)
    if kind not in (SyncKind.STATUS, SyncKind.CONFIGURE) and req.contributor < 0:
        raise InvalidRequestError(f"SyncSteps {kind.value} needs a worker index >= 0, got {req.contributor}")
    if kind is SyncKind.CONFIGURE and any(m < 0 for m in req.members):
        raise InvalidRequestError("SyncSteps configure: worker indices must be >= 0")
    return kind, req.contributor, req.staleness, list(req.members), req.step


def encode_sync_report(r: SyncReport) -> ps_pb2.SyncStepsResponse:
    members = sorted(r.clocks)
    return ps_pb2.SyncStepsResponse(
        enabled=r.enabled, staleness=r.staleness, applied=r.applied, members=members,
        clocks=[r.clocks[m] for m in members], waiting=list(r.waiting), staged_steps=list(r.staged_steps),
        max_lead=r.max_lead, uncommitted=r.uncommitted,
    )


def decode_sync_report(resp: ps_pb2.SyncStepsResponse) -> SyncReport:
    return SyncReport(resp.enabled, resp.staleness, resp.applied, dict(zip(resp.members, resp.clocks)),
                      list(resp.waiting), list(resp.staged_steps), resp.max_lead, resp.uncommitted)
