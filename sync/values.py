"""Per-replica values.

A :class:`PerReplica` holds one value per replica. Under the hood it is one
global array of shape ``(num_replicas, *value_shape)`` whose leading axis is
sharded over the strategy's ``"replica"`` mesh axis, so replica ``r``'s value
lives on replica ``r``'s device and nothing is copied when it is fed back into
:meth:`Strategy.run`.

A per-replica *batch* (what a distributed dataset yields) may give replicas
different numbers of rows, as TF does for a short batch (20 rows over 8
replicas: ``[3, 3, 3, 3, 3, 3, 2, 0]``). XLA needs one static shape, so every
replica's slice is zero-padded to the same row count and the real counts
travel with the value (:attr:`PerReplica.row_counts`): ``values`` and
``experimental_local_results`` give each replica's real rows only, and inside
``strategy.run`` jaxdist's loss helper and metrics ignore the padding rows
(see :attr:`jaxdist.sync.ReplicaContext.row_mask`).

Replicated values (TF's "mirrored" values: outputs of ``run`` that are the
same on every replica, results of ``reduce``) are plain ``jax.Array``s with a
fully replicated ``NamedSharding`` over the same mesh; the strategy remembers
which arrays it produced (:class:`MirroredRegistry`) so that ``reduce`` and
``gather`` can tell them from non-distributed values, as TF does.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import jax
import numpy as np

__all__ = ["PerReplica", "is_per_replica", "MirroredRegistry"]


def is_array_like(x: object) -> bool:
    """Whether ``x`` is an array or a number: a leaf that ``run`` passes as a value (anything else is static)."""
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def is_tracer(x: object) -> bool:
    """Whether ``x`` is a JAX tracer (a value inside a trace: ``jax.jit``, ``jaxdist.function``, ``run``)."""
    return isinstance(x, jax.core.Tracer)


class PerReplica:
    """One value per replica (TF's ``tf.distribute.DistributedValues``/``PerReplica``).

    Registered as a JAX pytree node whose children are the stacked array (and,
    for a batch with uneven replicas, the per-replica row counts), so
    ``jax.tree.map``, ``jax.jit`` and ``jax.lax.scan`` carry it.

    Args:
        stacked: array of shape ``(num_replicas, *value_shape)``; row ``r`` is
            replica ``r``'s value. Usually a ``jax.Array`` sharded over the
            replica axis; a numpy array is accepted (it is placed on the
            devices the next time a strategy uses it).
        row_counts: for per-replica batches only: int array ``(num_replicas,)``,
            replica ``r``'s real rows (the rest of its ``value_shape[0]`` rows
            are zero padding).
        host_row_counts: the same counts as a host numpy array, when the
            maker has them (saves a device transfer when they are needed).
        guard: whether ``strategy.run`` must check that ``fn`` handles the
            padding rows (distributed datasets set it unless ``with_mask=True``).
        origin: set by ``strategy.run`` on the per-replica values it returns:
            (fn's name, fn's output tree, leaf index), so that ``run`` can warn
            when such a value is fed back where a replicated one went before.
    """

    __slots__ = ("_stacked", "_rows", "_rows_host", "_guard", "_origin")

    def __init__(
        self,
        stacked: Any,
        row_counts: Any = None,
        *,
        host_row_counts: np.ndarray | None = None,
        guard: bool = False,
        origin: tuple[str, Any, int] | None = None,
    ) -> None:
        if not hasattr(stacked, "shape") or len(stacked.shape) < 1:
            raise ValueError(
                "PerReplica wants an array with a leading replica axis, got "
                f"{type(stacked).__name__} with shape {getattr(stacked, 'shape', None)}"
            )
        if row_counts is not None and len(stacked.shape) < 2:
            raise ValueError("row_counts need per-replica values with a leading (batch) dimension")
        self._stacked = stacked
        self._rows = row_counts
        # Host copy of the row counts (when known without a device transfer).
        self._rows_host = host_row_counts
        self._guard = guard
        self._origin = origin

    @property
    def stacked(self) -> Any:
        """The global array ``(num_replicas, *value_shape)`` (padding rows included)."""
        return self._stacked

    @property
    def row_counts(self) -> Any:
        """Real rows per replica for a batch split unevenly (None: every row is real)."""
        return self._rows

    @property
    def known_host_row_counts(self) -> np.ndarray | None:
        """The row counts on the host if they are known without a device transfer, else None."""
        return self._rows_host

    @property
    def guard(self) -> bool:
        """Whether ``strategy.run`` checks that ``fn`` handles this batch's padding rows."""
        return self._guard

    @property
    def origin(self) -> tuple[str, Any, int] | None:
        """For a per-replica output of ``strategy.run``: (fn's name, its output tree, leaf index), else None."""
        return self._origin

    @property
    def num_replicas(self) -> int:
        return int(self._stacked.shape[0])

    @property
    def shape(self) -> tuple[int, ...]:
        """Shape of one replica's (padded) value."""
        return tuple(self._stacked.shape[1:])

    @property
    def dtype(self) -> Any:
        return self._stacked.dtype

    @property
    def values(self) -> tuple[Any, ...]:
        """This process's replicas' values, in replica order (TF's ``PerReplica.values``).

        In a multi-process job only the replicas on this process's devices
        are included, as TF's ``experimental_local_results``. For a batch with
        row counts each value holds that replica's real rows only (possibly 0).
        """
        return tuple(v for _, v in self.local_items())

    def host_row_counts(self) -> np.ndarray | None:
        """Every replica's real row count on the host (None: every row is real).

        Fetched from the devices the first time (in a multi-process job, an
        all-gather: every process must call it), then kept.
        """
        if self._rows is None:
            return None
        if self._rows_host is None:
            self._rows_host = _global_rows(self._rows)
        return self._rows_host

    def local_items(self) -> list[tuple[int, Any]]:
        """``(replica_id, value)`` for each replica addressable from this process."""
        x = self._stacked
        rows = self.host_row_counts()
        if isinstance(x, jax.Array):
            out = []
            for shard in x.addressable_shards:
                start = shard.index[0].start if shard.index and shard.index[0].start is not None else 0
                data = shard.data
                for i in range(data.shape[0]):
                    out.append((start + i, data[i]))
            # A fully replicated array has every row on every device: keep one copy per row.
            seen: dict[int, Any] = {}
            for rid, v in sorted(out, key=lambda t: t[0]):
                seen.setdefault(rid, v)
            items = sorted(seen.items())
        else:
            arr = np.asarray(x)
            items = [(i, arr[i]) for i in range(arr.shape[0])]
        if rows is not None:
            items = [(rid, v[: int(rows[rid])]) for rid, v in items]
        return items

    def __repr__(self) -> str:
        extra = "" if self._rows is None else ", uneven rows"
        return f"PerReplica(num_replicas={self.num_replicas}, shape={self.shape}, dtype={self.dtype}{extra})"


def _global_rows(rows: Any) -> np.ndarray:
    """All replicas' row counts on the host (they are tiny; every process holds its own copy)."""
    if isinstance(rows, jax.Array) and not rows.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(rows, tiled=True))
    return np.asarray(rows)


def is_per_replica(x: object) -> bool:
    """Whether ``x`` is a :class:`PerReplica` (use as ``is_leaf`` in ``jax.tree`` calls)."""
    return isinstance(x, PerReplica)


def _flatten(p: PerReplica) -> tuple[tuple[Any, ...], bool]:
    if p._rows is None:
        return (p._stacked,), False
    return (p._stacked, p._rows), True


def _unflatten(has_rows: bool, children: Any) -> PerReplica:
    # No validation: JAX may unflatten with placeholder leaves during transformations.
    out = object.__new__(PerReplica)
    out._stacked = children[0]
    out._rows = children[1] if has_rows else None
    out._rows_host = None
    out._guard = False
    out._origin = None
    return out


jax.tree_util.register_pytree_node(PerReplica, _flatten, _unflatten)


class MirroredRegistry:
    """Remembers the replicated arrays a strategy produced (TF's mirrored values).

    ``strategy.reduce(SUM, x)`` must tell a value that came out of the
    strategy (an all-reduced output of ``run``: each replica holds its own
    equal copy, and TF sums them) from a non-distributed value made outside
    (TF raises ``ValueError`` for SUM). jax.Arrays are unhashable, so entries
    are keyed by ``id`` and hold a weak reference (checked by identity, so a
    recycled id never matches). Tracers (inside ``jax.jit``) do not support
    weak references: the most recent ones are held strongly in a bounded LRU
    (a tracer outlives its trace only as garbage, so the bound just caps it).
    """

    _MAX_TRACERS = 4096

    def __init__(self) -> None:
        self._weak: dict[int, weakref.ref[Any]] = {}
        self._strong: OrderedDict[int, Any] = OrderedDict()

    def add(self, x: Any) -> Any:
        key = id(x)
        try:
            weak = self._weak

            def forget(_ref: weakref.ref[Any], k: int = key) -> None:
                weak.pop(k, None)

            self._weak[key] = weakref.ref(x, forget)
        except TypeError:
            self._strong[key] = x
            self._strong.move_to_end(key)
            while len(self._strong) > self._MAX_TRACERS:
                self._strong.popitem(last=False)
        return x

    def __contains__(self, x: Any) -> bool:
        ref = self._weak.get(id(x))
        if ref is not None and ref() is x:
            return True
        return self._strong.get(id(x)) is x
