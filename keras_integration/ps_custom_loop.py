"""Keras's custom training loop inside ``ClusterCoordinator`` closures under ``ParameterServerStrategy``.

TF's custom-loop guide and its parameter-server tutorial build a Keras model, optimizer and metrics in
``ParameterServerStrategy.scope()`` and schedule steps whose ``strategy.run(replica_fn)`` trains the model
on a worker. Here (Keras 3's JAX recipe: ``jax.value_and_grad`` over ``model.stateless_call``)::

    with strategy.scope():
        model = keras.Sequential([keras.Input((28, 28, 1)), ...])
        optimizer = keras.optimizers.Adam(0.01)
        train_accuracy = keras.metrics.SparseCategoricalAccuracy()

    def replica_fn(batch):                       # the guide's train_step
        ...grads via jax.value_and_grad(loss_fn)(...)...
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def step_fn(batch):
        return strategy.reduce("SUM", strategy.run(replica_fn, args=(batch,)), axis=None)

    coordinator.schedule(step_fn, args=(batch,))

How it works (TF's semantics: the model's state lives on the parameter servers):

- **The PS holds the state.** A Keras model, optimizer or metric made in the strategy's scope and captured
  by a scheduled function pickles as a reference to its state on the parameter servers (made when the
  first closure that captures it is scheduled): the model's variables (partitioned by the strategy's
  ``variable_partitioner``), each trainable one with the optimizer's Keras update rule as its PS-side
  optimizer (:mod:`jaxdist.keras.ps_optimizers`; the same rules ``fit`` uses), the optimizer's step
  counter, and one accumulator per metric variable. The optimizer is ``model.optimizer`` when the model
  is compiled, else the one Keras optimizer made in the scope (several: compile the model with the one
  that trains it, ``model.compile(optimizer=...)``).
- **On the worker** each reference becomes the process's copy (rebuilt from the config once, shared by
  in-process workers). Inside ``strategy.run`` (the worker's devices, :mod:`jaxdist.ps_methods`) every
  read of the model's variables reads the PS's current values, pulled once per ``run`` (one call per PS
  task) into that run's own session (a run never reads or writes the copy's variables);
  ``optimizer.apply_gradients`` sums the replicas' gradients (TF's contract), applies Keras's clipping
  and, when ``run`` returns, pushes them with ``+1`` on the step counter; metric updates are added up
  across replicas and their increments pushed to the accumulators. All of a ``run``'s pushes go in one
  atomic push per PS task carrying the closure's identity: a closure re-run after a worker failure
  applies them once. Outside ``run`` (the closure's own body): ``metric.update_state`` and
  ``optimizer.apply_gradients`` push at once (same identity rule); the copy's variables hold the values
  of the process's latest pull (the config's initial values before the first ``run``).
- **On the coordinator** ``metric.result()`` reads the accumulators and ``metric.reset_state()`` resets
  them; :func:`jaxdist.keras.sync_from_ps` copies the PS's weights (and the step counter into
  ``optimizer.iterations``) into the coordinator's model, as ``fit`` does after each epoch.

Keras's stateless recipe (``grads`` from ``jax.grad`` over ``model.stateless_call``, then
``trainable, optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)``) works too, with
the PS's semantics (TF's: a read after an update reads the PS):

- ``stateless_apply`` sums the replicas' gradients and clips them as ``apply_gradients`` does, and pushes them
  with ``+1`` on the step counter **at the call**: inside ``strategy.run`` from the compiled step itself (a
  host callback, once whatever the number of local replicas, in a child of the closure's push identity, so a
  re-run closure applies it once); in the closure's body, at once. The PS applies the optimizer, once.
- It returns the **values the PS holds right after that push** (read back from the PS: one pull of the model's
  trainable variables), and ``optimizer_vars`` **as given**: the optimizer's state (step count, moments) lives
  on the PS, so only their structure is checked: one value per variable of this optimizer built for this model
  (``optimizer.build(model.trainable_variables); [v.value for v in optimizer.variables]`` on the coordinator).
  With one worker the values equal Keras's own ``stateless_apply`` on one device; with several, pushes other
  workers made before this one are in them too. Read the step count with :func:`jaxdist.keras.sync_from_ps`.
- Inside ``run`` the parameter servers must be other processes: a PS serving from this process (an in-process
  cluster) would run its optimizer step on the XLA CPU client the waiting step holds (it hung over 2 local
  devices), so that raises :class:`~jaxdist.base.errors.ConfigurationError`.
- Assigning those returned values back (``variable.assign(value)`` in the same run, Keras's recipe) is
  accepted and does nothing: the PS holds them already. Any other assignment of a weight is refused.
- ``metric.stateless_update_state(metric_vars, ...)`` is a pure function, as in Keras: inside ``run`` the
  replicas' updates are combined (exact cross-replica values); it pushes nothing (the PS accumulators change only
  by ``update_state``).

What raises :class:`~jaxdist.base.errors.ConfigurationError` (saying what to write instead):
``stateless_apply`` with another optimizer's variables or another structure, or with values that are not the
captured model's trainable variables, reading an optimizer variable inside ``run``, assigning a model weight
any other value, a layer captured without its model, a metric whose variables do not
add up (``aggregation`` other than ``"sum"``), several candidate optimizers, and an optimizer without a
PS rule (:class:`~jaxdist.keras.ps_optimizers.UnsupportedOptimizerError`).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import logging
import threading
import uuid
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import io_callback
import numpy as np

import keras

from jaxdist.base.errors import ConfigurationError
from jaxdist.keras import compat
from jaxdist.keras.custom_loop import KerasVariableView, mesh_replica
from jaxdist.keras.ps_model import (
    ps_model,
    ps_model_with_optimizer,
    ps_optimizers,
    ps_strategy_of,
    ps_strategy_of_variable,
)
from jaxdist.keras.ps_embedding import dynamic_embeddings
from jaxdist.keras.ps_optimizers import clipping_of, to_optax
from jaxdist.proto import pickling
from jaxdist.proto.ps_wire import Op
from jaxdist.ps_methods import local_strategy, register_run_hook
from jaxdist.sync import context as ctx_lib
from jaxdist.sync.variables import SyncVariable, VariableAggregation, VariableSynchronization
from jaxdist.variables import gradient_updates, pull, pulls_for_run, push_updates, split_update
from jaxdist.worker import context as wctx

logger = logging.getLogger(__name__)

__all__ = ["PSBoundView", "RUN_HOOK", "binding", "install_ps_custom_loop_support", "ps_apply", "refuse_optimizer_variable",
           "refuse_weight_assign"]

#: The name of the ParameterServerStrategy run hook this module registers.
RUN_HOOK = "keras"


# ---------------------------------------------------------------------------------------
# Coordinator: Keras objects of a PS scope pickle as references to their PS state
# ---------------------------------------------------------------------------------------

_lock = threading.Lock()


class _OptimizerRef:
    """A Keras optimizer trained on the PS: its config (rebuilt on the worker), clipping, PS step counter."""

    def __init__(self, optimizer: Any, strategy: Any) -> None:
        to_optax(optimizer)  # UnsupportedOptimizerError now, at the first schedule, not on a worker
        self.uid = f"opt-{uuid.uuid4().hex[:12]}"
        self.config = keras.optimizers.serialize(optimizer)
        self.clipping = clipping_of(optimizer)
        existing = ps_model_with_optimizer(optimizer)  # a model fitted with it: one step counter for both
        self.iterations = existing.iterations if existing is not None else strategy.create_variable(
            np.asarray(int(optimizer.iterations.numpy()), np.int64), name=f"keras/{self.uid}/iterations", trainable=False)

    def build(self) -> Any:
        optimizer = keras.optimizers.deserialize(self.config)
        _optimizer_bindings[id(optimizer)] = self
        for v in optimizer.variables:  # its step counter, learning rate: the PS's optimizer has the real ones
            _bindings[id(v)] = _Binding("optimizer", v, None, None)

        def stateless_apply(optimizer_variables: Any, grads: Any, trainable_variables: Any) -> Any:
            return _stateless_apply(optimizer, self, optimizer_variables, grads, trainable_variables)

        compat.replace_on_instance(optimizer, "stateless_apply", stateless_apply)
        return optimizer


class _ModelRef:
    """A Keras model whose variables live on the PS: its config and its PS variables."""

    def __init__(self, model: Any, pm: Any, optimizer_uid: str) -> None:
        self.uid = f"model-{pm.uid}"
        self.optimizer_uid = optimizer_uid  # the optimizer whose stateless_apply trains this model's weights
        self.model_json = model.to_json()
        self.trainable = list(pm.trainable)
        self.non_trainable = list(pm.non_trainable)

    def build(self) -> Any:
        model = keras.models.model_from_json(self.model_json)
        if not model.built or (len(model.trainable_variables), len(model.non_trainable_variables)) != (
                len(self.trainable), len(self.non_trainable)):
            raise ConfigurationError(
                "the Keras model rebuilt on the worker from its config is not built, or has other variables than the "
                "coordinator's: build it with keras.Input shapes, and make its layers serializable (get_config) and "
                "registered (keras.saving.register_keras_serializable) in a module the worker imports")
        variables = list(model.trainable_variables) + list(model.non_trainable_variables)
        group = _PullGroup(variables, self.trainable + self.non_trainable)
        for i, (v, h) in enumerate(zip(variables, group.handles)):
            _bindings[id(v)] = _Binding("weight" if i < len(self.trainable) else "state", v, h, group, index=i)
        with _trained_lock:
            _trained.setdefault(self.optimizer_uid, []).append(_Trained(model, group, len(self.trainable)))
        return model


class _MetricRef:
    """A Keras metric accumulated on the PS: its config and one accumulator per metric variable."""

    def __init__(self, metric: Any, strategy: Any) -> None:
        for v in metric.variables:
            if str(getattr(v, "aggregation", "sum")) != "sum":
                raise ConfigurationError(
                    f"Keras metric {metric.name!r}: variable {v.path} has aggregation {v.aggregation!r}; under "
                    "ParameterServerStrategy the closures' increments are added up on the parameter servers, which "
                    "needs aggregation='sum' (Keras's default for metrics); compute this one on the coordinator")
        self.uid = f"metric-{uuid.uuid4().hex[:12]}"
        self.config = keras.metrics.serialize(metric)
        fresh = keras.metrics.deserialize(self.config)
        self.init = [np.asarray(v.value) for v in fresh.variables]
        self.accumulators = [
            strategy.create_variable(np.asarray(v.value), name=f"keras/{self.uid}/{i}", trainable=False)
            for i, v in enumerate(metric.variables)]

    def build(self) -> Any:
        metric = keras.metrics.deserialize(self.config)
        if len(metric.variables) != len(self.accumulators):
            raise ConfigurationError(f"Keras metric {metric.name!r} rebuilt on the worker has other variables than "
                                     "the coordinator's: make it serializable (get_config)")
        for v, h, init in zip(metric.variables, self.accumulators, self.init):
            v.assign(init)
            _bindings[id(v)] = _Binding("metric", v, h, None, init)
        compat.replace_on_instance(metric, "update_state", _eager_metric_update(metric, metric.update_state))
        return metric


_model_refs: weakref.WeakKeyDictionary[Any, _ModelRef] = weakref.WeakKeyDictionary()
_optimizer_refs: weakref.WeakKeyDictionary[Any, _OptimizerRef] = weakref.WeakKeyDictionary()
_metric_refs: weakref.WeakKeyDictionary[Any, _MetricRef] = weakref.WeakKeyDictionary()


def _optimizer_ref(optimizer: Any, strategy: Any) -> _OptimizerRef:
    with _lock:
        ref = _optimizer_refs.get(optimizer)
        if ref is None:
            ref = _optimizer_refs[optimizer] = _OptimizerRef(optimizer, strategy)
        return ref


def _optimizer_of(model: Any, strategy: Any) -> Any:
    """The Keras optimizer whose rule the PS applies to ``model`` (see the module docstring)."""
    if getattr(model, "optimizer", None) is not None:
        return model.optimizer
    found = ps_optimizers(strategy)
    if len(found) == 1:
        return found[0]
    raise ConfigurationError(
        f"Keras model {model.name!r} is used in a closure under ParameterServerStrategy, and "
        + ("no Keras optimizer was made in the strategy's scope" if not found else
           f"{len(found)} Keras optimizers were made in the strategy's scope ({', '.join(o.name for o in found)})")
        + ": the parameter servers apply the optimizer, so they need to know which one trains the model. Make it "
        "in strategy.scope(), or compile the model with it there (model.compile(optimizer=optimizer))")


def _model_ref(model: Any, strategy: Any) -> _ModelRef:
    with _lock:
        ref = _model_refs.get(model)
    if ref is not None:
        return ref
    if dynamic_embeddings(model):
        raise ConfigurationError(
            f"Keras model {model.name!r} has jaxdist.keras.layers.DynamicEmbedding layers, which run under "
            "model.fit/evaluate/predict only: in a custom loop's closures, look rows up and push their gradients "
            "with jaxdist.DynamicEmbedding (lookup, apply_gradients) and feed the rows to the rest of the model")
    optimizer = _optimizer_of(model, strategy)
    oref = _optimizer_ref(optimizer, strategy)
    pm = ps_model(model, optimizer=optimizer, iterations=oref.iterations)
    assert pm is not None
    if pm.optimizer is not optimizer:
        raise ConfigurationError(f"Keras model {model.name!r} has its variables on the parameter servers with "
                                 f"optimizer {pm.optimizer.name!r} already (an earlier fit): train it with that one")
    with _lock:
        return _model_refs.setdefault(model, _ModelRef(model, pm, oref.uid))


def _metric_ref(metric: Any, strategy: Any) -> _MetricRef:
    with _lock:
        ref = _metric_refs.get(metric)
        if ref is not None:
            return ref
        ref = _metric_refs[metric] = _MetricRef(metric, strategy)
    _follow_ps(metric, ref)
    return ref


def _follow_ps(metric: Any, ref: _MetricRef) -> None:
    """The coordinator's ``metric.result()`` reads the PS accumulators; ``reset_state()`` resets them too."""
    result, reset_state = metric.result, metric.reset_state

    def ps_result() -> Any:
        for v, value in zip(metric.variables, pull(ref.accumulators)):
            v.assign(value)
        return result()

    def ps_reset_state() -> None:
        reset_state()
        updates = []
        for h, v in zip(ref.accumulators, metric.variables):
            updates.extend(split_update(h, Op.ASSIGN, np.asarray(v.value)))
        push_updates(updates)

    compat.replace_on_instance(metric, "result", ps_result)
    compat.replace_on_instance(metric, "reset_state", ps_reset_state)


def _reference_of(obj: Any) -> Any:
    """What ``obj`` pickles as when it belongs to a ParameterServerStrategy scope (None: Keras's own pickling)."""
    if isinstance(obj, keras.Model):
        strategy = ps_strategy_of(obj)
        return None if strategy is None else _model_ref(obj, strategy)
    if isinstance(obj, keras.optimizers.Optimizer):
        strategy = ps_strategy_of_variable(obj.iterations)
        return None if strategy is None else _optimizer_ref(obj, strategy)
    if isinstance(obj, keras.metrics.Metric):
        strategy = next((s for s in map(ps_strategy_of_variable, obj.variables) if s is not None), None)
        return None if strategy is None else _metric_ref(obj, strategy)
    if isinstance(obj, keras.layers.Layer) and any(ps_strategy_of_variable(v) is not None for v in obj.variables):
        raise ConfigurationError(
            f"Keras layer {obj.name!r} of a model built in ParameterServerStrategy.scope() is captured by a closure "
            "on its own: capture the model (its state lives on the parameter servers, shipped as the model's)")
    return None


def pickle_patch(original: Callable[..., Any]) -> Callable[..., Any]:
    """Keras's ``KerasSaveable.__reduce__``, except for objects of a ParameterServerStrategy scope pickled by
    jaxdist to travel to a worker (:func:`jaxdist.proto.pickling.shipping`)."""

    def reduce(self: Any) -> Any:
        if not pickling.shipping():  # the user's own pickle.dumps / copy.deepcopy: Keras's way
            return original(self)
        ref = _reference_of(self)
        if ref is None:
            return original(self)
        return (_worker_copy, (ref,))

    return reduce


# ---------------------------------------------------------------------------------------
# Worker: the copies and what their variables stand for
# ---------------------------------------------------------------------------------------

_copies_lock = threading.Lock()
#: reference uid -> this process's copy.
_copies: dict[str, Any] = {}


def _worker_copy(ref: Any) -> Any:
    """This process's copy of the object ``ref`` stands for (built once, when a closure's function is first
    unpickled: outside any closure's context, so it reads nothing from the PS). Several in-process workers
    share it: a run never reads or writes the copy's variables, only its own session's values."""
    key = ref.uid
    with _copies_lock:
        got = _copies.get(key)
    if got is not None:
        return got
    made = ref.build()
    with _copies_lock:
        return _copies.setdefault(key, made)


class _PullGroup:
    """A model's variables on the worker and their PS variables, pulled together."""

    def __init__(self, variables: list[Any], handles: list[Any]) -> None:
        self.variables = variables
        self.handles = handles

    def pull(self) -> list[np.ndarray]:
        """The PS's values now (one call per PS task); the copy's variables get them too, for eager use of the
        model in a closure's body (the latest pull in this process)."""
        values = [np.asarray(v) for v in pull(self.handles)]
        # Called while strategy.run traces (the first read of a variable): the copies are assigned eagerly, outside
        # the trace's Keras scope and jaxdist frame.
        with _copies_lock, ctx_lib.outside_frames(), compat.outside_stateless_scope(), jax.ensure_compile_time_eval():
            for v, value in zip(self.variables, values):
                v.assign(value)
        return values


class _Binding:
    """What a worker copy's Keras variable stands for: ``kind`` ``"weight"`` (trainable), ``"state"``
    (non-trainable model variable) or ``"metric"`` (an accumulator's part), its PS variable ``handle``."""

    __slots__ = ("kind", "keras_variable", "handle", "group", "index", "init", "slot")

    def __init__(self, kind: str, keras_variable: Any, handle: Any, group: _PullGroup | None,
                 init: np.ndarray | None = None, index: int = 0) -> None:
        self.kind = kind
        self.keras_variable = keras_variable
        self.handle = handle
        self.group = group
        self.index = index  # in ``group``
        self.init = init
        self.slot: _Slot | None = None


#: id(worker copy's Keras variable) -> its binding (copies are kept for the process's life: never reused ids).
_bindings: dict[int, _Binding] = {}
#: id(worker copy's optimizer) -> its reference.
_optimizer_bindings: dict[int, _OptimizerRef] = {}
_iteration_slots: dict[int, _Slot] = {}


def binding(variable: Any) -> _Binding | None:
    """The binding of a worker copy's Keras variable (None: not a variable of a PS-trained Keras object)."""
    b = _bindings.get(id(variable))
    return b if b is not None and b.keras_variable is variable else None


# ---------------------------------------------------------------------------------------
# One strategy.run: pulls before, pushes after
# ---------------------------------------------------------------------------------------


class _Session:
    """What one ``ParameterServerStrategy.run`` on a worker pulled, and the pushes it owes."""

    def __init__(self) -> None:
        self.pulled: dict[int, list[np.ndarray]] = {}
        self.grads: dict[_Binding, Any] = {}
        self.iterations: dict[int, tuple[_OptimizerRef, Any]] = {}
        self.metrics: dict[_Binding, Any] = {}
        self.states: dict[_Binding, Any] = {}
        # optimizer.stateless_apply inside the run: its pushes happen during the compiled step (a host callback),
        # in the closure's task context, each once whatever the number of replicas calling back.
        self.key = next(_session_keys) % (2**31 - 1)
        self.task = wctx.current()
        self.lock = threading.Lock()
        self.applied: dict[int, list[np.ndarray]] = {}  # call site -> the PS's values after its push
        self.applied_done: Any = None  # an output of the step computed after every callback: finish waits on it
        #: id(traced value) -> the weight binding whose post-push value it is (trace time: assigning it back is fine).
        self.returned: dict[int, _Binding] = {}

    def value(self, b: _Binding) -> np.ndarray:
        """What ``b``'s variable reads in this run: a model variable's PS value (its model pulled once per run),
        a metric part's reset value (the run's increment is what it pushes)."""
        if b.group is None:
            assert b.init is not None
            return b.init
        values = self.pulled.get(id(b.group))
        if values is None:
            with pulls_for_run():  # an input of the compiled step, read each call: not a constant of the trace
                values = self.pulled[id(b.group)] = b.group.pull()
        return values[b.index]

    def finish(self) -> None:
        if self.applied_done is not None:
            np.asarray(self.applied_done)  # the step's stateless_apply pushes are done before the run's own
        updates: list[Any] = []
        for b, g in self.grads.items():
            updates.extend(gradient_updates(b.handle, np.asarray(g), broadcast=False))
        for ref, count in self.iterations.values():
            if int(count):
                updates.extend(split_update(ref.iterations, Op.ASSIGN_ADD, np.asarray(int(count), np.int64)))
        for b, value in self.metrics.items():
            assert b.init is not None
            updates.extend(split_update(b.handle, Op.ASSIGN_ADD, np.asarray(value) - b.init))
        for b, value in self.states.items():
            updates.extend(split_update(b.handle, Op.ASSIGN, np.asarray(value), broadcast=False))
        if updates:
            push_updates(updates)


_SESSION: contextvars.ContextVar[_Session | None] = contextvars.ContextVar("jaxdist_keras_ps_run", default=None)
_session_keys = itertools.count(1)
#: Sessions of the runs in progress by key: a stateless_apply callback (on XLA's thread) finds its run's session.
_live: dict[int, _Session] = {}
_live_lock = threading.Lock()


@contextlib.contextmanager
def _run_scope() -> Iterator[None]:
    """The run hook: a session around each ``ParameterServerStrategy.run``; its pushes when it succeeded."""
    if _SESSION.get() is not None:  # a run inside a run: the outer one pushes
        yield
        return
    session = _Session()
    token = _SESSION.set(session)
    with _live_lock:
        _live[session.key] = session
    try:
        yield
    finally:
        _SESSION.reset(token)
        try:
            if session.applied_done is not None:
                np.asarray(session.applied_done)  # no callback of this run still running when it is forgotten
        finally:
            with _live_lock:
                _live.pop(session.key, None)
    session.finish()  # not reached when the run raised: it owes nothing


def _session(what: str) -> _Session:
    s = _SESSION.get()
    if s is None:
        raise ConfigurationError(
            f"{what} of a Keras object trained under ParameterServerStrategy is used in compiled code other than "
            "ParameterServerStrategy.run: inside a scheduled closure, call the model, its optimizer and metrics "
            "inside strategy.run(replica_fn, ...) (the worker's devices), as TF's parameter-server tutorial does")
    return s


# ---------------------------------------------------------------------------------------
# Variables of the trace: the copies' variables, and the gradient and step slots
# ---------------------------------------------------------------------------------------


class PSBoundView(KerasVariableView):
    """A worker copy's Keras variable in ``strategy.run``'s trace: read, it is the PS's value (pulled once per
    run); assigned, what the run owes the PS (a metric's increment, a non-trainable variable's value)."""

    __slots__ = ("binding",)

    def __init__(self, variable: Any, b: _Binding) -> None:
        super().__init__(local_strategy(), variable)
        self.binding = b

    @property
    def storage(self) -> Any:
        kind = self.binding.kind
        value = _session("a Keras metric" if kind == "metric" else "a Keras model").value(self.binding)
        return self.distribute_strategy.engine.store_variable(value)

    @storage.setter
    def storage(self, value: Any) -> None:
        kind = self.binding.kind
        if kind == "weight":
            raise ConfigurationError(_WEIGHT_ASSIGNED.format(path=self.keras_variable.path))
        s = _session("a Keras metric" if kind == "metric" else "a Keras model")
        (s.metrics if kind == "metric" else s.states)[self.binding] = value


_NO_STATELESS_APPLY = (
    "Keras optimizer {name!r} trains a model under ParameterServerStrategy: optimizer.apply(grads) without the "
    "variables has no variables to apply to. Write optimizer.apply_gradients(zip(grads, model.trainable_variables)), "
    "or Keras's stateless form, optimizer.stateless_apply(optimizer_variables, grads, trainable_values)")

_WEIGHT_ASSIGNED = (
    "Keras variable {path!r} of a model trained under ParameterServerStrategy is assigned inside strategy.run: its "
    "value lives on the parameter servers and changes only by the optimizer there; apply gradients with "
    "optimizer.apply_gradients(zip(grads, model.trainable_variables))")


def refuse_optimizer_variable(variable: Any) -> None:
    """Raise if ``variable`` is a worker copy's optimizer variable (read in a trace: the PS holds the optimizer)."""
    b = binding(variable)
    if b is not None and b.kind == "optimizer":
        raise ConfigurationError(
            f"Keras variable {variable.path!r} of an optimizer trained under ParameterServerStrategy is read inside "
            "strategy.run: the optimizer's state lives on the parameter servers (the optimizer's variables have no "
            "values on the worker). Write optimizer.apply_gradients(zip(grads, model.trainable_variables)) inside "
            "strategy.run, or optimizer.stateless_apply(optimizer_variables, grads, trainable_values) with "
            "optimizer_variables read on the coordinator (optimizer.build(model.trainable_variables); "
            "[v.value for v in optimizer.variables]): under ParameterServerStrategy only their structure is used")


def refuse_weight_assign(variable: Any, value: Any = None) -> bool:
    """Raise if ``variable`` is a PS-trained model's weight (assigned in a trace: only the optimizer changes it),
    unless ``value`` is what this run's ``optimizer.stateless_apply`` returned for it (Keras's recipe assigns the
    new values back): then True, nothing to do (the PS holds it already). False: not such a weight."""
    b = binding(variable)
    if b is None or b.kind != "weight":
        return False
    s = _SESSION.get()
    if s is not None and value is not None and s.returned.get(id(value)) is b:
        return True
    raise ConfigurationError(_WEIGHT_ASSIGNED.format(path=variable.path))


class _Slot(SyncVariable):
    """What a run owes the PS for one variable (a gradient sum) or optimizer (steps): zero when the run starts."""

    __slots__ = ("on_write",)

    def __init__(self, name: str, shape: tuple[int, ...], dtype: Any, on_write: Callable[[_Session, Any], None]) -> None:
        super().__init__(local_strategy(), name, None, shape, np.dtype(dtype), False, VariableSynchronization.ON_WRITE,
                         VariableAggregation.NONE, False)
        self.on_write = on_write

    @property
    def storage(self) -> Any:
        return self.distribute_strategy.engine.store_variable(np.zeros(self.shape, self.dtype))

    @storage.setter
    def storage(self, value: Any) -> None:
        self.on_write(_session("a Keras optimizer"), value)


def _grad_slot(b: _Binding) -> _Slot:
    if b.slot is None:
        def record(s: _Session, value: Any) -> None:
            s.grads[b] = value

        v = b.keras_variable
        b.slot = _Slot(f"keras-grad/{v.path}", tuple(v.shape), np.dtype(v.dtype), record)
    return b.slot


def _iteration_slot(optimizer: Any, ref: _OptimizerRef) -> _Slot:
    slot = _iteration_slots.get(id(optimizer))
    if slot is None:
        def record(s: _Session, value: Any) -> None:
            s.iterations[id(optimizer)] = (ref, value)

        slot = _iteration_slots[id(optimizer)] = _Slot(f"keras-steps/{ref.uid}", (), np.int32, record)
    return slot


# ---------------------------------------------------------------------------------------
# Optimizer and metric updates of the copies
# ---------------------------------------------------------------------------------------


def ps_apply(optimizer: Any, grads: list[Any], trainable_variables: Any, replica: Any) -> bool:
    """``optimizer.apply(grads, trainable_variables)`` for a worker copy of a PS-trained optimizer (the replicas'
    gradients summed by ``replica``, a replica context, when not None); False: ``optimizer`` is not one."""
    ref = _optimizer_bindings.get(id(optimizer))
    if ref is None:
        return False
    if trainable_variables is None:
        raise ConfigurationError(_NO_STATELESS_APPLY.format(name=optimizer.name))
    variables = list(trainable_variables)
    bound = [binding(v) for v in variables]
    for v, b in zip(variables, bound):
        if b is None or b.kind != "weight":
            raise ConfigurationError(
                f"Keras optimizer {optimizer.name!r} (trained under ParameterServerStrategy) is applied to "
                f"{getattr(v, 'path', v)!r}, which is not a trainable variable of the model the closure captured: "
                "apply it to zip(grads, model.trainable_variables)")
    pairs = [(g, b) for g, b in zip(grads, bound) if g is not None]
    if not pairs:
        return True
    values = [g for g, _ in pairs]
    if replica is not None:
        values = list(replica.all_reduce("sum", values))
    if ref.clipping:
        values = list(compat.clip_gradients(optimizer, values))
    if ctx_lib.current_frame() is None:  # eager, in the closure's body: push now
        updates: list[Any] = []
        for g, (_, b) in zip(values, pairs):
            assert b is not None
            updates.extend(gradient_updates(b.handle, np.asarray(g), broadcast=False))
        updates.extend(split_update(ref.iterations, Op.ASSIGN_ADD, np.ones((), np.int64)))
        push_updates(updates)
        return True
    _session("a Keras optimizer")
    for g, (_, b) in zip(values, pairs):
        assert b is not None
        slot = _grad_slot(b)
        slot.assign(slot.value() + jnp.asarray(g).astype(slot.dtype), read_value=False)
    steps = _iteration_slot(optimizer, ref)
    steps.assign(steps.value() + 1, read_value=False)
    return True


class _Trained:
    """A worker copy of a model trained by a PS optimizer: what its ``stateless_apply`` takes and returns."""

    __slots__ = ("model", "group", "count", "structure")

    def __init__(self, model: Any, group: _PullGroup, count: int) -> None:
        self.model = model
        self.group = group
        self.count = count  # the trainable variables: the group's first ``count``
        #: Shapes and dtypes of the optimizer's variables built for this model (made on first use).
        self.structure: list[tuple[tuple[int, ...], np.dtype[Any]]] | None = None

    @property
    def weights(self) -> list[_Binding]:
        out = [binding(v) for v in self.group.variables[:self.count]]
        assert all(b is not None for b in out)
        return out  # type: ignore[return-value]


_trained_lock = threading.Lock()
#: optimizer reference uid -> the worker copies of the models it trains (in this process).
_trained: dict[str, list[_Trained]] = {}
_done_slots: dict[int, _Slot] = {}
_key_slot: list[_Slot] = []


def _shape_of(x: Any) -> tuple[tuple[int, ...], str] | None:
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        return None
    return tuple(int(d) for d in shape), str(np.dtype(keras.backend.standardize_dtype(dtype)))


def _trained_model(optimizer: Any, ref: _OptimizerRef, trainable_variables: list[Any]) -> _Trained:
    """The captured model whose trainable variables ``trainable_variables`` are values of (checked)."""
    with _trained_lock:
        candidates = list(_trained.get(ref.uid, ()))
    given = [_shape_of(v) for v in trainable_variables]
    matching = [t for t in candidates if t.count == len(given) and all(
        g is not None and g[0] == tuple(b.keras_variable.shape) for g, b in zip(given, t.weights))]
    if len(matching) == 1:
        return matching[0]
    if not candidates:
        raise ConfigurationError(
            f"Keras optimizer {optimizer.name!r} (trained under ParameterServerStrategy) is called with "
            "stateless_apply in a closure that did not capture the model it trains: use the model in the same "
            "function (model.stateless_call(trainable_variables, non_trainable_variables, x))")
    expected = [tuple(b.keras_variable.shape) for b in candidates[0].weights]
    raise ConfigurationError(
        f"Keras optimizer {optimizer.name!r} (trained under ParameterServerStrategy): stateless_apply's "
        f"trainable_variables must be the values of the model's trainable variables, in model.trainable_variables "
        f"order ({len(expected)} arrays of shapes {expected}), got {len(given)} of shapes "
        f"{[g[0] if g is not None else type(v).__name__ for g, v in zip(given, trainable_variables)]}"
        + (f" ({len(matching)} captured models match: one optimizer, one model)" if len(matching) > 1 else ""))


def _optimizer_structure(ref: _OptimizerRef, trained: _Trained) -> list[tuple[tuple[int, ...], str]]:
    """What ``optimizer.variables`` holds once the optimizer is built for ``trained``'s model (as Keras's recipe
    builds it: ``optimizer.build(model.trainable_variables)``): a fresh copy built outside any trace."""
    if trained.structure is None:
        with ctx_lib.outside_frames(), compat.outside_stateless_scope(), jax.ensure_compile_time_eval():
            fresh = keras.optimizers.deserialize(ref.config)
            fresh.build([b.keras_variable for b in trained.weights])
            trained.structure = [(tuple(int(d) for d in v.shape), np.dtype(keras.backend.standardize_dtype(v.dtype)))
                                 for v in fresh.variables]
    return [(shape, str(dtype)) for shape, dtype in trained.structure]


def _check_optimizer_variables(optimizer: Any, ref: _OptimizerRef, trained: _Trained, given: Any) -> list[Any]:
    if given is None or isinstance(given, (str, bytes, dict)) or not hasattr(given, "__len__"):
        raise ConfigurationError(
            f"Keras optimizer {optimizer.name!r}: stateless_apply's optimizer_variables must be a list with one value "
            f"per optimizer variable ([v.value for v in optimizer.variables] once built), got {type(given).__name__}")
    given = list(given)
    expected = _optimizer_structure(ref, trained)
    got = [_shape_of(v) for v in given]
    if len(got) != len(expected) or any(g is None or g[0] != e[0] for g, e in zip(got, expected)):
        raise ConfigurationError(
            f"Keras optimizer {optimizer.name!r} (trained under ParameterServerStrategy): stateless_apply's "
            f"optimizer_variables are not this optimizer's variables for this model: expected {len(expected)} "
            f"values of shapes {[e[0] for e in expected]}, got {len(got)} of shapes "
            f"{[g[0] if g is not None else type(v).__name__ for g, v in zip(got, given)]}. Pass the variables of "
            "the same optimizer, built for the model it trains (optimizer.build(model.trainable_variables); "
            "[v.value for v in optimizer.variables]); their values are not read: the state lives on the parameter "
            "servers")
    return given


def _stateless_apply(optimizer: Any, ref: _OptimizerRef, optimizer_variables: Any, grads: Any,
                     trainable_variables: Any) -> tuple[list[Any], list[Any]]:
    """``optimizer.stateless_apply`` of a worker copy of a PS-trained optimizer (see the module docstring).

    The replicas' gradients are summed (as ``apply_gradients``), clipped as the optimizer says, and pushed with
    ``+1`` on the step counter right away (inside ``strategy.run``: from the compiled step, by a host callback,
    once for all replicas; the push carries the closure's identity, so a re-run closure applies it once); the PS
    applies the optimizer. Returns the values of the model's trainable variables the PS holds right after that push
    (read back from it: with other workers pushing, theirs applied before it are in them too) and
    ``optimizer_variables`` as given: the optimizer's state lives on the PS, so only their structure is checked."""
    if trainable_variables is None or grads is None:
        raise ConfigurationError(
            f"Keras optimizer {optimizer.name!r}: stateless_apply(optimizer_variables, grads, trainable_variables) "
            "needs the gradients and the trainable variables' values")
    values = list(trainable_variables)
    grads = list(grads)
    if len(grads) != len(values):
        raise ConfigurationError(f"Keras optimizer {optimizer.name!r}: stateless_apply got {len(grads)} gradients for "
                                 f"{len(values)} trainable variables")
    trained = _trained_model(optimizer, ref, values)
    optimizer_variables = _check_optimizer_variables(optimizer, ref, trained, optimizer_variables)
    weights = trained.weights
    present = [i for i, g in enumerate(grads) if g is not None]
    for i in present:
        if _shape_of(grads[i]) is None or _shape_of(grads[i])[0] != tuple(weights[i].keras_variable.shape):  # type: ignore[index]
            raise ConfigurationError(
                f"Keras optimizer {optimizer.name!r}: stateless_apply's gradient {i} has shape "
                f"{getattr(grads[i], 'shape', None)}, its variable {weights[i].keras_variable.path!r} "
                f"{tuple(weights[i].keras_variable.shape)}")
    summed = [grads[i] for i in present]
    replica = mesh_replica()
    if replica is not None and summed:
        summed = list(replica.all_reduce("sum", summed))
    if ref.clipping and summed:
        summed = list(compat.clip_gradients(optimizer, summed))
    push = functools.partial(_push_and_pull, ref, trained, present)
    if ctx_lib.current_frame() is None:  # eager, in the closure's body: push now, read back
        new = push([np.asarray(g) for g in summed])
        return [jnp.asarray(v) for v in new], optimizer_variables
    s = _session("a Keras optimizer")
    from jaxdist.ps_server.server import serving_in_this_process  # here: importing jaxdist.keras loads no PS code

    if serving_in_this_process():
        # The callback holds the step's XLA execution thread while the PS applies the push; a PS in this process
        # runs its optimizer step on the same XLA CPU client, which may have no thread left for it (over 2 local
        # devices it hung): refused rather than left to the thread pool's size.
        raise ConfigurationError(
            f"Keras optimizer {optimizer.name!r}: stateless_apply inside strategy.run needs the parameter servers in "
            "other processes (here a PS serves from this process, an in-process cluster, and its optimizer step "
            "could wait for the XLA threads the step holds). Run the PS tasks as processes "
            "(jaxdist.LocalCluster, `jaxdist ps`), or use optimizer.apply_gradients(zip(grads, "
            "model.trainable_variables)) inside strategy.run, or call stateless_apply in the closure's body")
    site = next(_call_sites)
    result_shapes = ([jax.ShapeDtypeStruct(tuple(b.keras_variable.shape), np.dtype(b.keras_variable.dtype))
                      for b in weights], jax.ShapeDtypeStruct((), np.int32))
    key = _key_variable().value()
    new, done = io_callback(functools.partial(_callback, site, push), result_shapes, key,
                            [jnp.asarray(g) for g in summed])
    slot = _done_slot(optimizer, ref)
    slot.assign(slot.value() + done, read_value=False)
    new = list(new)
    for b, v in zip(weights, new):
        s.returned[id(v)] = b
    return new, optimizer_variables


_call_sites = itertools.count()


def _push_and_pull(ref: _OptimizerRef, trained: _Trained, present: list[int], grads: list[np.ndarray]) -> list[np.ndarray]:
    """Push ``grads`` (of the weights at ``present``) and ``+1`` step; the model's trainable values after it."""
    weights = trained.weights
    updates: list[Any] = []
    for i, g in zip(present, grads):
        updates.extend(gradient_updates(weights[i].handle, np.asarray(g), broadcast=False))
    updates.extend(split_update(ref.iterations, Op.ASSIGN_ADD, np.ones((), np.int64)))
    push_updates(updates)
    return [np.asarray(v) for v in pull([b.handle for b in weights])]


def _callback(site: int, push: Callable[[list[np.ndarray]], list[np.ndarray]], key: Any,
              grads: list[Any]) -> tuple[list[np.ndarray], np.ndarray]:
    """The host side of one ``stateless_apply`` in a compiled step (XLA's thread, once per replica): the first
    replica to call back pushes, in a child of the closure's identity (so its place among the closure's pushes
    does not depend on threads); the others get the same values."""
    with _live_lock:
        s = _live.get(int(np.asarray(key)))
    if s is None:
        raise RuntimeError("jaxdist: a Keras stateless_apply callback ran outside its ParameterServerStrategy.run")
    with s.lock:
        got = s.applied.get(site)
        if got is None:
            grads = [np.asarray(g) for g in grads]
            if s.task is None or s.task.identity is None:
                got = push(grads)
            else:
                # Named by what it is, not by ``site`` (a trace-time count, another on another worker): the n-th
                # such push of a closure attempt has the same identity in a re-run, which the PS applies once.
                child = s.task.for_child("keras-stateless-apply")
                assert child.identity is not None
                child.identity.bind()
                with wctx.use(child):
                    got = push(grads)
            s.applied[site] = got
    return got, np.ones((), np.int32)


class _KeySlot(_Slot):
    """A step input that is the running session's key, read at each call (a callback finds its session by it)."""

    __slots__ = ()

    @property
    def storage(self) -> Any:
        return self.distribute_strategy.engine.store_variable(np.asarray(_session("a Keras optimizer").key, np.int32))

    @storage.setter
    def storage(self, value: Any) -> None:
        raise ConfigurationError("jaxdist's stateless_apply session key is not assignable")


def _key_variable() -> _Slot:
    with _trained_lock:
        if not _key_slot:
            _key_slot.append(_KeySlot("keras-stateless-key", (), np.int32, lambda s, v: None))
        return _key_slot[0]


def _done_slot(optimizer: Any, ref: _OptimizerRef) -> _Slot:
    slot = _done_slots.get(id(optimizer))
    if slot is None:
        def record(s: _Session, value: Any) -> None:
            s.applied_done = value

        slot = _done_slots[id(optimizer)] = _Slot(f"keras-stateless-done/{ref.uid}", (), np.int32, record)
    return slot


def _eager_metric_update(metric: Any, update_state: Callable[..., Any]) -> Callable[..., Any]:
    """A worker copy's ``update_state``: traced (inside strategy.run) as Keras's; called eagerly in the closure's
    body, its increments are pushed to the accumulators at once."""

    def ps_update_state(*args: Any, **kwargs: Any) -> Any:
        if compat.in_stateless_scope() or ctx_lib.current_frame() is not None:
            return update_state(*args, **kwargs)
        bound = [binding(v) for v in metric.variables]
        scope = keras.StatelessScope(state_mapping=[(v, jnp.asarray(b.init)) for v, b in zip(metric.variables, bound)
                                                    if b is not None])
        with scope:
            update_state(*args, **kwargs)
        updates: list[Any] = []
        for v, b in zip(metric.variables, bound):
            new = scope.get_current_value(v)
            if b is not None and new is not None:
                assert b.init is not None
                updates.extend(split_update(b.handle, Op.ASSIGN_ADD, np.asarray(new) - b.init))
        if updates:
            push_updates(updates)
        return None

    return ps_update_state


_install_lock = threading.Lock()
_installed = False


def install_ps_custom_loop_support() -> None:
    """Register the run hook and Keras's pickling of PS-scope objects (idempotent)."""
    global _installed
    with _install_lock:
        if _installed:
            return
        compat.install_pickle_patch(pickle_patch)
        register_run_hook(RUN_HOOK, _run_scope)
        _installed = True
