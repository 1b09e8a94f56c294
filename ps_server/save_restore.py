"""Save and Restore of one PS task: a consistent cut of its store to one checkpoint file, and back.

The file format (one ``.npz`` per PS task, written atomically) is
:mod:`jaxdist.ps_server.checkpoint_io`'s; the coordinator writes the manifest
that ties the files of all PS tasks together (:mod:`jaxdist.checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import numpy as np

from jaxdist.base.errors import InvalidRequestError
from jaxdist.proto import codec, ps_pb2
from jaxdist.ps_server import checkpoint_io
from jaxdist.ps_server.optimizer import Optimizer
from jaxdist.ps_server.store import VariableStore

__all__ = ["save", "read_restore", "Staged"]

#: A variable read back from a checkpoint, ready to install: (name, value, optimizer, optimizer state).
Staged = tuple[str, np.ndarray, "Optimizer | None", object]


def save(store: VariableStore, req: ps_pb2.SaveRequest) -> ps_pb2.SaveResponse:
    """Write every variable and optimizer state of ``store`` to ``req.directory/req.file_name``.

    Keys: ``param/<name>`` and ``opt/<name>/<i>`` (the i-th leaf of the optax
    state). Every variable lock is held while the file is written, so no push
    is half in it.

    Raises:
        InvalidRequestError: no directory, or a file name that is not a plain name.
    """
    if not req.directory or not req.file_name or "/" in req.file_name:
        raise InvalidRequestError("Save needs a directory and a plain file name")
    with store.frozen() as snapshot:
        arrays: dict[str, np.ndarray] = {}
        out = ps_pb2.SaveResponse(file_name=req.file_name)
        for name, value, opt_state, version in snapshot:
            leaves = jax.tree.leaves(opt_state) if opt_state is not None else []
            arrays[f"param/{name}"] = value
            for i, leaf in enumerate(leaves):
                arrays[f"opt/{name}/{i}"] = np.asarray(leaf)
            sv = out.variables.add(name=name, version=version, optimizer_leaves=len(leaves))
            codec.spec_to_proto(value.shape, value.dtype, sv.spec)
        # Arrays are immutable snapshots (in-place updates copy while readers exist),
        # but writing under the locks keeps the cut exact and simple.
        sha, nbytes = checkpoint_io.write_npz_atomic(req.directory, req.file_name, arrays)
    out.sha256, out.bytes = sha, nbytes
    return out


def read_restore(
    req: ps_pb2.RestoreRequest, max_variable_bytes: int, optimizer: Callable[[bytes, str], Optimizer | None]
) -> list[Staged]:
    """Assemble every entry of ``req`` from its pieces (re-sharding allowed), verifying checksums.

    Nothing is installed: the caller installs the result once every entry was
    read, so a bad checkpoint changes nothing. ``optimizer(blob, digest)`` gives
    an entry's optimizer (see :class:`~jaxdist.ps_server.optimizer_cache.OptimizerCache`).

    Raises:
        InvalidRequestError: a missing, corrupt or mismatched file or piece.
    """
    reader = checkpoint_io.PieceReader(req.directory)
    try:
        staged: list[Staged] = []
        for e in req.entries:
            shape, dtype = codec.spec_from_proto(e.spec, max_variable_bytes)
            pieces = [(p.file, p.sha256, p.source, p.src_start, p.src_stop, p.dst_start) for p in e.pieces]
            value = reader.assemble("param", pieces, shape, dtype)
            opt = optimizer(e.optimizer, e.optimizer_digest)
            state = None
            if opt is not None and e.with_optimizer_state:
                leaves, treedef = jax.tree.flatten(opt.init(value))
                state = jax.tree.unflatten(treedef, [
                    reader.assemble(f"opt#{i}", pieces, leaf.shape, leaf.dtype, row_shaped=leaf.shape == shape)
                    for i, leaf in enumerate(leaves)
                ])
            staged.append((e.name, value, opt, state))
        return staged
    finally:
        reader.close()
