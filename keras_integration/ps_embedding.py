"""Row-sparse embeddings under ParameterServerStrategy: only the rows a batch looks up move.

An ``Embedding`` layer fed directly by a model input (its ids are in the
batch) is *row-sparse*, whatever the optimizer. For such a layer a worker step

1. takes the batch's unique ids (``np.unique``) and reads only those rows
   from the PS (``sparse_read``: each row from the shard that owns it);
2. runs the model with a compact table of those rows (padded to a power of
   two, so the step compiles O(log batch) times) and the ids renumbered into
   it: a copy of the model whose layer has ``input_dim`` = the padded row count;
3. pushes the gradient of those rows only (a row-sparse gradient).

So a step moves ``unique ids x dim`` values for the table each way, whatever
its size (10M x 16 included). The PS applies the optimizer to those rows
exactly (Keras's dense rule with zero gradient for the other rows, the
default: the weights equal Keras's single-device ``fit``) or lazily (only
those rows and their slots change: :func:`jaxdist.keras.lazy_embeddings`);
for ``SGD`` without momentum and ``Adagrad`` the two are the same, and the
PS works on the pushed rows only. Layers with ``mask_zero``, a regularizer,
a constraint or LoRA, layers called on more than one input, and inputs
passed as a dict stay dense (the whole table moves).

:class:`jaxdist.keras.layers.DynamicEmbedding` layers (dynamic tables, keys
looked up by hash) take the same path with their distinct keys
(:func:`dynamic_embeddings`, :func:`compact_batch`): their rows come from the
table's :meth:`jaxdist.DynamicEmbedding.lookup` and their gradients go to its
:meth:`~jaxdist.DynamicEmbedding.apply_gradients`. They have no dense
fallback: such a layer must be fed by a model input, called once, and the
batch laid out as the model's inputs.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.keras import compat

logger = logging.getLogger(__name__)

__all__ = ["DynamicKeys", "DynamicSlot", "SparseEmbedding", "bucket", "compact_batch", "dynamic_embeddings",
           "renumber_dynamic_inputs", "sparse_embeddings", "with_compact_tables", "with_input_dims"]


@dataclass(frozen=True)
class SparseEmbedding:
    """A row-sparse Embedding: its table's place in ``trainable_variables``, its input's place in the model's inputs."""

    layer: str
    trainable_index: int
    input_index: int


def bucket(n: int) -> int:
    """Row counts are padded to powers of two (one compiled step per size class)."""
    return 1 << max(0, (n - 1).bit_length())


def sparse_embeddings(model: Any) -> list[SparseEmbedding]:
    """The model's row-sparse Embedding layers (see the module docstring); computed on the coordinator."""
    import keras

    layers = [layer for layer in compat.flatten_layers(model) if isinstance(layer, keras.layers.Embedding)]
    if not layers:
        return []
    inputs = list(getattr(model, "inputs", None) or [])
    out = []
    for layer in layers:
        cfg = layer.get_config()
        if cfg.get("mask_zero") or cfg.get("embeddings_regularizer") or cfg.get("embeddings_constraint") \
                or cfg.get("lora_rank") or compat.inbound_node_count(layer) != 1:
            logger.info("Embedding %s stays dense (mask_zero, regularizer, constraint, LoRA or shared)", layer.name)
            continue
        where = [i for i, t in enumerate(inputs) if layer.input is t]
        table = [i for i, v in enumerate(model.trainable_variables) if v is layer.embeddings]
        if len(where) != 1 or len(table) != 1:
            logger.info("Embedding %s stays dense (not fed by a model input)", layer.name)
            continue
        out.append(SparseEmbedding(layer.name, table[0], where[0]))
    return out


def with_input_dims(model_json: str, dims: dict[str, int]) -> str:
    """``model_json`` with the ``input_dim`` of each Embedding named in ``dims`` replaced."""

    def edit(class_name: Any, cfg: dict[str, Any]) -> None:
        if class_name == "Embedding" and cfg.get("name") in dims:
            cfg["input_dim"] = dims[cfg["name"]]

    return _edit_layer_configs(model_json, edit)


def _edit_layer_configs(model_json: str, edit: Callable[[Any, dict[str, Any]], None]) -> str:
    """``model_json`` after ``edit(class_name, config)`` changed, in place, the config of every node of it that has
    one (layers, nested models' layers)."""
    config = json.loads(model_json)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            cfg = node.get("config")
            if isinstance(cfg, dict):
                edit(node.get("class_name"), cfg)
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(config)
    return json.dumps(config)


@dataclass
class Rows:
    """One step's rows of one row-sparse table: the unique ids read, and the padded size of the compact table."""

    ids: np.ndarray
    size: int


def padded(values: np.ndarray, size: int) -> np.ndarray:
    """``values`` (rows) padded with zero rows to ``size`` rows (the padding is never looked up)."""
    if len(values) == size:
        return values
    return np.concatenate([values, np.zeros((size - len(values),) + values.shape[1:], values.dtype)])


@dataclass(frozen=True)
class DynamicSlot:
    """A :class:`jaxdist.keras.layers.DynamicEmbedding` layer of a model: its name, its input's place in the
    model's inputs, and its table (a :class:`jaxdist.DynamicEmbedding` handle: it pickles as its description)."""

    layer: str
    input_index: int
    table: Any


def dynamic_embeddings(model: Any) -> list[tuple[Any, int]]:
    """The model's DynamicEmbedding layers with the place of their input among the model's inputs.

    Raises:
        ConfigurationError: such a layer is not fed directly by a model input, or is called more than once
            (its keys must be in the batch: the worker looks their rows up before the step).
    """
    from jaxdist.keras.layers import DynamicEmbedding

    inputs = list(getattr(model, "inputs", None) or [])
    out = []
    for layer in compat.flatten_layers(model):
        if not isinstance(layer, DynamicEmbedding):
            continue
        where = [i for i, t in enumerate(inputs) if compat.inbound_node_count(layer) == 1 and layer.input is t]
        if len(where) != 1:
            raise ConfigurationError(
                f"jaxdist.keras.layers.DynamicEmbedding {layer.name!r} must be called once, directly on a model input "
                "(keras.Input(..., dtype='int64' or 'string')): the workers look up the batch's keys before the step")
        out.append((layer, where[0]))
    return out


@dataclass
class DynamicKeys:
    """One step's keys of one dynamic table.

    ``keys``: every occurrence, flattened (int64 array, or list of str); ``distinct``: the distinct keys
    (rows ``0..n-1`` of the compact table); ``first``: where each distinct key first occurs in ``keys``;
    ``size``: the padded size of the compact table; ``counts``: each distinct key's occurrences in ``keys``.
    """

    keys: np.ndarray | list[str]
    distinct: np.ndarray | list[str]
    first: np.ndarray
    size: int
    counts: np.ndarray

    def counted_grads(self, grads: np.ndarray) -> tuple[np.ndarray | list[str], np.ndarray, np.ndarray]:
        """The compact table's gradient (distinct rows first) as a counted push: ``(the distinct keys in
        first-occurrence order, their gradient rows (float32), their occurrences)``.

        The same push, bit for bit, as one row per key occurrence (each distinct key's row at its first
        occurrence, zeros at the others: the PS's sum of those in occurrence order from +0.0 is the row itself),
        with each key sent once: the PS still counts every occurrence (admission, LFU frequency), in the order
        the keys first occur (recency, keys pending admission)."""
        n = len(self.distinct)
        order = np.argsort(self.first, kind="stable")
        rows = np.asarray(grads[:n], dtype=np.float32)[order]
        if isinstance(self.distinct, np.ndarray):
            return self.distinct[order], rows, self.counts[order]
        return [self.distinct[int(i)] for i in order], rows, self.counts[order]


def _model_inputs(x: Any, num_inputs: int) -> list[Any] | None:
    if isinstance(x, (list, tuple)) and len(x) == num_inputs:
        return list(x)
    if num_inputs == 1 and hasattr(x, "shape"):
        return [x]
    return None


def _compact_keys(raw: Any, key_dtype: str) -> tuple[np.ndarray, DynamicKeys]:
    """``(the keys renumbered into the compact table (int32, the keys' shape), the step's DynamicKeys)``."""
    arr = np.asarray(raw) if key_dtype == "int64" else np.asarray(raw, dtype=object)
    if key_dtype == "int64":
        if arr.dtype.kind not in "iu":
            raise ConfigurationError(f"a DynamicEmbedding with int64 keys got keys of dtype {arr.dtype}")
        flat = arr.reshape(-1).astype(np.int64)
        distinct, first, inverse = np.unique(flat, return_index=True, return_inverse=True)
        keys: np.ndarray | list[str] = flat
        uniq: np.ndarray | list[str] = distinct
    else:
        flat_s = [k.decode("utf-8") if isinstance(k, bytes) else k for k in arr.reshape(-1).tolist()]
        at: dict[Any, int] = {}
        firsts: list[int] = []
        inv = np.empty(len(flat_s), dtype=np.int64)
        for i, k in enumerate(flat_s):
            j = at.get(k)
            if j is None:
                j = at[k] = len(firsts)
                firsts.append(i)
            inv[i] = j
        keys, uniq, first, inverse = flat_s, list(at), np.asarray(firsts, dtype=np.int64), inv
    counts = np.bincount(inverse.reshape(-1), minlength=len(uniq)).astype(np.int64)
    return inverse.reshape(arr.shape).astype(np.int32), DynamicKeys(keys, uniq, first, bucket(len(uniq)), counts)


def compact_batch(x: Any, sparse: list[SparseEmbedding], dynamic: list[DynamicSlot],
                  num_inputs: int) -> tuple[Any, list[Rows], list[DynamicKeys]] | None:
    """``x`` with each row-sparse layer's ids and each dynamic layer's keys renumbered into compact tables,
    the rows to read of the first and the keys of the second.

    None when ``x`` is not laid out as the model's inputs and the model has no dynamic layer (the step then
    runs dense).

    Raises:
        ConfigurationError: ``x`` is not laid out as the model's inputs and the model has a dynamic layer.
    """
    xs = _model_inputs(x, num_inputs)
    if xs is None:
        if dynamic:
            raise ConfigurationError(
                "a model with jaxdist.keras.layers.DynamicEmbedding takes its batch's inputs as an array (one input) "
                f"or a list/tuple of {num_inputs} arrays in the model's input order, not {type(x).__name__}")
        return None
    rows = []
    for e in sparse:
        ids = np.asarray(xs[e.input_index])
        uniq, inverse = np.unique(ids, return_inverse=True)
        xs[e.input_index] = inverse.reshape(ids.shape).astype(ids.dtype)
        rows.append(Rows(uniq.astype(np.int64), bucket(len(uniq))))
    keys = []
    for d in dynamic:
        xs[d.input_index], k = _compact_keys(xs[d.input_index], d.table.config.key_dtype)
        keys.append(k)
    if isinstance(x, (list, tuple)):
        return type(x)(xs), rows, keys
    return xs[0], rows, keys


def renumber_dynamic_inputs(model: Any, batch: Any) -> Any:
    """``batch`` with the keys of ``model``'s DynamicEmbedding layers renumbered as a worker's step renumbers them
    (what the coordinator builds the model and its compiled metrics from: Keras cannot make symbolic tensors
    of string keys). ``batch`` unchanged when the model has no such layer."""
    layers = dynamic_embeddings(model)
    if not layers:
        return batch
    x, y, sw = compat.unpack_x_y_sample_weight(batch)
    xs = _model_inputs(x, len(model.inputs))
    if xs is None:
        raise ConfigurationError(
            "a model with jaxdist.keras.layers.DynamicEmbedding takes its batch's inputs as an array (one input) or "
            f"a list/tuple of arrays in the model's input order, not {type(x).__name__}")
    for layer, at in layers:
        xs[at] = _compact_keys(xs[at], layer.key_dtype)[0]
    return compat.pack_x_y_sample_weight(type(x)(xs) if isinstance(x, (list, tuple)) else xs[0], y, sw)


def with_compact_tables(model_json: str, rows: dict[str, int]) -> str:
    """``model_json`` with each DynamicEmbedding named in ``rows`` given a compact table of that many rows, and
    string inputs declared int32 (a worker's copy gets the keys renumbered: no string reaches the model)."""

    def edit(class_name: Any, cfg: dict[str, Any]) -> None:
        if class_name == "DynamicEmbedding" and cfg.get("name") in rows:
            cfg["compact_rows"] = rows[cfg["name"]]
        elif class_name == "InputLayer" and cfg.get("dtype") == "string":
            cfg["dtype"] = "int32"

    return _edit_layer_configs(model_json, edit)
