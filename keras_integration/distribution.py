"""A jaxdist strategy seen by Keras 3: a ``keras.distribution`` over the strategy's devices.

Keras's JAX trainer never asks for a strategy; it asks for the thread-local
``keras.distribution.distribution()``. :class:`StrategyDistribution` is a
``keras.distribution.DataParallel`` over the strategy's devices (one mesh axis,
``"batch"``): variables made while it is current are replicated on every
replica's device, each batch is split along its first dimension, and Keras's
own jitted ``train_step`` computes the mean loss over the *global* batch, so
XLA inserts the gradient all-reduce (the sum of the replicas' gradients of
``loss / global_batch``, which is what TF's optimizers apply under a
strategy). Metric variables are replicated too and updated from the whole
global batch, so metrics are exact across replicas and processes.

What it adds to ``DataParallel``:

- **Short batches.** ``DataParallel`` fails on a batch whose rows do not divide
  by the replica count (the last batch of most data sets). Here such a batch
  is replicated instead: every replica computes the whole (small) batch, the
  result is the single-device one, exactly, and nothing is padded.
- **Multi-process input (TF's ``DATA`` auto-shard policy).** Under
  ``MultiWorkerMirroredStrategy`` every process iterates the same input (the
  same arrays, or a generator / ``PyDataset`` that yields the same batches in
  the same order on every process, as TF's ``DATA`` policy requires) and each
  process places only its own replicas' rows of each global batch on its
  devices. ``batch_size`` is the global batch, as in TF.

The per-batch placement replaces Keras's JAX epoch iterator's distributed input
while a :class:`StrategyDistribution` is current (Keras has no public hook
for it: the one it has, ``get_data_layout``, is asked once per ``fit`` and
cached for every batch); with any other distribution, or none, Keras's own
code runs unchanged. See :func:`install_data_placement`; what it replaces in
Keras is listed in :mod:`jaxdist.keras.compat`, which does the replacing.
"""

from __future__ import annotations

import collections
import functools
import inspect
import logging
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import keras
from keras.distribution import DataParallel, DeviceMesh, TensorLayout

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import InputContext
from jaxdist.keras import compat
from jaxdist.keras.data import Batches, creator_arguments, is_dataset_fn

logger = logging.getLogger(__name__)

__all__ = ["StrategyDistribution", "install_data_placement"]

#: The mesh axis the batch is split along (Keras's DataParallel default name).
BATCH_AXIS = "batch"


class StrategyDistribution(DataParallel):
    """Keras data parallelism over a synchronous jaxdist strategy's replicas.

    ``strategy.scope()`` enters it (see :mod:`jaxdist.keras`); build, compile
    and ``fit`` the model inside the scope. Replica ``r`` is
    ``strategy.devices[r]``.

    Args:
        strategy: a ``MirroredStrategy``, ``OneDeviceStrategy``,
            ``CentralStorageStrategy``, ``TPUStrategy`` or
            ``MultiWorkerMirroredStrategy`` (anything with ``devices``).
    """

    def __init__(self, strategy: Any) -> None:
        devices = list(getattr(strategy, "devices", ()))
        if not devices:
            raise ConfigurationError(f"{type(strategy).__name__} has no devices to lay a Keras mesh on")
        mesh = DeviceMesh(shape=(len(devices),), axis_names=[BATCH_AXIS], devices=np.array(devices, dtype=object))
        # auto_shard_dataset=False: Keras's own multi-process sharding accepts only tf.data; the rows each process
        # keeps are chosen per batch by place_batch (TF's DATA policy) instead.
        super().__init__(device_mesh=mesh, auto_shard_dataset=False)
        self._strategy = strategy
        self._devices = tuple(devices)
        jax_mesh = jax.sharding.Mesh(np.array(devices, dtype=object), (BATCH_AXIS,))
        self._replicated = NamedSharding(jax_mesh, PartitionSpec())
        self._split = NamedSharding(jax_mesh, PartitionSpec(BATCH_AXIS))
        self._multi_process = len({d.process_index for d in devices}) > 1
        self._counts = {"split": 0, "replicated": 0}
        self._gather = jax.jit(lambda a: a, out_shardings=self._replicated)
        with _registry_lock:
            _by_mesh[jax_mesh] = self
            _by_device_mesh[id(self.device_mesh)] = self

    @property
    def strategy(self) -> Any:
        """The jaxdist strategy this distribution stands for."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

    @property
    def multi_process(self) -> bool:
        """Whether the replicas span more than one process."""
        return self._multi_process

    def fetchable(self, tree: Any) -> Any:
        """``tree`` with every array this process cannot read whole gathered onto every replica (an all-gather)."""

        def one(a: Any) -> Any:
            if isinstance(a, jax.Array) and not a.is_fully_addressable:
                return self._gather(a)
            return a

        return jax.tree.map(one, tree)

    @property
    def placement_counts(self) -> dict[str, int]:
        """Batches placed so far: ``split`` over the replicas, ``replicated`` (short batches, computed whole)."""
        return dict(self._counts)

    def get_data_layout(self, data_shape: Any) -> TensorLayout:
        """Split along dim 0 when it divides by the replica count; otherwise replicate (a short batch)."""
        shape = tuple(data_shape)
        if shape and shape[0] is not None and shape[0] % len(self._devices) == 0:
            return super().get_data_layout(shape)
        return TensorLayout([None] * len(shape), self.device_mesh)

    def _sharding_for(self, rows: int | None) -> NamedSharding:
        if rows is not None and rows % len(self._devices) == 0:
            return self._split
        return self._replicated

    def place_batch(self, batch: Any) -> Any:
        """One global batch (a structure of host arrays) as global ``jax.Array``s on the replicas.

        Rows are split evenly over the replicas when they divide by the
        replica count, else the batch is replicated. In a multi-process job
        each process builds only its own devices' pieces from its copy of the
        global batch.
        """

        def place(a: Any) -> Any:
            if a is None:
                return None
            if not hasattr(a, "shape"):
                a = np.asarray(a)
            sharding = self._sharding_for(a.shape[0] if a.ndim else None)
            if not self._multi_process:
                return jax.device_put(a, sharding)
            host = np.asarray(a)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        placed = keras.tree.map_structure(place, batch)
        leaves = [a for a in keras.tree.flatten(placed) if a is not None]
        split = bool(leaves) and all(a.sharding == self._split for a in leaves if a.ndim)
        self._counts["split" if split else "replicated"] += 1
        return placed

    def place_local_batch(self, batch: Any) -> Any:
        """This process's part of one global batch (TF's ``FILE`` policy) as global ``jax.Array``s.

        The global batch is the processes' parts in process order. Parts whose rows divide by this
        process's replica count are placed on its replicas only; otherwise (a short last batch) the
        parts are gathered to every process and placed as :meth:`place_batch` places a global batch.

        Raises:
            ValueError: the parts differ in rows between processes (or between the batch's arrays).
        """
        if not self._multi_process:
            return self.place_batch(batch)
        from jax.experimental import multihost_utils

        leaves = [a for a in keras.tree.flatten(batch) if a is not None]
        rows = {int(np.shape(a)[0]) for a in leaves}
        if len(rows) != 1:
            raise ValueError(f"per-process batch: its arrays have different row counts {sorted(rows)}")
        (local_rows,) = rows
        everyone = np.asarray(multihost_utils.process_allgather(np.array([local_rows], np.int64))).ravel().tolist()
        if len(set(everyone)) != 1:
            raise ValueError(
                f"per-process batches (Batches(per_process=True)) must have the same rows on every process: "
                f"this batch has {everyone} rows on processes 0..{len(everyone) - 1}"
            )
        local_devices = sum(1 for d in self._devices if d.process_index == jax.process_index())
        if local_rows % local_devices == 0:
            placed = keras.tree.map_structure(
                lambda a: None if a is None else jax.make_array_from_process_local_data(self._split, np.asarray(a)), batch)
            self._counts["split"] += 1
            return placed
        whole = keras.tree.map_structure(
            lambda a: None if a is None else np.asarray(multihost_utils.process_allgather(np.asarray(a), tiled=True)),
            batch)
        return self.place_batch(whole)

    def batches(self, host_batches: Iterator[Any], per_process: bool = False) -> Iterator[Any]:
        """``place_batch`` (``place_local_batch`` when ``per_process``) over an iterator, one batch ahead
        (the transfer overlaps the previous step)."""
        place = self.place_local_batch if per_process else self.place_batch
        ahead = None
        for batch in host_batches:
            placed = place(batch)
            if ahead is not None:
                yield ahead
            ahead = placed
        if ahead is not None:
            yield ahead

    def __repr__(self) -> str:
        return f"StrategyDistribution({type(self._strategy).__name__}, {len(self._devices)} replicas)"


_install_lock = threading.Lock()
_installed = False
_registry_lock = threading.Lock()
#: The distribution of each mesh jaxdist made (strategies over the same devices place alike; the latest wins).
_by_mesh: weakref.WeakValueDictionary[Any, StrategyDistribution] = weakref.WeakValueDictionary()
#: The distribution of each Keras DeviceMesh jaxdist made, by id (one per strategy: a variable's layout names it).
_by_device_mesh: weakref.WeakValueDictionary[int, StrategyDistribution] = weakref.WeakValueDictionary()

def _first_sharding(model: Any) -> Any:
    for v in model.variables:
        # None while Keras holds the state itself (mid-fit); .value would fall back to the initializer.
        return getattr(compat.stored_value(v), "sharding", None)
    return None


def variable_distribution(variable: Any) -> StrategyDistribution | None:
    """The StrategyDistribution Keras ``variable`` was created under (None: none of jaxdist's).

    Keras gives every variable made while a distribution is current that distribution's layout (an
    optimizer's slots take their model variable's), whose mesh is the distribution's own.
    """
    mesh = getattr(compat.variable_layout(variable), "device_mesh", None)
    if mesh is None:
        return None
    with _registry_lock:
        dist = _by_device_mesh.get(id(mesh))
    return dist if dist is not None and dist.device_mesh is mesh else None


def model_distribution(model: Any) -> StrategyDistribution | None:
    """The StrategyDistribution whose replicas hold ``model``'s variables (None: not made in a jaxdist scope)."""
    mesh = getattr(_first_sharding(model), "mesh", None)
    if mesh is None:
        return None
    with _registry_lock:
        return _by_mesh.get(mesh)


def _check_model_devices(model: Any, dist: StrategyDistribution) -> None:
    sharding = _first_sharding(model)
    if sharding is None:
        return
    have = set(sharding.device_set)
    if have != set(dist.strategy.devices):
        raise ConfigurationError(
            f"this Keras model's variables live on {sorted(str(d) for d in have)}, not on the devices of "
            f"{type(dist.strategy).__name__}.scope() ({dist.num_replicas_in_sync} replicas): build and compile the "
            "model inside the strategy's scope (as TF requires), or run it outside the scope"
        )


def install_data_placement() -> None:
    """Hook jaxdist into Keras's JAX trainer (idempotent).

    - Keras's distributed input goes through :meth:`StrategyDistribution.batches`,
      only while a :class:`StrategyDistribution` is the current distribution
      (any other distribution, or none, gets Keras's own iterator);
    - ``fit``/``evaluate``/``predict``/``*_on_batch`` of a model whose variables
      were made in a jaxdist strategy's scope run under that strategy's
      distribution when no distribution is current (TF's rule: a model keeps
      the strategy it was created in, also outside the scope and in other
      threads, where Keras's thread-local distribution is unset).

    Raises ConfigurationError when the installed Keras lacks what is hooked
    (a Keras outside the range jaxdist's ``keras`` extra pins). The Keras
    attributes replaced are listed in :mod:`jaxdist.keras.compat`.
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        compat.install_trainer_patches(_placed_batches, _entry_point, _step_function)
        _installed = True


def _placed_batches(distribution: Any, data_adapter: Any) -> Iterator[Any] | None:
    """The epoch's batches placed on a StrategyDistribution's replicas (None: another distribution, Keras's own)."""
    if isinstance(distribution, StrategyDistribution):
        per_process = isinstance(data_adapter, Batches) and data_adapter.per_process
        return distribution.batches(data_adapter.get_jax_iterator(), per_process=per_process)
    return None


def _entry_point(method: Any, name: str) -> Any:
    return _under_model_distribution(method, name.endswith("_on_batch"))


def _step_function(model: Any, kind: str, inner: Any) -> Any:
    """The step function Keras's ``kind`` loop calls (what ``make_<kind>_function`` made, wrapped as needed)."""
    if kind == "predict":
        inner = _fetchable_predictions(inner)
    return _bounded_in_flight(inner)


#: Steps Keras's loop may dispatch before the oldest of them has finished. XLA's CPU client runs
#: the replicas of one step on a shared thread pool and limits the computations in flight per
#: device; when the loop runs far ahead (the device threads starved of CPU), a later computation
#: can hold a device's slot that an earlier step's all-reduce needs, and the process deadlocks
#: (reproduced: 2 of 6 fits of examples/keras_fit.py on 8 fake CPU devices beside 4 CPU hogs).
#: Two steps ahead keeps the next step's dispatch overlapped with this one's compute.
MAX_STEPS_IN_FLIGHT = 2

#: The step functions jaxdist made by wrapping Keras's (not wrapped again when Keras hands one back).
_BOUNDED: weakref.WeakSet[Any] = weakref.WeakSet()
_GATHERING: weakref.WeakSet[Any] = weakref.WeakSet()


def _bounded_in_flight(inner: Any) -> Any:
    """Under a StrategyDistribution, ``inner`` wrapped so that it waits for the step ``MAX_STEPS_IN_FLIGHT``
    calls back before returning (its outputs: the state is donated); else ``inner`` itself."""
    if not isinstance(keras.distribution.distribution(), StrategyDistribution) or inner in _BOUNDED:
        return inner
    pending: collections.deque[Any] = collections.deque()

    def step_function(state: Any, iterator: Any) -> Any:
        outputs, new_state = inner(state, iterator)
        pending.append(outputs)
        if len(pending) > MAX_STEPS_IN_FLIGHT:
            jax.block_until_ready(pending.popleft())
        return outputs, new_state

    _BOUNDED.add(step_function)
    return step_function


def _fetchable_predictions(inner: Any) -> Any:
    """In a multi-process job, ``inner`` (the predict step) wrapped so that its outputs are gathered to every
    process (Keras turns them into numpy); else ``inner`` itself."""
    dist = keras.distribution.distribution()
    if isinstance(dist, StrategyDistribution) and dist.multi_process and inner not in _GATHERING:

        def predict_function(state: Any, iterator: Any) -> Any:
            outputs, state = inner(state, iterator)
            return dist.fetchable(outputs), state

        _GATHERING.add(predict_function)
        return predict_function
    return inner


#: Keras callbacks that write files from every process (no multi-process logic): every process would
#: write the same path at once. The jaxdist subclass named beside each writes from process 0 only.
_EVERY_PROCESS_WRITERS = {
    "ModelCheckpoint": "jaxdist.keras.ModelCheckpoint",
    "BackupAndRestore": "jaxdist.keras.BackupAndRestore",
}


def _refuse_every_process_writers(callbacks: Any, strategy: Any) -> None:
    if not isinstance(callbacks, (list, tuple)):
        return  # None, or fit's own CallbackList handed to its validation evaluate (checked when fit was called)
    for cb in callbacks:
        for name, replacement in _EVERY_PROCESS_WRITERS.items():
            keras_class = getattr(keras.callbacks, name)
            if type(cb) is keras_class:  # exactly Keras's class: a subclass may have its own multi-process logic
                raise ConfigurationError(
                    f"keras.callbacks.{name} writes its files from every process of a multi-process "
                    f"{type(strategy).__name__} at once; use {replacement} (same arguments), which writes from process 0"
                )


def _under_model_distribution(method: Any, on_batch: bool) -> Any:
    signature = inspect.signature(method)

    def refuse_multi_process(dist: StrategyDistribution, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not dist.multi_process:
            return
        # Keras places an *_on_batch input as this process's part of the batch (make_array_from_process_local_data),
        # unlike fit, where every process feeds the global batch (TF's DATA policy): refuse rather than mix the two.
        if on_batch:
            raise NotImplementedError(
                f"{method.__name__} under a multi-process {type(dist.strategy).__name__} is not supported: use "
                "fit/evaluate/predict (every process passes the same global data)"
            )
        try:
            bound = signature.bind_partial(None, *args, **kwargs)
        except TypeError:
            return  # Keras itself reports the bad call
        _refuse_every_process_writers(bound.arguments.get("callbacks"), dist.strategy)

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        from jaxdist.keras import ps_fit
        from jaxdist.keras.ps_model import PSDistribution

        on_ps = ps_fit.route(self, method.__name__, method)
        if on_ps is not None:  # a model built in a ParameterServerStrategy's scope
            return on_ps(*args, **kwargs)
        current = keras.distribution.distribution()
        if isinstance(current, PSDistribution):
            raise ConfigurationError(
                f"this Keras model was not built in {type(current.strategy).__name__}.scope(): build and compile it "
                "inside the strategy's scope (as TF requires), or run it outside the scope")
        if current is None:
            dist = model_distribution(self)
            if dist is not None:
                refuse_multi_process(dist, args, kwargs)
                args, kwargs = _dataset_creator_input(signature, method.__name__, args, kwargs, dist)
                with dist.scope():
                    return method(self, *args, **kwargs)
        elif isinstance(current, StrategyDistribution):
            _check_model_devices(self, current)
            refuse_multi_process(current, args, kwargs)
        if current is None or isinstance(current, StrategyDistribution):
            args, kwargs = _dataset_creator_input(signature, method.__name__, args, kwargs, current)
        return method(self, *args, **kwargs)

    return run


def _dataset_creator_input(signature: inspect.Signature, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                           dist: StrategyDistribution | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args``/``kwargs`` of Keras entry point ``name`` with DatasetCreator inputs made readable by Keras
    (:func:`jaxdist.keras.data.creator_arguments`), for ``dist``'s replicas (None: one replica, one process)."""
    try:
        bound = signature.bind_partial(None, *args, **kwargs)
    except TypeError:
        return args, kwargs  # Keras itself reports the bad call
    arguments = dict(bound.arguments)
    if not any(is_dataset_fn(v) for v in arguments.values()):
        return args, kwargs
    if dist is None:
        context, local = InputContext(1, 0, 1), 1
    else:
        devices = list(np.asarray(dist.device_mesh.devices).ravel())
        processes = sorted({d.process_index for d in devices})
        me = jax.process_index()
        # One input pipeline per process (TF's distribute_datasets_from_function), in process order.
        context = InputContext(len(processes), processes.index(me), len(devices))
        local = sum(1 for d in devices if d.process_index == me)
    changed = creator_arguments(name, arguments, context, local)
    changed.pop(next(iter(signature.parameters)))  # self (bound to None above)
    for p in signature.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:  # evaluate's **kwargs, bound as one dict
            changed.update(changed.pop(p.name, {}))
    return (), changed
