"""ClusterCoordinator: schedules closures onto workers and survives worker failures.

Contract (what users may rely on):

- ``schedule(fn, args, kwargs)`` returns a :class:`RemoteValue` at once; it
  blocks only while the closure queue is full. ``fn`` runs on some worker.
- **Execution.** A closure whose worker fails (killed, unreachable, restarted)
  before reporting a result is re-run on another worker. Pushes made inside a
  closure carry its identity, so each PS applies a closure's updates at most
  once even when it is re-run: *updates are exactly-once*; the closure's
  Python code itself may run more than once (side effects outside jaxdist,
  e.g. printing, are at-least-once). Its RemoteValue takes the result of the
  first attempt that finishes.
- **Errors.** A closure that raises makes its RemoteValue raise that error on
  every ``fetch()`` (original type, with the remote traceback attached as a
  note); queued closures are cancelled (``fetch()`` raises
  :class:`jaxdist.base.errors.CancelledError`); the next ``schedule``/``join``/
  ``done`` waits for running closures to finish and raises the error once.
  An unreachable PS surfaces the same way as :class:`PSUnavailableError`.
- **Workers** are detected dead by failed calls, by a connection that drops
  and does not come back, and by heartbeats (a worker that has answered
  nothing for its probe interval is sent one; unanswered for
  ``failure_timeout`` seconds, it is dead); their in-flight closures go back
  to the queue, and the worker is reconfigured (its per-worker datasets
  rebuilt) when it answers again, at the same address.

This module is the facade (:class:`ClusterCoordinator`) and the membership
(:class:`Cluster`: which workers take part, the per-worker resources each
must hold, and carrying out the failure handler's decisions on them, as TF's
``Cluster``). The rest of the role lives beside it:
:mod:`~jaxdist.cluster_coordinator.dispatch` (every call to the workers, on
one event loop: closures, heartbeats, configuration), :mod:`~jaxdist.cluster_coordinator.failure_handler` (what every
failure means, sans-IO), :mod:`~jaxdist.cluster_coordinator.ps_recovery`
(the PS watcher), :mod:`~jaxdist.cluster_coordinator.datasets` (per-worker
datasets, the data ledger), :mod:`~jaxdist.cluster_coordinator.servicer`
(the registration service) and :mod:`~jaxdist.cluster_coordinator.closure_queue`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import json
import logging
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
from jaxdist.base import errors as E
from jaxdist.base.monitoring import MetricsExporter
from jaxdist.cluster_coordinator import failure_handler as fh
from jaxdist.cluster_coordinator.closure_queue import Closure, ClosureQueue
from jaxdist.cluster_coordinator.datasets import (
    DataLedger,
    ExactlyOnceDataset,
    PerWorkerDataset,
    as_dataset_fn,
    assign_ledger_positions,
)
from jaxdist.cluster_coordinator.dispatch import TICK_S, Dispatcher, DispatchSettings, WorkerHandle
from jaxdist.cluster_coordinator.failure_handler import DEFAULT_FORGET_AFTER, DEFAULT_MAX_PROBE_RATE, FailureHandler, PSMode
from jaxdist.cluster_coordinator.monitoring import CoordinatorCollector
from jaxdist.cluster_coordinator.ps_recovery import PSWatcher
from jaxdist.cluster_coordinator.remote_value import PerWorkerResourceValues, PerWorkerValues, RemoteValue
from jaxdist.cluster_coordinator.servicer import SERVICE, CoordinatorServicer, check_worker_address
from jaxdist.cluster_coordinator.sync_barrier import StepBarrier, turn_off
from jaxdist.proto import worker_pb2
from jaxdist.transport.server import Server
from jaxdist.worker.closure_args import release_resource

if TYPE_CHECKING:
    from jaxdist.checkpoint import CheckpointManager
    from jaxdist.strategy import ParameterServerStrategy

logger = logging.getLogger(__name__)

__all__ = ["Cluster", "ClusterCoordinator", "ClosureCounts", "DEFAULT_CLOSURES_PER_RPC"]

#: Closures sent per RunClosures call. Batching amortises the per-RPC cost
#: (~0.3 ms of Python on each side) over several tiny closures.
DEFAULT_CLOSURES_PER_RPC = 16

#: Seconds shutdown waits for the calls in flight to be cancelled, and a departing worker's call.
_JOIN_TIMEOUT_S = 5.0
_LEAVE_JOIN_TIMEOUT_S = 10.0
#: Threads of the registration service: a RegisterWorker waits (up to ADMIT_TIMEOUT_S) for its
#: probe of the address on the dispatch loop, so a host of 100 workers joining at once is admitted
#: 64 at a time instead of 16; the pool is the cap on what registrations can hold.
_REGISTRATION_THREADS = 64
#: Seconds the coordinator gives its workers to take note of a Shutdown.
_SHUTDOWN_CALL_S = 2.0


@dataclass(frozen=True)
class ClosureCounts:
    """The closure queue's figures at one moment (:attr:`ClusterCoordinator.closure_counts`)."""

    queued: int  # waiting for a worker (per-worker resource closures included)
    running: int  # sent to a worker, no result yet
    finished: int  # finished successfully, since the start
    failed: int  # failed with an error, since the start
    retried: int  # re-run because their worker failed (or a PS was down), since the start


def _check_args(structure: Any) -> bool:
    """Reject RemoteValues; return whether any PerWorkerValues is present."""
    has_pw = False
    for leaf in jax.tree.leaves(structure, is_leaf=lambda x: isinstance(x, (RemoteValue, PerWorkerValues))):
        if isinstance(leaf, RemoteValue):
            raise ValueError(
                "a RemoteValue cannot be passed to schedule(); fetch() it first, or keep the value "
                "on the parameter servers (a jaxdist Variable) and read it inside the closure"
            )
        has_pw |= isinstance(leaf, PerWorkerValues)
    return has_pw


class ResourceBuilds:
    """How the builds of one per-worker resource ended, on every worker: built, failed (the first
    errors), or cancelled unrun. Fed by the resource closures' ``on_settled``; thread-safe."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.built = 0
        self.cancelled = 0
        self.errors: list[BaseException] = []

    def settled(self, error: BaseException | None) -> None:
        with self._cond:
            if error is None:
                self.built += 1
            elif isinstance(error, E.CancelledError):
                self.cancelled += 1
            elif len(self.errors) < 8:
                self.errors.append(error)
            self._cond.notify_all()

    def wait_first(self, worth_waiting: Callable[[], bool], recheck_s: float) -> BaseException | None:
        """Wait until one build ended; return its error, None if it was built (or cancelled, or
        ``worth_waiting()`` turned False: no worker can build it now). ``worth_waiting`` is asked
        again every ``recheck_s`` seconds (a worker may die with the build in flight)."""
        with self._cond:
            while not (self.built or self.cancelled or self.errors):
                if not worth_waiting():
                    return None
                self._cond.wait(recheck_s)
            return self.errors[0] if self.errors else None


class Cluster:
    """The coordinator's workers and what keeps them working: membership, dispatch, failures.

    Owns the closure queue, the failure handler, the dispatcher (one event
    loop for every call to every worker), one :class:`WorkerHandle` per
    worker slot, the per-worker resources every worker must hold and the PS
    watcher; carries out the failure handler's decisions (it is the
    dispatcher's and the watcher's host). Built and driven by
    :class:`ClusterCoordinator`; users never see it.
    """

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        addresses: Sequence[str],
        settings: DispatchSettings,
        queue: ClosureQueue,
        run_id: str,
        *,
        max_probe_rate: float = DEFAULT_MAX_PROBE_RATE,
        forget_after: float = DEFAULT_FORGET_AFTER,
    ) -> None:
        self.strategy = strategy
        self.queue = queue
        # The dispatcher ticks every TICK_S: the handler measures its own lateness from that.
        self.failures = FailureHandler(settings.failure_timeout, heartbeat_interval=settings.heartbeat_interval,
                                       max_probe_rate=max_probe_rate, forget_after=forget_after, tick_interval=TICK_S)
        self.run_id = run_id
        self._settings = settings
        self._credentials = strategy.credentials
        self._cluster_json = json.dumps(strategy.cluster_resolver.cluster_spec().as_dict(), sort_keys=True)
        #: Where workers deregister ("" until the coordinator serves registration).
        self.registration_address = ""
        self._hold_lock = threading.Lock()
        # Per-worker resources, in creation order: every worker holds all of them.
        self._resource_lock = threading.Lock()
        self._resources: list[tuple[int, Callable[[int], Closure]]] = []
        self._resource_ids = itertools.count(1)
        # Ids of resources whose last handle was collected (appended by weakref finalizers, which may
        # run in any thread at any allocation, so they only append; release_dropped frees them).
        self._dropped: collections.deque[int] = collections.deque()
        self._membership_lock = threading.Lock()
        self.dispatcher = Dispatcher(queue, self.failures, settings, self, self._credentials)
        self._workers: list[WorkerHandle] = [self._new_handle(i, a) for i, a in enumerate(addresses)]
        self._active = len(self._workers)  # workers not departed (changed under the membership lock)
        self._leaving: set[int] = set()  # being removed (under the membership lock)
        self.ps_watcher: PSWatcher | None = None
        #: Membership of the synchronous / bounded-stale steps (None: asynchronous training).
        self.steps: StepBarrier | None = None
        if strategy.staleness is not None:
            self.steps = StepBarrier(strategy.connections, strategy.staleness, queue)

    def _new_handle(self, index: int, address: str, elastic: bool = False) -> WorkerHandle:
        self.failures.add_worker(index, elastic=elastic)
        return WorkerHandle(index, address, self._credentials, elastic=elastic)

    def start(self) -> None:
        if self.steps is not None:
            # No member yet: each worker joins when it is first configured (before it takes a
            # closure), so steps never wait for a worker that never came up.
            self.steps.start(())
        else:
            # A synchronous coordinator of these PS tasks may have died without turning its steps off.
            turn_off(self.strategy.connections)
        self.queue.set_listener(self.dispatcher.kick)
        self.dispatcher.start()
        for w in list(self._workers):
            self.dispatcher.add(w)

    def watch_ps(self, watcher: PSWatcher) -> None:
        """Start ``watcher`` (the failure handler's PS mode is set): PS decisions go to it."""
        self.ps_watcher = watcher
        watcher.start()

    def stop(self) -> list[WorkerHandle]:
        """Stop the PS watcher and dispatching (the queue is stopped first: calls in flight are
        cancelled, their closures with them); returns the handles of the workers still taking part
        (to tell them the job is over, then :meth:`close`)."""
        if self.ps_watcher is not None:
            self.ps_watcher.stop()
        if self.steps is not None:
            self.steps.stop()
        try:
            self.dispatcher.quiesce(timeout=_JOIN_TIMEOUT_S)
        except TimeoutError:
            logger.warning("calls in flight not settled within %.0fs of shutdown", _JOIN_TIMEOUT_S)
        return [w for w in list(self._workers) if not self.failures.worker_status(w.index).left]

    def shutdown_workers(self, handles: Sequence[WorkerHandle], reason: str, exit_code: int) -> None:
        """Tell ``handles``' workers that the job is over, all at once (unreachable ones are skipped)."""
        try:
            self.dispatcher.shutdown_workers(handles, reason, exit_code, timeout=_SHUTDOWN_CALL_S)
        except TimeoutError:
            logger.warning("not every worker was told of the shutdown in time")

    def close(self) -> None:
        """Close every channel and end the dispatch loop (after :meth:`stop`)."""
        self.dispatcher.stop()

    # ------------------------------------------------------------------ views
    @property
    def num_workers(self) -> int:
        return len(self._workers)

    @property
    def active_workers(self) -> int:
        return self._active

    def status(self) -> list[dict[str, Any]]:
        rows = []
        for w in list(self._workers):
            s = self.failures.worker_status(w.index)
            rows.append({"task": w.task, "address": w.address, "healthy": s.healthy, "closures_done": s.closures_done,
                         "failures": s.failures, "left": s.left, "functions_shipped": w.functions_shipped,
                         "busy": w.busy})
        return rows

    def dispatch_counters(self) -> dict[str, int]:
        """See :meth:`ClusterCoordinator.dispatch_counters`."""
        d = self.dispatcher
        return {"run_calls": d.calls, "closures_sent": d.closures_sent, "probes": d.probes}

    def active_handles(self) -> list[WorkerHandle]:
        return [w for w in list(self._workers) if not self.failures.worker_status(w.index).left]

    # ------------------------------------------------------------- membership
    def add_worker(self, address: str, elastic: bool = False) -> int:
        """See :meth:`ClusterCoordinator.add_worker` (``elastic``: it joined through registration)."""
        with self._membership_lock:
            index = self.active_worker_index(address)
            if index is not None:
                return index
            w = self._new_handle(len(self._workers), address, elastic)
            self._workers.append(w)
            self._active += 1
        logger.info("worker:%d joined at %s", w.index, address)
        self.dispatcher.add(w)
        return w.index

    def register_worker(self, address: str) -> int:
        """A worker asks to join through the registration service: its address must be a
        ``host:port`` the coordinator can dial and where a jaxdist worker answers (probed once,
        on a channel of its own), else it is refused and costs nothing more. An address already
        active answers its index. Raises InvalidRequestError / UnreachableWorkerAddressError."""
        address = check_worker_address(address, own=self.registration_address)
        index = self.active_worker_index(address)
        if index is not None:
            return index
        self.dispatcher.admit(address)
        return self.add_worker(address, elastic=True)

    def remove_worker(self, index: int, wait: bool = True) -> None:
        """See :meth:`ClusterCoordinator.remove_worker` (``wait=False``: return at once, the
        removal finishes on the dispatch loop)."""
        with self._membership_lock:
            w = self._workers[index]
            if index in self._leaving or self.failures.worker_status(index).left:
                return
            self._leaving.add(index)
        logger.info("worker:%d (%s) leaves", index, w.address)
        # First: it takes nothing more, and its call cancelled now is not counted as its failure.
        self.failures.remove_worker(index)
        removing = self.dispatcher.remove(w)
        if removing is None or not wait:
            self._removed(w)
            return
        try:
            removing.result(_LEAVE_JOIN_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            logger.warning("worker:%d: its call in flight did not settle within %.0fs", index, _LEAVE_JOIN_TIMEOUT_S)
        self._removed(w)

    def _forget(self, index: int) -> None:
        """The failure handler forgot worker ``index`` (marked left there): drop it here too."""
        with self._membership_lock:
            if index in self._leaving:
                return
            self._leaving.add(index)
        w = self._workers[index]
        self.dispatcher.remove(w)
        self._removed(w)

    def _removed(self, w: WorkerHandle) -> None:
        with self._membership_lock:
            self._active -= 1
            self._leaving.discard(w.index)
        if self.steps is not None:
            self.steps.worker_failed(w.index)  # steps no longer wait for it
        self.queue.drop_tagged(w.index)
        logger.info("worker:%d (%s) left", w.index, w.address)

    def active_worker_index(self, address: str) -> int | None:
        """The index of the active worker serving at ``address`` (not departed or leaving), or None."""
        for w in list(self._workers):
            if w.address == address and w.index not in self._leaving and not self.failures.worker_status(w.index).left:
                return w.index
        return None

    def reconfigure_workers(self, timeout: float) -> None:
        """Send every active worker its current configuration, all at once (the dispatch loop, at
        most 64 calls in flight); one that does not answer gets it when it is next recovered."""
        try:
            failed = self.dispatcher.configure_all(self.active_handles(), timeout)
        except TimeoutError:
            logger.warning("not every worker was reconfigured within %.0fs; the rest are when next recovered", timeout)
            return
        for w, code in failed:
            logger.info("%s not reconfigured yet: %s", w.task, code.name)

    # --------------------------------------------------- per-worker resources
    def create_per_worker_resource(self, fn: Callable[..., Any], args: tuple[Any, ...], has_pw: bool) -> PerWorkerResourceValues:
        """See :meth:`ClusterCoordinator.create_per_worker_resource`."""
        rid = next(self._resource_ids)
        builds = ResourceBuilds()

        def make(worker: int) -> Closure:
            return Closure(fn, args, resource_id=rid, per_worker=has_pw, on_settled=builds.settled)

        self.release_dropped()
        with self._resource_lock:
            self._resources.append((rid, make))
            for w in list(self._workers):
                if self.failures.is_healthy(w.index):
                    self.queue.put_tagged(w.index, make(w.index))
                # Workers not configured yet get every resource when they are (worker_configured).
        values = PerWorkerResourceValues(rid, builds)
        weakref.finalize(values, self._dropped.append, rid)
        return values

    def release_dropped(self) -> None:
        """Free the per-worker resources whose last handle was collected (a dropped per-worker iterator,
        as TF frees it): restarted workers no longer rebuild them, and every healthy worker is sent a
        release closure that drops its copy. Called at the coordinator's next schedule, join or new
        resource (never from the finalizer itself, which may run while a lock is held)."""
        while self._dropped:
            rid = self._dropped.popleft()
            with self._resource_lock:
                self._resources = [(r, make) for r, make in self._resources if r != rid]
                for w in list(self._workers):
                    if self.failures.is_healthy(w.index):
                        self.queue.put_tagged(w.index, Closure(release_resource, resource_id=rid))

    def first_build(self, values: PerWorkerResourceValues) -> BaseException | None:
        """Wait for the first build of resource ``values`` on any worker to end; its error, or None.

        Waits while some worker is healthy (it builds it, or is about to), and
        for up to the failure timeout while none is yet but some has not
        answered its first Configure (the coordinator has just started). With
        no worker able to build it, or while dispatch is paused or held,
        returns None at once: the workers build it when they can, and a
        failure there reaches its consumers.
        """
        builds = values.builds
        if not isinstance(builds, ResourceBuilds):
            return None
        starting_until = time.monotonic() + self._settings.failure_timeout

        def worth_waiting() -> bool:
            if not self.queue.dispatching:  # paused (e.g. inside coordinator.paused()), held or stopped
                return False
            rows = [self.failures.worker_status(w.index) for w in list(self._workers)]
            if any(r.healthy for r in rows):
                return True
            starting = any(not r.left and not r.incarnation and not r.failures for r in rows)
            return starting and time.monotonic() < starting_until

        return builds.wait_first(worth_waiting, recheck_s=0.25)

    # ------------------------------------------- the handles' and watcher's host
    def configure_request(self, handle: WorkerHandle) -> worker_pb2.ConfigureRequest:
        """What worker ``handle`` is told: the cluster (current primaries), its index, this run."""
        return worker_pb2.ConfigureRequest(
            cluster_json=self._cluster_json, worker_index=handle.index, num_workers=self.num_workers,
            coordinator_id=self.run_id, registration_address=self.registration_address, worker_address=handle.address,
        )

    def worker_configured(self, handle: WorkerHandle, incarnation: str) -> None:
        # (Re)joins the steps before it takes a closure. Not a member on every PS yet (a PS did not
        # answer): it stays unhealthy, takes nothing, and the dispatcher configures it again.
        if self.steps is not None and not self.steps.worker_joined(handle.index):
            return
        # Under the resource lock: a resource created meanwhile either sees the worker healthy (and
        # queues it there) or is among the resources rebuilt here; never neither.
        with self._resource_lock:
            self.apply(self.failures.worker_configured(handle.index, incarnation))

    def apply(self, decisions: Sequence[fh.Decision]) -> None:
        """Carry out the failure handler's decisions, in order (called from any thread)."""
        q = self.queue
        finished = 0  # consecutive Finish decisions are counted in the queue together (one lock, one wake-up)
        for d in decisions:
            if type(d) is fh.Finish:
                d.closure.succeed(d.payload)
                finished += 1
                continue
            if finished:
                q.mark_finished(finished)
                finished = 0
            if type(d) is fh.Fail:
                d.closure.fail(d.error, pushed=d.pushed)
                q.mark_failed(d.error)
                # Under synchronous steps its push may be staged and never committed: the steps would wait
                # for it forever (and join() for the closures held at the barrier). Withdraw it; a worker
                # that cannot rejoin every PS now is configured again (it takes nothing meanwhile).
                if d.pushed and d.worker >= 0 and self.steps is not None and not self.steps.withdraw(d.worker):
                    self.apply(self.failures.reconfigure(d.worker, "it could not rejoin the synchronous steps"))
            elif type(d) is fh.InputFailed:
                d.closure.fail(d.error)
                q.mark_failed(d.error, record=False)
            elif type(d) is fh.Retry:
                q.retry(d.closure)
            elif type(d) is fh.ReturnUnrun:
                q.return_unrun(d.closure)
            elif type(d) is fh.ForgetFunction:
                self._workers[d.worker].shipped.discard(d.digest)
            elif type(d) is fh.Probe:
                self.dispatcher.probe(d.worker)
            elif type(d) is fh.DeclareDead:
                self.dispatcher.declare_dead(d.worker)
                if self.steps is not None:
                    # Synchronously, before the Retry decisions that follow: the re-run of its
                    # closure must not meet its old staged contribution.
                    self.steps.worker_failed(d.worker)
            elif type(d) is fh.ForgetWorker:
                self._forget(d.worker)
            elif type(d) is fh.RebuildResources:
                self._workers[d.worker].shipped.clear()
                # Resources die with the process: rebuild them first, in creation order.
                q.put_tagged_front(d.worker, [make(d.worker) for _rid, make in self._resources])
            elif type(d) in (fh.HoldDispatch, fh.ReleaseDispatch):
                # A level: set the hold to the handler's state now (decisions of two threads may
                # be carried out in either order; the last one applied reads the latest state).
                with self._hold_lock:
                    q.set_held(self.failures.dispatch_held)
            elif type(d) is fh.FailAll:
                q.fail_all(d.error)
            elif type(d) is fh.RestorePS:
                self._watcher().restore(d.shards)
            elif type(d) is fh.FailOver:
                self._watcher().fail_over(d.shard)
            elif type(d) is fh.AttachBackup:
                self._watcher().attach_backup(d.shard)
            elif type(d) is fh.ReconfigureWorkers:
                self._point_workers_at_primaries()
            else:  # pragma: no cover - a decision type without an executor is a bug
                raise TypeError(f"no executor for decision {d!r}")
        if finished:
            q.mark_finished(finished)

    def _watcher(self) -> PSWatcher:
        if self.ps_watcher is None:  # pragma: no cover - PS decisions come only from the watcher
            raise RuntimeError("a PS decision without a PS watcher")
        return self.ps_watcher

    def _point_workers_at_primaries(self) -> None:
        """Give every worker the current primaries (its PS connections are rebuilt)."""
        replicas = self.strategy.replicas
        if replicas is None:  # pragma: no cover - only a failover asks for this
            return
        spec = self.strategy.cluster_resolver.cluster_spec().as_dict()
        spec["ps"] = replicas.primaries()
        spec["ps_backup"] = [replicas.backup_of(i) for i in range(len(spec["ps"]))]
        self._cluster_json = json.dumps(spec, sort_keys=True)
        self.reconfigure_workers(timeout=10.0)


class ClusterCoordinator:
    """Schedules closures on the workers of a :class:`ParameterServerStrategy`.

    Liveness (see :mod:`~jaxdist.cluster_coordinator.failure_handler`): any
    answer of a worker is proof of life; a worker that has answered nothing
    for its probe interval, ``max(heartbeat_interval, workers /
    max_heartbeats_per_s)`` seconds (jittered), is sent a heartbeat; one left
    unanswered for ``failure_timeout`` seconds declares it failed, and so does
    a failed call or a heartbeat that finds nobody listening. A connection
    that drops is probed at once, so a killed worker process is detected in
    well under a second whatever the cluster size. Time the coordinator
    itself was stalled is not counted against any worker.

    Args:
        strategy: the strategy whose cluster and variables closures use.
        closures_per_rpc: closures sent to a worker per call (batching); None: 16, or 1 under
            ``staleness``.
        heartbeat_interval: seconds of silence after which a worker is sent a
            heartbeat (when the rate allows).
        failure_timeout: seconds a heartbeat may stay unanswered before the
            worker is declared failed and its closures re-queued.
        closure_timeout: deadline of one RunClosures call (None: no limit;
            liveness is covered by heartbeats).
        max_queued: closures queued before ``schedule`` blocks.
        max_heartbeats_per_s: heartbeats per second to all workers together
            (bounds the coordinator's liveness cost; beyond
            ``max_heartbeats_per_s * heartbeat_interval`` workers, each silent
            one is probed less often).
        forget_after: seconds a worker that joined through registration may
            stay unreachable before it leaves the job.

    With a strategy made with ``staleness`` (synchronous or bounded-stale
    training) each worker takes one closure at a time (``closures_per_rpc``
    is 1, and more is a ``ConfigurationError``: a worker holding a batch
    would hold several steps' closures while it waits at the barrier),
    failed workers leave the steps and workers that come back rejoin them
    (:mod:`jaxdist.cluster_coordinator.sync_barrier`), and ``join`` applies
    a last partial step.
    """

    #: Seconds a primary may stay unreachable before its backup is promoted (read when the
    #: coordinator is made: set it on the class, or on a subclass, beforehand).
    failover_after = 1.5

    #: The settings this coordinator was made with (None until its constructor ran): a second
    #: ``ClusterCoordinator(strategy, ...)`` returns it, and is checked against them.
    _made_with: dict[str, Any] | None = None

    def __new__(cls, strategy: ParameterServerStrategy, **settings: Any) -> ClusterCoordinator:
        # TF's contract: one coordinator per strategy, and constructing it again returns the live one.
        existing = strategy.coordinator
        if isinstance(existing, cls):
            return existing
        return super().__new__(cls)

    def __init__(
        self,
        strategy: ParameterServerStrategy,
        *,
        closures_per_rpc: int | None = None,
        heartbeat_interval: float = 0.5,
        failure_timeout: float = 3.0,
        closure_timeout: float | None = None,
        max_queued: int | None = None,
        max_heartbeats_per_s: float = DEFAULT_MAX_PROBE_RATE,
        forget_after: float = DEFAULT_FORGET_AFTER,
    ) -> None:
        made_with = {"closures_per_rpc": closures_per_rpc, "heartbeat_interval": heartbeat_interval,
                     "failure_timeout": failure_timeout, "closure_timeout": closure_timeout, "max_queued": max_queued,
                     "max_heartbeats_per_s": max_heartbeats_per_s, "forget_after": forget_after}
        if self._made_with is not None:
            # __new__ returned the strategy's live coordinator: it is used as it is, so settings that
            # differ from its own would be ignored; refuse them instead.
            differ = {k: v for k, v in made_with.items() if self._made_with[k] != v}
            if differ:
                raise E.ConfigurationError(
                    f"this strategy already has a ClusterCoordinator, made with "
                    f"{', '.join(f'{k}={self._made_with[k]!r}' for k in differ)}; ClusterCoordinator(strategy) returns "
                    f"it, so it cannot take {', '.join(f'{k}={v!r}' for k, v in differ.items())}: shut it down first "
                    "(coordinator.shutdown()) to make one with other settings")
            return
        addresses = strategy.cluster_resolver.cluster_spec().job_tasks("worker")
        if not addresses:
            raise E.ConfigurationError("the cluster has no 'worker' tasks; add at least one worker to the cluster spec")
        if closures_per_rpc is None:
            closures_per_rpc = DEFAULT_CLOSURES_PER_RPC if strategy.staleness is None else 1
        elif strategy.staleness is not None and closures_per_rpc > 1:
            raise E.ConfigurationError(
                f"closures_per_rpc={closures_per_rpc} with staleness={strategy.staleness}: under synchronous steps a "
                "worker takes one closure at a time (a batch would hold several steps' closures at the barrier); "
                "leave closures_per_rpc unset")
        self._closed = False
        strategy.bind_coordinator(self)  # one live coordinator per strategy
        self._made_with = made_with
        self.strategy = strategy
        #: Token and TLS material of every call (the strategy's).
        self.credentials = strategy.credentials
        self.run_id = uuid.uuid4().hex[:12]
        self.closures_per_rpc = max(1, closures_per_rpc)
        self.heartbeat_interval = heartbeat_interval
        self.failure_timeout = failure_timeout
        self.closure_timeout = closure_timeout
        self._queue = ClosureQueue(max_queued) if max_queued else ClosureQueue()
        settings = DispatchSettings(self.closures_per_rpc, heartbeat_interval, failure_timeout, closure_timeout)
        self._cluster = Cluster(strategy, addresses, settings, self._queue, self.run_id,
                                max_probe_rate=max_heartbeats_per_s, forget_after=forget_after)
        self._registration: Server | None = None
        self._metrics: MetricsExporter | None = None
        self._ps_recovery_timeout: float | None = None
        self._begin_run()
        self._cluster.start()
        if strategy.replicas is not None:
            self._cluster.failures.set_ps_mode(PSMode.REPLICATION, failover_after=self.failover_after)
            self._cluster.watch_ps(PSWatcher(strategy, self, self._cluster.failures, self._cluster,
                                             failover_after=self.failover_after))

    def _begin_run(self) -> None:
        """Begin this run on every PS task before any worker is configured: from then on each refuses
        pushes of closures of earlier runs (workers that outlived an earlier coordinator of the job),
        so nothing of them lands on variables this run restores. A task that does not answer is
        skipped (logged): a PS restored or attached later begins the run then."""
        conns = self.strategy.connections
        run_id = self.run_id

        def begin(client: Any) -> str | None:
            try:
                client.begin_run(run_id)
                return None
            except E.JaxdistError as e:
                return str(e)

        failed = {i: e for i, e in conns.fan_out({i: begin for i in range(len(conns.clients))}).items() if e}
        for i, e in sorted(failed.items()):
            logger.warning("ps:%d did not begin coordinator run %s: %s", i, run_id, e)
        if self.strategy.replicas is not None:
            self.strategy.replicas.begin_run(run_id)

    # ------------------------------------------------------------------ views
    def dispatch_counters(self) -> dict[str, int]:
        """Calls made to workers so far (benchmarks): ``run_calls`` (RunClosures calls),
        ``closures_sent`` (closures in them, retries included) and ``probes`` (liveness Heartbeats)."""
        return self._cluster.dispatch_counters()

    @property
    def num_workers(self) -> int:
        """Worker slots (indices) this coordinator has handed out, including workers that left."""
        return self._cluster.num_workers

    @property
    def active_workers(self) -> int:
        """Workers taking part in the job (not departed), healthy or not."""
        return self._cluster.active_workers

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` was called."""
        return self._closed

    @property
    def closure_counts(self) -> ClosureCounts:
        """Queued, running, finished, failed and retried closures (also exported as metrics)."""
        q = self._queue
        return ClosureCounts(q.queued, q.inflight, q.finished, q.failed, q.retried)

    @property
    def dispatching(self) -> bool:
        """False while no closure is handed out: inside :meth:`paused`, while a PS is down
        (recovery or failover), or after :meth:`shutdown`. (A checkpoint save's
        ``paused(drain=True)`` still re-runs the closures of failed workers before its snapshot.)"""
        return self._queue.dispatching

    @property
    def ps_recovery_timeout(self) -> float | None:
        """Seconds a PS may stay away before checkpoint-mode recovery gives up; None: it is off
        (:meth:`enable_ps_recovery`)."""
        return self._ps_recovery_timeout

    @property
    def ps_recovery_failures(self) -> int:
        """PS restores that failed (each failed the job with its error; checkpoint-mode recovery)."""
        watcher = self._cluster.ps_watcher
        return watcher.failed_recoveries if watcher is not None else 0

    @property
    def ps_recoveries(self) -> int:
        """PS tasks restored from a checkpoint after a restart (checkpoint-mode recovery)."""
        watcher = self._cluster.ps_watcher
        return watcher.recoveries if watcher is not None else 0

    def status(self) -> list[dict[str, Any]]:
        """One row per worker slot: ``task``, ``address``, ``healthy`` (takes closures), ``left``
        (departed), ``closures_done``, ``failures`` (times declared failed), ``functions_shipped``, ``busy`` (a
        RunClosures call to it is in flight: it is handed nothing more until that call answers)."""
        return self._cluster.status()

    # ------------------------------------------------------- elastic workers
    def add_worker(self, address: str) -> int:
        """Add a worker while training runs; returns its index.

        It is configured, gets every per-worker dataset built, then takes
        closures. Adding an address that is already active returns its index.
        """
        return self._cluster.add_worker(address)

    def remove_worker(self, index: int) -> None:
        """Take worker ``index`` out of the job; its running closures are re-queued elsewhere.

        Returns once its threads have stopped: no closure runs there afterwards
        (``status()`` then shows it ``left``). Idempotent.
        """
        self._cluster.remove_worker(index)

    # --------------------------------------------------------- PS recovery
    def enable_ps_recovery(self, manager: CheckpointManager, poll_interval: float = 0.5, timeout: float = 300.0) -> None:
        """Survive PS failures without restarting anything (checkpoint mode).

        A watcher polls every PS. When one dies, closures that need it wait
        (they are re-queued, not failed); when it comes back (restarted by
        LocalCluster, Kubernetes or Slurm at the same address) its variables
        and optimizer states are restored from ``manager``'s latest checkpoint
        and training continues. Guarantee: the restarted PS loses the updates
        made since that checkpoint; other PS tasks lose nothing. If the PS is
        not back within ``timeout`` seconds, :class:`PSUnavailableError`
        surfaces from ``schedule``/``join``/``done``.
        """
        if self.strategy.replicas is not None:
            raise E.ConfigurationError(
                "this cluster replicates its PS tasks (a 'ps_backup' job): failover already keeps every "
                "acknowledged update; checkpoint-mode recovery is for clusters without backups"
            )
        if self.strategy.staleness is not None:
            raise E.ConfigurationError(
                "checkpoint-mode PS recovery does not combine with staleness= (synchronous steps): a restored PS "
                "would lose the staged gradients of the step being formed; use asynchronous training for it")
        if self._cluster.ps_watcher is not None:
            return
        self._cluster.failures.set_ps_mode(PSMode.CHECKPOINT, ps_timeout=timeout)
        self._ps_recovery_timeout = timeout
        self._cluster.watch_ps(PSWatcher(self.strategy, self, self._cluster.failures, self._cluster, manager=manager,
                                         poll_interval=poll_interval))

    # --------------------------------------------------- services it serves
    def serve_registration(self, host: str = "127.0.0.1", port: int = 0, insecure: bool = False) -> str:
        """Serve the Coordinator service so workers can join (``jaxdist worker --register-with``)
        and leave on their own; returns its ``host:port``. Stopped by :meth:`shutdown`."""
        if self._registration is not None:
            return self._cluster.registration_address
        server = Server(host, port, self.credentials, insecure=insecure, max_workers=_REGISTRATION_THREADS)
        server.add_service(SERVICE, CoordinatorServicer(self._cluster).handlers())
        server.start()
        self._registration = server
        self._cluster.registration_address = server.address
        # Tell the workers already configured (all at once), so they too deregister when they leave.
        self._cluster.reconfigure_workers(timeout=5.0)
        return server.address

    def serve_metrics(self, port: int = 0, host: str = "127.0.0.1") -> int:
        """Serve Prometheus metrics on ``http://host:port/metrics`` (0: a free port); returns the port.

        Exports ``jaxdist_coordinator_closures_{queued,running}`` (gauges),
        ``..._closures_{done,failed,retried}_total`` and, per worker,
        ``jaxdist_coordinator_worker_healthy{worker,address}`` (1/0),
        ``..._worker_closures_done_total`` and ``..._worker_failures_total``;
        all read at scrape time. Stopped by :meth:`shutdown`. Idempotent.
        """
        if self._metrics is None:
            self._metrics = MetricsExporter("coordinator", 0, self.run_id)
            self._metrics.register(CoordinatorCollector(self))
        return self._metrics.start(host, port)

    # ------------------------------------------------------------ scheduling
    def schedule(self, fn: Callable[..., Any], args: tuple[Any, ...] | list[Any] | None = None, kwargs: dict[str, Any] | None = None) -> RemoteValue:
        """Schedule ``fn(*args, **kwargs)`` on some worker; return its RemoteValue.

        Non-blocking unless the queue is full. ``PerWorkerValues`` arguments
        (per-worker dataset iterators) are replaced by the running worker's
        own value.

        Raises:
            The first closure error since the last raise (then cleared), after
            running closures have finished; queued closures were cancelled.
            ValueError: an argument is a RemoteValue.
        """
        if self._closed:
            raise RuntimeError("this ClusterCoordinator was shut down")
        if not callable(fn):
            raise TypeError(f"schedule() wants a callable, got {type(fn).__name__}")
        args = tuple(args or ())
        kwargs = dict(kwargs or {})
        has_pw = _check_args((args, kwargs)) if args or kwargs else False
        self._cluster.release_dropped()
        self._queue.raise_if_error()
        closure = Closure(fn, args, kwargs, per_worker=has_pw)
        if has_pw:
            assign_ledger_positions(closure)
        self._queue.put(closure)
        return closure.remote_value

    def join(self, timeout: float | None = None) -> None:
        """Block until every scheduled closure has finished.

        Raises:
            The first closure error since the last raise; when it raises,
            nothing is still running and queued closures were cancelled.
            TimeoutError: ``timeout`` passed first (nothing is cancelled).
        """
        self._cluster.release_dropped()
        if not self._queue.wait(timeout):
            raise TimeoutError(f"join() timed out after {timeout}s with {self._queue.queued} closures queued and {self._queue.inflight} running")
        steps = self._cluster.steps
        if steps is not None:
            steps.flush()  # a last, partial step: workers without a closure for it skip it

    @property
    def step_barrier(self) -> StepBarrier | None:
        """The synchronous steps' membership and the PS tasks' step clocks (None: asynchronous training)."""
        return self._cluster.steps

    def done(self) -> bool:
        """True when no closure is queued or running; raises like :meth:`join`."""
        return self._queue.done()

    def fetch(self, structure: Any) -> Any:
        """``fetch()`` every RemoteValue in ``structure``; other leaves pass through."""
        return jax.tree.map(
            lambda x: x.fetch() if isinstance(x, RemoteValue) else x,
            structure,
            is_leaf=lambda x: isinstance(x, RemoteValue),
        )

    @contextlib.contextmanager
    def paused(self, timeout: float | None = None, *, drain: bool = False) -> Iterator[bool]:
        """Hand out no closure inside the ``with`` block: a quiet point of training.

        On entry, waits up to ``timeout`` seconds (None: as long as it takes)
        for the closures already running to finish, and yields whether they
        did (False: some still run; the block runs anyway). Dispatch resumes
        on exit. Nestable; closures may still be scheduled meanwhile (they
        queue). Checkpoints save and restore inside it.

        With ``drain`` (what a checkpoint save uses), the closures queued
        again after their worker failed are run first, and the wait lasts
        until they finished too: such a closure may have applied some of its
        updates before its worker died, and its re-run (same push
        identities: nothing applied twice) completes them. Inside the block
        every update on the PS tasks then belongs to a closure that finished
        (its exactly-once batches marked done), and every queued closure
        never ran. The re-runs need a healthy worker: the wait lasts until
        one takes them (or ``timeout``).
        """
        quiet = self._queue.pause(timeout, drain=drain)
        try:
            yield quiet
        finally:
            self._queue.resume()

    # -------------------------------------------------------- per-worker data
    def create_per_worker_resource(self, fn: Callable[..., Any], args: tuple[Any, ...] = ()) -> PerWorkerResourceValues:
        """Run ``fn(*args)`` on every worker and keep the result there (a per-worker resource).

        Workers that restart or join later build it too, before they run
        anything else. ``args`` may hold other per-worker values (each worker
        gets its own). Passed to a closure, the returned handle is the
        resource of the worker running it. Once the handle (and whatever
        holds it: an iterator of a per-worker dataset, a scheduled closure's
        arguments) is collected, the workers free the resource at the
        coordinator's next ``schedule``, ``join`` or new resource, and
        restarted workers no longer build it (TF frees a dropped iterator).
        """
        return self._cluster.create_per_worker_resource(fn, args, _check_args(args))

    def create_per_worker_dataset(
        self,
        dataset_fn: Callable[..., Any] | Iterable[Any],
        *,
        exactly_once: bool = False,
        num_batches: int | None = None,
        epochs: int = 1,
    ) -> PerWorkerDataset:
        """Build ``dataset_fn`` on every worker; ``iter()`` of the result feeds closures.

        ``dataset_fn`` takes an :class:`InputContext` (or no argument) and
        returns any iterable; ``jaxdist.current_worker_index()`` works inside
        it. Datasets are rebuilt on a worker that restarts. As in TF, a
        dataset object may be passed instead of the function: a re-iterable
        one (a list, an array, a class with ``__iter__``), which each worker
        gets a copy of; a one-shot iterator (a generator) raises TypeError.

        Returns once ``dataset_fn`` has run on one worker (the first to build
        it; the others build it meanwhile, and workers that join or restart
        later build it before they run anything else; a worker busy with a
        closure builds it when that closure is done), and raises
        :class:`~jaxdist.errors.PerWorkerInputError` (the function's exception
        as its ``__cause__``) if that first build raised: TF raises a bad
        dataset function here too. With no worker up yet it returns at once.
        A build that fails on a worker later fails only the closures that use
        the dataset there (their error is that ``PerWorkerInputError``);
        other closures and ``join`` are unaffected.

        With ``exactly_once=True``, ``dataset_fn`` must return the *whole*
        data set as a sequence of ``num_batches`` batches (``ds[i]``), the same
        on every worker. The coordinator keeps a :class:`DataLedger` and gives
        each scheduled closure one batch position; ``next(it)`` in the closure
        returns that batch (a second ``next`` raises, ending its data). A
        closure re-run after a worker failure gets the same batch, a cancelled
        or failed closure's batch is handed to a later one, and after
        ``num_batches * epochs`` positions ``next`` raises (end of data). With
        exactly-once updates, every batch of every epoch is trained on exactly
        once, whatever workers die.
        """
        dataset_fn = as_dataset_fn(dataset_fn)
        if exactly_once:
            if num_batches is None:
                raise ValueError("exactly_once=True needs num_batches (the length of the data set in batches)")
            ds: PerWorkerDataset = ExactlyOnceDataset(self, dataset_fn, DataLedger(num_batches, epochs))
        else:
            ds = PerWorkerDataset(self, dataset_fn)
        error = self._cluster.first_build(ds.resource)
        if error is not None:
            raise error
        return ds

    # -------------------------------------------------------------- lifecycle
    def shutdown(self, exit_tasks: bool = True, exit_code: int = 0) -> None:
        """Stop scheduling; with ``exit_tasks`` tell every worker and PS to exit (the job is over)
        and close the strategy's PS connections (nothing is left to talk to).

        Queued closures are cancelled. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        if self._registration is not None:
            self._registration.stop(grace=None)
        self._queue.stop()
        active = self._cluster.stop()
        try:
            if exit_tasks:
                reason = "job finished" if exit_code == 0 else "job failed"
                self._cluster.shutdown_workers(active, reason, exit_code)
                self.strategy.shutdown_ps(reason, exit_code)
        finally:
            self._cluster.close()
        if exit_tasks:
            self.strategy.close()
        if self._metrics is not None:
            self._metrics.stop()

    def __enter__(self) -> ClusterCoordinator:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        self.shutdown(exit_tasks=True, exit_code=0 if exc_type is None else 1)
