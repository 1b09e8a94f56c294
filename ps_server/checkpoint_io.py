"""Checkpoint files: one uncompressed numpy ``.npz`` per PS task, written atomically, checksummed.

Why ``.npz``: it is numpy's own archive of ``.npy`` arrays, readable anywhere
with ``numpy.load`` and no jaxdist, handles every dtype we use (bfloat16 via
ml_dtypes), and needs no extra dependency. Keys inside a file:
``param/<variable>`` and ``opt/<variable>/<i>`` (the i-th leaf of the
variable's optax state, in ``jax.tree.leaves`` order).

Atomicity: the PS writes ``<name>.tmp-<pid>``, fsyncs it and renames it into
place; a crash leaves at most a ``.tmp`` file that no manifest names.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from typing import Any, cast

import numpy as np

from jaxdist.base.errors import InvalidRequestError

_READ_BLOCK = 8 << 20


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_READ_BLOCK):
            h.update(block)
    return h.hexdigest()


def write_npz_atomic(directory: str, file_name: str, arrays: dict[str, np.ndarray]) -> tuple[str, int]:
    """Write ``arrays`` to ``directory/file_name`` atomically; returns (sha256, bytes)."""
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, file_name)
    tmp = f"{final}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **cast("dict[str, Any]", arrays))  # cast: numpy's stub types **kwds like allow_pickle
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return sha256_file(final), os.path.getsize(final)


class PieceReader:
    """Reads row ranges of arrays out of checkpoint files, verifying each file's checksum once."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._files: dict[str, Any] = {}
        self._cache: dict[tuple[str, str], np.ndarray] = {}

    def _open(self, file: str, sha: str) -> Any:
        f = self._files.get(file)
        if f is None:
            if os.path.basename(file) != file:
                raise InvalidRequestError(f"checkpoint file name {file!r} must be a plain name")
            path = os.path.join(self.directory, file)
            if not os.path.exists(path):
                raise InvalidRequestError(f"checkpoint file {path} does not exist")
            if sha and sha256_file(path) != sha:
                raise InvalidRequestError(f"checkpoint file {path} is corrupt (sha256 mismatch)")
            try:
                f = np.load(path, allow_pickle=False)
            except (OSError, ValueError, zipfile.BadZipFile) as e:
                raise InvalidRequestError(f"checkpoint file {path} is unreadable: {e}") from None
            self._files[file] = f
        return f

    def _array(self, file: str, sha: str, key: str) -> np.ndarray:
        arr = self._cache.get((file, key))
        if arr is None:
            f = self._open(file, sha)
            if key not in f.files:
                raise InvalidRequestError(f"checkpoint file {file} has no array {key!r}")
            arr = f[key]
            self._cache[(file, key)] = arr
        return arr

    def assemble(
        self,
        kind: str,
        pieces: list[tuple[str, str, str, int, int, int]],
        shape: tuple[int, ...],
        dtype: np.dtype,
        row_shaped: bool = True,
    ) -> np.ndarray:
        """Build an array of ``shape`` from row pieces; ``kind`` is "param" or "opt#<leaf index>".

        Non-row-shaped optimizer leaves (step counts) are taken whole from the first piece.
        """
        def key(source: str) -> str:
            return f"param/{source}" if kind == "param" else f"opt/{source}/{kind.split('#', 1)[1]}"

        if not row_shaped or not shape:
            file, sha, source, *_ = pieces[0]
            arr = self._array(file, sha, key(source))
            if arr.shape != tuple(shape):
                raise InvalidRequestError(f"optimizer state {key(source)} has shape {arr.shape}, expected {shape}")
            return arr.astype(dtype, copy=False)
        out = np.empty(shape, dtype)
        filled = 0
        for file, sha, source, start, stop, dst in pieces:
            arr = self._array(file, sha, key(source))
            if arr.shape[1:] != tuple(shape[1:]) or not (0 <= start <= stop <= arr.shape[0]) or dst + stop - start > shape[0]:
                raise InvalidRequestError(f"piece {key(source)}[{start}:{stop}] does not fit {shape} at row {dst}")
            out[dst : dst + stop - start] = arr[start:stop]
            filled += stop - start
        if filled != shape[0]:
            raise InvalidRequestError(f"pieces cover {filled} of {shape[0]} rows")
        return out

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._cache.clear()
