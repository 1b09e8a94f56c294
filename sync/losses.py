"""Loss scaling helpers for synchronous training (``tf.nn.compute_average_loss`` and friends).

With ``R`` replicas each computing gradients on its slice of a global batch
and the gradients then *summed* across replicas, the per-replica loss must be
``sum(per_example_loss) / global_batch_size`` for the summed gradient to equal
the gradient of the global-batch mean loss. These helpers do that scaling.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxdist.sync import context as ctx_lib

__all__ = ["compute_average_loss", "scale_regularization_loss"]


def _num_replicas(fn_name: str) -> int:
    if ctx_lib.in_cross_replica_context():
        raise RuntimeError(
            f"You are calling `{fn_name}` in cross replica context, while it was expected to be called in "
            "replica context (inside strategy.run)."
        )
    return ctx_lib.get_strategy().num_replicas_in_sync


def compute_average_loss(
    per_example_loss: Any,
    global_batch_size: int | Any | None = None,
    sample_weight: Any = None,
) -> Any:
    """Scale per-example losses by the global batch size: ``sum(loss * weight) / global_batch_size``.

    Same contract as ``tf.nn.compute_average_loss``. Call it inside
    ``strategy.run`` (or outside any strategy); the replicas' results add up
    to the mean loss over the global batch.

    Padding rows of an uneven batch (TF's split of a short batch, see
    ``experimental_distribute_dataset``) are left out by themselves: inside
    ``run`` the losses of rows that are padding count as 0, so the result is
    TF's for the replica's real rows.

    Args:
        per_example_loss: losses of rank >= 1, leading axis the examples.
            Integer losses are promoted to float32 (the result is a mean).
        global_batch_size: examples in the global batch (a Python int or an
            integer scalar array). ``None`` means this replica's (real) row
            count times ``num_replicas_in_sync``, as TF.
        sample_weight: optional per-example weights, broadcast against
            ``per_example_loss`` (e.g. the mask of
            ``experimental_distribute_dataset(..., with_mask=True)``).

    Returns:
        A float scalar; 0 when ``global_batch_size`` is 0 (TF's ``div_no_nan``).

    Raises:
        ValueError: ``per_example_loss`` is a scalar, or ``global_batch_size``
            is not an integer scalar.
        RuntimeError: called in a cross-replica context.
    """
    loss = jnp.asarray(per_example_loss)
    if not jnp.issubdtype(loss.dtype, jnp.inexact):
        loss = loss.astype(jnp.float32)
    dtype = loss.dtype
    if loss.ndim == 0:
        raise ValueError(
            "Invalid value passed for `per_example_loss`. Expected a tensor with at least rank 1 "
            f"(one loss per example), received a scalar: {per_example_loss!r}"
        )
    if sample_weight is not None:
        w = jnp.asarray(sample_weight)
        if w.ndim > loss.ndim:
            raise ValueError(f"sample_weight of shape {w.shape} has a higher rank than the losses {loss.shape}")
        w = w.reshape(w.shape + (1,) * (loss.ndim - w.ndim))
        loss = (loss * w).astype(dtype)
    rep = ctx_lib.get_replica_context()
    mask = rep.row_mask(loss.shape[0], dtype) if rep is not None else None
    if mask is not None:
        loss = loss * mask.reshape(mask.shape + (1,) * (loss.ndim - 1))
    if global_batch_size is None:
        n = _num_replicas("compute_average_loss")
        rows = rep.num_rows if (rep is not None and mask is not None) else loss.shape[0]
        global_batch_size = jnp.asarray(rows, jnp.int32) * n
    elif isinstance(global_batch_size, bool) or not (
        isinstance(global_batch_size, (int, np.integer))
        or (hasattr(global_batch_size, "dtype") and jnp.issubdtype(global_batch_size.dtype, jnp.integer)
            and jnp.ndim(global_batch_size) == 0)
    ):
        raise ValueError(f"global_batch_size must be an integer scalar, got {global_batch_size!r}")
    gbs = jnp.asarray(global_batch_size).astype(dtype)
    total = jnp.sum(loss)
    return jnp.where(gbs == 0, jnp.zeros((), dtype), total / jnp.where(gbs == 0, jnp.ones((), dtype), gbs)).astype(dtype)


def scale_regularization_loss(regularization_loss: Any) -> Any:
    """Divide a regularization loss by ``num_replicas_in_sync`` (``tf.nn.scale_regularization_loss``).

    Every replica adds the same regularization term; after the cross-replica
    gradient sum it must count once.

    Args:
        regularization_loss: a scalar or array (summed), or a list of them (added).

    Returns:
        ``sum(regularization_loss) / num_replicas_in_sync``.

    Raises:
        RuntimeError: called in a cross-replica context.
    """
    if isinstance(regularization_loss, (list, tuple)):
        regularization_loss = sum(jnp.asarray(x) for x in regularization_loss)
    n = _num_replicas("scale_regularization_loss")
    loss = jnp.asarray(regularization_loss)
    return jnp.sum(loss) / jnp.asarray(n, dtype=loss.dtype if jnp.issubdtype(loss.dtype, jnp.floating) else jnp.float32)
