"""Applying pushed gradients with an optax ``GradientTransformation`` on the PS.

Each variable (or variable shard) has its own optimizer state, initialised
from the variable's value and kept next to it on the same PS. The optimizer is
applied per variable: element-wise transformations (SGD, momentum, Adam,
Adagrad, RMSProp, weight decay, ...) behave exactly as with plain optax on the
whole model; transformations that couple variables (e.g. clipping by the
*global* norm) see one variable at a time.

Row (sparse) gradients travel as rows (only the rows a batch looked up) and
are applied in one of two modes, chosen per optimizer:

- *exact* (the default): the PS scatters the pushed rows into a zero
  gradient of the whole variable and applies the optimizer's dense rule, in
  one jit-compiled step on the PS. The result is the dense update's exactly
  (Adam's moments of the rows not pushed decay, momentum keeps moving them),
  so a PS run equals a single-device run; the PS's arithmetic is O(table)
  per push, the wire's O(rows) (TF's ``ParameterServerStrategy`` does the same).
  For a rule marked :func:`row_separable` (every Keras rule
  :func:`jaxdist.keras.ps_optimizers.to_optax` makes) on a large variable the
  same values are computed with less memory traffic: the pushed rows' update
  on those rows alone, the dense rule with a zero gradient as two in-place
  passes (no table-sized gradient buffer), the rows written over it; and
  several pushes share one pass (:meth:`Optimizer.apply_rows_many`; the store
  defers them, see :mod:`jaxdist.ps_server.store`).
- *lazy* (:func:`lazy_rows`, TF's ``LazyAdam``): only the rows named by the
  indices change, in the parameter and in every optimizer-state leaf shaped
  like the parameter; state leaves of other shapes (step counts) advance once
  per push. O(rows) on the PS too. For a rule whose zero gradient changes
  nothing (SGD without momentum, Adagrad) it equals the exact mode bit for bit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jax_core
import jax.numpy as jnp
import numpy as np
import optax

logger = logging.getLogger(__name__)

__all__ = ["LazyRows", "Optimizer", "RowSeparable", "is_lazy", "is_row_separable", "lazy_rows", "row_separable"]


class LazyRows(optax.GradientTransformation):
    """An optax transformation whose row gradients the PS applies lazily (see the module docstring).

    Made by :func:`lazy_rows`; it is the same ``(init, update)`` pair, so
    dense gradients are applied exactly as by the transformation it wraps.
    Wrapping it again (``optax.chain(lazy, ...)``) gives an ordinary
    transformation, applied in the exact mode.
    """


def lazy_rows(tx: optax.GradientTransformation) -> LazyRows:
    """``tx`` marked *lazy* for row gradients: a row push changes only its rows and their optimizer state.

    Under ``ParameterServerStrategy`` a row gradient (:class:`jaxdist.SparseGradient`,
    a Keras ``Embedding``'s rows) of a variable created with this optimizer
    updates only the pushed rows, their slots and the step count (TF's
    ``LazyAdam``; the usual choice for large embedding tables): the PS's
    work is O(rows pushed), not O(table). Without it (the default, *exact*)
    the PS applies ``tx``'s dense rule with zero gradient for the rows not
    pushed, which equals a single-device run. Dense gradients are applied
    the same way in both modes.

    Raises:
        TypeError: ``tx`` is not an optax ``GradientTransformation`` (has no ``init``/``update``).
    """
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"lazy_rows needs an optax.GradientTransformation, got {type(tx).__name__}")
    return LazyRows(tx.init, tx.update)


def is_lazy(tx: Any) -> bool:
    """Whether ``tx`` applies row gradients lazily (made by :func:`lazy_rows`)."""
    return isinstance(tx, LazyRows)


class RowSeparable(optax.GradientTransformation):
    """An optax transformation marked row-separable (made by :func:`row_separable`): the exact mode
    computes its row pushes with less memory traffic, with the same results.

    The same ``(init, update)`` pair as the transformation it marks; wrapping it
    again (``optax.chain(marked, ...)``) gives an unmarked transformation.
    """


def row_separable(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    """``tx`` marked *row-separable*: the PS applies its exact-mode row pushes faster, with the same results.

    A transformation is row-separable when row ``i`` of its new parameter and of
    every state leaf shaped like the parameter depends only on row ``i`` of the
    parameter, of those leaves and of the gradient, and on the state leaves of
    other shapes (step counts), which must not depend on the gradient or the
    parameter. Element-wise rules are (SGD, momentum, Adam, AdamW's decoupled
    decay, RMSprop, Adagrad, Adamax, Nadam, Ftrl, optax's element-wise
    transforms and ``optax.chain`` of them); rules that reduce over the variable
    are not (clipping by a norm, LARS/LAMB trust ratios, anything reading a
    norm or a mean). :func:`jaxdist.keras.ps_optimizers.to_optax` marks the
    Keras rules it makes.

    For a marked transformation the exact mode (the default, without
    :func:`lazy_rows`) may compute a row push as the rule on the pushed rows
    alone (their duplicate indices summed first), the dense rule with a zero
    gradient (no table-sized gradient is written and read back; the
    parameter's pass first, reading the old state, then the state's), and the
    pushed rows written over its result; several pushes into one variable
    share one such pass (the PS defers them, bit for bit the same values). The values are the unmarked transformation's
    (the dense rule on the gradient with the rows scattered into zeros, push
    after push). The PS does so for variables of at least ``SEPARABLE_MIN_SIZE``
    elements whose state's zero-gradient update never reads the parameter and
    whose passes XLA compiles without a table-sized temporary (every Keras rule
    but centered RMSprop and Ftrl), else it runs the unmarked path. Marking a
    rule that is not row-separable gives wrong results for the pushed rows.
    Dense gradients and the lazy mode are unaffected; a :func:`lazy_rows`
    transformation is returned as it is (its pushes touch the pushed rows only).

    Raises:
        TypeError: ``tx`` is not an optax ``GradientTransformation`` (has no ``init``/``update``).
    """
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(f"row_separable needs an optax.GradientTransformation, got {type(tx).__name__}")
    if isinstance(tx, (LazyRows, RowSeparable)):
        return tx
    return RowSeparable(tx.init, tx.update)


def is_row_separable(tx: Any) -> bool:
    """Whether ``tx`` is marked row-separable (made by :func:`row_separable`)."""
    return isinstance(tx, RowSeparable)


#: Row pushes are padded to at least this many rows. Each padded size is one XLA compilation of the
#: row step, shared by every table of the optimizer; without a floor a model with tables of every size
#: (a recommender's 26: 3 to 10M rows) compiled ~10 sizes in its first pushes, each seconds on a loaded
#: machine, and its first push outlived the client's push deadline. Padding a 3-row push to 256 rows
#: costs microseconds.
MIN_ROW_BUCKET = 256


#: A :func:`row_separable` rule's row pushes take the three-step path for variables of at least this
#: many elements (8M: 512K rows of 16 float32); smaller ones keep the one-step path (same results for the
#: rules ``to_optax`` makes). Measured (bench/exact_rows.py, Keras's Adam, 4,096 distinct ids, dim 16,
#: medians of 15 pushes, 2-core host, quiet): one step / three steps 2.15 / 4.21 ms at 64K rows, 7.74 /
#: 10.05 at 256K, 12.5 / 13.4 at 384K, 26.9 / 17.9 at 512K, 44.4 / 31.5 at 1M, 203 / 137 at 5M: below
#: ~6M elements the three steps' fixed cost (three dispatches, the ids sorted on the host) is more than
#: the memory traffic they save, while the table still sits in the caches.
SEPARABLE_MIN_SIZE = 1 << 23


#: At most this many exact row pushes of one variable are applied in one pass over it
#: (:meth:`Optimizer.apply_rows_many`): one compilation of the zero passes per count up to it, per
#: layout; the unrolled steps' arithmetic stays below the pass's memory time (measured on a 5M x 16
#: Keras Adam shard, 2 cores: one pass of 8 steps cost about what one pass of one step did).
MAX_PUSHES_PER_PASS = 8


def _reads_first_argument(fn: Callable[..., Any], *avals: Any) -> bool:
    """Whether ``fn``'s outputs may depend on its first argument's leaves (conservative: an operation
    with any needed output counts as reading all its inputs, nested programs included)."""
    closed = jax.make_jaxpr(fn)(*avals)
    jaxpr = closed.jaxpr
    first = jaxpr.invars[: len(jax.tree.leaves(avals[0]))]
    needed = {v for v in jaxpr.outvars if isinstance(v, jax_core.Var)}
    for eqn in reversed(jaxpr.eqns):
        if any(isinstance(o, jax_core.Var) and o in needed for o in eqn.outvars):
            needed.update(v for v in eqn.invars if isinstance(v, jax_core.Var))
    return any(v in needed for v in first)


def _bucket(n: int) -> int:
    """Row counts are padded to powers of two (at least :data:`MIN_ROW_BUCKET`) so sparse updates compile O(log n) times."""
    return max(MIN_ROW_BUCKET, 1 << max(0, (n - 1).bit_length()))


def _donatable(param: Any, state: Any) -> bool:
    """Whether every buffer of a step's inputs is an XLA array (numpy inputs are copied in anyway;
    donating them only makes XLA warn)."""
    return all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves((param, state)))


def _aval(x: Any) -> jax.ShapeDtypeStruct:
    """The shape and dtype of an array (numpy, XLA, or a ShapeDtypeStruct)."""
    return jax.ShapeDtypeStruct(np.shape(x), np.dtype(x.dtype))


def _to_numpy_tree(tree: Any) -> Any:
    return jax.tree.map(np.asarray, tree)


class Optimizer:
    """An optax transformation applied to one variable at a time, jit-compiled once per shape."""

    def __init__(self, tx: optax.GradientTransformation, digest: str = "", *,
                 separable_min_size: int = SEPARABLE_MIN_SIZE) -> None:
        """``separable_min_size``: a :func:`row_separable` rule's row pushes into variables of at least
        this many elements take the three-step path (see :meth:`apply_rows`)."""
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(tx).__name__}")
        self.tx = tx
        self.digest = digest
        self.separable_min_size = separable_min_size
        #: Row gradients change only their rows (:func:`lazy_rows`); else the dense rule runs (exact).
        self.lazy = is_lazy(tx)
        self._lock = threading.Lock()

        def step(param: jax.Array, state: Any, grad: jax.Array) -> tuple[jax.Array, Any]:
            # Gradients may arrive narrower (bf16 transfer); the update runs in the param's dtype.
            grad = grad.astype(param.dtype)
            updates, new_state = tx.update(grad, state, param)
            return optax.apply_updates(param, updates), new_state

        def row_step(param: jax.Array, state: Any, indices: jax.Array, rows: jax.Array) -> tuple[jax.Array, Any]:
            # The exact mode: the pushed rows scattered into a zero gradient (inside XLA: the
            # dense gradient never exists in Python), then the dense rule. Padding rows are
            # zero and point at row 0, so adding them changes nothing.
            grad = jnp.zeros(param.shape, param.dtype).at[indices].add(rows.astype(param.dtype), mode="drop")
            updates, new_state = tx.update(grad, state, param)
            return optax.apply_updates(param, updates), new_state

        self._step = jax.jit(step)
        self._row_step = jax.jit(row_step)
        # The same steps with the parameter and state buffers donated: XLA writes the new values
        # into them instead of allocating (and page-faulting) a table-sized array per leaf per
        # push; the exact mode's O(table) work is then one pass over memory already mapped.
        self._step_donating = jax.jit(step, donate_argnums=(0, 1))
        self._row_step_donating = jax.jit(row_step, donate_argnums=(0, 1))
        self._init = jax.jit(tx.init)

        #: The exact mode's row pushes as three steps (:func:`row_separable` rules only).
        self.row_separable = is_row_separable(tx)

        def zero_steps(param: jax.Array, state: Any, zero: jax.Array, k: int) -> tuple[jax.Array, Any]:
            # The dense rule with a zero gradient, k times, broadcast from a scalar argument: XLA fuses
            # the broadcast into the update's loops, so no table-sized gradient is written and read
            # back. Not a constant: XLA would simplify the rule around a known zero (x - 0*c -> x,
            # (x*c1)*c2 -> x*(c1*c2)) and round some results differently from the dense step's.
            grad = jnp.broadcast_to(zero.astype(param.dtype), param.shape)
            for _ in range(k):
                updates, state = tx.update(grad, state, param)
                param = optax.apply_updates(param, updates)
            return param, state

        def zero_param(param: jax.Array, state: Any, zero: jax.Array, k: int) -> jax.Array:
            # The parameter after k zero steps, alone: one loop over the table reading the old state
            # (the intermediate moments live in registers), writing the parameter in place.
            return zero_steps(param, state, zero, k)[0]

        def zero_state(param: jax.Array, state: Any, zero: jax.Array, k: int) -> Any:
            # The state after k zero steps, alone: each leaf's loop reads and writes that leaf only
            # (the plan checks that the state never reads the parameter, so ``param`` is unused).
            return zero_steps(param, state, zero, k)[1]

        def put_rows(param: jax.Array, state: Any, uniq: jax.Array, p_rows: jax.Array,
                     state_rows: Any) -> tuple[jax.Array, Any]:
            # The pushed rows' results over the zero-gradient ones (in place: both donated).
            shape = param.shape

            def put(leaf: Any, new: Any) -> Any:
                return leaf.at[uniq].set(new, mode="drop") if leaf.shape == shape else leaf

            return param.at[uniq].set(p_rows, mode="drop"), jax.tree.map(put, state, state_rows)

        # Two programs per k, each a single in-place pass: XLA's program for the whole step (parameter
        # and state together) copies a state leaf the parameter's loop still reads after the state's
        # loop overwrote it in place (one table-sized temporary) for most rules, and for every rule
        # once k > 1; split, the parameter's pass reads the old state, then the state's pass writes it.
        self._zero_param = jax.jit(zero_param, static_argnames="k", donate_argnums=(0,))
        self._zero_state = jax.jit(zero_state, static_argnames="k", donate_argnums=(1,))
        self._zero_param_copy = jax.jit(zero_param, static_argnames="k")
        self._zero_state_copy = jax.jit(zero_state, static_argnames="k")
        self._zero_steps_fn = zero_steps
        #: Per variable layout: whether the k-step zero passes run in place (see _zero_plan).
        self._zero_plans: dict[Any, bool] = {}
        self._put_rows = jax.jit(put_rows, donate_argnums=(0, 1))

    def init(self, param: np.ndarray) -> Any:
        """The optimizer state of ``param``: numpy arrays (writable copies in the lazy mode)."""
        state = self._init(param)
        if self.lazy:
            # The lazy mode writes its rows into the state in place (the store's row merge); a
            # read-only view of XLA's buffer would be copied whole by the first push instead, on
            # that push's deadline (two 320 MB copies for Adam on a 5M-row shard).
            return jax.tree.map(np.array, state)
        return _to_numpy_tree(state)

    def apply(self, param: Any, state: Any, grad: np.ndarray, donate: bool = False) -> tuple[np.ndarray, jax.Array, Any]:
        """Dense step: ``(new param as a read-only numpy view, the same as an XLA array, new state)``.

        ``param`` and ``state`` may be numpy or XLA arrays; passing back the XLA
        arrays of the previous step saves copying them into XLA again (the
        state stays in XLA arrays: readers use ``np.asarray``, a free view on CPU).
        ``donate``: ``param`` and ``state`` are XLA arrays nobody else uses (no
        numpy view of them is alive either); the step updates them in place and
        they are invalid afterwards.
        """
        new_param, new_state = (self._step_donating if donate and _donatable(param, state) else self._step)(param, state, grad)
        return np.asarray(new_param), new_param, new_state

    def apply_rows(
        self, param: Any, state: Any, indices: np.ndarray, rows: np.ndarray, donate: bool = False
    ) -> tuple[np.ndarray, jax.Array, Any]:
        """Exact row update: the dense rule with zero gradient for the rows not in ``indices``.

        ``indices``: int64 row indices, rank 1 (a repeated index's rows add
        up); ``rows``: their gradient rows. The results are :meth:`apply`'s
        for the dense gradient that has ``rows`` added at ``indices`` and
        zeros elsewhere; only ``len(indices)`` rows enter XLA (padded to a
        power of two: O(log n) compilations per shape). ``donate``: as for :meth:`apply`.
        A :func:`row_separable` rule is computed in three steps with the same
        values (see there) when :meth:`batches_rows` says so; any other in one.
        """
        if self.batches_rows(param, state):
            return self._apply_rows_separable(param, state, [(indices, rows)], donate)
        n = len(indices)
        pad = _bucket(n) - n
        if pad:
            indices = np.concatenate([indices, np.zeros(pad, np.int64)])
            rows = np.concatenate([rows, np.zeros((pad,) + rows.shape[1:], rows.dtype)])
        fn = self._row_step_donating if donate and _donatable(param, state) else self._row_step
        new_param, new_state = fn(param, state, indices, rows)
        return np.asarray(new_param), new_param, new_state

    def batches_rows(self, param: Any, state: Any) -> bool:
        """Whether this variable's exact row pushes take the three-step path, and so several of them
        may be applied in one pass over the table (:meth:`apply_rows_many`): a :func:`row_separable`
        rule, not lazy, a variable of at least ``separable_min_size`` elements, and zero passes that
        run in place (:meth:`_zero_plan`). Depends on the layout only, never on a push."""
        return (self.row_separable and not self.lazy and int(np.prod(np.shape(param))) >= self.separable_min_size
                and self._zero_plan(param, state))

    def apply_rows_many(
        self, param: Any, state: Any, pushes: Sequence[tuple[np.ndarray, np.ndarray]], donate: bool = False
    ) -> tuple[np.ndarray, jax.Array, Any]:
        """Several exact row pushes, in order: the values :meth:`apply_rows` gives applying them one
        after the other, bit for bit. ``pushes``: ``(indices, rows)`` pairs as for :meth:`apply_rows`.

        Where :meth:`batches_rows` holds, the table is passed over once for up to
        :data:`MAX_PUSHES_PER_PASS` pushes (the zero-gradient steps of all of them unrolled in one
        loop, the pushed rows' steps on those rows alone): the O(table) memory traffic of one push
        for all of them. Elsewhere the pushes are applied one by one.
        """
        if not pushes:
            raise ValueError("apply_rows_many needs at least one push")
        separable = self.batches_rows(param, state)
        size = MAX_PUSHES_PER_PASS if separable else 1
        out: tuple[np.ndarray, jax.Array, Any] | None = None
        for i in range(0, len(pushes), size):
            out = None  # XLA copies a donated buffer that a numpy view still points at
            if separable:
                out = self._apply_rows_separable(param, state, pushes[i:i + size], donate)
            else:
                out = self.apply_rows(param, state, pushes[i][0], pushes[i][1], donate)
            param, state = out[1], out[2]
        assert out is not None
        return out

    def rows_after(self, param: Any, state: Any, indices: np.ndarray,
                   pushes: Sequence[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
        """Rows ``indices`` of the parameter after the exact row ``pushes`` (not yet applied to ``param``
        and ``state``), without changing either: bit for bit what :meth:`apply_rows_many` would give
        those rows (the same per-push gradients on the gathered rows, the same jitted step, push after
        push). ``indices``: int64, rank 1, repeats allowed; returns a new array, one row per index."""
        uniq, inverse = np.unique(indices, return_inverse=True)
        p_rows, _ = self._rows_stepped(param, state, uniq, pushes)
        return np.asarray(p_rows)[: len(uniq)][inverse.reshape(-1)]

    def _rows_stepped(self, param: Any, state: Any, uniq: np.ndarray,
                      pushes: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[Any, Any]:
        """Rows ``uniq`` (sorted, distinct) of the parameter and of the state leaves shaped like it,
        gathered and padded to a bucket, after one step of the rule per push: the push's gradient on
        those rows (its rows for those ids, duplicates summed in push order from +0.0 in the
        parameter's dtype, as the dense scatter-add sums them), zero on the rows it did not name (the
        zero step's arithmetic, as on every row it did not name). Steps with the dense step's own
        jitted function, the same fused arithmetic as the dense step's, so the rows round as they
        would there. Padding rows (zero gradient, parameter and state) are computed, never meant to be
        written back. Returns ``(parameter rows, state)``: the state's other leaves stepped too."""
        shape = np.shape(param)
        dtype = np.dtype(param.dtype)
        u = len(uniq)
        b = _bucket(u)

        def take(leaf: Any) -> Any:
            arr = np.asarray(leaf)  # a view of an XLA array on CPU, dropped on return (before any donation)
            if arr.shape != shape:
                return leaf
            out = np.zeros((b,) + shape[1:], arr.dtype)
            out[:u] = arr[uniq]
            return out

        p_rows, state_rows = take(param), jax.tree.map(take, state)
        for idx, rows in pushes:
            g = np.zeros((b,) + shape[1:], dtype)
            pos = np.searchsorted(uniq, idx)
            hit = pos < u
            hit[hit] = uniq[pos[hit]] == idx[hit]
            np.add.at(g, pos[hit], rows[hit].astype(dtype, copy=False))
            p_rows, state_rows = self._step(p_rows, state_rows, g)
        return p_rows, state_rows

    def _zero_plan(self, param: Any, state: Any) -> bool:
        """Whether the zero-gradient passes of this variable's layout run in place (decided once per layout).

        The parameter's pass (:func:`zero_param`) reads the old state and writes the parameter; the
        state's pass (:func:`zero_state`) then writes the state. That is right only if the state's
        new values never read the parameter (true of the element-wise rules' moments and
        accumulators; checked on the rule's program, conservatively: any use counts), and pays only
        if neither pass needs a temporary the size of a table leaf (checked on XLA's programs for one
        step). The choice depends on the layout only, never on the push, so a variable's pushes always
        take the same path.
        """
        aval = _aval(param)
        state_avals = jax.tree.map(_aval, state)
        key = (aval, jax.tree.structure(state_avals), tuple(jax.tree.leaves(state_avals)))
        with self._lock:
            if key in self._zero_plans:
                return self._zero_plans[key]
        zero = jax.ShapeDtypeStruct((), aval.dtype)
        leaf_bytes = int(np.prod(aval.shape)) * aval.dtype.itemsize
        reads_param = _reads_first_argument(
            lambda p, s, z: self._zero_steps_fn(p, s, z, 1)[1], aval, state_avals, zero)
        temps = []
        if not reads_param:
            for fn in (self._zero_param, self._zero_state):
                stats = fn.lower(aval, state_avals, zero, k=1).compile().memory_analysis()
                temps.append(None if stats is None else stats.temp_size_in_bytes)
        plan = not reads_param and all(t is not None and t < leaf_bytes for t in temps)
        logger.info("exact row pushes of a %s %s variable: %s (the state reads the parameter: %s; the zero "
                    "passes' temporaries: %s bytes)", aval.shape, aval.dtype, "three steps" if plan else "one step",
                    reads_param, temps)
        with self._lock:
            return self._zero_plans.setdefault(key, plan)

    def _apply_rows_separable(
        self, param: Any, state: Any, pushes: Sequence[tuple[np.ndarray, np.ndarray]], donate: bool
    ) -> tuple[np.ndarray, jax.Array, Any]:
        """:meth:`apply_rows_many` for a :func:`row_separable` rule, k = ``len(pushes)`` pushes: the rule on
        the rows any of them names (gathered; k steps, each with its push's gradient, zero for the
        others' rows), the k zero-gradient dense steps (the parameter's pass, then the state's; donated
        when allowed), then those rows written over their result."""
        k = len(pushes)
        uniq = np.unique(np.concatenate([np.asarray(idx, np.int64) for idx, _ in pushes]))
        p_rows, state_rows = self._rows_stepped(param, state, uniq, pushes)
        # Padding rows point past the table: never written back.
        uniq_p = np.full(_bucket(len(uniq)), param.shape[0], np.int64)
        uniq_p[: len(uniq)] = uniq
        zero = np.zeros((), param.dtype)
        in_place = donate and _donatable(param, state)
        # The parameter's pass reads the old state; only then may the state's pass overwrite it
        # (JAX orders a donation after the reads already dispatched).
        new_param = (self._zero_param if in_place else self._zero_param_copy)(param, state, zero, k=k)
        new_state = (self._zero_state if in_place else self._zero_state_copy)(new_param, state, zero, k=k)
        new_param, new_state = self._put_rows(new_param, new_state, uniq_p, p_rows, state_rows)
        return np.asarray(new_param), new_param, new_state

    def apply_sparse(
        self, param: np.ndarray, state: Any, indices: np.ndarray, rows: np.ndarray
    ) -> tuple[np.ndarray, Any, Any]:
        """Lazy row update (:func:`lazy_rows`).

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
