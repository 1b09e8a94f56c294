"""Applying pushed gradients with an optax ``GradientTransformation`` on the PS.

Each variable (or variable shard) has its own optimizer state, initialised
from the variable's value and kept next to it on the same PS. The optimizer is
applied per variable: element-wise transformations (SGD, momentum, Adam,
Adagrad, RMSProp, weight decay, ...) behave exactly as with plain optax on the
whole model; transformations that couple variables (e.g. clipping by the
*global* norm) see one variable at a time.

Sparse (row) gradients are applied *lazily*: only the rows named by the
indices change, in the parameter and in every optimizer-state leaf shaped like
the parameter; state leaves of other shapes (step counts) advance once per
push. For SGD and Adagrad that equals the dense update with zero gradients
elsewhere; for momentum, Adam and friends it is TF's lazy sparse apply
(untouched rows keep their moments and values).
"""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
import optax


def _bucket(n: int) -> int:
    """Row counts are padded to powers of two so sparse updates compile O(log n) times."""
    return 1 << max(0, (n - 1).bit_length())


def _to_numpy_tree(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


class Optimizer:
    """An optax transformation applied to one variable at a time, jit-compiled once per shape."""

    def __init__(self, tx: optax.GradientTransformation, digest: str = "") -> None:
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(tx).__name__}")
        self.tx = tx
        self.digest = digest
        self._lock = threading.Lock()

        def step(param: jax.Array, state: Any, grad: jax.Array) -> tuple[jax.Array, Any]:
            # Gradients may arrive narrower (bf16 transfer); the update runs in the param's dtype.
            grad = grad.astype(param.dtype)
            updates, new_state = tx.update(grad, state, param)
            return optax.apply_updates(param, updates), new_state

        self._step = jax.jit(step)
        self._init = jax.jit(tx.init)

    def init(self, param: np.ndarray) -> Any:
        return _to_numpy_tree(self._init(param))

    def apply(self, param: Any, state: Any, grad: np.ndarray) -> tuple[np.ndarray, jax.Array, Any]:
        """Dense step: ``(new param as a read-only numpy view, the same as an XLA array, new state)``.

        ``param`` and ``state`` may be numpy or XLA arrays; passing back the XLA
        arrays of the previous step saves copying them into XLA again (the
        state stays in XLA arrays: readers use ``np.asarray``, a free view on CPU).
        """
        new_param, new_state = self._step(param, state, grad)
        return np.asarray(new_param), new_param, new_state

    def apply_sparse(
        self, param: np.ndarray, state: Any, indices: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, Any, Any]:
        """Lazy row update.

        Args:
            param: the full parameter (dim 0 = rows).
            state: its optimizer state.
            indices: unique row indices, int64, rank 1.
            rows: gradient rows for ``indices`` (duplicates already summed).

        Returns:
            ``(new_param_rows, new_state, is_row)``: the caller writes
            ``new_param_rows`` back at ``indices``, and for every state leaf
            where ``is_row`` is True writes that leaf's rows back at
            ``indices``; other leaves (e.g. step counts) replace the old ones.
        """
        n = len(indices)
        b = _bucket(n)
        pad = b - n
        shape = param.shape

        def take(leaf: Any) -> Any:
            leaf = np.asarray(leaf)
            if leaf.shape == shape:
                g = leaf[indices]
                return np.concatenate([g, np.zeros((pad,) + shape[1:], leaf.dtype)]) if pad else g
            return leaf

        p_rows = take(param)
        s_rows = jax.tree.map(take, state)
        g_rows = np.concatenate([rows, np.zeros((pad,) + shape[1:], rows.dtype)]) if pad else rows
        new_p, new_s = self._step(p_rows, s_rows, g_rows)
        is_row = jax.tree.map(lambda leaf: np.asarray(leaf).shape == shape, state)
        new_p = np.asarray(new_p)[:n]
        new_s = jax.tree.map(lambda leaf, r: np.asarray(leaf)[:n] if r else np.asarray(leaf), new_s, is_row)
        return new_p, new_s, is_row
