"""ShardedVariable: one logical variable cut along dim 0 into shards on several PS tasks.

Layout follows TF's "div" strategy exactly: with ``k`` shards of a ``dim0``-row
variable, the first ``dim0 % k`` shards hold ``dim0 // k + 1`` rows, the rest
``dim0 // k``; shard ``i`` is the variable ``{name}/part_{i}``.

Row access (``sparse_read``, ``embedding_lookup``, ``scatter_*``, sparse
gradients) moves only the rows asked for, from/to the shards that own them,
one call per PS task, all in parallel.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.partitioners import shard_offsets
from jaxdist.proto import recycle
from jaxdist.transport.dataplane import SHM_SLOT_BYTES
from jaxdist.proto.ps_wire import PullSpec
from jaxdist.variables import Variable, VariableOps, locate_rows, pull, pull_specs

#: A lookup whose answer from each PS task is at most this many bytes sends every request before it
#: reads any answer (:func:`jaxdist.variables.pull_specs`' ``pipelined``): a PS then writes its whole
#: answer without waiting for this process (two shared-memory slots; the socket's buffer is as large).
_PIPELINED_BYTES = 2 * SHM_SLOT_BYTES

__all__ = ["ShardedVariable", "embedding_lookup"]


class ShardedVariable(VariableOps):
    """A variable partitioned along dim 0; ``variables`` are its shards (jaxdist Variables)."""

    def __init__(self, name: str, variables: Sequence[Variable]) -> None:
        if not variables:
            raise ValueError("a ShardedVariable needs at least one shard")
        if not all(isinstance(v, Variable) for v in variables):
            kinds = sorted({type(v).__name__ for v in variables if not isinstance(v, Variable)})
            raise ValueError(f"Expected a list of jaxdist Variables (the shards), got {', '.join(kinds)} among them")
        first = variables[0]
        if any(v.dtype != first.dtype for v in variables):
            raise ValueError(f"shards must have the same dtype, got {sorted({str(v.dtype) for v in variables})}")
        if any(v.shape[1:] != first.shape[1:] for v in variables):
            raise ValueError(
                f"shards must have the same shapes except in the first dimension (every dimension but the first), got "
                f"{[tuple(v.shape) for v in variables]}")
        self.name = name
        self.variables = list(variables)
        self.dtype = first.dtype
        self.shape = (sum(v.shape[0] for v in variables),) + first.shape[1:]
        self._offsets = np.array(shard_offsets(self.shape[0], len(variables)), dtype=np.int64)
        if [int(b - a) for a, b in zip(self._offsets[:-1], self._offsets[1:])] != [v.shape[0] for v in variables]:
            raise ValueError("shard sizes do not follow TF's 'div' layout")
        self.trainable = first.trainable

    def __repr__(self) -> str:
        return f"<jaxdist.ShardedVariable {self.name!r} shape={self.shape} dtype={self.dtype} shards={len(self.variables)}>"

    def shards(self) -> list[tuple[Variable, int]]:
        """``(shard, first row)`` per shard (``{name}/part_{i}``), in row order."""
        return [(v, int(row)) for v, row in zip(self.variables, self._offsets[:-1])]

    def numpy(self) -> np.ndarray:
        """The full value (all shards pulled in parallel, each into its rows of one array)."""
        return pull(self)

    def _split_rows(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        try:
            return locate_rows(self.shards(), self.shape[0], idx)
        except IndexError as e:
            raise IndexError(f"{e} for {self.name!r}") from None

    def sparse_read(self, indices: Any) -> np.ndarray:
        """Rows ``indices`` (any int array shape); pulls only those rows, de-duplicated."""
        idx = np.asarray(indices, dtype=np.int64)
        flat = idx.reshape(-1)
        uniq, inverse = np.unique(flat, return_inverse=True)
        if uniq.size and (uniq[0] < 0 or uniq[-1] >= self.shape[0]):
            raise IndexError(f"row index out of range [0, {self.shape[0]}) for {self.name!r}")
        # ``uniq`` is sorted and shards are contiguous row ranges in row order: each shard's rows are
        # one slice of it, found by binary search, and the shards' answers land, in place, in
        # consecutive slices of one buffer (no per-row shard lookup, no scatter of the answers).
        cuts = np.searchsorted(uniq, self._offsets)
        out = recycle.take((len(uniq),) + self.shape[1:], self.dtype)
        by_ps: dict[int, list[PullSpec]] = defaultdict(list)
        outs: dict[int, list[np.ndarray | None]] = defaultdict(list)
        for s, v in enumerate(self.variables):
            a, b = int(cuts[s]), int(cuts[s + 1])
            if a == b:
                continue
            by_ps[v.ps_index].append(PullSpec(v.name, indices=uniq[a:b] - self._offsets[s]))
            outs[v.ps_index].append(out[a:b])
        if by_ps:
            # Answers that fit a data-plane connection's buffers (both shared-memory slots) are read
            # after every request went out, from this thread: no thread hand-off per PS task.
            row_bytes = out.nbytes // max(1, len(uniq))
            pipelined = max(sum(len(sp.indices) for sp in specs if sp.indices is not None) for specs in by_ps.values()
                            ) * row_bytes <= _PIPELINED_BYTES
            results = pull_specs(self.variables[0].connections(), dict(by_ps), outs=dict(outs), pipelined=pipelined)
            for ps, dests in outs.items():
                for dest, (value, _ver) in zip(dests, results[ps]):
                    if value is not dest:  # received elsewhere (the transport could not write in place)
                        assert dest is not None and value is not None
                        dest[...] = value
        if len(uniq) == len(flat) and np.array_equal(uniq, flat):
            return out.reshape(idx.shape + self.shape[1:])  # sorted distinct ids: no gather
        # np.take, not out[inverse]: about half the time for rows; into a recycled buffer (the
        # caller's until it drops it, see jaxdist.proto.recycle). ``inverse`` is in range by
        # construction, and mode="clip" lets np.take write straight into ``rows`` (mode="raise"
        # with ``out`` goes through a buffered copy).
        rows = recycle.take((len(flat),) + self.shape[1:], self.dtype)
        np.take(out, inverse.reshape(-1), axis=0, out=rows, mode="clip")
        return rows.reshape(idx.shape + self.shape[1:])

    def embedding_lookup(self, ids: Any) -> np.ndarray:
        return self.sparse_read(ids)

    def __getitem__(self, key: Any) -> np.ndarray:
        """numpy indexing of the whole value (TF's ``ShardedVariable.__getitem__``).

        An int or a slice on dim 0 (then anything on the other dimensions) pulls only the rows it
        selects; an Ellipsis, ``np.newaxis`` or a boolean mask first reads the whole value. Like TF,
        array scalars (a ``jax.Array``, a numpy 0-d array) are not allowed as an index or slice bound:
        write ``int(i)``.
        """
        parts = key if isinstance(key, tuple) else (key,)
        for k in parts:
            bounds = (k.start, k.stop, k.step) if isinstance(k, slice) else (k,)
            if any(_array_scalar(b) for b in bounds):
                raise TypeError(
                    f"indexing a ShardedVariable with an array ({type(k).__name__}) is not allowed, as in TF; "
                    "use Python ints (int(i))")
        first, rest = parts[0], parts[1:]
        if isinstance(first, (int, np.integer)) and not isinstance(first, bool):
            n = self.shape[0]
            if not -n <= int(first) < n:
                raise IndexError(f"index {int(first)} is out of bounds for axis 0 with size {n} of {self.name!r}")
            row = self.sparse_read(np.array([int(first) % n]))[0]
            return row[rest] if rest else row
        if isinstance(first, slice):
            rows = self.sparse_read(np.arange(self.shape[0])[first])
            return rows[(slice(None),) + rest] if rest else rows
        if first is Ellipsis or first is None or (isinstance(first, np.ndarray) and first.dtype == np.bool_):
            return self.numpy()[key]
        raise TypeError(
            f"ShardedVariable supports int, slice, Ellipsis, np.newaxis and boolean-mask indexing, got {type(first).__name__}")


def _array_scalar(x: Any) -> bool:
    """Whether ``x`` is an array standing for a scalar (TF's tensor index, which it refuses)."""
    return isinstance(x, jax.Array) or (isinstance(x, np.ndarray) and x.ndim == 0)


def embedding_lookup(table: ShardedVariable | Variable, ids: Any) -> np.ndarray:
    """Rows ``ids`` of ``table`` (TF's ``tf.nn.embedding_lookup``), pulling only those rows."""
    return table.sparse_read(ids)
