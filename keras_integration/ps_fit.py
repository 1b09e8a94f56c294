"""Keras ``fit``/``evaluate``/``predict`` of a model built in ``ParameterServerStrategy.scope()``.

As tf.keras did under ``ParameterServerStrategy`` (TF's rules):

- ``fit(x=DatasetCreator(dataset_fn) or dataset_fn, epochs=, steps_per_epoch=)``:
  ``steps_per_epoch`` is required; the input is a per-worker dataset function
  (numpy arrays ``fit(x, y, batch_size=)`` are accepted too, as tf.keras
  did: each worker reads its shard of the rows, reshuffled every pass, and
  ``steps_per_epoch`` defaults to one pass, ``ceil(rows / batch_size)``)
  (``ClusterCoordinator.create_per_worker_dataset``); each closure runs
  ``steps_per_execution`` (from ``compile``) training steps on a worker
  (:class:`jaxdist.keras.ps_worker.TrainSteps`). The model's variables live on
  the PS and its optimizer runs there (:mod:`jaxdist.keras.ps_model`). A
  worker that dies mid-``fit`` has its closures re-run elsewhere; each step is
  applied once (pushes carry the closure's identity), so an epoch applies
  exactly ``steps_per_epoch`` steps.
- ``evaluate(x, y, batch_size=)`` (arrays) or ``evaluate(DatasetCreator(fn), steps=N)``
  (``fn`` returns the whole evaluation set as a sequence of ``N`` batches):
  TF's exact inline evaluation: every batch is evaluated exactly once, also
  when workers die (jaxdist's exactly-once data ledger).
- ``predict``: on the coordinator, with the PS's current weights (Keras's own
  ``predict`` after :meth:`PSModel.sync`; a model with DynamicEmbedding layers
  runs a copy of the model per batch, with the batch's rows looked up).

Keras's own ``CallbackList`` (``History``, the progress bar, user callbacks)
runs on the coordinator. Metrics are exact: each closure returns the Keras
metric variables it accumulated (all of aggregation ``"sum"``), and the
coordinator adds them up (each closure's result is kept once, whatever
re-runs happen) and lets Keras compute ``result()`` from the sums. Batch-level
logs show the closures finished so far; epoch logs cover every step.
Callbacks see the PS's weights at epoch boundaries (``model`` is synced after
every epoch); mid-epoch they see the weights of the last sync. With
:func:`~jaxdist.keras.ps_model.epoch_end_sync` off, ``model`` is synced once,
when ``fit`` ends, and callbacks that read the weights at epoch ends are refused.

Each ``fit`` makes one per-worker training dataset (and one exactly-once
validation dataset), each ``evaluate`` one exactly-once dataset: per-worker
resources of the coordinator, kept on the workers (and rebuilt on a worker
that restarts) for the coordinator's lifetime, as every
``create_per_worker_dataset``.
"""

from __future__ import annotations

import collections
import functools
import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

import keras

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import InputContext
from jaxdist.keras import compat
from jaxdist.keras.data import DatasetCreator, call_dataset_fn
from jaxdist.keras.ps_embedding import dynamic_embeddings, renumber_dynamic_inputs
from jaxdist.keras.ps_model import PSModel, ps_model, ps_strategy_of, syncs_each_epoch
from jaxdist.keras.ps_worker import EvalSteps, RepeatingDatasetFn, SkipBatches, TrainSteps
from jaxdist.keras.ps_worker import predict as ps_predict
from jaxdist.keras.tensorboard import TensorBoard

logger = logging.getLogger(__name__)

__all__ = ["ArrayBatches", "FitControl", "ShardedArrays", "route"]

#: Closures kept in flight per worker: enough that a worker always has its next closures queued (it takes
#: several per call), few enough that batch-level logs trail the scheduled steps by little.
IN_FLIGHT_PER_WORKER = 8


class ArrayBatches:
    """Arrays cut into batches: ``len()`` batches, ``[i]`` the i-th ``(x, y[, sample_weight])`` (picklable)."""

    def __init__(self, x: Any, y: Any, sample_weight: Any, batch_size: int) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.x, self.y, self.sample_weight, self.batch_size = x, y, sample_weight, int(batch_size)
        self.n = len(keras.tree.flatten(x)[0])

    def __len__(self) -> int:
        return math.ceil(self.n / self.batch_size)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        sl = slice(i * self.batch_size, (i + 1) * self.batch_size)
        cut = functools.partial(keras.tree.map_structure, lambda a: np.asarray(a)[sl])
        out = (cut(self.x),) + (() if self.y is None else (cut(self.y),))
        if self.sample_weight is not None:
            out += (cut(self.sample_weight),)
        return out


class ShardedArrays:
    """``fit``'s per-worker dataset made from arrays (as tf.keras wrapped arrays in a DatasetCreator).

    Worker ``i`` of ``n`` takes rows ``i, i + n, ...``, reshuffled every pass
    when ``shuffle`` (seeded by worker and pass), in batches of
    ``batch_size``; the data travels with the closure's dataset function.
    """

    def __init__(self, x: Any, y: Any, sample_weight: Any, batch_size: int, shuffle: bool) -> None:
        self.data = ArrayBatches(x, y, sample_weight, batch_size)
        self.n = self.data.n
        self.batch_size = self.data.batch_size
        self.shuffle = shuffle
        self.rows = np.arange(self.n)
        self.seed = 0

    def batch(self, rows: np.ndarray) -> tuple[Any, ...]:
        d = self.data
        cut = functools.partial(keras.tree.map_structure, lambda a: np.asarray(a)[rows])
        out = (cut(d.x),) + (() if d.y is None else (cut(d.y),))
        return out + (() if d.sample_weight is None else (cut(d.sample_weight),))

    def batches_of(self, rows: np.ndarray) -> list[np.ndarray]:
        return [rows[i:i + self.batch_size] for i in range(0, len(rows), self.batch_size)]

    def __call__(self, input_context: Any) -> ShardedArrays:
        mine = ShardedArrays.__new__(ShardedArrays)
        mine.__dict__.update(self.__dict__)
        mine.rows = np.arange(self.n)[input_context.input_pipeline_id::input_context.num_input_pipelines]
        mine.seed = input_context.input_pipeline_id
        return mine

    def __iter__(self) -> Any:
        rows = self.rows
        if self.shuffle:
            rows = np.random.default_rng(self.seed).permutation(rows)
            self.seed += 1 << 20  # the next pass: another order
        for part in self.batches_of(rows):
            yield self.batch(part)


class FitControl:
    """A callback mixin whose two questions ``fit`` under ParameterServerStrategy asks (and only it).

    Closures run asynchronously: when ``on_train_batch_end`` is called, the
    steps just scheduled may not have been applied yet. A callback that needs
    the PS state to be exactly the steps so far (a backup) asks for a *quiet
    point*; a callback that restored a mid-epoch backup in ``on_train_begin``
    says how many steps of the first epoch were already trained.
    """

    def ps_resume_step(self) -> int:
        """Steps of the first epoch already trained (asked once, after ``on_train_begin``); 0: none."""
        return 0

    def ps_wants_quiet_point(self, epoch: int, steps_done: int) -> bool:
        """Whether ``on_train_batch_end`` after ``steps_done`` steps of ``epoch`` needs every scheduled step
        applied (and its metrics counted) first: ``fit`` then waits for them before calling it."""
        return False


def _resume_step(controls: list[FitControl], steps_per_epoch: int) -> int:
    asked = {cb.ps_resume_step() for cb in controls} - {0}
    if len(asked) > 1:
        raise ConfigurationError(f"fit: callbacks resume the first epoch at different steps {sorted(asked)}")
    step = asked.pop() if asked else 0
    if not 0 <= step <= steps_per_epoch:  # all of them: killed between the last step's backup and the epoch's end
        raise ConfigurationError(f"fit: a callback resumes at step {step} of an epoch of {steps_per_epoch} steps "
                                 "(steps_per_epoch changed since the backup?)")
    return step


def _refuse_coordinator_only_restores(callbacks: Any) -> None:
    for cb in callbacks or ():
        if type(cb) is keras.callbacks.BackupAndRestore:  # exactly Keras's: it restores the coordinator's copy only
            raise ConfigurationError(
                "keras.callbacks.BackupAndRestore restores the coordinator's copy of the weights, not the parameter "
                "servers' variables and optimizer state: use jaxdist.keras.BackupAndRestore (same arguments)")


def _refuse_keras_saves(callbacks: Any) -> None:
    """Before any step: a Keras ModelCheckpoint would fail at its first save (DynamicEmbedding's table has no Keras
    weights to write), after training an epoch."""
    for cb in callbacks or ():
        if isinstance(cb, keras.callbacks.ModelCheckpoint):
            raise ConfigurationError(
                f"{type(cb).__name__} saves Keras weights, and this model's jaxdist.keras.layers.DynamicEmbedding "
                "tables live on the parameter servers, not in them: back up with jaxdist.keras.BackupAndRestore (or "
                "jaxdist.Checkpoint(strategy)), which save and restore the tables with the model's variables")


def _refuse_epoch_end_readers(callbacks: Any) -> None:
    """Before any step, under ``epoch_end_sync(model, False)``: the callbacks that read the coordinator's weights
    at epoch ends would see the last pull's, silently."""
    for cb in callbacks or ():
        why = None
        if isinstance(cb, keras.callbacks.ModelCheckpoint):
            why = "saves the weights at epoch ends"
        elif isinstance(cb, keras.callbacks.EarlyStopping) and getattr(cb, "restore_best_weights", False):
            why = "keeps the best epoch's weights (restore_best_weights=True)"
        elif getattr(cb, "histogram_freq", 0) and isinstance(cb, (keras.callbacks.TensorBoard, TensorBoard)):
            why = "writes weight histograms at epoch ends (histogram_freq)"
        if why is not None:
            raise ConfigurationError(
                f"{type(cb).__name__} {why}, and jaxdist.keras.epoch_end_sync(model, False) leaves the coordinator's "
                "weights at the last pull until fit ends: keep the epoch-end pull (epoch_end_sync(model, True)), or "
                "back up with jaxdist.keras.BackupAndRestore, which reads the parameter servers")


def _is_arrays(x: Any) -> bool:
    leaves = keras.tree.flatten(x) if isinstance(x, (list, tuple, dict)) else [x]
    return bool(leaves) and all(hasattr(a, "shape") and hasattr(a, "__array__") for a in leaves)


class _Sequence:
    """The exactly-once evaluation dataset function: the same batch sequence on every worker."""

    def __init__(self, source: Any) -> None:
        self.source = source

    def __call__(self, input_context: Any = None) -> Any:
        if isinstance(self.source, ArrayBatches):
            return self.source
        data = call_dataset_fn(self.source, input_context)
        if not (hasattr(data, "__len__") and hasattr(data, "__getitem__")):
            raise ConfigurationError("evaluate() under ParameterServerStrategy: dataset_fn must return the whole "
                                     f"evaluation set as a sequence of batches (len() and [i]), got {type(data).__name__}")
        return data


class _Metrics:
    """The sum of the closures' Keras metric states; Keras computes the logs from it.

    The sum starts from ``start`` (default ``init``, the reset values): a resumed
    epoch starts from the metric state its backup held.
    """

    def __init__(self, model: Any, init: list[np.ndarray], start: list[np.ndarray] | None = None) -> None:
        self.model = model
        self.init = init
        self.total = [np.array(a, dtype=np.float64 if np.issubdtype(a.dtype, np.floating) else a.dtype)
                      for a in (init if start is None else start)]
        self.closures = 0
        self._logs: dict[str, Any] | None = None

    def add(self, state: list[np.ndarray]) -> None:
        for t, s, i in zip(self.total, state, self.init):
            t += np.asarray(s) - i
        self.closures += 1
        self._logs = None

    def logs(self) -> dict[str, Any]:
        """Keras's metric results of the sums so far (recomputed only when a closure was added since)."""
        if self._logs is None:
            for v, t in zip(self.model.metrics_variables, self.total):
                v.assign(t.astype(v.dtype))
            self._logs = {k: float(np.asarray(r)) if np.ndim(r) == 0 else np.asarray(r)
                          for k, r in self.model.get_metrics_result().items()}
        return dict(self._logs)


class _InFlight:
    """Closures scheduled and not yet folded into the metrics; at most ``limit`` at a time."""

    def __init__(self, metrics: _Metrics, limit: int) -> None:
        self.metrics = metrics
        self.limit = max(1, limit)
        self.pending: collections.deque[Any] = collections.deque()

    def add(self, rv: Any) -> None:
        self.pending.append(rv)
        while len(self.pending) >= self.limit:
            self.metrics.add(self.pending.popleft().fetch())
        self.collect()

    def collect(self) -> None:
        while self.pending and self.pending[0].done():
            self.metrics.add(self.pending.popleft().fetch())

    def drain(self) -> None:
        while self.pending:
            self.metrics.add(self.pending.popleft().fetch())


def _coordinator(strategy: Any) -> Any:
    """The strategy's ClusterCoordinator (one is made, and kept for later calls, when it has none: as TF)."""
    coord = strategy.coordinator
    if coord is None:
        from jaxdist.cluster_coordinator import ClusterCoordinator

        coord = ClusterCoordinator(strategy)
    return coord


def _dataset_fn(x: Any, what: str) -> Callable[..., Any]:
    if isinstance(x, DatasetCreator):
        return x.dataset_fn
    if callable(x) and not hasattr(x, "shape"):
        return x
    raise ConfigurationError(
        f"{what} under ParameterServerStrategy takes a per-worker dataset function: "
        "jaxdist.keras.DatasetCreator(dataset_fn) (or dataset_fn itself), TF's rule; "
        f"got {type(x).__name__}")


def _check_metric_aggregation(model: Any) -> None:
    for v in model.metrics_variables:
        if getattr(v, "aggregation", "sum") != "sum":
            raise NotImplementedError(
                f"metric variable {v.path} has aggregation {v.aggregation!r}: under ParameterServerStrategy the "
                "workers' metric states are added up, which needs aggregation='sum' (Keras's default for metrics)")


def _build(model: Any, batch: Any) -> PSModel:
    """Build the model, its compiled loss and metrics from one batch (as Keras's fit does), then its PS state."""
    if model.built and dynamic_embeddings(model):
        _build_compiled(model, renumber_dynamic_inputs(model, batch))
    else:
        compat.symbolic_build(model, batch)
    _check_metric_aggregation(model)
    pm = ps_model(model)
    assert pm is not None
    if pm.optimizer is not model.optimizer:
        raise ConfigurationError(
            f"Keras model {model.name!r} has its variables on the parameter servers with optimizer "
            f"{pm.optimizer.name!r} (a custom loop in closures made them): fit/evaluate it compiled with that optimizer")
    return pm


def _build_compiled(model: Any, batch: Any) -> None:
    """Build a built model's compiled loss and metrics (and its optimizer) from one batch, as Keras's fit does
    first, without calling the model: its predictions are stood in for by zeros of its outputs' shapes.

    For models with DynamicEmbedding layers, whose declared inputs may be strings (no JAX array holds them: the
    workers renumber the keys before the model sees them, which Keras's own symbolic build cannot). The metric
    states this leaves are reset (:meth:`PSModel.spec` resets them before they travel).
    """
    x, y, sample_weight = compat.unpack_x_y_sample_weight(batch)
    rows = len(keras.tree.flatten(y)[0]) if y is not None else len(keras.tree.flatten(x)[0])
    outs = [np.zeros((rows,) + tuple(t.shape[1:]), dtype=t.dtype) for t in model.outputs]
    y_pred = outs[0] if len(outs) == 1 else outs
    model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False)
    model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    model.reset_metrics()
    if model.optimizer is not None and not model.optimizer.built:
        model.optimizer.build(model.trainable_variables)


def _steps_per_execution(model: Any) -> int:
    return max(1, int(getattr(model, "steps_per_execution", 1) or 1))


def _refuse(name: str, value: Any, default: Any, why: str) -> None:
    if value is default:
        return
    scalar = isinstance(value, (bool, int, float, str))
    if default is not None and scalar and value == default:
        return
    shown = repr(value) if scalar else f"<{type(value).__name__}>"
    raise ValueError(f"{name}={shown} is not supported under ParameterServerStrategy: {why}")


def fit(model: Any, x: Any = None, y: Any = None, batch_size: Any = None, epochs: int = 1, verbose: Any = "auto",
        callbacks: Any = None, validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True,
        class_weight: Any = None, sample_weight: Any = None, initial_epoch: int = 0, steps_per_epoch: int | None = None,
        validation_steps: int | None = None, validation_batch_size: int | None = None,
        validation_freq: int = 1) -> Any:
    """Keras's ``fit`` under ParameterServerStrategy (see the module docstring); returns the History."""
    if _is_arrays(x):
        data = ShardedArrays(x, y, sample_weight, 32 if batch_size is None else batch_size, bool(shuffle))
        fn: Callable[..., Any] = data
        if steps_per_epoch is None:
            steps_per_epoch = len(data.batches_of(np.arange(data.n)))
        first_batch = data.batch(np.arange(min(data.n, data.batch_size)))
    else:
        fn = _dataset_fn(x, "fit")
        if steps_per_epoch is None:
            raise ValueError("fit(DatasetCreator) under ParameterServerStrategy needs steps_per_epoch (TF's rule: "
                             "the per-worker datasets repeat, so an epoch is a number of steps)")
        for name, value, why in (("y", y, "the dataset_fn's batches carry the targets"),
                                 ("batch_size", batch_size, "dataset_fn batches its data"),
                                 ("sample_weight", sample_weight, "put sample weights in the dataset_fn's batches")):
            _refuse(name, value, None, why)
        _refuse("shuffle", shuffle, True, "shuffling is dataset_fn's job")
        first_batch = None
    _refuse("class_weight", class_weight, None, "weight the samples (sample_weight)")
    _refuse("validation_split", validation_split, 0.0, "pass validation_data")
    _refuse_coordinator_only_restores(callbacks)
    epoch_sync = syncs_each_epoch(model)
    if not epoch_sync:
        _refuse_epoch_end_readers(callbacks)
    strategy = ps_strategy_of(model)
    coord = _coordinator(strategy)
    if first_batch is None:
        first_batch = next(iter(call_dataset_fn(fn, InputContext(max(1, coord.num_workers), 0, 1))))
    pm = _build(model, first_batch)
    if pm.dynamic:
        _refuse_keras_saves(callbacks)
    spec = pm.spec()
    spe = _steps_per_execution(model)
    fns = {k: TrainSteps(spec, k) for k in {spe, steps_per_epoch % spe} if k}
    it = iter(coord.create_per_worker_dataset(RepeatingDatasetFn(fn)))
    val_it = None
    if validation_data is not None:
        vx, vy, vsw = _validation_args(validation_data)
        vsource, val_batches, _ = _eval_source(vx, vy, vsw, validation_batch_size, validation_steps)
        runs = sum(compat.should_eval(model, e, validation_freq) for e in range(initial_epoch, epochs))
        # One exactly-once dataset for every validation of this fit (its ledger runs one pass per validation).
        val_it = iter(coord.create_per_worker_dataset(_Sequence(vsource), exactly_once=True, num_batches=val_batches,
                                                      epochs=max(1, runs)))
    verbose = 1 if verbose == "auto" else verbose
    cbs = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0, verbose=verbose,
                                       epochs=epochs, steps=steps_per_epoch, model=model)
    model.stop_training = False
    cbs.on_train_begin()
    # As Keras's fit: a callback (BackupAndRestore) may have moved the first epoch in on_train_begin.
    initial_epoch = compat.initial_epoch(model) or initial_epoch
    controls = [cb for cb in cbs.callbacks if isinstance(cb, FitControl)]
    step = _resume_step(controls, steps_per_epoch)
    if step:
        # The resumed epoch's first steps were trained before the backup: their batches are read, not trained
        # (with one worker, or batches that do not depend on which worker reads them, the data then goes on
        # exactly as in an uninterrupted run).
        coord.schedule(SkipBatches(step), args=(it,))
    training_logs: dict[str, Any] | None = None
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        cbs.on_epoch_begin(epoch)
        # Keras's metric variables as on_epoch_begin left them: the reset values, or a resumed epoch's partial sums.
        metrics = _Metrics(model, spec.metric_init, start=[np.asarray(v.value) for v in model.metrics_variables])
        inflight = _InFlight(metrics, IN_FLIGHT_PER_WORKER * max(1, coord.active_workers))
        while step < steps_per_epoch:
            k = min(spe, steps_per_epoch - step)
            cbs.on_train_batch_begin(step)
            inflight.add(coord.schedule(fns[k], args=(it,)))
            step += k
            if any(c.ps_wants_quiet_point(epoch, step) for c in controls):
                coord.join()
                inflight.drain()
            cbs.on_train_batch_end(step - 1, metrics.logs())
            if model.stop_training:
                break
        coord.join()
        inflight.drain()
        pm.check_learning_rate()
        if epoch_sync:
            pm.sync()
        epoch_logs = metrics.logs()
        if val_it is not None and compat.should_eval(model, epoch, validation_freq):
            val = _run_evaluation(model, coord, pm, val_it, val_batches, 0, None)
            epoch_logs.update({f"val_{k}": v for k, v in val.items()})
        cbs.on_epoch_end(epoch, epoch_logs)
        training_logs = epoch_logs
        step = 0
        if model.stop_training:
            break
    if not epoch_sync and training_logs is not None:
        pm.sync()  # the trained weights, once (epoch_end_sync(model, False))
    cbs.on_train_end(logs=training_logs)
    return model.history


def _validation_args(validation_data: Any) -> tuple[Any, ...]:
    if isinstance(validation_data, (tuple, list)):
        return tuple(validation_data) + (None,) * (3 - len(validation_data))
    return (validation_data, None, None)


def _eval_source(x: Any, y: Any, sample_weight: Any, batch_size: int | None, steps: int | None) -> tuple[Any, int, Any]:
    """``(dataset source, number of batches, first batch)`` of evaluate's input."""
    if isinstance(x, DatasetCreator) or (callable(x) and not hasattr(x, "shape")):
        for name, value in (("y", y), ("sample_weight", sample_weight), ("batch_size", batch_size)):
            _refuse(name, value, None, "dataset_fn's batches carry them")
        if steps is None:
            raise ValueError("evaluate(DatasetCreator) under ParameterServerStrategy needs steps= (the number of "
                             "batches of the evaluation set, each evaluated exactly once)")
        source: Any = _dataset_fn(x, "evaluate")
        first = _Sequence(source)(InputContext(1, 0, 1))
        if len(first) < int(steps):
            raise ValueError(f"evaluate(steps={steps}): dataset_fn's sequence has only {len(first)} batches")
        return source, int(steps), first[0]
    if x is None:
        raise ValueError("evaluate() needs x")
    source = ArrayBatches(x, y, sample_weight, 32 if batch_size is None else batch_size)
    return source, len(source) if steps is None else min(int(steps), len(source)), source[0]


def evaluate(model: Any, x: Any = None, y: Any = None, batch_size: int | None = None, verbose: Any = "auto",
             sample_weight: Any = None, steps: int | None = None, callbacks: Any = None, return_dict: bool = False,
             **kwargs: Any) -> Any:
    """Keras's ``evaluate`` under ParameterServerStrategy: every batch exactly once (see the module docstring)."""
    if kwargs:
        raise ValueError(f"evaluate() under ParameterServerStrategy does not take {sorted(kwargs)}")
    source, num_batches, first_batch = _eval_source(x, y, sample_weight, batch_size, steps)
    coord = _coordinator(ps_strategy_of(model))
    pm = _build(model, first_batch)
    it = iter(coord.create_per_worker_dataset(_Sequence(source), exactly_once=True, num_batches=num_batches))
    logs = _run_evaluation(model, coord, pm, it, num_batches, verbose, callbacks)
    return logs if return_dict else compat.flatten_metrics_in_order(model, logs)


def _run_evaluation(model: Any, coord: Any, pm: PSModel, it: Any, num_batches: int, verbose: Any,
                    callbacks: Any) -> dict[str, Any]:
    """One pass over ``num_batches`` batches of exactly-once iterator ``it``; returns the logs."""
    spec = pm.spec()
    spe = _steps_per_execution(model)
    # The pass's last closure takes only the batches left: a closure of `spe` steps would take
    # `spe` ledger positions, past the end of this pass and into the next one (fit validates
    # every epoch from one exactly-once dataset whose ledger runs one pass per validation).
    step_fns = {k: EvalSteps(spec, k) for k in {spe, num_batches % spe} if k}
    verbose = 1 if verbose == "auto" else verbose
    cbs = keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
                                       steps=num_batches, model=model)
    model.reset_metrics()
    metrics = _Metrics(model, spec.metric_init)
    inflight = _InFlight(metrics, IN_FLIGHT_PER_WORKER * max(1, coord.active_workers))
    cbs.on_test_begin()
    for begin in range(0, num_batches, spe):
        cbs.on_test_batch_begin(begin)
        inflight.add(coord.schedule(step_fns[min(spe, num_batches - begin)], args=(it,)))
        cbs.on_test_batch_end(min(begin + spe, num_batches) - 1, metrics.logs())
    coord.join()
    inflight.drain()
    logs = metrics.logs()
    cbs.on_test_end(logs)
    return logs


def predict(model: Any, method: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Keras's own ``predict`` on the coordinator, with the PS's current weights (a model with DynamicEmbedding
    layers: :func:`_predict_dynamic`)."""
    pm = ps_model(model)
    if pm is not None and pm.dynamic:
        return _predict_dynamic(model, pm, *args, **kwargs)
    if pm is not None:
        pm.sync()
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        return method(model, *args, **kwargs)
    finally:
        keras.distribution.set_distribution(previous)


def _predict_dynamic(model: Any, pm: PSModel, x: Any, batch_size: int | None = None, verbose: Any = "auto",
                     steps: int | None = None, callbacks: Any = None) -> Any:
    """``predict`` of a model with DynamicEmbedding layers, on the coordinator: each batch's keys are looked up
    in their tables (a pure read: keys not admitted read the default vector, admitted keys without a row their
    initializer row), the other variables are the PS's current values. Arrays only; ``verbose`` shows a
    progress bar (Keras's ``Progbar``) per batch."""
    if not _is_arrays(x):
        raise ValueError("predict under ParameterServerStrategy of a model with DynamicEmbedding layers takes arrays "
                         f"(one per model input), not {type(x).__name__}")
    _refuse("callbacks", callbacks, None, "predict of a model with DynamicEmbedding layers runs no callbacks")
    data = ArrayBatches(x, None, None, 32 if batch_size is None else batch_size)
    count = len(data) if steps is None else min(int(steps), len(data))
    bar = keras.utils.Progbar(count) if verbose not in (0, "0") else None
    outs = ps_predict(pm.spec(), [data[i][0] for i in range(count)],
                      progress=None if bar is None else (lambda i: bar.update(i + 1)))
    return keras.tree.map_structure(lambda *parts: np.concatenate(parts), *outs)


def route(model: Any, name: str, method: Callable[..., Any]) -> Callable[..., Any] | None:
    """The PS implementation of Keras entry point ``name`` for ``model`` (None: not a PS model)."""
    strategy = ps_strategy_of(model)
    if strategy is None:
        return None
    if name in ("fit", "evaluate"):
        run = fit if name == "fit" else evaluate

        def under_strategy(*args: Any, **kwargs: Any) -> Any:
            # As for the synchronous strategies, fit/evaluate run with the model's strategy current, also when
            # called outside its scope (callbacks ask keras.distribution.distribution() which strategy trains).
            from jaxdist.keras.scope import distribution_for

            with distribution_for(strategy).scope():
                return run(model, *args, **kwargs)

        return under_strategy
    if name == "predict":
        return functools.partial(predict, model, method)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"{name} under ParameterServerStrategy is not supported: use fit/evaluate (closures on the workers) "
            "or predict (on the coordinator)")

    return refuse
