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
import types
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import InputContext, ValueContext
from jaxdist.sync import context as ctx_lib
from jaxdist.sync import cross_device_ops as cdo
from jaxdist.sync.reduce_op import ReduceOp
from jaxdist.sync.values import MirroredRegistry, PerReplica, is_per_replica
from jaxdist.sync.variables import (
    SyncVariable,
    VariableAggregation,
    VariableSynchronization,
    _aggregate_stacked,
)

logger = logging.getLogger(__name__)

__all__ = ["AXIS", "Strategy", "default_strategy", "replicate"]

#: Name of the mesh axis the replicas are laid on (usable with ``jax.lax`` collectives in ``run``).
AXIS = "replica"

#: Compiled ``run`` programs kept per strategy (LRU). Each entry is one traced
#: function and input signature; 64 covers a train step, an eval step and a
#: few shapes (e.g. a short last batch) with room to spare, while bounding the
#: memory that executables of one-off lambdas could pin.
_RUN_CACHE_SIZE = 64

#: A function whose captured globals change on this many consecutive calls is
#: retraced each time (correct, but slow): warn once, naming the global.
_RETRACE_WARN_AFTER = 3

#: Set to a JAX platform name ("cpu") to let TPUStrategy run its code path on
#: that platform's devices when no TPU is present (tests, development).
ENV_TPU_FAKE_DEVICES = "JAXDIST_TPU_FAKE_DEVICES"

_PER_REPLICA, _REPLICATED, _STATIC, _ROWS = "per_replica", "replicated", "static", "rows"


def _is_array_like(x: object) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def _is_tracer(x: object) -> bool:
    return isinstance(x, jax.core.Tracer)


def _check_run_args(args: Any, kwargs: Any) -> tuple[tuple, dict]:
    if kwargs is None:
        kwargs = {}
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"run(fn, args=...) wants a tuple of positional arguments, got {type(args).__name__}")
    if not isinstance(kwargs, Mapping):
        raise TypeError(f"run(fn, kwargs=...) wants a dict, got {type(kwargs).__name__}")
    return tuple(args), dict(kwargs)


def _check_run_options(options: Any) -> None:
    if options is not None:
        raise ConfigurationError(
            "strategy.run(options=...): TF's tf.distribute.RunOptions only tune TPUStrategy's dynamic-shape "
            "handling (bucketizing, dynamic batch sizes); jaxdist compiles static shapes, pads short batches "
            "itself (see experimental_distribute_dataset) and has no such options. Leave options=None"
        )


# ---------------------------------------------------------------------------------------
# The run-cache trap: functions whose captured globals changed since they were traced
# ---------------------------------------------------------------------------------------

#: Modules whose functions are library code, not user code: not scanned for captured globals.
_LIBRARY_PREFIXES = ("jax", "jaxlib", "numpy", "optax", "jaxdist", "flax", "haiku", "equinox", "chex", "ml_dtypes")


def _fn_key(fn: Callable[..., Any]) -> Any:
    """Cache key of a callable: bound methods by (function, instance id), others by identity."""
    if isinstance(fn, types.MethodType):
        return ("method", fn.__func__, id(fn.__self__))
    return fn


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def _captures(fn: Callable[..., Any], depth: int = 0, seen: set[int] | None = None) -> list[tuple[Any, Any, Any]]:
    """``(holder, key, value)`` for every global and closure cell ``fn`` (and user functions it calls) reads.

    A cached compiled program bakes these values in; if one is rebound, the
    program is stale. Functions of libraries (jax, numpy, optax, jaxdist...)
    are not scanned. Attribute lookups (``self.model``) and in-place
    mutation of an array are not visible here.
    """
    seen = set() if seen is None else seen
    f = fn.__func__ if isinstance(fn, types.MethodType) else fn
    if hasattr(f, "func") and hasattr(f, "args"):  # functools.partial
        f = f.func
    code = getattr(f, "__code__", None)
    if code is None or id(f) in seen or depth > 2:
        return []
    seen.add(id(f))
    out: list[tuple[Any, Any, Any]] = []
    for cell in getattr(f, "__closure__", None) or ():
        try:
            out.append((cell, None, cell.cell_contents))
        except ValueError:  # an empty cell (a name assigned later)
            pass
    glb = getattr(f, "__globals__", {})
    for name in sorted(_code_names(code)):
        if name in glb:
            out.append((glb, name, glb[name]))
    for _, _, v in list(out):
        if isinstance(v, types.FunctionType) and not str(getattr(v, "__module__", "") or "").startswith(
            _LIBRARY_PREFIXES
        ):
            out.extend(_captures(v, depth + 1, seen))
    return out


def _changed_capture(caps: list[tuple[Any, Any, Any]]) -> str | None:
    """The name of the first captured global/cell that no longer holds the traced object, else None."""
    for holder, key, value in caps:
        if key is None:
            try:
                now = holder.cell_contents
            except ValueError:
                return "<closure cell>"
            if now is not value:
                return "<closure variable>"
        elif holder.get(key, _MISSING) is not value:
            return str(key)
    return None


_MISSING = object()


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

    _is_default = False

    def __init__(self) -> None:
        self._default_replica_context = ctx_lib.ReplicaContext(self, None)
        self._cross_device_ops: cdo.CrossDeviceOps = cdo.CrossDeviceOps()
        self._communication_options: cdo.CommunicationOptions | None = None
        self._variables: dict[str, SyncVariable] = {}
        self._var_names: dict[str, int] = {}
        self._var_lock = threading.Lock()
        #: Optimizers whose state lives in this strategy (checkpoints store their state per variable).
        self._optimizers: weakref.WeakSet[Any] = weakref.WeakSet()
        self._mirrored = MirroredRegistry()
        self._extended: Any = None
        self._jit_cache: dict[Any, Any] = {}

    # -- context -----------------------------------------------------------------

    def scope(self) -> contextlib.AbstractContextManager[Strategy]:
        """Make this the current strategy for the block (``jaxdist.get_strategy()`` returns it).

        Inside the scope, :func:`jaxdist.create_variables` makes this
        strategy's variables and the loss helpers use its replica count.
        Entering another strategy's scope inside it raises ConfigurationError.
        """
        return ctx_lib.enter_scope(self)

    @property
    def extended(self) -> Any:
        """TF's ``strategy.extended`` (:class:`jaxdist.sync.extended.StrategyExtended`)."""
        if self._extended is None:
            from jaxdist.sync.extended import StrategyExtended

            self._extended = StrategyExtended(self)
        return self._extended

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that take part in each synchronous step (all processes together)."""
        raise NotImplementedError

    @property
    def cluster_resolver(self) -> Any:
        """The resolver the strategy was built from (None for single-host strategies)."""
        return None

    def _check_cross_replica(self, method: str) -> None:
        if ctx_lib._state.replica and not ctx_lib._state.merge:
            raise RuntimeError(
                f"strategy.{method}() was called inside strategy.run(fn): it is a cross-replica method. "
                "Inside fn use jaxdist.get_replica_context().all_reduce/all_gather (or merge_call) instead"
            )

    # -- variables -----------------------------------------------------------------

    @property
    def variables(self) -> dict[str, SyncVariable]:
        """Every variable created in this strategy's scope, by name."""
        return dict(self._variables)

    def create_variable(self, initial_value: Any, **kwargs: Any) -> SyncVariable:
        """A variable of this strategy (see :func:`jaxdist.sync.variables.create_variable`)."""
        from jaxdist.sync.variables import create_variable

        return create_variable(initial_value, strategy=self, **kwargs)

    def create_variables(self, tree: Any, **kwargs: Any) -> Any:
        """A tree of variables of this strategy (see :func:`jaxdist.sync.variables.create_variables`)."""
        from jaxdist.sync.variables import create_variables

        return create_variables(tree, strategy=self, **kwargs)

    def _unique_name(self, name: str | None) -> str:
        """The variable's checkpoint key.

        An explicit name is kept as it is: a variable created again under a
        name in use takes its place in the strategy's registry (what
        :class:`jaxdist.Checkpoint` saves and restores), so "build a fresh
        model, then restore" works as in TF, where checkpoints follow the
        objects. Unnamed variables are numbered ``Variable``, ``Variable_1``...
        """
        if name:
            return name
        with self._var_lock:
            n = self._var_names.get("Variable", 0)
            cand = "Variable" if n == 0 else f"Variable_{n}"
            while cand in self._variables:
                n += 1
                cand = f"Variable_{n}"
            self._var_names["Variable"] = n + 1
        return cand

    def _create_sync_variable(
        self,
        value: jax.Array,
        name: str | None,
        trainable: bool,
        sync: VariableSynchronization,
        agg: VariableAggregation,
        checkpoint: bool,
    ) -> SyncVariable:
        frame = ctx_lib.current_frame()
        if frame is not None and not frame.discover:
            raise ConfigurationError(
                f"variable {name!r} is created inside compiled code (strategy.run / jaxdist.function) after its "
                "first trace. Create variables in strategy.scope() before the loop (as in TF, where tf.function "
                "supports only variables created on its first call); jaxdist.Optimizer and jaxdist.metrics "
                "create theirs when they are built"
            )
        vname = self._unique_name(name)
        with ctx_lib.outside_frames(), jax.ensure_compile_time_eval():
            if sync is VariableSynchronization.ON_READ:
                stored = self._store_on_read(jnp.broadcast_to(value[None], (self.num_replicas_in_sync, *value.shape)))
            else:
                stored = self._store_variable(value)
        var = SyncVariable(self, vname, stored, value.shape, value.dtype, trainable, sync, agg, checkpoint)
        self._variables[vname] = var
        return var

    def _store_variable(self, x: Any) -> Any:
        """Where a mirrored variable's value lives (the default strategy: the default device)."""
        return jnp.asarray(x)

    def _store_on_read(self, stacked: Any) -> Any:
        """Where a sync-on-read variable's per-replica parts live."""
        return jnp.asarray(stacked)

    def _aggregate_on_read(self, stacked: Any, aggregation: VariableAggregation) -> Any:
        """Cross-replica read of a sync-on-read variable: its parts combined by ``aggregation``."""
        return _aggregate_stacked(jnp.asarray(stacked), aggregation)

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

    def _check_options(self, options: Any, what: str) -> cdo.CommunicationOptions | None:
        opts = cdo.check_options(options, what)
        if opts is not None and opts.timeout is not None:
            raise ConfigurationError(
                f"{what}: CommunicationOptions(timeout_seconds=...) per call is not supported: the collectives of a "
                "step run inside one compiled program. Set it for the whole job with "
                "MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=...)) "
                "(it applies to collectives between processes only, as in TF)"
            )
        return opts

    def collective_plan(self, options: Any, what: str) -> cdo.CrossDeviceOps:
        """The cross-device ops a collective called with ``options`` uses: the plan the options ask for
        (``CommunicationOptions(implementation=..., bytes_per_pack=...)``) where they ask for one, else the
        strategy's own ``cross_device_ops``. ``what`` names the calling API in the errors for options that
        cannot apply per call (``timeout_seconds``)."""
        opts = self._check_options(options, what)
        if opts is not None:
            plan = cdo.plan_from_options(opts, self._platform())
            if plan is not None:
                return plan
        return self._cross_device_ops

    def _platform(self) -> str:
        return jax.devices()[0].platform

    def _in_replica_all_reduce(self, op: ReduceOp, value: Any, options: Any = None) -> Any:
        rep = ctx_lib.current_replica()
        if rep is None or rep.axis_name is None:
            return jax.tree.map(jnp.asarray, value)
        plan = self.collective_plan(options, "all_reduce")
        return cdo.all_reduce(plan, op is ReduceOp.MEAN, value, rep.axis_name, self.num_replicas_in_sync)

    # -- helpers shared with input_lib -----------------------------------------------

    def _input_context(self) -> InputContext:
        return InputContext(1, 0, self.num_replicas_in_sync)

    def _local_replica_ids(self) -> list[int]:
        return list(range(self.num_replicas_in_sync))

    def _num_processes(self) -> int:
        return 1

    def _distribute_local(self, stacked_local: Any, rows: np.ndarray | None = None, guard: bool = False) -> Any:
        """``stacked_local[i]`` is local replica i's value -> what the dataset yields."""
        raise NotImplementedError

    def _replica_devices(self) -> list[Any]:
        """The local replicas' devices, in local replica order."""
        return [jax.devices()[0]]


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

    _is_default = True
    #: Datasets yield the batch itself (one replica), not PerReplica values.
    _yields_plain_arrays = True

    @property
    def num_replicas_in_sync(self) -> int:
        return 1

    def replicate(self, value: Any) -> Any:
        if any(isinstance(x, PerReplica) for x in jax.tree.leaves(value, is_leaf=is_per_replica)):
            raise TypeError("replicate() got a PerReplica value: reduce or gather it first")
        return jax.tree.map(lambda x: jnp.asarray(x) if _is_array_like(x) else x, value)

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        _check_run_options(options)
        args, kwargs = _check_run_args(args, kwargs)
        with ctx_lib.enter_replica(self._default_replica_context):
            return fn(*args, **kwargs)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        op = ReduceOp.coerce(reduce_op)
        self._check_cross_replica("reduce")

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                return _reduce_stacked(jnp.asarray(x.stacked), op, axis, x.row_counts)
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
                return _gather_rows(x, axis)
            return x  # a non-distributed value is returned unchanged, as in TF

        return jax.tree.map(one, value, is_leaf=is_per_replica)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        if isinstance(value, PerReplica):
            return value.values
        return (value,)

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        return value_fn(ValueContext(0, 1))

    def _distribute_local(self, stacked_local: Any, rows: np.ndarray | None = None, guard: bool = False) -> Any:
        # One replica gets the whole batch: as TF, it is yielded as it is (padded only when a mask is asked for,
        # i.e. guard=False).
        x = stacked_local[0]
        return x[: int(rows[0])] if rows is not None and guard else x

    def _run_stacked(self, fn: Callable[..., Any], batches: list[Any], args: Sequence[Any], kwargs: Any) -> Any:
        from jaxdist.sync.loops import default_run_stacked

        return default_run_stacked(self, fn, batches, args, kwargs)

    def __repr__(self) -> str:
        return "DefaultStrategy()"


_DEFAULT: _DefaultStrategy | None = None
_DEFAULT_LOCK = threading.Lock()


def default_strategy() -> Strategy:
    """The process-wide default strategy (what ``get_strategy()`` returns outside any scope)."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = _DefaultStrategy()
        return _DEFAULT


def replicate(value: Any) -> Any:
    """Place ``value``'s arrays as replicated values of the current strategy (``get_strategy().replicate``)."""
    return ctx_lib.get_strategy().replicate(value)


def _row_mask_nd(stacked: Any, rows: Any) -> Any:
    """``(R, b, 1, ...)`` mask of real rows for a stacked per-replica batch ``(R, b, ...)``."""
    b = stacked.shape[1]
    m = jnp.arange(b)[None, :] < jnp.asarray(rows)[:, None]
    return m.reshape(m.shape + (1,) * (stacked.ndim - 2))


def _reduce_stacked(x: Any, op: ReduceOp, axis: int | None, rows: Any = None) -> Any:
    """Reduce ``(R, ...)`` over replicas (and ``axis`` of each value); padding rows do not count."""
    if axis is None:
        return (jnp.sum(x, 0) if op is ReduceOp.SUM else jnp.mean(x, 0)).astype(_result_dtype(x, op))
    ax = _norm_axis(axis, x.ndim - 1) + 1
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


def _gather_stacked(x: jax.Array, axis: int) -> jax.Array:
    # (R, s0, ..., sk) -> concatenation of the R slices along `axis`, replica-major.
    if x.ndim < 2:
        raise ValueError("gather needs per-replica values of rank >= 1 (scalars cannot be concatenated)")
    axis = _norm_axis(axis, x.ndim - 1)
    moved = jnp.moveaxis(x, 0, axis)
    shape = moved.shape[:axis] + (moved.shape[axis] * moved.shape[axis + 1],) + moved.shape[axis + 2 :]
    return moved.reshape(shape)


def _gather_rows(x: PerReplica, axis: int) -> Any:
    """Gather a (host-side) PerReplica, keeping only real rows of an uneven batch."""
    stacked = jnp.asarray(x.stacked)
    rows = x._host_rows()
    if rows is None:
        return _gather_stacked(stacked, axis)
    if _norm_axis(axis, stacked.ndim - 1) != 0:
        raise ValueError("an uneven batch (with row counts) can only be gathered along axis 0, its batch axis")
    idx = np.concatenate([r * stacked.shape[1] + np.arange(int(n)) for r, n in enumerate(rows)]).astype(np.int32)
    return jnp.take(_gather_stacked(stacked, 0), idx, axis=0)


def _norm_axis(axis: int, ndim: int) -> int:
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for per-replica values of rank {ndim}")
    return axis % ndim


def _non_distributed_reduce(op: ReduceOp, x: Any, axis: int | None, r: int) -> Any:
    """TF's ``reduce_non_distributed_value``: a value made outside the strategy."""
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
    return None  # handled by the caller (axis reduction per replica, as TF's run(reduce_sum))
