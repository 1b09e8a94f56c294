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

from keras.distribution import DeviceMesh, TensorLayout

from jaxdist.base.errors import ConfigurationError
from jaxdist.keras.compat import Distribution
from jaxdist.keras.ps_embedding import sparse_embeddings
from jaxdist.keras.ps_optimizers import clipping_of, learning_rate_of, to_optax
from jaxdist.keras.ps_worker import ModelSpec
from jaxdist.variables import pull

logger = logging.getLogger(__name__)

__all__ = ["PSDistribution", "PSModel", "ps_model", "ps_strategy_of", "ps_variables", "sync_from_ps"]

_lock = threading.Lock()
#: Keras variables created in a PSDistribution's scope -> that distribution (by id; weak values).
_owned: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_owner: dict[int, PSDistribution] = {}
_models: weakref.WeakKeyDictionary[Any, PSModel] = weakref.WeakKeyDictionary()


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
        with _lock:
            _owned[id(variable)] = variable
            _owner[id(variable)] = self
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
    return None


def ps_strategy_of_variable(variable: Any) -> Any:
    """The ParameterServerStrategy in whose scope Keras ``variable`` was made (None: not in one's scope)."""
    with _lock:
        if _owned.get(id(variable)) is variable:
            return _owner[id(variable)].strategy
    return None


def _safe(path: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.\-/]", "_", path)


class PSModel:
    """A compiled Keras model's state on the parameter servers (see the module docstring).

    Raises:
        ConfigurationError: the model is not compiled, or not built.
        UnsupportedOptimizerError: its optimizer has no PS equivalent.
    """

    def __init__(self, model: Any, strategy: Any) -> None:
        if not getattr(model, "compiled", False) or model.optimizer is None:
            raise ConfigurationError("compile the Keras model (in the strategy's scope) before fit/evaluate")
        if not model.built:
            raise ConfigurationError("build the Keras model (keras.Input, or call it on a batch) before fit/evaluate "
                                     "under ParameterServerStrategy")
        self.model = model
        self.strategy = strategy
        self.optimizer = model.optimizer
        self.tx = to_optax(model.optimizer)
        self.learning_rate = learning_rate_of(model.optimizer)
        self.uid = uuid.uuid4().hex[:12]
        self.trainable = [strategy.create_variable(np.asarray(v.value), name=f"keras/{_safe(v.path)}", optimizer=self.tx)
                          for v in model.trainable_variables]
        self.non_trainable = [strategy.create_variable(np.asarray(v.value), name=f"keras/{_safe(v.path)}", trainable=False)
                              for v in model.non_trainable_variables]
        self.iterations = strategy.create_variable(np.asarray(int(model.optimizer.iterations.numpy()), np.int64),
                                                   name=f"keras/{_safe(model.name)}/iterations", trainable=False)
        self._spec: ModelSpec | None = None
        logger.info("Keras model %s: %d trainable, %d non-trainable variables on %d PS tasks", model.name,
                    len(self.trainable), len(self.non_trainable), strategy.num_ps)

    def spec(self) -> ModelSpec:
        """What the workers need (made once the model's metrics are built: their reset values travel)."""
        if self._spec is None:
            m = self.model
            m.reset_metrics()
            self._spec = ModelSpec(self.uid, m.to_json(), m.get_compile_config(), self.trainable, self.non_trainable,
                                   self.iterations, [np.asarray(v.value) for v in m.metrics_variables],
                                   clipping_of(self.optimizer), sparse_embeddings(m), len(getattr(m, "inputs", None) or []))
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


def ps_model(model: Any) -> PSModel | None:
    """``model``'s :class:`PSModel` (made on first call), or None when it was not built in a PS strategy's scope."""
    with _lock:
        got = _models.get(model)
    if got is not None:
        return got
    strategy = ps_strategy_of(model)
    if strategy is None:
        return None
    made = PSModel(model, strategy)
    with _lock:
        return _models.setdefault(model, made)


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


def sync_from_ps(model: Any) -> bool:
    """Copy the PS's current values into ``model``'s Keras variables when its state lives on the PS.

    Returns True when it did; False when ``model`` has no PS state (not built in a ParameterServerStrategy's
    scope, or never fitted or evaluated there: its Keras variables are then the only copy).
    """
    with _lock:
        got = _models.get(model)
    if got is None:
        return False
    got.sync()
    return True
