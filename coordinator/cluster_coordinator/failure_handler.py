"""The coordinator's failure handling, sans-IO: evidence in, decisions out.

Every piece of evidence about the health of the cluster lands here, and
nowhere else is a failure classified:

- from the dispatch loop: a RunClosures call failed (status code and
  reason, the task called is a worker), a closure came back (ok, error,
  function unknown, resource unknown, skipped), a worker answered Configure
  (with its incarnation), a heartbeat was answered (with an incarnation) or
  missed (timed out, or unreachable), a worker's connection dropped, the
  liveness :meth:`FailureHandler.tick` (which workers to probe now, which
  have been silent too long; from the ticks' spacing, the coordinator's own
  stalls);
- from the PS watcher: a PS primary answered (incarnation, whether its
  backup is attached) or did not, the end of a pass over the shards, and
  the outcome of a restore or a failover it carried out.

Each event returns the :class:`Decision` objects the caller must carry out,
in order: finish, fail, retry or return a closure; forget a shipped
function; probe a worker (send it a heartbeat); declare a worker dead
(cancel its call in flight); forget a worker that joined through
registration and stayed unreachable; rebuild a worker's per-worker resources; hold or release dispatch while a PS is
suspect; restore PS tasks from a checkpoint, fail a shard over to its
backup, re-attach a backup, tell the workers about new primaries; fail
everything queued.

**Liveness** of every watched task (workers and PS primaries) is one
:class:`Liveness` record: when it last answered, since when it has not, and
its incarnation. The rules that read it differ only in their thresholds: a
worker that leaves a heartbeat unanswered for ``failure_timeout`` seconds is
dead (see "Worker liveness" below); a PS primary down
for ``failover_after`` seconds is failed over (replication), or, in
checkpoint mode, surfaces as :class:`PSUnavailableError` after
``ps_timeout`` seconds; a new incarnation means a restart (a worker is
reconfigured and its resources rebuilt, a PS is restored).

**Worker liveness** (the rules, at any number of workers):

- *Any answer is proof of life*: a RunClosures answer, a Configure answer
  or a heartbeat answer resets the worker's silence. Busy workers running
  short closures are therefore never heartbeated.
- *Heartbeats only to the silent*: :meth:`~FailureHandler.tick` probes a
  healthy worker (:class:`Probe`) once it has answered nothing for its
  probe interval, ``max(heartbeat_interval, watched / max_probe_rate)``
  seconds, jittered by +-25% so that workers configured together do not
  stay in step; at most ``max_probe_rate`` probes per second leave (a token
  bucket), so the coordinator's liveness cost is bounded whatever the
  number of workers. One probe at a time per worker.
- *Dead when asked and silent*: a worker is declared dead when the first
  probe it left unanswered was sent more than ``failure_timeout`` seconds
  ago (checked on every tick and on every miss). A probe that finds
  nobody listening (``heartbeat_missed(unreachable=True)``: a fresh
  connection to its address is refused, the process is gone) declares it
  dead at once, like a failed call; a probe that failed UNAVAILABLE while
  a process still holds the port (a connection dropped by keepalive on a
  loaded machine) is a miss like a timeout.
- *A dropped connection is checked at once*: :meth:`~FailureHandler.connection_lost`
  (the channel left READY: a SIGKILLed process's kernel resets its
  connections) sends a probe now, outside the rate budget; the probe's
  outcome decides.
- *The coordinator's own lateness is not the workers' silence*: every
  worker time (last answer, first unanswered probe, next probe) is read on
  the *workers' clock*, the coordinator's clock less the time it could not
  run. Made with ``tick_interval`` (the dispatch loop ticks every 0.1 s),
  the handler measures that itself: a :meth:`~FailureHandler.tick` that
  comes more than :data:`STALL_GRACE_S` later than due means the loop was
  stalled (GIL, GC, CPU starvation, the process descheduled) for that long.
  A missed heartbeat accounts the stall too before it is judged, because
  after a stall the loop may carry out the probe's DEADLINE_EXCEEDED before
  the late tick: a probe whose deadline the stall used up is asked again,
  so every worker missing at once right after the coordinator's own stall
  is one stall, not N failures. A silent worker still fails once its probe
  is ``failure_timeout`` old in time the coordinator observed; evidence
  (nobody listening, a failed call) still fails it at once.
  :meth:`~FailureHandler.coordinator_stalled` reports a stall measured
  elsewhere.
- *Unreachable registrants cost a bounded time*: a worker that joined
  through registration (``elastic``) and has answered nothing for
  ``forget_after`` seconds while unhealthy is forgotten
  (:class:`ForgetWorker`): it leaves the job and must register again.

No sockets, no threads, no sleeping: time comes from the injected
``clock`` (and the jitter from the injected ``rng``). The state is guarded by one lock, so events may come from any
thread; decisions are carried out by the caller, outside the lock. Because
two threads may carry out their decisions in either order, the dispatch
hold is a *level*: whoever carries out :class:`HoldDispatch` or
:class:`ReleaseDispatch` sets the queue's hold to :attr:`FailureHandler.dispatch_held`
as it is *then*, not to what the decision says.
"""

from __future__ import annotations

import enum
import logging
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

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
    "InputFailed",
    "Finish",
    "ForgetFunction",
    "ForgetWorker",
    "HoldDispatch",
    "Liveness",
    "MAX_PS_RETRIES",
    "Outcome",
    "PSMode",
    "Probe",
    "RebuildResources",
    "ReconfigureWorkers",
    "ReleaseDispatch",
    "RestorePS",
    "Retry",
    "ReturnUnrun",
    "STALL_GRACE_S",
    "WorkerStatus",
]

#: Times one closure is retried because a PS was down, before its error surfaces.
MAX_PS_RETRIES = 20

#: Heartbeats per second the coordinator sends at most, all workers together. A heartbeat costs
#: the coordinator ~60-150 us of CPU (grpc.aio unary call, measured on the 2-core development
#: machine, loaded and not): 200/s keeps liveness under ~3% of one core at any cluster size. Up to
#: ``200 * heartbeat_interval`` (100) workers each idle one is probed every ``heartbeat_interval``;
#: beyond, every ``workers / 200`` seconds (5 s at 1,000).
DEFAULT_MAX_PROBE_RATE = 200.0
#: Seconds a worker that joined through registration may stay unreachable before it is forgotten
#: (it leaves the job; a restarted process registers again). Bounds what an address that never
#: answers costs the coordinator: one retry coroutine for this long, then nothing.
DEFAULT_FORGET_AFTER = 60.0
#: Jitter of a worker's probe interval: uniform in [1 - J, 1 + J) times the interval.
_PROBE_JITTER = 0.25
#: Lateness of a tick (past ``tick_interval``) that is ordinary jitter of a busy loop; beyond it the
#: coordinator is taken to have been stalled for all of the lateness.
STALL_GRACE_S = 0.05


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
    """The closure failed for good with ``error`` (recorded; queued closures are cancelled).
    ``pushed``: this attempt made a push that may have been applied (its batches are consumed).
    ``worker``: the worker it failed on (-1: none, or not known), whose gradients staged for the
    synchronous steps it may have left uncommitted (not part of the decision's equality)."""

    closure: Closure
    error: BaseException
    pushed: bool = False
    worker: int = field(default=-1, compare=False)


@dataclass(frozen=True, slots=True)
class InputFailed:
    """A per-worker resource closure raised on its worker (the dataset function failed there): settle
    it with ``error`` and count it failed, but record no job error. The worker holds the failure; only
    the closures that consume the resource there fail (with it), as in TF."""

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
class Probe:
    """Send worker ``worker`` a heartbeat now; report the outcome (``heartbeat_answered`` or
    ``heartbeat_missed``)."""

    worker: int


@dataclass(frozen=True, slots=True)
class ForgetWorker:
    """Worker ``worker`` (joined through registration) stayed unreachable for ``forget_after``
    seconds: it leaves the job (already marked left here); cancel what it still holds."""

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
    Finish | Fail | InputFailed | Retry | ReturnUnrun | ForgetFunction | Probe | DeclareDead | ForgetWorker | RebuildResources
    | HoldDispatch | ReleaseDispatch | RestorePS | FailOver | AttachBackup | ReconfigureWorkers | FailAll
)


@dataclass(slots=True)
class ClosureReport:
    """What a worker said about one closure of a batch (``payload`` for OK, ``error`` for ERROR)."""

    closure: Closure
    outcome: Outcome
    payload: bytes = b""
    error: BaseException | None = None
    pushed: bool = False  # ERROR: the closure made a push before it failed


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
    elastic: bool = False  # joined through registration: forgotten when unreachable for forget_after
    healthy: bool = False
    left: bool = False
    failures: int = 0
    closures_done: int = 0
    probing: bool = False  # a heartbeat is in flight
    asked_since: float | None = None  # when the first probe left unanswered since the last answer was sent
    next_probe_at: float = 0.0  # when to probe it if it stays silent


def _role_of(task: object) -> str:
    """The role of a task name such as ``"ps:1"`` (which task a call went to, set by the client)."""
    return str(task or "").partition(":")[0]


# -------------------------------------------------------------------- handler
class FailureHandler:
    """Decides what every failure means. Sans-IO, thread-safe, clock injected.

    Args:
        failure_timeout: seconds a healthy worker may leave a heartbeat
            unanswered before it is declared dead.
        clock: monotonic time in seconds.
        max_ps_retries: attempts after which a closure that met an unavailable
            PS fails instead of waiting for the PS again.
        heartbeat_interval: seconds of silence (no answer of any kind) after
            which a worker is probed, when the rate budget allows.
        max_probe_rate: heartbeats per second, all workers together.
        forget_after: seconds a worker that joined through registration may
            stay unreachable before it is forgotten.
        rng: uniform [0, 1) numbers for the probe jitter (default: a generator of its own, not Python's global one).
        tick_interval: seconds between two :meth:`tick` calls the caller promises (the dispatch
            loop's :data:`~jaxdist.cluster_coordinator.dispatch.TICK_S`). Set, the handler measures
            its own lateness: a tick (or a missed heartbeat) that comes more than
            ``tick_interval + STALL_GRACE_S`` after the previous one means the coordinator could not
            run meanwhile, and that time is not counted against any worker. None: only what
            :meth:`coordinator_stalled` reports is.
    """

    def __init__(
        self,
        failure_timeout: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
        max_ps_retries: int = MAX_PS_RETRIES,
        *,
        heartbeat_interval: float = 0.5,
        max_probe_rate: float = DEFAULT_MAX_PROBE_RATE,
        forget_after: float = DEFAULT_FORGET_AFTER,
        rng: Callable[[], float] | None = None,
        tick_interval: float | None = None,
    ) -> None:
        if max_probe_rate <= 0 or heartbeat_interval <= 0:
            raise ValueError("heartbeat_interval and max_probe_rate must be positive")
        if tick_interval is not None and tick_interval <= 0:
            raise ValueError(f"tick_interval must be positive (or None), got {tick_interval}")
        self.failure_timeout = failure_timeout
        self.max_ps_retries = max_ps_retries
        self.heartbeat_interval = heartbeat_interval
        self.max_probe_rate = max_probe_rate
        self.forget_after = forget_after
        self._clock = clock
        # Its own generator by default, never Python's global one: the heartbeat thread would otherwise draw
        # from the sequence that random.seed / keras.utils.set_random_seed fix for the user's program (Keras
        # seeds each initializer from it), making a seeded model's initial weights depend on the timing.
        self._rng = rng if rng is not None else random.Random().random
        self._lock = threading.Lock()
        self._workers: dict[int, _Worker] = {}
        self._watched = 0  # healthy workers at the last tick (the probe interval divides by the rate)
        self._tokens = 1.0  # probes that may leave now (a bucket refilled at max_probe_rate)
        self._last_tick = clock()
        self._tick_interval = tick_interval
        self._accounted_to: float | None = None  # raw clock time up to which the coordinator's running is accounted
        #: Seconds the coordinator itself could not run (measured from its ticks' lateness, or reported
        #: through :meth:`coordinator_stalled`): the workers' clock stops meanwhile.
        self.stalled_s = 0.0
        self._ps: dict[int, Liveness] = {}
        self._ps_mode = PSMode.NONE
        self._ps_timeout = 300.0
        self._failover_after = 1.5
        self._restarted: set[int] = set()  # PS tasks seen restarted, not restored yet (checkpoint mode)
        # Replication: shards whose primary answered as a new process (restarted, empty) and whose
        # backup is not promoted yet: never attach the backup to it (its full sync would empty it).
        self._lost_primary: set[int] = set()
        #: The address each shard's primary answered at last (replication mode), to tell a new primary from a restart.
        self._primary_at: dict[int, str] = {}
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

    @property
    def probe_interval(self) -> float:
        """Seconds of silence after which a healthy worker is probed (before jitter):
        ``max(heartbeat_interval, watched workers / max_probe_rate)``."""
        return max(self.heartbeat_interval, self._watched / self.max_probe_rate)

    # --------------------------------------------------------------- membership
    def add_worker(self, index: int, task: str | None = None, *, elastic: bool = False) -> None:
        """Watch worker ``index`` (not healthy until it answers Configure); ``elastic``: it joined
        through registration (forgotten when unreachable for ``forget_after`` seconds)."""
        with self._lock:
            self._workers[index] = _Worker(index, task or f"worker:{index}", Liveness(self._observed()), elastic=elastic)

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
            self._answered(w, self._observed())
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
            w.probing = False
            self._answered(w, self._observed())
            if w.liveness.is_restart(incarnation):
                # Its closures in flight died with the old process; Configure adopts the new one.
                return self._declare_dead(w, "it restarted")
            return []

    def heartbeat_missed(self, index: int, unreachable: bool = False) -> list[Decision]:
        """A heartbeat to worker ``index`` got no answer: ``unreachable`` when nobody listens at its
        address (a fresh connection is refused: the process is gone), else it timed out or its
        connection dropped while a process still listens there.

        Unreachable is dead at once (the evidence of a failed call). A timeout
        is dead once the first unanswered probe is ``failure_timeout`` old
        (without a recorded probe: counted from the last answer); before
        that, the next tick probes it again.
        """
        with self._lock:
            # Carried out on the dispatch loop, maybe before a tick that ran late: the loop's own
            # stall is accounted first, so a probe whose deadline the stall used up is asked again.
            self._account(self._clock())
            w = self._workers[index]
            now = self._observed()
            w.probing = False
            w.liveness.missed(now)
            if w.left:
                return []
            if unreachable:
                return self._declare_dead(w, "unreachable (nobody listens at its address)")
            if w.asked_since is None:
                w.asked_since = w.liveness.last_answer
            if now - w.asked_since > self.failure_timeout:
                return self._declare_dead(w, f"no heartbeat for {self.failure_timeout:.1f}s")
            w.next_probe_at = now  # still within the timeout (a stall moved it): ask again
            return []

    def connection_lost(self, index: int) -> list[Decision]:
        """Worker ``index``'s connection left READY (closed or reset). Not a failure by itself: a
        healthy worker not being probed already is probed now, outside the rate budget."""
        with self._lock:
            w = self._workers[index]
            if not w.healthy or w.left or w.probing:
                return []
            return [self._probe(w, self._observed())]

    def coordinator_stalled(self, seconds: float) -> list[Decision]:
        """The coordinator could not listen for ``seconds`` (reported by the caller, e.g. a pause it
        measured itself): nobody's silence grows by it (the workers' clock stops for that long).
        With ``tick_interval`` set the handler also measures its ticks' lateness itself."""
        if seconds <= 0:
            return []
        with self._lock:
            self.stalled_s += seconds
            return []

    def _observed(self) -> float:
        """The workers' clock: this coordinator's time less its own stalls (under the lock)."""
        return self._clock() - self.stalled_s

    def _account(self, now: float) -> None:
        """Account the coordinator's time up to ``now`` (raw clock; under the lock): with ticks due
        every ``tick_interval``, a gap since the last tick (or miss) longer than that by more than
        :data:`STALL_GRACE_S` is the coordinator's own stall (GIL, GC, CPU starvation, the process
        descheduled), not the workers' silence."""
        if self._tick_interval is None:
            return
        if self._accounted_to is None:  # the first tick: nothing to measure from
            self._accounted_to = now
            return
        gap = now - self._accounted_to
        if gap > self._tick_interval + STALL_GRACE_S:
            stall = gap - self._tick_interval
            self.stalled_s += stall
            if stall >= 0.5 * self.failure_timeout:
                logger.warning("the coordinator could not run for %.1fs (CPU starvation, GC or a pause): not "
                               "counted against any worker's heartbeat", stall)
        if now > self._accounted_to:
            self._accounted_to = now

    def tick(self) -> list[Decision]:
        """The liveness clock: call it often (every ~0.1 s). Returns :class:`Probe` for healthy
        workers silent for their probe interval (within the rate budget), :class:`DeclareDead`
        for those whose unanswered probe is ``failure_timeout`` old, :class:`ForgetWorker` for
        registered workers unreachable for ``forget_after``."""
        with self._lock:
            raw = self._clock()
            self._account(raw)
            self._tokens = min(max(1.0, self.max_probe_rate * 0.25),
                               self._tokens + (raw - self._last_tick) * self.max_probe_rate)
            self._last_tick = raw
            now = self._observed()
            out: list[Decision] = []
            watched = 0
            for w in self._workers.values():
                if w.left:
                    continue
                if w.healthy:
                    watched += 1
                    if w.asked_since is not None and now - w.asked_since > self.failure_timeout:
                        out.extend(self._declare_dead(w, f"no heartbeat for {self.failure_timeout:.1f}s"))
                    elif not w.probing and now >= w.next_probe_at and self._tokens >= 1.0:
                        self._tokens -= 1.0
                        out.append(self._probe(w, now))
                elif w.elastic and now - w.liveness.last_answer > self.forget_after:
                    w.left = True
                    why = f"joined through registration and unreachable for {self.forget_after:.0f}s"
                    logger.warning("%s forgotten: %s", w.task, why)
                    out.append(ForgetWorker(w.index, why))
            self._watched = watched
            return out

    def _probe(self, w: _Worker, now: float) -> Probe:
        w.probing = True
        if w.asked_since is None:
            w.asked_since = now
        return Probe(w.index)

    def _answered(self, w: _Worker, now: float) -> None:
        """Any answer: the silence ends, the next probe is one (jittered) interval away."""
        w.liveness.answered(now)
        w.asked_since = None
        jitter = 1.0 + _PROBE_JITTER * (2.0 * self._rng() - 1.0)
        w.next_probe_at = now + self.probe_interval * jitter

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
            self._answered(w, self._observed())
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
                    elif r.closure.resource_id:
                        out.append(InputFailed(r.closure, err))
                    else:
                        out.append(Fail(r.closure, err, pushed=r.pushed, worker=index))
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
        so ``join`` raises instead of hanging. They may have been sent and run: their pushes may be applied."""
        return [Fail(c, error, pushed=True) for c in batch if not c.remote_value.done()]

    def reconfigure(self, index: int, why: str) -> list[Decision]:
        """Worker ``index`` must be configured again before it takes work (``why``; e.g. it could not
        rejoin the synchronous steps): it counts as failed until Configure answers (:class:`DeclareDead`)."""
        with self._lock:
            w = self._workers[index]
            if w.left:
                return []
            return self._declare_dead(w, why)

    def _declare_dead(self, w: _Worker, why: str) -> list[Decision]:
        if w.healthy:
            logger.warning("%s failed: %s; its closures will be retried", w.task, why)
            w.failures += 1
        w.healthy = False
        return [DeclareDead(w.index, why)]

    # ---------------------------------------------------------------- PS events
    def _ps_recoverable(self, err: BaseException) -> bool:
        # Unreachable, or restarted empty (a PS no longer knows the variable). Checkpoint mode restores
        # it, then runs the closure again. Replication mode fails the shard over; a killed primary that
        # restarts at its address before the workers learnt of the failover answers there as a primary
        # with nothing in it (found by the nemesis soak, seed 97854616): the re-run goes to the new one.
        if self._ps_mode in (PSMode.REPLICATION, PSMode.CHECKPOINT):
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
        if (self._held and not self._restarted and not self._lost_primary
                and all(p.down_since is None for p in self._ps.values())):
            self._held = False
            return [ReleaseDispatch()]
        return []

    def _shard(self, shard: int) -> Liveness:
        p = self._ps.get(shard)
        if p is None:
            p = self._ps[shard] = Liveness(self._clock())
        return p

    def ps_answered(self, shard: int, incarnation: str = "", has_backup: bool = True, primary: str = "") -> list[Decision]:
        """PS primary ``shard`` answered a status probe (as process ``incarnation``; whether its
        backup is attached, in replication mode; ``primary``: the address probed, "" unknown)."""
        with self._lock:
            p = self._shard(shard)
            p.answered(self._clock())
            if primary and self._primary_at.get(shard) != primary:
                # Another task is the primary now, promoted outside this handler (ReplicaSet.fail_over
                # called by hand): its process is adopted, not taken for a restart of the old one.
                self._primary_at[shard] = primary
                if shard not in self._lost_primary:
                    p.incarnation = ""
            if self._ps_mode is PSMode.CHECKPOINT:
                if p.is_restart(incarnation):
                    self._restarted.add(shard)
                p.incarnation = incarnation or p.incarnation
            elif self._ps_mode is PSMode.REPLICATION:
                if shard in self._lost_primary or p.is_restart(incarnation):
                    # The primary restarted before it was seen silent for failover_after: it answers
                    # empty. The backup holds the shard: promote it (the restarted task is attached
                    # to it afterwards as the backup). Attaching the backup to the restarted primary
                    # would copy its emptiness over the backup (found by the nemesis soak).
                    if shard not in self._lost_primary:
                        logger.warning("ps:%d: the primary restarted (it lost the shard): failing over to its backup", shard)
                    self._lost_primary.add(shard)
                    p.incarnation = incarnation or p.incarnation
                    return self._suspect_ps(f"ps:{shard}") + [FailOver(shard)]
                p.incarnation = incarnation or p.incarnation
                if not has_backup:
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
            p = self._shard(shard)
            p.answered(self._clock())
            p.incarnation = ""  # the promoted backup's process is adopted at its next answer
            self._lost_primary.discard(shard)
            return [ReconfigureWorkers()]

    def ps_failover_failed(self, shard: int, error: BaseException) -> list[Decision]:
        """No backup of ``shard`` could be promoted either (two failures): wait for one to come back."""
        logger.error("ps:%d: primary down and its backup could not be promoted: %s", shard, error)
        return []
