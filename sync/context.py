"""Which strategy and replica context are current (TF's distribution context).

Situations, as in TF:

- **default**: outside any ``strategy.scope()`` and outside ``strategy.run``.
  :func:`get_strategy` returns the pass-through default strategy (one
  replica) and :func:`get_replica_context` its default replica context.
- **cross-replica**: inside ``with strategy.scope():`` but not inside
  ``strategy.run``. :func:`get_strategy` returns that strategy and
  :func:`get_replica_context` returns ``None``.
- **replica**: while ``strategy.run`` traces ``fn``. :func:`get_replica_context`
  returns a :class:`ReplicaContext` whose collectives are XLA collectives over
  the strategy's ``"replica"`` mesh axis.
- **merge** (cross-replica inside a replica): while ``merge_fn`` of
  :meth:`ReplicaContext.merge_call` runs. :func:`get_replica_context` returns
  ``None`` and cross-replica methods (``reduce``, ``extended.update``...) work
  on the values the replicas handed over.

The state is per thread; ``strategy.run`` traces ``fn`` in the calling thread.

This module also holds the *variable frames*: while ``run`` (or
:func:`jaxdist.function`) traces a function, variables read and assigned in it
are threaded through the compiled program as inputs and outputs (see
:mod:`jaxdist.sync.variables`); the innermost frame answers for them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxdist.base.errors import ConfigurationError
from jaxdist.sync.hooks import entered_scope_hooks
from jaxdist.sync.reduce_op import ReduceOp

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from jaxdist.sync.strategy import Strategy
    from jaxdist.sync.variables import VarFrame

__all__ = [
    "ReplicaContext",
    "get_strategy",
    "get_replica_context",
    "has_strategy",
    "in_cross_replica_context",
]


class _State(threading.local):
    def __init__(self) -> None:
        self.scopes: list[Any] = []
        self.replica: list[ReplicaContext] = []
        self.merge = 0
        self.frames: list[VarFrame] = []


_state = _State()


class ReplicaContext:
    """The replica-side view of a strategy while ``strategy.run`` runs ``fn``.

    Collectives act over the strategy's replica axis and compile to XLA
    collectives inside the one step ``run`` compiles; the way the all-reduce
    is done follows the strategy's ``cross_device_ops`` /
    ``communication_options`` (see :mod:`jaxdist.sync.cross_device_ops`).

    Args:
        strategy: the strategy running ``fn``.
        axis_name: mesh axis the replicas are laid on; ``None`` for the
            default (single replica) context, whose collectives are identities.
        num_rows: for a run over a batch with uneven replicas, this replica's
            real row count (a traced int32 scalar); ``padded_rows`` is the
            static padded row count.
    """

    def __init__(
        self, strategy: Strategy, axis_name: str | None, num_rows: Any = None, padded_rows: int | None = None
    ) -> None:
        self._strategy = strategy
        self._axis_name = axis_name
        self._num_rows = num_rows
        self._padded_rows = padded_rows
        #: Set once fn asked for the padding mask (directly or through the loss helper or a metric).
        self.rows_used = False
        #: Values fn declared replicated with :func:`jaxdist.replicated`, in call order: (traced leaf,
        #: where: the call site and the leaf's path in the declared tree). ``run`` checks them when it compiles.
        self.declared: list[tuple[Any, str]] = []

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return self._strategy.num_replicas_in_sync

    @property
    def axis_name(self) -> str | None:
        """The mesh axis name usable with ``jax.lax`` collectives inside ``fn``."""
        return self._axis_name

    @property
    def replica_id_in_sync_group(self) -> Any:
        """This replica's index in ``[0, num_replicas_in_sync)`` (a traced int32 inside ``run``)."""
        if self._axis_name is None:
            return jnp.int32(0)
        return jax.lax.axis_index(self._axis_name)

    @property
    def devices(self) -> tuple[Any, ...]:
        """The devices of the whole replica group (TF's ``ReplicaContext.devices`` lists this replica's)."""
        return tuple(getattr(self._strategy, "devices", ()))

    # -- padding of uneven batches ---------------------------------------------------

    @property
    def num_rows(self) -> Any:
        """This replica's real rows in the current batch, or None when the batch is even.

        A batch split as TF splits a short batch (20 rows over 8 replicas:
        ``[3, 3, 3, 3, 3, 3, 2, 0]``) reaches every replica padded to the same
        row count (3); this is the replica's real count (a traced int32).
        """
        if self._num_rows is not None:
            self.rows_used = True
        return self._num_rows

    @property
    def padded_rows(self) -> int | None:
        """The padded (static) row count of the current batch, or None when the batch is even."""
        return self._padded_rows

    def row_mask(self, rows: int | None = None, dtype: Any = jnp.float32) -> Any:
        """1 for this replica's real rows, 0 for padding (``None`` when the batch is even).

        Args:
            rows: the leading dimension the mask is for (default the batch's
                padded row count); a different size gets ``None``, since it is
                not a per-example array of this batch.
            dtype: the mask's dtype.

        ``jaxdist.compute_average_loss`` and the ``jaxdist.metrics`` objects
        apply this mask themselves; use it for anything else computed per
        example (a hand-written mean, predictions kept for later).
        """
        if self._num_rows is None or (rows is not None and rows != self._padded_rows):
            return None
        self.rows_used = True
        return (jnp.arange(self._padded_rows) < self._num_rows).astype(dtype)

    # -- collectives -----------------------------------------------------------------

    def all_reduce(self, reduce_op: ReduceOp | str, value: Any, options: Any = None) -> Any:
        """Reduce every leaf of ``value`` across replicas; every replica gets the result.

        ``SUM`` adds the replicas' values, ``MEAN`` divides that by
        ``num_replicas_in_sync``. How the all-reduce is done (one fused psum,
        reduce-scatter + all-gather, packs of ``bytes_per_pack``...) follows
        the strategy's ``cross_device_ops`` / ``communication_options``, or
        ``options`` (a :class:`jaxdist.CommunicationOptions`) for this call.
        A value that is the same on every replica is reduced like any other
        (``SUM`` gives ``num_replicas_in_sync * value``).

        Args:
            reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN``.
            value: a pytree of arrays.
            options: optional ``CommunicationOptions`` for this call.

        Returns:
            A pytree of the same structure, identical on every replica.
        """
        op = ReduceOp.coerce(reduce_op)
        if self._axis_name is None:
            return jax.tree.map(jnp.asarray, value)
        return self._strategy.engine.all_reduce_in_replica(op, value, options)

    def all_gather(self, value: Any, axis: int, options: Any = None) -> Any:
        """Concatenate every replica's leaves along ``axis`` (replica order); every replica gets the result."""
        if options is not None:
            self._strategy.engine.check_options(options, "all_gather")
        if self._axis_name is None:
            return jax.tree.map(jnp.asarray, value)
        return jax.tree.map(lambda x: jax.lax.all_gather(x, self._axis_name, axis=axis, tiled=True), value)

    def merge_call(self, merge_fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None) -> Any:
        """Call ``merge_fn(strategy, *args, **kwargs)`` once, in cross-replica context (TF's ``merge_call``).

        Every replica hands over its ``args``; inside ``merge_fn`` each array
        leaf is a per-replica value holding all replicas' values (as TF's
        ``PerReplica``), so ``strategy.reduce``, ``strategy.gather``,
        ``strategy.experimental_local_results``,
        ``strategy.extended.reduce_to``/``batch_reduce_to`` and
        ``strategy.extended.update`` work on them, and
        :func:`in_cross_replica_context` is True. What ``merge_fn`` returns
        goes back to every replica (a per-replica value returns each replica
        its own part). In jaxdist every replica runs the same program, so
        ``merge_fn`` is traced once and its collectives are XLA collectives.
        """
        kwargs = dict(kwargs or {})
        if self._axis_name is None:
            with enter_merge():
                return merge_fn(self._strategy, *args, **kwargs)
        from jaxdist.sync.values import PerReplica

        wrap = lambda x: MergedValue(self, x) if _is_arraylike(x) else x  # noqa: E731
        w_args = jax.tree.map(wrap, tuple(args))
        w_kwargs = jax.tree.map(wrap, kwargs)
        with enter_merge():
            out = merge_fn(self._strategy, *w_args, **w_kwargs)

        def unwrap(x: Any) -> Any:
            if isinstance(x, MergedValue):
                return x.local
            if isinstance(x, PerReplica):
                raise TypeError("merge_fn returned a PerReplica value made outside the replica; return arrays")
            return x

        return jax.tree.map(unwrap, out, is_leaf=lambda x: isinstance(x, (MergedValue, PerReplica)))

    def __repr__(self) -> str:
        return f"ReplicaContext(strategy={type(self._strategy).__name__}, axis_name={self._axis_name!r})"


def _is_arraylike(x: object) -> bool:
    import numpy as np

    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, bool, jax.core.Tracer))


class MergedValue:
    """Inside ``merge_fn``: one value per replica, handed over by ``merge_call`` (TF's ``PerReplica``).

    Each replica still holds only its own part (``local``); strategy methods
    that combine the replicas' parts (reduce, gather, local results) do so
    with collectives over the replica axis.
    """

    __slots__ = ("ctx", "local")

    def __init__(self, ctx: ReplicaContext, local: Any) -> None:
        self.ctx = ctx
        self.local = local

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(jnp.shape(self.local))

    @property
    def dtype(self) -> Any:
        return jnp.asarray(self.local).dtype

    def __repr__(self) -> str:
        return f"PerReplica(merged, shape={self.shape})"


def _default_strategy() -> Any:
    from jaxdist.sync.strategy import default_strategy

    return default_strategy()


def is_default_strategy(strategy: object) -> bool:
    """Whether ``strategy`` is the default strategy (the pass-through one current outside any scope)."""
    from jaxdist.sync.strategy import is_default_strategy as is_default

    return is_default(strategy)


def get_strategy() -> Any:
    """The current strategy: the one whose ``scope()`` or ``run`` is active, else the default strategy.

    A ``ParameterServerStrategy``'s scope counts too.
    """
    if _state.replica:
        return _state.replica[-1].strategy
    if _state.scopes:
        return _state.scopes[-1]
    return _default_strategy()


def has_strategy() -> bool:
    """Whether a non-default strategy is current."""
    return bool(_state.replica) or any(not is_default_strategy(s) for s in _state.scopes)


def in_cross_replica_context() -> bool:
    """True inside a non-default ``strategy.scope()`` but outside ``strategy.run`` (or inside ``merge_call``)."""
    if _state.replica and not _state.merge:
        return False
    return has_strategy()


def in_replica_fn() -> bool:
    """Whether ``fn`` of a ``strategy.run`` is being traced here (replica context), outside any ``merge_fn``.

    Cross-replica methods (``strategy.reduce``, ``Checkpoint.save``...) refuse to run there.
    """
    return bool(_state.replica) and not _state.merge


def innermost_scope() -> Any:
    """The strategy whose ``scope()`` was entered last on this thread (any kind of strategy), or None."""
    return _state.scopes[-1] if _state.scopes else None


def in_merge() -> bool:
    """Whether a ``merge_fn`` of ``ReplicaContext.merge_call`` is running (cross-replica inside a replica)."""
    return bool(_state.replica) and bool(_state.merge)


def current_replica() -> ReplicaContext | None:
    """The ReplicaContext of the innermost ``run`` being traced (also inside merge_fn), else None."""
    return _state.replica[-1] if _state.replica else None


def get_replica_context() -> ReplicaContext | None:
    """The current replica context.

    Returns:
        The :class:`ReplicaContext` of the ``strategy.run`` being traced; the
        default strategy's context outside any scope; ``None`` in a
        cross-replica context (inside ``scope()``, outside ``run``, or inside
        ``merge_call``), as TF.
    """
    if _state.replica and not _state.merge:
        return _state.replica[-1]
    if in_cross_replica_context():
        return None
    return _default_strategy().replica_context


@contextlib.contextmanager
def enter_scope(strategy: Any) -> Iterator[Any]:
    """Make ``strategy`` current for the block (what ``strategy.scope()`` does)."""
    for other in _state.scopes:
        if other is not strategy and not is_default_strategy(other) and not is_default_strategy(strategy):
            raise ConfigurationError(
                f"cannot enter {type(strategy).__name__}.scope() inside {type(other).__name__}.scope(): "
                "mixing different strategies is not supported (as in TF); leave the outer scope first"
            )
    _state.scopes.append(strategy)
    try:
        # What code built on the sync core enters with every scope (Keras's view of the strategy, once
        # jaxdist.keras is in use): registered in jaxdist.sync.hooks, never imported from here.
        with entered_scope_hooks(strategy):
            yield strategy
    finally:
        _state.scopes.pop()


@contextlib.contextmanager
def enter_replica(ctx: ReplicaContext) -> Iterator[ReplicaContext]:
    """Make ``ctx`` the current replica context while ``strategy.run`` traces ``fn``."""
    _state.replica.append(ctx)
    saved_merge, _state.merge = _state.merge, 0
    try:
        yield ctx
    finally:
        _state.merge = saved_merge
        _state.replica.pop()


@contextlib.contextmanager
def enter_merge() -> Iterator[None]:
    """Cross-replica context inside a replica (``merge_fn`` of ``merge_call``)."""
    _state.merge += 1
    try:
        yield
    finally:
        _state.merge -= 1


def current_frame() -> VarFrame | None:
    """The innermost variable frame (a ``run`` or ``jaxdist.function`` being traced), if any."""
    return _state.frames[-1] if _state.frames else None


@contextlib.contextmanager
def enter_frame(frame: VarFrame) -> Iterator[VarFrame]:
    _state.frames.append(frame)
    try:
        yield frame
    finally:
        _state.frames.pop()


@contextlib.contextmanager
def outside_frames() -> Iterator[None]:
    """Hide the frames (and replica contexts) for the block: eager, cross-replica work inside a trace."""
    frames, replica, merge = _state.frames, _state.replica, _state.merge
    _state.frames, _state.replica, _state.merge = [], [], 0
    try:
        yield
    finally:
        _state.frames, _state.replica, _state.merge = frames, replica, merge
