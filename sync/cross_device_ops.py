"""How the all-reduce across replicas is done (TF's ``cross_device_ops`` and ``CommunicationOptions``).

Every in-replica all-reduce (``ReplicaContext.all_reduce``, the gradient
aggregation of :class:`jaxdist.Optimizer`, ``extended.batch_reduce_to`` inside
``merge_call``) runs inside the one XLA program ``strategy.run`` compiles.
These objects choose the collective pattern it is written with:

==============================================  ==============================================================
TF                                              jaxdist (XLA collectives over the ``"replica"`` axis)
==============================================  ==============================================================
``NcclAllReduce(num_packs=1)``                  one fused ``psum`` of all leaves (XLA uses NCCL on GPUs);
                                                ``num_packs=k``: leaves concatenated per dtype and split into
                                                k packs, one ``psum`` each (TF's packing)
``HierarchicalCopyAllReduce(num_packs=1)``      two-level: ``psum`` within groups of replicas
                                                (two groups, as TF's DGX-1 layout), then a ``psum`` that
                                                combines the group leaders' sums; packs as above
``ReductionToOneDevice(reduce_to_device,        every replica's value gathered (``all_gather``) and added in
accumulation_fn)``                              replica order with ``accumulation_fn`` (default: a fixed-order
                                                sum). Cross-replica (``strategy.reduce``) the values are
                                                really copied to ``reduce_to_device``, reduced there and the
                                                result broadcast; inside the compiled step every replica does
                                                that sum itself (same numbers: SPMD has no "one device" step)
``CommunicationOptions(implementation=AUTO)``   one fused ``psum``
``...(implementation=RING)``                    reduce-scatter (``psum_scatter``) + ``all_gather``
``...(implementation=NCCL)``                    ``psum`` on GPUs; a clear error elsewhere (NCCL needs GPUs)
``...(bytes_per_pack=N)``                       leaves grouped in order into packs of at most N bytes, one
                                                collective per pack (0: no packing)
``...(timeout_seconds=T)``                      MultiWorkerMirroredStrategy only: a step whose collectives
                                                have not finished after T s fails the job with
                                                ``PeerFailedError`` (TF: ``DeadlineExceededError``)
==============================================  ==============================================================

A custom pattern: subclass :class:`CrossDeviceOps` and implement
:meth:`CrossDeviceOps.all_reduce_sum` with ``jax.lax`` collectives.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.base.errors import ConfigurationError

if TYPE_CHECKING:
    from jaxdist.sync.engine import SyncEngine
    from jaxdist.sync.strategy import Strategy

__all__ = [
    "CommunicationImplementation",
    "CollectiveCommunication",
    "CommunicationOptions",
    "CrossDeviceOps",
    "NcclAllReduce",
    "HierarchicalCopyAllReduce",
    "ReductionToOneDevice",
]


class CommunicationImplementation(enum.Enum):
    """Collective implementation (``tf.distribute.experimental.CommunicationImplementation``)."""

    AUTO = "AUTO"
    RING = "RING"
    NCCL = "NCCL"


#: TF's deprecated name of :class:`CommunicationImplementation`.
CollectiveCommunication = CommunicationImplementation


@dataclass(frozen=True)
class CommunicationOptions:
    """Options for cross-replica collectives (``tf.distribute.experimental.CommunicationOptions``).

    Args:
        bytes_per_pack: pack leaves into collectives of at most this many
            bytes each (0: one collective for everything).
        timeout_seconds: MultiWorkerMirroredStrategy only: fail the job when a
            step's collectives take longer (None or 0: no timeout).
        implementation: AUTO, RING or NCCL (see the module table).
    """

    bytes_per_pack: int = 0
    timeout_seconds: float | None = None
    implementation: CommunicationImplementation | str = CommunicationImplementation.AUTO

    def __post_init__(self) -> None:
        if not isinstance(self.bytes_per_pack, (int, np.integer)) or self.bytes_per_pack < 0:
            raise ValueError(f"bytes_per_pack must be a non-negative integer, got {self.bytes_per_pack!r}")
        if self.timeout_seconds is not None and (
            not isinstance(self.timeout_seconds, (int, float)) or self.timeout_seconds < 0
        ):
            raise ValueError(f"timeout_seconds must be None or >= 0, got {self.timeout_seconds!r}")
        impl = self.implementation
        if isinstance(impl, str):
            try:
                impl = CommunicationImplementation(impl.upper())
            except ValueError:
                raise ValueError(f"implementation must be AUTO, RING or NCCL, got {self.implementation!r}") from None
        if not isinstance(impl, CommunicationImplementation):
            raise ValueError(f"implementation must be a CommunicationImplementation, got {impl!r}")
        object.__setattr__(self, "implementation", impl)

    @property
    def timeout(self) -> float | None:
        """The collective timeout in seconds (None when off)."""
        return self.timeout_seconds if self.timeout_seconds else None


def check_options(options: Any, what: str) -> CommunicationOptions | None:
    if options is None:
        return None
    if not isinstance(options, CommunicationOptions):
        raise TypeError(
            f"{what}: options must be a jaxdist.CommunicationOptions (TF's tf.distribute.experimental."
            f"CommunicationOptions), got {type(options).__name__}"
        )
    return options


# ---------------------------------------------------------------------------------------
# Packing helpers (inside the traced step)
# ---------------------------------------------------------------------------------------


def _pack_groups(leaves: Sequence[Any], bytes_per_pack: int) -> list[list[int]]:
    """Indices of leaves grouped in order into packs of at most ``bytes_per_pack`` bytes."""
    groups: list[list[int]] = []
    cur: list[int] = []
    size = 0
    for i, x in enumerate(leaves):
        nbytes = int(np.prod(jnp.shape(x), dtype=np.int64)) * jnp.asarray(x).dtype.itemsize
        if cur and size + nbytes > bytes_per_pack:
            groups.append(cur)
            cur, size = [], 0
        cur.append(i)
        size += nbytes
    if cur:
        groups.append(cur)
    return groups


def _concat_apply(leaves: Sequence[Any], fn: Callable[[Any], Any], num_packs: int = 1) -> list[Any]:
    """Apply the 1-D collective ``fn`` to the leaves concatenated per dtype (in ``num_packs`` chunks)."""
    out: list[Any] = [None] * len(leaves)
    by_dtype: dict[Any, list[int]] = {}
    for i, x in enumerate(leaves):
        by_dtype.setdefault(jnp.asarray(x).dtype, []).append(i)
    for _, idx in by_dtype.items():
        flat = jnp.concatenate([jnp.ravel(leaves[i]) for i in idx]) if len(idx) > 1 else jnp.ravel(leaves[idx[0]])
        n = flat.shape[0]
        packs = max(1, min(num_packs, n))
        bounds = [round(k * n / packs) for k in range(packs + 1)]
        reduced = [fn(flat[bounds[k] : bounds[k + 1]]) for k in range(packs)]
        total = jnp.concatenate(reduced) if len(reduced) > 1 else reduced[0]
        off = 0
        for i in idx:
            size = int(np.prod(jnp.shape(leaves[i]), dtype=np.int64))
            out[i] = total[off : off + size].reshape(jnp.shape(leaves[i]))
            off += size
    return out


def _ring_1d(x: Any, axis: str, r: int) -> Any:
    """Reduce-scatter + all-gather of a 1-D array (the two phases of a ring all-reduce)."""
    n = x.shape[0]
    padded = int(math.ceil(n / r) * r) if n else r
    if padded != n:
        x = jnp.concatenate([x, jnp.zeros((padded - n,), x.dtype)])
    part = jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
    return jax.lax.all_gather(part, axis, tiled=True)[:n]


# ---------------------------------------------------------------------------------------
# CrossDeviceOps
# ---------------------------------------------------------------------------------------


class CrossDeviceOps:
    """Base class: how replicas' values are summed inside the compiled step (``tf.distribute.CrossDeviceOps``).

    Subclasses implement :meth:`all_reduce_sum`. The default is one fused psum.
    """

    def all_reduce_sum(self, leaves: list[Any], axis: str, num_replicas: int) -> list[Any]:
        """Sum every leaf over the replica mesh axis ``axis`` (called inside ``run``'s trace)."""
        return list(jax.lax.psum(tuple(leaves), axis))

    def reduce(self, reduce_op: Any, per_replica_value: Any, destinations: Any = None, options: Any = None) -> Any:
        """Cross-replica reduce of one per-replica value (``CrossDeviceOps.reduce``); see ``extended.reduce_to``."""
        strategy = _strategy_of(per_replica_value)
        with _using(strategy.engine, self):
            return strategy.extended.reduce_to(reduce_op, per_replica_value, destinations, options)

    def batch_reduce(self, reduce_op: Any, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any = None) -> list[Any]:
        """Cross-replica reduce of several values (``CrossDeviceOps.batch_reduce``)."""
        pairs = list(value_destination_pairs)
        if not pairs:
            return []
        strategy = _strategy_of(pairs[0][0])
        with _using(strategy.engine, self):
            return strategy.extended.batch_reduce_to(reduce_op, pairs, options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def _strategy_of(value: Any) -> Strategy:
    from jaxdist.sync import context as ctx_lib
    from jaxdist.sync.strategy import Strategy, is_default_strategy

    s = ctx_lib.get_strategy()
    if not isinstance(s, Strategy) or is_default_strategy(s):
        raise ConfigurationError(
            "CrossDeviceOps.reduce needs the strategy the values belong to: call it inside a synchronous "
            "strategy's scope(), or use strategy.extended.reduce_to"
        )
    return s


class _using:
    """Temporarily make ``ops`` the strategy's cross-device ops (for CrossDeviceOps.reduce)."""

    def __init__(self, engine: SyncEngine, ops: CrossDeviceOps) -> None:
        self.engine, self.ops = engine, ops

    def __enter__(self) -> None:
        self.saved = self.engine.cross_device_ops
        self.engine.cross_device_ops = self.ops

    def __exit__(self, *exc: object) -> None:
        self.engine.cross_device_ops = self.saved


class _Packed(CrossDeviceOps):
    def __init__(self, num_packs: int = 1) -> None:
        if not isinstance(num_packs, (int, np.integer)) or num_packs < 1:
            raise ValueError(f"num_packs must be a positive integer, got {num_packs!r}")
        self.num_packs = int(num_packs)

    def _one(self, flat: Any, axis: str, r: int) -> Any:
        return jax.lax.psum(flat, axis)

    def all_reduce_sum(self, leaves: list[Any], axis: str, num_replicas: int) -> list[Any]:
        if self.num_packs == 1 and type(self)._one is _Packed._one:
            return list(jax.lax.psum(tuple(leaves), axis))
        return _concat_apply(leaves, lambda f: self._one(f, axis, num_replicas), self.num_packs)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_packs={self.num_packs})"


class NcclAllReduce(_Packed):
    """One fused all-reduce (``tf.distribute.NcclAllReduce``): XLA picks NCCL on GPUs.

    Args:
        num_packs: split the concatenated values into this many all-reduces.
    """


class HierarchicalCopyAllReduce(_Packed):
    """Two-level all-reduce (``tf.distribute.HierarchicalCopyAllReduce``).

    Replicas form two groups (halves, as TF's 8-GPU DGX-1 layout; one group
    when the replica count is odd or below 4). Each group sums its values
    (``psum`` over the group), then the groups' leaders' sums are added by a
    ``psum`` in which only leaders contribute, which also broadcasts the
    total back to every replica.
    """

    def _one(self, flat: Any, axis: str, r: int) -> Any:
        if r < 4 or r % 2:
            return jax.lax.psum(flat, axis)
        half = r // 2
        groups = [list(range(half)), list(range(half, r))]
        within = jax.lax.psum(flat, axis, axis_index_groups=groups)
        leader = jax.lax.axis_index(axis) % half == 0
        return jax.lax.psum(jnp.where(leader, within, jnp.zeros_like(within)), axis)


class ReductionToOneDevice(CrossDeviceOps):
    """Reduce to one device, then broadcast (``tf.distribute.ReductionToOneDevice``).

    Args:
        reduce_to_device: where cross-replica reductions (``strategy.reduce``,
            ``extended.reduce_to`` outside ``run``) are done: a ``jax.Device``,
            an index or a string such as ``"cpu:0"``; default the first replica's device.
        accumulation_fn: adds a list of arrays (TF's ``tf.math.add_n``);
            default a sum in replica order.
    """

    def __init__(self, reduce_to_device: Any = None, accumulation_fn: Callable[[list[Any]], Any] | None = None) -> None:
        if accumulation_fn is not None and not callable(accumulation_fn):
            raise TypeError(f"accumulation_fn must be callable (e.g. lambda xs: sum(xs)), got {accumulation_fn!r}")
        self.reduce_to_device = reduce_to_device
        self.accumulation_fn = accumulation_fn

    def accumulate(self, values: list[Any]) -> Any:
        if self.accumulation_fn is not None:
            return self.accumulation_fn(values)
        total = values[0]
        for v in values[1:]:
            total = total + v
        return total

    def all_reduce_sum(self, leaves: list[Any], axis: str, num_replicas: int) -> list[Any]:
        out = []
        for x in leaves:
            stacked = jax.lax.all_gather(x, axis)  # (R, ...) on every replica, in replica order
            out.append(jnp.asarray(self.accumulate([stacked[i] for i in range(num_replicas)])).astype(jnp.asarray(x).dtype))
        return out

    def __repr__(self) -> str:
        return f"ReductionToOneDevice(reduce_to_device={self.reduce_to_device!r})"


class _Ring(CrossDeviceOps):
    def all_reduce_sum(self, leaves: list[Any], axis: str, num_replicas: int) -> list[Any]:
        return _concat_apply(leaves, lambda f: _ring_1d(f, axis, num_replicas), 1) if leaves else []


class _PerPack(CrossDeviceOps):
    """Leaves grouped in order into packs of ``bytes_per_pack``; each pack one collective of ``inner``."""

    def __init__(self, inner: CrossDeviceOps, bytes_per_pack: int) -> None:
        self.inner, self.bytes_per_pack = inner, bytes_per_pack

    def all_reduce_sum(self, leaves: list[Any], axis: str, num_replicas: int) -> list[Any]:
        out: list[Any] = [None] * len(leaves)
        for group in _pack_groups(leaves, self.bytes_per_pack):
            sub = [leaves[i] for i in group]
            reduced = _concat_apply(sub, lambda f: self.inner.all_reduce_sum([f], axis, num_replicas)[0], 1)
            for i, v in zip(group, reduced):
                out[i] = v
        return out


def plan_from_options(options: CommunicationOptions, platform: str) -> CrossDeviceOps | None:
    """The collective pattern ``options`` asks for (None: leave the strategy's own)."""
    impl = options.implementation
    if impl is CommunicationImplementation.NCCL and platform != "gpu":
        raise ConfigurationError(
            f"CommunicationImplementation.NCCL needs GPUs (these replicas run on {platform}); use "
            "CommunicationImplementation.AUTO (XLA picks the collective) or RING (reduce-scatter + all-gather)"
        )
    base: CrossDeviceOps | None
    if impl is CommunicationImplementation.RING:
        base = _Ring()
    elif impl is CommunicationImplementation.NCCL:
        base = NcclAllReduce()
    else:
        base = None
    if options.bytes_per_pack:
        return _PerPack(base if base is not None else CrossDeviceOps(), options.bytes_per_pack)
    return base


def all_reduce(
    ops: CrossDeviceOps, op_is_mean: bool, tree: Any, axis: str, num_replicas: int
) -> Any:
    """All-reduce every leaf of ``tree`` with ``ops`` (SUM, or MEAN = SUM / num_replicas)."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    arrays = [jnp.asarray(x) for x in leaves]
    summed = ops.all_reduce_sum(arrays, axis, num_replicas)
    if op_is_mean:
        summed = [
            (s / num_replicas).astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else s // num_replicas
            for s, a in zip(summed, arrays)
        ]
    return jax.tree.unflatten(treedef, summed)
