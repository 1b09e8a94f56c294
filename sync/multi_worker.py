"""``MultiWorkerMirroredStrategy``: synchronous data parallelism across processes (hosts).

Bring-up, in the constructor:

1. The cluster comes from a resolver (``TF_CONFIG``, ``JAXDIST_CLUSTER`` from
   ``jaxdist launch``, Slurm, or one passed in; see
   :func:`jaxdist.base.cluster_resolver.detect`). The processes of the job are the
   ``chief`` (if any) then the ``worker`` tasks, in index order: process 0 is
   the chief, or worker 0 when there is no chief. Without any cluster in the
   environment the strategy runs on this host alone (as TF does).
2. Process 0 serves jaxdist's coordination service
   (:mod:`jaxdist.sync.coordination`) on its cluster-spec address and picks a
   free port for JAX's own coordinator. Every process registers, learns that
   address and waits until all processes have registered.
3. Every process calls ``jax.distributed.initialize(...)`` (gloo collectives
   on CPU, NCCL on GPU), so ``jax.devices()`` spans every process and the
   all-reduce in each step spans every host. Replica ``r`` is global device
   ``r`` ordered by (process, device id): process ``p``'s replicas are contiguous.

Failure detection: every process heartbeats process 0 every
``heartbeat_interval_s``; a dead process is noticed within ``peer_timeout_s``
(3 s by default, instead of JAX's 100 s heartbeat timeout). What a survivor
sees, measured with 2 processes on loopback:

- **A worker (process > 0) dies.** Process 0 declares it dead after
  ``peer_timeout_s`` and the others learn it from their next heartbeat. A
  survivor may be blocked inside a collective with the dead peer, where no
  Python code runs, so by default (``on_peer_failure="abort"``) the watchdog
  thread logs a ``PeerFailedError`` message to stderr and ends the process with
  ``os._exit(EXIT_PEER_FAILED)`` (138, which Kubeflow's ``ExitCode`` restart
  policy treats as retryable): ~3.5 s after the kill. (With gloo the
  survivor's collective often fails at once with a ``JaxRuntimeError``;
  the next strategy call then waits for the heartbeats to name the dead peer,
  and a process exiting on that error is still ended with code 138, because
  the watchdog stays armed during :meth:`~MultiWorkerMirroredStrategy.shutdown`'s
  barrier.)
- **Process 0 dies.** It hosts JAX's own coordination service too, whose
  clients notice the lost connection first and abort the process themselves
  (SIGABRT, exit status 134, "Terminating process because the JAX distributed
  service detected fatal errors ... another task died"), within a second.
  jaxdist's heartbeat watchdog (138) is the backstop.

With ``on_peer_failure="raise"`` the watchdog only records the failure and the
next strategy call (``run``, ``reduce``, ``gather``, ``replicate``) raises
:class:`PeerFailedError` (from the ``JaxRuntimeError`` of the failed
collective, if any). On CPU, ``run`` waits for the previous step by polling,
so it raises even when that step is stuck in a collective with the dead peer;
a process blocked elsewhere (e.g. in ``np.asarray(loss)``, or in an NCCL
collective) waits for JAX's own timeout. Once a failure is recorded, the
process ends with :data:`EXIT_PEER_FAILED` when the interpreter exits (JAX's
runtime would otherwise wait for the dead peer in its shutdown barrier).
After any failure restart every process (from the last checkpoint): a running
JAX multi-process session cannot take new members.

Call :meth:`MultiWorkerMirroredStrategy.shutdown` when training is done (it
is also registered with ``atexit``): it shuts JAX's distributed runtime down
(a barrier with the other processes, skipped once a peer is known dead), then
leaves the coordination service and stops heartbeating.
"""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxdist.base import errors as E
from jaxdist.base.cluster_resolver import ClusterResolver, detect
from jaxdist.transport.rpc import is_loopback
from jaxdist.sync.coordination import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_PEER_TIMEOUT_S,
    CoordinationClient,
    CoordinationService,
    CoordinationState,
    HeartbeatSender,
    PeerFailedError,
)
from jaxdist.sync import cross_device_ops as cdo
from jaxdist.sync.engine import MeshEngine
from jaxdist.sync.mesh import MeshStrategy
from jaxdist.sync.peer_watch import EXIT_PEER_FAILED, PeerWatch
from jaxdist.sync.reduce_op import ReduceOp

logger = logging.getLogger(__name__)

__all__ = ["MultiWorkerMirroredStrategy", "PeerFailedError", "EXIT_PEER_FAILED"]

#: Jobs (TF_CONFIG task types) that take part in the collectives, in rank order.
_COLLECTIVE_JOBS = ("chief", "worker")

#: Default seconds to wait for every process to register and for JAX's coordinator.
_DEFAULT_INIT_TIMEOUT_S = 120.0

#: JAX's own heartbeat timeout, a backstop behind jaxdist's faster detection.
_DEFAULT_JAX_HEARTBEAT_TIMEOUT_S = 100


def _members(resolver: ClusterResolver) -> list[tuple[str, int, str]]:
    spec = resolver.cluster_spec()
    out = []
    for job in _COLLECTIVE_JOBS:
        for i, addr in enumerate(spec.job_tasks(job)):
            out.append((job, i, addr))
    return out


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host.strip("[]"), 0))
        return int(s.getsockname()[1])


def backends_initialized() -> bool:
    """Whether JAX has picked its devices in this process (then it can no longer join a multi-process job)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - private API moved
        return False


class MultiWorkerMirroredStrategy(MeshStrategy):
    """Synchronous training across processes (``tf.distribute.MultiWorkerMirroredStrategy``).

    Create it at the start of every process of the job, before any other JAX
    call (``jax.distributed.initialize`` must run before JAX picks its devices).
    Afterwards the API is :class:`MirroredStrategy`'s over every device of every
    process; in a multi-process job, pass every process the same arguments and
    the same global batches (each keeps its replicas' rows).

    Args:
        cluster_resolver: where the tasks are; default :func:`jaxdist.base.cluster_resolver.detect`.
            The processes are the chief (if any) and the workers.
        communication_options: a :class:`jaxdist.CommunicationOptions`:
            ``implementation`` (AUTO: one fused psum; RING: reduce-scatter +
            all-gather; NCCL: GPUs only) and ``bytes_per_pack`` choose how
            in-replica all-reduces are done; ``timeout_seconds`` fails the job
            (:class:`PeerFailedError`, as ``on_peer_failure`` says) when a
            step's collectives have not finished after that many seconds.
        peer_timeout_s: silence after which a peer is declared dead.
        heartbeat_interval_s: time between heartbeats.
        init_timeout_s: how long to wait for every process to join.
        on_peer_failure: ``"abort"`` (default): log and ``os._exit(EXIT_PEER_FAILED)``;
            ``"raise"``: the next strategy call raises :class:`PeerFailedError`.
        cpu_collectives: JAX CPU collectives implementation (``"gloo"``, ``"mpi"``);
            default: JAX's default, gloo if it has none.
        jax_heartbeat_timeout_s: JAX's own heartbeat timeout (a backstop).
        insecure: allow process 0 to serve on a non-loopback address without a token.

    Raises:
        ConfigurationError: this task is not a chief/worker, JAX was already in
            use, or the cluster is malformed.
        PeerFailedError: a process did not join within ``init_timeout_s`` or
            died during bring-up.
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver | None = None,
        communication_options: Any = None,
        *,
        peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        init_timeout_s: float = _DEFAULT_INIT_TIMEOUT_S,
        on_peer_failure: str = "abort",
        cpu_collectives: str | None = None,
        jax_heartbeat_timeout_s: int = _DEFAULT_JAX_HEARTBEAT_TIMEOUT_S,
        insecure: bool = False,
    ) -> None:
        opts = cdo.check_options(communication_options, "MultiWorkerMirroredStrategy(communication_options=...)")
        if on_peer_failure not in ("abort", "raise"):
            raise E.ConfigurationError(f"on_peer_failure must be 'abort' or 'raise', got {on_peer_failure!r}")
        self._service: CoordinationService | None = None
        self._client: CoordinationClient | None = None
        self._heartbeat: HeartbeatSender | None = None
        self._initialized_jax = False
        self._closed = False
        self._shutting_down = False
        self._incarnation = uuid.uuid4().hex

        resolver = cluster_resolver
        if resolver is None:
            try:
                resolver = detect()
            except E.ConfigurationError:
                resolver = None
        self._resolver = resolver
        members = _members(resolver) if resolver is not None else []
        if len(members) <= 1:
            if resolver is not None and members and (resolver.task_type, resolver.task_id) != members[0][:2]:
                raise E.ConfigurationError(
                    f"MultiWorkerMirroredStrategy runs on chief/worker tasks; this task is "
                    f"{resolver.task_type}:{resolver.task_id}"
                )
            logger.info("MultiWorkerMirroredStrategy: single process, %d local device(s)", jax.local_device_count())
            self._rank, self._nproc, self._task = 0, 1, (f"{members[0][0]}:{members[0][1]}" if members else "local")
            self._watch = self._new_watch(on_peer_failure, peer_timeout_s, heartbeat_interval_s)
            super().__init__(jax.local_devices())
            self._apply_communication_options(opts)
            return

        assert resolver is not None  # members came from it
        me = (resolver.task_type, resolver.task_id)
        ranks = [(job, i) for job, i, _ in members]
        if me not in ranks:
            raise E.ConfigurationError(
                f"MultiWorkerMirroredStrategy runs on chief/worker tasks; this task is "
                f"{resolver.task_type}:{resolver.task_id} (cluster jobs: {resolver.cluster_spec().jobs}). "
                "Set TF_CONFIG's task to a chief or worker entry"
            )
        self._rank = ranks.index(me)
        self._nproc = len(members)
        self._task = f"{me[0]}:{me[1]}"
        self._watch = self._new_watch(on_peer_failure, peer_timeout_s, heartbeat_interval_s)
        chief_job, chief_idx, chief_addr = members[0]
        chief_task = f"{chief_job}:{chief_idx}"
        host, _, port_s = chief_addr.rpartition(":")

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
        try:
            bind_host = host if is_loopback(host) else "0.0.0.0"
            if self._rank == 0:
                jax_port = _free_port(bind_host)
                state = CoordinationState(
                    self._nproc, f"{host}:{jax_port}", peer_timeout_s, session_id=uuid.uuid4().hex
                )
                self._service = CoordinationService(
                    state,
                    bind_host,
                    int(port_s),
                    resolver.credentials,
                    on_failure=self._watch.handle,
                    check_interval_s=heartbeat_interval_s / 2,
                    insecure=insecure,
                )
                self._service.start()
                self._watch.serving = True
                logger.info("coordination service for %d processes on %s", self._nproc, chief_addr)
            self._client = CoordinationClient(chief_addr, resolver.credentials, chief_task)
            session = self._client.register(self._rank, self._task, self._incarnation, timeout=init_timeout_s)
            if self._rank != 0:
                self._heartbeat = HeartbeatSender(
                    self._client,
                    self._rank,
                    self._incarnation,
                    on_failure=self._watch.handle,
                    interval_s=heartbeat_interval_s,
                    peer_timeout_s=peer_timeout_s,
                )
                self._heartbeat.start()
            self._client.wait_all(self._rank, timeout=init_timeout_s)
            self._watch.raise_if_failed()

            if cpu_collectives is not None:
                jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
            elif getattr(jax.config, "jax_cpu_collectives_implementation", None) in (None, "none"):
                jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax_addr = session["jax_coordinator_address"]
            kwargs: dict[str, Any] = {}
            if self._rank == 0 and is_loopback(host):
                kwargs["coordinator_bind_address"] = f"{host}:{jax_addr.rpartition(':')[2]}"
            logger.info(
                "jax.distributed.initialize(%s, num_processes=%d, process_id=%d)", jax_addr, self._nproc, self._rank
            )
            jax.distributed.initialize(
                jax_addr,
                num_processes=self._nproc,
                process_id=self._rank,
                initialization_timeout=int(max(1, init_timeout_s)),
                heartbeat_timeout_seconds=int(jax_heartbeat_timeout_s),
                **kwargs,
            )
            self._initialized_jax = True
            devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
            super().__init__(devices)
            self._apply_communication_options(opts)
        except BaseException:
            if self._initialized_jax:
                self._initialized_jax = False
                try:
                    jax.distributed.shutdown()
                except Exception:  # noqa: BLE001 - already failing
                    pass
            self._teardown()
            raise
        atexit.register(self._at_exit)
        logger.info(
            "MultiWorkerMirroredStrategy: process %d/%d (%s), %d replicas in sync",
            self._rank,
            self._nproc,
            self._task,
            self.num_replicas_in_sync,
        )

    # -- properties -----------------------------------------------------------------

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        return self._resolver

    @property
    def process_index(self) -> int:
        """This process's rank in the job (0 for the chief or worker 0)."""
        return self._rank

    @property
    def num_processes(self) -> int:
        return self._nproc

    @property
    def task(self) -> str:
        """This process's task, e.g. ``"worker:1"``."""
        return self._task

    @property
    def failure(self) -> PeerFailedError | None:
        """The peer failure seen so far, if any."""
        return self._watch.failure

    # -- failures -------------------------------------------------------------------

    def _new_watch(self, on_peer_failure: str, peer_timeout_s: float, heartbeat_interval_s: float) -> PeerWatch:
        return PeerWatch(
            on_peer_failure,
            task=self._task,
            rank=self._rank,
            num_processes=self._nproc,
            peer_timeout_s=peer_timeout_s,
            heartbeat_interval_s=heartbeat_interval_s,
        )

    def _new_engine(self, devices: list[jax.Device]) -> MeshEngine:
        return MeshEngine(self, devices, guard=self._watch)

    def _apply_communication_options(self, opts: cdo.CommunicationOptions | None) -> None:
        """How collectives are done (implementation, packs) and the collective timeout."""
        self._engine.communication_options = opts
        if opts is None:
            return
        plan = cdo.plan_from_options(opts, self._engine.platform)
        if plan is not None:
            self._engine.cross_device_ops = plan
        if opts.timeout is not None:
            self._watch.start_timeout_watch(opts.timeout)

    def _run(
        self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any] | None, steps: int | None = None
    ) -> Any:
        with self._watch.typed_errors():
            return super()._run(fn, args, kwargs, steps)

    def reduce(self, reduce_op: ReduceOp | str, value: Any, axis: int | None = None) -> Any:
        with self._watch.typed_errors():
            return super().reduce(reduce_op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        with self._watch.typed_errors():
            return super().gather(value, axis)

    def replicate(self, value: Any) -> Any:
        with self._watch.typed_errors():
            return super().replicate(value)

    # -- lifecycle --------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave the job cleanly (idempotent; also registered with ``atexit``).

        First shuts JAX's distributed runtime down, which is a barrier: it
        waits for every other process to shut down too. The failure watchdog
        stays armed meanwhile, so a peer dying at that point still ends this
        process with :data:`EXIT_PEER_FAILED` instead of a hang (this is also
        what happens when an exception from a collective ends the main thread
        and the interpreter exits). Then the heartbeats and process 0's
        coordination service stop.
        """
        if self._closed or self._shutting_down:
            return
        self._shutting_down = True
        if self._initialized_jax:
            self._initialized_jax = False
            if self._watch.failure is not None:
                # The barrier would wait for the dead peer until JAX's own heartbeat timeout.
                logger.warning("skipping jax.distributed.shutdown(): %s", self._watch.failure)
            else:
                try:
                    jax.distributed.shutdown()
                except Exception as e:  # noqa: BLE001 - best effort at exit
                    logger.warning("jax.distributed.shutdown failed: %s", e)
        self._teardown()

    def _at_exit(self) -> None:
        """Interpreter exit: shut down cleanly, or end the process if a peer failed.

        After a peer failure JAX's runtime would wait for the dead peer in its
        own shutdown barrier (run when its client is destroyed) until its
        heartbeat timeout, so the process ends at once with :data:`EXIT_PEER_FAILED`.
        """
        if self._watch.failure is not None and self._nproc > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PEER_FAILED)
        self.shutdown()

    def _teardown(self) -> None:
        self._closed = True
        self._watch.close()
        if self._heartbeat is not None:
            self._heartbeat.stop()
            self._heartbeat = None
        if self._client is not None:
            if self._rank != 0:
                try:
                    self._client.leave(self._rank, timeout=0.5)
                except E.JaxdistError as e:  # process 0 may already be gone: it passed the same barrier
                    logger.debug("leave: %s", e)
            self._client.close()
            self._client = None
        if self._service is not None:
            self._service.stop()
            self._service = None
            self._watch.serving = False

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(process {self._rank}/{self._nproc} {self._task}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )
