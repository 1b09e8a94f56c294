"""The mesh strategies' machinery: replicas on a 1-D ``jax.sharding.Mesh``, ``run`` compiled
with ``jax.jit(jax.shard_map(...))``, per-replica/replicated values in and out (see
:mod:`jaxdist.sync.strategy` for the model)."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import InputContext, ValueContext
from jaxdist.sync import context as ctx_lib
from jaxdist.sync.loops import _Program, run_program, stack_batches
from jaxdist.sync.reduce_op import ReduceOp
from jaxdist.sync.strategy import (
    AXIS,
    Strategy,
    _check_run_args,
    _check_run_options,
    _gather_stacked,
    _is_array_like,
    _is_tracer,
    _non_distributed_reduce,
    _norm_axis,
    _reduce_stacked,
)
from jaxdist.sync.values import PerReplica, is_per_replica
from jaxdist.sync.variables import (
    SyncVariable,
    VariableAggregation,
    _aggregate_stacked,
)

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# Mesh strategies
# ---------------------------------------------------------------------------------------


class _MeshStrategy(Strategy):
    """Replicas on a 1-D mesh of ``devices``; the machinery behind every non-default strategy."""

    def __init__(self, devices: Sequence[jax.Device]) -> None:
        super().__init__()
        devices = list(devices)
        if not devices:
            raise ConfigurationError(f"{type(self).__name__} needs at least one device")
        if len(set(devices)) != len(devices):
            raise ConfigurationError(f"{type(self).__name__}: duplicate devices in {devices}")
        self._devices = tuple(devices)
        self._mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
        self._replicated_sharding = NamedSharding(self._mesh, P())
        self._per_replica_sharding = NamedSharding(self._mesh, P(AXIS))
        me = jax.process_index()
        self._local_ids = [i for i, d in enumerate(devices) if d.process_index == me]
        if not self._local_ids:
            raise ConfigurationError(f"{type(self).__name__}: none of the devices {devices} belongs to this process")
        self._process_ids = sorted({d.process_index for d in devices})
        self._multi_process = len(self._process_ids) > 1
        self._programs: OrderedDict[Any, _Program] = OrderedDict()
        self._programs_lock = threading.Lock()
        self._trace_count = 0
        self._jit_cache: dict[Any, Callable[..., Any]] = {}
        # See _dispatch: XLA:CPU multi-device programs must not queue up behind each other.
        self._pace = devices[0].platform == "cpu" and len(devices) > 1
        self._in_flight: Any = None

    # -- properties ----------------------------------------------------------------

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The replicas' devices, replica ``r`` on ``devices[r]``."""
        return self._devices

    @property
    def mesh(self) -> Mesh:
        """The 1-D mesh (axis :data:`AXIS`) the replicas are laid on."""
        return self._mesh

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def replicated_sharding(self) -> NamedSharding:
        return self._replicated_sharding

    @property
    def per_replica_sharding(self) -> NamedSharding:
        return self._per_replica_sharding

    @property
    def trace_count(self) -> int:
        """How many times :meth:`run` traced a function (a new function or input signature)."""
        return self._trace_count

    def _platform(self) -> str:
        return self._devices[0].platform

    def _replica_devices(self) -> list[Any]:
        return [self._devices[i] for i in self._local_ids]

    # -- placement -----------------------------------------------------------------

    def _to_replicated(self, x: Any) -> jax.Array:
        """``x`` as an array replicated on the mesh (no copy if it already is)."""
        if _is_tracer(x):
            return x
        if isinstance(x, jax.Array):
            if x.sharding.is_equivalent_to(self._replicated_sharding, x.ndim):
                return x
            if not x.is_fully_addressable:
                return self._jit_identity(self._replicated_sharding)(x)
            if not self._multi_process:
                return jax.device_put(x, self._replicated_sharding)
            x = np.asarray(x)
        if not self._multi_process:
            return jax.device_put(x, self._replicated_sharding)
        arr = np.asarray(x)
        arr = arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)
        return jax.make_array_from_callback(arr.shape, self._replicated_sharding, lambda idx: arr[idx])

    def _place_per_replica(self, x: Any) -> Any:
        """A stacked ``(R, ...)`` array laid out one row per replica (no copy if it already is)."""
        if _is_tracer(x):
            return x
        r = self.num_replicas_in_sync
        if x.shape[0] != r:
            raise ConfigurationError(
                f"a PerReplica value with {x.shape[0]} replicas was passed to a strategy with {r} replicas"
            )
        if isinstance(x, jax.Array):
            if x.sharding.is_equivalent_to(self._per_replica_sharding, x.ndim):
                return x
            if not x.is_fully_addressable:
                return self._jit_identity(self._per_replica_sharding)(x)
            if not self._multi_process:
                return jax.device_put(x, self._per_replica_sharding)
        arr = np.asarray(x)
        return self._stack_to_global(arr[self._local_ids])

    def _to_per_replica(self, value: PerReplica) -> jax.Array:
        """The stacked array of ``value`` laid out one row per replica."""
        return self._place_per_replica(value.stacked)

    def _stack_to_global(self, stacked_local: np.ndarray) -> jax.Array:
        """Global ``(R, ...)`` array from this process's rows (``stacked_local[i]`` -> local replica i)."""
        if not self._multi_process:
            return jax.device_put(stacked_local, self._per_replica_sharding)
        shape = (self.num_replicas_in_sync, *stacked_local.shape[1:])
        arrays = [
            jax.device_put(stacked_local[i : i + 1], self._devices[rid]) for i, rid in enumerate(self._local_ids)
        ]
        return jax.make_array_from_single_device_arrays(shape, self._per_replica_sharding, arrays)

    def _jit_identity(self, sharding: NamedSharding) -> Callable[[Any], Any]:
        key = ("identity", sharding.spec)
        fn = self._jit_cache.get(key)
        if fn is None:
            fn = jax.jit(lambda a: a, out_shardings=sharding)
            self._jit_cache[key] = fn
        return fn

    def _store_variable(self, x: Any) -> Any:
        """Where a mirrored variable lives: replicated on the mesh (CentralStorage: its parameter device).

        The stored array always carries the strategy's own sharding object (an
        equivalent one, e.g. a one-device sharding an XLA output came back
        with, is relabelled without a copy), so compiled functions that take
        variables see the same input sharding every call and do not retrace.
        """
        x = self._to_replicated(x)
        if isinstance(x, jax.Array) and not _is_tracer(x) and x.sharding != self._replicated_sharding:
            x = jax.device_put(x, self._replicated_sharding)
        return x

    def _store_on_read(self, stacked: Any) -> Any:
        x = self._place_per_replica(stacked)
        if isinstance(x, jax.Array) and not _is_tracer(x) and x.sharding != self._per_replica_sharding:
            x = jax.device_put(x, self._per_replica_sharding)
        return x

    def _aggregate_on_read(self, stacked: Any, aggregation: VariableAggregation) -> Any:
        fn = self._jitted(("on_read", aggregation), lambda: lambda s: _aggregate_stacked(s, aggregation))
        return self._dispatch(fn, self._place_per_replica(stacked))

    def _finish_replicated(self, x: jax.Array) -> jax.Array:
        """Post-process a replicated output (hook for CentralStorageStrategy)."""
        return x

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

        def one(x: Any) -> Any:
            if _is_array_like(x):
                return self._mirrored.add(self._store_variable(x))
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
        :data:`_RUN_CACHE_SIZE`). Before reusing it, ``run`` checks that the
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
        _check_run_options(options)
        return self._run(fn, args, kwargs)

    def _run(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None, steps: int | None = None
    ) -> Any:

        args, kwargs = _check_run_args(args, kwargs)
        self._check_cross_replica("run")
        return run_program(self, fn, args, kwargs, steps)

    def _run_stacked(self, fn: Callable[..., Any], batches: list[Any], args: Sequence[Any], kwargs: Any) -> Any:

        self._check_cross_replica("run_steps")
        stacked = stack_batches(self, batches)
        return self._run(fn, (stacked, *tuple(args)), kwargs, steps=len(batches))

    def _dispatch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a compiled multi-replica program, pacing dispatch on CPU.

        On the CPU platform, several in-flight programs whose replicas meet in
        collectives can deadlock XLA:CPU's thread pool when there are more
        devices than cores (seen with 8 fake devices on 2 cores; see
        jax-ml/jax#25861). So on CPU each dispatch first waits for the previous
        program of this strategy to finish: the host work of the next step
        (input splitting, argument checks) still overlaps the running step,
        only the launch waits. Other platforms dispatch asynchronously as
        usual. Inside a trace (``jaxdist.function``/``jax.jit``) nothing runs
        yet, so nothing waits.
        """
        if any(_is_tracer(a) for a in jax.tree.leaves(args)):
            return fn(*args)
        if self._pace and self._in_flight is not None:
            jax.block_until_ready(self._in_flight)
            self._in_flight = None
        out = fn(*args)
        if self._pace:
            self._in_flight = out
        return out

    # -- cross-replica reductions ------------------------------------------------------

    def _jitted(self, key: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        fn = self._jit_cache.get(key)
        if fn is None:
            fn = jax.jit(make(), out_shardings=self._replicated_sharding)
            self._jit_cache[key] = fn
        return fn

    def _is_mirrored(self, x: Any) -> bool:
        """Whether ``x`` is a replicated value this strategy produced (an output of run/reduce/replicate)."""
        return x in self._mirrored

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

        def per_replica(stacked: Any, rows: Any = None) -> Any:
            if rows is None:
                fn = self._jitted(("reduce", op, axis), lambda: lambda s: _reduce_stacked(s, op, axis))
                return self._mirrored.add(self._finish_replicated(self._dispatch(fn, self._place_per_replica(stacked))))
            fn = self._jitted(("reduce_rows", op, axis), lambda: lambda s, n: _reduce_stacked(s, op, axis, n))
            out = self._dispatch(fn, self._place_per_replica(stacked), self._place_per_replica(rows))
            return self._mirrored.add(self._finish_replicated(out))

        def same_everywhere(x: Any) -> Any:
            def f(v: jax.Array) -> jax.Array:
                if axis is not None:
                    v = jnp.sum(v, axis) if op is ReduceOp.SUM else jnp.mean(v, axis)
                return v * r if op is ReduceOp.SUM else v

            fn = self._jitted(("reduce_replicated", op, axis, r), lambda: f)
            return self._mirrored.add(self._finish_replicated(self._dispatch(fn, self._to_replicated(x))))

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                return per_replica(x.stacked, x.row_counts)
            if isinstance(x, SyncVariable):
                self._check_own_variable(x, "reduce")
                if x.on_read:
                    return per_replica(x._value)
                if op is ReduceOp.MEAN and axis is None:
                    return x.value()
                if axis is None:
                    raise ValueError(
                        f"cannot SUM the mirrored variable {x.name!r} across replicas: its copies are the same "
                        "value (TF asserts here). Use MEAN, or read it (var.value())"
                    )
                return same_everywhere(x.value())
            if self._is_mirrored(x) or _is_tracer(x):
                return same_everywhere(x)
            handled = _non_distributed_reduce(op, x, axis, r)
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

        def one(x: Any) -> Any:
            if isinstance(x, PerReplica):
                rows = x._host_rows() if x.row_counts is not None and not _is_tracer(x.row_counts) else None
                if x.row_counts is not None and rows is None:
                    raise ValueError(
                        "gather of an uneven batch inside a compiled function: the result's row count would "
                        "depend on data. Gather outside, or use the padded values with get_replica_context().row_mask()"
                    )
                stacked = self._place_per_replica(x.stacked)
                fn = self._jitted(("gather", axis), lambda: lambda s: _gather_stacked(s, axis))
                out = self._dispatch(fn, stacked)
                if rows is not None:
                    if _norm_axis(axis, stacked.ndim - 1) != 0:
                        raise ValueError("an uneven batch can only be gathered along axis 0, its batch axis")
                    b = stacked.shape[1]
                    idx = np.concatenate([k * b + np.arange(int(n)) for k, n in enumerate(rows)]).astype(np.int32)
                    take = self._jitted(("take_rows", len(idx)), lambda: lambda a, i: jnp.take(a, i, axis=0))
                    out = self._dispatch(take, out, self._to_replicated(idx))
                return self._mirrored.add(self._finish_replicated(out))
            if isinstance(x, SyncVariable):
                self._check_own_variable(x, "gather")
                src = x._value if x.on_read else None
                if src is not None:
                    fn = self._jitted(("gather", axis), lambda: lambda s: _gather_stacked(s, axis))
                    return self._finish_replicated(self._dispatch(fn, self._place_per_replica(src)))
                x = x.value()
            elif not (self._is_mirrored(x) or _is_tracer(x)):
                return x  # a non-distributed value is returned unchanged, as in TF
            fn = self._jitted(
                ("gather_replicated", axis, r),
                lambda: lambda v: jnp.concatenate([v] * r, axis=_norm_axis(axis, v.ndim)),
            )
            return self._mirrored.add(self._finish_replicated(self._dispatch(fn, self._to_replicated(x))))

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
                return PerReplica(value._value).values
            value = value.value()
        if isinstance(value, jax.Array) and not _is_tracer(value) and value.sharding.is_equivalent_to(
            self._replicated_sharding, value.ndim
        ):
            by_device = {s.device: s.data for s in value.addressable_shards}
            return tuple(by_device[self._devices[i]] for i in self._local_ids)
        leaves, tree = jax.tree.flatten(value, is_leaf=is_per_replica)
        if not any(isinstance(x, PerReplica) for x in leaves):
            return (value,)
        per_leaf = [x.values if isinstance(x, PerReplica) else None for x in leaves]
        return tuple(
            jax.tree.unflatten(tree, [pv[i] if pv is not None else x for x, pv in zip(leaves, per_leaf)])
            for i in range(len(self._local_ids))
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
        outs = [value_fn(ValueContext(rid, r)) for rid in self._local_ids]
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
            out_leaves.append(self._distribute_local(np.stack(arrs)))
        return jax.tree.unflatten(tree0, out_leaves)

    # -- input hooks ----------------------------------------------------------------------

    def _input_context(self) -> InputContext:
        me = jax.process_index()
        return InputContext(len(self._process_ids), self._process_ids.index(me), self.num_replicas_in_sync)

    def _local_replica_ids(self) -> list[int]:
        return list(self._local_ids)

    def _num_processes(self) -> int:
        return len(self._process_ids)

    def _distribute_local(self, stacked_local: Any, rows: np.ndarray | None = None, guard: bool = False) -> Any:
        if isinstance(stacked_local, np.ndarray):
            stacked = self._stack_to_global(stacked_local)
        else:
            stacked = stacked_local  # already a global per-replica array (placed by input_lib)
        if rows is None:
            return PerReplica(stacked)
        pr = PerReplica(stacked, self._stack_to_global(rows[self._local_ids].astype(np.int32)))
        pr._rows_host = rows.astype(np.int32)
        pr._guard = guard
        return pr

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_replicas_in_sync={self.num_replicas_in_sync}, devices={list(self._devices)})"


