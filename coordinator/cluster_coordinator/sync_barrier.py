"""The coordinator's side of synchronous and bounded-stale training: who takes part in the steps.

The steps themselves live on the PS tasks (:mod:`jaxdist.ps_server.sync_steps`):
each PS stages the workers' gradients per step, applies a step once every
member has committed it, and holds a worker's pull at the barrier while it is
more than ``staleness`` steps ahead of the slowest. Every PS runs the same
clock: workers commit a step on every PS, and only once their pushes reached
every PS. What a PS cannot decide alone is *membership*, and this module
decides it, the same way on every PS:

- **start**: every PS gets the staleness, and no member: each worker joins
  when it is first configured, before it takes a closure (so steps never
  wait for a worker that never came up).
- **a worker declared failed** (``failure_timeout`` without a heartbeat, or
  its call failed; also a worker removed): it is *fenced* on every PS (its
  pushes and commits are refused from then on), then *dropped*. Its
  contribution to the step it was in counts only if some PS had its commit
  (then it had reached every PS, and it is committed everywhere); otherwise
  it is discarded on every PS and its update ids are forgotten, so the
  closure's re-run (queued after the drop) pushes again, on the worker that
  runs it, into that worker's step. Steps no longer wait for it.
- **a PS that does not answer** a fence, drop or join: the change may have
  reached some PS tasks only (a fence on one, not on the other). It is not
  dropped: the worker stays pending and the watcher retries every
  ``_POLL_S`` until every PS has it (a drop retried keeps the step the
  first complete fence round decided). Until the drop is complete the worker
  counts as a member. A worker configured again joins only once its drop
  is done (a join of a member still fenced on some PS would leave it fenced
  there: its pushes refused, its closures failed); until it is a member on
  every PS it takes no closure, and the dispatcher configures it again.
  Giving up instead left a member that no step could pass (steps waited for
  it forever, and ``join()`` for the closures blocked at the barrier).
- **a closure that failed for good after a push** (a user error, a PS that
  refused it): the gradients it staged for its worker's step are never
  committed, and the step would wait for them forever. Its worker is
  dropped (the uncommitted contribution discarded on every PS) and joins
  again at once; if a PS does not answer, the worker is configured again
  (and takes no closure) until it can join.
- **a worker (re)configured** (it came back, or joined): it joins the steps
  from the step being formed, with the same first step on every PS.
- **idle workers**: a step can wait for a worker that has no closure to run
  (nothing queued, or dispatch paused). When every running closure waits at
  the barrier and no closure can be handed out (nothing queued, or the queue
  hands out nothing: paused or held; a checkpoint's draining pause still hands
  out the closures re-queued after a worker failure, and an idle worker takes
  one, so it is not skipped while any is queued), dispatch is paused for a
  moment and the idle workers skip the blocked step (they take no part in
  it), on every PS; ``join()`` does the same for a last, partial step, so
  every committed gradient is applied when ``join`` returns.

Calls go to every PS in parallel through the strategy's connections;
decisions are made under one lock, one at a time.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from typing import Protocol

from jaxdist.base import errors as E
from jaxdist.proto.ps_wire import SyncKind, SyncReport
from jaxdist.ps_server.connections import PSConnections

logger = logging.getLogger(__name__)

__all__ = ["StepBarrier", "plan_keep", "plan_skips", "turn_off"]

#: Seconds between looks for a step blocked by idle workers (only while nothing can be handed out).
_POLL_S = 0.1


class _Queue(Protocol):
    """What the barrier reads of the coordinator's closure queue."""

    @property
    def queued(self) -> int: ...

    @property
    def inflight(self) -> int: ...

    @property
    def handing_out(self) -> bool: ...

    def pause(self, timeout: float | None = None) -> bool: ...

    def resume(self) -> None: ...


def plan_keep(fenced: Sequence[SyncReport], worker: int) -> int:
    """The step whose contribution of failed ``worker`` counts (-1: none), from every PS's report after the fence.

    A PS that has its commit of step ``j`` (its clock is above ``j`` there while another PS's is
    ``j``) proves its pushes of ``j`` reached every PS: ``j`` is kept (committed everywhere).
    Clocks equal everywhere: the commit never happened; whatever was staged is discarded.
    """
    clocks = [r.clocks[worker] for r in fenced if worker in r.clocks]
    if not clocks or max(clocks) == min(clocks):
        return -1
    return min(clocks)


def plan_skips(reports: Sequence[SyncReport], final: bool = False) -> dict[int, int] | None:
    """Idle members to move forward, ``{worker: step}``; None when the PS tasks disagree (look again later).

    With ``final`` (nothing runs: ``join``), every member catches up with the furthest, so every
    committed step is applied. Otherwise only enough to open the barrier for one waiting worker:
    idle (not waiting) members below ``min(clock - staleness)`` of the waiting ones move there.
    """
    if not reports or not reports[0].enabled:
        return {}
    first = reports[0]
    if any(r.clocks != first.clocks or r.applied != first.applied for r in reports[1:]):
        return None
    if any(r.uncommitted for r in reports):
        return None  # a push is between its PS tasks and its commit: not idle
    clocks = first.clocks
    if final:
        target = max(clocks.values(), default=0)
        return {w: target for w, c in clocks.items() if c < target}
    waiting = set().union(*(r.waiting for r in reports)) & set(clocks)
    if not waiting:
        return {}
    target = min(clocks[w] - first.staleness for w in waiting)
    return {w: target for w, c in clocks.items() if c < target and w not in waiting}


def turn_off(connections: PSConnections, timeout: float = 2.0) -> None:
    """Make every PS apply pushes asynchronously (an asynchronous coordinator starting where a
    synchronous one ran and died); a PS that does not answer is skipped (logged)."""
    # One PS after the other, on this thread: once per coordinator, and it starts no I/O threads
    # (an asynchronous coordinator's strategy may never fan out otherwise).
    for i, client in enumerate(connections.clients):
        try:
            client.sync_steps(SyncKind.CONFIGURE, staleness=-1, timeout=timeout)
        except E.JaxdistError as e:
            logger.info("synchronous steps not turned off on ps:%d: %s", i, e)


class StepBarrier:
    """Membership of the synchronous steps on every PS (see the module docstring).

    ``start(members)`` then ``worker_failed``/``worker_joined`` from the
    coordinator's failure handling, ``flush`` from ``join``, ``stop`` at shutdown.
    """

    def __init__(self, connections: PSConnections, staleness: int, queue: _Queue) -> None:
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.staleness = staleness
        self._conns = connections
        self._queue = queue
        self._lock = threading.Lock()
        self._members: set[int] = set()
        # Failed workers whose drop has not reached every PS yet (a PS did not answer): worker -> the
        # step its fence round decided to keep (None: no fence round answered by every PS yet).
        self._dropping: dict[int, int | None] = {}
        self._warned: set[int] = set()  # workers whose pending drop's failure is logged (once per drop)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="jaxdist-step-barrier", daemon=True)
        #: Idle workers moved past a blocked step (each counted once per step it skipped).
        self.skips = 0

    # -------------------------------------------------------------- lifecycle
    def start(self, members: Iterable[int]) -> None:
        """Configure every PS: these workers, each at the step every PS is at."""
        with self._lock:
            self._members = set(members)
            self._all(SyncKind.CONFIGURE, staleness=self.staleness, members=sorted(self._members))
        self._thread.start()

    def stop(self) -> None:
        """Stop watching, and turn the PS tasks back to asynchronous updates (a later coordinator of
        the same cluster may train asynchronously); a PS that does not answer is skipped."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)
        with self._lock:
            turn_off(self._conns)

    # ------------------------------------------------------------------ views
    @property
    def members(self) -> frozenset[int]:
        with self._lock:
            return frozenset(self._members)

    def reports(self) -> list[SyncReport]:
        """Every PS's step clock, in PS order."""
        return self._all(SyncKind.STATUS)

    # ----------------------------------------------------------- membership
    def worker_failed(self, worker: int) -> None:
        """Fence and drop ``worker`` on every PS (idempotent). Returns once every PS dropped it, so a
        re-run of its closure queued afterwards never meets its old staged contribution; when a PS
        does not answer, the drop stays pending and the watcher retries it (see the module docstring)."""
        with self._lock:
            if worker not in self._members:
                return
            self._dropping.setdefault(worker, None)
            self._drop(worker)

    def worker_joined(self, worker: int) -> bool:
        """Add ``worker`` (configured: back, or new) from the step being formed; a member stays as it
        is. Returns whether it is a member on every PS now: False when a PS did not answer (its
        pending drop first, then the join); the caller keeps it from taking closures and asks again
        (a closure run meanwhile would push where it is still fenced, and fail)."""
        with self._lock:
            if worker in self._dropping and not self._drop(worker):
                return False
            if worker in self._members:
                return True
            try:
                step = max(r.applied for r in self._all(SyncKind.STATUS))
                clocks = [r.clocks.get(worker, -1) for r in self._all(SyncKind.JOIN, contributor=worker, step=step)]
                step = max(clocks)
                if min(clocks) != step:
                    # A step completed on some PS between the join's calls (another member's commit
                    # reached it first, while this worker was no member yet): the PS tasks put it at
                    # different steps, and its pull would not match its push. It has run nothing yet:
                    # move it to the furthest step everywhere (steps below it do not wait for it).
                    self._all(SyncKind.SKIP, contributor=worker, step=step)
            except E.JaxdistError as e:
                logger.warning("worker:%d could not join the synchronous steps yet: %s (it is configured again)", worker, e)
                return False
            self._members.add(worker)
        logger.info("worker:%d joined the synchronous steps at step %d", worker, step)
        return True

    def withdraw(self, worker: int) -> bool:
        """A closure of member ``worker`` failed for good after it may have pushed: the gradients it
        staged for its current step will never be committed, and the steps would wait for that commit
        forever (an idle member with an uncommitted contribution is never skipped). Drop ``worker`` on
        every PS (its uncommitted contribution discarded, a step committed on some PS kept) and join it
        again from the step being formed. Returns whether it is a member on every PS again (False: a PS
        did not answer; the drop is retried, and the caller keeps it from taking closures until
        :meth:`worker_joined` returns True). Not a member (it left): nothing to do, True."""
        with self._lock:
            if worker in self._dropping:
                return False
            if worker not in self._members:
                return True
            self._dropping[worker] = None
            if not self._drop(worker):
                return False
        return self.worker_joined(worker)

    @property
    def pending_drops(self) -> frozenset[int]:
        """Failed workers whose drop has not reached every PS yet (a PS did not answer; retried)."""
        with self._lock:
            return frozenset(self._dropping)

    def retry_drops(self) -> None:
        """Retry the drops a PS did not answer (the watcher's, every ``_POLL_S``)."""
        with self._lock:
            for worker in sorted(self._dropping):
                self._drop(worker)

    def _drop(self, worker: int) -> bool:
        """Under the lock: fence then drop pending ``worker`` on every PS; whether it is done.

        The step to keep is decided once, from a fence round every PS answered (a fenced worker's
        clocks no longer move), and kept for the retries: a retry after a drop that reached some PS
        only must drop it with the same step everywhere (a PS that dropped it reports no clock for it)."""
        keep = self._dropping[worker]
        fenced: list[SyncReport] = []
        try:
            if keep is None:
                fenced = self._all(SyncKind.FENCE, contributor=worker)
                keep = self._dropping[worker] = plan_keep(fenced, worker)
            self._all(SyncKind.DROP, contributor=worker, step=keep)
        except E.JaxdistError as e:
            if worker not in self._warned:
                self._warned.add(worker)
                logger.warning("worker:%d could not be dropped from the synchronous steps yet: %s (retrying; steps wait "
                               "for it meanwhile)", worker, e)
            return False
        del self._dropping[worker]
        self._warned.discard(worker)
        self._members.discard(worker)
        if keep >= 0:
            what = f"its committed step {keep} counts"
        elif any(r.staged_steps for r in fenced):
            what = "its uncommitted gradients were discarded"
        else:
            what = "it had no uncommitted gradients"
        logger.info("worker:%d left the synchronous steps (%s)", worker, what)
        return True

    # ------------------------------------------------------------ idle workers
    def flush(self) -> None:
        """Nothing runs (``join`` returned): apply every committed step, idle workers skipping what they missed."""
        with self._lock:
            plan = plan_skips(self._all(SyncKind.STATUS), final=True)
            if plan:
                self._skip(plan)
            elif plan is None:
                logger.warning("the PS tasks' step clocks disagree at join(); a partial step stays pending")

    def _watch(self) -> None:
        while not self._stop.wait(_POLL_S):
            if self._dropping:
                self.retry_drops()
            self.look()

    def look(self) -> None:
        """One look for a step blocked by idle workers (the watcher's, every ``_POLL_S``)."""
        q = self._queue
        # Closures the queue hands out now go to the idle workers, which then take part in the step:
        # only when none can be handed out may they skip it. A checkpoint's draining pause hands out
        # the re-queued closures (``handing_out``), though dispatch is paused.
        if (q.queued and q.handing_out) or not q.inflight:
            return
        try:
            self._unblock()
        except E.JaxdistError as e:
            logger.debug("step barrier: PS not answering (%s)", e)

    def _unblock(self) -> None:
        """Open a barrier that waits for idle workers (see the module docstring)."""
        waiting = set().union(*(r.waiting for r in self._all(SyncKind.STATUS)))
        if not waiting or len(waiting) < self._queue.inflight:
            return
        # Nothing may be handed out while the decision is made: a worker given a closure now would
        # start the very step it is about to skip.
        self._queue.pause(timeout=0)
        try:
            with self._lock:
                reports = self._all(SyncKind.STATUS)
                waiting = set().union(*(r.waiting for r in reports))
                if self._queue.inflight > len(waiting):
                    return  # a closure runs that is not waiting: it will commit
                plan = plan_skips(reports)
                if plan:
                    self._skip(plan)
        finally:
            self._queue.resume()

    def _skip(self, plan: dict[int, int]) -> None:
        for worker, step in sorted(plan.items()):
            self._all(SyncKind.SKIP, contributor=worker, step=step)
            self.skips += 1
        logger.info("idle workers skip steps: %s", ", ".join(f"worker:{w} to step {s}" for w, s in sorted(plan.items())))

    # ------------------------------------------------------------------- calls
    def _all(self, kind: SyncKind, **kwargs: object) -> list[SyncReport]:
        conns = self._conns
        n = len(conns.clients)
        got = conns.fan_out({i: (lambda c: c.sync_steps(kind, **kwargs)) for i in range(n)})  # type: ignore[arg-type]
        return [got[i] for i in range(n)]
