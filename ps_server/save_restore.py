"""Save and Restore of one PS task: a consistent cut of its store to one checkpoint file, and back;
and Export, its part of an export for serving (whole, or the changes since an earlier export).

The file format (one ``.npz`` per PS task, written atomically) is
:mod:`jaxdist.ps_server.checkpoint_io`'s; the coordinator writes the manifest
that ties the files of all PS tasks together (:mod:`jaxdist.checkpoint`,
:mod:`jaxdist.serving_export`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import jax
import numpy as np

from jaxdist.proto import codec, ps_pb2, ps_wire
from jaxdist.ps_server import checkpoint_io, export_rows
from jaxdist.ps_server.optimizer import Optimizer
from jaxdist.ps_server.store import VariableStore

__all__ = ["export", "save", "read_restore", "Staged"]

#: A variable read back from a checkpoint, ready to install: (name, value, optimizer, optimizer state).
Staged = tuple[str, np.ndarray, "Optimizer | None", object]


def save(
    store: VariableStore, req: ps_pb2.SaveRequest,
    extra: Callable[[], tuple[dict[str, np.ndarray], list[str]]] | None = None,
) -> ps_pb2.SaveResponse:
    """Write every variable and optimizer state of ``store`` to ``req.directory/req.file_name``.

    Keys: ``param/<name>`` and ``opt/<name>/<i>`` (the i-th leaf of the optax
    state). Every variable lock is held while the file is written, so no push
    is half in it. ``extra()`` (called while they are held) gives more arrays for the file and the
    names of the dynamic tables they hold (``SaveResponse.dynamic_tables``).

    Raises:
        InvalidRequestError: no directory, a file name that is not a plain name
            (:func:`~jaxdist.proto.ps_wire.decode_save`), or a directory that cannot be
            made or written (a file, no permission); nothing is written then.
    """
    directory, file_name = ps_wire.decode_save(req)
    checkpoint_io.prepare_directory(directory)
    with store.frozen() as snapshot:
        arrays: dict[str, np.ndarray] = {}
        out = ps_pb2.SaveResponse(file_name=file_name)
        for name, value, opt_state, version in snapshot:
            leaves = jax.tree.leaves(opt_state) if opt_state is not None else []
            arrays[f"param/{name}"] = value
            for i, leaf in enumerate(leaves):
                arrays[f"opt/{name}/{i}"] = np.asarray(leaf)
            sv = out.variables.add(name=name, version=version, optimizer_leaves=len(leaves))
            codec.spec_to_proto(value.shape, value.dtype, sv.spec)
        if extra is not None:
            more, tables = extra()
            arrays.update(more)
            out.dynamic_tables.extend(tables)
        # Arrays are immutable snapshots (in-place updates copy while readers exist),
        # but writing under the locks keeps the cut exact and simple.
        sha, nbytes = checkpoint_io.write_npz_atomic(directory, file_name, arrays)
    out.sha256, out.bytes = sha, nbytes
    return out


def read_restore(
    req: ps_pb2.RestoreRequest, max_variable_bytes: int, optimizer: Callable[[bytes, str], Optimizer | None]
) -> list[Staged]:
    """Assemble every entry of ``req`` from its pieces (re-sharding allowed), verifying checksums.

    Nothing is installed: the caller installs the result once every entry was
    read, so a bad request or checkpoint changes nothing. ``optimizer(blob, digest)`` gives
    an entry's optimizer (see :class:`~jaxdist.ps_server.optimizer_cache.OptimizerCache`).

    Raises:
        InvalidRequestError: a malformed request (pieces that do not tile a variable
            exactly among others, see :func:`~jaxdist.proto.ps_wire.decode_restore`), a
            missing, corrupt or mismatched file or piece.
        PayloadTooLargeError: a variable over ``max_variable_bytes``.
    """
    directory, entries = ps_wire.decode_restore(req, max_variable_bytes)
    reader = checkpoint_io.PieceReader(directory)
    try:
        staged: list[Staged] = []
        for e in entries:
            value = reader.assemble("param", e.pieces, e.shape, e.dtype)
            opt = optimizer(e.optimizer, e.optimizer_digest)
            state = None
            if opt is not None and e.with_optimizer_state:
                leaves, treedef = jax.tree.flatten(opt.init(value))
                state = jax.tree.unflatten(treedef, [
                    reader.assemble(f"opt#{i}", e.pieces, leaf.shape, leaf.dtype, row_shaped=leaf.shape == e.shape)
                    for i, leaf in enumerate(leaves)
                ])
            staged.append((e.name, value, opt, state))
        return staged
    finally:
        reader.close()


def export(store: VariableStore, req: ps_pb2.ExportRequest,
           participants: Sequence[export_rows.CutParticipant] = ()) -> ps_pb2.ExportResponse:
    """Write this PS's part of an export to ``req.directory/req.file_name`` and make an export cut.

    A full export (``req.delta`` False) writes every named variable whole (``value/<name>``) and
    every keyed table's keys and rows (``keys/<table>``, ``rows/<table>``). A delta writes, per
    variable, its changed rows since the base cut (``ids/<name>``: global row numbers, the shard's
    ``row_offset`` added, ascending; ``rows/<name>``), or the variable whole when it changed as a
    whole (a dense update); per keyed table the rows of the keys updated and the keys evicted
    (``evicted/<table>``). Names are :func:`~jaxdist.ps_server.export_rows.value_key` and its
    siblings. The cut is taken under every lock (no push is half in it); the file is written after
    the locks are released, atomically (fsynced, renamed). When the base cannot be answered
    (:class:`~jaxdist.ps_server.export_rows.ChangeTracker`), nothing is written and
    ``delta_unavailable`` is set.

    Raises:
        InvalidRequestError: a malformed request (:func:`~jaxdist.proto.ps_wire.decode_export`), a
            directory or file that cannot be written; nothing is cut then.
        VariableNotFoundError: a named variable is not on this PS (nothing is cut).
    """
    spec = ps_wire.decode_export(req)
    checkpoint_io.prepare_directory(spec.directory)
    offsets = dict(spec.variables)
    with store.export_cut([n for n, _ in spec.variables], spec.base_generation, spec.base_cut, spec.delta,
                          participants) as (result, parts, keyed):
        out = ps_pb2.ExportResponse(file_name=spec.file_name, generation=result.generation, cut=result.cut)
        if not result.available:
            out.delta_unavailable = True
            return out
        arrays: dict[str, np.ndarray] = {}
        for part in parts:
            ev = out.variables.add(name=part.name, whole=part.value is not None)
            codec.spec_to_proto(part.shape, part.dtype, ev.spec)
            if part.value is not None:
                arrays[export_rows.value_key(part.name)] = part.value
                ev.rows = part.shape[0] if part.shape else 1
            else:
                assert part.ids is not None and part.rows is not None
                arrays[export_rows.ids_key(part.name)] = part.ids + offsets[part.name]
                arrays[export_rows.rows_key(part.name)] = part.rows
                ev.rows = len(part.ids)
        for p, (keys, values, evicted) in zip(participants, keyed):
            out.tables.append(p.name)
            arrays[export_rows.keys_key(p.name)] = keys
            arrays[export_rows.rows_key(p.name)] = values
            if evicted is not None:
                # Not keys.dtype: a unicode dtype has a width, and an evicted string may be longer.
                arrays[export_rows.evicted_key(p.name)] = (
                    np.asarray(evicted, dtype=np.int64 if keys.dtype.kind in "iu" else str) if evicted else keys[:0])
            elif spec.delta:
                out.whole_tables.append(p.name)
        sha, nbytes = checkpoint_io.write_npz_atomic(spec.directory, spec.file_name, arrays)
    out.sha256, out.bytes = sha, nbytes
    return out
