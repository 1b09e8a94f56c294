"""Keras layers of jaxdist: :class:`DynamicEmbedding`, a hash-keyed embedding table for ``fit``.

``jaxdist.keras.layers.DynamicEmbedding`` is the Keras face of :class:`jaxdist.DynamicEmbedding`
(docs/dynamic-embeddings.md): its rows live on the parameter servers, in a dynamic table with no
vocabulary fixed in advance, created on first lookup from the key by the table's initializer and
bounded by admission and eviction. It works in ``model.fit`` / ``evaluate`` / ``predict`` under
``jaxdist.ParameterServerStrategy`` only (:mod:`jaxdist.keras.ps_fit`): each step on a worker

1. takes the batch's distinct keys and looks their rows up on the PS tasks that hold them;
2. runs the model with a compact table of those rows (padded to a power of two, as row-sparse
   ``Embedding`` layers do: :mod:`jaxdist.keras.ps_embedding`) and the keys renumbered into it;
3. pushes each distinct key's gradient row once per step with its number of occurrences (a counted push:
   admission and LFU count every occurrence), with the closure's identity (exactly once, as
   :meth:`jaxdist.DynamicEmbedding.apply_gradients` in a custom loop); the PS applies the table's
   per-row rule, made from the model's optimizer: ``SGD`` (no momentum) -> ``"sgd"``, ``Adagrad`` ->
   ``"adagrad"``, ``Adam`` -> ``"lazy_adam"`` once :func:`jaxdist.keras.lazy_embeddings` chose the lazy
   mode (a dynamic table has no rows for the keys a step does not look up: Adam can only be lazy).

The layer has no Keras weights on the coordinator (``get_weights`` / ``save_weights`` cannot hold a
table that lives on the PS): the table is saved and restored by :class:`jaxdist.Checkpoint`
(``jaxdist.keras.BackupAndRestore`` uses it), and Keras's ``save`` / ``save_weights`` raise
:class:`~jaxdist.errors.ConfigurationError` instead of writing a file without the table.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

import keras

from jaxdist.base.errors import ConfigurationError
from jaxdist.keras import compat
from jaxdist.ps_server.dynamic_table import AdmissionConfig, DynamicTableConfig, EvictionConfig

logger = logging.getLogger(__name__)

__all__ = ["DynamicEmbedding"]

#: Where to go instead, named by every refusal.
_USE_INSTEAD = ("use it in a model built and compiled in jaxdist.ParameterServerStrategy.scope() and trained with "
                "model.fit (or, in a custom loop, use jaxdist.DynamicEmbedding directly); under synchronous "
                "strategies or on one device, use keras.layers.Embedding over hashed ids (keras.layers.Hashing)")


@keras.saving.register_keras_serializable(package="jaxdist")
class DynamicEmbedding(keras.layers.Layer):
    """A dynamic (hash-keyed) embedding table on the parameter servers, for Keras ``fit``.

    Maps keys of any shape ``S`` (int64 ids, or strings with ``key_dtype="string"``) to rows of shape
    ``S + (output_dim,)``. Feed it directly from a model input (``keras.Input(shape, dtype="int64")``,
    or ``dtype="string"``); each such layer is one :class:`jaxdist.DynamicEmbedding` table over every PS
    task of the strategy, created at the model's first ``fit``/``evaluate`` (when its optimizer is
    known). The options are those of :class:`jaxdist.DynamicEmbedding` (same meaning, passed to the
    table unchanged); the table's per-row optimizer is the model's (see the module docstring).

    Args:
        output_dim: the row length.
        key_dtype: ``"int64"`` or ``"string"``.
        initializer: ``"normal"``, ``"uniform"`` or ``"zeros"``; a new row is a pure function of
            ``(seed, key)`` scaled by ``init_scale``.
        default_value: what a key not (yet) admitted reads (every element).
        min_count, admit_probability, max_pending: admission.
        capacity, eviction_policy, ttl_steps: eviction (rows per PS task, ``"lru"`` / ``"lfu"``, steps).
        max_bytes_per_shard: bound on one PS task's rows and optimizer state.
        table_name: the table's name among the strategy's dynamic tables (default: the layer's name).
        compact_rows: set by jaxdist on the workers' copies of the model only (the compact table's size);
            leave it None.

    Raises:
        ConfigurationError: created outside ``ParameterServerStrategy.scope()`` (under a synchronous
            strategy or none), or an invalid option.
    """

    def __init__(
        self,
        output_dim: int,
        *,
        key_dtype: str = "int64",
        initializer: str = "normal",
        init_scale: float = 0.05,
        seed: int = 0,
        default_value: float = 0.0,
        min_count: int = 1,
        admit_probability: float = 1.0,
        max_pending: int = 1 << 20,
        capacity: int | None = None,
        eviction_policy: str = "lru",
        ttl_steps: int | None = None,
        max_bytes_per_shard: int = 8 << 30,
        table_name: str | None = None,
        compact_rows: int | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.output_dim = int(output_dim)
        self.key_dtype = key_dtype
        self.initializer = initializer
        self.init_scale = float(init_scale)
        self.seed = int(seed)
        self.default_value = float(default_value)
        self.min_count = int(min_count)
        self.admit_probability = float(admit_probability)
        self.max_pending = int(max_pending)
        self.capacity = None if capacity is None else int(capacity)
        self.eviction_policy = eviction_policy
        self.ttl_steps = None if ttl_steps is None else int(ttl_steps)
        self.max_bytes_per_shard = int(max_bytes_per_shard)
        self.table_name = table_name if table_name is not None else self.name
        self.compact_rows = None if compact_rows is None else int(compact_rows)
        if self.output_dim < 1:
            raise ConfigurationError(f"DynamicEmbedding: output_dim must be >= 1, got {output_dim}")
        if np.dtype(self.compute_dtype).kind != "f" or np.dtype(self.variable_dtype).kind != "f":
            raise ConfigurationError(f"DynamicEmbedding: rows must be floating point, not {self.dtype_policy.name}")
        self.table_config("sgd", 0.01)  # every option checked now (the optimizer is the model's, known at fit)
        #: The ParameterServerStrategy whose scope made the layer (None on a worker's copy).
        self.ps_strategy: Any = None
        if self.compact_rows is None:
            from jaxdist.keras.ps_model import PSDistribution

            dist = keras.distribution.distribution()
            if not isinstance(dist, PSDistribution):
                where = "outside any strategy scope" if dist is None else f"under {type(getattr(dist, 'strategy', dist)).__name__}"
                raise ConfigurationError(
                    f"jaxdist.keras.layers.DynamicEmbedding {self.name!r} was created {where}: its rows live on "
                    f"parameter servers, so {_USE_INSTEAD}")
            self.ps_strategy = dist.strategy

    def table_config(self, optimizer: str, learning_rate: float, **optimizer_options: float) -> DynamicTableConfig:
        """The :class:`~jaxdist.ps_server.dynamic_table.DynamicTableConfig` of this layer's table with the
        per-row rule ``optimizer`` (what :class:`jaxdist.DynamicEmbedding` makes of the same arguments)."""
        from jaxdist.ps_server.dynamic_table import RowOptimizer

        return DynamicTableConfig(
            name=self.table_name, row_shape=(self.output_dim,), dtype=str(np.dtype(self.variable_dtype)),
            key_dtype=self.key_dtype, seed=self.seed, initializer=self.initializer, init_scale=self.init_scale,
            default_value=self.default_value,
            optimizer=RowOptimizer(optimizer, float(learning_rate), **optimizer_options),
            admission=AdmissionConfig(self.min_count, self.admit_probability, self.max_pending),
            eviction=EvictionConfig(self.capacity, self.eviction_policy, self.ttl_steps),
            max_bytes=self.max_bytes_per_shard,
        )

    def build(self, input_shape: Any) -> None:
        if self.compact_rows is not None:
            # A worker's copy: the step's compact table (its values are the looked-up rows, set every step).
            self.embeddings = self.add_weight(shape=(self.compact_rows, self.output_dim), initializer="zeros",
                                              name="embeddings")
        self.built = True

    def call(self, inputs: Any) -> Any:
        if self.compact_rows is not None:
            return keras.ops.take(self.embeddings, keras.ops.cast(inputs, "int32"), axis=0)
        if compat.in_symbolic_scope():  # building the model (shapes only): no row is read
            return keras.ops.zeros(tuple(inputs.shape) + (self.output_dim,), dtype=self.compute_dtype)
        raise ConfigurationError(
            f"jaxdist.keras.layers.DynamicEmbedding {self.name!r} was called outside jaxdist's fit/evaluate/predict "
            f"(its rows are looked up on the parameter servers by them): {_USE_INSTEAD}")

    def compute_output_shape(self, input_shape: Any) -> tuple[Any, ...]:
        return tuple(input_shape) + (self.output_dim,)

    def compute_output_spec(self, inputs: Any) -> Any:
        return keras.KerasTensor(tuple(inputs.shape) + (self.output_dim,), dtype=self.compute_dtype)

    def save_own_variables(self, store: Any) -> None:
        raise ConfigurationError(
            f"jaxdist.keras.layers.DynamicEmbedding {self.name!r}: its table lives on the parameter servers, not in "
            "the Keras weights, so Keras's save/save_weights (and keras.callbacks.ModelCheckpoint) would write a file "
            "without it: save with jaxdist.Checkpoint(strategy) (or train with jaxdist.keras.BackupAndRestore), which "
            "save and restore the table's keys, rows, optimizer state and counters")

    def load_own_variables(self, store: Any) -> None:
        raise ConfigurationError(
            f"jaxdist.keras.layers.DynamicEmbedding {self.name!r}: its table is restored by jaxdist.Checkpoint, not "
            "from Keras weights")

    def get_config(self) -> dict[str, Any]:
        config: dict[str, Any] = super().get_config()
        config.update(
            output_dim=self.output_dim, key_dtype=self.key_dtype, initializer=self.initializer,
            init_scale=self.init_scale, seed=self.seed, default_value=self.default_value, min_count=self.min_count,
            admit_probability=self.admit_probability, max_pending=self.max_pending, capacity=self.capacity,
            eviction_policy=self.eviction_policy, ttl_steps=self.ttl_steps,
            max_bytes_per_shard=self.max_bytes_per_shard, table_name=self.table_name, compact_rows=self.compact_rows,
        )
        return config
