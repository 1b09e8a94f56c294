"""A Keras model under ``ParameterServerStrategy``: which models belong to it, and their variables on the PS.

- :class:`PSDistribution` is what ``ParameterServerStrategy.scope()`` makes
  current for Keras: it notes every Keras variable created in the scope, so
  a model built there belongs to the strategy (TF's rule: build and compile
  in the scope). Variables are made on the coordinator as usual; Keras's
  own data placement is never asked for (``fit``/``evaluate`` are jaxdist's,
  :mod:`jaxdist.keras.ps_fit`).
- :class:`PSModel` (one per model, made by :func:`ps_model` at the first
  ``fit``/``evaluate``) creates the model's variables on the PS: each
  trainable variable (in ``model.trainable_variables`` order, partitioned by
  the strategy's ``variable_partitioner``) with the Keras optimizer's rule as
  its PS-side optimizer (:mod:`jaxdist.keras.ps_optimizers`), each
  non-trainable one (seed state, BatchNormalization statistics: assigned by
  the workers' steps, last writer wins) and the step counter (``+1`` per
  applied step, exactly once). From then on the PS holds the model's state;
  :meth:`PSModel.sync` copies it into the coordinator's Keras variables
  (``get_weights``, ``save_weights``, ``predict``, ``optimizer.iterations``).
"""

from __future__ import annotations

import logging
import re
import threading
import uuid
import weakref
from typing import Any

import numpy as np

import keras
from keras.distribution import DeviceMesh, TensorLayout

from jaxdist.base.errors import ConfigurationError
from jaxdist.keras import compat
from jaxdist.keras.compat import Distribution
from jaxdist.keras.ps_embedding import DynamicSlot, dynamic_embeddings, sparse_embeddings
from jaxdist.keras.ps_optimizers import clipping_of, dynamic_row_rule, learning_rate_of, row_local, to_optax
from jaxdist.ps_server.optimizer import lazy_rows
from jaxdist.keras.ps_worker import ModelSpec
from jaxdist.variables import pull

logger = logging.getLogger(__name__)

__all__ = ["PSDistribution", "PSModel", "dynamic_tables", "epoch_end_sync", "lazy_embeddings", "syncs_each_epoch", "ps_model", "ps_model_with_optimizer", "ps_optimizers", "ps_strategy_of", "ps_variables",
           "sync_from_ps"]

_lock = threading.Lock()
#: Keras variables created in a PSDistribution's scope -> that distribution (by id; weak values).
_owned: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_owner: dict[int, PSDistribution] = {}
_models: weakref.WeakKeyDictionary[Any, PSModel] = weakref.WeakKeyDictionary()
#: Keras optimizers made in a PSDistribution's scope -> that distribution (a custom loop's model finds its optimizer).
_optimizers: weakref.WeakKeyDictionary[Any, PSDistribution] = weakref.WeakKeyDictionary()
#: Models whose embedding tables apply row gradients lazily (:func:`lazy_embeddings`).
_lazy: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
#: Models whose ``fit`` copies the PS's weights to the coordinator only when it ends (:func:`epoch_end_sync`).
_no_epoch_sync: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


class PSDistribution(Distribution):
    """Current inside ``ParameterServerStrategy.scope()`` once Keras is imported: notes the scope's variables."""

    def __init__(self, strategy: Any) -> None:
        import jax

        devices = np.array(jax.local_devices()[:1], dtype=object)
        super().__init__(DeviceMesh(shape=(1,), axis_names=["batch"], devices=devices), "batch", False)
        self._strategy = strategy

    @property
    def strategy(self) -> Any:
        return self._strategy

    @property
    def num_model_replicas(self) -> int:
        return 1

    def get_variable_layout(self, variable: Any) -> None:
        caller = compat.name_scope_caller()
        with _lock:
            _owned[id(variable)] = variable
            _owner[id(variable)] = self
            if isinstance(caller, keras.optimizers.Optimizer):  # the optimizer's own variables (its step counter)
                _optimizers[caller] = self
        weakref.finalize(variable, _owner.pop, id(variable), None)
        return None  # made on the coordinator's default device; the PS copy is made at the first fit

    def get_data_layout(self, data_shape: Any) -> TensorLayout:
        raise ConfigurationError(
            "Keras's own input placement is not used under ParameterServerStrategy: fit/evaluate a model built and "
            "compiled inside the strategy's scope (they dispatch closures through a ClusterCoordinator)")

    def get_tensor_layout(self, path: Any) -> None:
        return None

    def distribute_dataset(self, dataset: Any) -> Any:
        return dataset

    def __repr__(self) -> str:
        return f"PSDistribution({self._strategy!r})"


def ps_strategy_of(model: Any) -> Any:
    """The ParameterServerStrategy ``model`` was built in (None: not built in one's scope)."""
    for v in getattr(model, "trainable_variables", ()):
        with _lock:
            if _owned.get(id(v)) is v:
                return _owner[id(v)].strategy
    # A model whose only trainable state is dynamic tables (two DynamicEmbedding layers and a dot product) has no
    # Keras variable on the coordinator: its layers know their strategy.
    from jaxdist.keras.layers import DynamicEmbedding

    if isinstance(model, keras.layers.Layer):
        for layer in compat.flatten_layers(model):
            if isinstance(layer, DynamicEmbedding) and layer.ps_strategy is not None:
                return layer.ps_strategy
    return None


def ps_strategy_of_variable(variable: Any) -> Any:
    """The ParameterServerStrategy in whose scope Keras ``variable`` was made (None: not in one's scope)."""
    with _lock:
        if _owned.get(id(variable)) is variable:
            return _owner[id(variable)].strategy
    return None


def ps_optimizers(strategy: Any) -> list[Any]:
    """The Keras optimizers made in ``strategy.scope()`` (alive), in no particular order."""
    with _lock:
        return [opt for opt, dist in _optimizers.items() if dist.strategy is strategy]


def _safe(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", path)


class PSModel:
    """A compiled Keras model's state on the parameter servers (see the module docstring).

    ``optimizer`` (a custom loop's, :mod:`jaxdist.keras.ps_custom_loop`): the Keras optimizer whose rule the
    PS applies, for a model that is not compiled; ``iterations``: the PS step counter to use (that optimizer's).

    Raises:
        ConfigurationError: the model is not compiled (and no ``optimizer`` is given), or not built.
        UnsupportedOptimizerError: its optimizer has no PS equivalent.
    """

    def __init__(self, model: Any, strategy: Any, optimizer: Any = None, iterations: Any = None) -> None:
        if optimizer is None and (not getattr(model, "compiled", False) or model.optimizer is None):
            raise ConfigurationError("compile the Keras model (in the strategy's scope) before fit/evaluate")
        if not model.built:
            raise ConfigurationError("build the Keras model (keras.Input, or call it on a batch) before fit/evaluate "
                                     "under ParameterServerStrategy")
        self.model = model
        self.strategy = strategy
        self.optimizer = optimizer if optimizer is not None else model.optimizer
        #: Row gradients of the row-sparse tables are applied lazily (:func:`lazy_embeddings`), else exactly.
        self.lazy = _lazy.get(model, False)
        self.sparse = sparse_embeddings(model)
        self.learning_rate = learning_rate_of(self.optimizer)
        #: DynamicEmbedding layers and their dynamic tables (made first: an optimizer they cannot use is refused
        #: before any PS variable exists).
        self.dynamic = self._dynamic_tables(model, strategy)
        self.uid = uuid.uuid4().hex[:12]
        self.trainable = [strategy.create_variable(np.asarray(v.value), name=f"keras/{_safe(v.path)}", optimizer=tx)
                          for v, tx in zip(model.trainable_variables, self._optimizers())]
        self.non_trainable = [strategy.create_variable(np.asarray(v.value), name=f"keras/{_safe(v.path)}", trainable=False)
                              for v in model.non_trainable_variables]
        self.iterations = iterations if iterations is not None else strategy.create_variable(
            np.asarray(int(self.optimizer.iterations.numpy()), np.int64), name=f"keras/{_safe(model.name)}/iterations",
            trainable=False)
        self._spec: ModelSpec | None = None
        logger.info("Keras model %s: %d trainable, %d non-trainable variables on %d PS tasks", model.name,
                    len(self.trainable), len(self.non_trainable), strategy.num_ps)

    def _dynamic_tables(self, model: Any, strategy: Any) -> list[DynamicSlot]:
        """One :class:`jaxdist.DynamicEmbedding` table per DynamicEmbedding layer, with the optimizer's per-row rule."""
        layers = dynamic_embeddings(model)
        if not layers:
            return []
        from jaxdist.dynamic_embedding import DynamicEmbedding as Table

        rule, lr, options = dynamic_row_rule(self.optimizer, self.lazy)
        configs = [layer.table_config(rule, lr, **options) for layer, _ in layers]
        names = [cfg.name for cfg in configs]
        # Every check before any table is made (a refused model leaves no table behind).
        for (layer, _), cfg in zip(layers, configs):
            if layer.ps_strategy is not strategy:
                raise ConfigurationError(f"DynamicEmbedding {layer.name!r} was made in another strategy's scope")
            if cfg.name in strategy.dynamic_tables or names.count(cfg.name) > 1:
                raise ConfigurationError(
                    f"DynamicEmbedding {layer.name!r}: this strategy has another dynamic table named {cfg.name!r} "
                    "(another layer of that name, in this model or another?): give each layer its own table_name")
        out = []
        for (layer, input_index), cfg in zip(layers, configs):
            with strategy.scope():
                table = Table(
                    cfg.row_shape, name=cfg.name, key_dtype=cfg.key_dtype, dtype=cfg.dtype, initializer=cfg.initializer,
                    init_scale=cfg.init_scale, seed=cfg.seed, default_value=cfg.default_value, optimizer=rule,
                    learning_rate=lr, optimizer_options=options, min_count=cfg.admission.min_count,
                    admit_probability=cfg.admission.probability, max_pending=cfg.admission.max_pending,
                    capacity=cfg.eviction.capacity, eviction_policy=cfg.eviction.policy,
                    ttl_steps=cfg.eviction.ttl_steps, max_bytes_per_shard=cfg.max_bytes)
            assert table.config == cfg, (table.config, cfg)
            out.append(DynamicSlot(layer.name, input_index, table))
        logger.info("Keras model %s: %d dynamic table(s) on %d PS tasks, per-row rule %s (learning rate %g)",
                    model.name, len(out), strategy.num_ps, rule, lr)
        return out

    def _optimizers(self) -> list[Any]:
        """Each trainable variable's PS optimizer: Keras's rule, with weight decay where Keras decays it; a
        row-sparse table's marked lazy (:func:`jaxdist.lazy_rows`) in the lazy mode, or where lazy is exact
        (:func:`~jaxdist.keras.ps_optimizers.row_local`: the PS then works on the pushed rows only).

        Few distinct transformations are made (one per variant), so each PS unpickles and compiles each once.
        """
        opt = self.optimizer
        tables = {e.trainable_index for e in self.sparse}
        lazy_tables = self.lazy or row_local(opt)
        made: dict[tuple[bool, bool], Any] = {}
        out = []
        for i, v in enumerate(self.model.trainable_variables):
            key = (compat.uses_weight_decay(opt, v), lazy_tables and i in tables)
            if key not in made:
                tx = to_optax(opt, v)
                made[key] = lazy_rows(tx) if key[1] else tx
            out.append(made[key])
        if self.sparse:
            logger.info("Keras model %s: %d row-sparse embedding table(s), row gradients applied %s", self.model.name,
                        len(self.sparse), "lazily (only the pushed rows and their slots change)" if self.lazy
                        else "exactly (Keras's dense rule on the PS)")
        return out

    def spec(self) -> ModelSpec:
        """What the workers need (made once the model's metrics are built: their reset values travel)."""
        if self._spec is None:
            m = self.model
            m.reset_metrics()
            self._spec = ModelSpec(self.uid, m.to_json(), m.get_compile_config(), self.trainable, self.non_trainable,
                                   self.iterations, [np.asarray(v.value) for v in m.metrics_variables],
                                   clipping_of(self.optimizer), self.sparse, len(getattr(m, "inputs", None) or []),
                                   self.dynamic)
        return self._spec

    def check_learning_rate(self) -> None:
        """Raise if the optimizer's learning rate was changed (a callback): the PS would not follow."""
        now = learning_rate_of(self.optimizer)
        if now != self.learning_rate:
            raise ConfigurationError(
                f"the optimizer's learning rate changed from {self.learning_rate} to {now} during fit (a callback?): "
                "under ParameterServerStrategy the PS applies the learning rate it was given at the first fit")

    def steps_applied(self) -> int:
        """Training steps the PS has applied (its step counter)."""
        return int(self.iterations.numpy())

    def sync(self) -> None:
        """Copy the PS's values into the coordinator's Keras variables and ``optimizer.iterations``."""
        values = pull(self.trainable + self.non_trainable + [self.iterations])
        m = self.model
        for v, value in zip(list(m.trainable_variables) + list(m.non_trainable_variables), values):
            v.assign(value)
        self.optimizer.iterations.assign(int(values[-1]))


def ps_model(model: Any, optimizer: Any = None, iterations: Any = None) -> PSModel | None:
    """``model``'s :class:`PSModel` (made on first call, with ``optimizer`` and ``iterations`` if given: see
    :class:`PSModel`), or None when it was not built in a PS strategy's scope."""
    with _lock:
        got = _models.get(model)
    if got is not None:
        return got
    strategy = ps_strategy_of(model)
    if strategy is None:
        return None
    made = PSModel(model, strategy, optimizer, iterations)
    with _lock:
        return _models.setdefault(model, made)


def ps_model_with_optimizer(optimizer: Any) -> PSModel | None:
    """The :class:`PSModel` (made already) whose PS optimizer is ``optimizer``'s rule, or None."""
    with _lock:
        return next((pm for pm in _models.values() if pm.optimizer is optimizer), None)


def ps_variables(model: Any) -> list[Any]:
    """The PS variables of ``model``'s trainable variables, in ``model.trainable_variables`` order
    (a :class:`jaxdist.ShardedVariable` where the partitioner split one).

    Raises:
        ConfigurationError: ``model`` was not built in a ParameterServerStrategy's scope, or has not been
            fitted or evaluated yet (its variables are made on the PS then).
    """
    with _lock:
        got = _models.get(model)
    if got is None:
        raise ConfigurationError("this Keras model has no variables on parameter servers (yet): build and compile it "
                                 "in ParameterServerStrategy.scope(), then fit or evaluate it")
    return list(got.trainable)


def dynamic_tables(model: Any) -> dict[str, Any]:
    """The dynamic tables of ``model``'s :class:`jaxdist.keras.layers.DynamicEmbedding` layers, by layer name: each a
    :class:`jaxdist.DynamicEmbedding` (``lookup``, ``stats``; saved by :class:`jaxdist.Checkpoint`).

    Raises:
        ConfigurationError: ``model`` was not built in a ParameterServerStrategy's scope, or has not been
            fitted or evaluated yet (its tables are made on the PS then, with the optimizer's per-row rule).
    """
    with _lock:
        got = _models.get(model)
    if got is None:
        raise ConfigurationError("this Keras model has no tables on parameter servers (yet): build and compile it "
                                 "in ParameterServerStrategy.scope(), then fit or evaluate it")
    return {d.layer: d.table for d in got.dynamic}


def sync_from_ps(model: Any) -> bool:
    """Copy the PS's current values into ``model``'s Keras variables when its state lives on the PS.

    Its weights, and the PS step counter into its optimizer's ``iterations``. ``fit`` does it after every
    epoch; a custom loop in ``ClusterCoordinator`` closures (:mod:`jaxdist.keras.ps_custom_loop`) calls it
    when the coordinator wants the trained weights (``get_weights``, ``save_weights``, ``predict`` outside
    ``fit``). Call it once the steps that count are done (``coordinator.join()``).

    Returns True when it did; False when ``model`` has no PS state (not built in a ParameterServerStrategy's
    scope, or never fitted, evaluated or used by a scheduled closure there: its Keras variables are then the
    only copy).
    """
    with _lock:
        got = _models.get(model)
    if got is None:
        return False
    got.sync()
    return True


def epoch_end_sync(model: Any, sync: bool = True) -> Any:
    """Choose whether ``fit`` copies the PS's weights into ``model``'s Keras variables at every epoch end; returns
    ``model``.

    Under ``ParameterServerStrategy`` the model's state lives on the PS tasks. By default (``sync=True``) ``fit``
    pulls the whole model to the coordinator after every epoch, before ``on_epoch_end``, so that callbacks see
    the epoch's weights (Keras's contract). That pull is the whole model every epoch: for a recommender model
    with large embedding tables it is the model's size over the coordinator's link (830 MB, 6.9 s per epoch over
    a 1 Gbit/s link in ``bench/recsys.py``), and TF's ``fit`` under its ``ParameterServerStrategy`` takes no
    such step (its model's variables are read from the PS when used).

    ``sync=False``: ``fit`` pulls once, when it ends (before ``on_train_end``: the model then holds the trained
    weights, as after any ``fit``; a ``fit`` that raises part way leaves them at the last pull, and
    :func:`sync_from_ps` reads the PS's); at epoch ends the Keras variables keep the values of the last pull. ``fit``
    then refuses, before any step, the callbacks that read the weights at epoch ends (``ModelCheckpoint``,
    ``EarlyStopping(restore_best_weights=True)``, ``TensorBoard(histogram_freq=N)``, Keras's or jaxdist's);
    a callback of your own that reads them can call :func:`sync_from_ps` itself. ``evaluate``, validation,
    ``predict`` and :class:`jaxdist.keras.BackupAndRestore` read the PS and are unaffected. It may be changed
    between ``fit`` calls, and needs only the model built in the strategy's scope.

    Raises:
        TypeError: ``sync`` is not a bool.
        ConfigurationError: ``model`` was not built in a ParameterServerStrategy's scope.
    """
    if not isinstance(sync, bool):
        raise TypeError(f"epoch_end_sync: sync must be True or False, got {sync!r}")
    if ps_strategy_of(model) is None:
        raise ConfigurationError("epoch_end_sync: the model was not built in a ParameterServerStrategy's scope "
                                 "(only a parameter-server model's weights live off the coordinator)")
    with _lock:
        if sync:
            _no_epoch_sync.pop(model, None)
        else:
            _no_epoch_sync[model] = True
    return model


def syncs_each_epoch(model: Any) -> bool:
    """Whether ``fit`` pulls ``model``'s weights at every epoch end (:func:`epoch_end_sync`; the default)."""
    with _lock:
        return model not in _no_epoch_sync


def lazy_embeddings(model: Any, lazy: bool = True) -> Any:
    """Choose how the parameter servers apply ``model``'s embedding-row gradients; returns ``model``.

    Under ``ParameterServerStrategy`` a Keras ``Embedding`` fed by a model
    input moves only the rows a batch looks up, both ways, whatever the
    optimizer (:mod:`jaxdist.keras.ps_embedding`). The PS then applies
    the optimizer to its table

    - exactly (``lazy=False``, the default without this call): Keras's dense
      rule with zero gradient for the rows not looked up (Adam's moments of
      every row decay, momentum keeps moving them), so the weights equal
      Keras's single-device ``fit``; the PS's work per step is O(table);
    - lazily (``lazy=True``, TF's ``LazyAdam``; the usual choice for
      recommender tables): only the looked-up rows, their optimizer slots
      (and the step count) change; O(rows) on the PS. Not Keras's result for
      optimizers with state (momentum, Adam, RMSprop, ...) or weight decay;
      for ``SGD`` without momentum and ``Adagrad`` both modes are the same.

    A model with :class:`jaxdist.keras.layers.DynamicEmbedding` layers compiled with ``Adam`` needs the lazy
    mode: a dynamic table holds no state for the keys a step does not look up.

    Call it after building ``model`` in the strategy's scope, before its
    first ``fit``/``evaluate`` (the PS variables are made then). Dense
    variables (and tables that stay dense: ``mask_zero``, shared layers, ...)
    are updated by the dense rule in both modes.

    Raises:
        ConfigurationError: ``model`` was not built in a ParameterServerStrategy's scope, or its variables
            are on the PS already with the other mode.
    """
    if ps_strategy_of(model) is None:
        raise ConfigurationError("lazy_embeddings: the model was not built in a ParameterServerStrategy's scope "
                                 "(only parameter servers apply embedding rows; build it in strategy.scope() first)")
    lazy = bool(lazy)
    with _lock:
        made = _models.get(model)
        if made is not None and made.lazy != lazy:
            raise ConfigurationError(
                f"lazy_embeddings({lazy}): the model's variables are on the parameter servers already, with "
                f"{'lazy' if made.lazy else 'exact'} embedding updates; choose the mode before the first fit/evaluate")
        _lazy[model] = lazy
    return model
