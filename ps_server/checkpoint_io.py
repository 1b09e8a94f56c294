"""Checkpoint files: one uncompressed numpy ``.npz`` per PS task, written atomically, checksummed.

Why ``.npz``: it is numpy's own archive of ``.npy`` arrays, readable anywhere
with ``numpy.load`` and no jaxdist, handles every dtype we use (bfloat16 via
ml_dtypes), and needs no extra dependency. Keys inside a file:
``param/<variable>`` and ``opt/<variable>/<i>`` (the i-th leaf of the
variable's optax state, in ``jax.tree.leaves`` order).

Atomicity (:class:`jaxdist.base.files.AtomicFile`): the PS writes ``<name>.tmp-<pid>``,
fsyncs it and renames it into place; a crash leaves at most a ``.tmp`` file that no manifest names.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zipfile
from collections.abc import Sequence
from typing import Any, cast

import numpy as np

from jaxdist.base.errors import InvalidRequestError
from jaxdist.base.files import AtomicFile
from jaxdist.proto.ps_wire import RestorePiece

_READ_BLOCK = 8 << 20


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def prepare_directory(directory: str) -> None:
    """Make ``directory`` (and its parents) if missing, ready for :func:`write_npz_atomic`.

    Raises:
        InvalidRequestError: it is a file, or it cannot be made (a parent is a file,
            no permission, a name too long): the caller named a place nothing can be saved.
    """
    try:
        os.makedirs(directory, exist_ok=True)
    except OSError as e:
        raise InvalidRequestError(f"cannot make checkpoint directory {_short(directory)}: {e.strerror}") from None
    if not os.path.isdir(directory):
        raise InvalidRequestError(f"checkpoint directory {_short(directory)} is not a directory")


def write_npz_atomic(directory: str, file_name: str, arrays: dict[str, np.ndarray]) -> tuple[str, int]:
    """Write ``arrays`` to ``directory/file_name`` atomically; returns (sha256, bytes).

    Raises:
        InvalidRequestError: the file cannot be created there (no permission, a
            directory of that name, ...). Failures while writing (a full disk) propagate.
    """
    prepare_directory(directory)
    final = os.path.join(directory, file_name)
    if os.path.isdir(final):
        raise InvalidRequestError(f"checkpoint file {_short(final)} is a directory")
    try:
        out = AtomicFile(final)
    except OSError as e:
        raise InvalidRequestError(f"cannot create checkpoint file {_short(final)}: {e.strerror}") from None
    with out as f:
        np.savez(f, **cast("dict[str, Any]", arrays))  # cast: numpy's stub types **kwds like allow_pickle
    return sha256_file(final), os.path.getsize(final)


def _short(text: str, keep: int = 200) -> str:
    return repr(text) if len(text) <= keep else f"{text[:keep]!r}... ({len(text)} characters)"


#: numpy parses each .npy header with ``ast.literal_eval``, and CPython 3.11's AST constructor is
#: not thread-safe (gh-106905: "SystemError: AST constructor recursion depth mismatch", seen here
#: when restores on two PS tasks of one process read at once): member reads take turns.
_NPY_READ_LOCK = threading.Lock()

class PieceReader:
    """Reads row ranges of arrays out of checkpoint files, verifying each file's checksum once."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._files: dict[str, Any] = {}
        self._cache: dict[tuple[str, str], np.ndarray] = {}

    def _open(self, file: str, sha: str) -> Any:
        f = self._files.get(file)
        if f is None:
            if os.path.basename(file) != file or file in ("", ".", ".."):
                raise InvalidRequestError(f"checkpoint file name {_short(file)} must be a plain name")
            path = os.path.join(self.directory, file)
            if not os.path.isfile(path):
                raise InvalidRequestError(f"checkpoint file {_short(path)} does not exist")
            try:
                if sha and sha256_file(path) != sha:
                    raise InvalidRequestError(f"checkpoint file {_short(path)} is corrupt (sha256 mismatch)")
                f = np.load(path, allow_pickle=False)
            except (OSError, ValueError, zipfile.BadZipFile) as e:
                raise InvalidRequestError(f"checkpoint file {_short(path)} is unreadable: {e}") from None
            self._files[file] = f
        return f

    def array(self, file: str, sha: str, key: str) -> np.ndarray:
        """The whole array ``key`` of ``file`` (checksum verified on first open).

        Raises:
            InvalidRequestError: a missing, corrupt or unreadable file or array.
        """
        return self._array(file, sha, key)

    def _array(self, file: str, sha: str, key: str) -> np.ndarray:
        arr = self._cache.get((file, key))
        if arr is None:
            f = self._open(file, sha)
            if key not in f.files:
                raise InvalidRequestError(f"checkpoint file {file} has no array {_short(key)}")
            try:
                with _NPY_READ_LOCK:
                    arr = f[key]
            except (OSError, ValueError, zipfile.BadZipFile) as e:  # a damaged member, an object array
                raise InvalidRequestError(f"array {_short(key)} of checkpoint file {file} is unreadable: {e}") from None
            self._cache[(file, key)] = arr
        return arr

    def assemble(
        self,
        kind: str,
        pieces: Sequence[RestorePiece],
        shape: tuple[int, ...],
        dtype: np.dtype,
        row_shaped: bool = True,
    ) -> np.ndarray:
        """Build an array of ``shape`` from row pieces; ``kind`` is "param" or "opt#<leaf index>".

        ``pieces`` tile ``shape``'s rows exactly (:func:`~jaxdist.proto.ps_wire.decode_restore`
        checked that); here each piece is checked against the array it reads.
        Non-row-shaped optimizer leaves (step counts) and scalars are taken whole from the first piece.

        Raises:
            InvalidRequestError: a missing file or array, or one that does not fit.
        """
        def key(source: str) -> str:
            return f"param/{source}" if kind == "param" else f"opt/{source}/{kind.split('#', 1)[1]}"

        if not row_shaped or not shape:
            if not pieces:
                raise InvalidRequestError(f"no piece to read {kind} of shape {shape} from")
            p = pieces[0]
            arr = self._array(p.file, p.sha256, key(p.source))
            if arr.shape != tuple(shape):
                raise InvalidRequestError(f"{_short(key(p.source))} has shape {arr.shape}, expected {shape}")
            return _cast(arr, dtype, key(p.source))
        out = np.empty(shape, dtype)
        for p in pieces:
            arr = self._array(p.file, p.sha256, key(p.source))
            rows = p.src_stop - p.src_start
            if arr.ndim != len(shape) or arr.shape[1:] != tuple(shape[1:]) or not (0 <= p.src_start <= p.src_stop <= arr.shape[0]) \
                    or not 0 <= p.dst_start <= shape[0] - rows:
                raise InvalidRequestError(f"piece {_short(key(p.source))}[{p.src_start}:{p.src_stop}] of shape {arr.shape} "
                                          f"does not fit {shape} at row {p.dst_start}")
            out[p.dst_start : p.dst_start + rows] = _cast(arr[p.src_start : p.src_stop], dtype, key(p.source))
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._cache.clear()


def _cast(arr: np.ndarray, dtype: np.dtype, key: str) -> np.ndarray:
    """``arr`` as ``dtype``. ``.npy`` has no code for ml_dtypes types (bfloat16): they are
    saved as raw bytes of their size (``|V2``) and read back by a view."""
    if arr.dtype.type is np.void and dtype.type is not np.void and arr.dtype.itemsize == dtype.itemsize and arr.dtype.fields is None:
        return arr.view(dtype)
    try:
        return arr.astype(dtype, copy=False)
    except (TypeError, ValueError) as e:
        raise InvalidRequestError(f"{_short(key)} ({arr.dtype}) cannot be read as {dtype}: {e}") from None
