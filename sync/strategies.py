"""The public synchronous strategies: Mirrored, OneDevice, CentralStorage, TPU (TF's names and
constructor arguments), each a :class:`~jaxdist.sync.mesh.MeshStrategy` on its devices.

OneDevice and CentralStorage place values differently from the others: their
engines (:class:`OneDeviceEngine`, :class:`CentralStorageEngine`) say how.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import SingleDeviceSharding

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import ValueContext
from jaxdist.sync import cross_device_ops as cdo
from jaxdist.sync.engine import MeshEngine
from jaxdist.sync.mesh import MeshStrategy
from jaxdist.sync.strategy import ENV_TPU_FAKE_DEVICES
from jaxdist.sync.values import is_tracer

logger = logging.getLogger(__name__)

__all__ = ["MirroredStrategy", "OneDeviceStrategy", "CentralStorageStrategy", "TPUStrategy"]


# ---------------------------------------------------------------------------------------
# Public strategies
# ---------------------------------------------------------------------------------------


def resolve_device(spec: Any) -> jax.Device:
    """A ``jax.Device`` from a device, an int (index into ``jax.devices()``) or a TF-style string."""
    if isinstance(spec, jax.Device):
        return spec
    if isinstance(spec, int):
        return jax.devices()[spec]
    if isinstance(spec, str):
        s = spec.strip().lower().lstrip("/")
        if s.startswith("device:"):
            s = s[len("device:") :]
        kind, _, idx = s.partition(":")
        kind = {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "cpu": "cpu"}.get(kind, kind)
        try:
            devs = jax.devices(kind)
        except RuntimeError as e:
            raise ConfigurationError(f"device {spec!r}: no {kind!r} devices ({e})") from None
        i = int(idx) if idx.isdigit() else 0
        if not 0 <= i < len(devs):
            raise ConfigurationError(f"device {spec!r}: only {len(devs)} {kind} device(s) exist")
        return devs[i]
    raise ConfigurationError(f"cannot interpret {spec!r} as a device (pass a jax.Device, an int or 'cpu:0')")


def _check_cross_device_ops(ops: Any) -> cdo.CrossDeviceOps:
    if ops is None:
        return cdo.CrossDeviceOps()
    if not isinstance(ops, cdo.CrossDeviceOps):
        raise TypeError(
            "cross_device_ops must be a jaxdist.CrossDeviceOps (jaxdist.NcclAllReduce(), "
            "jaxdist.HierarchicalCopyAllReduce(), jaxdist.ReductionToOneDevice(), or a subclass implementing "
            f"all_reduce_sum), got {type(ops).__name__}"
        )
    return ops


class MirroredStrategy(MeshStrategy):
    """Synchronous data parallelism over one host's devices (``tf.distribute.MirroredStrategy``).

    Variables are mirrored on every device; each step runs ``fn`` on every
    replica in one XLA program and all-reduces with XLA collectives.

    Args:
        devices: the devices to use (``jax.Device``s, indices or strings such
            as ``"cpu:0"``/``"/gpu:1"``); default: all local devices.
        cross_device_ops: how in-replica all-reduces are done
            (:class:`jaxdist.NcclAllReduce`, :class:`jaxdist.HierarchicalCopyAllReduce`,
            :class:`jaxdist.ReductionToOneDevice`); default one fused psum.
            See :mod:`jaxdist.sync.cross_device_ops`.
    """

    def __init__(self, devices: Sequence[Any] | None = None, cross_device_ops: Any = None) -> None:
        devs = jax.local_devices() if devices is None else [resolve_device(d) for d in devices]
        super().__init__(devs)
        self._engine.cross_device_ops = _check_cross_device_ops(cross_device_ops)


class OneDeviceEngine(MeshEngine):
    """One replica whose batches are plain arrays on its device (``OneDeviceStrategy``)."""

    yields_plain_arrays = True

    def distribute_local(self, stacked_local: Any, rows: np.ndarray | None = None, guard: bool = False) -> Any:
        x = stacked_local[0]
        if rows is not None and guard:  # no mask asked for: the batch keeps its real rows, as in TF
            x = x[: int(rows[0])]
        return jax.device_put(x, self.devices[0])


class OneDeviceStrategy(MeshStrategy):
    """Everything on one device, through the same API (``tf.distribute.OneDeviceStrategy``).

    Datasets yield plain arrays on the device (no ``PerReplica``; a short
    batch keeps its real row count, as in TF); ``run`` compiles ``fn`` like
    the other strategies, with one replica.

    Args:
        device: a ``jax.Device``, an index into ``jax.devices()`` or a string
            such as ``"cpu:0"``, ``"/gpu:0"`` or ``"/device:CPU:0"``.
    """

    def __init__(self, device: Any) -> None:
        super().__init__([resolve_device(device)])

    def _new_engine(self, devices: list[jax.Device]) -> MeshEngine:
        return OneDeviceEngine(self, devices)

    @property
    def device(self) -> jax.Device:
        return self.devices[0]

    def experimental_distribute_values_from_function(self, value_fn: Callable[[ValueContext], Any]) -> Any:
        self._check_cross_replica("experimental_distribute_values_from_function")
        return jax.tree.map(lambda x: jax.device_put(x, self.device), value_fn(ValueContext(0, 1)))


class CentralStorageEngine(MeshEngine):
    """Replicas on the compute devices, mirrored variables and replicated outputs on one parameter device."""

    def __init__(self, strategy: CentralStorageStrategy, devices: list[jax.Device], parameter_device: jax.Device) -> None:
        super().__init__(strategy, devices)
        self._central = SingleDeviceSharding(parameter_device)

    def store_variable(self, x: Any) -> Any:
        if is_tracer(x):
            return x
        return jax.device_put(x, self._central)

    def finish_replicated(self, x: Any) -> Any:
        if is_tracer(x):
            return x
        return jax.device_put(x, self._central)


class CentralStorageStrategy(MeshStrategy):
    """Variables on one device, compute on all local devices (``tf.distribute.experimental.CentralStorageStrategy``).

    Mirrored variables (and :meth:`replicate`'s values) live on the parameter
    device. Each ``run`` copies the ones ``fn`` uses to the compute devices,
    runs ``fn`` on every replica (the gradient all-reduce is an XLA
    collective) and copies every replicated output (the updated variables)
    back to the parameter device, so between steps one copy of the variables
    exists, on the parameter device.

    Args:
        compute_devices: devices that run the replicas; default all local devices.
        parameter_device: where variables live; default the first CPU device.
    """

    def __init__(self, compute_devices: Sequence[Any] | None = None, parameter_device: Any = None) -> None:
        devs = jax.local_devices() if compute_devices is None else [resolve_device(d) for d in compute_devices]
        self._parameter_device = jax.devices("cpu")[0] if parameter_device is None else resolve_device(parameter_device)
        super().__init__(devs)

    def _new_engine(self, devices: list[jax.Device]) -> MeshEngine:
        return CentralStorageEngine(self, devices, self._parameter_device)

    @property
    def parameter_device(self) -> jax.Device:
        return self._parameter_device


class TPUStrategy(MeshStrategy):
    """Synchronous training on TPU cores (``tf.distribute.TPUStrategy``).

    Set-up as in TF's TPU guide::

        resolver = jaxdist.TPUClusterResolver(tpu="")            # reads the Cloud TPU VM environment
        jaxdist.experimental_connect_to_cluster(resolver)        # jax.distributed across the slice's hosts
        topology = jaxdist.initialize_tpu_system(resolver)
        strategy = jaxdist.TPUStrategy(resolver)

    The replicas are the TPU devices JAX sees (all hosts of the slice), or
    the devices of ``experimental_device_assignment`` (a
    :class:`jaxdist.DeviceAssignment`: which devices, in which replica
    order). The code path is the one of :class:`MirroredStrategy`: mirrored
    variables, one compiled step per ``run``, XLA collectives over the
    ``"replica"`` axis.

    Without TPUs it raises :class:`~jaxdist.base.errors.ConfigurationError`. To run
    the TPU code path on other devices (tests, development), either pass the
    devices explicitly, e.g. ``TPUStrategy(devices=jax.devices("cpu"))``, or set
    ``JAXDIST_TPU_FAKE_DEVICES=cpu`` (with
    ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` for 8 fake CPU devices).

    Args:
        tpu_cluster_resolver: a :class:`jaxdist.TPUClusterResolver` (TF's
            keyword; ``cluster_resolver`` is accepted as well). Default: one
            built from the environment, as TF's ``TPUClusterResolver('')``.
        experimental_device_assignment: a :class:`jaxdist.DeviceAssignment`
            (``device_assignment`` is accepted as TF1's name for it).
        experimental_spmd_xla_partitioning: TF's model parallelism inside a
            replica; not supported (replicas are single devices here): use
            ``jax.sharding`` inside ``fn`` for model parallelism.
        devices: use these devices instead of the TPUs.
    """

    def __init__(
        self,
        tpu_cluster_resolver: Any = None,
        experimental_device_assignment: Any = None,
        experimental_spmd_xla_partitioning: bool = False,
        *,
        device_assignment: Any = None,
        cluster_resolver: Any = None,
        devices: Sequence[Any] | None = None,
    ) -> None:
        from jaxdist.sync import tpu as tpu_lib

        if tpu_cluster_resolver is not None and cluster_resolver is not None:
            raise ConfigurationError("pass tpu_cluster_resolver or cluster_resolver, not both (they are the same)")
        if experimental_device_assignment is not None and device_assignment is not None:
            raise ConfigurationError(
                "pass experimental_device_assignment or device_assignment, not both (they are the same)"
            )
        if experimental_spmd_xla_partitioning:
            raise ConfigurationError(
                "experimental_spmd_xla_partitioning=True (TF's model parallelism inside a replica) is not "
                "supported: jaxdist's replicas are one device each. Shard the model with jax.sharding inside fn, "
                "or use a larger DeviceAssignment-free mesh with jax.jit directly"
            )
        resolver = tpu_cluster_resolver if tpu_cluster_resolver is not None else cluster_resolver
        assignment = experimental_device_assignment if experimental_device_assignment is not None else device_assignment
        self._resolver = resolver
        if assignment is not None:
            if devices is not None:
                raise ConfigurationError("pass devices or a device assignment, not both")
            if not isinstance(assignment, tpu_lib.DeviceAssignment):
                raise TypeError(
                    f"experimental_device_assignment must be a jaxdist.DeviceAssignment, got {type(assignment).__name__}"
                )
            devs = list(assignment.replica_devices)
        elif devices is not None:
            devs = [resolve_device(d) for d in devices]
        else:
            devs = _tpu_devices()
        self._device_assignment = assignment
        super().__init__(devs)

    @property
    def cluster_resolver(self) -> Any:
        """The TPUClusterResolver (TF returns a default ``TPUClusterResolver('')`` when none was given)."""
        if self._resolver is None:
            from jaxdist.base.cluster_resolver.tpu import TPUClusterResolver

            self._resolver = TPUClusterResolver.default()
        return self._resolver

    @property
    def experimental_device_assignment(self) -> Any:
        """The DeviceAssignment the strategy was built with (None: every TPU in JAX's order)."""
        return self._device_assignment


def _tpu_devices() -> list[jax.Device]:
    fake = os.environ.get(ENV_TPU_FAKE_DEVICES, "").strip()
    if fake:
        try:
            devs = jax.devices(fake)
        except RuntimeError as e:
            raise ConfigurationError(f"{ENV_TPU_FAKE_DEVICES}={fake!r}: no such JAX platform ({e})") from None
        logger.warning(
            "TPUStrategy: running on %d %s device(s) instead of TPUs (%s is set)", len(devs), fake, ENV_TPU_FAKE_DEVICES
        )
        return sorted(devs, key=lambda d: (d.process_index, d.id))
    try:
        devs = jax.devices("tpu")
    except RuntimeError:
        devs = []
    if not devs:
        platforms = sorted({d.platform for d in jax.devices()})
        raise ConfigurationError(
            f"TPUStrategy: no TPU devices were found (JAX sees only: {', '.join(platforms)}). "
            "Run on a Cloud TPU VM, or, to exercise the TPU code path on other devices, pass "
            "TPUStrategy(devices=jax.devices('cpu')) or set "
            f"{ENV_TPU_FAKE_DEVICES}=cpu (add XLA_FLAGS=--xla_force_host_platform_device_count=8 "
            "for 8 fake CPU devices)"
        )
    return sorted(devs, key=lambda d: (d.process_index, d.id))
