"""Cross-replica reductions of stacked per-replica values: the array math behind ``reduce`` and ``gather``.

A per-replica value is one array ``(num_replicas, *value_shape)`` (see
:mod:`jaxdist.sync.values`); these functions combine its rows as TF's
``strategy.reduce`` / ``strategy.gather`` do, leaving out the padding rows of
an uneven batch. They are pure ``jax.numpy`` functions: the strategies jit
them (:mod:`jaxdist.sync.mesh`) or call them eagerly (the default strategy).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.sync.reduce_op import ReduceOp
from jaxdist.sync.values import PerReplica

__all__ = ["gather_rows", "gather_stacked", "non_distributed_reduce", "norm_axis", "reduce_stacked"]


def _row_mask_nd(stacked: Any, rows: Any) -> Any:
    """``(R, b, 1, ...)`` mask of real rows for a stacked per-replica batch ``(R, b, ...)``."""
    b = stacked.shape[1]
    m = jnp.arange(b)[None, :] < jnp.asarray(rows)[:, None]
    return m.reshape(m.shape + (1,) * (stacked.ndim - 2))


def reduce_stacked(x: Any, op: ReduceOp, axis: int | None, rows: Any = None) -> Any:
    """Reduce ``(R, ...)`` over replicas (and ``axis`` of each value); padding rows do not count."""
    if axis is None:
        return (jnp.sum(x, 0) if op is ReduceOp.SUM else jnp.mean(x, 0)).astype(_result_dtype(x, op))
    ax = norm_axis(axis, x.ndim - 1) + 1
    if rows is not None and ax == 1:
        mask = _row_mask_nd(x, rows)
        total = jnp.sum(jnp.where(mask, x, jnp.zeros_like(x)), axis=(0, 1))
        if op is ReduceOp.SUM:
            return total
        return total / jnp.maximum(jnp.sum(jnp.asarray(rows)), 1)
    return jnp.sum(x, (0, ax)) if op is ReduceOp.SUM else jnp.mean(x, (0, ax))


def _result_dtype(x: Any, op: ReduceOp) -> Any:
    if op is ReduceOp.MEAN and not jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.float32
    return x.dtype


def gather_stacked(x: jax.Array, axis: int) -> jax.Array:
    """``(R, s0, ..., sk)`` -> the R slices concatenated along ``axis``, replica-major."""
    if x.ndim < 2:
        raise ValueError("gather needs per-replica values of rank >= 1 (scalars cannot be concatenated)")
    axis = norm_axis(axis, x.ndim - 1)
    moved = jnp.moveaxis(x, 0, axis)
    shape = moved.shape[:axis] + (moved.shape[axis] * moved.shape[axis + 1],) + moved.shape[axis + 2 :]
    return moved.reshape(shape)


def gather_rows(x: PerReplica, axis: int) -> Any:
    """Gather a (host-side) PerReplica, keeping only real rows of an uneven batch."""
    stacked = jnp.asarray(x.stacked)
    rows = x.host_row_counts()
    if rows is None:
        return gather_stacked(stacked, axis)
    if norm_axis(axis, stacked.ndim - 1) != 0:
        raise ValueError("an uneven batch (with row counts) can only be gathered along axis 0, its batch axis")
    idx = np.concatenate([r * stacked.shape[1] + np.arange(int(n)) for r, n in enumerate(rows)]).astype(np.int32)
    return jnp.take(gather_stacked(stacked, 0), idx, axis=0)


def norm_axis(axis: int, ndim: int) -> int:
    """``axis`` of a per-replica value of rank ``ndim``, made non-negative (ValueError if out of range)."""
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for per-replica values of rank {ndim}")
    return axis % ndim


def non_distributed_reduce(op: ReduceOp, x: Any, axis: int | None, r: int) -> Any:
    """TF's ``reduce_non_distributed_value``: a value made outside the strategy.

    With ``axis=None``: Python ``0`` stays ``0``; ``MEAN`` (or one replica)
    returns the value; ``SUM`` raises ValueError, as TF. With an axis it
    returns None: the caller reduces the value per replica (TF's
    ``run(reduce_sum)``).
    """
    if axis is None:
        if isinstance(x, (int, float)) and not isinstance(x, bool) and x == 0:
            return 0
        if op is ReduceOp.MEAN or r == 1:
            return x
        raise ValueError(
            f"A non-DistributedValues value {x!r} cannot be reduced with the given reduce op {op}. "
            "(TF raises this too: the same value on every replica has no defined SUM.) Reduce a per-replica "
            "value (strategy.run's output), multiply by strategy.num_replicas_in_sync yourself, or use MEAN"
        )
    return None
