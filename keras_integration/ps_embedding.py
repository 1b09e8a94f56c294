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
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from jaxdist.keras import compat

logger = logging.getLogger(__name__)

__all__ = ["SparseEmbedding", "sparse_embeddings", "with_input_dims", "bucket"]


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
    config = json.loads(model_json)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            cfg = node.get("config")
            if node.get("class_name") == "Embedding" and isinstance(cfg, dict) and cfg.get("name") in dims:
                cfg["input_dim"] = dims[cfg["name"]]
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


def compact_inputs(x: Any, sparse: list[SparseEmbedding], num_inputs: int) -> tuple[Any, list[Rows]] | None:
    """``x`` with each row-sparse layer's ids renumbered into its compact table, and the rows to read.

    None when ``x`` is not laid out as the model's inputs (an array for one
    input, a list/tuple for several): the step then runs dense.
    """
    if isinstance(x, (list, tuple)) and len(x) == num_inputs:
        xs = list(x)
    elif num_inputs == 1 and hasattr(x, "shape"):
        xs = [x]
    else:
        return None
    rows = []
    for e in sparse:
        ids = np.asarray(xs[e.input_index])
        uniq, inverse = np.unique(ids, return_inverse=True)
        xs[e.input_index] = inverse.reshape(ids.shape).astype(ids.dtype)
        rows.append(Rows(uniq.astype(np.int64), bucket(len(uniq))))
    if isinstance(x, (list, tuple)):
        return type(x)(xs), rows
    return xs[0], rows


def padded(values: np.ndarray, size: int) -> np.ndarray:
    """``values`` (rows) padded with zero rows to ``size`` rows (the padding is never looked up)."""
    if len(values) == size:
        return values
    return np.concatenate([values, np.zeros((size - len(values),) + values.shape[1:], values.dtype)])
