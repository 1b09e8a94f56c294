"""``TPUClusterResolver``: the hosts of a Cloud TPU slice, as TF's resolver of that name.

On a Cloud TPU VM (and in GKE TPU pods) every host of a slice runs the same
script, and the TPU runtime describes the slice in environment variables;
this resolver reads them, without querying the GCE metadata server (so it
works in containers that cannot reach it, and in tests):

==============================  ===========================================================
``TPU_WORKER_HOSTNAMES``        the slice's hosts, comma-separated, in worker-id order
                                (``TPU_PROCESS_ADDRESSES`` wins when set, as in JAX)
``TPU_WORKER_ID``               this host's index in that list
``TPU_ACCELERATOR_TYPE``        e.g. ``v4-16`` (generation and TensorCore count)
``TPU_CHIPS_PER_HOST_BOUNDS``   e.g. ``2,2,1``: chips per host along x, y, z (optional)
``TPU_HOST_BOUNDS``             e.g. ``1,1,2``: hosts along x, y, z (optional)
``MEGASCALE_NUM_SLICES``,       multislice: slice count, this slice's index and the
``MEGASCALE_SLICE_ID``,         coordinator host (optional)
``MEGASCALE_COORDINATOR_ADDRESS``
==============================  ===========================================================

The JAX coordinator (``jax.distributed``) runs on the first host, port
:data:`JAX_COORDINATOR_PORT` (JAX's own choice), unless
``coordinator_address`` says otherwise. Process ``p`` of the job is worker
``TPU_WORKER_ID`` of slice ``MEGASCALE_SLICE_ID``: ``p = slice * hosts + worker``.

TF's arguments that only make sense for the Cloud TPU API (a TPU *name*
looked up with ``zone``/``project``/``credentials``) or for TPU Nodes
(``tpu="grpc://..."``) raise :class:`~jaxdist.base.errors.ConfigurationError`
explaining what to do instead: JAX drives TPU VMs from the VM itself.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from jaxdist.base.cluster_resolver.base import ClusterResolver, ClusterSpec
from jaxdist.base.errors import ConfigurationError

__all__ = ["TPUClusterResolver", "TPUSystemMetadata", "JAX_COORDINATOR_PORT", "TF_TPU_PORT"]

#: Port of JAX's distributed coordinator on the first host (the one ``jax.distributed`` picks on TPU VMs).
JAX_COORDINATOR_PORT = 8482
#: Port TF's TPU workers listen on; used for the addresses in :meth:`TPUClusterResolver.cluster_spec`.
TF_TPU_PORT = 8470

ENV_HOSTNAMES = "TPU_WORKER_HOSTNAMES"
ENV_PROCESS_ADDRESSES = "TPU_PROCESS_ADDRESSES"
ENV_WORKER_ID = "TPU_WORKER_ID"
ENV_ACCELERATOR_TYPE = "TPU_ACCELERATOR_TYPE"
ENV_CHIPS_PER_HOST_BOUNDS = "TPU_CHIPS_PER_HOST_BOUNDS"
ENV_HOST_BOUNDS = "TPU_HOST_BOUNDS"
ENV_NUM_SLICES = "MEGASCALE_NUM_SLICES"
ENV_SLICE_ID = "MEGASCALE_SLICE_ID"
ENV_MEGASCALE_COORDINATOR = "MEGASCALE_COORDINATOR_ADDRESS"

#: TensorCores per chip that JAX shows as separate devices (v2/v3); v4 and later show one device per chip.
_CORES_PER_DEVICE_CHIP = {"v2": 2, "v3": 2}
#: Chips per host when TPU_CHIPS_PER_HOST_BOUNDS is absent.
_DEFAULT_CHIPS_PER_HOST = {"v2": 4, "v3": 4, "v4": 4, "v5litepod": 8, "v5e": 8, "v5p": 4, "v6e": 8}


@dataclass(frozen=True)
class TPUSystemMetadata:
    """What the slice looks like (TF's ``TPUSystemMetadata``).

    Attributes:
        num_cores: TPU devices JAX shows across the slice (all hosts).
        num_hosts: hosts (processes) in the job.
        num_of_cores_per_host: devices per host.
        accelerator_type: e.g. ``"v4-16"`` (``""`` when unknown).
        chips_per_host_bounds, host_bounds: the physical layout, (x, y, z).
    """

    num_cores: int
    num_hosts: int
    num_of_cores_per_host: int
    accelerator_type: str
    chips_per_host_bounds: tuple[int, int, int]
    host_bounds: tuple[int, int, int]


def _bounds(text: str | None, what: str) -> tuple[int, int, int] | None:
    if not text:
        return None
    try:
        vals = tuple(int(v) for v in text.replace(" ", "").split(","))
    except ValueError:
        raise ConfigurationError(f"{what}={text!r} is not a list of integers like '2,2,1'") from None
    if len(vals) != 3 or min(vals) < 1:
        raise ConfigurationError(f"{what}={text!r} must be three positive integers (x,y,z)")
    return (vals[0], vals[1], vals[2])


def _generation(accelerator_type: str) -> str:
    m = re.match(r"^(v\d+[a-z]*)", accelerator_type.lower())
    return m.group(1) if m else ""


class TPUClusterResolver(ClusterResolver):
    """The hosts of this Cloud TPU slice (``tf.distribute.cluster_resolver.TPUClusterResolver``).

    Args:
        tpu: ``None`` or ``""``: this slice, from the environment (raises off
            a TPU VM); ``"local"``: this host alone; a TPU name or
            ``"grpc://..."``: not supported (see the module docstring).
        zone, project, credentials, service, discovery_url: TF's Cloud TPU
            API arguments; only their defaults are accepted.
        job_name: the job name of the TPU hosts in :meth:`cluster_spec` (TF's default ``"worker"``).
        coordinator_name: add a job of this name holding ``coordinator_address`` to the cluster spec (TF).
        coordinator_address: ``host:port`` of JAX's distributed coordinator
            (default: the first host at :data:`JAX_COORDINATOR_PORT`, or
            ``MEGASCALE_COORDINATOR_ADDRESS``).
    """

    env_name = "tpu"
    detection_priority = 40

    def __init__(
        self,
        tpu: str | None = None,
        zone: str | None = None,
        project: str | None = None,
        job_name: str = "worker",
        coordinator_name: str | None = None,
        coordinator_address: str | None = None,
        credentials: Any = "default",
        service: Any = None,
        discovery_url: str | None = None,
    ) -> None:
        for arg, value, default in (
            ("zone", zone, None),
            ("project", project, None),
            ("credentials", credentials, "default"),
            ("service", service, None),
            ("discovery_url", discovery_url, None),
        ):
            if value != default:
                raise ConfigurationError(
                    f"TPUClusterResolver({arg}=...): jaxdist does not call the Cloud TPU API to look a TPU up. Run "
                    "the script on every host of the TPU VM slice and use TPUClusterResolver(tpu='') (the slice "
                    "from the environment) or tpu='local' (this host only)"
                )
        tpu = "" if tpu is None else str(tpu)
        if tpu.startswith("grpc://"):
            raise ConfigurationError(
                f"TPUClusterResolver(tpu={tpu!r}): TPU Nodes reached over gRPC are TF-only; JAX runs on TPU VMs. "
                "Run the script on the TPU VM's hosts with TPUClusterResolver(tpu='')"
            )
        if tpu not in ("", "local"):
            raise ConfigurationError(
                f"TPUClusterResolver(tpu={tpu!r}): looking a TPU up by name needs the Cloud TPU API, which jaxdist "
                "does not call. Run the script on the TPU VM slice itself with tpu='' (or 'local' for one host)"
            )
        if not job_name:
            raise ConfigurationError("job_name must be a non-empty string")
        self.tpu = tpu
        self.job_name = job_name
        self.accelerator_type = os.environ.get(ENV_ACCELERATOR_TYPE, "").strip()
        if tpu == "local":
            self._hosts = ["localhost"]
            self.task_id = 0
            self._num_slices, self._slice_id = 1, 0
        else:
            raw = os.environ.get(ENV_PROCESS_ADDRESSES) or os.environ.get(ENV_HOSTNAMES)
            if not raw or not raw.strip():
                raise ConfigurationError(
                    "TPUClusterResolver(): no Cloud TPU VM environment found (TPU_WORKER_HOSTNAMES or "
                    "TPU_PROCESS_ADDRESSES, TPU_WORKER_ID, TPU_ACCELERATOR_TYPE are not set). Run on a Cloud TPU VM "
                    "(or GKE TPU pod), pass tpu='local' for this host alone, or use MirroredStrategy off TPU"
                )
            self._hosts = [h.strip().split(":")[0] if h.count(":") == 1 else h.strip() for h in raw.split(",") if h.strip()]
            wid = os.environ.get(ENV_WORKER_ID, "0").strip() or "0"
            if not wid.isdigit() or int(wid) >= len(self._hosts):
                raise ConfigurationError(
                    f"{ENV_WORKER_ID}={wid!r} is not an index into the {len(self._hosts)} hosts of {ENV_HOSTNAMES}"
                )
            self.task_id = int(wid)
            self._num_slices = int(os.environ.get(ENV_NUM_SLICES, "1") or 1)
            self._slice_id = int(os.environ.get(ENV_SLICE_ID, "0") or 0)
            if not 0 <= self._slice_id < self._num_slices:
                raise ConfigurationError(f"{ENV_SLICE_ID}={self._slice_id} is outside [0, {ENV_NUM_SLICES}={self._num_slices})")
        self.task_type = job_name
        self.rpc_layer = "grpc"
        self._chips_per_host = _bounds(os.environ.get(ENV_CHIPS_PER_HOST_BOUNDS), ENV_CHIPS_PER_HOST_BOUNDS)
        self._host_bounds = _bounds(os.environ.get(ENV_HOST_BOUNDS), ENV_HOST_BOUNDS)
        if coordinator_name is not None and coordinator_address is None:
            raise ConfigurationError("coordinator_name needs coordinator_address (as in TF)")
        if coordinator_address is not None:
            host, sep, port = coordinator_address.rpartition(":")
            if not sep or not host or not port.isdigit():
                raise ConfigurationError(f"coordinator_address {coordinator_address!r} is not 'host:port'")
        self._coordinator_name = coordinator_name
        self._coordinator_address = coordinator_address

    @classmethod
    def is_env_present(cls) -> bool:
        """True on a Cloud TPU VM / GKE TPU pod (the slice's host list is in the environment)."""
        return bool((os.environ.get(ENV_PROCESS_ADDRESSES) or os.environ.get(ENV_HOSTNAMES) or "").strip())

    @classmethod
    def default(cls) -> TPUClusterResolver:
        """What TF's ``TPUClusterResolver('')`` gives: the slice from the environment, else this host."""
        return cls() if cls.is_env_present() else cls(tpu="local")

    # -- the job ----------------------------------------------------------------------

    @property
    def hosts(self) -> list[str]:
        """The slice's hosts, in worker-id order."""
        return list(self._hosts)

    @property
    def num_processes(self) -> int:
        """Processes (hosts) in the job: hosts per slice times slices."""
        return len(self._hosts) * self._num_slices

    @property
    def process_id(self) -> int:
        """This process's index in the job (``slice * hosts + worker``, as JAX numbers them)."""
        assert self.task_id is not None
        return self._slice_id * len(self._hosts) + int(self.task_id)

    @property
    def coordinator_address(self) -> str:
        """``host:port`` of JAX's distributed coordinator (process 0)."""
        if self._coordinator_address:
            return self._coordinator_address
        mega = os.environ.get(ENV_MEGASCALE_COORDINATOR, "").strip()
        host = mega.split(":")[0] if mega else self._hosts[0]
        return f"{host}:{JAX_COORDINATOR_PORT}"

    def cluster_spec(self) -> ClusterSpec:
        """``{job_name: ["host:8470", ...]}`` (plus the coordinator job when ``coordinator_name`` was given)."""
        jobs = {self.job_name: [f"{h}:{TF_TPU_PORT}" for h in self._hosts]}
        if self._coordinator_name:
            assert self._coordinator_address is not None
            jobs[self._coordinator_name] = [self._coordinator_address]
        return ClusterSpec(jobs)

    def master(self, task_type: str | None = None, task_id: int | None = None, rpc_layer: str | None = None) -> str:
        """The gRPC address of a TPU host (this one by default), as TF's ``master()``."""
        addr = super().master(task_type, task_id)
        return f"{rpc_layer or self.rpc_layer}://{addr}" if addr else ""

    get_master = master

    def get_job_name(self) -> str:
        return self.job_name

    # -- the hardware --------------------------------------------------------------------

    @property
    def devices_per_host(self) -> int:
        """TPU devices JAX shows per host (chips, or TensorCores on v2/v3)."""
        gen = _generation(self.accelerator_type)
        cores = _CORES_PER_DEVICE_CHIP.get(gen, 1)
        if self._chips_per_host is not None:
            return math.prod(self._chips_per_host) * cores
        if gen in _DEFAULT_CHIPS_PER_HOST:
            return _DEFAULT_CHIPS_PER_HOST[gen] * cores
        m = re.match(r"^v\d+[a-z]*-(\d+)$", self.accelerator_type.lower())
        if m and len(self._hosts):
            return max(1, int(m.group(1)) // len(self._hosts))
        return 0

    def num_accelerators(self, task_type: str | None = None, task_id: int | None = None, config_proto: Any = None) -> dict[str, int]:
        """``{"TPU": devices per host}`` (TF's signature; ``config_proto`` has no meaning here)."""
        if config_proto is not None:
            raise ConfigurationError("num_accelerators(config_proto=...): TF session configs do not apply to JAX")
        n = self.devices_per_host
        return {"TPU": n} if n else {}

    def get_tpu_system_metadata(self) -> TPUSystemMetadata:
        per_host = self.devices_per_host
        return TPUSystemMetadata(
            num_cores=per_host * self.num_processes,
            num_hosts=self.num_processes,
            num_of_cores_per_host=per_host,
            accelerator_type=self.accelerator_type,
            chips_per_host_bounds=self._chips_per_host or (per_host, 1, 1),
            host_bounds=self._host_bounds or (1, 1, len(self._hosts)),
        )

    def __repr__(self) -> str:
        return (
            f"TPUClusterResolver(tpu={self.tpu!r}, hosts={self._hosts}, worker={self.task_id}, "
            f"accelerator_type={self.accelerator_type!r})"
        )
