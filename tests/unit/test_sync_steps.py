"""Synchronous and bounded-stale steps, sans-IO: the PS's step clock, the gradient mean, and the
coordinator's membership decisions (no sockets, no processes)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from jaxdist.base.errors import InvalidRequestError, StepMembershipError
from jaxdist.cluster_coordinator.sync_barrier import plan_keep, plan_skips
from jaxdist.proto import ps_pb2, ps_wire
from jaxdist.proto.ps_wire import Op, SyncKind, SyncReport, Update
from jaxdist.ps_server.sync_steps import Contribution, StepClock, SyncSteps, mean_gradients

F32 = np.dtype(np.float32)


def grad(name: str, value: float, shape: tuple[int, ...] = (2,)) -> Update:
    return Update(name, Op.APPLY_GRADIENT, np.full(shape, value, np.float32))


def clock(staleness: int, members: list[int]) -> StepClock:
    c = StepClock()
    c.configure(staleness, members)
    return c


# ------------------------------------------------------------------ StepClock
def test_synchronous_step_applies_once_when_every_member_committed() -> None:
    c = clock(0, [0, 1])
    assert c.stage(0, "a/1", [grad("w", 1.0)]) == 0
    c.commit(0)
    assert c.pop_complete() == []  # worker 1 has not committed step 0
    assert not c.ready(0)  # worker 0 may not start step 1 before step 0 is applied
    assert c.ready(1)
    assert c.stage(1, "b/1", [grad("w", 3.0)]) == 0
    c.commit(1)
    done = c.pop_complete()
    assert [s for s, _, _ in done] == [0]
    assert [x.contributor for x in done[0][1]] == [0, 1]
    assert c.applied == 1 and c.ready(0) and c.ready(1)
    assert c.pop_complete() == []  # applied once


def test_bounded_staleness_lets_a_worker_run_exactly_s_steps_ahead() -> None:
    c = clock(2, [0, 1])
    for step in range(2):
        assert c.ready(0)
        c.note_opened(0)
        c.stage(0, f"a/{step}", [grad("w", 1.0)])
        c.commit(0)
    assert c.ready(0)  # clock 2, slowest 0: exactly 2 ahead
    c.note_opened(0)
    c.stage(0, "a/2", [grad("w", 1.0)])
    c.commit(0)
    assert not c.ready(0)  # a 3rd step ahead: waits
    assert c.max_lead == 2
    c.stage(1, "b/0", [grad("w", 1.0)])
    c.commit(1)
    assert [s for s, _, _ in c.pop_complete()] == [0]
    assert c.ready(0)


def test_stage_refuses_non_members_mixed_ops_and_a_second_push_per_step() -> None:
    c = clock(0, [0])
    with pytest.raises(StepMembershipError):
        c.stage(5, "x/1", [grad("w", 1.0)])
    with pytest.raises(InvalidRequestError):
        c.stage(0, "x/2", [grad("w", 1.0), Update("w", Op.ASSIGN_ADD, np.ones(2, np.float32))])
    c.stage(0, "x/3", [grad("w", 1.0)])
    with pytest.raises(InvalidRequestError):
        c.stage(0, "x/4", [grad("w", 2.0)])
    with pytest.raises(StepMembershipError):
        c.commit(7)


def test_drop_discards_an_uncommitted_contribution_and_forgets_its_id() -> None:
    c = clock(0, [0, 1])
    c.stage(0, "a/1", [grad("w", 1.0)])
    c.commit(0)
    c.stage(1, "b/1", [grad("w", 5.0)])  # worker 1 dies before committing
    assert c.fence(1) == [0]
    with pytest.raises(StepMembershipError):
        c.commit(1)  # fenced: its late commit changes nothing
    c.drop(1)
    assert not c.is_staged("b/1")  # the closure's re-run may push it again
    ((step, contributions, n),) = c.pop_complete()
    assert step == 0 and [x.update_id for x in contributions] == ["a/1"] and n == 1


def test_drop_keeps_a_contribution_at_the_kept_step() -> None:
    c = clock(0, [0, 1])
    c.stage(1, "b/1", [grad("w", 5.0)])
    c.stage(0, "a/1", [grad("w", 1.0)])
    c.commit(0)
    c.fence(1)
    c.drop(1, keep=0)  # another PS had worker 1's commit: it counts here too
    ((step, contributions, n),) = c.pop_complete()
    assert [x.update_id for x in contributions] == ["a/1", "b/1"] and n == 2


def test_join_starts_at_the_applied_step_and_skip_moves_an_idle_member() -> None:
    c = clock(0, [0])
    for i in range(3):
        c.stage(0, f"a/{i}", [grad("w", 1.0)])
        c.commit(0)
        c.pop_complete()
    assert c.join(1, 0) == 3  # never into an applied step
    assert c.join(1, 10) == 3  # a member keeps its clock
    c.stage(0, "a/3", [grad("w", 1.0)])
    c.commit(0)
    assert c.pop_complete() == []  # waits for worker 1
    c.skip(1, 4)
    assert [s for s, _, _ in c.pop_complete()] == [3]
    c.stage(1, "b/4", [grad("w", 1.0)])
    with pytest.raises(InvalidRequestError):
        c.skip(1, 6)  # it has an uncommitted contribution: not idle


def test_a_worker_dropped_ahead_of_the_applied_step_rejoins_after_its_counted_steps() -> None:
    # Staleness 2: worker 0 commits steps 0 and 1 while worker 1 is still at step 0, then fails.
    # Its committed contributions stay in their steps; it rejoins after them, not at ``applied``.
    c = clock(2, [0, 1])
    for i in range(2):
        c.stage(0, f"a/{i}", [grad("w", 1.0)])
        c.commit(0)
    assert c.pop_complete() == []
    c.fence(0)
    c.drop(0)
    assert c.join(0, 0) == 2
    c.stage(0, "a/2", [grad("w", 1.0)])  # its step 2, not a second push to step 0
    # Its contribution to step 2 kept by a drop (committed on another PS) counts too: back at step 3.
    c.fence(0)
    c.drop(0, keep=2)
    assert c.join(0, 0) == 3
    for i in range(2):
        c.stage(1, f"b/{i}", [grad("w", 3.0)])
        c.commit(1)
    assert [(s, [x.update_id for x in cs], n) for s, cs, n in c.pop_complete()] == [
        (0, ["a/0", "b/0"], 2), (1, ["a/1", "b/1"], 2)]


def test_configure_off_and_no_members() -> None:
    c = clock(-1, [0])
    assert not c.enabled and c.ready(0)
    c = clock(0, [])
    assert c.pop_complete() == [] and c.ready(3)
    c.configure(0, [0])
    c.stage(0, "a", [grad("w", 1.0)])
    # A new coordinator: what the old one staged is never committed; it is discarded, its id forgotten.
    assert c.configure(0, [0, 1]) == 1
    assert not c.is_staged("a") and c.clocks == {0: 0, 1: 0}


# -------------------------------------------------------------- the mean
def test_mean_of_dense_gradients_in_the_variable_dtype() -> None:
    cs = [Contribution(0, "a", [grad("w", 1.0), grad("b", 2.0, ())]), Contribution(1, "b", [grad("w", 4.0)])]
    out = {u.name: u for u in mean_gradients(cs, lambda n: F32)}
    np.testing.assert_array_equal(out["w"].value, [2.5, 2.5])
    assert out["w"].op is Op.APPLY_GRADIENT and out["w"].value.dtype == F32
    np.testing.assert_array_equal(out["b"].value, 2.0)  # only one contribution carried it


def test_the_mean_divides_by_the_step_contributors_not_by_who_touched_the_variable() -> None:
    # Worker 1 pushed only to another PS (other rows of an embedding): here its gradient is zero.
    c = clock(0, [0, 1])
    c.stage(0, "a/1", [grad("w", 4.0)])
    c.commit(0)
    c.commit(1)
    ((step, contributions, n),) = c.pop_complete()
    assert n == 2
    (u,) = mean_gradients(contributions, lambda name: F32, n)
    np.testing.assert_array_equal(u.value, [2.0, 2.0])  # one process, combined batch: (4 + 0) / 2
    # A skipped (idle) worker is no contributor.
    c.stage(0, "a/2", [grad("w", 4.0)])
    c.commit(0)
    c.skip(1, 2)
    ((_, contributions, n),) = c.pop_complete()
    assert n == 1


def test_mean_of_bf16_gradients_is_taken_in_float32() -> None:
    import ml_dtypes

    g = Update("w", Op.APPLY_GRADIENT, np.full(2, 1.5, ml_dtypes.bfloat16))
    (u,) = mean_gradients([Contribution(0, "a", [g]), Contribution(1, "b", [grad("w", 0.5)])], lambda n: F32)
    assert u.value.dtype == F32
    np.testing.assert_array_equal(u.value, [1.0, 1.0])


def test_mean_of_sparse_and_dense_rows() -> None:
    sparse = Update("e", Op.SPARSE_APPLY_GRADIENT, np.ones((2, 3), np.float32), np.array([0, 2]))
    dense = Update("e", Op.APPLY_GRADIENT, np.full((4, 3), 2.0, np.float32))
    (u,) = mean_gradients([Contribution(0, "a", [sparse]), Contribution(1, "b", [dense])], lambda n: F32)
    assert u.op is Op.SPARSE_APPLY_GRADIENT
    full = np.zeros((4, 3), np.float32)
    np.add.at(full, u.indices, u.value)
    np.testing.assert_array_equal(full[:, 0], [1.5, 1.0, 1.5, 1.0])


# ------------------------------------------------------------ SyncSteps
class FakeStore:
    def __init__(self) -> None:
        self.applied: list[tuple[int, dict[str, np.ndarray], list[str]]] = []
        self.ids: set[str] = set()

    def apply_step(self, updates: list[Update], ids: list[str], step: int) -> None:
        self.applied.append((step, {u.name: u.value for u in updates}, ids))
        self.ids.update(ids)


def sync(staleness: int, members: list[int]) -> tuple[SyncSteps, FakeStore]:
    store = FakeStore()
    s = SyncSteps(store.apply_step, lambda n: F32, lambda i: i in store.ids)
    s.control(SyncKind.CONFIGURE, staleness=staleness, members=members)
    return s, store


def test_a_retried_push_never_contributes_twice() -> None:
    s, store = sync(0, [0, 1])
    assert s.push(0, "c1/1", [grad("w", 2.0)], commit=False) == (False, True, 0)
    assert s.push(0, "c1/1", [grad("w", 9.0)], commit=False) == (True, True, 0)  # staged: duplicate, awaits commit
    s.control(SyncKind.COMMIT, 0)
    s.push(1, "c2/1", [grad("w", 4.0)], commit=True)
    assert [(st, list(v)) for st, v, _ in store.applied] == [(0, ["w"])]
    np.testing.assert_array_equal(store.applied[0][1]["w"], [3.0, 3.0])
    assert store.applied[0][2] == ["c1/1", "c2/1"]
    # A re-run of closure c2 on worker 0, after the step was applied: a duplicate, nothing staged.
    assert s.push(0, "c2/1", [grad("w", 100.0)], commit=True) == (True, False, 1)
    assert len(store.applied) == 1


def test_a_duplicate_of_a_staged_uncommitted_push_still_asks_for_the_commit() -> None:
    # With several PS tasks the closure commits only when some PS answers ``staged``: a push sent
    # again after a lost answer (or the closure re-run on the same worker) must still say so, or the
    # worker's step is never committed and every member waits at the barrier.
    s, store = sync(0, [0, 1])
    assert s.push(0, "c/1", [grad("w", 2.0)], commit=False) == (False, True, 0)
    assert s.push(0, "c/1", [grad("w", 2.0)], commit=False) == (True, True, 0)
    # Another worker's re-run of the same closure is a duplicate that commits nothing of worker 0's.
    assert s.push(1, "c/1", [grad("w", 2.0)], commit=False) == (True, False, 0)
    s.control(SyncKind.COMMIT, 0)
    # Once committed, a duplicate no longer asks for a commit (a second one would end step 1).
    assert s.push(0, "c/1", [grad("w", 2.0)], commit=False) == (True, False, 1)
    assert s.control(SyncKind.STATUS).clocks == {0: 1, 1: 0}
    # A duplicate carrying ``commit`` (one PS) commits a staged contribution it finds uncommitted.
    assert s.push(1, "d/1", [grad("w", 4.0)], commit=False) == (False, True, 0)
    assert s.push(1, "d/1", [grad("w", 4.0)], commit=True) == (True, False, 1)
    assert len(store.applied) == 1 and store.applied[0][2] == ["c/1", "d/1"]
    np.testing.assert_array_equal(store.applied[0][1]["w"], [3.0, 3.0])


def test_a_pull_waits_at_the_barrier_until_the_slowest_commits() -> None:
    s, store = sync(0, [0, 1])
    s.push(0, "a/1", [grad("w", 1.0)], commit=True)
    assert s.wait_ready(0, timeout=0.0) == (False, 1)
    opened: list[tuple[bool, int]] = []
    t = threading.Thread(target=lambda: opened.append(s.wait_ready(0, timeout=30.0)))
    t.start()
    try:
        # The waiter shows in the report (the coordinator's idle-worker check reads it).
        from jaxdist.testing import poll_for

        poll_for(lambda: s.control(SyncKind.STATUS).waiting == [0], timeout=10, what="worker 0 waiting")
        s.push(1, "b/1", [grad("w", 1.0)], commit=True)
    finally:
        t.join(timeout=30)
    assert opened == [(True, 1)]
    assert s.wait_ready(7, timeout=0.0) == (True, -1)  # not a member: no barrier
    assert s.steps_applied == 1


def test_drop_of_a_failed_member_unblocks_the_step() -> None:
    s, store = sync(0, [0, 1])
    s.push(0, "a/1", [grad("w", 1.0)], commit=True)
    s.push(1, "b/1", [grad("w", 7.0)], commit=False)  # dies before committing
    r = s.control(SyncKind.FENCE, 1)
    assert r.staged_steps == [0] and r.uncommitted == 1
    with pytest.raises(StepMembershipError):
        s.push(1, "b/2", [grad("w", 1.0)], commit=True)
    r = s.control(SyncKind.DROP, 1, step=-1)
    assert r.applied == 1 and r.clocks == {0: 1}
    np.testing.assert_array_equal(store.applied[0][1]["w"], [1.0, 1.0])
    # The discarded id is free again: the closure's re-run on worker 0 contributes to worker 0's step.
    assert s.push(0, "b/1", [grad("w", 3.0)], commit=True) == (False, False, 1)


# ------------------------------------------------------- coordinator plans
def report(clocks: dict[int, int], applied: int = 0, waiting: list[int] | None = None, staleness: int = 0,
           uncommitted: int = 0) -> SyncReport:
    return SyncReport(True, staleness, applied, clocks, waiting or [], [], 0, uncommitted)


def test_plan_keep_counts_a_contribution_only_when_some_ps_had_its_commit() -> None:
    assert plan_keep([report({0: 3, 1: 2}), report({0: 3, 1: 2})], 1) == -1  # never committed anywhere
    assert plan_keep([report({0: 3, 1: 3}), report({0: 3, 1: 2})], 1) == 2  # committed on ps:0
    assert plan_keep([report({0: 3})], 1) == -1  # not a member


def test_plan_skips_moves_only_idle_members_and_only_when_the_ps_tasks_agree() -> None:
    # Worker 0 waits for step 2; worker 1 is idle at clock 1; worker 2 waits too.
    r = report({0: 2, 1: 1, 2: 2}, applied=1, waiting=[0, 2])
    assert plan_skips([r, r]) == {1: 2}
    assert plan_skips([r, report({0: 2, 1: 2, 2: 2}, applied=2)]) is None  # a commit in flight
    assert plan_skips([report({0: 2, 1: 1}, 1, [0], uncommitted=1)]) is None  # a push in flight
    assert plan_skips([report({0: 2, 1: 1}, 1, [])]) == {}  # nobody waits
    # Bounded staleness 1: worker 0 at clock 3 needs step 2 applied; idle worker 1 moves to 2.
    assert plan_skips([report({0: 3, 1: 1}, 1, [0], staleness=1)]) == {1: 2}
    # join(): everyone catches up with the furthest.
    assert plan_skips([report({0: 3, 1: 1, 2: 2}, 1)], final=True) == {1: 3, 2: 3}


# ------------------------------------------------------------------ wire
def test_sync_messages_round_trip_and_refuse_garbage() -> None:
    req = ps_wire.encode_sync_request(SyncKind.DROP, 3, step=7)
    assert ps_wire.decode_sync_request(ps_pb2.SyncStepsRequest.FromString(req.SerializeToString())) == (SyncKind.DROP, 3, 0, [], 7)
    with pytest.raises(InvalidRequestError):
        ps_wire.decode_sync_request(ps_pb2.SyncStepsRequest(kind=99))
    with pytest.raises(InvalidRequestError):
        ps_wire.decode_sync_request(ps_pb2.SyncStepsRequest(kind=ps_pb2.SYNC_COMMIT, contributor=-1))
    with pytest.raises(InvalidRequestError):
        ps_wire.decode_sync_request(ps_pb2.SyncStepsRequest(kind=ps_pb2.SYNC_CONFIGURE, members=[0, -2]))
    r = report({2: 5, 0: 4}, applied=4, waiting=[2])
    assert ps_wire.decode_sync_report(ps_wire.encode_sync_report(r)) == r
    header, _ = ps_wire.encode_push([grad("w", 1.0)], "u/1", contributor=0, commit=True)
    assert header.contributor == 1 and header.commit
    assert ps_wire.encode_pull([], contributor=-1).contributor == 0


def test_a_push_computed_at_another_step_is_refused() -> None:
    c = clock(0, [0, 1])
    c.stage(0, "a/1", [grad("w", 1.0)], pulled_at=0)
    c.commit(0)
    # Pushing twice per pull: the second gradient was computed at step 0, the worker is at step 1.
    with pytest.raises(StepMembershipError):
        c.stage(0, "a/2", [grad("w", 1.0)], pulled_at=0)
    # A frozen worker dropped and rejoined at a later step: its late push (pulled at 0) is refused.
    c.fence(1)
    c.drop(1)
    c.join(1, 5)
    with pytest.raises(StepMembershipError):
        c.stage(1, "b/1", [grad("w", 1.0)], pulled_at=0)
    assert c.stage(1, "b/1", [grad("w", 1.0)], pulled_at=c.clocks[1]) == c.clocks[1]


# ------------------------------------------------------------------ the barrier and a checkpoint's drain
class _FakePS:
    """Answers STATUS with ``state["report"]`` and records every other call."""

    def __init__(self, state: dict[str, object]) -> None:
        self.state = state

    def sync_steps(self, kind: SyncKind, **kwargs: object) -> SyncReport:
        if kind is not SyncKind.STATUS:
            self.state.setdefault("calls", []).append((kind, kwargs))  # type: ignore[union-attr]
        return self.state["report"]  # type: ignore[return-value]


class _FakeConnections:
    def __init__(self, state: dict[str, object]) -> None:
        self.clients = [_FakePS(state)]

    def fan_out(self, calls: dict[int, object]) -> dict[int, object]:
        return {i: fn(self.clients[i]) for i, fn in calls.items()}  # type: ignore[operator]


def test_the_barrier_skips_no_idle_worker_while_a_drain_hands_out_reruns() -> None:
    """A checkpoint's drain pauses dispatch but still hands out closures re-queued after a worker
    failure: an idle member takes one and pushes into the blocked step, so the barrier must not skip
    it meanwhile (it read ``dispatching``, False during any pause, and skipped it). Once the drain has
    nothing left to hand out, the idle member is skipped, or the step (and the drain) would wait forever."""
    from jaxdist.cluster_coordinator.closure_queue import Closure, ClosureQueue
    from jaxdist.cluster_coordinator.sync_barrier import StepBarrier
    from jaxdist.testing import poll_for

    q = ClosureQueue()
    a, b, c = Closure(fn=print), Closure(fn=print), Closure(fn=print)
    for x in (a, b, c):
        q.put(x)
    assert q.take(0) == [a] and q.take(1) == [b]
    q.retry(b)  # worker:1 died while running b (dropped from the steps): b may have run in part
    # Members 0 and 2: worker 0 waits at step 1 with a, worker 2 is idle at clock 0.
    state: dict[str, object] = {"report": report({0: 1, 2: 0}, 0, [0])}
    barrier = StepBarrier(_FakeConnections(state), 0, q)  # type: ignore[arg-type]
    drained: list[bool] = []
    drain = threading.Thread(target=lambda: drained.append(q.pause(timeout=60, drain=True)))
    drain.start()
    try:
        # The drain is in effect once it hands out b (c stays queued: it never ran).
        poll_for(lambda: q.handing_out, 30, what="the drain to hand out the re-queued closure")
        assert not q.dispatching
        barrier.look()
        assert "calls" not in state  # worker 2 is about to take b: no skip
        assert q.take(2) == [b]
        barrier.look()  # b runs and has not reached the barrier: a closure runs that will commit
        assert "calls" not in state
        q.mark_finished()  # b finished (its push joined step 1 from worker 2's side; here: it left)
        assert not q.handing_out and q.queued == 1  # c never ran: the drain does not hand it out
        barrier.look()  # a waits, worker 2 is idle and nothing can be handed out: skip it
        assert state["calls"] == [(SyncKind.SKIP, {"contributor": 2, "step": 1})]
        q.mark_finished()  # a's step applied
        drain.join(timeout=60)
        assert drained == [True]
    finally:
        q.stop()
        drain.join(timeout=60)


# ------------------------------------------------------------------ membership when a PS does not answer
class _ClockPS:
    """One PS's step clock (the real :class:`StepClock`) behind the client's ``sync_steps``. While
    ``down`` holds the kind of a request, the request fails as an unreachable PS's does (it does
    not reach the clock). ``applied`` records each applied step's contributors, in order."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.clock = StepClock()
        self.down: set[SyncKind] = set()
        self.applied: list[tuple[int, list[int]]] = []

    def sync_steps(self, kind: SyncKind, contributor: int = -1, staleness: int = 0, members: object = (),
                   step: int = -1, timeout: float = 10.0) -> SyncReport:
        from jaxdist.base.errors import PSUnavailableError

        if kind in self.down:
            raise PSUnavailableError(f"ps:{self.index}: failed to connect to all addresses (Connection refused)",
                                     task=f"ps:{self.index}")
        c, staged = self.clock, []
        if kind is SyncKind.CONFIGURE:
            c.configure(staleness, members)  # type: ignore[arg-type]
        elif kind is SyncKind.FENCE:
            staged = c.fence(contributor)
        elif kind is SyncKind.DROP:
            c.drop(contributor, step)
        elif kind is SyncKind.JOIN:
            c.join(contributor, step)
        elif kind is SyncKind.SKIP:
            c.skip(contributor, step)
        self.advance()
        return c.report((), staged)

    def advance(self) -> None:
        self.applied += [(s, [x.contributor for x in contributions]) for s, contributions, _ in self.clock.pop_complete()]


class _Cluster:
    """PS tasks of :class:`_ClockPS`, fanned out like :meth:`PSConnections.fan_out`: every call is made,
    then the first error is raised (a change may reach some PS tasks and not the others)."""

    def __init__(self, n: int) -> None:
        self.clients = [_ClockPS(i) for i in range(n)]

    def fan_out(self, calls: dict[int, object]) -> dict[int, object]:
        got: dict[int, object] = {}
        first: BaseException | None = None
        for i, fn in calls.items():
            try:
                got[i] = fn(self.clients[i])  # type: ignore[operator]
            except BaseException as e:  # noqa: BLE001 - raised after every call, as fan_out does
                first = first or e
        if first is not None:
            raise first
        return got


def _barrier(ps: _Cluster, members: list[int]):  # type: ignore[no-untyped-def]
    from jaxdist.cluster_coordinator.closure_queue import ClosureQueue
    from jaxdist.cluster_coordinator.sync_barrier import StepBarrier

    q = ClosureQueue()
    barrier = StepBarrier(ps, 0, q)  # type: ignore[arg-type]
    barrier.start(members)  # its watcher runs: it retries what a PS did not answer
    return barrier, q


def test_a_drop_that_a_ps_did_not_answer_is_retried_and_the_steps_go_on() -> None:
    """The hang of test_sigkilled_worker_is_dropped_and_synchronous_training_completes (a full-suite run,
    join() blocked 300 s): worker 1 is declared failed while ps:0 refuses connections. The fence reached
    ps:1 only; the barrier gave up ("steps wait for it") and kept it as a member, so (1) no step could pass
    it any more: worker 0's closure waited at the barrier forever, and join() for that closure; (2) when
    worker 1 came back, worker_joined() saw a member and did nothing: it stayed fenced on ps:1, its push was
    refused there and its closure failed (the job's error). The drop is now retried until every PS has it,
    and a worker joins (and takes closures) only once it is a member on every PS again."""
    from jaxdist.testing import poll_for

    ps = _Cluster(2)
    barrier, q = _barrier(ps, [0, 1])
    try:
        p0, p1 = ps.clients
        # Step 0: worker 0 committed it on both PS; worker 1's push reached ps:1 only (not committed).
        for p in (p0, p1):
            p.clock.stage(0, "a/0", [grad("w", 1.0)], pulled_at=0)
            p.clock.commit(0)
        p1.clock.stage(1, "b/0", [grad("w", 3.0)], pulled_at=0)
        p0.down = {SyncKind.FENCE, SyncKind.DROP, SyncKind.STATUS, SyncKind.JOIN}  # ps:0 refuses connections
        barrier.worker_failed(1)
        assert 1 in p1.clock._fenced and 1 not in p0.clock._fenced  # the fence reached ps:1 only
        assert 1 in barrier.members  # not dropped: the steps still wait for it
        assert barrier.worker_joined(1) is False  # back while ps:0 is down: not a member everywhere, takes nothing
        assert p0.applied == p1.applied == []
        p0.down = set()  # ps:0 answers again: the watcher completes the drop, and step 0 is applied on both
        # PS with worker 0's gradient alone (worker 1's uncommitted push discarded).
        poll_for(lambda: p0.applied == p1.applied == [(0, [0])], 30, what="the drop retried and step 0 applied")
        assert 1 not in barrier.members and not barrier.pending_drops
        assert barrier.worker_joined(1)  # configured again: it joins from the step being formed
        assert 1 in barrier.members
        assert p0.clock.clocks == p1.clock.clocks == {0: 1, 1: 1}
        assert not p1.clock._fenced  # its pushes are taken again on ps:1
    finally:
        q.stop()
        barrier.stop()


def test_a_drop_retried_keeps_the_step_its_fence_round_decided_on_every_ps() -> None:
    """Worker 1 committed step 0 on ps:1 before it died, not on ps:0: the fence round (answered by both)
    decides that its step-0 gradient counts. The drop then reaches ps:1 only. Its retry must drop it on
    ps:0 keeping step 0 too: recomputed from the reports then (ps:1 no longer has a clock for it), the
    commit would look lost and ps:0 would apply step 0 without it, unlike ps:1."""
    from jaxdist.testing import poll_for

    ps = _Cluster(2)
    barrier, q = _barrier(ps, [0, 1])
    try:
        p0, p1 = ps.clients
        for p in (p0, p1):
            p.clock.stage(0, "a/0", [grad("w", 1.0)], pulled_at=0)
            p.clock.commit(0)
            p.clock.stage(1, "b/0", [grad("w", 3.0)], pulled_at=0)
        p1.clock.commit(1)  # worker 1's commit reached ps:1 only
        p1.advance()
        assert p1.applied == [(0, [0, 1])] and p0.applied == []
        p0.down = {SyncKind.DROP}
        barrier.worker_failed(1)
        assert 1 in barrier.members and p0.applied == []
        p0.down = set()
        # The same step 0 on both PS.
        poll_for(lambda: p0.applied == p1.applied == [(0, [0, 1])], 30, what="the drop retried and step 0 applied")
        assert 1 not in barrier.members and not barrier.pending_drops
    finally:
        q.stop()
        barrier.stop()


def test_a_closure_failed_after_a_partial_push_is_withdrawn_from_the_steps() -> None:
    """A closure of worker 1 pushed to ps:1, then its push to ps:0 failed (ps:0 refused it) and the
    closure failed for good: its gradient is staged on ps:1 and will never be committed. Worker 1 is a
    healthy, idle member with an uncommitted contribution, so the barrier never skips it (plan_skips: not
    idle), and worker 0 would wait at step 1 forever (join() with it). Withdrawing worker 1 discards the
    staged gradient on every PS and joins it again at the step being formed."""
    ps = _Cluster(2)
    barrier, q = _barrier(ps, [0, 1])
    try:
        p0, p1 = ps.clients
        for p in (p0, p1):
            p.clock.stage(0, "a/0", [grad("w", 1.0)], pulled_at=0)
            p.clock.commit(0)
        p1.clock.stage(1, "b/0", [grad("w", 3.0)], pulled_at=0)
        assert plan_skips(barrier.reports()) is None  # worker 1 is not idle: never skipped
        assert barrier.withdraw(1)
        assert p0.applied == p1.applied == [(0, [0])]  # step 0 with worker 0's gradient alone, on both PS
        assert p0.clock.clocks == p1.clock.clocks == {0: 1, 1: 1}
        assert barrier.members == {0, 1} and not p1.clock._fenced
        assert barrier.withdraw(2)  # not a member (it left): nothing to do
        # A PS that does not answer: not a member everywhere again (the caller configures it again).
        p1.clock.stage(1, "b/1", [grad("w", 3.0)], pulled_at=1)
        p0.down = {SyncKind.FENCE}
        assert not barrier.withdraw(1)
        assert not barrier.worker_joined(1)
        p0.down = set()
        assert barrier.worker_joined(1)  # the drop completed first, then the join
        assert p0.clock.clocks == p1.clock.clocks == {0: 1, 1: 1} and not p1.clock._fenced
        assert p1.clock.report().uncommitted == 0  # worker 1's step-1 gradient is gone
    finally:
        q.stop()
        barrier.stop()


def test_a_join_that_a_commit_overtakes_on_one_ps_puts_the_worker_at_one_step_everywhere() -> None:
    """Worker 1 joins while worker 0 commits step 1: the commit reaches ps:1 before the join (worker 1
    no member yet there: step 1 is applied, the join puts it at step 2) and ps:0 after (member at step 1,
    step 1 waits for it). Different clocks on the two PS: its pull (step 2 on one) would not match its
    push (step 1 on the other): StepMembershipError, seen after a withdraw while the other worker trained.
    The join moves it to the furthest step on every PS."""
    ps = _Cluster(2)
    barrier, q = _barrier(ps, [0])
    try:
        p0, p1 = ps.clients
        for p in (p0, p1):
            p.clock.stage(0, "a/0", [grad("w", 1.0)], pulled_at=0)
            p.clock.commit(0)
            p.advance()
            p.clock.stage(0, "a/1", [grad("w", 1.0)], pulled_at=1)  # worker 0's step 1, pushed, not committed

        def commit_step_1() -> None:  # worker 0's commit fan-out: ps:1 before the join there, ps:0 after its join
            for p in (p1, p0):
                p.clock.commit(0)
                p.advance()

        real = p1.sync_steps

        def p1_sync_steps(kind: SyncKind, **kw: object) -> SyncReport:
            if kind is SyncKind.JOIN and not p1.applied[1:]:
                commit_step_1()
            return real(kind, **kw)  # type: ignore[arg-type]

        p1.sync_steps = p1_sync_steps  # type: ignore[method-assign]
        assert barrier.worker_joined(1)
        assert p0.clock.clocks == p1.clock.clocks == {0: 2, 1: 2}
        assert p0.applied == p1.applied == [(0, [0]), (1, [0])]  # step 1 without worker 1 on both PS
    finally:
        q.stop()
        barrier.stop()
