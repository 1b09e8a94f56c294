"""The closures a Keras ``fit``/``evaluate`` under ``ParameterServerStrategy`` runs on the workers.

Each closure object (:class:`TrainSteps`, :class:`EvalSteps`) is pickled once
per ``fit`` (it carries the model's JSON config, its compile config and the
PS variable handles, never weights). On a worker the Keras model is rebuilt
from that config once per model and worker (:func:`worker_model`), then
every step:

- pulls the model's variables from the PS (one call per PS task, in parallel;
  of a row-sparse embedding only the rows the batch looks up:
  :mod:`jaxdist.keras.ps_embedding`, the rows of every table in one more call
  per PS task: :func:`read_rows`);
- reads the rows of the batch's distinct keys of each
  :class:`jaxdist.keras.layers.DynamicEmbedding` from its dynamic table (one
  lookup per PS task holding keys), into the copy's compact table;
- runs Keras's own stateless step (``compute_loss_and_updates`` under
  ``jax.value_and_grad``, then Keras's metric update), jit-compiled once;
- training: pushes, in one atomic push per PS task, the gradients (applied
  by the PS's optimizer), the new non-trainable values (assigned) and ``+1``
  on the PS step counter. Inside a closure the push carries the closure's
  identity, so a closure re-run after a worker failure never applies a step
  twice, and the step counter counts each step exactly once. Before it, each
  dynamic table gets its gradient rows (one counted DynamicPush per PS task holding
  keys), with the closure's identity too.

A closure returns the Keras metric variables it accumulated over its steps
(starting from their reset values); the coordinator adds them up
(:mod:`jaxdist.keras.ps_fit`). The closure's result is kept once, whatever
re-runs happen, so metrics count each closure exactly once.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.cluster_coordinator.datasets import StepsPerExecution
from jaxdist.keras import compat
from jaxdist.proto.ps_wire import Op, PullSpec
from jaxdist.keras.ps_embedding import (
    DynamicKeys,
    DynamicSlot,
    Rows,
    SparseEmbedding,
    compact_batch,
    padded,
    with_compact_tables,
    with_input_dims,
)
from jaxdist.variables import SparseGradient, gradient_updates, pull, pull_specs, push_updates, split_update
from jaxdist.worker.context import current_worker_index

logger = logging.getLogger(__name__)

__all__ = ["ModelSpec", "TrainSteps", "EvalSteps", "SkipBatches", "RepeatingDataset", "predict", "predict_model",
           "worker_model"]


class ModelSpec:
    """What a worker needs to run a model's steps: its config and its PS variables (picklable, small)."""

    def __init__(self, uid: str, model_json: str, compile_config: dict[str, Any], trainable: list[Any],
                 non_trainable: list[Any], iterations: Any, metric_init: list[np.ndarray],
                 clipping: dict[str, float], sparse: list[SparseEmbedding], num_inputs: int,
                 dynamic: list[DynamicSlot] | None = None) -> None:
        self.uid = uid
        self.model_json = model_json
        self.compile_config = compile_config
        self.trainable = trainable
        self.non_trainable = non_trainable
        self.iterations = iterations
        self.metric_init = metric_init
        self.clipping = clipping
        #: Row-sparse Embedding layers (only looked-up rows move: :mod:`jaxdist.keras.ps_embedding`).
        self.sparse = sparse
        self.num_inputs = num_inputs
        #: DynamicEmbedding layers (rows looked up in, gradients pushed to, their dynamic tables).
        self.dynamic = list(dynamic or [])


class _WorkerModel:
    """A worker's copy of the model (built from the spec) and its jitted steps.

    ``dims`` (row-sparse and dynamic embeddings): the compact tables' row counts, one per
    :attr:`ModelSpec.sparse` layer (the copy's layers have that ``input_dim``), then one per
    :attr:`ModelSpec.dynamic` layer (the copy's DynamicEmbedding has a compact table of that many rows:
    a trainable variable the coordinator's model does not have, at :attr:`dynamic_index` among the
    copy's trainable variables).
    """

    def __init__(self, spec: ModelSpec, dims: tuple[int, ...] | None) -> None:
        import keras

        model = keras.models.model_from_json(_copy_json(spec, dims))
        config = dict(spec.compile_config)
        # The PS runs the optimizer; the worker's copy needs one without slots (Keras's loss computation
        # reads the optimizer's variables: its step and learning rate) that clips gradients as the user's does.
        config["optimizer"] = keras.optimizers.serialize(keras.optimizers.SGD(**spec.clipping))
        model.compile_from_config(config)
        self.model = model
        self.spec = spec
        self.lock = threading.Lock()
        self._built = False
        #: Where each dynamic layer's compact table is among the copy's trainable variables.
        self.dynamic_index: list[int] = []
        self._train = jax.jit(self._train_step)
        self._test = jax.jit(compat.stateless_test_step(model))

    def build(self, batch: Any) -> None:
        if self._built:
            return
        compat.symbolic_build(self.model, batch)
        m = self.model
        self.dynamic_index = _dynamic_index(m, self.spec)
        if (len(m.trainable_variables), len(m.non_trainable_variables), len(m.metrics_variables)) != (
                len(self.spec.trainable) + len(self.spec.dynamic), len(self.spec.non_trainable),
                len(self.spec.metric_init)):
            raise ConfigurationError(
                "the Keras model rebuilt on the worker from its config has other variables than the coordinator's "
                f"({len(m.trainable_variables)}/{len(m.non_trainable_variables)}/{len(m.metrics_variables)} "
                f"trainable/non-trainable/metric vs {len(self.spec.trainable)}/{len(self.spec.non_trainable)}/"
                f"{len(self.spec.metric_init)}): its layers must be serializable (get_config) and registered "
                "(keras.saving.register_keras_serializable) in a module the worker imports")
        self.opt_vars = [v.value for v in m.optimizer.variables]
        self._built = True

    def _train_step(self, trainable: Any, non_trainable: Any, metrics: Any, opt_vars: Any, data: Any) -> Any:
        m = self.model
        x, y, sw = compat.unpack_x_y_sample_weight(data)
        grad_fn = jax.value_and_grad(compat.loss_and_updates(m), has_aux=True)
        (_, aux), grads = grad_fn(trainable, non_trainable, metrics, x, y, sw, training=True, optimizer_variables=opt_vars)
        unscaled_loss, y_pred, non_trainable, metrics = aux
        _, metrics = compat.update_metrics_variables(m, metrics, unscaled_loss, x, y, y_pred, sw)
        return compat.clip_gradients(m.optimizer, grads), non_trainable, metrics

    def train(self, state: tuple[list[Any], list[Any]], metrics: list[Any], batch: Any) -> Any:
        return self._train(state[0], state[1], metrics, self.opt_vars, batch)

    def test(self, state: tuple[list[Any], list[Any]], metrics: list[Any], batch: Any) -> list[Any]:
        _, (_, _, metrics) = self._test((state[0], state[1], metrics), batch)
        return metrics


def _copy_json(spec: ModelSpec, dims: tuple[int, ...] | None) -> str:
    """The JSON of a copy of ``spec``'s model with compact tables of ``dims`` rows (see :class:`_WorkerModel`)."""
    model_json = spec.model_json
    if dims is not None:
        model_json = with_input_dims(model_json, {e.layer: d for e, d in zip(spec.sparse, dims)})
        if spec.dynamic:
            model_json = with_compact_tables(
                model_json, {d.layer: n for d, n in zip(spec.dynamic, dims[len(spec.sparse):])})
    return model_json


def _dynamic_index(model: Any, spec: ModelSpec) -> list[int]:
    """Where each dynamic layer's compact table is among ``model``'s (a built copy's) trainable variables."""
    if not spec.dynamic:
        return []
    by_name = {layer.name: layer for layer in compat.flatten_layers(model)}
    tables = [by_name[d.layer].embeddings for d in spec.dynamic]
    return [next(i for i, v in enumerate(model.trainable_variables) if v is t) for t in tables]


class _PredictModel:
    """A copy of the model for ``predict`` on the coordinator (compact tables of ``dims`` rows; not compiled):
    the forward pass only, jit-compiled once per size class."""

    def __init__(self, spec: ModelSpec, dims: tuple[int, ...] | None) -> None:
        import keras

        model = keras.models.model_from_json(_copy_json(spec, dims))
        if not model.built:
            raise ConfigurationError("predict under ParameterServerStrategy of a model with DynamicEmbedding layers "
                                     "needs a model built from keras.Input (a functional or Sequential model)")
        self.model = model
        self.dynamic_index = _dynamic_index(model, spec)
        self.lock = threading.Lock()
        self._predict = jax.jit(self._forward)

    def _forward(self, trainable: Any, non_trainable: Any, x: Any) -> Any:
        outputs, _ = self.model.stateless_call(trainable, non_trainable, x, training=False)
        return outputs

    def build(self, batch: Any) -> None:
        """Nothing to build: the copy is built from its inputs' declaration."""

    def predict(self, state: tuple[list[Any], list[Any]], x: Any) -> Any:
        return self._predict(state[0], state[1], x)


_models: dict[tuple[str, int, tuple[int, ...] | None], _WorkerModel] = {}
_predict_models: dict[tuple[str, tuple[int, ...] | None], _PredictModel] = {}
_models_lock = threading.Lock()


def worker_model(spec: ModelSpec, dims: tuple[int, ...] | None = None) -> _WorkerModel:
    """This worker's copy of ``spec``'s model (with compact tables of ``dims`` rows), built on first use
    (one per model, worker index and size class: in-process test clusters run several workers in one process)."""
    key = (spec.uid, current_worker_index(), dims)
    with _models_lock:
        wm = _models.get(key)
        if wm is None:
            wm = _WorkerModel(spec, dims)
            _models[key] = wm
        return wm


def predict_model(spec: ModelSpec, dims: tuple[int, ...] | None = None) -> _PredictModel:
    """The coordinator's copy of ``spec``'s model for ``predict`` (with compact tables of ``dims`` rows), made
    on first use."""
    key = (spec.uid, dims)
    with _models_lock:
        pm = _predict_models.get(key)
        if pm is None:
            pm = _predict_models[key] = _PredictModel(spec, dims)
        return pm


class _Step:
    """One batch on the worker: the model copy to run, the batch for it, the rows of its sparse tables and the
    keys of its dynamic tables. ``copy``: which copy of the model runs it (a worker's :func:`worker_model`, or
    :func:`predict_model` for ``predict`` on the coordinator)."""

    def __init__(self, spec: ModelSpec, batch: Any, copy: Any = None) -> None:
        copy = worker_model if copy is None else copy
        self.spec = spec
        self.rows: dict[int, Rows] = {}
        self.keys: list[DynamicKeys] = []
        if spec.sparse or spec.dynamic:
            x, y, sw = compat.unpack_x_y_sample_weight(batch)
            got = compact_batch(x, spec.sparse, spec.dynamic, spec.num_inputs)
            if got is not None:
                x, rows, self.keys = got
                self.rows = {e.trainable_index: r for e, r in zip(spec.sparse, rows)}
                self.model = copy(spec, tuple(r.size for r in rows) + tuple(k.size for k in self.keys))
                self.batch = compat.pack_x_y_sample_weight(x, y, sw)
                self.model.build(self.batch)
                return
        self.model = copy(spec)
        self.batch = batch
        self.model.build(batch)

    def dense_variables(self) -> list[Any]:
        """The variables pulled whole: trainable ones without rows, then the non-trainable ones."""
        return [v for i, v in enumerate(self.spec.trainable) if i not in self.rows] + self.spec.non_trainable

    def state(self, dense_values: list[Any]) -> tuple[list[Any], list[Any]]:
        """``(trainable, non_trainable)`` values of the model copy: the dense ones given, the sparse tables' rows
        and the dynamic tables' rows read now."""
        it = iter(dense_values)
        order = sorted(self.rows)
        read = dict(zip(order, read_rows([self.spec.trainable[i] for i in order], [self.rows[i] for i in order])))
        trainable = [next(it) if i not in read else read[i] for i in range(len(self.spec.trainable))]
        # The copy's compact dynamic tables, each at its place (ascending: each insert lands at its final index).
        for pos, rows in sorted(zip(self.model.dynamic_index, self.dynamic_rows()), key=lambda p: p[0]):
            trainable.insert(pos, rows)
        return trainable, list(it)

    def dynamic_rows(self) -> list[np.ndarray]:
        """Each dynamic table's rows of the step's distinct keys (a pure read), zero-padded to its compact size."""
        return [padded(d.table.lookup(k.distinct), k.size) for d, k in zip(self.spec.dynamic, self.keys)]

    def split_grads(self, grads: list[Any]) -> tuple[list[Any], list[np.ndarray]]:
        """The copy's gradients as ``(the coordinator model's trainable variables', the dynamic tables')``."""
        if not self.keys:
            return list(grads), []
        dyn = set(self.model.dynamic_index)
        return ([g for i, g in enumerate(grads) if i not in dyn],
                [np.asarray(grads[i]) for i in self.model.dynamic_index])

    def push_dynamic(self, grads: list[np.ndarray]) -> None:
        """Push each dynamic table's gradient rows, each distinct key once with its occurrence count (exactly
        once: the closure's identity, counted per table)."""
        for d, k, g in zip(self.spec.dynamic, self.keys, grads):
            keys, rows, counts = k.counted_grads(g)
            d.table.apply_gradients(keys, rows, counts=counts)

    def updates(self, grads: list[Any], non_trainable: list[Any]) -> list[Any]:
        """The step's pushes: gradients (row-sparse for the sparse tables), non-trainable values, step counter +1."""
        spec = self.spec
        out = []
        for i, (var, g) in enumerate(zip(spec.trainable, grads)):
            r = self.rows.get(i)
            grad = np.asarray(g) if r is None else SparseGradient(r.ids, np.asarray(g)[:len(r.ids)])
            out.extend(gradient_updates(var, grad, broadcast=False))
        for var, v in zip(spec.non_trainable, non_trainable):
            out.extend(split_update(var, Op.ASSIGN, np.asarray(v), broadcast=False))
        out.extend(split_update(spec.iterations, Op.ASSIGN_ADD, np.ones((), np.int64)))
        return out


def read_rows(tables: Sequence[Any], rows: Sequence[Rows]) -> list[np.ndarray]:
    """Each table's rows ``rows[k].ids`` (sorted, distinct), zero-padded to ``rows[k].size`` rows.

    One pull per PS task for all the tables together (a DLRM-shaped model looks up 26 tables a step:
    one round trip per table and shard was most of a step), each shard's rows received in place
    into its slice of the table's result. ``tables``: jaxdist Variables or ShardedVariables.

    Raises:
        IndexError: an id outside ``[0, rows of the table)`` (nothing is read).
    """
    by_ps: dict[int, list[PullSpec]] = defaultdict(list)
    outs: dict[int, list[np.ndarray | None]] = defaultdict(list)
    results = []
    conns = None
    for var, r in zip(tables, rows):
        ids = r.ids
        n_rows = int(var.shape[0])
        if ids.size and (ids[0] < 0 or ids[-1] >= n_rows):
            raise IndexError(f"row index out of range [0, {n_rows}) for {var.name!r}")
        out = np.zeros((r.size,) + tuple(var.shape[1:]), var.dtype)  # rows past len(ids): padding, never read
        shards = var.shards()
        cuts = np.searchsorted(ids, [first for _, first in shards] + [n_rows])
        for (shard, first), a, b in zip(shards, cuts[:-1], cuts[1:]):
            if a == b:
                continue
            conns = shard.connections()
            by_ps[shard.ps_index].append(PullSpec(shard.name, indices=ids[a:b] - first))
            outs[shard.ps_index].append(out[a:b])
        results.append(out)
    if conns is not None:
        got = pull_specs(conns, dict(by_ps), outs=dict(outs))
        for ps, dests in outs.items():
            for dest, (value, _version) in zip(dests, got[ps]):
                if value is not dest:  # received elsewhere (the transport could not write in place)
                    assert dest is not None and value is not None
                    dest[...] = value
    return results


def train(spec: ModelSpec, batches: Iterator[Any], steps: int) -> list[Any]:
    """``steps`` training steps on ``batches``; returns the metric state accumulated from the reset values."""
    metrics = list(spec.metric_init)
    for _ in range(steps):
        step = _Step(spec, next(batches))
        with step.model.lock:
            state = step.state(pull(step.dense_variables()))
            grads, non_trainable, metrics = step.model.train(state, metrics, step.batch)
            grads, dynamic_grads = step.split_grads(grads)
            # The dynamic tables first: a push they refuse (a typed error: NaN, the memory bound) changes nothing
            # there, and the step's other pushes are then not made either.
            step.push_dynamic(dynamic_grads)
            push_updates(step.updates(grads, non_trainable))
    return metrics


def evaluate(spec: ModelSpec, batches: Any) -> list[Any]:
    """Every batch ``batches`` holds (an exactly-once closure's); returns the metric state."""
    metrics = list(spec.metric_init)
    dense: dict[int, list[Any]] = {}  # evaluation changes no variable: each closure pulls the dense ones once
    while len(batches) > 0:
        step = _Step(spec, next(batches))
        key = len(step.rows)  # (the dynamic tables' rows are read per batch, by step.state)
        if key not in dense:
            dense[key] = pull(step.dense_variables())
        with step.model.lock:
            metrics = step.model.test(step.state(dense[key]), metrics, step.batch)
    return metrics


def predict(spec: ModelSpec, batches: Sequence[Any], progress: Any = None) -> list[Any]:
    """The model's outputs (numpy) for each batch of inputs ``batches`` (``predict`` on the coordinator of a model
    with DynamicEmbedding layers: their rows and the row-sparse tables' are read per batch, the dense variables
    once); ``progress(i)`` is called after batch ``i``."""
    import keras

    outs = []
    dense: dict[int, list[Any]] = {}
    for i, x in enumerate(batches):
        step = _Step(spec, (x,), copy=predict_model)
        key = len(step.rows)
        if key not in dense:
            dense[key] = pull(step.dense_variables())
        x_step, _, _ = compat.unpack_x_y_sample_weight(step.batch)
        with step.model.lock:
            out = step.model.predict(step.state(dense[key]), x_step)
        outs.append(keras.tree.map_structure(np.asarray, out))
        if progress is not None:
            progress(i)
    return outs


def _metrics_out(metrics: list[Any]) -> list[np.ndarray]:
    return [np.asarray(m) for m in metrics]


class TrainSteps:
    """``steps`` training steps on the worker's batches (one closure of ``fit``); returns the metric state."""

    def __init__(self, spec: ModelSpec, steps: int) -> None:
        self.spec = spec
        self.steps = steps
        self.__name__ = f"keras_train_x{steps}"
        self.__qualname__ = self.__name__

    def __call__(self, batches: Iterator[Any]) -> list[np.ndarray]:
        return _metrics_out(train(self.spec, batches, self.steps))


class SkipBatches:
    """Read ``count`` batches of the worker's training data and train none (a resumed ``fit``'s steps already
    trained before its backup: the data goes on where the interrupted run's did)."""

    def __init__(self, count: int) -> None:
        if count < 1:
            raise ValueError(f"SkipBatches: count must be >= 1, got {count}")
        self.count = int(count)
        self.__name__ = f"keras_skip_x{count}"
        self.__qualname__ = self.__name__

    def __call__(self, batches: Iterator[Any]) -> int:
        for _ in range(self.count):
            next(batches)
        return self.count


class EvalSteps(StepsPerExecution):
    """Up to ``steps`` evaluation batches of an exactly-once dataset (one closure of ``evaluate``).

    A :class:`StepsPerExecution`, so the coordinator's data ledger gives it
    ``steps`` batch positions (fewer at the end of the data); it evaluates
    exactly the batches it was given and returns the metric state.
    """

    def __init__(self, spec: ModelSpec, steps: int) -> None:
        super().__init__(self._unused, steps)
        self.spec = spec
        self.__name__ = f"keras_eval_x{steps}"
        self.__qualname__ = self.__name__

    @staticmethod
    def _unused(*args: Any) -> None:  # pragma: no cover - __call__ is overridden
        raise AssertionError("EvalSteps runs its own steps")

    def __call__(self, batches: Any) -> list[np.ndarray]:
        return _metrics_out(evaluate(self.spec, batches))


class RepeatingDataset:
    """The per-worker dataset of ``fit``: the user's iterable, re-iterated when a pass ends (TF's ``.repeat()``).

    ``fit`` schedules exactly ``steps_per_epoch`` steps per epoch, so the data
    must not run out: a pass that yields nothing (a one-shot generator
    already consumed) raises ConfigurationError.
    """

    def __init__(self, iterable: Any) -> None:
        self._iterable = iterable

    def __iter__(self) -> Iterator[Any]:
        while True:
            got = False
            for batch in self._iterable:
                got = True
                yield batch
            if not got:
                raise ConfigurationError(
                    "the per-worker dataset of fit() ran out: return a re-iterable (a list, a keras PyDataset-like "
                    "sequence, an object whose __iter__ starts a new pass) or an endless iterator from dataset_fn")


class RepeatingDatasetFn:
    """``dataset_fn`` whose result is wrapped in :class:`RepeatingDataset` (runs on the workers)."""

    def __init__(self, dataset_fn: Any) -> None:
        self.dataset_fn = dataset_fn

    def __call__(self, input_context: Any) -> RepeatingDataset:
        from jaxdist.keras.data import call_dataset_fn

        return RepeatingDataset(call_dataset_fn(self.dataset_fn, input_context))
