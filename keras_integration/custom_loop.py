"""Keras objects inside ``strategy.run`` and :func:`jaxdist.function`: TF's custom training loop with Keras parts.

TF's guide "Custom training with tf.distribute.Strategy" builds a Keras model, a Keras optimizer,
a Keras loss with ``reduction=None`` and Keras metrics in ``strategy.scope()``, and runs its
``train_step`` / ``test_step`` under ``strategy.run``. On JAX the gradient comes from
``jax.value_and_grad`` over ``model.stateless_call`` (Keras 3's own JAX custom-loop recipe); the rest
is the guide's code. What makes it work under every synchronous strategy:

- **Keras variables are variables of the trace.** While ``strategy.run`` (or ``jaxdist.function``,
  or ``run_steps``) traces user code, a Keras ``StatelessScope`` is current (the sync core's trace
  hook, :data:`HOOK`): a Keras variable read there is read through a :class:`KerasVariableView`, a
  mirrored :class:`~jaxdist.sync.variables.SyncVariable` whose value *is* the Keras variable's, so
  the compiled program takes it as an input; a Keras variable assigned there (``model(x)`` of a
  layer with state, ``metric.update_state``, ``optimizer.apply_gradients``) becomes an output,
  written back into the Keras variable after the call. Nothing is captured as a constant, no
  tracer leaks into a Keras variable, and Keras's ``"batch"`` mesh never meets the strategy's
  ``"replica"`` mesh inside the program (JAX's "Mesh for all inputs should be equal" error).
- **Updates made in replica context follow the Keras variable's** ``aggregation`` (TF's rule for
  a variable assigned inside ``strategy.run``): ``"sum"`` (every Keras metric's state) adds the
  replicas' changes (``old + sum_r(new_r - old)``: metrics are exact over the global batch),
  ``"mean"`` averages the replicas' values, ``"only_first_replica"`` (the optimizer's iteration
  counter) keeps replica 0's, and ``"none"`` (weights, optimizer slots) must be the same on every
  replica: a value that differs between replicas is refused when ``run`` compiles, naming the variable.
- **Optimizers sum the replicas' gradients first** (TF's ``apply_gradients`` contract in replica
  context): ``optimizer.apply_gradients``, ``optimizer.apply`` and ``optimizer.stateless_apply``
  inside ``strategy.run`` all-reduce the gradients (sum) before Keras's update rule runs, so with
  losses scaled by :func:`jaxdist.compute_average_loss` every replica applies the global batch's
  gradient. An optimizer that is not built yet is built (outside the trace, on the variables'
  strategy) at its first ``apply_gradients``, as in TF; under a multi-process strategy that raises
  (build it in the scope first: creating a variable there needs every process outside the step).
- **Stateless metric updates are aggregated too**: ``metric.stateless_update_state(vars, ...)``
  inside ``strategy.run`` returns values combined by each variable's aggregation, as above.
- **Losses.** A Keras loss called inside ``strategy.run`` of a synchronous strategy must have
  ``reduction=None`` (or ``"none"``/``"sum"``): any other reduction averages over the replica's part
  of the batch, which the summed gradients would count ``num_replicas`` times; it raises
  :class:`~jaxdist.base.errors.ConfigurationError` naming what to write instead (TF refuses it too).

Keras variables used this way must exist before the trace (build the model, as TF's guide does with
``Input`` shapes, in ``strategy.scope()``); the Keras internals this module relies on are in
:mod:`jaxdist.keras.compat`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import keras

from jaxdist.base.errors import ConfigurationError
from jaxdist.keras import compat
from jaxdist.sync import context as ctx_lib
from jaxdist.sync.hooks import register_trace_hook
from jaxdist.sync.strategy import default_strategy
from jaxdist.sync.variables import SyncVariable, VariableAggregation, VariableSynchronization

logger = logging.getLogger(__name__)

__all__ = ["HOOK", "KerasVariableView", "install_custom_loop_support", "mesh_replica", "view_of"]

#: The name of the sync core's trace hook this module registers.
HOOK = "keras"

#: Loss reductions that average over the examples a replica sees (refused inside strategy.run).
_AVERAGING_REDUCTIONS = ("sum_over_batch_size", "mean", "mean_with_sample_weight")


# ---------------------------------------------------------------------------------------
# Which strategy a Keras variable belongs to
# ---------------------------------------------------------------------------------------

def _strategy_of(variable: Any) -> Any:
    """The strategy Keras ``variable`` was created in (the default strategy: made outside every jaxdist scope)."""
    from jaxdist.keras.distribution import variable_distribution

    dist = variable_distribution(variable)
    return dist.strategy if dist is not None else default_strategy()


# ---------------------------------------------------------------------------------------
# A Keras variable as a variable of the strategy
# ---------------------------------------------------------------------------------------


class KerasVariableView(SyncVariable):
    """A Keras variable seen by jaxdist's compiled code: a mirrored variable whose value is the Keras variable's.

    Reading :attr:`storage` reads the Keras variable's array (placed as the strategy keeps mirrored
    values); writing it assigns the Keras variable. Its own aggregation is NONE: what a Keras
    variable's ``aggregation`` asks for is done when it is assigned in replica context (see the
    module docstring). Not checkpointed by :class:`jaxdist.Checkpoint` (Keras saves its own).
    """

    __slots__ = ("keras_variable",)

    varying_assign_hint = (
        "It is a Keras variable (aggregation='none'): apply gradients with the Keras optimizer inside strategy.run "
        "(apply_gradients / stateless_apply sum the replicas' gradients first, as TF's do), or give a variable of "
        "your own aggregation='sum' / 'mean' / 'only_first_replica' (Keras's add_weight(aggregation=...))"
    )

    def __init__(self, strategy: Any, variable: Any) -> None:
        super().__init__(
            strategy,
            f"keras/{variable.path}",
            None,
            tuple(variable.shape),
            np.dtype(variable.dtype),
            bool(variable.trainable),
            VariableSynchronization.ON_WRITE,
            VariableAggregation.NONE,
            False,
        )
        self.keras_variable = variable

    @property
    def storage(self) -> Any:
        return self.distribute_strategy.engine.store_variable(_stored(self.keras_variable))

    @storage.setter
    def storage(self, value: Any) -> None:
        self.keras_variable.assign(value)


def _stored(variable: Any) -> Any:
    """The array Keras ``variable`` holds; raises if it has none yet (created inside a trace)."""
    raw = compat.stored_value(variable)
    if raw is None:
        raise ConfigurationError(
            f"Keras variable {variable.path!r} has no value yet: it was created inside strategy.run / "
            "jaxdist.function (Keras builds layers lazily). Create it before the loop, in strategy.scope(): build "
            "the model (keras.Input shapes, or model.build(input_shape)) and, if you like, the optimizer "
            "(optimizer.build(model.trainable_variables))"
        )
    return raw


_views_lock = threading.Lock()
#: id(Keras variable) -> its view (dropped with the variable).
_views: dict[int, KerasVariableView] = {}


def view_of(variable: Any) -> KerasVariableView:
    """The :class:`KerasVariableView` of a Keras variable (one per variable)."""
    key = id(variable)
    with _views_lock:
        cached = _views.get(key)
        if cached is not None and cached.keras_variable is variable:
            return cached
    from jaxdist.keras import ps_custom_loop

    bound = ps_custom_loop.binding(variable)
    view: KerasVariableView
    if bound is not None:  # a worker's copy of a model, metric trained under ParameterServerStrategy
        view = ps_custom_loop.PSBoundView(variable, bound)
    else:
        view = KerasVariableView(_strategy_of(variable), variable)
    with _views_lock:
        _views[key] = view
    weakref.finalize(variable, _forget_view, key)
    return view


def _forget_view(key: int) -> None:
    with _views_lock:
        _views.pop(key, None)


# ---------------------------------------------------------------------------------------
# Replica context: aggregation of updates
# ---------------------------------------------------------------------------------------


def mesh_replica() -> Any:
    """The replica context of a synchronous strategy's ``run`` being traced (outside merge_fn), else None."""
    rep = ctx_lib.get_replica_context()
    if rep is None or rep.axis_name is None:
        return None  # cross-replica context, or the default strategy's one replica
    return rep


def aggregate_update(variable: Any, old: Any, new: Any) -> Any:
    """``new``, a replica's value for Keras ``variable`` (``old`` before), combined across replicas.

    Outside a synchronous strategy's replica context: ``new`` itself.
    """
    rep = mesh_replica()
    if rep is None:
        return new
    aggregation = str(getattr(variable, "aggregation", "none") or "none").lower()
    new = jnp.asarray(new)
    if aggregation == "sum":
        old = jnp.asarray(old).astype(new.dtype)
        return old + rep.all_reduce("sum", new - old)
    if aggregation == "mean":
        if not jnp.issubdtype(new.dtype, jnp.floating):
            raise ConfigurationError(
                f"Keras variable {variable.path!r} (aggregation='mean', dtype {new.dtype}) is assigned inside "
                "strategy.run: a mean of integers is not a value of the variable; use aggregation='sum' or "
                "'only_first_replica', or assign it outside strategy.run"
            )
        return rep.all_reduce("mean", new)
    if aggregation == "only_first_replica":
        first = rep.replica_id_in_sync_group == 0
        if new.dtype == jnp.bool_:
            return rep.all_reduce("sum", jnp.where(first, new, False).astype(jnp.int32)).astype(jnp.bool_)
        return rep.all_reduce("sum", jnp.where(first, new, jnp.zeros_like(new)))
    return new  # "none": must be the same on every replica (checked when run compiles)


# ---------------------------------------------------------------------------------------
# The trace hook: Keras's stateless scope mapped onto the frame's variables
# ---------------------------------------------------------------------------------------


class FrameScope(keras.StatelessScope):
    """The Keras ``StatelessScope`` current while jaxdist traces user code.

    Keras variables read in it are read through their :class:`KerasVariableView` in the current
    frame (inputs of the compiled program); assigned ones are assigned there (outputs, written back
    after the call), combined across replicas by their aggregation in replica context.
    """

    def __init__(self) -> None:
        super().__init__(initialize_variables=False)

    def get_current_value(self, variable: Any) -> Any:
        _stored(variable)  # a variable created inside the trace has no value to thread: say what to do
        _refuse_ps_variable(variable)
        from jaxdist.keras.ps_custom_loop import refuse_optimizer_variable

        refuse_optimizer_variable(variable)
        return view_of(variable).value()

    def add_update(self, update: Any) -> None:
        from jaxdist.keras.ps_custom_loop import refuse_weight_assign

        variable, value = update
        if refuse_weight_assign(variable, value):
            return  # a value stateless_apply pushed and read back from the parameter servers: they hold it
        view = view_of(variable)
        view.assign(aggregate_update(variable, view.value(), value), read_value=False)


def _refuse_ps_variable(variable: Any) -> None:
    from jaxdist.keras.ps_model import ps_strategy_of_variable

    ps = ps_strategy_of_variable(variable)
    if ps is not None:
        raise ConfigurationError(
            f"Keras variable {variable.path!r} belongs to a model built in {type(ps).__name__}.scope(): its training "
            "state lives on the parameter servers, which strategy.run / jaxdist.function do not read or update. "
            "Train such a model with model.fit / evaluate (they dispatch closures through a ClusterCoordinator), "
            "or schedule the custom loop's steps as closures (ClusterCoordinator.schedule) that call "
            "strategy.run(replica_fn) on the worker, or write it with jaxdist.create_variables, jaxdist.pull and "
            "jaxdist.apply_gradients"
        )


@contextlib.contextmanager
def trace_scope(strategy: Any) -> Iterator[None]:
    """The sync core's trace hook: :class:`FrameScope` around the user's code in every trace."""
    with FrameScope():
        yield


# ---------------------------------------------------------------------------------------
# Optimizers, metrics and losses inside strategy.run
# ---------------------------------------------------------------------------------------


def _in_frame() -> bool:
    return ctx_lib.current_frame() is not None


def optimizer_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's ``Optimizer.apply`` (what ``apply_gradients`` and ``stateless_apply`` call), summing the replicas'
    gradients first in a synchronous strategy's replica context, and building the optimizer outside the trace."""

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        from jaxdist.keras.ps_custom_loop import ps_apply

        grads = list(grads)
        if ps_apply(self, grads, trainable_variables, mesh_replica()):
            return None  # a worker's copy of an optimizer trained under ParameterServerStrategy: the PS applies
        if trainable_variables is not None and not self.built and _in_frame():
            trainable_variables = list(trainable_variables)
            _build_outside_trace(self, trainable_variables)
        rep = mesh_replica()
        if rep is not None and grads:
            present = [i for i, g in enumerate(grads) if g is not None]
            summed = rep.all_reduce("sum", [grads[i] for i in present])
            for i, g in zip(present, summed):
                grads[i] = g
        return original(self, grads, trainable_variables)

    return apply


def _build_outside_trace(optimizer: Any, variables: list[Any]) -> None:
    """Build ``optimizer`` for ``variables`` eagerly, as in their strategy's scope (its slots are made once)."""
    from jaxdist.keras.scope import distribution_for

    strategy = _strategy_of(variables[0]) if variables else None
    dist = distribution_for(strategy) if strategy is not None else None
    if getattr(dist, "multi_process", False):
        # Keras places each new variable with a check across processes (multihost_utils), which JAX refuses
        # inside a trace.
        raise ConfigurationError(
            f"Keras optimizer {optimizer.name!r} is first used inside {type(strategy).__name__}.run, whose replicas "
            "span several processes: build it before the loop, in strategy.scope() "
            "(optimizer.build(model.trainable_variables)); creating its variables needs every process outside "
            "the compiled step"
        )
    with ctx_lib.outside_frames(), compat.outside_stateless_scope(), jax.ensure_compile_time_eval():
        with dist.scope() if dist is not None else contextlib.nullcontext():
            optimizer.build(variables)
    logger.info("built Keras optimizer %s inside a trace (outside it, on %s)", optimizer.name, strategy)


def metric_stateless_update(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's ``Metric.stateless_update_state``, its results combined across replicas in replica context."""

    def stateless_update_state(self: Any, metric_variables: Any, *args: Any, **kwargs: Any) -> Any:
        new = original(self, metric_variables, *args, **kwargs)
        if mesh_replica() is None:
            return new
        out = []
        for var, old, value in zip(self.variables, metric_variables, new):
            if value is var:  # Keras returns the variable itself for a state update_state left alone
                out.append(old)
            else:
                out.append(aggregate_update(var, old, value))
        return out

    return stateless_update_state


def loss_reduction(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's loss reduction (what every ``Loss.__call__`` ends with), refusing inside ``strategy.run`` a reduction
    that averages over the replica's examples."""

    def reduce_weighted_values(
        values: Any, sample_weight: Any = None, mask: Any = None, reduction: Any = "sum_over_batch_size", dtype: Any = None
    ) -> Any:
        if reduction in _AVERAGING_REDUCTIONS and mesh_replica() is not None:
            strategy = ctx_lib.get_strategy()
            raise ConfigurationError(
                f"a Keras loss with reduction={reduction!r} is called inside {type(strategy).__name__}.run: it "
                "averages over this replica's part of the batch, and the replicas' gradients are summed, so the "
                "loss would count num_replicas_in_sync times (TF refuses it too). Create the loss with "
                "reduction=None (per-example losses) and scale them with "
                "jaxdist.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE), or use "
                "reduction='sum' and divide by the global batch size yourself"
            )
        return original(values, sample_weight=sample_weight, mask=mask, reduction=reduction, dtype=dtype)

    return reduce_weighted_values


_install_lock = threading.Lock()
_installed = False


def install_custom_loop_support() -> None:
    """Register the trace hook and wrap Keras's optimizer, metric and loss entry points (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        compat.install_custom_loop_patches(optimizer_apply, metric_stateless_update, loss_reduction)
        register_trace_hook(HOOK, trace_scope)
        _installed = True
