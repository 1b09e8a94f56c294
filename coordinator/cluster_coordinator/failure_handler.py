"""The coordinator's failure handling, sans-IO: evidence in, decisions out.

Every piece of evidence about the health of the cluster lands here, and
nowhere else is a failure classified:

- from the dispatch threads: a RunClosures call failed (status code and
  reason, the task called is a worker), a closure came back (ok, error,
  function unknown, resource unknown, skipped), a worker answered Configure
  (with its incarnation), a heartbeat was answered (with an incarnation) or
  missed;
- from the PS watcher: a PS primary answered (incarnation, whether its
  backup is attached) or did not, the end of a pass over the shards, and
  the outcome of a restore or a failover it carried out.

Each event returns the :class:`Decision` objects the caller must carry out,
in order: finish, fail, retry or return a closure; forget a shipped
function; declare a worker dead (cancel its call in flight); rebuild a
worker's per-worker resources; hold or release dispatch while a PS is
suspect; restore PS tasks from a checkpoint, fail a shard over to its
backup, re-attach a backup, tell the workers about new primaries; fail
everything queued.

**Liveness** of every watched task (workers and PS primaries) is one
:class:`Liveness` record: when it last answered, since when it has not, and
its incarnation. The rules that read it differ only in their thresholds: a
worker silent for ``failure_timeout`` seconds is dead; a PS primary down
for ``failover_after`` seconds is failed over (replication), or, in
checkpoint mode, surfaces as :class:`PSUnavailableError` after
``ps_timeout`` seconds; a new incarnation means a restart (a worker is
reconfigured and its resources rebuilt, a PS is restored).

No sockets, no threads, no sleeping: time comes from the injected
``clock``. The state is guarded by one lock, so events may come from any
thread; decisions are carried out by the caller, outside the lock. Because
two threads may carry out their decisions in either order, the dispatch
hold is a *level*: whoever carries out :class:`HoldDispatch` or
:class:`ReleaseDispatch` sets the queue's hold to :attr:`FailureHandler.dispatch_held`
as it is *then*, not to what the decision says.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import grpc
from jaxdist.base import errors as E
from jaxdist.cluster_coordinator.closure_queue import Closure
from jaxdist.proto.status import error_from_status

logger = logging.getLogger(__name__)

__all__ = [
    "AttachBackup",
    "ClosureReport",
    "DeclareDead",
    "Decision",
    "Fail",
    "FailAll",
    "FailOver",
    "FailureHandler",
    "Finish",
    "ForgetFunction",
    "HoldDispatch",
    "Liveness",
    "MAX_PS_RETRIES",
    "Outcome",
    "PSMode",
    "RebuildResources",
    "ReconfigureWorkers",
    "ReleaseDispatch",
    "RestorePS",
    "Retry",
    "ReturnUnrun",
    "WorkerStatus",
]

#: Times one closure is retried because a PS was down, before its error surfaces.
MAX_PS_RETRIES = 20


class Outcome(enum.Enum):
    """How a worker answered for one closure of a RunClosures call."""

    OK = "ok"  # it ran; its value came back
    ERROR = "error"  # it raised (the user's error, or a PS error met inside it)
    FUNCTION_UNKNOWN = "function_unknown"  # the worker lacks the function (it restarted): resend it
    RESOURCE_UNKNOWN = "resource_unknown"  # the worker lacks a per-worker resource it names
    SKIPPED = "skipped"  # an earlier closure of the batch failed; this one did not run


class PSMode(enum.Enum):
    """What a PS failure means for the job."""

    NONE = "none"  # no recovery: a PS error fails its closure
    CHECKPOINT = "checkpoint"  # enable_ps_recovery: wait for the PS, restore it from a checkpoint
    REPLICATION = "replication"  # a ps_backup job: fail the shard over to its backup


# ------------------------------------------------------------------ decisions
# Decisions are values: frozen, except the two built for every closure (Finish, ClosureReport),
# whose frozen __init__ would cost ~1 us each on the coordinator's busiest path.
@dataclass(slots=True)
class Finish:
    """The closure ran: settle its value with ``payload`` and count it finished."""

    closure: Closure
    payload: bytes


@dataclass(frozen=True, slots=True)
class Fail:
    """The closure failed for good with ``error`` (recorded; queued closures are cancelled)."""

    closure: Closure
    error: BaseException


@dataclass(frozen=True, slots=True)
class Retry:
    """Run the closure again (it may have run: a new attempt, same push identities)."""

    closure: Closure


@dataclass(frozen=True, slots=True)
class ReturnUnrun:
    """Put the closure back: it certainly did not run (no attempt counted)."""

    closure: Closure


@dataclass(frozen=True, slots=True)
class ForgetFunction:
    """Worker ``worker`` does not hold function ``digest``: send its payload again."""

    worker: int
    digest: str


@dataclass(frozen=True, slots=True)
class DeclareDead:
    """Worker ``worker`` is failed: cancel its call in flight (its closures come back as retries)."""

    worker: int
    why: str


@dataclass(frozen=True, slots=True)
class RebuildResources:
    """Worker ``worker`` is a new process: forget what was shipped to it and queue its
    per-worker resources ahead of everything else it runs."""

    worker: int


@dataclass(frozen=True, slots=True)
class HoldDispatch:
    """A PS is suspect: hand out no closure (running ones finish or fail fast)."""

    task: str


@dataclass(frozen=True, slots=True)
class ReleaseDispatch:
    """No PS is suspect any more: dispatch again."""


@dataclass(frozen=True, slots=True)
class RestorePS:
    """Restore the variables of PS tasks ``shards`` (restarted empty) from the latest checkpoint."""

    shards: frozenset[int]


@dataclass(frozen=True, slots=True)
class FailOver:
    """Promote the backup of shard ``shard`` (its primary stopped answering)."""

    shard: int


@dataclass(frozen=True, slots=True)
class AttachBackup:
    """Shard ``shard``'s primary runs without a backup: attach it (full sync) if it answers."""

    shard: int


@dataclass(frozen=True, slots=True)
class ReconfigureWorkers:
    """The primaries changed: give every worker the current PS addresses."""


@dataclass(frozen=True, slots=True)
class FailAll:
    """Record ``error`` for the job (it surfaces from schedule/join/done) and cancel everything queued."""

    error: BaseException


Decision = (
    Finish | Fail | Retry | ReturnUnrun | ForgetFunction | DeclareDead | RebuildResources | HoldDispatch
    | ReleaseDispatch | RestorePS | FailOver | AttachBackup | ReconfigureWorkers | FailAll
)


@dataclass(slots=True)
class ClosureReport:
    """What a worker said about one closure of a batch (``payload`` for OK, ``error`` for ERROR)."""

    closure: Closure
    outcome: Outcome
    payload: bytes = b""
    error: BaseException | None = None


# ------------------------------------------------------------------- liveness
@dataclass(slots=True)
class Liveness:
    """When a watched task last answered, since when it has not, and which process it is.

    ``incarnation`` is the process the coordinator works with ("" until it
    first answered): adopted when the task is (re)configured, compared
    against what later answers carry.
    """

    last_answer: float
    incarnation: str = ""
    down_since: float | None = None

    def answered(self, now: float) -> None:
        self.last_answer = now
        self.down_since = None

    def missed(self, now: float) -> None:
        if self.down_since is None:
            self.down_since = now

    def silent_for(self, now: float) -> float:
        """Seconds since the last answer."""
        return now - self.last_answer

    def down_for(self, now: float) -> float:
        """Seconds since the first unanswered probe of the current outage (0: it answers)."""
        return 0.0 if self.down_since is None else now - self.down_since

    def is_restart(self, incarnation: str) -> bool:
        """Whether ``incarnation`` is another process than the known one."""
        return bool(self.incarnation) and bool(incarnation) and incarnation != self.incarnation


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker as the coordinator sees it (a snapshot)."""

    index: int
    task: str
    healthy: bool
    left: bool
    failures: int
    closures_done: int
    incarnation: str


@dataclass(slots=True)
class _Worker:
    index: int
    task: str
    liveness: Liveness
    healthy: bool = False
    left: bool = False
    failures: int = 0
    closures_done: int = 0


def _role_of(task: object) -> str:
    """The role of a task name such as ``"ps:1"`` (which task a call went to, set by the client)."""
    return str(task or "").partition(":")[0]


# -------------------------------------------------------------------- handler
class FailureHandler:
    """Decides what every failure means. Sans-IO, thread-safe, clock injected.

    Args:
        failure_timeout: seconds a healthy worker may go without answering
            (heartbeats and calls) before it is declared dead.
        clock: monotonic time in seconds.
        max_ps_retries: attempts after which a closure that met an unavailable
            PS fails instead of waiting for the PS again.
    """

    def __init__(
        self,
        failure_timeout: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        max_ps_retries: int = MAX_PS_RETRIES,
    ) -> None:
        self.failure_timeout = failure_timeout
        self.max_ps_retries = max_ps_retries
        self._clock = clock
        self._lock = threading.Lock()
        self._workers: dict[int, _Worker] = {}
        self._ps: dict[int, Liveness] = {}
        self._ps_mode = PSMode.NONE
        self._ps_timeout = 300.0
        self._failover_after = 1.5
        self._restarted: set[int] = set()  # PS tasks seen restarted, not restored yet (checkpoint mode)
        self._held = False

    # ------------------------------------------------------------ configuration
    def set_ps_mode(self, mode: PSMode, *, ps_timeout: float = 300.0, failover_after: float = 1.5) -> None:
        """How PS failures are handled: ``ps_timeout`` (checkpoint mode) is how long a PS may stay
        down before its absence fails the job; ``failover_after`` (replication) how long a primary
        may stay silent before its backup is promoted."""
        with self._lock:
            self._ps_mode = mode
            self._ps_timeout = ps_timeout
            self._failover_after = failover_after

    @property
    def ps_mode(self) -> PSMode:
        return self._ps_mode

    @property
    def dispatch_held(self) -> bool:
        """Whether dispatch is held because a PS is suspect (what the queue's hold must be)."""
        with self._lock:
            return self._held

    # --------------------------------------------------------------- membership
    def add_worker(self, index: int, task: str | None = None) -> None:
        """Watch worker ``index`` (not healthy until it answers Configure)."""
        with self._lock:
            self._workers[index] = _Worker(index, task or f"worker:{index}", Liveness(self._clock()))

    def remove_worker(self, index: int) -> None:
        """Worker ``index`` left the job: it is no longer watched and takes no work."""
        with self._lock:
            w = self._workers[index]
            w.left = True
            w.healthy = False

    def is_healthy(self, index: int) -> bool:
        with self._lock:
            return self._workers[index].healthy

    def incarnation(self, index: int) -> str:
        """The process of worker ``index`` the coordinator configured ("" before that)."""
        with self._lock:
            return self._workers[index].liveness.incarnation

    def worker_status(self, index: int) -> WorkerStatus:
        with self._lock:
            w = self._workers[index]
            return WorkerStatus(w.index, w.task, w.healthy, w.left, w.failures, w.closures_done, w.liveness.incarnation)

    # ------------------------------------------------------------ worker events
    def worker_configured(self, index: int, incarnation: str) -> list[Decision]:
        """Worker ``index`` answered Configure as process ``incarnation``: it takes work again.

        A new process (not the first) lost its per-worker resources and its
        function cache: they are rebuilt before anything else runs there.
        """
        with self._lock:
            w = self._workers[index]
            if w.left:
                return []
            known = w.liveness.incarnation
            w.liveness.answered(self._clock())
            w.healthy = True
            if incarnation == known:
                return []
            if known:
                logger.info("%s came back (new process); rebuilding its per-worker resources", w.task)
            w.liveness.incarnation = incarnation
            return [RebuildResources(index)]

    def heartbeat_answered(self, index: int, incarnation: str) -> list[Decision]:
        """Worker ``index`` answered a heartbeat as process ``incarnation``."""
        with self._lock:
            w = self._workers[index]
            w.liveness.answered(self._clock())
            if w.liveness.is_restart(incarnation):
                # Its closures in flight died with the old process; Configure adopts the new one.
                return self._declare_dead(w, "it restarted")
            return []

    def heartbeat_missed(self, index: int) -> list[Decision]:
        """A heartbeat to worker ``index`` got no answer in time."""
        with self._lock:
            w = self._workers[index]
            now = self._clock()
            w.liveness.missed(now)
            if w.liveness.silent_for(now) > self.failure_timeout:
                return self._declare_dead(w, f"no heartbeat for {self.failure_timeout:.1f}s")
            return []

    def call_failed(self, index: int, batch: Sequence[Closure], code: grpc.StatusCode, reason: str = "", details: str = "") -> list[Decision]:
        """The RunClosures call carrying ``batch`` to worker ``index`` ended with status ``code``.

        ``CANCELLED`` is a call this coordinator cancelled (it declared the
        worker dead) or whose channel closed. Unreachable, cancelled or
        restarted: the worker is dead and the batch is retried elsewhere.
        Anything else is the worker rejecting the request itself (a bug or a
        limit): the batch fails with that error.
        """
        with self._lock:
            w = self._workers[index]
            if code == grpc.StatusCode.CANCELLED:
                err: E.JaxdistError = E.WorkerUnavailableError(f"{w.task}: {details or 'declared failed'}", task=w.task)
            else:
                err = error_from_status(code, details, reason, w.task, "worker")
            if isinstance(err, (E.TaskUnavailableError, E.WorkerRestartedError)):
                return self._declare_dead(w, type(err).__name__) + [Retry(c) for c in batch]
            logger.error("%s rejected closures: %s", w.task, err)
            return [Fail(c, err) for c in batch]

    def closures_returned(self, index: int, reports: Iterable[ClosureReport]) -> list[Decision]:
        """Worker ``index`` answered a RunClosures call: one report per closure, in batch order."""
        out: list[Decision] = []
        with self._lock:
            w = self._workers[index]
            w.liveness.answered(self._clock())
            for r in reports:
                if r.outcome is Outcome.OK:
                    w.closures_done += 1
                    out.append(Finish(r.closure, r.payload))
                elif r.outcome is Outcome.ERROR:
                    err = r.error if r.error is not None else E.ClosureError(f"closure failed on {w.task}")
                    if self._ps_recoverable(err) and r.closure.attempt < self.max_ps_retries:
                        # A PS is down or came back empty: hold dispatch until it is back, then run again.
                        out.append(Retry(r.closure))
                        out.extend(self._suspect_ps(str(getattr(err, "task", "") or "")))
                    else:
                        out.append(Fail(r.closure, err))
                elif r.outcome is Outcome.FUNCTION_UNKNOWN:
                    out.append(ForgetFunction(index, r.closure.function.digest))
                    out.append(ReturnUnrun(r.closure))
                elif r.outcome is Outcome.RESOURCE_UNKNOWN:
                    out.append(Retry(r.closure))
                    out.extend(self._declare_dead(w, "it lost its per-worker resources"))
                else:  # SKIPPED
                    out.append(ReturnUnrun(r.closure))
        return out

    def arguments_failed(self, batch: Sequence[Closure], position: int, error: BaseException) -> list[Decision]:
        """``batch[position]``'s arguments could not be pickled: that is its error; nothing was sent,
        so the others go back unrun (after the error is recorded, which cancels them)."""
        out: list[Decision] = [ReturnUnrun(c) for c in batch[:position]]
        out.append(Fail(batch[position], error))
        out.extend(ReturnUnrun(c) for c in batch[position + 1 :])
        return out

    def not_sent(self, batch: Sequence[Closure]) -> list[Decision]:
        """``batch`` was taken for a worker that is leaving, and never sent: it goes to the others."""
        return [ReturnUnrun(c) for c in batch]

    def dispatch_crashed(self, batch: Sequence[Closure], error: BaseException) -> list[Decision]:
        """Sending ``batch`` failed unexpectedly (a bug): its unsettled closures fail with ``error``,
        so ``join`` raises instead of hanging."""
        return [Fail(c, error) for c in batch if not c.remote_value.done()]

    def _declare_dead(self, w: _Worker, why: str) -> list[Decision]:
        if w.healthy:
            logger.warning("%s failed: %s; its closures will be retried", w.task, why)
            w.failures += 1
        w.healthy = False
        return [DeclareDead(w.index, why)]

    # ---------------------------------------------------------------- PS events
    def _ps_recoverable(self, err: BaseException) -> bool:
        if self._ps_mode is PSMode.REPLICATION:
            return isinstance(err, E.PSUnavailableError)  # the watcher fails the shard over; then run again
        if self._ps_mode is PSMode.CHECKPOINT:
            # Unreachable, or restarted empty (a PS no longer knows the variable): restore, then run again.
            return isinstance(err, E.PSUnavailableError) or (
                isinstance(err, E.VariableNotFoundError) and _role_of(getattr(err, "task", "")) == "ps"
            )
        return False

    def _suspect_ps(self, task: str) -> list[Decision]:
        if self._held:
            return []
        self._held = True
        logger.warning("%s unavailable: pausing closures until it is back and restored", task or "a PS")
        return [HoldDispatch(task)]

    def _release_if_settled(self) -> list[Decision]:
        if self._held and not self._restarted and all(p.down_since is None for p in self._ps.values()):
            self._held = False
            return [ReleaseDispatch()]
        return []

    def _shard(self, shard: int) -> Liveness:
        p = self._ps.get(shard)
        if p is None:
            p = self._ps[shard] = Liveness(self._clock())
        return p

    def ps_answered(self, shard: int, incarnation: str = "", has_backup: bool = True) -> list[Decision]:
        """PS primary ``shard`` answered a status probe (as process ``incarnation``; whether its
        backup is attached, in replication mode)."""
        with self._lock:
            p = self._shard(shard)
            p.answered(self._clock())
            if self._ps_mode is PSMode.CHECKPOINT:
                if p.is_restart(incarnation):
                    self._restarted.add(shard)
                p.incarnation = incarnation or p.incarnation
            elif self._ps_mode is PSMode.REPLICATION and not has_backup:
                return [AttachBackup(shard)]
            return []

    def ps_missed(self, shard: int) -> list[Decision]:
        """PS primary ``shard`` did not answer a status probe."""
        with self._lock:
            p = self._shard(shard)
            now = self._clock()
            first = p.down_since is None
            p.missed(now)
            if self._ps_mode is PSMode.REPLICATION:
                out = self._suspect_ps(f"ps:{shard}")
                if p.down_for(now) >= self._failover_after:
                    out.append(FailOver(shard))
                return out
            if self._ps_mode is PSMode.CHECKPOINT:
                if first:
                    return self._suspect_ps(f"ps:{shard}")
                if p.down_for(now) > self._ps_timeout:
                    err = E.PSUnavailableError(f"ps:{shard} did not come back within {self._ps_timeout:.0f}s", task=f"ps:{shard}")
                    # The job fails; dispatch goes on so the error surfaces. A new timeout starts.
                    p.down_since = now
                    self._held = False
                    return [FailAll(err), ReleaseDispatch()]
            return []

    def ps_pass_done(self) -> list[Decision]:
        """The watcher probed every shard once: restore the PS tasks that restarted, or dispatch
        again when no PS is suspect any more."""
        with self._lock:
            if self._restarted:
                shards = frozenset(self._restarted)
                return self._suspect_ps(",".join(f"ps:{i}" for i in sorted(shards))) + [RestorePS(shards)]
            return self._release_if_settled()

    def ps_restored(self, shards: Iterable[int]) -> list[Decision]:
        """The restarted PS tasks ``shards`` were restored: training continues."""
        with self._lock:
            self._restarted.difference_update(shards)
            return self._release_if_settled()

    def ps_restore_failed(self, shards: Iterable[int], error: BaseException) -> list[Decision]:
        """Restoring ``shards`` failed: the job fails with ``error``."""
        with self._lock:
            self._restarted.difference_update(shards)
            return [FailAll(error)] + self._release_if_settled()

    def ps_failed_over(self, shard: int) -> list[Decision]:
        """Shard ``shard``'s backup was promoted: it answers again, and the workers must learn it."""
        with self._lock:
            self._shard(shard).answered(self._clock())
            return [ReconfigureWorkers()]

    def ps_failover_failed(self, shard: int, error: BaseException) -> list[Decision]:
        """No backup of ``shard`` could be promoted either (two failures): wait for one to come back."""
        logger.error("ps:%d: primary down and its backup could not be promoted: %s", shard, error)
        return []
