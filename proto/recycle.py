"""Receive buffers that are reused once nobody holds them any more.

Why: a pull answers with a new array every time. A large new array is a fresh
``mmap`` whose pages the kernel must fault in and zero while the bytes arrive:
measured on a 2-core host, filling a fresh 64 MB array ran at 355-565 MB/s
against ~2,700 MB/s into one already touched. With numpy's transparent-huge-page
advice the faults are cheaper when the kernel has free huge pages, but when
memory is fragmented (e.g. right after another large process ran) each fault
may wait for compaction: one fresh fill was seen at 97 MB/s. That is why the
64 MB pull benchmark swung by 2.7x with the order in which systems ran.

The rule that keeps reuse safe: a buffer is handed out again only when the only
references to it are the pool's own. Every numpy view, slice, reshape or
``memoryview`` of an array handed out keeps a reference to the buffer (numpy
points every view at the array owning the memory), and so does anything that
adopts the memory without copying it (``jax.device_put`` of an aligned array
holds the array). So a value the caller still holds, in any form that can see
its bytes, is never overwritten; a value the caller dropped is recycled. Code
that keeps a raw pointer without a Python reference (``arr.ctypes.data``) is
outside that rule and must keep the array alive itself.
"""

from __future__ import annotations

import math
import os
import sys
import threading
from collections.abc import Sequence

import numpy as np

from jaxdist.base.errors import ConfigurationError

__all__ = ["ENV_POOL_BYTES", "MIN_POOLED_BYTES", "RecvPool", "pool", "take"]

#: ``JAXDIST_RECV_POOL_BYTES``: most bytes of receive buffers one process keeps for reuse
#: (default 1 GiB; ``0`` turns reuse off). Buffers the caller holds count too; beyond the cap new
#: buffers are not kept (they are freed as before) and free ones are released oldest first.
ENV_POOL_BYTES = "JAXDIST_RECV_POOL_BYTES"
_DEFAULT_POOL_BYTES = 1 << 30
#: Smaller arrays come from malloc's heap, already faulted in: not worth a pool entry.
MIN_POOLED_BYTES = 1 << 20


def _pool_bytes() -> int:
    raw = os.environ.get(ENV_POOL_BYTES, "").strip()
    if not raw:
        return _DEFAULT_POOL_BYTES
    try:
        value = int(raw)
    except ValueError:
        raise ConfigurationError(f"{ENV_POOL_BYTES}={raw!r}: expected a number of bytes (0 turns reuse off)") from None
    return max(0, value)


class RecvPool:
    """Buffers for received values, reused only when nothing outside the pool references them. Thread-safe.

    Args:
        max_bytes: most bytes kept (None: ``JAXDIST_RECV_POOL_BYTES``, default 1 GiB); 0 keeps nothing.
        min_bytes: arrays smaller than this are plain ``np.empty`` (never pooled).
    """

    def __init__(self, max_bytes: int | None = None, min_bytes: int = MIN_POOLED_BYTES) -> None:
        self.max_bytes = _pool_bytes() if max_bytes is None else max(0, max_bytes)
        self.min_bytes = min_bytes
        self._bufs: list[np.ndarray] = []  # uint8, each owning its memory; oldest first
        # A buffer nobody else references, held exactly as the pool holds its buffers: a buffer is
        # free when ``sys.getrefcount`` counts as many references to it as to this probe through the
        # same expression (so the count of the interpreter's own temporary references cancels out).
        self._probe = [np.empty(0, np.uint8)]
        self._lock = threading.Lock()
        #: Buffers handed out again (reused) and made new (for tests and metrics).
        self.reused = 0
        self.allocated = 0

    @property
    def held_bytes(self) -> int:
        with self._lock:
            return sum(b.nbytes for b in self._bufs)

    def _is_free(self, i: int) -> bool:
        """Whether only the pool references buffer ``i``; call with the lock held."""
        return sys.getrefcount(self._bufs[i]) <= sys.getrefcount(self._probe[0])

    def _free_index(self, nbytes: int) -> int:
        """Index of a free buffer of exactly ``nbytes`` (-1: none); call with the lock held."""
        for i in range(len(self._bufs)):
            if self._bufs[i].nbytes == nbytes and self._is_free(i):
                return i
        return -1

    def empty(self, shape: Sequence[int] | int, dtype: object) -> np.ndarray:
        """An uninitialised C-contiguous array of ``shape`` and ``dtype`` (like ``np.empty``), in a
        recycled buffer when a free one of the same size exists; the caller owns it until it drops
        every reference to it (and to its views)."""
        dt = np.dtype(dtype)  # type: ignore[call-overload]
        shape_t = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        nbytes = math.prod(shape_t) * dt.itemsize
        if nbytes < self.min_bytes or nbytes > self.max_bytes:
            return np.empty(shape_t, dt)
        with self._lock:
            i = self._free_index(nbytes)
            if i >= 0:
                buf = self._bufs.pop(i)
                self._bufs.append(buf)  # most recently used last: the oldest free ones go first
                self.reused += 1
                return buf.view(dt).reshape(shape_t)  # the view references ``buf``: in use from here
            held = sum(b.nbytes for b in self._bufs)
            j = 0
            while held + nbytes > self.max_bytes and j < len(self._bufs):
                if self._is_free(j):
                    held -= self._bufs.pop(j).nbytes
                else:
                    j += 1
            buf = np.empty(nbytes, np.uint8)
            self.allocated += 1
            if held + nbytes <= self.max_bytes:
                self._bufs.append(buf)
            return buf.view(dt).reshape(shape_t)

    def clear(self) -> None:
        """Forget every buffer (those still held by callers stay valid: they are theirs)."""
        with self._lock:
            self._bufs.clear()


#: This process's pool (pulled values, looked-up rows).
pool = RecvPool()


def take(shape: Sequence[int] | int, dtype: object) -> np.ndarray:
    """:meth:`RecvPool.empty` of this process's :data:`pool`."""
    return pool.empty(shape, dtype)
