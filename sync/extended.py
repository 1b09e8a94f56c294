"""``strategy.extended`` (TF's ``tf.distribute.StrategyExtended``) and the cross-replica side of ``merge_call``.

Cross-replica methods work in two places, as in TF: outside ``strategy.run``
(on ``PerReplica`` values the strategy returned) and inside ``merge_fn`` of
:meth:`jaxdist.ReplicaContext.merge_call` (on the values the replicas handed
over, which every replica still holds its own part of: there the reductions
are XLA collectives in the step being compiled).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from jaxdist.base.errors import ConfigurationError
from jaxdist.sync import context as ctx_lib
from jaxdist.sync import cross_device_ops as cdo
from jaxdist.sync.context import MergedValue
from jaxdist.sync.reduce_op import ReduceOp
from jaxdist.sync.reductions import non_distributed_reduce
from jaxdist.sync.values import PerReplica
from jaxdist.sync.variables import SyncVariable

if TYPE_CHECKING:
    from jaxdist.sync.strategy import Strategy

__all__ = ["StrategyExtended"]


def _merge_axis() -> tuple[ctx_lib.ReplicaContext, str]:
    rep = ctx_lib.current_replica()
    assert rep is not None and rep.axis_name is not None
    return rep, rep.axis_name


def _reject_outside_value(x: Any, what: str) -> None:
    if isinstance(x, PerReplica):
        raise TypeError(
            f"{what} inside merge_fn got a PerReplica made outside this step; pass values to merge_call's args"
        )


def merge_reduce(strategy: Strategy, op: ReduceOp, value: Any, axis: int | None, options: Any = None) -> Any:
    """``strategy.reduce`` inside ``merge_fn``: an in-replica all-reduce of the handed-over values."""
    rep, ax = _merge_axis()
    r = strategy.num_replicas_in_sync
    plan = strategy.engine.collective_plan(options, "reduce")

    def one(x: Any) -> Any:
        _reject_outside_value(x, "reduce")
        if isinstance(x, SyncVariable):
            if x.on_read:
                return x.value()  # aggregated read (merge is cross-replica)
            if op is ReduceOp.MEAN and axis is None:
                return x.value()
            raise ValueError(f"cannot SUM the mirrored variable {x.name!r} across replicas (TF asserts); use MEAN")
        if isinstance(x, MergedValue):
            local = jnp.asarray(x.local)
            if axis is None:
                return cdo.all_reduce(plan, op is ReduceOp.MEAN, local, ax, r)
            total = cdo.all_reduce(plan, False, jnp.sum(local, axis), ax, r)
            if op is ReduceOp.SUM:
                return total
            return total / (local.shape[axis] * r)
        if axis is None:
            return non_distributed_reduce(op, x, None, r)
        v = jnp.asarray(x)
        return jnp.sum(v, axis) * r if op is ReduceOp.SUM else jnp.mean(v, axis)

    return jax.tree.map(one, value, is_leaf=lambda x: isinstance(x, (MergedValue, PerReplica, SyncVariable)))


def merge_gather(strategy: Strategy, value: Any, axis: int) -> Any:
    """``strategy.gather`` inside ``merge_fn``: an all-gather of the handed-over values."""
    _, ax = _merge_axis()

    def one(x: Any) -> Any:
        _reject_outside_value(x, "gather")
        if isinstance(x, MergedValue):
            return jax.lax.all_gather(x.local, ax, axis=axis, tiled=True)
        return x

    return jax.tree.map(one, value, is_leaf=lambda x: isinstance(x, (MergedValue, PerReplica)))


def merge_local_results(strategy: Strategy, value: Any) -> tuple[Any, ...]:
    """Every replica's part of a handed-over value (gathered), in replica order."""
    _, ax = _merge_axis()
    if isinstance(value, MergedValue):
        stacked = jax.lax.all_gather(value.local, ax)
        return tuple(stacked[i] for i in range(strategy.num_replicas_in_sync))
    return (value,)


class StrategyExtended:
    """Additional strategy methods (TF's ``strategy.extended``).

    Args:
        strategy: the strategy these methods belong to.
    """

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        self._engine = strategy.engine

    # -- devices -------------------------------------------------------------------

    @property
    def worker_devices(self) -> tuple[Any, ...]:
        """This process's replica devices, in replica order."""
        return tuple(self._engine.replica_devices())

    @property
    def parameter_devices(self) -> tuple[Any, ...]:
        """Where mirrored variables live (CentralStorageStrategy: its parameter device)."""
        central = getattr(self._strategy, "parameter_device", None)
        if central is not None:
            return (central,)
        return tuple(getattr(self._strategy, "devices", self.worker_devices))

    def non_slot_devices(self, var_list: Sequence[Any]) -> tuple[Any, ...]:
        """Devices for non-slot variables (TF): the parameter devices."""
        return self.parameter_devices

    @property
    def experimental_require_static_shapes(self) -> bool:
        """Always True: XLA compiles static shapes (short batches are padded, see experimental_distribute_dataset)."""
        return True

    @property
    def should_checkpoint(self) -> bool:
        """Whether this process writes checkpoints: process 0 (jaxdist.Checkpoint handles this itself)."""
        return jax.process_index() == min(self._engine.process_ids)

    should_save_summary = should_checkpoint
    should_init = True

    # -- variables -----------------------------------------------------------------

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Create variables on the same devices as ``colocate_with_variable`` (TF).

        A mirrored variable of this strategy is on every replica device (or
        the parameter device), which is where every new variable goes too, so
        the placement is already satisfied; the variable must belong to this
        strategy.
        """
        if not isinstance(colocate_with_variable, SyncVariable) or colocate_with_variable.distribute_strategy is not self._strategy:
            raise ValueError(
                f"colocate_vars_with: {colocate_with_variable!r} is not a variable of this {type(self._strategy).__name__}"
            )
        with self._strategy.scope():
            yield

    def variable_created_in_scope(self, v: Any) -> bool:
        """Whether ``v`` was created in this strategy's scope."""
        return isinstance(v, SyncVariable) and v.distribute_strategy is self._strategy

    def value_container(self, value: Any) -> Any:
        """The container of a per-device component: jaxdist variables are their own containers."""
        return value

    def read_var(self, v: SyncVariable) -> Any:
        """The cross-replica value of ``v`` (an ON_READ variable's parts aggregated)."""
        with ctx_lib.outside_frames() if ctx_lib.current_frame() is None else contextlib.nullcontext():
            return v.value()

    # -- reductions --------------------------------------------------------------------

    def _require_cross_replica(self, method: str) -> None:
        if ctx_lib.in_replica_fn():
            raise RuntimeError(
                f"strategy.extended.{method}() must be called in cross-replica context (outside strategy.run, or "
                "inside ReplicaContext.merge_call's merge_fn); inside fn use get_replica_context().all_reduce"
            )

    def _place(self, value: Any, destinations: Any) -> Any:
        """Put a reduced value where ``destinations`` says (TF's destinations argument)."""
        s, e = self._strategy, self._engine
        if destinations is None or ctx_lib.in_merge() or isinstance(value, jax.core.Tracer):
            return value
        if isinstance(destinations, SyncVariable):
            if destinations.distribute_strategy is not s:
                raise ValueError(f"destinations {destinations!r} belongs to another strategy")
            return e.store_variable(value) if not destinations.on_read else value
        if isinstance(destinations, PerReplica) or (isinstance(destinations, jax.Array) and destinations.ndim >= 0):
            return value  # TF: the value's own devices
        from jaxdist.sync.strategies import resolve_device

        devs = destinations if isinstance(destinations, (list, tuple)) else [destinations]
        devices = [resolve_device(d) for d in devs]
        if len(devices) == 1:
            if devices[0].process_index != jax.process_index():
                raise ValueError(f"destination {devices[0]} is not on this process")
            return jax.device_put(value, devices[0])
        if set(devices) == set(getattr(s, "devices", ())):
            return e.to_replicated(value)
        raise ConfigurationError(
            f"destinations {devs}: jaxdist places a reduced value on one device or on all of the strategy's "
            "devices; pass one device, a variable, or None"
        )

    def reduce_to(self, reduce_op: ReduceOp | str, value: Any, destinations: Any, options: Any = None) -> Any:
        """Reduce ``value`` across replicas and put the result on ``destinations`` (cross-replica).

        Args:
            reduce_op: SUM or MEAN.
            value: a per-replica value (outside ``run``: a ``PerReplica``; in
                ``merge_fn``: a value handed over by ``merge_call``), or a
                non-distributed value (TF's rule: MEAN returns it, SUM raises).
            destinations: a variable, a device (or its name), or None.
            options: a :class:`jaxdist.CommunicationOptions` for this reduction.
        """
        op = ReduceOp.coerce(reduce_op)
        self._require_cross_replica("reduce_to")
        s = self._strategy
        if ctx_lib.in_merge():
            return merge_reduce(s, op, value, None, options)
        self._engine.check_options(options, "reduce_to")
        ops = self._engine.collective_plan(options, "reduce_to")
        if isinstance(value, PerReplica) and isinstance(ops, cdo.ReductionToOneDevice):
            return self._place(self._reduce_on_one_device(ops, op, value), destinations)
        return self._place(s.reduce(op, value, axis=None), destinations)

    def _reduce_on_one_device(self, ops: cdo.ReductionToOneDevice, op: ReduceOp, value: PerReplica) -> Any:
        """Copy every replica's value to ``reduce_to_device``, reduce there, broadcast the result."""
        from jaxdist.sync.strategies import resolve_device

        e = self._engine
        if e.multi_process:
            raise ConfigurationError(
                "ReductionToOneDevice across processes: one device cannot hold other hosts' values; use the "
                "default CrossDeviceOps (an all-reduce) with MultiWorkerMirroredStrategy"
            )
        target = resolve_device(ops.reduce_to_device) if ops.reduce_to_device is not None else e.replica_devices()[0]
        parts = [jax.device_put(v, target) for v in value.values]
        total = jnp.asarray(ops.accumulate(parts))
        if op is ReduceOp.MEAN:
            total = total / len(parts)
        return e.mirrored.add(e.finish_replicated(e.to_replicated(total)))

    def batch_reduce_to(
        self, reduce_op: ReduceOp | str, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any = None
    ) -> list[Any]:
        """Reduce several values at once (inside ``merge_fn``: one fused all-reduce, packed per ``options``)."""
        op = ReduceOp.coerce(reduce_op)
        self._require_cross_replica("batch_reduce_to")
        pairs = list(value_destination_pairs)
        s = self._strategy
        if ctx_lib.in_merge():
            rep, ax = _merge_axis()
            plan = self._engine.collective_plan(options, "batch_reduce_to")
            merged = [v for v, _ in pairs]
            for v in merged:
                _reject_outside_value(v, "batch_reduce_to")
            if all(isinstance(v, MergedValue) for v in merged):
                return list(
                    cdo.all_reduce(plan, op is ReduceOp.MEAN, [jnp.asarray(v.local) for v in merged], ax, s.num_replicas_in_sync)
                )
            return [merge_reduce(s, op, v, None, options) for v in merged]
        return [self.reduce_to(op, v, d, options) for v, d in pairs]

    # -- updates -------------------------------------------------------------------------

    def update(
        self,
        var: SyncVariable,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        group: bool = True,
    ) -> Any:
        """Run ``fn(var, *args, **kwargs)`` to update ``var`` on all its copies (cross-replica, TF's ``update``).

        ``fn`` typically calls ``var.assign_add(...)``; in jaxdist the copies
        of a mirrored variable are one replicated value, so ``fn`` runs once
        and every copy gets the result. ``args`` must be the same for every
        replica (reduce per-replica values first), as TF requires.

        Returns:
            ``fn``'s result (``group=False``: one per local replica).
        """
        self._require_cross_replica("update")
        if not isinstance(var, SyncVariable) or var.distribute_strategy is not self._strategy:
            raise ValueError(f"update: {var!r} is not a variable of this {type(self._strategy).__name__}")
        for a in jax.tree.leaves((tuple(args), dict(kwargs or {})), is_leaf=lambda x: isinstance(x, (PerReplica, MergedValue))):
            if isinstance(a, (PerReplica, MergedValue)):
                raise ValueError(
                    "strategy.extended.update: args must be the same on every replica (mirrored), got a per-replica "
                    "value; reduce it first (extended.reduce_to / batch_reduce_to)"
                )
        out = fn(var, *args, **dict(kwargs or {}))
        if group:
            return out
        return tuple(out for _ in self.worker_devices)

    def __repr__(self) -> str:
        return f"StrategyExtended({type(self._strategy).__name__})"
