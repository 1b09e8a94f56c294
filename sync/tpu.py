"""TPU set-up as in TF's TPU guide: connect to the slice, initialise it, assign devices.

TF::

    resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu="")
    tf.config.experimental_connect_to_cluster(resolver)
    topology = tf.tpu.experimental.initialize_tpu_system(resolver)
    da = tf.tpu.experimental.DeviceAssignment.build(topology, num_replicas=4)
    strategy = tf.distribute.TPUStrategy(resolver, experimental_device_assignment=da)

jaxdist (same calls, ``jaxdist.`` instead of TF's modules)::

    resolver = jaxdist.TPUClusterResolver(tpu="")
    jaxdist.experimental_connect_to_cluster(resolver)   # jax.distributed across the slice's hosts
    topology = jaxdist.initialize_tpu_system(resolver)
    da = jaxdist.DeviceAssignment.build(topology, num_replicas=4)
    strategy = jaxdist.TPUStrategy(resolver, experimental_device_assignment=da)

What differs: JAX initialises the TPUs itself when a process first uses
them, so :func:`initialize_tpu_system` brings nothing up but the answer (the
:class:`Topology`); :func:`experimental_connect_to_cluster` starts
``jax.distributed`` (every host must call it, before any other JAX call),
where TF connects one client to remote TPU workers. A replica is one device:
``DeviceAssignment`` with more than one core per replica (model parallelism)
is refused with a pointer to ``jax.sharding``.

Off TPU, ``JAXDIST_TPU_FAKE_DEVICES=cpu`` runs all of this on (fake) CPU
devices, with coordinates made up from ``TPU_CHIPS_PER_HOST_BOUNDS`` /
``TPU_HOST_BOUNDS`` (tests, development).
"""

from __future__ import annotations

import enum
import logging
import os
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxdist.base.cluster_resolver.tpu import TPUClusterResolver
from jaxdist.base.errors import ConfigurationError

logger = logging.getLogger(__name__)

__all__ = ["Topology", "DeviceAssignment", "DeviceOrderMode", "experimental_connect_to_cluster", "initialize_tpu_system"]

ENV_TPU_FAKE_DEVICES = "JAXDIST_TPU_FAKE_DEVICES"


def _fake_platform() -> str:
    return os.environ.get(ENV_TPU_FAKE_DEVICES, "").strip()


def experimental_connect_to_cluster(
    cluster_spec_or_resolver: Any,
    job_name: str = "localhost",
    task_index: int = 0,
    protocol: str | None = None,
    make_master_device_default: bool = True,
    cluster_device_filters: Any = None,
    *,
    initialization_timeout: int = 300,
) -> None:
    """Bring up ``jax.distributed`` across the TPU slice's hosts (TF's ``tf.config.experimental_connect_to_cluster``).

    Every host calls it with its own resolver, before any other JAX call.
    Process ``p`` (see :attr:`TPUClusterResolver.process_id`) joins JAX's
    coordinator at :attr:`TPUClusterResolver.coordinator_address`; afterwards
    ``jax.devices()`` lists the TPUs of every host. With one host it does
    nothing. Called again with the same job, it does nothing.

    Args:
        cluster_spec_or_resolver: a :class:`jaxdist.TPUClusterResolver`.
        job_name, task_index, make_master_device_default: TF's client-side
            settings; jaxdist has no client job or master device, so only
            their defaults are accepted.
        protocol: ``None`` or ``"grpc"``.
        cluster_device_filters: must be None (TF device filters do not apply to JAX).
        initialization_timeout: seconds to wait for every host to join.

    Raises:
        ConfigurationError: not a TPUClusterResolver, a non-default TF-only
            argument, or JAX was already used in this process.
    """
    if not isinstance(cluster_spec_or_resolver, TPUClusterResolver):
        raise ConfigurationError(
            "experimental_connect_to_cluster wants a jaxdist.TPUClusterResolver. For multi-host training on GPUs "
            "or CPUs use jaxdist.MultiWorkerMirroredStrategy(resolver), which connects the hosts itself"
        )
    if job_name != "localhost" or task_index != 0 or not make_master_device_default or cluster_device_filters is not None:
        raise ConfigurationError(
            "experimental_connect_to_cluster: job_name, task_index, make_master_device_default and "
            "cluster_device_filters configure TF's client session, which JAX does not have; leave them at their "
            "defaults (every host runs the same script and connects itself)"
        )
    if protocol not in (None, "grpc"):
        raise ConfigurationError(f"experimental_connect_to_cluster(protocol={protocol!r}): only 'grpc' is used")
    resolver = cluster_spec_or_resolver
    n, pid = resolver.num_processes, resolver.process_id
    if n == 1:
        logger.info("experimental_connect_to_cluster: one host, nothing to connect")
        return
    if jax.distributed.is_initialized():
        if jax.process_count() == n and jax.process_index() == pid:
            return
        raise ConfigurationError(
            f"jax.distributed is already initialized for {jax.process_count()} processes (this one {jax.process_index()}), "
            f"but the resolver describes {n} (this one {pid})"
        )
    from jaxdist.sync.job_session import backends_initialized

    if backends_initialized():
        raise ConfigurationError(
            "JAX is already in use in this process, so it can no longer join the TPU slice's hosts. Call "
            "jaxdist.experimental_connect_to_cluster(resolver) first, before any other JAX call"
        )
    addr = resolver.coordinator_address
    kwargs: dict[str, Any] = {}
    host = addr.rpartition(":")[0]
    from jaxdist.transport.channel import is_loopback

    if pid == 0 and is_loopback(host):
        kwargs["coordinator_bind_address"] = addr
    if _fake_platform() == "cpu" and getattr(jax.config, "jax_cpu_collectives_implementation", None) in (None, "none"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    logger.info("jax.distributed.initialize(%s, num_processes=%d, process_id=%d)", addr, n, pid)
    jax.distributed.initialize(addr, num_processes=n, process_id=pid, initialization_timeout=initialization_timeout, **kwargs)


def _tpu_or_fake_devices() -> list[Any]:
    fake = _fake_platform()
    if fake:
        return sorted(jax.devices(fake), key=lambda d: (d.process_index, d.id))
    try:
        devs = jax.devices("tpu")
    except RuntimeError:
        devs = []
    if not devs:
        raise ConfigurationError(
            "initialize_tpu_system: no TPU devices were found (JAX sees only: "
            f"{', '.join(sorted({d.platform for d in jax.devices()}))}). Run on a Cloud TPU VM, or set "
            f"{ENV_TPU_FAKE_DEVICES}=cpu to exercise the TPU code path on CPU devices"
        )
    return sorted(devs, key=lambda d: (d.process_index, d.id))


def initialize_tpu_system(cluster_resolver: TPUClusterResolver | None = None) -> Topology:
    """The slice's :class:`Topology` (TF's ``tf.tpu.experimental.initialize_tpu_system``).

    JAX initialises the TPU runtime on first use, so this checks the slice is
    what the resolver says (every host connected, the device count) and
    describes it. On several hosts, call :func:`experimental_connect_to_cluster` first.
    """
    resolver = cluster_resolver if cluster_resolver is not None else TPUClusterResolver.default()
    if not isinstance(resolver, TPUClusterResolver):
        raise ConfigurationError("initialize_tpu_system wants a jaxdist.TPUClusterResolver")
    if resolver.num_processes > 1 and jax.process_count() != resolver.num_processes:
        raise ConfigurationError(
            f"initialize_tpu_system: the slice has {resolver.num_processes} hosts but this process sees "
            f"{jax.process_count()}; call jaxdist.experimental_connect_to_cluster(resolver) first (on every host)"
        )
    devices = _tpu_or_fake_devices()
    return Topology.from_devices(devices, resolver)


class Topology:
    """The physical layout of the slice's devices (TF's ``tf.tpu.experimental.Topology``).

    Attributes:
        mesh_shape: ``[x, y, z, cores_per_chip]``.
        device_coordinates: ``(num_tasks, num_tpus_per_task, 4)`` int array:
            the coordinates of each task's (host's) devices, in device order.
        devices: ``devices[task][ordinal]``, the ``jax.Device`` at each place.
    """

    def __init__(self, devices: Sequence[Sequence[Any]], device_coordinates: np.ndarray, mesh_shape: Sequence[int]) -> None:
        self.devices = [list(d) for d in devices]
        self.device_coordinates = np.asarray(device_coordinates, np.int32)
        self.mesh_shape = np.asarray(mesh_shape, np.int32)
        if self.device_coordinates.shape[:2] != (len(self.devices), len(self.devices[0])) or self.device_coordinates.shape[2] != 4:
            raise ValueError(f"device_coordinates has shape {self.device_coordinates.shape}, expected (tasks, devices, 4)")
        self._at: dict[tuple[int, ...], tuple[int, int]] = {}
        for t in range(self.num_tasks):
            for o in range(self.num_tpus_per_task):
                c = tuple(int(v) for v in self.device_coordinates[t, o])
                if c in self._at:
                    raise ValueError(f"two devices at coordinates {c}")
                self._at[c] = (t, o)

    @classmethod
    def from_devices(cls, devices: Sequence[Any], resolver: TPUClusterResolver | None = None) -> Topology:
        """From JAX devices: TPU devices carry ``coords``/``core_on_chip``; others get coordinates from the resolver's bounds."""
        by_task: dict[int, list[Any]] = {}
        for d in devices:
            by_task.setdefault(d.process_index, []).append(d)
        tasks = [sorted(by_task[p], key=lambda d: d.id) for p in sorted(by_task)]
        per_task = len(tasks[0])
        if any(len(t) != per_task for t in tasks):
            raise ConfigurationError(f"every host must have the same number of devices, got {[len(t) for t in tasks]}")
        coords = np.zeros((len(tasks), per_task, 4), np.int32)
        if all(hasattr(d, "coords") and getattr(d, "coords", None) is not None for d in devices) and devices[0].platform == "tpu":
            for t, devs in enumerate(tasks):
                for o, d in enumerate(devs):
                    coords[t, o, :3] = list(d.coords)[:3]
                    coords[t, o, 3] = int(getattr(d, "core_on_chip", 0))
        else:
            meta = resolver.get_tpu_system_metadata() if resolver is not None else None
            cpb = meta.chips_per_host_bounds if meta is not None and np.prod(meta.chips_per_host_bounds) == per_task else (per_task, 1, 1)
            hb = meta.host_bounds if meta is not None and np.prod(meta.host_bounds) == len(tasks) else (1, 1, len(tasks))
            for t in range(len(tasks)):
                host = (t % hb[0], (t // hb[0]) % hb[1], t // (hb[0] * hb[1]))
                for o in range(per_task):
                    chip = (o % cpb[0], (o // cpb[0]) % cpb[1], o // (cpb[0] * cpb[1]))
                    coords[t, o, :3] = [host[k] * cpb[k] + chip[k] for k in range(3)]
        mesh = [int(coords[:, :, k].max()) + 1 for k in range(4)]
        return cls(tasks, coords, mesh)

    @property
    def mesh_rank(self) -> int:
        return 4

    @property
    def num_tasks(self) -> int:
        return len(self.devices)

    @property
    def num_tpus_per_task(self) -> int:
        return len(self.devices[0])

    @property
    def missing_devices(self) -> np.ndarray:
        """Coordinates in the mesh with no device (none on a whole slice)."""
        all_c = {tuple(c) for c in np.ndindex(*self.mesh_shape)}
        return np.asarray(sorted(all_c - set(self._at)), np.int32).reshape(-1, 4)

    def _lookup(self, device_coordinates: Sequence[int]) -> tuple[int, int]:
        c = tuple(int(v) for v in device_coordinates)
        if len(c) != 4:
            raise ValueError(f"coordinates must have 4 entries (x, y, z, core), got {c}")
        if c not in self._at:
            raise ValueError(f"no device at coordinates {c} (mesh_shape {self.mesh_shape.tolist()})")
        return self._at[c]

    def task_ordinal_at_coordinates(self, device_coordinates: Sequence[int]) -> int:
        return self._lookup(device_coordinates)[0]

    def tpu_device_ordinal_at_coordinates(self, device_coordinates: Sequence[int]) -> int:
        return self._lookup(device_coordinates)[1]

    def device_at_coordinates(self, device_coordinates: Sequence[int]) -> Any:
        """The ``jax.Device`` at these coordinates (jaxdist's addition)."""
        t, o = self._lookup(device_coordinates)
        return self.devices[t][o]

    def tpu_device_name_at_coordinates(self, device_coordinates: Sequence[int], job: str | None = None) -> str:
        t, o = self._lookup(device_coordinates)
        return f"/job:{job or 'worker'}/replica:0/task:{t}/device:TPU:{o}"

    def cpu_device_name_at_coordinates(self, device_coordinates: Sequence[int], job: str | None = None) -> str:
        t, _ = self._lookup(device_coordinates)
        return f"/job:{job or 'worker'}/replica:0/task:{t}/device:CPU:0"

    def __repr__(self) -> str:
        return f"Topology(mesh_shape={self.mesh_shape.tolist()}, num_tasks={self.num_tasks}, num_tpus_per_task={self.num_tpus_per_task})"


class DeviceOrderMode(enum.Enum):
    """Replica order of :meth:`DeviceAssignment.build` (TF's ``DeviceOrderMode``)."""

    AUTO = "AUTO"
    RING = "RING"
    MESH = "MESH"


class DeviceAssignment:
    """Which device runs each replica (TF's ``tf.tpu.experimental.DeviceAssignment``).

    Args:
        topology: the slice's :class:`Topology` (from :func:`initialize_tpu_system`).
        core_assignment: int array ``(num_replicas, num_cores_per_replica, 4)``:
            the coordinates of replica ``r``'s cores. jaxdist runs one device
            per replica (``num_cores_per_replica`` must be 1); any subset of
            the devices, in any order, makes a logical mesh of that order.
    """

    def __init__(self, topology: Topology, core_assignment: Any) -> None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a jaxdist.Topology, got {type(topology).__name__}")
        ca = np.asarray(core_assignment, np.int32)
        if ca.ndim != 3 or ca.shape[2] != 4:
            raise ValueError(f"core_assignment must have shape (num_replicas, num_cores_per_replica, 4), got {ca.shape}")
        if ca.shape[1] != 1:
            raise ConfigurationError(
                f"DeviceAssignment with {ca.shape[1]} cores per replica: jaxdist's replicas are one device each. "
                "For model parallelism shard the model with jax.sharding inside fn"
            )
        self._topology = topology
        self._core_assignment = ca
        devices = [topology.device_at_coordinates(ca[r, 0]) for r in range(ca.shape[0])]
        if len(set(devices)) != len(devices):
            raise ValueError("core_assignment places two replicas on the same device")
        self._devices = devices

    @classmethod
    def build(
        cls,
        topology: Topology,
        computation_shape: Sequence[int] | None = None,
        computation_stride: Sequence[int] | None = None,
        num_replicas: int = 1,
        device_order_mode: DeviceOrderMode | str = DeviceOrderMode.AUTO,
    ) -> DeviceAssignment:
        """Place ``num_replicas`` one-device replicas on the slice (TF's ``DeviceAssignment.build``).

        Devices are taken in order: ``AUTO``/``MESH`` walk the mesh with x
        fastest, then y, z and the core; ``RING`` walks each z-plane in a
        snake (x forward on even rows, backward on odd ones), so neighbours
        in replica order are neighbours in the torus. ``computation_stride``
        keeps every ``stride``-th position along each axis.
        """
        if computation_shape is not None and any(int(c) != 1 for c in computation_shape):
            raise ConfigurationError(
                f"computation_shape={list(computation_shape)}: jaxdist runs one device per replica; use "
                "jax.sharding inside fn for model parallelism"
            )
        mode = DeviceOrderMode(device_order_mode.upper()) if isinstance(device_order_mode, str) else device_order_mode
        stride = [1, 1, 1, 1] if computation_stride is None else [int(s) for s in computation_stride]
        if len(stride) != 4 or min(stride) < 1:
            raise ValueError(f"computation_stride must be 4 positive integers, got {computation_stride}")
        xs, ys, zs, cs = (range(0, int(n), s) for n, s in zip(topology.mesh_shape, stride))
        order: list[tuple[int, int, int, int]] = []
        for z in zs:
            for yi, y in enumerate(ys):
                xr = list(xs)
                if mode is DeviceOrderMode.RING and yi % 2:
                    xr.reverse()
                for x in xr:
                    for c in cs:
                        order.append((x, y, z, c))
        order = [c for c in order if c in topology._at]
        if not 1 <= num_replicas <= len(order):
            raise ValueError(f"num_replicas={num_replicas}, but the slice has {len(order)} devices at that stride")
        return cls(topology, np.asarray(order[:num_replicas], np.int32)[:, None, :])

    @property
    def topology(self) -> Topology:
        return self._topology

    @property
    def core_assignment(self) -> np.ndarray:
        return self._core_assignment

    @property
    def num_replicas(self) -> int:
        return int(self._core_assignment.shape[0])

    @property
    def num_cores_per_replica(self) -> int:
        return int(self._core_assignment.shape[1])

    @property
    def replica_devices(self) -> list[Any]:
        """The ``jax.Device`` of each replica, in replica order."""
        return list(self._devices)

    def coordinates(self, replica: int, logical_core: int) -> tuple[int, ...]:
        return tuple(int(v) for v in self._core_assignment[replica, logical_core])

    def lookup_replicas(self, task_id: int, logical_core: int) -> list[int]:
        """The replicas whose ``logical_core`` is on task (host) ``task_id``."""
        found = [
            r
            for r in range(self.num_replicas)
            if self._topology.task_ordinal_at_coordinates(self._core_assignment[r, logical_core]) == task_id
        ]
        if not found:
            raise ValueError(f"no replica has logical core {logical_core} on task {task_id}")
        return found

    def tpu_ordinal(self, replica: int = 0, logical_core: int = 0) -> int:
        return self._topology.tpu_device_ordinal_at_coordinates(self._core_assignment[replica, logical_core])

    def host_device(self, replica: int = 0, logical_core: int = 0, job: str | None = None) -> str:
        return self._topology.cpu_device_name_at_coordinates(self._core_assignment[replica, logical_core], job)

    def tpu_device(self, replica: int = 0, logical_core: int = 0, job: str | None = None) -> str:
        return self._topology.tpu_device_name_at_coordinates(self._core_assignment[replica, logical_core], job)

    def __repr__(self) -> str:
        return f"DeviceAssignment(num_replicas={self.num_replicas}, devices={self._devices})"
