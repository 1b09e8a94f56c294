"""The coordinator's FailureHandler without sockets or threads: event sequences and their decisions,
time from a fake clock (in the manner of CoordinationState's tests)."""

from __future__ import annotations

import grpc
import pytest
from jaxdist.base import errors as E
from jaxdist.cluster_coordinator import failure_handler as fh
from jaxdist.cluster_coordinator.closure_queue import Closure
from jaxdist.cluster_coordinator.failure_handler import ClosureReport, FailureHandler, Outcome, PSMode

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def noop() -> None:
    return None


def handler(workers: int = 2, failure_timeout: float = 3.0, mode: PSMode = PSMode.NONE, **ps: float) -> tuple[FailureHandler, FakeClock]:
    clock = FakeClock()
    h = FailureHandler(failure_timeout, clock=clock)
    for i in range(workers):
        h.add_worker(i)
    if mode is not PSMode.NONE:
        h.set_ps_mode(mode, **ps)
    return h, clock


def healthy(workers: int = 2, **kw: object) -> tuple[FailureHandler, FakeClock]:
    h, clock = handler(workers, **kw)  # type: ignore[arg-type]
    for i in range(workers):
        h.worker_configured(i, f"inc-{i}")
    return h, clock


def report(c: Closure, outcome: Outcome, error: BaseException | None = None, payload: bytes = b"") -> ClosureReport:
    return ClosureReport(c, outcome, payload, error)


# ------------------------------------------------------------------ configure
def test_a_worker_is_healthy_only_once_configured() -> None:
    h, _ = handler()
    assert not h.is_healthy(0)
    assert h.worker_configured(0, "a") == [fh.RebuildResources(0)]  # first process: build its resources
    assert h.is_healthy(0) and h.incarnation(0) == "a"
    assert not h.is_healthy(1)


def test_reconfiguring_the_same_process_rebuilds_nothing() -> None:
    h, _ = healthy()
    h.call_failed(0, [], grpc.StatusCode.UNAVAILABLE)
    assert not h.is_healthy(0)
    assert h.worker_configured(0, "inc-0") == []
    assert h.is_healthy(0)


def test_a_new_process_gets_its_resources_rebuilt() -> None:
    h, _ = healthy()
    h.heartbeat_answered(0, "new")
    assert h.worker_configured(0, "new") == [fh.RebuildResources(0)]
    assert h.incarnation(0) == "new"


def test_a_departed_worker_stays_out() -> None:
    h, _ = healthy()
    h.remove_worker(1)
    assert h.worker_configured(1, "inc-1") == []
    s = h.worker_status(1)
    assert s.left and not s.healthy


# ------------------------------------------------------------------ heartbeats
def test_missed_heartbeats_declare_dead_only_after_the_timeout() -> None:
    h, clock = healthy(failure_timeout=3.0)
    clock.t += 1.0
    assert h.heartbeat_missed(0) == []
    clock.t += 1.9  # 2.9 s since the last answer
    assert h.heartbeat_missed(0) == []
    clock.t += 0.2
    assert h.heartbeat_missed(0) == [fh.DeclareDead(0, "no heartbeat for 3.0s")]
    assert not h.is_healthy(0) and h.worker_status(0).failures == 1
    assert h.is_healthy(1)


def test_any_answer_resets_the_silence() -> None:
    h, clock = healthy(failure_timeout=3.0)
    clock.t += 2.5
    h.closures_returned(0, [])  # a RunClosures answer counts like a heartbeat
    clock.t += 2.5
    assert h.heartbeat_missed(0) == []
    h.heartbeat_answered(0, "inc-0")
    clock.t += 2.9
    assert h.heartbeat_missed(0) == []
    clock.t += 5
    h.worker_configured(0, "inc-0")  # so does Configure
    assert h.heartbeat_missed(0) == []


def test_heartbeat_from_a_new_process_declares_the_old_one_dead() -> None:
    h, _ = healthy()
    assert h.heartbeat_answered(0, "inc-0") == []
    assert h.heartbeat_answered(0, "restarted") == [fh.DeclareDead(0, "it restarted")]
    assert h.incarnation(0) == "inc-0"  # adopted by the next Configure, not by a heartbeat


def test_a_failure_counts_once_however_much_evidence_arrives() -> None:
    h, clock = healthy()
    clock.t += 10
    h.heartbeat_missed(0)
    h.heartbeat_missed(0)
    h.call_failed(0, [], grpc.StatusCode.UNAVAILABLE)
    assert h.worker_status(0).failures == 1
    h.worker_configured(0, "inc-0")
    clock.t += 10
    h.heartbeat_missed(0)
    assert h.worker_status(0).failures == 2


# ------------------------------------------------------------------ failed calls
@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED])
def test_unreachable_worker_retries_its_batch(code: grpc.StatusCode) -> None:
    h, _ = healthy()
    batch = [Closure(noop), Closure(noop)]
    out = h.call_failed(1, batch, code, details="gone")
    assert out[0] == fh.DeclareDead(1, "WorkerUnavailableError")
    assert out[1:] == [fh.Retry(c) for c in batch]
    assert not h.is_healthy(1)


def test_cancelled_call_is_a_dead_worker_whatever_its_reason() -> None:
    h, _ = healthy()
    c = Closure(noop)
    out = h.call_failed(0, [c], grpc.StatusCode.CANCELLED, reason="CANCELLED")
    assert isinstance(out[0], fh.DeclareDead) and out[1:] == [fh.Retry(c)]


def test_restarted_worker_rejecting_the_call_retries_the_batch() -> None:
    h, _ = healthy()
    c = Closure(noop)
    out = h.call_failed(0, [c], grpc.StatusCode.FAILED_PRECONDITION, reason=E.WorkerRestartedError.reason)
    assert out == [fh.DeclareDead(0, "WorkerRestartedError"), fh.Retry(c)]


@pytest.mark.parametrize(
    "code, reason, cls",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, "", E.InvalidRequestError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "", E.PayloadTooLargeError),
        (grpc.StatusCode.UNAUTHENTICATED, "", E.AuthenticationError),
        (grpc.StatusCode.INTERNAL, "", E.RemoteError),
        (grpc.StatusCode.INVALID_ARGUMENT, E.InvalidRequestError.reason, E.InvalidRequestError),
    ],
)
def test_worker_rejecting_the_request_fails_the_batch(code: grpc.StatusCode, reason: str, cls: type) -> None:
    h, _ = healthy()
    batch = [Closure(noop), Closure(noop)]
    out = h.call_failed(0, batch, code, reason, "nope")
    assert [type(d) for d in out] == [fh.Fail, fh.Fail]
    assert all(isinstance(d.error, cls) and d.error.task == "worker:0" for d in out)  # type: ignore[union-attr]
    assert h.is_healthy(0)  # the worker answered: it is alive


# ---------------------------------------------------------------- closure results
def test_ok_results_finish_and_count() -> None:
    h, _ = healthy()
    a, b = Closure(noop), Closure(noop)
    assert h.closures_returned(0, [report(a, Outcome.OK, payload=b"1"), report(b, Outcome.OK, payload=b"2")]) == [
        fh.Finish(a, b"1"), fh.Finish(b, b"2")]
    assert h.worker_status(0).closures_done == 2 and h.worker_status(1).closures_done == 0


def test_user_error_fails_the_closure_in_every_mode() -> None:
    for mode in PSMode:
        h, _ = healthy(mode=mode)
        c = Closure(noop)
        err = ZeroDivisionError("x")
        assert h.closures_returned(0, [report(c, Outcome.ERROR, err)]) == [fh.Fail(c, err)]
        assert not h.dispatch_held


def test_a_failed_closure_names_its_worker_and_a_worker_can_be_sent_back_to_configure() -> None:
    """The worker a closure failed on travels with the Fail (the coordinator withdraws its staged
    gradients from the synchronous steps); ``reconfigure`` makes a healthy worker take nothing until it
    answers Configure again (it could not rejoin the steps)."""
    h, _ = healthy()
    c = Closure(noop)
    err = ZeroDivisionError("x")
    r = ClosureReport(c, Outcome.ERROR, error=err, pushed=True)
    (d,) = h.closures_returned(1, [r])
    assert d == fh.Fail(c, err, pushed=True) and isinstance(d, fh.Fail) and d.worker == 1
    assert h.reconfigure(1, "it could not rejoin the synchronous steps") == [fh.DeclareDead(1, "it could not rejoin the synchronous steps")]
    assert not h.is_healthy(1) and h.worker_status(1).failures == 1
    h.worker_configured(1, "inc-1")
    assert h.is_healthy(1)
    h.remove_worker(0)
    assert h.reconfigure(0, "x") == []  # it left: nothing to configure


def test_function_unknown_resends_it_without_counting_an_attempt() -> None:
    h, _ = healthy()
    c = Closure(noop)
    assert h.closures_returned(1, [report(c, Outcome.FUNCTION_UNKNOWN)]) == [
        fh.ForgetFunction(1, c.function.digest), fh.ReturnUnrun(c)]
    assert h.is_healthy(1)


def test_skipped_closures_go_back_unrun() -> None:
    h, _ = healthy()
    bad, skipped = Closure(noop), Closure(noop)
    err = ValueError("first one failed")
    out = h.closures_returned(0, [report(bad, Outcome.ERROR, err), report(skipped, Outcome.SKIPPED)])
    assert out == [fh.Fail(bad, err), fh.ReturnUnrun(skipped)]


def test_a_resource_closure_error_fails_its_input_not_the_job() -> None:
    """A per-worker dataset function that raised: InputFailed (no job error; its consumers fail),
    while the same error of an ordinary closure is a Fail (the job's error)."""
    h, _ = healthy()
    build, user = Closure(noop, resource_id=7), Closure(noop)
    err = E.PerWorkerInputError("per-worker input 7 failed to build on worker:0", 7, "worker:0")
    out = h.closures_returned(0, [report(build, Outcome.ERROR, err)])
    assert out == [fh.InputFailed(build, err)]
    assert h.is_healthy(0)
    assert h.closures_returned(0, [report(user, Outcome.ERROR, err)]) == [fh.Fail(user, err)]


def test_resource_unknown_retries_and_declares_the_worker_dead() -> None:
    h, _ = healthy()
    c = Closure(noop)
    out = h.closures_returned(0, [report(c, Outcome.RESOURCE_UNKNOWN)])
    assert out == [fh.Retry(c), fh.DeclareDead(0, "it lost its per-worker resources")]
    assert not h.is_healthy(0) and h.worker_status(0).failures == 1


def test_arguments_that_cannot_be_pickled_fail_only_their_closure() -> None:
    h, _ = healthy()
    batch = [Closure(noop) for _ in range(4)]
    err = TypeError("cannot pickle")
    assert h.arguments_failed(batch, 2, err) == [
        fh.ReturnUnrun(batch[0]), fh.ReturnUnrun(batch[1]), fh.Fail(batch[2], err), fh.ReturnUnrun(batch[3])]


def test_a_dispatch_bug_fails_the_unsettled_closures() -> None:
    h, _ = healthy()
    done, pending = Closure(noop), Closure(noop)
    done.succeed(b"")
    err = RuntimeError("bug")
    # It may have been sent and run: a push of it may be applied (its batches are consumed, not given back).
    assert h.dispatch_crashed([done, pending], err) == [fh.Fail(pending, err, pushed=True)]


# ---------------------------------------------------------- PS errors in closures
def _ps_down(task: str = "ps:1") -> E.PSUnavailableError:
    return E.PSUnavailableError(f"{task}: unreachable", task=task)


def _ps_empty(task: str) -> E.VariableNotFoundError:
    err = E.VariableNotFoundError(f"{task}: no variable 'w'")
    err.task = task  # type: ignore[attr-defined] - set by the client that called ``task``
    return err


def test_without_recovery_a_ps_error_fails_the_closure() -> None:
    h, _ = healthy()
    c = Closure(noop)
    err = _ps_down()
    assert h.closures_returned(0, [report(c, Outcome.ERROR, err)]) == [fh.Fail(c, err)]


def test_with_recovery_a_ps_error_retries_and_holds_dispatch_once() -> None:
    for mode in (PSMode.CHECKPOINT, PSMode.REPLICATION):
        h, _ = healthy(mode=mode)
        a, b = Closure(noop), Closure(noop)
        out = h.closures_returned(0, [report(a, Outcome.ERROR, _ps_down())])
        assert out == [fh.Retry(a), fh.HoldDispatch("ps:1")]
        assert h.dispatch_held
        assert h.closures_returned(1, [report(b, Outcome.ERROR, _ps_down())]) == [fh.Retry(b)]  # already held


def test_a_ps_restarted_empty_is_recoverable_with_recovery_or_replication() -> None:
    """Checkpoint mode restores it. Under replication, a killed primary restarted at its address before
    the workers learnt of the failover answers them as a primary, empty: the closure runs again (on the
    new primary), it does not fail the job (the nemesis soak, seed 97854616, failed the job so)."""
    for mode in (PSMode.CHECKPOINT, PSMode.REPLICATION):
        h, _ = healthy(mode=mode)
        c = Closure(noop)
        assert h.closures_returned(0, [report(c, Outcome.ERROR, _ps_empty("ps:0"))]) == [fh.Retry(c), fh.HoldDispatch("ps:0")]
    h, _ = healthy()  # without recovery or replication it is the job's error
    err = _ps_empty("ps:0")
    assert h.closures_returned(0, [report(c, Outcome.ERROR, err)]) == [fh.Fail(c, err)]
    # Classified by the task called, not by text: a missing *per-worker* thing is the user's error.
    for mode in (PSMode.CHECKPOINT, PSMode.REPLICATION):
        h, _ = healthy(mode=mode)
        err = _ps_empty("worker:0")
        assert h.closures_returned(0, [report(c, Outcome.ERROR, err)]) == [fh.Fail(c, err)]


def test_a_closure_stops_waiting_for_a_ps_after_max_retries() -> None:
    h, _ = healthy(mode=PSMode.CHECKPOINT)
    c = Closure(noop)
    c.attempt = fh.MAX_PS_RETRIES - 1
    assert h.closures_returned(0, [report(c, Outcome.ERROR, _ps_down())])[0] == fh.Retry(c)
    c.attempt = fh.MAX_PS_RETRIES
    err = _ps_down()
    assert h.closures_returned(0, [report(c, Outcome.ERROR, err)]) == [fh.Fail(c, err)]


# ------------------------------------------------------------- checkpoint mode
def test_checkpoint_mode_holds_while_a_ps_is_down_and_releases_when_back() -> None:
    h, clock = handler(mode=PSMode.CHECKPOINT, ps_timeout=60.0)
    assert h.ps_answered(0, "p0") == [] and h.ps_answered(1, "p1") == []
    assert h.ps_pass_done() == []
    clock.t += 0.5
    assert h.ps_missed(1) == [fh.HoldDispatch("ps:1")]
    assert h.ps_pass_done() == []  # still down: stay held
    clock.t += 0.5
    assert h.ps_missed(1) == []
    assert h.ps_answered(1, "p1") == []  # same process: it was only unreachable
    assert h.ps_pass_done() == [fh.ReleaseDispatch()]
    assert not h.dispatch_held


def test_checkpoint_mode_restores_a_restarted_ps_then_releases() -> None:
    h, clock = handler(mode=PSMode.CHECKPOINT)
    h.ps_answered(0, "p0")
    h.ps_answered(1, "p1")
    h.ps_missed(1)
    clock.t += 1
    h.ps_answered(0, "p0")
    h.ps_answered(1, "p1-new")
    assert h.ps_pass_done() == [fh.RestorePS(frozenset({1}))]  # already held since the miss
    assert h.dispatch_held
    assert h.ps_restored({1}) == [fh.ReleaseDispatch()]
    h.ps_answered(1, "p1-new")
    assert h.ps_pass_done() == []  # the new process is the known one now


def test_checkpoint_mode_restart_seen_without_an_outage_holds_first() -> None:
    h, _ = handler(mode=PSMode.CHECKPOINT)
    h.ps_answered(0, "p0")
    h.ps_answered(0, "p0-new")  # restarted between two probes
    assert h.ps_pass_done() == [fh.HoldDispatch("ps:0"), fh.RestorePS(frozenset({0}))]


def test_checkpoint_mode_failed_restore_fails_the_job() -> None:
    h, _ = handler(mode=PSMode.CHECKPOINT)
    h.ps_answered(0, "a")
    h.ps_answered(0, "b")
    h.ps_pass_done()
    err = E.PSUnavailableError("no checkpoint")
    assert h.ps_restore_failed({0}, err) == [fh.FailAll(err), fh.ReleaseDispatch()]


def test_checkpoint_mode_a_ps_away_too_long_fails_the_job_once_per_timeout() -> None:
    h, clock = handler(mode=PSMode.CHECKPOINT, ps_timeout=10.0)
    h.ps_answered(0, "p0")
    assert h.ps_missed(0) == [fh.HoldDispatch("ps:0")]
    clock.t += 10.0
    assert h.ps_missed(0) == []  # exactly the timeout: not yet
    clock.t += 0.5
    out = h.ps_missed(0)
    assert [type(d) for d in out] == [fh.FailAll, fh.ReleaseDispatch]
    assert isinstance(out[0].error, E.PSUnavailableError) and out[0].error.task == "ps:0"  # type: ignore[union-attr]
    assert not h.dispatch_held  # the error surfaces through dispatch
    clock.t += 5
    assert h.ps_missed(0) == []  # a new timeout started
    clock.t += 6
    assert type(h.ps_missed(0)[0]) is fh.FailAll


def test_release_waits_for_every_shard() -> None:
    h, _ = handler(mode=PSMode.CHECKPOINT)
    h.ps_missed(0)
    h.ps_missed(1)
    h.ps_answered(0, "p0")
    assert h.ps_pass_done() == []
    h.ps_answered(1, "p1")
    assert h.ps_pass_done() == [fh.ReleaseDispatch()]


# ------------------------------------------------------------- replication mode
def test_replication_fails_over_a_primary_silent_for_failover_after() -> None:
    h, clock = handler(mode=PSMode.REPLICATION, failover_after=1.5)
    assert h.ps_answered(0) == []
    assert h.ps_missed(0) == [fh.HoldDispatch("ps:0")]
    clock.t += 1.4
    assert h.ps_missed(0) == []
    clock.t += 0.1
    assert h.ps_missed(0) == [fh.FailOver(0)]
    assert h.ps_failed_over(0) == [fh.ReconfigureWorkers()]
    assert h.ps_pass_done() == [fh.ReleaseDispatch()]


def test_replication_retries_a_failover_that_failed() -> None:
    h, clock = handler(mode=PSMode.REPLICATION, failover_after=1.5)
    h.ps_missed(0)
    clock.t += 2
    assert h.ps_missed(0) == [fh.FailOver(0)]
    assert h.ps_failover_failed(0, E.PSUnavailableError("backup down too")) == []
    assert h.ps_pass_done() == []  # still held
    clock.t += 0.25
    assert h.ps_missed(0) == [fh.FailOver(0)]


def test_replication_attaches_a_missing_backup() -> None:
    h, _ = handler(mode=PSMode.REPLICATION)
    assert h.ps_answered(1, has_backup=False) == [fh.AttachBackup(1)]
    assert h.ps_answered(1, has_backup=True) == []


def test_replication_adopts_a_primary_promoted_by_hand_instead_of_failing_back() -> None:
    """ReplicaSet.fail_over called by the script (not through this handler): the next probe reaches
    another address, another process. That is the new primary, not a restart of the old one (which
    made the watcher fail the shard back over to the old primary: nemesis seed 1919667383's final
    check read shard 0 from one process twice). A restart at the same address is still one."""
    h, _ = handler(mode=PSMode.REPLICATION, failover_after=1.5)
    assert h.ps_answered(0, "p0", has_backup=True, primary="10.0.0.2:1") == []
    assert h.ps_answered(0, "b0", has_backup=False, primary="10.0.0.4:1") == [fh.AttachBackup(0)]
    assert h.ps_answered(0, "b0", has_backup=True, primary="10.0.0.4:1") == []
    assert h.ps_answered(0, "b0-restarted", has_backup=False, primary="10.0.0.4:1") == [
        fh.HoldDispatch("ps:0"), fh.FailOver(0)]


def test_replication_fails_over_a_primary_that_restarted_before_it_was_seen_silent() -> None:
    """A primary killed and restarted at its address within ``failover_after`` answers as a new process,
    empty, without its backup. Attaching the backup to it (a full sync of nothing) wiped the shard on
    both processes (the nemesis soak, seed 263643654): the backup is promoted instead, and only the
    restarted task is attached afterwards, as the new backup."""
    h, _ = handler(mode=PSMode.REPLICATION, failover_after=1.5)
    assert h.ps_answered(0, "p0", has_backup=True) == []
    assert h.ps_answered(0, "p0-restarted", has_backup=False) == [fh.HoldDispatch("ps:0"), fh.FailOver(0)]
    assert h.ps_answered(0, "p0-restarted", has_backup=False) == [fh.FailOver(0)]  # until the promotion: never attach
    assert h.ps_pass_done() == []  # held
    assert h.ps_failover_failed(0, E.PSUnavailableError("backup busy")) == []
    assert h.ps_answered(0, "p0-restarted", has_backup=False) == [fh.FailOver(0)]  # tried again
    assert h.ps_failed_over(0) == [fh.ReconfigureWorkers()]
    assert h.ps_answered(0, "b0", has_backup=False) == [fh.AttachBackup(0)]  # the promoted backup, alone
    assert h.ps_pass_done() == [fh.ReleaseDispatch()]
    assert h.ps_answered(0, "b0", has_backup=True) == []


def test_replication_ignores_incarnations() -> None:
    h, _ = handler(mode=PSMode.REPLICATION)
    h.ps_answered(0, "a")
    h.ps_answered(0, "b")  # the primary changes at every failover
    assert h.ps_pass_done() == []


def test_without_a_ps_mode_probes_decide_nothing() -> None:
    h, clock = handler()
    assert h.ps_missed(0) == []
    clock.t += 1000
    assert h.ps_missed(0) == [] and h.ps_pass_done() == []


def test_a_batch_taken_by_a_leaving_worker_goes_back_unrun() -> None:
    h, _ = healthy()
    batch = [Closure(noop), Closure(noop)]
    assert h.not_sent(batch) == [fh.ReturnUnrun(c) for c in batch]


# ------------------------------------------------------------- liveness at scale
def scaled(workers: int, *, rate: float = 200.0, heartbeat: float = 0.5, timeout: float = 3.0,
           forget_after: float = 60.0, elastic: bool = False) -> tuple[FailureHandler, FakeClock]:
    """``workers`` healthy workers, no jitter (rng 0.5), ``rate`` probes/s at most."""
    clock = FakeClock()
    h = FailureHandler(timeout, clock=clock, heartbeat_interval=heartbeat, max_probe_rate=rate,
                       forget_after=forget_after, rng=lambda: 0.5)
    for i in range(workers):
        h.add_worker(i, elastic=elastic)
        h.worker_configured(i, f"inc-{i}")
    return h, clock


def probes(decisions: list[fh.Decision]) -> list[int]:
    return [d.worker for d in decisions if isinstance(d, fh.Probe)]


def test_only_silent_workers_are_probed() -> None:
    h, clock = scaled(2)
    assert probes(h.tick()) == []  # both just answered Configure
    clock.t += 0.4
    h.closures_returned(0, [])  # worker 0 keeps answering RunClosures calls
    clock.t += 0.2  # worker 1 silent 0.6 s > heartbeat_interval 0.5; worker 0 only 0.2 s
    assert probes(h.tick()) == [1]
    assert probes(h.tick()) == []  # one probe at a time per worker


def test_probes_are_capped_at_the_rate_whatever_the_number_of_workers() -> None:
    h, clock = scaled(1000, rate=200.0)
    h.tick()  # learns how many are watched: the probe interval becomes 1000 / 200 = 5 s
    assert h.probe_interval == pytest.approx(5.0)
    sent: list[int] = []
    for _ in range(100):  # 10 s of ticks
        clock.t += 0.1
        got = probes(h.tick())
        sent += got
        for w in got:  # every probe is answered at once
            h.heartbeat_answered(w, f"inc-{w}")
    assert len(sent) <= 200 * 10 + 50  # the rate, plus the bucket's burst
    assert len(set(sent)) == 1000  # yet every worker was asked within 10 s


def test_a_probe_that_finds_nobody_listening_is_dead_at_once() -> None:
    h, clock = scaled(2)
    clock.t += 0.6
    h.tick()
    assert h.heartbeat_missed(0, unreachable=True) == [fh.DeclareDead(0, "unreachable (nobody listens at its address)")]
    assert not h.is_healthy(0) and h.is_healthy(1)


def test_a_probe_left_unanswered_is_dead_after_the_failure_timeout() -> None:
    h, clock = scaled(1, timeout=3.0)
    clock.t += 0.6
    assert probes(h.tick()) == [0]  # sent at t+0.6, never answered (a frozen process)
    clock.t += 2.9
    assert h.tick() == []
    clock.t += 0.2  # 3.1 s since the probe
    assert h.tick() == [fh.DeclareDead(0, "no heartbeat for 3.0s")]


def test_a_dropped_connection_is_probed_at_once_outside_the_budget() -> None:
    h, clock = scaled(1000, rate=1.0)
    h.tick()  # spends the one token
    assert h.connection_lost(7) == [fh.Probe(7)]
    assert h.connection_lost(7) == []  # already being probed
    h.heartbeat_answered(7, "inc-7")
    assert h.is_healthy(7)


def test_the_coordinators_own_stall_is_not_counted_against_workers() -> None:
    h, clock = scaled(1, timeout=3.0)
    clock.t += 0.6
    assert probes(h.tick()) == [0]
    clock.t += 10.0  # the coordinator could not run for 10 s (its loop ran that late)
    h.coordinator_stalled(10.0)
    assert h.tick() == []  # the probe has been out 0.6 s of the coordinator's own time
    assert h.is_healthy(0) and h.stalled_s == 10.0


def test_an_unreachable_registered_worker_is_forgotten_a_static_one_never() -> None:
    h, clock = scaled(0)
    h.add_worker(0, elastic=True)  # registered, never answered Configure
    h.add_worker(1)  # from the cluster spec
    clock.t += 59
    assert h.tick() == []
    clock.t += 2
    assert [type(d) for d in h.tick()] == [fh.ForgetWorker]
    assert h.worker_status(0).left and not h.worker_status(1).left
    clock.t += 1000
    assert h.tick() == []  # forgotten once; the static worker waits for ever


def test_probe_jitter_leaves_pythons_global_random_alone() -> None:
    """The heartbeat jitter has its own generator: a coordinator's threads must not move the sequence that
    random.seed / keras.utils.set_random_seed fix for the user (Keras seeds each initializer from it)."""
    import random

    random.seed(1234)
    expected = random.Random(1234).random()
    h, clock = healthy()
    for _ in range(5):
        clock.t += 1.0
        h.heartbeat_answered(0, "inc-0")  # each answer draws the next probe's jitter
        h.closures_returned(1, [])
    assert random.random() == expected


# ------------------------------------------------- the coordinator's own stall (tick_interval set)
TICK = 0.1


def ticking(workers: int, *, timeout: float = 3.0, rate: float = 200.0) -> tuple[FailureHandler, FakeClock]:
    """``workers`` healthy workers of a handler that measures its own lateness from ticks due every 0.1 s."""
    clock = FakeClock()
    h = FailureHandler(timeout, clock=clock, heartbeat_interval=0.5, max_probe_rate=rate, rng=lambda: 0.5,
                       tick_interval=TICK)
    for i in range(workers):
        h.add_worker(i)
        h.worker_configured(i, f"inc-{i}")
    h.tick()  # the first tick: what the next ones are measured from
    return h, clock


def run_ticks(h: FailureHandler, clock: FakeClock, seconds: float) -> list[fh.Decision]:
    """Tick on time (every 0.1 s) for ``seconds``: the coordinator runs normally. Returns every decision."""
    out: list[fh.Decision] = []
    for _ in range(round(seconds / TICK)):
        clock.t += TICK
        out += h.tick()
    return out


def dead(decisions: list[fh.Decision]) -> list[int]:
    return [d.worker for d in decisions if isinstance(d, fh.DeclareDead)]


def test_a_late_tick_is_the_coordinators_stall_not_the_workers_silence() -> None:
    """The loop could not run for 10 s (GC, CPU starvation, the process descheduled): the tick that
    finally runs finds every probe 10 s old in raw time, and fails nobody."""
    h, clock = ticking(2)
    sent = probes(run_ticks(h, clock, 0.6))
    assert sorted(sent) == [0, 1]  # both probed, neither answered yet
    clock.t += 10.0
    assert h.tick() == []
    assert h.stalled_s == pytest.approx(9.9)  # the gap less the one tick interval that was due
    assert h.is_healthy(0) and h.is_healthy(1)


def test_a_silent_worker_fails_after_the_timeout_the_coordinator_observed() -> None:
    """A frozen worker (its probe never answered) is still declared dead, after failure_timeout of
    time the coordinator ran, however long the coordinator itself stalled in between."""
    h, clock = ticking(1, timeout=3.0)
    assert probes(run_ticks(h, clock, 0.6)) == [0]  # the probe leaves at 0.6 s
    assert dead(run_ticks(h, clock, 1.0)) == []  # 1.0 s observed
    clock.t += 5.0  # a 5 s stall (4.9 s of it not observed)
    assert dead(h.tick()) == []  # 1.1 s observed
    assert dead(run_ticks(h, clock, 1.8)) == []  # 2.9 s observed
    assert dead(run_ticks(h, clock, 0.2)) == [0]  # past 3 s observed
    assert h.stalled_s == pytest.approx(4.9)


def test_a_coordinator_running_normally_fails_a_frozen_worker_within_the_timeout() -> None:
    """Ticks that run a little late (within STALL_GRACE_S) are ordinary jitter: nothing is discounted,
    and a worker that never answers fails exactly as without stall accounting."""
    h, clock = ticking(1, timeout=3.0)
    assert probes(run_ticks(h, clock, 0.6)) == [0]
    out: list[fh.Decision] = []
    for _ in range(21):  # ticks 0.04 s late each: 21 x 0.14 = 2.94 s
        clock.t += TICK + 0.04
        out += h.tick()
    assert dead(out) == [] and h.stalled_s == 0.0
    clock.t += TICK
    assert dead(h.tick()) == [0]


def test_a_miss_reported_before_the_late_tick_is_not_charged_the_stall() -> None:
    """After a stall the loop may carry out a heartbeat's DEADLINE_EXCEEDED before the late tick runs:
    the miss itself accounts the stall first, so the worker is asked again instead of failed."""
    h, clock = ticking(1, timeout=3.0)
    assert probes(run_ticks(h, clock, 0.6)) == [0]
    clock.t += 3.5  # the probe's deadline ran out while the coordinator could not run
    assert h.heartbeat_missed(0) == []
    assert h.is_healthy(0) and h.stalled_s == pytest.approx(3.4)
    assert probes(run_ticks(h, clock, 0.1)) == [0]  # asked again at once
    h.heartbeat_answered(0, "inc-0")
    assert h.worker_status(0).failures == 0


def test_every_worker_missing_right_after_the_coordinators_stall_is_not_n_failures() -> None:
    """200 workers with probes in flight when the coordinator stalls for 4 s: every probe times out
    at once. That is one stall of the coordinator, not 200 failures; all are asked again and answer."""
    h, clock = ticking(200, timeout=3.0)
    sent: set[int] = set()
    for d in run_ticks(h, clock, 1.5):  # the rate budget spreads the first 200 probes over 0.5-1.3 s
        assert not isinstance(d, fh.DeclareDead)
        if isinstance(d, fh.Probe):
            sent.add(d.worker)
    assert len(sent) == 200  # each probe still in flight
    clock.t += 4.0
    out: list[fh.Decision] = []
    for w in sorted(sent):
        out += h.heartbeat_missed(w)
    assert dead(out) == []
    again: set[int] = set()
    for i in range(30):
        clock.t += TICK if i else 0.0  # the first tick right after the misses
        for d in h.tick():
            if isinstance(d, fh.DeclareDead):
                raise AssertionError(f"{d} after the coordinator's own stall")
            if isinstance(d, fh.Probe):
                again.add(d.worker)
                h.heartbeat_answered(d.worker, f"inc-{d.worker}")
    assert again == sent
    assert sum(h.worker_status(i).failures for i in range(200)) == 0


def test_a_dead_worker_is_still_found_at_once_after_a_stall() -> None:
    """Stall accounting delays nothing that has evidence: a probe that finds nobody listening fails
    its worker at once, stall or not."""
    h, clock = ticking(2)
    assert sorted(probes(run_ticks(h, clock, 0.6))) == [0, 1]
    clock.t += 5.0
    assert h.heartbeat_missed(0, unreachable=True) == [fh.DeclareDead(0, "unreachable (nobody listens at its address)")]
    assert h.heartbeat_missed(1) == [] and h.is_healthy(1)


def test_tick_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="tick_interval"):
        FailureHandler(3.0, tick_interval=0.0)
