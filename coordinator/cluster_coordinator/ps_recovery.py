"""PS failure recovery: the watcher of the PS primaries and what it carries out.

Two modes, exclusive (see the README's "PS failure recovery" and "PS
replication"):

- **checkpoint** (:meth:`ClusterCoordinator.enable_ps_recovery`): the
  watcher polls every PS (GetStatus). While one does not answer, dispatch is
  held (closures that need it would only fail); when it answers as a new
  process (restarted by LocalCluster, Kubernetes or Slurm at the same
  address, empty) its variables and optimizer states are restored from the
  manager's latest checkpoint and training continues. A PS that stays away
  longer than ``timeout`` fails the job with ``PSUnavailableError``.
- **replication** (a ``ps_backup`` job): the watcher polls every shard's
  primary through the strategy's :class:`~jaxdist.cluster_coordinator.ps_failover.ReplicaSet`.
  A primary silent for ``failover_after`` seconds is failed over to its
  backup, and every worker is told the new primary; a primary running
  without a backup gets one attached (full sync) as soon as one answers.

The watcher only probes and carries out; what a probe means is decided by
the :class:`~jaxdist.cluster_coordinator.failure_handler.FailureHandler`
(which also hears of PS errors met inside closures).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from jaxdist.base.errors import JaxdistError, PSUnavailableError
from jaxdist.checkpoint import Checkpoint, CheckpointManager
from jaxdist.cluster_coordinator.failure_handler import Decision, FailureHandler, PSMode
from jaxdist.cluster_coordinator.ps_failover import ReplicaSet

if TYPE_CHECKING:
    from jaxdist.cluster_coordinator.coordinator import ClusterCoordinator
    from jaxdist.strategy import ParameterServerStrategy

logger = logging.getLogger(__name__)

__all__ = ["PSWatcher", "PSWatcherHost", "REPLICA_POLL_S", "RESTORE_QUIESCE_S"]

#: Seconds between two passes over the primaries in replication mode.
REPLICA_POLL_S = 0.25
#: Longest a restore waits for running closures: those stuck on the dead PS end by their deadlines.
RESTORE_QUIESCE_S = 15.0


class PSWatcherHost(Protocol):
    """What the watcher needs from the coordinator."""

    def apply(self, decisions: Sequence[Decision]) -> None:
        """Carry out the failure handler's decisions, in order."""
        ...


class PSWatcher:
    """One thread (``jaxdist-ps-watch`` or ``jaxdist-replica-watch``) probing the PS primaries.

    Args:
        strategy: whose PS tasks (connections, replica set) are watched.
        coordinator: paused while a restore runs (a quiet point).
        failures: the failure handler fed with every probe; its PS mode says
            which of the two modes runs.
        host: carries out the decisions (the coordinator).
        manager: checkpoint mode: where the latest checkpoint is.
        poll_interval: seconds between passes (checkpoint mode).
        failover_after: replication mode: seconds a primary may stay silent
            (probes time out at half of it).

    ``start``/``stop``; the effects (:meth:`restore`, :meth:`fail_over`,
    :meth:`attach_backup`) run in the caller's thread.
    """

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        coordinator: ClusterCoordinator,
        failures: FailureHandler,
        host: PSWatcherHost,
        *,
        manager: CheckpointManager | None = None,
        poll_interval: float = 0.5,
        failover_after: float = 1.5,
    ) -> None:
        self._strategy = strategy
        self._coordinator = coordinator
        self._failures = failures
        self._host = host
        self._manager = manager
        self._poll = poll_interval
        self._failover_after = failover_after
        self._stop = threading.Event()
        replication = failures.ps_mode is PSMode.REPLICATION
        self._thread = threading.Thread(target=self._loop, name="jaxdist-replica-watch" if replication else "jaxdist-ps-watch",
                                        daemon=True)
        #: PS tasks restored from a checkpoint so far (checkpoint mode).
        self.recoveries = 0
        #: Restores that failed (the job failed with their error).
        self.failed_recoveries = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the thread (it ends its current pass first)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # --------------------------------------------------------------------- loop
    def _loop(self) -> None:
        replication = self._failures.ps_mode is PSMode.REPLICATION
        interval = REPLICA_POLL_S if replication else self._poll
        while not self._stop.is_set() and not self._strategy.closed:
            try:
                self._pass_replicas() if replication else self._pass_checkpoint()
            except Exception:  # noqa: BLE001 - the watcher must outlive surprises; a closed strategy ends it
                if self._stop.is_set() or self._strategy.closed:
                    return
                logger.exception("PS watcher: unexpected error; retrying")
            self._stop.wait(interval)

    def _pass_checkpoint(self) -> None:
        for i, client in enumerate(self._strategy.connections.clients):
            if self._stop.is_set():
                return
            try:
                incarnation = client.status(timeout=max(1.0, self._poll * 2)).incarnation
            except JaxdistError:
                self._host.apply(self._failures.ps_missed(i))
                continue
            self._host.apply(self._failures.ps_answered(i, incarnation))
        self._host.apply(self._failures.ps_pass_done())

    def _pass_replicas(self) -> None:
        replicas = self._replicas()
        for i in range(len(replicas.pairs)):
            if self._stop.is_set():
                return
            alive, has_backup, incarnation, primary = replicas.probe(i, timeout=max(0.5, self._failover_after / 2))
            if alive:
                self._host.apply(self._failures.ps_answered(i, incarnation, has_backup=has_backup, primary=primary))
            else:
                self._host.apply(self._failures.ps_missed(i))
        self._host.apply(self._failures.ps_pass_done())

    def _replicas(self) -> ReplicaSet:
        replicas = self._strategy.replicas
        if replicas is None:
            raise PSUnavailableError("replication mode without a replica set")
        return replicas

    # ------------------------------------------------------------------ effects
    def restore(self, shards: Iterable[int]) -> None:
        """Restore the variables of PS tasks ``shards`` from the latest checkpoint; report the outcome."""
        shards = frozenset(shards)
        try:
            latest = self._manager.latest_checkpoint if self._manager is not None else None
            if latest is None:
                raise PSUnavailableError("a PS restarted and there is no checkpoint to restore it from")
            # The restarted task serves this run before it holds any variable: no push of an earlier
            # run (a worker that outlived its coordinator) lands on what is restored.
            conns = self._strategy.connections
            for i in sorted(shards):
                conns.clients[i].begin_run(self._coordinator.run_id)
            Checkpoint(self._strategy, self._coordinator, ledger=None).restore(
                latest, ps_tasks=set(shards), quiesce_timeout=RESTORE_QUIESCE_S
            )
        except JaxdistError as e:
            logger.error("PS recovery failed: %s", e)
            self.failed_recoveries += 1
            self._host.apply(self._failures.ps_restore_failed(shards, e))
            return
        self.recoveries += 1
        logger.warning("restored %s from %s; training continues", sorted(shards), latest)
        self._host.apply(self._failures.ps_restored(shards))

    def fail_over(self, shard: int) -> None:
        """Promote shard ``shard``'s backup; report the outcome."""
        try:
            self._replicas().fail_over(shard)
        except JaxdistError as e:
            self._host.apply(self._failures.ps_failover_failed(shard, e))
            return
        self._host.apply(self._failures.ps_failed_over(shard))

    def attach_backup(self, shard: int) -> None:
        """Attach shard ``shard``'s backup (full sync) if it answers; a failure is retried next pass."""
        replicas = self._replicas()
        if not replicas.backup_reachable(shard):
            return
        try:
            replicas.attach(shard)
        except JaxdistError as e:
            logger.info("ps:%d: backup not attached yet: %s", shard, e)
