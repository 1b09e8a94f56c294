"""Synchronous strategies on XLA collectives: Mirrored, TPU, OneDevice, CentralStorage, default.

Every mesh strategy lays its replicas on a 1-D :class:`jax.sharding.Mesh`
whose single axis is named ``"replica"`` (:data:`AXIS`):

- A *variable* created in ``strategy.scope()``
  (:func:`jaxdist.create_variables`, ``strategy.create_variables``) is a
  :class:`~jaxdist.sync.variables.SyncVariable`: mirrored on every replica
  (or, for metrics, one part per replica). ``run`` threads the variables
  ``fn`` uses through the compiled step: reads see the current value,
  ``assign`` updates it, as in TF.
- A *replicated* value is a ``jax.Array`` with ``NamedSharding(mesh,
  PartitionSpec())``: one logical value, an identical copy on every replica.
  :meth:`Strategy.replicate` makes them (the functional style, where ``fn``
  takes and returns its state).
- A *per-replica* value is a :class:`~jaxdist.sync.values.PerReplica`.
- :meth:`Strategy.run` compiles ``fn`` once per input signature with
  ``jax.jit(jax.shard_map(...))`` over the mesh, so inside ``fn``
  ``jax.lax.psum(x, "replica")`` and
  ``jaxdist.get_replica_context().all_reduce(op, x)`` are XLA collectives in
  the same compiled step. Gradients with respect to replicated values are
  *per-replica* until ``fn`` all-reduces them, as in TF; outputs that are
  provably the same on every replica (see :mod:`jaxdist.sync._varying`) come
  back replicated, all others as ``PerReplica``.

TF's custom-training-loop pattern, with no hand-written all-reduce::

    strategy = jaxdist.MirroredStrategy()
    with strategy.scope():
        params = jaxdist.create_variables(init_params(key))      # mirrored variables
        optimizer = jaxdist.Optimizer(optax.adam(1e-3))           # all-reduces like TF's
        accuracy = jaxdist.metrics.SparseCategoricalAccuracy()

    def train_step(batch):
        x, y = batch
        def loss_fn(p):
            logits = apply(p, x)
            per_example = optax.softmax_cross_entropy_with_integer_labels(logits, y)
            return jaxdist.compute_average_loss(per_example, GLOBAL_BATCH), logits
        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(jaxdist.read_variables(params))
        optimizer.apply(grads, params)
        accuracy.update_state(y, logits)
        return loss

    @jaxdist.function                                               # TF: @tf.function
    def distributed_train_step(batch):
        losses = strategy.run(train_step, args=(batch,))
        return strategy.reduce("sum", losses, axis=None)

    for batch in strategy.experimental_distribute_dataset(batches):
        loss = distributed_train_step(batch)

``strategy.run_steps(train_step, iterator, steps=k)`` runs ``k`` steps in one
compiled call (``lax.scan``; TF's ``steps_per_execution``) and
``strategy.run_epoch(train_step, dataset)`` a whole epoch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import InputContext, ValueContext
from jaxdist.sync import context as ctx_lib
from jaxdist.sync import cross_device_ops as cdo
from jaxdist.sync.engine import AXIS, SyncEngine
from jaxdist.sync.extended import StrategyExtended
from jaxdist.sync.reduce_op import ReduceOp
from jaxdist.sync.reductions import gather_rows, reduce_stacked
from jaxdist.sync.values import PerReplica, is_array_like, is_per_replica
from jaxdist.sync.variables import SyncVariable

logger = logging.getLogger(__name__)

__all__ = ["AXIS", "Strategy", "default_strategy", "replicate"]

#: Set to a JAX platform name ("cpu") to let TPUStrategy run its code path on
#: that platform's devices when no TPU is present (tests, development).
ENV_TPU_FAKE_DEVICES = "JAXDIST_TPU_FAKE_DEVICES"


def check_run_args(args: Any, kwargs: Any) -> tuple[tuple, dict]:
    """``run``'s ``args``/``kwargs`` as a tuple and a dict (TypeError for anything else)."""
    if kwargs is None:
        kwargs = {}
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"run(fn, args=...) wants a tuple of positional arguments, got {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"run(fn, kwargs=...) wants a dict, got {type(kwargs).__name__}")
    return tuple(args), dict(kwargs)


def check_run_options(options: Any) -> None:
    """``run(options=...)``: TF's RunOptions have nothing to tune here (ConfigurationError if given)."""
    if options is not None:
        raise ConfigurationError(
            "strategy.run(options=...): TF's tf.distribute.RunOptions only tune TPUStrategy's dynamic-shape "
            "handling (bucketizing, dynamic batch sizes); jaxdist compiles static shapes, pads short batches "
            "itself (see experimental_distribute_dataset) and has no such options. Leave options=None"
        )


# ---------------------------------------------------------------------------------------
# Strategy base
# ---------------------------------------------------------------------------------------


class Strategy:
    """Base class of every synchronous strategy (TF's ``tf.distribute.Strategy``).

    Subclasses differ in where variables live and which devices compute; the
    API is the same. Methods documented "cross-replica" must not be called
    from inside ``fn`` in :meth:`run` (use the :class:`ReplicaContext` there,
    or ``merge_call``).
    """

    def __init__(self, engine: SyncEngine) -> None:
        self._engine = engine
        self._extended: StrategyExtended | None = None

    @property
    def engine(self) -> SyncEngine:
        """The strategy's machinery (:class:`jaxdist.sync.engine.SyncEngine`): jaxdist's interface to it.

        jaxdist's modules (compiled loops, variables, ``jaxdist.function``,
        checkpoints, datasets) call it; user code calls the strategy.
        """
        return self._engine

    # -- context -----------------------------------------------------------------

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Make this the current strategy for the block (``jaxdist.get_strategy()`` returns it).

        Inside the scope, :func:`jaxdist.create_variables` makes this
        strategy's variables and the loss helpers use its replica count.
        Entering another strategy's scope inside it raises ConfigurationError.
        """
        return ctx_lib.enter_scope(self)

    @property
    def extended(self) -> StrategyExtended:
        """TF's ``strategy.extended`` (:class:`jaxdist.sync.extended.StrategyExtended`)."""
        if self._extended is None:
            self._extended = StrategyExtended(self)
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that take part in each synchronous step (all processes together)."""
        return self._engine.num_replicas

    @property
    def cluster_resolver(self) -> Any:
        """The resolver the strategy was built from (None for single-host strategies)."""
        return None

    def _check_cross_replica(self, method: str) -> None:
        if ctx_lib.in_replica_fn():
            raise RuntimeError(
                f"strategy.{method}() was called inside strategy.run(fn): it is a cross-replica method. "
                "Inside fn use jaxdist.get_replica_context().all_reduce/all_gather (or merge_call) instead"
            )

    # -- variables -----------------------------------------------------------------

    @property
    def variables(self) -> dict[str, SyncVariable]:
        """Every variable created in this strategy's scope, by name."""
        return self._engine.variables.snapshot()

    def create_variable(self, initial_value: Any, **kwargs: Any) -> SyncVariable:
        """A variable of this strategy (see :func:`jaxdist.sync.variables.create_variable`)."""
        from jaxdist.sync.variables import create_variable

        return create_variable(initial_value, strategy=self, **kwargs)

    def create_variables(self, tree: Any, **kwargs: Any) -> Any:
        """A tree of variables of this strategy (see :func:`jaxdist.sync.variables.create_variables`)."""
        from jaxdist.sync.variables import create_variables

        return create_variables(tree, strategy=self, **kwargs)

    # -- API implemented by subclasses ----------------------------------------------

    def replicate(self, value: Any) -> Any:
        """Place every array leaf of ``value`` as a replicated value of this strategy (cross-replica)."""
        raise NotImplementedError

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` on every replica in one compiled step; see the subclasses."""
        raise NotImplementedError

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduce per-replica values to one value (cross-replica); see the subclasses."""
        raise NotImplementedError

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate per-replica values along ``axis`` (cross-replica); see the subclasses."""
        raise NotImplementedError

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """This process's per-replica parts of ``value``; see the subclasses."""
        raise NotImplementedError

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Per-replica values from ``value_fn(ValueContext(replica_id, num_replicas))``; see the subclasses."""
        raise NotImplementedError

    # -- input ------------------------------------------------------------------------

    def experimental_distribute_dataset(
        self,
        dataset: Iterable[Any],
        options: Any = None,
        *,
        with_mask: bool = False,
        drop_remainder: bool = False,
    ) -> Any:
        """Split each global batch of ``dataset`` across the replicas, as TF does.

        Args:
            dataset: a re-iterable of batches (a list, or an object whose
                ``__iter__`` starts a fresh pass: every epoch iterates it
                again); a batch is a pytree (tuple, dict, ...) of arrays that
                share their leading (batch) dimension. A one-shot iterator (a
                generator) is accepted for one pass only: a second pass
                raises ConfigurationError instead of silently yielding
                nothing. The first batch fixes the nominal global batch size
                ``B``. In a multi-process job every process must iterate the
                same global batches in the same order; each keeps its own
                replicas' rows.
            options: a :class:`jaxdist.InputOptions` (TF's
                ``tf.distribute.InputOptions``); see its documentation for
                what each field does here.
            with_mask: yield ``(batch, mask)`` instead of ``batch``: ``mask``
                (per-replica, float32) is 1 for real rows and 0 for padding.
            drop_remainder: skip batches with fewer than ``B`` rows.

        Returns:
            An iterable of distributed batches: leaves are ``PerReplica``
            (plain arrays for OneDeviceStrategy and the default strategy).

        The split is TF's for input without a static batch size (a Python
        iterable, like ``tf.data.Dataset.from_generator``): a batch of ``n``
        rows gives replica ``r`` rows ``[r*b, min((r+1)*b, n))`` with
        ``b = ceil(n / R)``, so 20 rows over 8 replicas give
        ``[3, 3, 3, 3, 3, 3, 2, 0]`` rows. XLA needs static shapes: every
        replica's slice is zero-padded to ``ceil(B / R)`` rows (one compiled
        step serves every batch) and the real counts travel with the batch
        (:attr:`PerReplica.row_counts`). ``values`` and
        ``experimental_local_results`` give the real rows; inside ``run``,
        :func:`jaxdist.compute_average_loss` and the ``jaxdist.metrics``
        objects ignore padding rows by themselves, and
        ``get_replica_context().row_mask()`` gives the mask for anything
        else. A step whose ``fn`` uses none of them while a replica holds
        padding raises ConfigurationError before it runs (with
        ``with_mask=True`` the mask is yours to apply and no check is made).
        """
        from jaxdist.sync.input_lib import DistributedDataset

        self._check_cross_replica("experimental_distribute_dataset")
        return DistributedDataset(self, dataset, with_mask=with_mask, drop_remainder=drop_remainder, options=options)

    def distribute_datasets_from_function(
        self,
        dataset_fn: Callable[[InputContext], Iterable[Any]],
        options: Any = None,
        *,
        with_mask: bool = False,
    ) -> Any:
        """Build one input pipeline per process with ``dataset_fn(input_context)``.

        As in TF, ``dataset_fn`` gets an :class:`InputContext` (one pipeline
        per process, or one per replica with
        ``InputOptions(experimental_replication_mode=PER_REPLICA)``) and must
        return batches of the *per-replica* batch size
        (``input_context.get_per_replica_batch_size(global_batch_size)``),
        sharded as it sees fit (``input_pipeline_id``). Each step takes one
        batch per local replica, in order. The first batch fixes the
        per-replica size ``b``; a shorter batch, or a replica left without
        one when a pipeline runs out, is delivered as TF does (fewer or no
        rows), padded to ``b`` rows with the counts attached as for
        :meth:`experimental_distribute_dataset`. Iteration ends when every
        pipeline is exhausted; every pass calls ``dataset_fn`` again.
        """
        from jaxdist.sync.input_lib import DistributedDataset

        self._check_cross_replica("distribute_datasets_from_function")
        return DistributedDataset(self, dataset_fn, with_mask=with_mask, per_replica_fn=True, options=options)

    # -- compiled loops ---------------------------------------------------------------

    def run_steps(
        self,
        fn: Callable[..., Any],
        iterator: Iterator[Any],
        steps: int,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """Run ``fn(batch, *args, **kwargs)`` on up to ``steps`` batches of ``iterator`` in ONE compiled call.

        TF's ``steps_per_execution`` (and the tutorial's ``train_multiple_steps``):
        the batches are stacked and a ``lax.scan`` inside the compiled step
        runs ``fn`` once per batch, threading the variables ``fn`` updates
        from one step to the next, so Python dispatches once per ``steps``.
        Fewer batches than ``steps`` left: those are run (one more
        compilation for that count).

        Args:
            fn: the replica function, as for :meth:`run`; its first argument is the batch.
            iterator: an iterator of distributed batches (``iter(dist_dataset)``).
            steps: the most steps to run in this call.
            args, kwargs: further arguments, the same for every step.

        Returns:
            ``fn``'s outputs with a leading steps axis (a per-replica output's
            per-replica value gains it: ``strategy.reduce("sum", losses)``
            gives one total per step), or None if ``iterator`` had no batch left.
        """
        if not isinstance(steps, (int, np.integer)) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        batches = []
        for _ in range(int(steps)):
            try:
                batches.append(next(iterator))
            except StopIteration:
                break
        if not batches:
            return None
        return self._run_stacked(fn, batches, args, kwargs)

    def run_epoch(
        self,
        fn: Callable[..., Any],
        dataset: Iterable[Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        """One pass over ``dataset`` in ONE compiled call (TF's ``distributed_train_epoch``).

        Every batch of the pass is fetched first (they must fit in device
        memory together), then run as :meth:`run_steps` does.

        Returns:
            ``fn``'s outputs with a leading steps axis, or None for an empty dataset.
        """
        batches = list(iter(dataset))
        if not batches:
            return None
        return self._run_stacked(fn, batches, args, kwargs)

    def _run_stacked(self, fn: Callable[..., Any], batches: list[Any], args: Sequence[Any], kwargs: Any) -> Any:
        raise NotImplementedError

    # -- collectives -------------------------------------------------------------------

    def collective_plan(self, options: Any, what: str) -> cdo.CrossDeviceOps:
        """The cross-device ops a collective called with ``options`` uses (see :meth:`SyncEngine.collective_plan`)."""
        return self._engine.collective_plan(options, what)


# ---------------------------------------------------------------------------------------
# Default strategy
# ---------------------------------------------------------------------------------------


class _DefaultStrategy(Strategy):
    """The pass-through strategy that is current outside any scope (one replica).

    ``run`` calls ``fn`` directly (no compilation added; wrap the caller in
    :func:`jaxdist.function` to compile), collectives are identities,
    ``reduce`` over replicas is the identity and datasets are yielded
    unchanged (padded and masked only with ``with_mask=True``).
    """

    def __init__(self) -> None:
        super().__init__(SyncEngine(self))
        self._replica_context = ctx_lib.ReplicaContext(self, None)

    @property
    def replica_context(self) -> ctx_lib.ReplicaContext:
        """The one replica's context (what ``get_replica_context()`` returns outside any scope)."""
        return self._replica_context

    def replicate(self, value: Any) -> Any:
        if any(isinstance(x, PerReplica) for x in jax.tree.leaves(value, is_leaf=is_per_replica)):
            raise TypeError("replicate() got a PerReplica value: reduce or gather it first")
        return jax.tree.map(lambda x: jnp.asarray(x) if is_array_like(x) else x, value)

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        check_run_options(options)
        args, kwargs = check_run_args(args, kwargs)
        with ctx_lib.enter_replica(self._replica_context):
            return fn(*args, **kwargs)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        op = ReduceOp.coerce(reduce_op)
        self._check_cross_replica("reduce")

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                return reduce_stacked(jnp.asarray(x.stacked), op, axis, x.row_counts)
            if isinstance(x, SyncVariable):
                x = x.value()
            x = jnp.asarray(x)
            if axis is None:
                return x
            return jnp.sum(x, axis) if op is ReduceOp.SUM else jnp.mean(x, axis)

        return jax.tree.map(one, value, is_leaf=is_per_replica)

    def gather(self, value: Any, axis: int) -> Any:
        self._check_cross_replica("gather")

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                return gather_rows(x, axis)
            return x  # a non-distributed value is returned unchanged, as in TF

        return jax.tree.map(one, value, is_leaf=is_per_replica)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        if isinstance(value, PerReplica):
            return value.values
        return (value,)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        return value_fn(ValueContext(0, 1))

    def _run_stacked(self, fn: Callable[..., Any], batches: list[Any], args: Sequence[Any], kwargs: Any) -> Any:
        from jaxdist.sync.loops import default_run_stacked

        return default_run_stacked(self._engine, fn, batches, args, kwargs)

    def __repr__(self) -> str:
        return "DefaultStrategy()"


_DEFAULT: _DefaultStrategy | None = None
_DEFAULT_LOCK = threading.Lock()


def default_strategy() -> _DefaultStrategy:
    """The process-wide default strategy (what ``get_strategy()`` returns outside any scope)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = _DefaultStrategy()
        return _DEFAULT


def replicate(value: Any) -> Any:
    """Place ``value``'s arrays as replicated values of the current strategy (``get_strategy().replicate``)."""
    return ctx_lib.get_strategy().replicate(value)


def is_default_strategy(strategy: object) -> bool:
    """Whether ``strategy`` is the default strategy (the pass-through one current outside any scope)."""
    return isinstance(strategy, _DefaultStrategy)
