"""How one process of a ``MultiWorkerMirroredStrategy`` job joins it, and leaves it.

Bring-up, as :class:`~jaxdist.sync.multi_worker.MultiWorkerMirroredStrategy` runs it:

1. :meth:`Membership.resolve`: the cluster comes from a resolver
   (``TF_CONFIG``, ``JAXDIST_CLUSTER`` from ``jaxdist launch``, Slurm, or one
   passed in; see :func:`jaxdist.base.cluster_resolver.detect`). The processes
   of the job are the ``chief`` (if any) then the ``worker`` tasks, in index
   order: process 0 is the chief, or worker 0 when there is no chief. Without
   any cluster in the environment the strategy runs on this host alone (as TF does).
2. :meth:`JobSession.join`, for a job of several processes:

   a. JAX must not be in use yet (``jax.distributed.initialize`` must run
      before JAX picks its devices);
   b. process 0 serves jaxdist's coordination service
      (:mod:`jaxdist.sync.coordination`) on its cluster-spec address and picks
      a free port for JAX's own coordinator;
   c. every process registers, learns that address, starts heartbeating
      (processes > 0) and waits until all processes have registered;
   d. the CPU collectives are chosen (gloo unless set);
   e. every process calls ``jax.distributed.initialize(...)`` (gloo
      collectives on CPU, NCCL on GPU), so ``jax.devices()`` spans every
      process; the replicas are every process's devices ordered by (process,
      device id): process ``p``'s replicas are contiguous.

Leaving: :meth:`JobSession.shutdown_jax` (a barrier with the other processes,
skipped once a peer is known dead), then :meth:`JobSession.close` (leave the
coordination service, stop heartbeating and serving).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax

from jaxdist.base import errors as E
from jaxdist.base.cluster_resolver import ClusterResolver, detect
from jaxdist.sync.coordination import (
    CoordinationClient,
    CoordinationService,
    CoordinationState,
    HeartbeatSender,
    RegisterResponse,
)
from jaxdist.sync.peer_watch import PeerWatch
from jaxdist.transport.channel import is_loopback

logger = logging.getLogger(__name__)

__all__ = ["JobSession", "JoinSettings", "Membership", "backends_initialized"]

#: Jobs (TF_CONFIG task types) that take part in the collectives, in rank order.
_COLLECTIVE_JOBS = ("chief", "worker")


def backends_initialized() -> bool:
    """Whether JAX has picked its devices in this process (then it can no longer join a multi-process job)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        return False


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Membership:
    """Which process of which job this is (step 1 of the module docstring).

    Attributes:
        resolver: the resolver the cluster came from (None: no cluster in the environment).
        members: ``(job, index, address)`` of every process, in rank order (empty: no cluster).
        rank: this process's rank.
        task: this process's task, ``"worker:1"`` (``"local"`` without a cluster).
    """

    resolver: ClusterResolver | None
    members: tuple[tuple[str, int, str], ...]
    rank: int
    task: str

    @classmethod
    def resolve(cls, cluster_resolver: ClusterResolver | None) -> Membership:
        """This process's place in the job ``cluster_resolver`` (default: :func:`detect`) describes.

        Raises:
            ConfigurationError: this task is not a chief or worker of the cluster.
        """
        resolver = cluster_resolver
        if resolver is None:
            try:
                resolver = detect()
            except E.ConfigurationError:
                resolver = None
        if resolver is None:
            return cls(None, (), 0, "local")
        spec = resolver.cluster_spec()
        members = tuple((job, i, addr) for job in _COLLECTIVE_JOBS for i, addr in enumerate(spec.job_tasks(job)))
        me = (resolver.task_type, resolver.task_id)
        ranks = [(job, i) for job, i, _ in members]
        if len(members) <= 1:
            if members and me != ranks[0]:
                raise E.ConfigurationError(
                    f"MultiWorkerMirroredStrategy runs on chief/worker tasks; this task is "
                    f"{resolver.task_type}:{resolver.task_id}"
                )
            return cls(resolver, members, 0, f"{members[0][0]}:{members[0][1]}" if members else "local")
        if me not in ranks:
            raise E.ConfigurationError(
                f"MultiWorkerMirroredStrategy runs on chief/worker tasks; this task is "
                f"{resolver.task_type}:{resolver.task_id} (cluster jobs: {spec.jobs}). "
                "Set TF_CONFIG's task to a chief or worker entry"
            )
        return cls(resolver, members, ranks.index(me), f"{me[0]}:{me[1]}")

    @property
    def num_processes(self) -> int:
        return max(1, len(self.members))

    @property
    def chief_address(self) -> str:
        """Process 0's cluster-spec address, where it serves the coordination service."""
        return self.members[0][2]

    @property
    def chief_task(self) -> str:
        job, index, _ = self.members[0]
        return f"{job}:{index}"


@dataclass(frozen=True)
class JoinSettings:
    """How a process joins its job and watches it (the strategy's constructor arguments; see its docstring)."""

    on_peer_failure: str
    peer_timeout_s: float
    heartbeat_interval_s: float
    init_timeout_s: float
    cpu_collectives: str | None
    jax_heartbeat_timeout_s: int
    insecure: bool

    def __post_init__(self) -> None:
        if self.on_peer_failure not in ("abort", "raise"):
            raise E.ConfigurationError(f"on_peer_failure must be 'abort' or 'raise', got {self.on_peer_failure!r}")


class JobSession:
    """This process's part in its job: process 0's coordination service, the client, heartbeats, JAX's runtime.

    Args:
        membership: which process of the job this is.
        settings: timeouts and options.
    """

    def __init__(self, membership: Membership, settings: JoinSettings) -> None:
        self._m = membership
        self._settings = settings
        #: Receives the peer failures the service, the heartbeats and the collective timeout see.
        self.watch = PeerWatch(
            settings.on_peer_failure,
            task=membership.task,
            rank=membership.rank,
            num_processes=membership.num_processes,
            peer_timeout_s=settings.peer_timeout_s,
            heartbeat_interval_s=settings.heartbeat_interval_s,
        )
        self._incarnation = uuid.uuid4().hex
        self._service: CoordinationService | None = None
        self._client: CoordinationClient | None = None
        self._heartbeat: HeartbeatSender | None = None
        self._jax_initialized = False

    @contextlib.contextmanager
    def undone_on_error(self) -> Iterator[None]:
        """:meth:`abort` if the block raises (a bring-up that failed leaves nothing running)."""
        try:
            yield
        except BaseException:
            self.abort()
            raise

    def join(self) -> list[jax.Device]:
        """Bring the job up (step 2 of the module docstring); the replicas' devices, in replica order.

        On an error, call :meth:`abort` (see :meth:`undone_on_error`).

        Raises:
            ConfigurationError: JAX was already in use in this process.
            PeerFailedError: a process did not join within ``init_timeout_s`` or died meanwhile.
        """
        self._check_jax_unused()
        host = self._m.chief_address.rpartition(":")[0]
        if self._m.rank == 0:
            self._start_coordination(host)
        session = self._register()
        self._select_cpu_collectives()
        self._initialize_jax(session["jax_coordinator_address"], host)
        return sorted(jax.devices(), key=lambda d: (d.process_index, d.id))

    # -- the steps of join ---------------------------------------------------------------

    def _check_jax_unused(self) -> None:
        if jax.distributed.is_initialized():
            raise E.ConfigurationError(
                "jax.distributed is already initialized; MultiWorkerMirroredStrategy initializes it itself. "
                "Create the strategy instead of calling jax.distributed.initialize()"
            )
        if backends_initialized():
            raise E.ConfigurationError(
                "JAX is already in use in this process (devices or arrays were created), so it can no longer "
                "join a multi-process job. Create MultiWorkerMirroredStrategy first, before any other JAX call"
            )

    def _start_coordination(self, host: str) -> None:
        """Process 0: serve the coordination service, with a free port for JAX's own coordinator."""
        assert self._m.resolver is not None  # several processes came from it
        bind_host = host if is_loopback(host) else "0.0.0.0"
        nproc = self._m.num_processes
        jax_port = _free_port(bind_host)
        state = CoordinationState(nproc, f"{host}:{jax_port}", self._settings.peer_timeout_s, session_id=uuid.uuid4().hex)
        self._service = CoordinationService(
            state,
            bind_host,
            int(self._m.chief_address.rpartition(":")[2]),
            self._m.resolver.credentials,
            on_failure=self.watch.handle,
            check_interval_s=self._settings.heartbeat_interval_s / 2,
            insecure=self._settings.insecure,
        )
        self._service.start()
        self.watch.serving = True
        logger.info("coordination service for %d processes on %s", nproc, self._m.chief_address)

    def _register(self) -> RegisterResponse:
        """Register with process 0, heartbeat (processes > 0) and wait until every process has registered."""
        assert self._m.resolver is not None
        rank, timeout = self._m.rank, self._settings.init_timeout_s
        self._client = CoordinationClient(self._m.chief_address, self._m.resolver.credentials, self._m.chief_task)
        session = self._client.register(rank, self._m.task, self._incarnation, timeout=timeout)
        if rank != 0:
            self._heartbeat = HeartbeatSender(
                self._client,
                rank,
                self._incarnation,
                on_failure=self.watch.handle,
                interval_s=self._settings.heartbeat_interval_s,
                peer_timeout_s=self._settings.peer_timeout_s,
            )
            self._heartbeat.start()
        self._client.wait_all(rank, timeout=timeout)
        self.watch.raise_if_failed()
        return session

    def _select_cpu_collectives(self) -> None:
        chosen = self._settings.cpu_collectives
        if chosen is not None:
            jax.config.update("jax_cpu_collectives_implementation", chosen)
        elif getattr(jax.config, "jax_cpu_collectives_implementation", None) in (None, "none"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")

    def _initialize_jax(self, jax_addr: str, host: str) -> None:
        nproc, rank = self._m.num_processes, self._m.rank
        kwargs: dict[str, Any] = {}
        if rank == 0 and is_loopback(host):
            kwargs["coordinator_bind_address"] = f"{host}:{jax_addr.rpartition(':')[2]}"
        logger.info("jax.distributed.initialize(%s, num_processes=%d, process_id=%d)", jax_addr, nproc, rank)
        jax.distributed.initialize(
            jax_addr,
            num_processes=nproc,
            process_id=rank,
            initialization_timeout=int(max(1, self._settings.init_timeout_s)),
            heartbeat_timeout_seconds=int(self._settings.jax_heartbeat_timeout_s),
            **kwargs,
        )
        self._jax_initialized = True

    # -- leaving ---------------------------------------------------------------------------

    def abort(self) -> None:
        """Undo a bring-up that failed: shut JAX's runtime down (errors ignored), then :meth:`close`."""
        if self._jax_initialized:
            self._jax_initialized = False
            try:
                jax.distributed.shutdown()
            except Exception:  # noqa: BLE001 - already failing
                pass
        self.watch.close()
        self.close()

    def shutdown_jax(self) -> None:
        """Shut JAX's distributed runtime down: a barrier with the other processes, skipped after a peer failure."""
        if not self._jax_initialized:
            return
        self._jax_initialized = False
        if self.watch.failure is not None:
            # The barrier would wait for the dead peer until JAX's own heartbeat timeout.
            logger.warning("skipping jax.distributed.shutdown(): %s", self.watch.failure)
            return
        try:
            jax.distributed.shutdown()
        except Exception as e:  # noqa: BLE001 - best effort at exit
            logger.warning("jax.distributed.shutdown failed: %s", e)

    def close(self) -> None:
        """Stop heartbeating, leave the coordination service (processes > 0), stop serving it (process 0)."""
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._client is not None:
            if self._m.rank != 0:
                try:
                    self._client.leave(self._m.rank, timeout=0.5)
                except E.JaxdistError as e:  # process 0 may already be gone: it passed the same barrier
                    logger.debug("leave: %s", e)
            self._client.close()
            self._client = None
        if self._service is not None:
            self._service.stop()
            self._service = None
            self.watch.serving = False
