"""Arrays on the wire: dtype + shape + raw little-endian bytes.

Large payloads travel as raw frames (see ``ps.proto``): a header message, then
the tensors' bytes concatenated and cut into chunks of at most
:data:`CHUNK_BYTES`. :func:`iter_frames` produces those chunks with one copy per
byte (numpy buffers -> one ``bytes`` per frame); :class:`FrameReader` writes incoming chunks
straight into preallocated numpy arrays (one copy per byte) and detects
truncated or over-long streams exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

import ml_dtypes
import numpy as np

from jaxdist.base.errors import InvalidRequestError, PayloadTooLargeError
from jaxdist.proto import common_pb2
from jaxdist.proto.recycle import take as recycle_take

#: Frames carry at most this many payload bytes. gRPC moves 1-4 MiB streamed
#: chunks ~3x faster than one huge unary message on this kind of machine.
CHUNK_BYTES = 4 << 20

_NP_TO_PROTO: dict[np.dtype, common_pb2.DType] = {
    np.dtype(np.float32): common_pb2.FLOAT32,
    np.dtype(np.float64): common_pb2.FLOAT64,
    np.dtype(ml_dtypes.bfloat16): common_pb2.BFLOAT16,
    np.dtype(np.float16): common_pb2.FLOAT16,
    np.dtype(np.int8): common_pb2.INT8,
    np.dtype(np.int16): common_pb2.INT16,
    np.dtype(np.int32): common_pb2.INT32,
    np.dtype(np.int64): common_pb2.INT64,
    np.dtype(np.uint8): common_pb2.UINT8,
    np.dtype(np.uint16): common_pb2.UINT16,
    np.dtype(np.uint32): common_pb2.UINT32,
    np.dtype(np.uint64): common_pb2.UINT64,
    np.dtype(np.bool_): common_pb2.BOOL,
}
_PROTO_TO_NP: dict[int, np.dtype] = {v: k for k, v in _NP_TO_PROTO.items()}

#: Shapes with more dimensions than this are rejected as malformed.
MAX_RANK = 32
#: The most bytes the non-zero dims of a shape may span (numpy's own limit: its largest index).
_MAX_EXTENT = int(np.iinfo(np.intp).max)


def canonical_dtype(dtype: object) -> np.dtype:
    """The numpy dtype jaxdist stores for ``dtype`` (native byte order).

    Raises:
        InvalidRequestError: the dtype cannot travel on the wire.
    """
    try:
        dt = np.dtype(dtype)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidRequestError(f"unsupported dtype {dtype!r}") from None
    dt = dt.newbyteorder("=") if dt.byteorder not in ("=", "|") else dt
    if dt not in _NP_TO_PROTO:
        raise InvalidRequestError(
            f"unsupported dtype {dt}; supported: {', '.join(sorted(str(d) for d in _NP_TO_PROTO))}"
        )
    return dt


def dtype_to_proto(dtype: object) -> common_pb2.DType:
    return _NP_TO_PROTO[canonical_dtype(dtype)]


def dtype_from_proto(code: int) -> np.dtype:
    try:
        return _PROTO_TO_NP[code]
    except KeyError:
        raise InvalidRequestError(f"unknown wire dtype code {code}") from None


def spec_to_proto(shape: Sequence[int], dtype: object, out: common_pb2.TensorSpec | None = None) -> common_pb2.TensorSpec:
    spec = out if out is not None else common_pb2.TensorSpec()
    spec.dtype = dtype_to_proto(dtype)
    del spec.shape[:]
    spec.shape.extend(int(d) for d in shape)
    return spec


def spec_from_proto(spec: common_pb2.TensorSpec, max_bytes: int | None = None) -> tuple[tuple[int, ...], np.dtype]:
    """Validate a wire spec and return ``(shape, dtype)``.

    Raises:
        InvalidRequestError: negative dims, too many dims, unknown dtype, or an empty
            shape whose other dims no array can have (``[0, 2**62, 2**62]``).
        PayloadTooLargeError: the tensor would exceed ``max_bytes`` (or any memory).
    """
    dtype = dtype_from_proto(spec.dtype)
    if len(spec.shape) > MAX_RANK:
        raise InvalidRequestError(f"tensor rank {len(spec.shape)} exceeds the limit of {MAX_RANK}")
    shape = tuple(int(d) for d in spec.shape)
    if any(d < 0 for d in shape):
        raise InvalidRequestError(f"negative dimension in shape {shape}")
    nbytes = math.prod(shape) * dtype.itemsize
    if max_bytes is not None and nbytes > max_bytes:
        raise PayloadTooLargeError(f"tensor of shape {shape} and dtype {dtype} is {nbytes} bytes; the limit is {max_bytes}")
    # numpy refuses any shape whose non-zero dims span more bytes than an index can
    # address, even when a zero dim makes it empty ([0, 2**62, 2**62]): such a shape
    # describes no array anyone could have sent.
    extent = math.prod(d for d in shape if d) * dtype.itemsize
    if extent > _MAX_EXTENT:
        if nbytes:
            raise PayloadTooLargeError(f"tensor of shape {shape} and dtype {dtype} is {nbytes} bytes")
        raise InvalidRequestError(f"shape {shape} has no elements but dimensions no array can have")
    return shape, dtype


def as_wire_array(value: object, dtype: object | None = None) -> np.ndarray:
    """A C-contiguous, native little-endian numpy array for ``value`` (no copy if already one)."""
    arr = np.asarray(value)
    dt = canonical_dtype(arr.dtype if dtype is None else dtype)
    if arr.dtype != dt:  # also turns big-endian input into native little-endian
        arr = arr.astype(dt)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    return arr


def nbytes_of(shape: Sequence[int], dtype: np.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def tensor_to_proto(value: object, out: common_pb2.Tensor | None = None) -> common_pb2.Tensor:
    """Inline encoding for small tensors (indices, scalars)."""
    arr = as_wire_array(value)
    t = out if out is not None else common_pb2.Tensor()
    spec_to_proto(arr.shape, arr.dtype, t.spec)
    t.data = arr.tobytes()
    return t


def tensor_from_proto(t: common_pb2.Tensor, max_bytes: int | None = None) -> np.ndarray:
    shape, dtype = spec_from_proto(t.spec, max_bytes)
    want = nbytes_of(shape, dtype)
    if len(t.data) != want:
        raise InvalidRequestError(f"tensor of shape {shape} and dtype {dtype} needs {want} bytes, got {len(t.data)}")
    return np.frombuffer(t.data, dtype=dtype).reshape(shape)


def iter_frames(arrays: Iterable[np.ndarray], chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Yield the arrays' bytes, concatenated, in frames of exactly ``chunk_bytes`` (the last may be shorter).

    Each frame is built by one ``bytes.join`` over memoryview slices of the
    arrays, so every payload byte is copied exactly once here (gRPC needs a
    ``bytes`` object per message). Small arrays share frames, so a push of
    many tiny variables costs a few messages, not one per variable. The
    arrays must stay unmodified until the generator is exhausted.
    """
    parts: list[memoryview] = []
    size = 0
    for arr in arrays:
        mv = as_memoryview(byte_view(arr))
        pos, n = 0, len(mv)
        while pos < n:
            take = min(chunk_bytes - size, n - pos)
            parts.append(mv[pos : pos + take])
            size += take
            pos += take
            if size == chunk_bytes:
                yield b"".join(parts)
                parts, size = [], 0
    if parts:
        yield b"".join(parts)


def _fits(arr: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> bool:
    return arr.shape == tuple(shape) and arr.dtype == dtype and arr.flags.c_contiguous and arr.flags.writeable


def as_memoryview(arr: np.ndarray) -> memoryview:
    """``memoryview(arr)``; numpy's stubs here lack ``__buffer__``, so mypy cannot see an ndarray is a Buffer."""
    return memoryview(arr)  # type: ignore[arg-type]


def byte_view(arr: np.ndarray) -> np.ndarray:
    """A flat uint8 view of a C-contiguous array (works for bfloat16 and 0-d arrays too)."""
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


#: Alignment of the arrays a PS receives gradients into. XLA's CPU client adopts a
#: 64-byte-aligned numpy buffer without copying it (``jax.device_put`` or a jitted call),
#: while malloc only guarantees 16: measured, 8 MB went into XLA in 0.05 ms instead of 1.8 ms.
#: Pulled values are not aligned: in the 2-worker pull benchmark, receiving into aligned
#: arrays was ~15% slower (4 A/B runs; cause not found), more than the MLP gained.
ALIGNMENT = 64


def empty_aligned(shape: Sequence[int] | int, dtype: object) -> np.ndarray:
    """``np.empty`` whose data starts on an :data:`ALIGNMENT`-byte boundary."""
    dt = np.dtype(dtype)  # type: ignore[call-overload]
    shape_t = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape_t) * dt.itemsize
    buf = np.empty(nbytes + ALIGNMENT, np.uint8)
    start = (-buf.ctypes.data) % ALIGNMENT
    return buf[start : start + nbytes].view(dt).reshape(shape_t)


def destination_arrays(
    specs: Sequence[tuple[tuple[int, ...], np.dtype]], out: Sequence[np.ndarray | None] | None = None, aligned: bool = False,
    recycle: bool = False,
) -> list[np.ndarray]:
    """One array per spec to receive into: ``out[i]`` when it is writable, C-contiguous and
    matches spec ``i`` (e.g. a shard's rows of a preallocated full variable), else a new one,
    :func:`empty_aligned` with ``aligned`` (a PS's gradients go into a jitted optimizer step), or
    with ``recycle`` one from :mod:`jaxdist.proto.recycle` (a buffer no one references any more:
    values a client pulls, which callers usually drop by the next pull)."""
    outs = list(out) if out is not None else []
    outs += [None] * (len(specs) - len(outs))
    new = empty_aligned if aligned else recycle_take if recycle else np.empty
    return [o if o is not None and _fits(o, shape, dtype) else new(shape, dtype) for (shape, dtype), o in zip(specs, outs)]


class FrameReader:
    """Writes raw frames into preallocated arrays of the given specs.

    Call :meth:`feed` for each frame and :meth:`finish` after the last one.
    """

    def __init__(
        self,
        specs: Sequence[tuple[tuple[int, ...], np.dtype]],
        out: Sequence[np.ndarray | None] | None = None,
        aligned: bool = False,
        recycle: bool = False,
    ) -> None:
        """``out`` optionally gives, per spec, a writable C-contiguous array to fill in place
        (e.g. a shard's rows of a preallocated full variable); one that does not
        match its spec's shape and dtype is ignored and a new array is allocated."""
        self.arrays = destination_arrays(specs, out, aligned, recycle)
        self._views = [as_memoryview(byte_view(a)) if a.nbytes else None for a in self.arrays]
        self._idx = 0
        self._pos = 0
        self._skip_empty()
        self.total = sum(a.nbytes for a in self.arrays)
        self.received = 0

    def _skip_empty(self) -> None:
        while self._idx < len(self._views) and self._views[self._idx] is None:
            self._idx += 1

    def feed(self, frame: bytes) -> None:
        n = len(frame)
        if self.received + n > self.total:
            raise InvalidRequestError(f"stream carries more than the {self.total} payload bytes its header announced")
        self.received += n
        src = memoryview(frame)
        off = 0
        while off < n:
            view = self._views[self._idx]
            assert view is not None
            take = min(len(view) - self._pos, n - off)
            view[self._pos : self._pos + take] = src[off : off + take]
            off += take
            self._pos += take
            if self._pos == len(view):
                self._idx += 1
                self._pos = 0
                self._skip_empty()

    def finish(self) -> list[np.ndarray]:
        if self.received != self.total:
            raise InvalidRequestError(
                f"truncated stream: got {self.received} of the {self.total} payload bytes its header announced"
            )
        return self.arrays
