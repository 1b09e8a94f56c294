"""``jaxdist.metrics``: Keras-style metric objects that aggregate exactly across replicas and processes.

Create them in ``strategy.scope()``, call ``update_state`` inside
``strategy.run`` (or anywhere: outside ``run`` it updates them eagerly) and
read ``result()`` in cross-replica context::

    with strategy.scope():
        train_accuracy = jaxdist.metrics.SparseCategoricalAccuracy()

    def train_step(batch):
        ...
        train_accuracy.update_state(labels, logits)

    print(float(train_accuracy.result())); train_accuracy.reset_state()

Each metric keeps its accumulators (totals, counts, confusion counts) in
sync-on-read variables (``synchronization=ON_READ, aggregation=SUM``): every
replica adds into its own part inside the compiled step, with no
communication, and ``result()`` sums the parts across all replicas of all
processes, then finishes the formula. The sums of counts are exact; so
accuracies and AUC's confusion counts are exact. In a multi-process job
``result()`` is a collective: every process must call it.

Rows that are padding of an uneven batch (TF's split of a short batch) are
left out by themselves, so a short last batch counts exactly its real rows.

**Under ParameterServerStrategy** (TF's PS tutorial makes its accuracy metric
in the strategy's scope): a metric made in ``ParameterServerStrategy.scope()``
keeps its accumulators as variables on the parameter servers, as TF does.
Closures call ``update_state`` on the worker (eagerly, in the closure's body:
the labels and predictions are computed there, by ``strategy.run`` or
otherwise); each update is a push of the totals' increments, which carries the
closure's identity, so a closure re-run after a worker failure counts its batch
once. ``result()`` and ``reset_state()`` run on the coordinator (or in a
closure) and read or zero the PS variables. ``update_state`` inside the PS
strategy's ``strategy.run`` (TF's ``replica_fn``, compiled over the worker's
devices) works too: each replica's increments leave the compiled step as
outputs, and their sum is pushed when ``run`` returns. Inside other compiled
code (``jax.jit``) it is refused with a
:class:`~jaxdist.errors.ConfigurationError`: a compiled function cannot push.

Why this module is ``coordinator/metrics.py`` (``jaxdist.metrics``) and not
under ``jaxdist.sync``: metric objects are a training-loop utility that works
under every strategy (the default strategy, OneDevice, the mesh strategies,
inside ``jaxdist.function``), as ``jaxdist.Checkpoint`` is; they only borrow
``jaxdist.sync``'s sync-on-read variables.
"""

from __future__ import annotations

import collections
import contextvars
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.strategy import ParameterServerStrategy
from jaxdist.sync import context as ctx_lib
from jaxdist.sync.programs import RUN_CACHE_SIZE, fn_key
from jaxdist.sync.variables import SyncVariable, VariableAggregation, VariableSynchronization, create_variable

logger = logging.getLogger(__name__)

__all__ = [
    "Metric",
    "Sum",
    "Mean",
    "Accuracy",
    "SparseCategoricalAccuracy",
    "SparseCategoricalCrossentropy",
    "AUC",
    "PSAccumulator",
]

#: Keras's backend epsilon: probabilities are clipped to [EPSILON, 1 - EPSILON] before their log.
EPSILON = 1e-7


class Metric:
    """Base class: accumulators in sync-on-read variables, ``update_state``/``result``/``reset_state``.

    Args:
        name: the metric's name (prefix of its variables' names).
        dtype: dtype of the result and float accumulators (default float32).
    """

    def __init__(self, name: str | None = None, dtype: Any = jnp.float32) -> None:
        self.name = name or _snake(type(self).__name__)
        self.dtype = jnp.dtype(dtype)
        self.strategy = ctx_lib.get_strategy()
        self._weights: list[Any] = []

    def add_weight(self, name: str, shape: Sequence[int] = (), dtype: Any = None) -> SyncVariable | PSAccumulator:
        """A zero-initialised accumulator (Keras's ``add_weight``): one part per replica, summed when
        read, under the synchronous strategies; a variable on a parameter server under
        ``ParameterServerStrategy`` (:class:`PSAccumulator`)."""
        if isinstance(self.strategy, ParameterServerStrategy):
            # "replace": a metric starts at zero, also when a PS still holds an earlier run's totals
            # under this name (a coordinator that restarted and made its metrics again).
            acc = PSAccumulator(self.strategy.create_variable(
                np.zeros(tuple(shape), dtype or self.dtype), name=f"metrics/{self.name}/{name}", trainable=False,
                if_exists="replace"))
            self._weights.append(acc)
            return acc
        v = create_variable(
            np.zeros(tuple(shape), dtype or self.dtype),
            name=f"metrics/{self.name}/{name}",
            trainable=False,
            synchronization=VariableSynchronization.ON_READ,
            aggregation=VariableAggregation.SUM,
            checkpoint=False,
            strategy=self.strategy,
        )
        self._weights.append(v)
        return v

    @property
    def variables(self) -> list[Any]:
        """The accumulators: :class:`SyncVariable` s, or :class:`PSAccumulator` s under parameter servers."""
        return list(self._weights)

    def update_state(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError

    def reset_state(self) -> None:
        """Zero every accumulator (call in cross-replica context, e.g. at the start of an epoch)."""
        for v in self._weights:
            v.assign(jnp.zeros(v.shape, v.dtype), read_value=False)

    def reset_states(self) -> None:
        """Keras 2's name of :meth:`reset_state` (TF's custom-training tutorial calls it)."""
        self.reset_state()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``update_state`` then ``result`` (Keras)."""
        self.update_state(*args, **kwargs)
        return self.result()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class PSAccumulator:
    """A metric accumulator held on a parameter server (a metric made in ``ParameterServerStrategy.scope()``).

    The part of the sync-on-read variable's interface that metrics use:
    ``assign_add``/``assign`` push (inside a closure with the closure's update
    identity: exactly once even when the closure is re-run), ``value()`` pulls.
    It pickles as its PS variable's handle, so closures carry the metric.
    """

    __slots__ = ("variable",)

    def __init__(self, variable: Any) -> None:
        self.variable = variable

    @property
    def name(self) -> str:
        return str(self.variable.name)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.variable.shape)

    @property
    def dtype(self) -> Any:
        return self.variable.dtype

    def _host(self, x: Any, what: str) -> np.ndarray:
        if isinstance(x, jax.core.Tracer) or ctx_lib.in_replica_fn():
            raise ConfigurationError(
                f"metric variable {self.name!r} lives on a parameter server (the metric was made in "
                "ParameterServerStrategy.scope()): it can be updated (update_state) in a closure's body or inside "
                f"the ParameterServerStrategy's own strategy.run, not inside other compiled code ({what}); return "
                "the labels and predictions from the compiled function and update the metric after it")
        return np.asarray(x, self.variable.dtype)

    def assign_add(self, delta: Any, read_value: bool = False) -> None:
        pending = _PENDING.get()
        if pending is not None and ctx_lib.in_replica_fn():
            # Inside the PS strategy's run: the increment leaves the compiled step as an output, and
            # run_with_ps_metrics pushes the sum over the replicas after it.
            pending.append((self, jnp.asarray(delta).astype(self.variable.dtype)))
            return
        self.variable.assign_add(self._host(delta, "assign_add"))

    def assign(self, value: Any, read_value: bool = False) -> None:
        self.variable.assign(self._host(value, "assign"))

    def value(self) -> Any:
        return jnp.asarray(self.variable.numpy())

    def numpy(self) -> np.ndarray:
        return np.asarray(self.variable.numpy())

    def __repr__(self) -> str:
        return f"PSAccumulator({self.variable!r})"


#: Set while a function run by :func:`run_with_ps_metrics` is traced: where PS accumulators record
#: the increments made inside it.
_PENDING: contextvars.ContextVar[list[tuple[PSAccumulator, Any]] | None] = contextvars.ContextVar(
    "jaxdist_ps_metric_updates", default=None)
#: Per function (by ``run``'s own key: code and captured values), its wrapper and what the wrapper's last
#: trace recorded. Bounded like the run cache; a function evicted here is wrapped (and traced) anew.
_WRAPPERS: collections.OrderedDict[Any, tuple[Callable[..., Any], dict[str, Any]]] = collections.OrderedDict()
_WRAPPERS_LOCK = threading.Lock()


def _wrapper_for(fn: Callable[..., Any]) -> tuple[Callable[..., Any], dict[str, Any]] | None:
    """``fn``'s wrapper (None: ``fn`` has no hashable key, so ``run`` cannot cache it either)."""
    key = fn_key(fn)
    try:
        hash(key)
    except TypeError:
        return None
    with _WRAPPERS_LOCK:
        hit = _WRAPPERS.get(key)
        if hit is not None:
            _WRAPPERS.move_to_end(key)
            return hit
    recorded: dict[str, Any] = {"accumulators": []}

    def with_metric_updates(*args: Any, **kwargs: Any) -> Any:
        pending: list[tuple[PSAccumulator, Any]] = []
        token = _PENDING.set(pending)
        try:
            out = fn(*args, **kwargs)
        finally:
            _PENDING.reset(token)
        # Runs when traced only: a cached program returns the increments of these same accumulators
        # (its key holds the function's captured values, the metrics among them, by identity).
        recorded["accumulators"] = [acc for acc, _ in pending]
        return out, tuple(delta for _, delta in pending)

    with_metric_updates.__name__ = str(getattr(fn, "__name__", "fn"))  # run's messages name the user's function
    with_metric_updates.__qualname__ = str(getattr(fn, "__qualname__", with_metric_updates.__name__))
    entry = (with_metric_updates, recorded)
    with _WRAPPERS_LOCK:
        _WRAPPERS[key] = entry
        while len(_WRAPPERS) > RUN_CACHE_SIZE:
            _WRAPPERS.popitem(last=False)
    return entry


def run_with_ps_metrics(local: Any, fn: Callable[..., Any], args: Sequence[Any], kwargs: Any, options: Any) -> Any:
    """``local.run(fn, ...)`` (the ParameterServerStrategy's ``run``: a MirroredStrategy over this
    process's devices) where ``fn`` may update metrics made under the PS strategy's scope, as in TF's
    PS tutorial: each replica's increments come out of the compiled step and their sum is pushed to
    the PS once the step is done (inside a closure, with the closure's update identity)."""
    entry = _wrapper_for(fn)
    if entry is None:
        return local.run(fn, args, kwargs, options)
    wrapper, recorded = entry
    out, deltas = local.run(wrapper, args, kwargs, options)
    for acc, delta in zip(recorded["accumulators"], deltas):
        acc.variable.assign_add(np.asarray(local.reduce("SUM", delta, axis=None), acc.variable.dtype))
    return out


def _snake(name: str) -> str:
    out = []
    for i, c in enumerate(name):
        if c.isupper() and i and not name[i - 1].isupper():
            out.append("_")
        out.append(c.lower())
    return "".join(out)


def _padding_mask(n: int, dtype: Any) -> Any:
    """1/0 per row when the current batch is uneven and has ``n`` padded rows (inside ``run``), else None."""
    rep = ctx_lib.get_replica_context()
    return rep.row_mask(n, dtype) if rep is not None else None


def _samplewise(values: Any, sample_weight: Any, dtype: Any) -> tuple[Any, Any]:
    """``(weighted values, weights)`` per sample, as Keras's ``reduce_to_samplewise_values``.

    ``total += sum(weighted)``, ``count += sum(weights)``. Values of rank > 1
    are averaged over their non-batch axes; padding rows of an uneven batch
    get weight 0.
    """
    v = jnp.asarray(values).astype(dtype)
    if v.ndim == 0:
        w = jnp.ones((), dtype) if sample_weight is None else jnp.asarray(sample_weight).astype(dtype)
        return v * w, w
    n = v.shape[0]
    w = jnp.ones((n,), dtype) if sample_weight is None else jnp.asarray(sample_weight).astype(dtype)
    if w.ndim == 0:
        w = jnp.broadcast_to(w, (n,))
    if w.ndim > v.ndim:
        raise ValueError(f"sample_weight of shape {w.shape} has a higher rank than the values {v.shape}")
    if v.ndim > w.ndim:
        v = jnp.mean(v, axis=tuple(range(w.ndim, v.ndim)))
    w = jnp.broadcast_to(w, v.shape)
    wv = v * w
    if wv.ndim > 1:
        wv = jnp.mean(wv, axis=tuple(range(1, wv.ndim)))
        w = jnp.mean(w, axis=tuple(range(1, w.ndim)))
    mask = _padding_mask(n, dtype)
    if mask is not None:
        wv, w = wv * mask, w * mask
    return wv, w


class Sum(Metric):
    """Weighted sum of values (``keras.metrics.Sum``)."""

    def __init__(self, name: str | None = "sum", dtype: Any = jnp.float32) -> None:
        super().__init__(name, dtype)
        self.total = self.add_weight("total")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        wv, _ = _samplewise(values, sample_weight, self.dtype)
        self.total.assign_add(jnp.sum(wv).astype(self.dtype), read_value=False)

    def result(self) -> Any:
        return self.total.value()


class Mean(Metric):
    """Weighted mean of values (``keras.metrics.Mean``): ``sum(v * w) / sum(w)``."""

    def __init__(self, name: str | None = "mean", dtype: Any = jnp.float32) -> None:
        super().__init__(name, dtype)
        self.total = self.add_weight("total")
        self.count = self.add_weight("count")

    def update_state(self, values: Any, sample_weight: Any = None) -> None:
        wv, w = _samplewise(values, sample_weight, self.dtype)
        self.total.assign_add(jnp.sum(wv).astype(self.dtype), read_value=False)
        self.count.assign_add(jnp.sum(w).astype(self.dtype), read_value=False)

    def result(self) -> Any:
        total, count = self.total.value(), self.count.value()
        return jnp.where(count == 0, jnp.zeros((), self.dtype), total / jnp.where(count == 0, 1, count))


class _MeanOf(Mean):
    """Mean of a per-example function of ``(y_true, y_pred)`` (Keras's ``MeanMetricWrapper``)."""

    def _per_example(self, y_true: Any, y_pred: Any) -> Any:
        raise NotImplementedError

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:  # type: ignore[override]
        super().update_state(self._per_example(jnp.asarray(y_true), jnp.asarray(y_pred)), sample_weight)


class Accuracy(_MeanOf):
    """How often predictions equal labels (``keras.metrics.Accuracy``)."""

    def __init__(self, name: str | None = "accuracy", dtype: Any = jnp.float32) -> None:
        super().__init__(name, dtype)

    def _per_example(self, y_true: Any, y_pred: Any) -> Any:
        if y_true.shape != y_pred.shape:
            y_pred = y_pred.reshape(y_true.shape)
        return (y_true == y_pred).astype(self.dtype)


class SparseCategoricalAccuracy(_MeanOf):
    """How often ``argmax(y_pred)`` equals the integer label (``keras.metrics.SparseCategoricalAccuracy``)."""

    def __init__(self, name: str | None = "sparse_categorical_accuracy", dtype: Any = jnp.float32) -> None:
        super().__init__(name, dtype)

    def _per_example(self, y_true: Any, y_pred: Any) -> Any:
        if y_true.ndim == y_pred.ndim and y_true.shape[-1] == 1:
            y_true = y_true[..., 0]
        return (jnp.argmax(y_pred, axis=-1) == y_true.astype(jnp.int32)).astype(self.dtype)


class SparseCategoricalCrossentropy(_MeanOf):
    """Mean cross-entropy of integer labels (``keras.metrics.SparseCategoricalCrossentropy``).

    Args:
        from_logits: ``y_pred`` are logits (else probabilities, normalised and
            clipped to ``[1e-7, 1 - 1e-7]`` as Keras does).
        axis: the class axis.
    """

    def __init__(
        self, name: str | None = "sparse_categorical_crossentropy", dtype: Any = jnp.float32, from_logits: bool = False, axis: int = -1
    ) -> None:
        super().__init__(name, dtype)
        self.from_logits = from_logits
        self.axis = axis

    def _per_example(self, y_true: Any, y_pred: Any) -> Any:
        if y_true.ndim == y_pred.ndim and y_true.shape[self.axis] == 1:
            y_true = jnp.squeeze(y_true, self.axis)
        y_pred = y_pred.astype(self.dtype)
        if self.from_logits:
            logp = jax.nn.log_softmax(y_pred, axis=self.axis)
        else:
            p = y_pred / jnp.sum(y_pred, axis=self.axis, keepdims=True)
            logp = jnp.log(jnp.clip(p, EPSILON, 1.0 - EPSILON))
        logp = jnp.moveaxis(logp, self.axis, -1)
        picked = jnp.take_along_axis(logp, y_true.astype(jnp.int32)[..., None], axis=-1)[..., 0]
        return -picked


class AUC(Metric):
    """Area under the ROC or PR curve (``keras.metrics.AUC``), from confusion counts at fixed thresholds.

    Args:
        num_thresholds: thresholds spread evenly in [0, 1] (with -eps and 1+eps at the ends), as Keras.
        curve: ``"ROC"`` or ``"PR"``.
        summation_method: ``"interpolation"`` (trapezoids; for PR, Davis and
            Goadrich's interpolation, as Keras), ``"minoring"`` or ``"majoring"``.
        thresholds: explicit thresholds in [0, 1] (overrides ``num_thresholds``).
        from_logits: apply a sigmoid to ``y_pred`` first.
        multi_label, num_labels, label_weights: per-label AUCs are not
            implemented: ``multi_label=True`` or ``label_weights`` raise
            (labels are flattened, as Keras's ``multi_label=False``).

    With ``thresholds`` at the distinct predicted scores, the ROC AUC equals
    the exact (trapezoidal) one, e.g. scikit-learn's ``roc_auc_score``.
    """

    def __init__(
        self,
        num_thresholds: int = 200,
        curve: str = "ROC",
        summation_method: str = "interpolation",
        name: str | None = "auc",
        dtype: Any = jnp.float32,
        thresholds: Sequence[float] | None = None,
        multi_label: bool = False,
        num_labels: int | None = None,
        label_weights: Any = None,
        from_logits: bool = False,
    ) -> None:
        if multi_label or label_weights is not None or num_labels is not None:
            raise NotImplementedError(
                "AUC(multi_label=True / num_labels / label_weights): per-label AUCs are not implemented in "
                "jaxdist.metrics; use one AUC per label, or multi_label=False (labels flattened)"
            )
        curve = curve.upper()
        summation_method = summation_method.lower()
        if curve not in ("ROC", "PR"):
            raise ValueError(f"curve must be 'ROC' or 'PR', got {curve!r}")
        if summation_method not in ("interpolation", "minoring", "majoring"):
            raise ValueError(f"summation_method must be interpolation/minoring/majoring, got {summation_method!r}")
        super().__init__(name, dtype)
        if thresholds is not None:
            inner = sorted(float(t) for t in thresholds)
        else:
            if num_thresholds <= 1:
                raise ValueError(f"num_thresholds must be > 1, got {num_thresholds}")
            inner = [(i + 1) * 1.0 / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        self.thresholds = np.asarray([0.0 - EPSILON, *inner, 1.0 + EPSILON], np.float32)
        self.num_thresholds = len(self.thresholds)
        self.curve, self.summation_method, self.from_logits = curve, summation_method, from_logits
        n = (self.num_thresholds,)
        self.true_positives = self.add_weight("true_positives", n)
        self.false_positives = self.add_weight("false_positives", n)
        self.true_negatives = self.add_weight("true_negatives", n)
        self.false_negatives = self.add_weight("false_negatives", n)

    def update_state(self, y_true: Any, y_pred: Any, sample_weight: Any = None) -> None:
        y_true = jnp.asarray(y_true)
        y_pred = jnp.asarray(y_pred).astype(jnp.float32)
        if self.from_logits:
            y_pred = jax.nn.sigmoid(y_pred)
        labels = y_true.reshape(y_true.shape[0], -1).astype(bool) if y_true.ndim else y_true.astype(bool)[None]
        preds = y_pred.reshape(labels.shape)
        w = jnp.ones(labels.shape[:1], self.dtype) if sample_weight is None else jnp.asarray(sample_weight).astype(self.dtype)
        if w.ndim == 0:
            w = jnp.broadcast_to(w, labels.shape[:1])
        w = w.reshape(labels.shape[:1] + (-1,)) if w.ndim > 1 else w[:, None]
        w = jnp.broadcast_to(w, labels.shape)
        mask = _padding_mask(labels.shape[0], self.dtype)
        if mask is not None:
            w = w * mask[:, None]
        pos = preds[..., None] > jnp.asarray(self.thresholds)  # (..., T)
        lab = labels[..., None]
        ww = w[..., None]
        axes = tuple(range(pos.ndim - 1))
        zero = jnp.zeros((), self.dtype)
        for var, sel in (
            (self.true_positives, pos & lab),
            (self.false_positives, pos & ~lab),
            (self.true_negatives, ~pos & ~lab),
            (self.false_negatives, ~pos & lab),
        ):
            var.assign_add(jnp.sum(jnp.where(sel, ww, zero), axis=axes).astype(self.dtype), read_value=False)

    def result(self) -> Any:
        tp, fp = self.true_positives.value(), self.false_positives.value()
        tn, fn = self.true_negatives.value(), self.false_negatives.value()
        return _auc(tp, fp, tn, fn, self.curve, self.summation_method)


def _div_no_nan(a: Any, b: Any) -> Any:
    return jnp.where(b == 0, jnp.zeros_like(a), a / jnp.where(b == 0, 1, b))


def _auc(tp: Any, fp: Any, tn: Any, fn: Any, curve: str, summation: str) -> Any:
    """Keras's AUC formula over confusion counts at increasing thresholds."""
    if curve == "PR" and summation == "interpolation":
        dtp = tp[:-1] - tp[1:]
        p = tp + fp
        dp = p[:-1] - p[1:]
        prec_slope = _div_no_nan(dtp, jnp.maximum(dp, 0))
        intercept = tp[1:] - prec_slope * p[1:]
        safe_p_ratio = jnp.where((p[:-1] > 0) & (p[1:] > 0), _div_no_nan(p[:-1], jnp.maximum(p[1:], 0)), jnp.ones_like(p[1:]))
        inc = _div_no_nan(prec_slope * (dtp + intercept * jnp.log(safe_p_ratio)), jnp.maximum(tp[1:] + fn[1:], 0))
        return jnp.sum(inc)
    recall = _div_no_nan(tp, tp + fn)
    if curve == "ROC":
        x, y = _div_no_nan(fp, fp + tn), recall
    else:
        x, y = recall, _div_no_nan(tp, tp + fp)
    if summation == "interpolation":
        heights = (y[:-1] + y[1:]) / 2.0
    elif summation == "minoring":
        heights = jnp.minimum(y[:-1], y[1:])
    else:
        heights = jnp.maximum(y[:-1], y[1:])
    return jnp.sum((x[:-1] - x[1:]) * heights)
