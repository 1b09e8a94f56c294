"""Synchronous and bounded-stale training on one PS: the step clock and gradient aggregation.

Contract (one PS task; every PS of a job runs the same clock, kept in step by
the workers' commits and the coordinator's membership changes, see
:mod:`jaxdist.cluster_coordinator.sync_barrier`):

- **Members** are worker indices (contributors). Each member has a *clock*:
  the number of steps it has committed. Step ``j`` is *complete* when every
  member's clock is above ``j``; complete steps are applied in order, each
  exactly once, and ``applied`` counts them (it is the slowest member's clock).
- **Staging.** A member's gradient push is staged for step ``clock`` (its
  current step), not applied. Only gradient ops are staged; a push that mixes
  gradients with other ops is refused. A push whose ``update_id`` is staged or
  was applied is a duplicate and changes nothing (exactly-once).
- **Commit.** ``commit(w)`` ends ``w``'s current step (its clock goes up by
  one) and counts ``w`` among the step's contributors. Workers commit only
  after their pushes reached every PS, and on every PS (also one they pushed
  nothing to), so a committed contribution is staged on every PS it
  touches and every PS counts the same contributors.
- **Applying** step ``j``: per variable, the sum of the gradients the step
  holds for it divided by the step's contributor count ``n`` (a contributor
  that pushed nothing for a variable counts as a zero gradient, as in one
  process with the combined batch), applied once with the variable's
  optimizer (sparse rows: all rows, each scaled by ``1/n``). The
  contributions' update ids become applied ids.
- **Barrier.** ``ready(w)``: ``applied >= clock_w - staleness``: a member
  starts step ``c`` only once the slowest member has committed ``c -
  staleness`` steps, i.e. it runs at most ``staleness`` steps ahead of the
  slowest. ``staleness == 0`` is synchronous SGD.
- **Membership.** ``fence(w)`` refuses ``w``'s pushes and reports its
  uncommitted staged steps; ``drop(w, keep)`` removes ``w``: its staged
  contribution at step ``keep`` is committed (the coordinator keeps it only
  when every PS has it), any other is discarded (its update id is forgotten,
  so the closure's re-run pushes again). ``join(w, step)`` adds ``w`` from
  step ``max(step, applied)``; ``skip(w, step)`` raises an idle member's
  clock to ``step`` (it contributes nothing to those steps).

:class:`StepClock` is the state machine, without threads or I/O (unit-tested
alone); :class:`SyncSteps` makes it thread-safe, lets pulls wait at the
barrier and applies complete steps to the :class:`VariableStore`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from jaxdist.base.errors import InvalidRequestError, StepMembershipError
from jaxdist.proto.ps_wire import GRADIENT_OPS, Op, SyncKind, SyncReport, Update

logger = logging.getLogger(__name__)

__all__ = ["Contribution", "StepClock", "SyncSteps", "mean_gradients"]


@dataclass
class Contribution:
    """One member's gradients for one step: the push's identity and its gradient updates."""

    contributor: int
    update_id: str
    updates: list[Update]


class StepClock:
    """The step clock of one PS: members, clocks, staged contributions (no threads, no I/O)."""

    def __init__(self) -> None:
        self.enabled = False
        self.staleness = 0
        self.applied = 0
        self.clocks: dict[int, int] = {}
        self._staged: dict[int, dict[int, Contribution]] = {}  # step -> contributor -> contribution
        self._counted: dict[int, set[int]] = {}  # step -> contributors that committed it
        self._staged_ids: dict[str, tuple[int, int]] = {}  # update id -> (step, contributor)
        self._fenced: set[int] = set()
        self.max_lead = 0

    # ---------------------------------------------------------------- config
    def configure(self, staleness: int, members: Iterable[int]) -> int:
        """Start synchronous steps (every member at the current applied step); ``staleness < 0`` stops them.

        A coordinator configures the steps when it starts (and turns them off when it stops), so
        contributions still staged belong to a coordinator that is gone: its closures will never
        commit them. They are discarded (their update ids forgotten); returns how many.
        """
        discarded = len(self._staged_ids) + sum(1 for slot in self._staged.values() for c in slot.values() if not c.update_id)
        self._staged.clear()
        self._staged_ids.clear()
        self._counted.clear()
        self._fenced.clear()
        if staleness < 0:
            self.enabled = False
            self.clocks = {}
            return discarded
        self.enabled = True
        self.staleness = staleness
        self.clocks = {int(w): self.applied for w in members}
        return discarded

    def is_member(self, w: int) -> bool:
        return self.enabled and w in self.clocks

    # --------------------------------------------------------------- barrier
    def ready(self, w: int) -> bool:
        """Whether member ``w`` may start its current step (non-members never wait)."""
        if not self.is_member(w):
            return True
        return self.applied >= self.clocks[w] - self.staleness

    def lead(self, w: int) -> int:
        """Steps ``w`` is ahead of the slowest member."""
        return self.clocks[w] - min(self.clocks.values())

    def note_opened(self, w: int) -> None:
        """``w``'s pull passed the barrier (for the ``max_lead`` figure)."""
        if self.is_member(w):
            self.max_lead = max(self.max_lead, self.lead(w))

    # --------------------------------------------------------------- staging
    def is_staged(self, update_id: str) -> bool:
        return update_id in self._staged_ids

    def awaits_commit(self, update_id: str, w: int) -> bool:
        """Whether ``update_id`` is member ``w``'s staged contribution to a step ``w`` has not committed yet."""
        at = self._staged_ids.get(update_id)
        return at is not None and at[1] == w and w in self.clocks and w not in self._fenced and at[0] >= self.clocks[w]

    def stage(self, w: int, update_id: str, updates: Sequence[Update], pulled_at: int = -1) -> int:
        """Stage member ``w``'s gradients for its current step; returns that step.

        ``pulled_at`` (-1: unknown) is the step ``w``'s pull reported: the gradient was
        computed at it, so it must still be ``w``'s step.

        Raises:
            StepMembershipError: ``w`` is not a member (dropped, or fenced), or is no longer at
                step ``pulled_at``.
            InvalidRequestError: a non-gradient op, or a second push in one step.
        """
        if not self.is_member(w) or w in self._fenced:
            raise StepMembershipError(
                f"worker {w} takes no part in the synchronous steps (it was declared failed or left); "
                "its closure is re-run elsewhere")
        if pulled_at >= 0 and pulled_at != self.clocks[w]:
            raise StepMembershipError(
                f"worker {w} pulled at step {pulled_at} but is at step {self.clocks[w]}: it was dropped and "
                "rejoined meanwhile, or it pushes twice per pull (pull before each gradient push)")
        bad = [u for u in updates if u.op not in GRADIENT_OPS]
        if bad:
            raise InvalidRequestError(
                f"a push in a synchronous step carries gradients only; {bad[0].op.value} on {bad[0].name!r} "
                "must be pushed separately")
        step = self.clocks[w]
        slot = self._staged.setdefault(step, {})
        if w in slot:
            raise InvalidRequestError(
                f"worker {w} already pushed gradients for step {step}; one push per step (commit it first)")
        slot[w] = Contribution(w, update_id, list(updates))
        if update_id:
            self._staged_ids[update_id] = (step, w)
        return step

    # ---------------------------------------------------------------- clocks
    def commit(self, w: int) -> None:
        """End member ``w``'s current step.

        Raises:
            StepMembershipError: ``w`` is not a member.
        """
        if not self.is_member(w) or w in self._fenced:
            raise StepMembershipError(f"worker {w} takes no part in the synchronous steps; nothing to commit")
        self._counted.setdefault(self.clocks[w], set()).add(w)
        self.clocks[w] += 1

    def fence(self, w: int) -> list[int]:
        """Refuse ``w``'s pushes and commits from now on; the steps of its uncommitted staged contributions."""
        if not self.is_member(w):
            return []
        self._fenced.add(w)
        return sorted(s for s, slot in self._staged.items() if w in slot and s >= self.clocks[w])

    def drop(self, w: int, keep: int = -1) -> None:
        """Remove ``w``; its uncommitted contribution at step ``keep`` counts, any other is discarded."""
        if not self.is_member(w):
            return
        clock = self.clocks.pop(w)
        self._fenced.discard(w)
        if keep >= clock:  # committed on another PS: a contributor of that step here too
            self._counted.setdefault(keep, set()).add(w)
        for step in list(self._staged):
            slot = self._staged[step]
            c = slot.get(w)
            if c is None or step < clock or step == keep:
                continue  # committed (or kept): it stays in its step
            del slot[w]
            self._staged_ids.pop(c.update_id, None)
            if not slot:
                del self._staged[step]

    def join(self, w: int, step: int) -> int:
        """Add ``w`` from step ``max(step, applied, its last counted step + 1)``; a member keeps its
        clock. Returns its clock.

        With staleness > 0 a dropped worker may have committed (or had kept) contributions to steps
        not applied yet; they stay in their steps, so it rejoins after the last of them: joining at
        ``applied`` would let it contribute to those steps twice (or have its push refused there).
        """
        if not self.enabled:
            return 0
        if w not in self.clocks:
            counted = max((s for s, ws in self._counted.items() if w in ws), default=-1)
            self.clocks[w] = max(step, self.applied, counted + 1)
            self._fenced.discard(w)
        return self.clocks[w]

    def skip(self, w: int, step: int) -> None:
        """Raise idle member ``w``'s clock to ``step``: it contributes nothing to the steps below.

        Raises:
            InvalidRequestError: ``w`` has an uncommitted staged contribution (it is not idle).
        """
        if not self.is_member(w) or self.clocks[w] >= step:
            return
        if any(w in slot and s >= self.clocks[w] for s, slot in self._staged.items()):
            raise InvalidRequestError(f"worker {w} has an uncommitted contribution; it is not idle")
        self.clocks[w] = step

    # -------------------------------------------------------------- applying
    def frontier(self) -> int:
        """The first step not complete: the slowest member's clock."""
        if self.clocks:
            return min(self.clocks.values())
        return max(self._staged, default=self.applied - 1) + 1

    def pop_complete(self) -> list[tuple[int, list[Contribution], int]]:
        """The complete steps not applied yet, in order: ``(step, contributions, contributor count)``
        (the caller applies them)."""
        out = []
        end = self.frontier()
        while self.applied < end:
            slot = self._staged.pop(self.applied, {})
            counted = self._counted.pop(self.applied, set())
            contributions = [slot[w] for w in sorted(slot)]
            for c in contributions:
                self._staged_ids.pop(c.update_id, None)
            out.append((self.applied, contributions, max(len(counted | set(slot)), 1)))
            self.applied += 1
        return out

    def report(self, waiting: Iterable[int] = (), staged_steps: Sequence[int] = ()) -> SyncReport:
        uncommitted = sum(1 for s, slot in self._staged.items() for w in slot if w in self.clocks and s >= self.clocks[w])
        return SyncReport(self.enabled, self.staleness, self.applied, dict(self.clocks), sorted(set(waiting)),
                          list(staged_steps), self.max_lead, uncommitted)


def mean_gradients(contributions: Sequence[Contribution], dtype_of: Callable[[str], np.dtype], n: int | None = None) -> list[Update]:
    """One update per variable: the sum of the contributions' gradients for it divided by ``n``
    (the step's contributor count; None: how many contributions carry the variable).

    Dense gradients are summed in the variable's dtype, in contributor order,
    then divided. Sparse rows (and dense gradients mixed with them) become one
    sparse update of every row, each scaled by ``1/n``.
    """
    by_var: dict[str, list[Update]] = {}
    for c in contributions:
        for u in c.updates:
            by_var.setdefault(u.name, []).append(u)
    out = []
    for name, ups in by_var.items():
        dt = dtype_of(name)
        count = len(ups) if n is None else n
        if all(u.op is Op.APPLY_GRADIENT for u in ups):
            total = np.array(ups[0].value, dtype=dt)
            for u in ups[1:]:
                total += np.asarray(u.value, dtype=dt)
            out.append(Update(name, Op.APPLY_GRADIENT, total / dt.type(count)))
            continue
        dense = [u for u in ups if u.op is Op.APPLY_GRADIENT]
        sparse = [u for u in ups if u.op is Op.SPARSE_APPLY_GRADIENT]
        idx = [np.asarray(u.indices, np.int64) for u in sparse]
        rows = [np.asarray(u.value, dtype=dt) for u in sparse]
        for u in dense:
            v = np.asarray(u.value, dtype=dt)
            idx.append(np.arange(v.shape[0], dtype=np.int64))
            rows.append(v)
        out.append(Update(name, Op.SPARSE_APPLY_GRADIENT, np.concatenate(rows) / dt.type(count), np.concatenate(idx)))
    return out


class SyncSteps:
    """Thread-safe :class:`StepClock` of one PS: the barrier pulls wait at, and the applier of complete steps.

    ``apply_step(updates, update_ids, step)`` applies one step's mean
    gradients atomically and records its contributions' update ids as applied
    (:meth:`VariableStore.apply_step`); ``dtype_of(name)`` gives a variable's dtype.
    """

    def __init__(
        self,
        apply_step: Callable[[Sequence[Update], Sequence[str], int], object],
        dtype_of: Callable[[str], np.dtype],
        was_applied: Callable[[str], bool],
    ) -> None:
        self._clock = StepClock()
        self._cond = threading.Condition()
        self._apply_step = apply_step
        self._dtype_of = dtype_of
        self._was_applied = was_applied
        self._waiting: dict[int, int] = {}  # contributor -> pulls waiting now
        self.steps_applied = 0

    @property
    def enabled(self) -> bool:
        return self._clock.enabled

    def wait_ready(self, w: int, timeout: float) -> tuple[bool, int]:
        """Wait up to ``timeout`` s until member ``w`` may start its step; ``(open, its step)``.

        ``(True, -1)`` when synchronous steps are off or ``w`` is no member (no barrier).
        """
        deadline = time.monotonic() + max(0.0, timeout)
        with self._cond:
            if not self._clock.is_member(w):
                return True, -1
            self._waiting[w] = self._waiting.get(w, 0) + 1
            try:
                while not self._clock.ready(w):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False, self._clock.clocks.get(w, -1)
                    self._cond.wait(left)
                    if not self._clock.is_member(w):
                        return True, -1
                self._clock.note_opened(w)
                return True, self._clock.clocks[w]
            finally:
                n = self._waiting[w] - 1
                if n:
                    self._waiting[w] = n
                else:
                    del self._waiting[w]

    def stages(self, w: int) -> bool:
        """Whether a gradient push by contributor ``w`` is staged (synchronous steps on; ``w`` a member or fenced)."""
        return self._clock.enabled and w in self._clock.clocks

    def push(self, w: int, update_id: str, updates: Sequence[Update], commit: bool,
             pulled_at: int = -1) -> tuple[bool, bool, int]:
        """Stage member ``w``'s gradients (and commit them with ``commit``); ``(duplicate, staged, step)``.

        ``staged``: the contribution is staged and still waits for its member's commit: true for a
        new push without ``commit``, and for a duplicate (a push sent again after a lost answer, or a
        closure re-run on the same worker) whose first copy ``w`` staged but never committed, so the
        caller commits it (``commit`` commits it here); false once it was committed or applied (committing again would end the
        member's next step). ``pulled_at``: see :meth:`StepClock.stage`."""
        with self._cond:
            if update_id and (self._clock.is_staged(update_id) or self._was_applied(update_id)):
                if commit and self._clock.awaits_commit(update_id, w):
                    self._clock.commit(w)
                    self._advance()
                return True, self._clock.awaits_commit(update_id, w), self._clock.clocks.get(w, -1)
            step = self._clock.stage(w, update_id, updates, pulled_at)
            if commit:
                self._clock.commit(w)
                self._advance()
            return False, not commit, step

    def control(self, kind: SyncKind, w: int = -1, staleness: int = 0, members: Iterable[int] = (), step: int = -1) -> SyncReport:
        """Carry out one ``SyncSteps`` request (see :class:`StepClock`); the clock's report after it."""
        with self._cond:
            staged: list[int] = []
            if kind is SyncKind.CONFIGURE:
                discarded = self._clock.configure(staleness, members)
                if discarded:
                    logger.warning("synchronous steps reconfigured: %d staged contributions of the previous "
                                   "coordinator discarded (never committed)", discarded)
            elif kind is SyncKind.COMMIT:
                self._clock.commit(w)
            elif kind is SyncKind.FENCE:
                staged = self._clock.fence(w)
            elif kind is SyncKind.DROP:
                self._clock.drop(w, step)
            elif kind is SyncKind.JOIN:
                self._clock.join(w, step)
            elif kind is SyncKind.SKIP:
                self._clock.skip(w, step)
            self._advance()
            self._cond.notify_all()
            return self._clock.report(self._waiting, staged)

    def _advance(self) -> None:
        """Apply every complete step, in order (lock held: steps are applied one at a time, in order)."""
        for step, contributions, n in self._clock.pop_complete():
            updates = mean_gradients(contributions, self._dtype_of, n)
            if updates:
                self._apply_step(updates, [c.update_id for c in contributions if c.update_id], step)
            self.steps_applied += 1
        self._cond.notify_all()
