"""Cluster specs and the resolver base class.

A resolver answers three questions for the process it runs in: which tasks
make up the cluster (a :class:`ClusterSpec`), which task this process is
(``task_type``/``task_id``), and the credentials every call carries (the
shared auth token and, optionally, TLS material). Subclasses register
themselves (``__init_subclass__``) so :func:`jaxdist.base.cluster_resolver.detect`
can pick one from the environment in a documented order.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from typing import ClassVar

from jaxdist.base.errors import ConfigurationError
from jaxdist.transport.credentials import ENV_TOKEN, Credentials, TLSConfig

__all__ = ["ENV_TOKEN", "KNOWN_JOBS", "TLS_FROM_ENV", "ClusterResolver", "ClusterSpec", "SimpleClusterResolver", "check_jobs",
           "check_task"]

#: Job names TF accepts in TF_CONFIG, and so do we, plus jaxdist's ``ps_backup``
#: (one backup per PS task: primary/backup replication, see jaxdist.cluster_coordinator.ps_failover).
KNOWN_JOBS = ("chief", "worker", "ps", "evaluator", "ps_backup")


def check_jobs(counts: Mapping[str, int], source: str) -> None:
    """TF's rules for a cluster's jobs (``multi_worker_util``): every job name is one of
    :data:`KNOWN_JOBS`, and there is at most one chief and one evaluator.

    Raises:
        ConfigurationError: naming ``source`` and what to fix.
    """
    for job in counts:
        if job not in KNOWN_JOBS:
            raise ConfigurationError(f"{source}: unknown job {job!r} in the cluster; allowed jobs are {', '.join(KNOWN_JOBS)}")
    for single in ("chief", "evaluator"):
        if counts.get(single, 0) > 1:
            raise ConfigurationError(f"{source}: at most one {single!r} task is allowed, got {counts[single]}")


def check_task(counts: Mapping[str, int], task_type: str | None, task_id: int | None, source: str) -> None:
    """TF's rules for this process's task: its type is one of :data:`KNOWN_JOBS` and its index is
    below its job's task count (an evaluator may be absent from the cluster, as in TF's tutorial).
    Nothing to check when ``task_type`` is None.

    Raises:
        ConfigurationError: naming ``source`` and what to fix.
    """
    if task_type is None:
        return
    if task_type not in KNOWN_JOBS:
        raise ConfigurationError(f"{source}: task type {task_type!r} is not one of {', '.join(KNOWN_JOBS)}")
    index = 0 if task_id is None else task_id
    if index < 0:
        raise ConfigurationError(f"{source}: task index {index} is negative")
    n = counts.get(task_type, 0)
    if index >= n and not (task_type == "evaluator" and n == 0):
        raise ConfigurationError(
            f"{source}: task {task_type}:{index} but the cluster has {n} {task_type!r} task(s); "
            "fix the task index or add the task's address to the cluster"
        )


class ClusterSpec:
    """An immutable mapping ``job name -> list of "host:port" addresses``.

    Accepts the same forms as ``tf.train.ClusterSpec``: a dict of lists, or a
    dict of ``{index: address}`` dicts (sparse specs), or another ClusterSpec.
    """

    def __init__(self, cluster: Mapping[str, Iterable[str] | Mapping[int, str]] | ClusterSpec) -> None:
        if isinstance(cluster, ClusterSpec):
            self._jobs: dict[str, list[str]] = {k: list(v) for k, v in cluster._jobs.items()}
            return
        if not isinstance(cluster, Mapping):
            raise ConfigurationError(
                f"ClusterSpec wants a dict like {{'worker': ['host:port', ...], 'ps': [...]}}, got {type(cluster).__name__}"
            )
        jobs: dict[str, list[str]] = {}
        for job, tasks in cluster.items():
            if not isinstance(job, str) or not job:
                raise ConfigurationError(f"job names must be non-empty strings, got {job!r}")
            if isinstance(tasks, Mapping):
                idx = sorted(int(i) for i in tasks)
                if idx != list(range(len(idx))):
                    raise ConfigurationError(
                        f"job {job!r}: sparse task indices {idx} must be 0..n-1 with no gaps"
                    )
                addrs = [str(tasks[i] if i in tasks else tasks[str(i)]) for i in idx]  # type: ignore[index]
            elif isinstance(tasks, str):
                raise ConfigurationError(f"job {job!r}: wants a list of addresses, got the string {tasks!r}")
            else:
                addrs = [str(a) for a in tasks]
            for a in addrs:
                _check_address(job, a)
            jobs[job] = addrs
        self._jobs = jobs

    @property
    def jobs(self) -> list[str]:
        return list(self._jobs)

    def job_tasks(self, job: str) -> list[str]:
        """Addresses of ``job``'s tasks, in index order ([] if the job is absent)."""
        return list(self._jobs.get(job, []))

    def num_tasks(self, job: str) -> int:
        return len(self._jobs.get(job, []))

    def task_address(self, job: str, task_id: int) -> str:
        tasks = self._jobs.get(job)
        if tasks is None:
            raise ConfigurationError(f"no job {job!r} in cluster spec (jobs: {sorted(self._jobs)})")
        if not 0 <= task_id < len(tasks):
            raise ConfigurationError(f"job {job!r} has {len(tasks)} tasks; task index {task_id} is out of range")
        return tasks[task_id]

    def as_dict(self) -> dict[str, list[str]]:
        return {k: list(v) for k, v in self._jobs.items()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSpec) and self._jobs == other._jobs

    def __hash__(self) -> int:
        return hash(tuple((k, tuple(v)) for k, v in sorted(self._jobs.items())))

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __repr__(self) -> str:
        return f"ClusterSpec({self._jobs!r})"


def _check_address(job: str, address: str) -> None:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigurationError(
            f"job {job!r}: address {address!r} is not 'host:port' with a port in 1..65535"
        )


class _TLSFromEnv:
    def __repr__(self) -> str:
        return "TLS_FROM_ENV"


#: ``tls`` not given: read ``JAXDIST_TLS_*`` when the credentials are asked for.
TLS_FROM_ENV: object = _TLSFromEnv()


class ClusterResolver:
    """Base class: where the cluster is and which task this process is.

    Subclasses that can be detected from the environment set
    ``detection_priority`` (lower is tried first) and implement
    :meth:`is_env_present`.
    """

    _registry: ClassVar[list[type[ClusterResolver]]] = []
    #: Name used by ``JAXDIST_CLUSTER_RESOLVER=<name>`` to force this resolver.
    env_name: ClassVar[str | None] = None
    detection_priority: ClassVar[int | None] = None

    def __init_subclass__(cls, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if cls.env_name is not None:
            ClusterResolver._registry.append(cls)

    @classmethod
    def is_env_present(cls) -> bool:
        return False

    def cluster_spec(self) -> ClusterSpec:
        raise NotImplementedError

    task_type: str | None = None
    task_id: int | None = None
    rpc_layer: str | None = "grpc"

    @property
    def token(self) -> str | None:
        """The shared auth token (``JAXDIST_TOKEN`` unless the resolver was given one)."""
        tok = getattr(self, "_token", None)
        return tok if tok is not None else (os.environ.get(ENV_TOKEN) or None)

    @property
    def tls(self) -> TLSConfig | None:
        """TLS material for calls to the cluster (``JAXDIST_TLS_*`` unless the resolver was given some)."""
        given = getattr(self, "_tls", TLS_FROM_ENV)
        return TLSConfig.from_env() if given is TLS_FROM_ENV else given  # type: ignore[return-value]

    @property
    def credentials(self) -> Credentials:
        """:attr:`token` and :attr:`tls` as the one object clients and servers take."""
        return Credentials(token=self.token, tls=self.tls)

    def num_accelerators(self) -> dict[str, int]:
        return {}

    def master(self, task_type: str | None = None, task_id: int | None = None) -> str:
        """Address of the given task (default: this one), as TF's ``master()``."""
        tt = task_type if task_type is not None else self.task_type
        ti = task_id if task_id is not None else self.task_id
        if tt is None or ti is None:
            return ""
        return self.cluster_spec().task_address(tt, ti)


class SimpleClusterResolver(ClusterResolver):
    """A resolver over a given spec, as ``tf.distribute.cluster_resolver.SimpleClusterResolver``.

    ``token`` and ``tls`` default to ``JAXDIST_TOKEN`` and ``JAXDIST_TLS_*``
    (read when :attr:`credentials` is asked for); ``tls=None`` means plaintext
    whatever the environment says.
    """

    def __init__(
        self,
        cluster_spec: ClusterSpec | Mapping[str, Iterable[str]],
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = "grpc",
        token: str | None = None,
        tls: TLSConfig | None | object = TLS_FROM_ENV,
    ) -> None:
        self._spec = ClusterSpec(cluster_spec)
        self.task_type = task_type
        self.task_id = task_id
        self.rpc_layer = rpc_layer
        self._token = token
        self._tls = tls

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def __repr__(self) -> str:
        return f"SimpleClusterResolver({self._spec!r}, task_type={self.task_type!r}, task_id={self.task_id!r})"
