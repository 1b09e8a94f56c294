"""The mesh strategies' machinery: replicas on a 1-D ``jax.sharding.Mesh``, ``run`` compiled
with ``jax.jit(jax.shard_map(...))``, per-replica/replicated values in and out (see
:mod:`jaxdist.sync.strategy` for the model)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import ValueContext
from jaxdist.sync import context as ctx_lib
from jaxdist.sync.engine import MeshEngine
from jaxdist.sync.loops import run_program, stack_batches
from jaxdist.sync.reduce_op import ReduceOp
from jaxdist.sync.reductions import gather_stacked, non_distributed_reduce, norm_axis, reduce_stacked
from jaxdist.sync.strategy import Strategy, check_run_args, check_run_options
from jaxdist.sync.values import PerReplica, is_array_like, is_per_replica, is_tracer
from jaxdist.sync.variables import SyncVariable

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# Mesh strategies
# ---------------------------------------------------------------------------------------


class MeshStrategy(Strategy):
    """Replicas on a 1-D mesh of ``devices``: TF's API over a :class:`~jaxdist.sync.engine.MeshEngine`.

    The base of every strategy but the default one. Subclasses that place
    values differently build their own engine in :meth:`_new_engine`.
    """

    _engine: MeshEngine

    def __init__(self, devices: Sequence[jax.Device]) -> None:
        super().__init__(self._new_engine(list(devices)))

    def _new_engine(self, devices: list[jax.Device]) -> MeshEngine:
        """The engine this strategy runs on (called once, by the constructor)."""
        return MeshEngine(self, devices)

    @property
    def engine(self) -> MeshEngine:
        return self._engine

    # -- properties ----------------------------------------------------------------

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The replicas' devices, replica ``r`` on ``devices[r]``."""
        return self._engine.devices

    @property
    def mesh(self) -> Mesh:
        """The 1-D mesh (axis :data:`~jaxdist.sync.engine.AXIS`) the replicas are laid on."""
        return self._engine.mesh

    @property
    def replicated_sharding(self) -> NamedSharding:
        return self._engine.replicated_sharding

    @property
    def per_replica_sharding(self) -> NamedSharding:
        return self._engine.per_replica_sharding

    @property
    def trace_count(self) -> int:
        """How many times :meth:`run` traced a function (a new function or input signature)."""
        return self._engine.trace_count

    def replicate(self, value: Any) -> Any:
        """Place every array leaf of ``value`` replicated on the mesh (the functional style's "variables").

        The result is one logical value with an identical copy on every
        replica's device (``NamedSharding(mesh, PartitionSpec())``). Leaves
        that are already replicated on this mesh are returned as they are; in
        a multi-process job every process must pass the same values.
        Non-array leaves are left alone; a ``PerReplica`` is refused (its
        replicas differ: reduce or gather it first).

        Returns:
            ``value`` with its array leaves replaced by replicated ``jax.Array``s.
        """
        self._check_cross_replica("replicate")
        if any(isinstance(x, PerReplica) for x in jax.tree.leaves(value, is_leaf=is_per_replica)):
            raise TypeError(
                "replicate() got a PerReplica value: its replicas hold different values. Reduce it "
                "(strategy.reduce) or gather it first"
            )

        e = self._engine

        def one(x: Any) -> Any:
            if is_array_like(x):
                return e.mirrored.add(e.store_variable(x))
            return x

        return jax.tree.map(one, value)

    # -- run -------------------------------------------------------------------------

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        options: Any = None,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` on every replica as one compiled XLA program.

        Inside ``fn`` each replica sees: for a ``PerReplica`` argument, its own
        value; for an array argument, the replicated value (numpy arrays and
        Python numbers are replicated first); any other leaf (strings, enums,
        variables, ...) is a static Python value (it must be hashable and is
        part of the compilation key). Variables ``fn`` reads are passed into
        the step and those it assigns are written back (see
        :mod:`jaxdist.sync.variables`): assigning a mirrored variable a
        value that differs between replicas raises ConfigurationError.
        ``jaxdist.get_replica_context()`` returns the
        :class:`~jaxdist.sync.context.ReplicaContext` and
        ``jax.lax.psum(x, "replica")`` and friends work directly.

        ``fn`` is traced once per (function, argument structure, shapes and
        dtypes, static leaves) and the compiled program is cached (LRU of
        :data:`jaxdist.sync.programs.RUN_CACHE_SIZE`). Before reusing it, ``run`` checks that the
        globals and closure variables ``fn`` (and the user functions it calls)
        read still hold the objects they held when it was traced, and traces
        again if one was rebound (so ``scale = 2.0`` between steps takes
        effect; it logs a warning when that happens on every call: pass the
        value as an argument instead). In-place mutation of a captured numpy
        array is not detected: pass arrays as arguments.

        ``run`` also works inside :func:`jaxdist.function` and ``jax.jit``
        (the step is then part of the caller's compiled program).

        Args:
            options: TF's ``RunOptions``: not supported (raises ConfigurationError if given).

        Returns:
            ``fn``'s output structure, where each leaf that is provably the
            same on every replica (derived only from replicated inputs and
            all-reduced values) is a replicated ``jax.Array``, and every other
            leaf is a :class:`PerReplica`.

        Raises:
            ConfigurationError: when ``fn`` is traced, if a value it declared
                with :func:`jaxdist.replicated` may differ between replicas
                (e.g. params updated with gradients that were not all-reduced).
        """
        check_run_options(options)
        return self._run(fn, args, kwargs)

    def _run(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None, steps: int | None = None
    ) -> Any:
        args, kwargs = check_run_args(args, kwargs)
        self._check_cross_replica("run")
        return run_program(self._engine, fn, args, kwargs, steps)

    def _run_stacked(self, fn: Callable[..., Any], batches: list[Any], args: Sequence[Any], kwargs: Any) -> Any:
        self._check_cross_replica("run_steps")
        stacked = stack_batches(self._engine, batches)
        return self._run(fn, (stacked, *tuple(args)), kwargs, steps=len(batches))

    # -- cross-replica reductions ------------------------------------------------------

    def _is_mirrored(self, x: Any) -> bool:
        """Whether ``x`` is a replicated value this strategy produced (an output of run/reduce/replicate)."""
        return x in self._engine.mirrored

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        """Reduce ``value`` across replicas (cross-replica), as ``tf.distribute.Strategy.reduce``.

        Args:
            reduce_op: ``ReduceOp.SUM`` or ``ReduceOp.MEAN`` (or "sum"/"mean").
            value: a pytree whose leaves are any of:

                - ``PerReplica``: the replicas' values are combined (padding
                  rows of an uneven batch do not count);
                - a replicated output of ``run`` (each replica returned the
                  same value): TF returns per-replica values for these too,
                  so ``SUM`` gives ``num_replicas_in_sync * value`` and
                  ``MEAN`` gives ``value``;
                - a mirrored :class:`SyncVariable`: ``MEAN`` gives its value;
                  ``SUM`` raises ValueError (TF asserts); a sync-on-read
                  variable: its per-replica parts are combined;
                - a non-distributed value (numpy, Python numbers, arrays made
                  outside the strategy): as TF, ``MEAN`` returns it, ``SUM``
                  raises ValueError (returns it with one replica, and ``0``
                  for a Python 0).
            axis: ``None`` reduces only across replicas. An int also reduces
                each replica's value along that axis (a non-distributed value
                counts as the same value on every replica, as TF's
                ``run(reduce_sum)`` does); ``MEAN`` then averages over all
                ``num_replicas * value.shape[axis]`` elements.

        Returns:
            The reduced pytree; leaves are replicated ``jax.Array``s readable
            from every process.
        """
        op = ReduceOp.coerce(reduce_op)
        self._check_cross_replica("reduce")
        if ctx_lib.in_merge():
            from jaxdist.sync.extended import merge_reduce

            return merge_reduce(self, op, value, axis)
        frame = ctx_lib.current_frame()
        if frame is not None:
            frame.strategies.add(self)
        r = self.num_replicas_in_sync
        e = self._engine

        def per_replica(stacked: Any, rows: Any = None) -> Any:
            if rows is None:
                fn = e.jit_replicated(("reduce", op, axis), lambda: lambda s: reduce_stacked(s, op, axis))
                return e.mirrored.add(e.finish_replicated(e.dispatch(fn, e.place_per_replica(stacked))))
            fn = e.jit_replicated(("reduce_rows", op, axis), lambda: lambda s, n: reduce_stacked(s, op, axis, n))
            out = e.dispatch(fn, e.place_per_replica(stacked), e.place_per_replica(rows))
            return e.mirrored.add(e.finish_replicated(out))

        def same_everywhere(x: Any) -> Any:
            def f(v: jax.Array) -> jax.Array:
                if axis is not None:
                    v = jnp.sum(v, axis) if op is ReduceOp.SUM else jnp.mean(v, axis)
                return v * r if op is ReduceOp.SUM else v

            fn = e.jit_replicated(("reduce_replicated", op, axis, r), lambda: f)
            return e.mirrored.add(e.finish_replicated(e.dispatch(fn, e.to_replicated(x))))

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                return per_replica(x.stacked, x.row_counts)
            if isinstance(x, SyncVariable):
                self._check_own_variable(x, "reduce")
                if x.on_read:
                    return per_replica(x.storage)
                if op is ReduceOp.MEAN and axis is None:
                    return x.value()
                if axis is None:
                    raise ValueError(
                        f"cannot SUM the mirrored variable {x.name!r} across replicas: its copies are the same "
                        "value (TF asserts here). Use MEAN, or read it (var.value())"
                    )
                return same_everywhere(x.value())
            if self._is_mirrored(x) or is_tracer(x):
                return same_everywhere(x)
            handled = non_distributed_reduce(op, x, axis, r)
            if axis is None:
                return handled
            return same_everywhere(x)

        return jax.tree.map(one, value, is_leaf=lambda x: isinstance(x, (PerReplica, SyncVariable)))

    def _check_own_variable(self, v: SyncVariable, what: str) -> None:
        if v.distribute_strategy is not self:
            raise ConfigurationError(f"{what}: variable {v.name!r} belongs to another strategy")

    def gather(self, value: Any, axis: int) -> Any:
        """Concatenate every replica's value along ``axis``, in replica order (cross-replica).

        A ``PerReplica`` of per-replica shape ``(b, ...)`` gathered on axis 0
        gives ``(R*b, ...)`` (an uneven batch gives its real rows only: 20
        rows over 8 replicas gather back to 20). A replicated output of
        ``run`` is the same value on every replica and is concatenated ``R``
        times; a non-distributed value is returned unchanged, as in TF.

        Returns:
            The gathered pytree; leaves are replicated ``jax.Array``s.
        """
        self._check_cross_replica("gather")
        if ctx_lib.in_merge():
            from jaxdist.sync.extended import merge_gather

            return merge_gather(self, value, axis)
        r = self.num_replicas_in_sync
        e = self._engine

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                rows = x.host_row_counts() if x.row_counts is not None and not is_tracer(x.row_counts) else None
                if x.row_counts is not None and rows is None:
                    raise ValueError(
                        "gather of an uneven batch inside a compiled function: the result's row count would "
                        "depend on data. Gather outside, or use the padded values with get_replica_context().row_mask()"
                    )
                stacked = e.place_per_replica(x.stacked)
                fn = e.jit_replicated(("gather", axis), lambda: lambda s: gather_stacked(s, axis))
                out = e.dispatch(fn, stacked)
                if rows is not None:
                    if norm_axis(axis, stacked.ndim - 1) != 0:
                        raise ValueError("an uneven batch can only be gathered along axis 0, its batch axis")
                    b = stacked.shape[1]
                    idx = np.concatenate([k * b + np.arange(int(n)) for k, n in enumerate(rows)]).astype(np.int32)
                    take = e.jit_replicated(("take_rows", len(idx)), lambda: lambda a, i: jnp.take(a, i, axis=0))
                    out = e.dispatch(take, out, e.to_replicated(idx))
                return e.mirrored.add(e.finish_replicated(out))
            if isinstance(x, SyncVariable):
                self._check_own_variable(x, "gather")
                src = x.storage if x.on_read else None
                if src is not None:
                    fn = e.jit_replicated(("gather", axis), lambda: lambda s: gather_stacked(s, axis))
                    return e.finish_replicated(e.dispatch(fn, e.place_per_replica(src)))
                x = x.value()
            elif not (self._is_mirrored(x) or is_tracer(x)):
                return x  # a non-distributed value is returned unchanged, as in TF
            fn = e.jit_replicated(
                ("gather_replicated", axis, r),
                lambda: lambda v: jnp.concatenate([v] * r, axis=norm_axis(axis, v.ndim)),
            )
            return e.mirrored.add(e.finish_replicated(e.dispatch(fn, e.to_replicated(x))))

        return jax.tree.map(one, value, is_leaf=lambda x: isinstance(x, (PerReplica, SyncVariable)))

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        """The parts of ``value`` on this process's replicas, in replica order.

        - ``PerReplica``: its local values (``PerReplica.values``; an uneven
          batch gives each replica's real rows).
        - an array replicated on this strategy's devices, or a mirrored
          variable: one copy per local device (like TF's mirrored variable components).
        - a sync-on-read variable: its local per-replica parts.
        - a pytree holding ``PerReplica`` leaves: a tuple with one pytree per
          local replica (``PerReplica`` leaves replaced by that replica's
          value, other leaves kept).
        - anything else: ``(value,)``.
        """
        if ctx_lib.in_merge():
            from jaxdist.sync.extended import merge_local_results

            return merge_local_results(self, value)
        if isinstance(value, PerReplica):
            return value.values
        if isinstance(value, SyncVariable):
            if value.on_read:
                return PerReplica(value.storage).values
            value = value.value()
        e = self._engine
        if isinstance(value, jax.Array) and not is_tracer(value) and value.sharding.is_equivalent_to(
            e.replicated_sharding, value.ndim
        ):
            by_device = {s.device: s.data for s in value.addressable_shards}
            return tuple(by_device[e.devices[i]] for i in e.local_replica_ids())
        leaves, tree = jax.tree.flatten(value, is_leaf=is_per_replica)
        if not any(isinstance(x, PerReplica) for x in leaves):
            return (value,)
        per_leaf = [x.values if isinstance(x, PerReplica) else None for x in leaves]
        return tuple(
            jax.tree.unflatten(tree, [pv[i] if pv is not None else x for x, pv in zip(leaves, per_leaf)])
            for i in range(len(e.local_replica_ids()))
        )

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        """Per-replica values made by ``value_fn(ValueContext(replica_id, num_replicas))``.

        ``value_fn`` is called once per replica on this process; it must return
        the same structure, shapes and dtypes for every replica.

        Returns:
            The structure ``value_fn`` returns with ``PerReplica`` leaves.
        """
        self._check_cross_replica("experimental_distribute_values_from_function")
        r = self.num_replicas_in_sync
        outs = [value_fn(ValueContext(rid, r)) for rid in self._engine.local_replica_ids()]
        trees = [jax.tree.flatten(o) for o in outs]
        tree0 = trees[0][1]
        for _, tree in trees[1:]:
            if tree != tree0:
                raise ValueError(f"value_fn returned different structures for different replicas: {tree0} vs {tree}")
        columns = zip(*(leaves for leaves, _ in trees))
        out_leaves = []
        for col in columns:
            arrs = [np.asarray(a) for a in col]
            if len({(a.shape, a.dtype) for a in arrs}) != 1:
                raise ValueError(
                    "value_fn must return the same shapes and dtypes on every replica, got "
                    f"{[(a.shape, str(a.dtype)) for a in arrs]}"
                )
            out_leaves.append(self._engine.distribute_local(np.stack(arrs)))
        return jax.tree.unflatten(tree0, out_leaves)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}, devices={list(self.devices)})"


