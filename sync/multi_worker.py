"""``MultiWorkerMirroredStrategy``: synchronous data parallelism across processes (hosts).

Bring-up, in the constructor, in named steps (:mod:`jaxdist.sync.job_session`):
:meth:`~jaxdist.sync.job_session.Membership.resolve` finds this process's
place in the job (the chief, if any, then the workers: process 0 is the chief,
or worker 0 when there is no chief; without any cluster in the environment the
strategy runs on this host alone, as TF does), then
:meth:`~jaxdist.sync.job_session.JobSession.join` has process 0 serve
jaxdist's coordination service (:mod:`jaxdist.sync.coordination`), every
process register and wait for the others, and every process call
``jax.distributed.initialize(...)`` (gloo collectives on CPU, NCCL on GPU), so
``jax.devices()`` spans every process and the all-reduce in each step spans
every host. Replica ``r`` is global device ``r`` ordered by (process, device
id): process ``p``'s replicas are contiguous.

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
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax

from jaxdist.base.cluster_resolver import ClusterResolver
from jaxdist.sync import cross_device_ops as cdo
from jaxdist.sync.coordination import DEFAULT_HEARTBEAT_INTERVAL_S, DEFAULT_PEER_TIMEOUT_S, PeerFailedError
from jaxdist.sync.engine import MeshEngine
from jaxdist.sync.job_session import JobSession, JoinSettings, Membership
from jaxdist.sync.mesh import MeshStrategy
from jaxdist.sync.peer_watch import EXIT_PEER_FAILED
from jaxdist.sync.reduce_op import ReduceOp

logger = logging.getLogger(__name__)

__all__ = ["MultiWorkerMirroredStrategy", "PeerFailedError", "EXIT_PEER_FAILED"]

#: Default seconds to wait for every process to register and for JAX's coordinator.
_DEFAULT_INIT_TIMEOUT_S = 120.0

#: JAX's own heartbeat timeout, a backstop behind jaxdist's faster detection.
_DEFAULT_JAX_HEARTBEAT_TIMEOUT_S = 100


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
        settings = JoinSettings(
            on_peer_failure=on_peer_failure, peer_timeout_s=peer_timeout_s, heartbeat_interval_s=heartbeat_interval_s,
            init_timeout_s=init_timeout_s, cpu_collectives=cpu_collectives,
            jax_heartbeat_timeout_s=jax_heartbeat_timeout_s, insecure=insecure,
        )
        self._job = Membership.resolve(cluster_resolver)
        self._session = JobSession(self._job, settings)
        self._watch = self._session.watch
        self._closed = self._shutting_down = False
        if self._job.num_processes == 1:
            logger.info("MultiWorkerMirroredStrategy: single process, %d local device(s)", jax.local_device_count())
            super().__init__(jax.local_devices())
            self._apply_communication_options(opts)
            return
        with self._session.undone_on_error():
            super().__init__(self._session.join())
            self._apply_communication_options(opts)
        atexit.register(self._at_exit)
        logger.info(
            "MultiWorkerMirroredStrategy: process %d/%d (%s), %d replicas in sync",
            self._job.rank, self._job.num_processes, self._job.task, self.num_replicas_in_sync,
        )

    # -- properties -----------------------------------------------------------------

    @property
    def cluster_resolver(self) -> ClusterResolver | None:
        return self._job.resolver

    @property
    def process_index(self) -> int:
        """This process's rank in the job (0 for the chief or worker 0)."""
        return self._job.rank

    @property
    def num_processes(self) -> int:
        return self._job.num_processes

    @property
    def task(self) -> str:
        """This process's task, e.g. ``"worker:1"``."""
        return self._job.task

    @property
    def failure(self) -> PeerFailedError | None:
        """The peer failure seen so far, if any."""
        return self._watch.failure

    # -- failures -------------------------------------------------------------------

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
        self._session.shutdown_jax()
        self._closed = True
        self._watch.close()
        self._session.close()

    def _at_exit(self) -> None:
        """Interpreter exit: shut down cleanly, or end the process if a peer failed.

        After a peer failure JAX's runtime would wait for the dead peer in its
        own shutdown barrier (run when its client is destroyed) until its
        heartbeat timeout, so the process ends at once with :data:`EXIT_PEER_FAILED`.
        """
        if self._watch.failure is not None and self._job.num_processes > 1:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_PEER_FAILED)
        self.shutdown()

    def __repr__(self) -> str:
        return (
            f"MultiWorkerMirroredStrategy(process {self._job.rank}/{self._job.num_processes} {self._job.task}, "
            f"num_replicas_in_sync={self.num_replicas_in_sync})"
        )
