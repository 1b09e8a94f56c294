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

The per-batch placement replaces ``JAXEpochIterator._get_distributed_iterator``
while a :class:`StrategyDistribution` is current (Keras has no public hook
for it: the one it has, ``get_data_layout``, is asked once per ``fit`` and
cached for every batch); with any other distribution, or none, Keras's own
code runs unchanged. See :func:`install_data_placement`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import keras
from keras.distribution import DataParallel, DeviceMesh, TensorLayout
from keras.src.distribution.distribution_lib import Distribution  # the base class (not exported by keras.distribution)

from jaxdist.base.errors import ConfigurationError

logger = logging.getLogger(__name__)

__all__ = ["StrategyDistribution", "UnsupportedStrategyDistribution", "install_data_placement"]

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

    @property
    def strategy(self) -> Any:
        """The jaxdist strategy this distribution stands for."""
        return self._strategy

    @property
    def num_replicas_in_sync(self) -> int:
        return len(self._devices)

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

    def batches(self, host_batches: Iterator[Any]) -> Iterator[Any]:
        """``place_batch`` over an iterator, one batch ahead (the transfer overlaps the previous step)."""
        ahead = None
        for batch in host_batches:
            placed = self.place_batch(batch)
            if ahead is not None:
                yield ahead
            ahead = placed
        if ahead is not None:
            yield ahead

    def __repr__(self) -> str:
        return f"StrategyDistribution({type(self._strategy).__name__}, {len(self._devices)} replicas)"


class UnsupportedStrategyDistribution(Distribution):
    """Current inside the scope of a strategy whose Keras integration does not exist yet.

    Every question Keras asks it (where a variable goes, how a batch or a layer
    output is laid out) raises ``NotImplementedError`` naming what is missing,
    so a Keras model can neither be built nor trained in that scope, instead of
    silently training somewhere else. Code in the scope that does not use
    Keras is unaffected.
    """

    def __init__(self, strategy: Any, missing: str) -> None:
        devices = np.array(jax.local_devices()[:1], dtype=object)
        super().__init__(DeviceMesh(shape=(1,), axis_names=[BATCH_AXIS], devices=devices), BATCH_AXIS, False)
        self._message = (
            f"Keras models under {type(strategy).__name__}.scope() are not supported yet: {missing}. "
            "Build and train the Keras model outside this scope, or use a synchronous strategy "
            "(MirroredStrategy, MultiWorkerMirroredStrategy, ...)"
        )

    @property
    def num_model_replicas(self) -> int:
        raise NotImplementedError(self._message)

    @property
    def placement_counts(self) -> dict[str, int]:
        """Batches placed so far: ``split`` over the replicas, ``replicated`` (short batches, computed whole)."""
        return dict(self._counts)

    def get_data_layout(self, data_shape: Any) -> TensorLayout:
        raise NotImplementedError(self._message)

    def get_variable_layout(self, variable: Any) -> TensorLayout:
        raise NotImplementedError(self._message)

    def get_tensor_layout(self, path: Any) -> TensorLayout | None:
        raise NotImplementedError(self._message)

    def distribute_dataset(self, dataset: Any) -> Any:
        raise NotImplementedError(self._message)


_install_lock = threading.Lock()
_installed = False


def install_data_placement() -> None:
    """Route Keras's distributed input through :meth:`StrategyDistribution.batches` (idempotent).

    Only while a :class:`StrategyDistribution` is the current distribution;
    any other distribution (or none) gets Keras's own iterator. Raises
    ConfigurationError when the installed Keras lacks the method (a Keras
    outside the range jaxdist's ``keras`` extra pins).
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        try:
            from keras.src.backend.jax.trainer import JAXEpochIterator
        except ImportError as e:  # pragma: no cover - depends on the installed Keras
            raise ConfigurationError(f"this Keras ({keras.__version__}) has no JAX trainer jaxdist knows: {e}") from e
        original = getattr(JAXEpochIterator, "_get_distributed_iterator", None)
        if original is None:  # pragma: no cover - depends on the installed Keras
            raise ConfigurationError(
                f"Keras {keras.__version__} is outside the range jaxdist supports (pip install 'jaxdist[keras]')"
            )

        def _get_distributed_iterator(self: Any, distribution: Any) -> Iterator[Any]:
            if isinstance(distribution, StrategyDistribution):
                return distribution.batches(self.data_adapter.get_jax_iterator())
            return original(self, distribution)

        JAXEpochIterator._get_distributed_iterator = _get_distributed_iterator
        _installed = True
