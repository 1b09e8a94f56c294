"""Export a Keras model trained under any jaxdist strategy, for serving: :func:`export_model`.

Three formats:

- ``"keras"``: Keras's own ``.keras`` file (``model.save``); load it with
  ``keras.saving.load_model`` (no jaxdist needed).
- ``"jax"``: a directory that a plain JAX process serves from, without jaxdist
  or Keras installed (only ``jax``, ``numpy`` and ``flatbuffers``, which
  ``jax.export`` needs to read its format):

  - ``model.jaxexport``: the model's inference function (``training=False``),
    serialized by ``jax.export``: ``exported.call(weights, inputs)``;
  - ``weights.npz``: its weights, one array per Keras variable (trainable ones
    first, then non-trainable ones, the order of ``model.stateless_call``);
  - ``manifest.json``: the key of each weight in ``weights.npz`` (in call
    order), their Keras paths, dtypes and shapes, the input and output shapes
    (``"batch"`` and ``"d<i>"`` mark the sizes the artifact accepts any value
    for), the platforms it was lowered for and the JAX version.

  Loading it::

      import json, pathlib, numpy as np, jax
      d = pathlib.Path("artifact")
      manifest = json.loads((d / "manifest.json").read_text())
      exported = jax.export.deserialize(bytearray((d / manifest["exported_file"]).read_bytes()))
      with np.load(d / manifest["weights_file"]) as npz:
          weights = [npz[w["key"]] for w in manifest["weights"]]
      y = exported.call(weights, x)

  Weights whose dtype numpy cannot store (``bfloat16``, the float8 types) are
  stored as ``float32`` (exactly) and cast back inside the exported function.
- ``"tf_saved_model"``: TF's SavedModel through Keras's own ``model.export``
  (``jax2tf``); needs TensorFlow (:class:`ExportDependencyError` when it is
  missing).

Whatever the strategy, the export holds the trained weights: under
``ParameterServerStrategy`` the PS's current values (partitioned variables
assembled) are pulled into the model first; under the synchronous strategies
the variables' replicated arrays are read whole (in a multi-process job every
process calls :func:`export_model` and process 0 writes). The export is traced
with no Keras distribution current, so it carries no sharding: it runs on one
device of the platform it was lowered for.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import keras

from jaxdist.base.errors import ConfigurationError
from jaxdist.keras.ps_model import ps_strategy_of, sync_from_ps

logger = logging.getLogger(__name__)

__all__ = ["EXPORT_FORMATS", "ExportDependencyError", "export_model"]

#: The formats :func:`export_model` writes.
EXPORT_FORMATS = ("keras", "jax", "tf_saved_model")

#: The ``"format"`` field of a ``"jax"`` artifact's manifest (bumped when the layout changes).
MANIFEST_FORMAT = "jaxdist.export.jax/1"
EXPORTED_FILE = "model.jaxexport"
WEIGHTS_FILE = "weights.npz"
MANIFEST_FILE = "manifest.json"


class ExportDependencyError(ConfigurationError, ImportError):
    """An export format needs a package that is not installed (it says which, and how to install it)."""


def export_model(model: Any, path: str | os.PathLike[str], format: str = "keras", *,  # noqa: A002 - Keras's name
                 input_signature: Any = None, platforms: Sequence[str] | None = None) -> Path:
    """Write ``model`` (trained under any jaxdist strategy, or none) to ``path`` in ``format``, for serving.

    Args:
        model: a built Keras model.
        path: ``"keras"``: the file to write, ending in ``.keras`` (overwritten); ``"jax"`` and
            ``"tf_saved_model"``: a directory, which must not exist or be empty.
        format: one of :data:`EXPORT_FORMATS` (see the module docstring).
        input_signature: ``"jax"``: the inputs' shapes and dtypes, a ``jax.ShapeDtypeStruct`` (or anything with
            ``shape`` and ``dtype``: a ``keras.KerasTensor``, an array) per input, in a list when the model takes
            several; ``None`` in a shape (and, by default, the batch dimension) becomes a size the artifact accepts
            any value for. Default: the model's ``inputs`` (a functional or ``Sequential`` model with an
            ``Input``). ``"tf_saved_model"``: passed to Keras's ``model.export``. ``"keras"``: must be None.
        platforms: ``"jax"`` only: the platforms to lower for (``("cpu", "cuda")`` serves on both); default JAX's
            default backend. Must be None for the other formats.

    Returns:
        The path written.

    Raises:
        ValueError: an unknown format, an argument the format does not take, a ``.keras`` path without that
            suffix, a non-empty directory, a model that is not built or (``"jax"``) has no ``inputs`` and no
            ``input_signature``.
        ExportDependencyError: ``"tf_saved_model"`` without TensorFlow installed, ``"jax"`` without
            ``flatbuffers`` (``pip install 'jaxdist[export]'``).
    """
    if format not in EXPORT_FORMATS:
        raise ValueError(f"export_model: unknown format {format!r}; one of {EXPORT_FORMATS}")
    if not getattr(model, "built", False):
        raise ValueError("export_model: the model is not built (give it an Input, or call it on a batch, first)")
    if platforms is not None and format != "jax":
        raise ValueError(f"export_model(platforms=...) applies to format='jax' only, not {format!r}")
    if input_signature is not None and format == "keras":
        raise ValueError("export_model(input_signature=...) does not apply to format='keras' (the file keeps the "
                         "model's own structure)")
    path = Path(path)
    writes = jax.process_index() == 0  # in a multi-process job process 0 writes (the others may see its files)
    if format == "keras":
        if path.suffix != ".keras":
            raise ValueError(f"export_model(format='keras'): the path must end in .keras (Keras's rule), got {path}")
    elif writes and path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise ValueError(f"export_model(format={format!r}): {path} exists and is not an empty directory")
    if format == "tf_saved_model" and importlib.util.find_spec("tensorflow") is None:
        raise ExportDependencyError(
            "export_model(format='tf_saved_model') goes through Keras's model.export, which converts the JAX model "
            "with jax2tf and needs TensorFlow: pip install tensorflow-cpu (or export format='jax' or 'keras', which "
            "do not)")
    if format == "jax" and importlib.util.find_spec("flatbuffers") is None:
        raise ExportDependencyError("export_model(format='jax') serializes with jax.export, which needs the "
                                    "flatbuffers package: pip install 'jaxdist[export]'")

    pulled = sync_from_ps(model)
    if pulled:
        logger.info("export_model: pulled %s's weights from the parameter servers", model.name)
    elif ps_strategy_of(model) is not None:
        logger.info("export_model: %s was built under ParameterServerStrategy but never fitted there: exporting its "
                    "initial weights", model.name)
    with _no_distribution():
        if format == "keras":
            if pulled:
                logger.warning(
                    "export_model(format='keras'): %s trained on parameter servers; the file's weights are the PS's, "
                    "but its optimizer variables are the coordinator's (the optimizer's state lives on the PS): "
                    "serve from the file, resume training from jaxdist.keras.BackupAndRestore or a checkpoint",
                    model.name)
            if writes:
                model.save(str(path))
        elif format == "jax":
            _export_jax(model, path, input_signature, platforms, writes)
        else:
            if writes:
                model.export(str(path), format="tf_saved_model", input_signature=input_signature)
    return path


@contextlib.contextmanager
def _no_distribution() -> Iterator[None]:
    """No Keras distribution current (the export is traced for one device, with no sharding in it)."""
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


def _host(value: Any) -> np.ndarray:
    """A variable's value as one numpy array (a replicated array is read from one of its copies)."""
    if isinstance(value, jax.Array) and not value.is_fully_addressable and not value.is_fully_replicated:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(value, tiled=True))
    return np.asarray(value)


def _stored_dtype(dtype: np.dtype[Any]) -> np.dtype[Any]:
    """The dtype ``weights.npz`` keeps ``dtype`` in: itself when numpy stores it, else float32 / int32 (exact)."""
    if dtype.kind != "V":  # numpy's own dtypes; ml_dtypes' (bfloat16, float8, int4) are opaque to np.save
        return dtype
    return np.dtype(np.float32) if jnp.issubdtype(dtype, jnp.floating) else np.dtype(np.int32)


def _signature(model: Any, input_signature: Any) -> Any:
    """The inputs as ``jax.ShapeDtypeStruct`` with symbolic sizes for the ``None`` ones (one scope: they combine)."""
    if input_signature is None:
        inputs = getattr(model, "inputs", None)
        if not inputs:
            raise ValueError(
                f"export_model(format='jax'): {type(model).__name__} has no `inputs` (a subclassed model): pass "
                "input_signature=jax.ShapeDtypeStruct((None, ...), dtype) (a list of them for several inputs)")
        input_signature = inputs[0] if len(inputs) == 1 else list(inputs)
    scope = jax.export.SymbolicScope()
    counter = iter(range(1 << 30))

    def one(spec: Any) -> jax.ShapeDtypeStruct:
        if not (hasattr(spec, "shape") and hasattr(spec, "dtype")):
            raise ValueError(f"export_model: input_signature entries need a shape and a dtype, got {type(spec).__name__}")
        dims = []
        for axis, d in enumerate(spec.shape):
            if d is None:
                dims.append("batch" if axis == 0 else f"d{next(counter)}")
            else:
                dims.append(str(d))
        shape = jax.export.symbolic_shape(", ".join(dims), scope=scope) if dims else ()
        return jax.ShapeDtypeStruct(shape, np.dtype(keras.backend.standardize_dtype(spec.dtype)))

    return jax.tree.map(one, input_signature, is_leaf=lambda s: hasattr(s, "shape") and hasattr(s, "dtype"))


def _shape_of(s: Any) -> list[Any]:
    return [d if isinstance(d, int) else str(d) for d in s.shape]


def _export_jax(model: Any, path: Path, input_signature: Any, platforms: Sequence[str] | None, writes: bool) -> None:
    if platforms is not None and (isinstance(platforms, str) or not all(isinstance(p, str) for p in platforms)):
        raise ValueError(f"export_model(platforms=...) takes a sequence of platform names, got {platforms!r}")
    trainable, non_trainable = list(model.trainable_variables), list(model.non_trainable_variables)
    variables = trainable + non_trainable
    values = [_host(v.value) for v in variables]
    stored = [a.astype(_stored_dtype(a.dtype)) for a in values]
    dtypes = [a.dtype for a in values]
    n_trainable = len(trainable)
    # stateless_call hands its keyword arguments to call() as they are (model(x) drops what call does not take).
    params = inspect.signature(model.call).parameters.values()
    call_kwargs = {"training": False} if any(p.name == "training" or p.kind is inspect.Parameter.VAR_KEYWORD
                                             for p in params) else {}

    def serve(weights: list[Any], inputs: Any) -> Any:
        weights = [w.astype(d) if w.dtype != d else w for w, d in zip(weights, dtypes)]
        outputs, _ = model.stateless_call(weights[:n_trainable], weights[n_trainable:], inputs, **call_kwargs)
        return outputs

    args = _signature(model, input_signature)
    weight_specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in stored]
    try:
        exported = jax.export.export(jax.jit(serve), platforms=platforms)(weight_specs, args)
    except Exception as e:
        raise ValueError(
            f"export_model(format='jax'): tracing {model.name} for inputs {jax.tree.map(_shape_of, args)} failed "
            f"({type(e).__name__}: {e}); if a layer cannot take a size left open (None), pass input_signature with "
            "fixed sizes (e.g. the serving batch size)") from e
    if not writes:
        return
    keys = [f"w{i:05d}" for i in range(len(variables))]
    manifest = {
        "format": MANIFEST_FORMAT,
        "exported_file": EXPORTED_FILE,
        "weights_file": WEIGHTS_FILE,
        "call": "exported.call(weights, inputs)",
        "model": model.name,
        "jax_version": jax.__version__,
        "platforms": list(exported.platforms),
        "weights": [
            {"key": k, "path": v.path, "trainable": i < n_trainable, "shape": list(a.shape), "dtype": str(a.dtype),
             "stored_dtype": str(s.dtype)}
            for i, (k, v, a, s) in enumerate(zip(keys, variables, values, stored))
        ],
        "inputs": jax.tree.map(lambda s: {"shape": _shape_of(s), "dtype": str(s.dtype)}, args),
        "outputs": [{"shape": _shape_of(s), "dtype": str(s.dtype)} for s in exported.out_avals],
    }
    path.mkdir(parents=True, exist_ok=True)
    (path / EXPORTED_FILE).write_bytes(exported.serialize())
    arrays: dict[str, Any] = dict(zip(keys, stored))
    np.savez(path / WEIGHTS_FILE, **arrays)
    (path / MANIFEST_FILE).write_text(json.dumps(manifest, indent=1) + "\n")
