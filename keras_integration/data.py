"""Any re-iterable of batches as Keras input (TF users' ``tf.data``-free pipelines).

Keras 3 takes arrays, ``keras.utils.PyDataset``, Python generators (one pass:
a second epoch gets nothing), tf.data, torch and grain, but not a plain
iterable (a list of batches, a class with ``__iter__``): it raises
``Unrecognized data type``. :class:`Batches` wraps one: ``iter()`` is called
again at every epoch, so each epoch sees every batch, and ``len()``, when the
iterable has it, gives Keras the epoch length (a progress bar with a target).

Each batch is a tuple ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)`` of
arrays (or nested structures of arrays), as with Keras generators; under a
jaxdist strategy it is a *global* batch, split over the replicas.

:class:`DatasetCreator` (TF's) takes a dataset function instead: per-worker
input under ``ParameterServerStrategy``, per-process input of per-replica
batches under the other strategies (:class:`DatasetCreatorInput`, made by
:func:`creator_arguments` when ``fit``/``evaluate``/``predict`` is called).
"""

from __future__ import annotations

import logging
import types
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.keras.compat import DataAdapter, get_jax_iterator, get_numpy_iterator

logger = logging.getLogger(__name__)

__all__ = ["Batches", "DatasetCreator", "DatasetCreatorInput", "call_dataset_fn", "creator_arguments", "is_dataset_fn"]


class Batches(DataAdapter):
    """Keras input from a re-iterable of batches: ``model.fit(jaxdist.keras.Batches(batches), epochs=3)``.

    Args:
        iterable: anything whose ``iter()`` yields the epoch's batches afresh
            each time (a list, a class with ``__iter__``). A one-shot iterator
            or generator is refused: pass a generator to ``fit`` directly
            (Keras reads it once) or wrap its factory in an iterable.
        per_process: TF's ``FILE`` auto-shard policy under a multi-process
            ``MultiWorkerMirroredStrategy``: each process's ``iterable`` yields
            only its own part of each global batch (e.g. read from its own
            files), and the global batch is the processes' parts in process
            order. Every process must yield the same number of batches, and the
            parts of one batch the same number of rows on every process
            (checked: ``ValueError`` otherwise). Parts whose rows divide by the
            process's replica count stay on that process's replicas; others
            (a short last batch) are gathered to every process and computed
            whole, as a short global batch is. Default ``False``: every process
            yields the same global batches (TF's ``DATA`` policy). In one
            process the two are the same.

    Raises:
        TypeError: ``iterable`` is a one-shot iterator, or its batches are not tuples.
        ValueError: ``iterable`` yields no batch.
    """

    def __init__(self, iterable: Iterable[Any], per_process: bool = False) -> None:
        if isinstance(iterable, types.GeneratorType) or iter(iterable) is iterable:
            raise TypeError(
                f"Batches needs a re-iterable (iter() gives a fresh pass each epoch); got a one-shot "
                f"{type(iterable).__name__}. Pass a generator to fit() directly, or an object whose __iter__ makes one"
            )
        self._iterable = iterable
        self.per_process = bool(per_process)
        first = next(iter(iterable), None)
        if first is None:
            raise ValueError("Batches: the iterable yields no batch")
        if not isinstance(first, tuple):
            raise TypeError(
                "Batches: each batch must be a tuple (x,), (x, y) or (x, y, sample_weight), as for Keras "
                f"generators; got {type(first).__name__}"
            )
        try:
            self._len: int | None = len(iterable)  # type: ignore[arg-type]
        except TypeError:
            self._len = None

    def _batches(self) -> Iterator[Any]:
        return iter(self._iterable)

    def get_numpy_iterator(self) -> Iterator[Any]:
        return get_numpy_iterator(self._batches())

    def get_jax_iterator(self) -> Iterator[Any]:
        return get_jax_iterator(self._batches())

    def get_tf_dataset(self) -> Any:
        raise NotImplementedError("jaxdist.keras.Batches serves Keras's JAX backend only (no tf.data)")

    def get_torch_dataloader(self) -> Any:
        raise NotImplementedError("jaxdist.keras.Batches serves Keras's JAX backend only (no torch DataLoader)")

    @property
    def num_batches(self) -> int | None:
        return self._len

    @property
    def batch_size(self) -> int | None:
        return None  # batches may differ in size (a short last one)

    @property
    def has_partial_batch(self) -> bool | None:
        return None

    @property
    def partial_batch_size(self) -> int | None:
        return None


class DatasetCreator:
    """Input from a dataset function for ``fit``/``evaluate`` (TF's ``DatasetCreator``), under every strategy.

    Under the synchronous strategies and the default one (``fit``, ``evaluate`` and ``predict``; TF's
    ``distribute_datasets_from_function``): ``dataset_fn(input_context)`` runs once per call in each
    process, ``input_context`` = ``InputContext(processes, this process's index, replicas)``, and yields
    *per-replica* batches; each step takes one per local replica (see :class:`DatasetCreatorInput`).
    ``steps_per_epoch`` / ``validation_steps`` / ``steps`` are required, and ``y``, ``sample_weight``,
    ``batch_size``, ``class_weight`` refused (the batches carry them).

    Under ``ParameterServerStrategy`` it is per-worker input:
    ``model.fit(jaxdist.keras.DatasetCreator(dataset_fn), epochs=..., steps_per_epoch=...)``:
    ``dataset_fn(input_context)`` (or ``dataset_fn()``) runs on every worker
    (and again on a worker that restarts) and returns an iterable of batches
    ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``; ``input_context`` is a
    :class:`jaxdist.InputContext` (``input_pipeline_id`` = the worker's
    index, to shard the data). ``fit`` re-iterates it when a pass ends (TF's
    ``.repeat()``). For ``evaluate`` it must return the whole evaluation set as
    a sequence of batches (``len()`` and ``ds[i]``), the same on every worker:
    each batch is then evaluated exactly once. A plain callable may be passed
    instead of a DatasetCreator.

    Args:
        dataset_fn: the function; it must pickle (it travels to the workers).
        input_options: TF's argument; only None is accepted (jaxdist has no input options here).
    """

    def __init__(self, dataset_fn: Any, input_options: Any = None) -> None:
        if not callable(dataset_fn):
            raise TypeError(f"DatasetCreator wants a callable dataset_fn, got {type(dataset_fn).__name__}")
        if input_options is not None:
            raise ValueError("DatasetCreator(input_options=...) is not supported by jaxdist: pass None")
        self.dataset_fn = dataset_fn

    def __call__(self, input_context: Any = None) -> Any:
        return call_dataset_fn(self.dataset_fn, input_context)

    def __repr__(self) -> str:
        return f"DatasetCreator({self.dataset_fn!r})"


def call_dataset_fn(dataset_fn: Any, input_context: Any) -> Any:
    """``dataset_fn(input_context)``, or ``dataset_fn()`` when it takes no argument."""
    import inspect

    if isinstance(dataset_fn, DatasetCreator):
        dataset_fn = dataset_fn.dataset_fn
    try:
        takes_arg = bool(inspect.signature(dataset_fn).parameters)
    except (TypeError, ValueError):
        takes_arg = True
    return dataset_fn(input_context) if takes_arg else dataset_fn()


class DatasetCreatorInput(Batches):
    """What ``fit``/``evaluate``/``predict`` read from a :class:`DatasetCreator` (or a dataset function) under a
    synchronous strategy or none (TF's ``distribute_datasets_from_function``), made by :func:`creator_arguments`.

    ``dataset_fn(input_context)`` is called once, in this process; its iterable yields *per-replica* batches
    (batched with ``input_context.get_per_replica_batch_size(global_batch)``, as in TF). Each step takes the
    next batch for each of this process's replicas, in replica order, and their rows, concatenated, are this
    process's part of the step's global batch (the processes' parts in process order: under
    ``MultiWorkerMirroredStrategy`` each process reads its own pipeline). The iterable is iterated again when
    a pass ends (TF's ``.repeat()``), so the number of steps is the caller's (``steps_per_epoch``, ``steps``).

    Raises:
        TypeError: a batch is not a tuple ``(x,)``, ``(x, y)`` or ``(x, y, sample_weight)``.
        ConfigurationError: a pass yields no batch (a one-shot iterator already consumed).
    """

    def __init__(self, dataset_fn: Any, input_context: Any, local_replicas: int) -> None:
        if local_replicas < 1:
            raise ValueError(f"local_replicas must be >= 1, got {local_replicas}")
        self._dataset = call_dataset_fn(dataset_fn, input_context)
        self._local_replicas = int(local_replicas)
        self.input_context = input_context
        self.per_process = input_context.num_input_pipelines > 1
        self._len = None  # endless: Keras's steps argument says how many steps

    def _passes(self) -> Iterator[Any]:
        while True:
            got = False
            for batch in self._dataset:
                got = True
                if not isinstance(batch, tuple):
                    raise TypeError("DatasetCreator: dataset_fn's batches must be tuples (x,), (x, y) or "
                                    f"(x, y, sample_weight), as for Keras generators; got {type(batch).__name__}")
                yield batch
            if not got:
                raise ConfigurationError(
                    "DatasetCreator: dataset_fn's data ran out: return a re-iterable (a list, a sequence, an object "
                    "whose __iter__ starts a new pass) or an endless iterator")

    def _batches(self) -> Iterator[Any]:
        import keras

        batches = self._passes()
        while True:
            parts = [next(batches) for _ in range(self._local_replicas)]
            if len(parts) == 1:
                yield parts[0]
            else:
                yield keras.tree.map_structure(lambda *a: None if a[0] is None else np.concatenate(a), *parts)


#: The steps argument each entry point needs with a DatasetCreator input (TF's rule), and the arguments the
#: DatasetCreator's batches carry instead (refused with one).
_CREATOR_INPUTS: dict[str, tuple[tuple[str, str, tuple[str, ...]], ...]] = {
    "fit": (("x", "steps_per_epoch", ("y", "sample_weight", "batch_size", "class_weight")),
            ("validation_data", "validation_steps", ("validation_batch_size",))),
    "evaluate": (("x", "steps", ("y", "sample_weight", "batch_size")),),
    "predict": (("x", "steps", ("batch_size",)),),
}


def is_dataset_fn(x: Any) -> bool:
    """Whether ``x`` is a DatasetCreator or a dataset function (a callable that is not an array or an iterable)."""
    if isinstance(x, DatasetCreator):
        return True
    return callable(x) and not isinstance(x, (DataAdapter, type)) and not hasattr(x, "shape") \
        and not hasattr(x, "__iter__") and not hasattr(x, "__getitem__")


def creator_arguments(name: str, arguments: dict[str, Any], input_context: Any, local_replicas: int) -> dict[str, Any]:
    """``arguments`` (Keras entry point ``name``'s, bound by name) with each DatasetCreator / dataset function input
    replaced by its :class:`DatasetCreatorInput`; ``arguments`` itself when there is none.

    Raises:
        ValueError: the steps argument is missing (the input is endless), or an argument the batches carry
            (``y``, ``batch_size``, ...) is given too.
    """
    changed = dict(arguments)
    for key, steps, carried in _CREATOR_INPUTS.get(name, ()):
        value = arguments.get(key)
        if not is_dataset_fn(value):
            continue
        if arguments.get(steps) is None:
            raise ValueError(f"{name}({key}=DatasetCreator) needs {steps}= (TF's rule: the dataset repeats, so "
                             "the number of steps is yours)")
        given = [c for c in carried if arguments.get(c) is not None]
        if given:
            raise ValueError(f"{name}({key}=DatasetCreator) does not take {', '.join(given)}: dataset_fn's batches "
                             "carry the targets and sample weights, and are batched per replica by dataset_fn")
        changed[key] = DatasetCreatorInput(value, input_context, local_replicas)
    return changed
