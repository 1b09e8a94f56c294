"""ClosureQueue without sockets or workers: TF's error/cancellation contract."""

from __future__ import annotations

import sys
import threading

import pytest

from jaxdist.cluster_coordinator.closure_queue import Closure, ClosureQueue
from jaxdist.testing import poll_for
from jaxdist.errors import CancelledError
from jaxdist.cluster_coordinator.remote_value import RemoteValueStatus

pytestmark = pytest.mark.timeout(30)


def noop() -> None:
    return None


def test_get_finish_join() -> None:
    q = ClosureQueue()
    cs = [Closure(noop) for _ in range(5)]
    for c in cs:
        q.put(c)
    batch = q.take(0, max_n=3)
    assert [c.id for c in batch] == [c.id for c in cs[:3]]
    assert not q.done()
    q.mark_finished(3)
    q.mark_finished(0)
    rest = q.take(1, max_n=10)
    assert len(rest) == 2
    q.mark_finished(2)
    assert q.done() and q.wait(timeout=0)


def test_error_cancels_queued_and_raises_once() -> None:
    q = ClosureQueue()
    cs = [Closure(noop) for _ in range(4)]
    for c in cs:
        q.put(c)
    (running,) = q.take(0)
    err = KeyError("boom")
    running.fail(err)
    q.mark_failed(err)
    for c in cs[1:]:
        assert c.remote_value.status is RemoteValueStatus.ABORTED
        with pytest.raises(CancelledError):
            c.remote_value.fetch()
    with pytest.raises(KeyError):
        q.wait()
    q.wait()  # cleared after raising once
    with pytest.raises(KeyError):  # the failed closure raises every time
        running.remote_value.fetch()
    with pytest.raises(KeyError):
        running.remote_value.fetch()


def _one_failed_one_running() -> ClosureQueue:
    """A queue where of two closures taken by workers 0 and 1, the first failed (ValueError "x") and the
    second still runs."""
    q = ClosureQueue()
    for worker in (0, 1):
        q.put(Closure(noop))
        q.take(worker)
    q.mark_failed(ValueError("x"))
    return q


def test_error_waits_for_running_closures() -> None:
    q = _one_failed_one_running()
    raised = threading.Event()

    def joiner() -> None:
        with pytest.raises(ValueError):
            q.wait()
        raised.set()

    t = threading.Thread(target=joiner)
    t.start()
    assert not raised.wait(0.2)  # b is still running
    q.mark_finished()
    t.join(5)
    assert raised.is_set()


def test_a_timed_wait_is_bounded_while_an_error_waits_for_running_closures() -> None:
    """join(timeout) with an error recorded and a closure still running: it times out (the error
    kept for the next call) instead of waiting for that closure without a limit."""
    q = _one_failed_one_running()
    assert q.wait(timeout=0.05) is False  # b still runs: timed out, nothing raised or cleared
    assert q.has_error()
    q.mark_finished()
    with pytest.raises(ValueError):
        q.wait(timeout=5)
    assert q.wait(timeout=0)


def _waiting_in(thread: threading.Thread, function: str) -> bool:
    """Whether ``thread`` is blocked inside ``function`` (a frame of its stack)."""
    frame = sys._current_frames().get(thread.ident or -1)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


@pytest.mark.parametrize("call", ["wait", "done"])
def test_an_error_is_raised_to_exactly_one_of_several_waiting_threads(call: str) -> None:
    """TF's contract, "the error is raised once": several threads in join/done while a closure error is
    pending and another closure still runs. One gets the error; every other returns normally. Before, the others
    re-read an error the first had cleared and raised ``None`` (TypeError)."""
    q = _one_failed_one_running()
    outcomes: list[str] = []

    def caller() -> None:
        try:
            getattr(q, call)()
            outcomes.append("returned")
        except ValueError:
            outcomes.append("ValueError")
        except BaseException as e:  # whatever else came out is reported
            outcomes.append(type(e).__name__)

    threads = [threading.Thread(target=caller) for _ in range(3)]
    for t in threads:
        t.start()
    # All three wait for b inside raise_if_error, with the error still recorded.
    poll_for(lambda: all(_waiting_in(t, "raise_if_error") for t in threads), 10, what="three callers waiting for b")
    q.mark_finished()
    for t in threads:
        t.join(10)
    assert sorted(outcomes) == ["ValueError", "returned", "returned"], outcomes


def test_retry_goes_first_and_counts_an_attempt() -> None:
    q = ClosureQueue()
    a, b = Closure(noop), Closure(noop)
    q.put(a)
    q.put(b)
    (got,) = q.take(0)
    q.retry(got)
    assert got.attempt == 1 and q.retried == 1
    assert q.take(1)[0] is a
    assert q.inflight == 1


def test_return_unrun_goes_first_without_an_attempt() -> None:
    q = ClosureQueue()
    a, b = Closure(noop), Closure(noop)
    q.put(a)
    q.put(b)
    (got,) = q.take(0)
    q.return_unrun(got)
    assert got.attempt == 0 and q.retried == 0 and q.inflight == 0
    assert q.take(1, max_n=2) == [a, b]


def test_tagged_closure_comes_back_to_its_worker() -> None:
    q = ClosureQueue()
    t = Closure(noop)
    q.put_tagged(1, t)
    (got,) = q.take(1)
    q.retry(got)
    assert q.take(0) == []
    assert q.take(1) == [t] and t.attempt == 1


@pytest.mark.parametrize("how", ["retry", "return_unrun"])
def test_requeue_after_error_cancels_and_gives_data_back(how: str) -> None:
    q = ClosureQueue()
    a, b = Closure(noop), Closure(noop)
    given_back = []
    b.on_cancel = lambda: given_back.append(b.id)
    q.put(a)
    q.put(b)
    (ga,) = q.take(0)
    (gb,) = q.take(1)
    q.mark_failed(RuntimeError("x"))
    getattr(q, how)(gb)
    assert gb.remote_value.status is RemoteValueStatus.ABORTED
    assert given_back == [b.id]
    assert q.retried == 0


def test_held_queue_hands_out_nothing_until_released() -> None:
    q = ClosureQueue()
    a = Closure(noop)
    q.put(a)
    q.set_held(True)
    assert q.held and q.take(0) == []
    assert q.pause(timeout=0)  # a checkpoint's pause nests with the hold
    q.set_held(False)
    assert q.take(0) == []  # still paused
    q.resume()
    assert q.take(0) == [a]


def test_closure_settles_once_and_runs_ledger_hooks_once() -> None:
    import cloudpickle

    events: list[str] = []
    ok = Closure(noop)
    ok.on_done, ok.on_cancel = (lambda: events.append("done")), (lambda: events.append("cancel"))
    ok.succeed(cloudpickle.dumps(7))
    ok.fail(RuntimeError("late"))  # a late failure of another attempt changes nothing
    assert ok.remote_value.fetch() == 7 and events == ["done"]
    bad = Closure(noop)
    bad.on_cancel = lambda: events.append("cancel")
    bad.fail(KeyError("k"))
    bad.cancel(CancelledError("c"))
    assert events == ["done", "cancel"] and bad.remote_value.status is RemoteValueStatus.READY
    with pytest.raises(KeyError):
        bad.remote_value.fetch()


def test_tagged_closures_only_go_to_their_worker_first() -> None:
    q = ClosureQueue()
    general = Closure(noop)
    tagged = Closure(noop)
    q.put(general)
    q.put_tagged(1, tagged)
    assert q.take(0) == [general]
    assert q.take(1) == [tagged]
    assert q.take(0) == []


def test_put_blocks_when_full() -> None:
    q = ClosureQueue(max_size=2)
    q.put(Closure(noop))
    q.put(Closure(noop))
    done = threading.Event()

    def producer() -> None:
        q.put(Closure(noop))
        done.set()

    t = threading.Thread(target=producer)
    t.start()
    assert not done.wait(0.2)
    q.take(0)
    assert done.wait(5)
    t.join()


def test_result_is_set_once() -> None:
    c = Closure(noop)
    import cloudpickle

    c.remote_value.set_result(cloudpickle.dumps(1))
    c.remote_value.set_result(cloudpickle.dumps(2))
    assert c.remote_value.fetch() == 1


def test_dispatching_is_false_while_paused_held_or_stopped() -> None:
    q = ClosureQueue()
    assert q.dispatching
    q.pause(timeout=0)
    assert not q.dispatching
    q.resume()
    q.set_held(True)
    assert not q.dispatching
    q.set_held(False)
    assert q.dispatching
    q.stop()
    assert not q.dispatching


def other() -> None:
    return None


def test_take_extends_a_batch_only_with_the_named_function() -> None:
    q = ClosureQueue()
    a = [Closure(noop) for _ in range(3)]
    b = [Closure(other) for _ in range(2)]
    last = Closure(noop)
    for c in a + b + [last]:
        q.put(c)
    assert q.head() is a[0]
    # One by fair share, then more only while the next closure is noop's, up to extend_to in all.
    assert q.take(0, 1, extend_to=5, extend_fn=noop) == a
    assert q.head() is b[0]
    assert q.take(1, 1, extend_to=5, extend_fn=noop) == [b[0]]  # b[1] is not noop's
    assert q.take(1, 1, extend_to=2, extend_fn=other) == [b[1]]  # the next is noop's, not other's
    assert q.take(1, 1, extend_to=4, extend_fn=noop) == [last]  # nothing left to extend with
    assert q.head() is None and q.inflight == 6
    q.mark_finished(6)
    assert q.done()


def test_remote_value_wakes_a_waiter_made_before_it_settles() -> None:
    c = Closure(noop)
    rv = c.remote_value
    assert not rv.done() and not rv.wait(0.01)
    got: list[bool] = []
    t = threading.Thread(target=lambda: got.append(rv.wait(30)))
    t.start()
    c.succeed(b"")
    t.join(30)
    assert got == [True] and rv.done() and rv.status is RemoteValueStatus.READY
    assert rv.wait(0) and rv.fetch(0) is None


def test_a_failure_counted_without_recording_fails_nothing_else() -> None:
    """mark_failed(record=False) (a per-worker input that failed): counted, but no job error: queued
    closures stay queued and wait() returns."""
    q = ClosureQueue()
    failing, queued = Closure(lambda: None), Closure(lambda: None)
    q.put(failing)
    q.put(queued)
    assert q.take(0) == [failing]
    q.mark_failed(ValueError("input"), record=False)
    assert q.failed == 1 and not q.has_error() and q.queued == 1
    assert q.take(0) == [queued]
    q.mark_finished()
    assert q.wait(timeout=5)


def test_on_settled_is_told_once_how_a_closure_ended() -> None:
    seen: list[BaseException | None] = []
    ok, failed, cancelled = (Closure(lambda: None, on_settled=seen.append) for _ in range(3))
    ok.succeed(b"")
    err = ValueError("x")
    failed.fail(err)
    failed.cancel(CancelledError("late"))  # settled already: not told again
    cancelled.cancel(CancelledError("c"))
    assert seen[:2] == [None, err] and isinstance(seen[2], CancelledError) and len(seen) == 3


# ------------------------------------------------------------ a checkpoint's drain
def _drainer(q: ClosureQueue) -> tuple[threading.Thread, list[bool]]:
    """A thread in ``q.pause(drain=True)`` (a save's quiet point); its result lands in the list."""
    out: list[bool] = []
    t = threading.Thread(target=lambda: out.append(q.pause(timeout=30, drain=True)), name="drainer")
    t.start()
    return t, out


def _requeued_after_failure(q: ClosureQueue) -> tuple[Closure, Closure]:
    """``ran`` was running when its worker failed (re-queued: it may have run in part); ``fresh`` never ran."""
    ran, fresh = Closure(noop), Closure(noop)
    q.put(ran)
    assert q.take(0) == [ran]
    q.put(fresh)
    q.retry(ran)
    assert ran.attempt == 1 and fresh.attempt == 0
    return ran, fresh


def test_drain_reruns_requeued_closures_and_holds_the_others() -> None:
    q = ClosureQueue()
    wakes: list[int] = []
    q.set_listener(lambda: wakes.append(1))
    ran, fresh = Closure(noop), Closure(noop)
    q.put(ran)
    q.put(fresh)
    assert q.take(0, max_n=2) == [ran, fresh]
    q.retry(ran)  # its worker failed while it ran
    q.return_unrun(fresh)  # certainly never ran (skipped in its batch): it goes ahead of ran, and is held
    before = len(wakes)
    t, out = _drainer(q)
    poll_for(lambda: len(wakes) > before, 10, what="the drain to wake the dispatcher")
    assert not q.dispatching and q.handing_out
    assert q.take(0, max_n=4) == [ran]  # the re-run only, not the closure that never ran
    assert not q.handing_out and q.take(1) == []
    assert t.is_alive()  # it waits for the re-run
    q.mark_finished()
    t.join(10)
    assert out == [True]
    assert q.take(1) == []  # quiet: nothing is handed out inside the save
    q.resume()
    assert q.take(1) == [fresh]


def test_drain_waits_for_a_rerun_whose_worker_fails_again() -> None:
    q = ClosureQueue()
    ran, _ = _requeued_after_failure(q)
    t, out = _drainer(q)
    poll_for(lambda: q.handing_out, 10, what="the drain")
    assert q.take(0) == [ran]
    q.retry(ran)  # its second worker failed too
    assert t.is_alive() and q.take(1) == [ran] and ran.attempt == 2
    q.mark_finished()
    t.join(10)
    assert out == [True]
    q.resume()


def test_plain_pause_leaves_requeued_closures_queued() -> None:
    q = ClosureQueue()
    ran, fresh = _requeued_after_failure(q)
    assert q.pause(timeout=0)  # not draining (a restore's, the step barrier's): nothing runs
    assert not q.handing_out and q.take(0) == []
    q.resume()
    assert q.take(0, max_n=2) == [ran, fresh]


def test_drain_hands_out_a_workers_resource_closures_first() -> None:
    q = ClosureQueue()
    ran, _ = _requeued_after_failure(q)
    rebuild = Closure(noop)
    q.put_tagged(1, rebuild)  # worker:1 restarted: its dataset is rebuilt before it runs anything
    t, _out = _drainer(q)
    poll_for(lambda: q.handing_out, 10, what="the drain")
    assert q.take(1) == [rebuild]
    assert q.take(1) == [ran]
    q.mark_finished(2)
    t.join(10)
    q.resume()


def test_drain_waits_while_a_plain_pause_is_in_effect_then_goes_on() -> None:
    q = ClosureQueue()
    wakes: list[int] = []
    q.set_listener(lambda: wakes.append(1))
    ran, _ = _requeued_after_failure(q)
    assert q.pause(timeout=0)  # e.g. the step barrier deciding skips
    t, out = _drainer(q)
    poll_for(lambda: q.inflight == 0 and t.is_alive(), 10, what="the drain to start")
    assert not q.handing_out and q.take(0) == []
    before = len(wakes)
    q.resume()  # the plain pause ends: the drain alone is in effect and wakes the dispatcher
    assert len(wakes) > before and q.take(0) == [ran]
    q.mark_finished()
    t.join(10)
    assert out == [True]
    q.resume()


def test_drain_ends_when_an_error_cancels_the_requeued_closures() -> None:
    q = ClosureQueue()
    ran, fresh = _requeued_after_failure(q)
    t, out = _drainer(q)
    poll_for(lambda: q.handing_out, 10, what="the drain")
    q.fail_all(RuntimeError("the job failed"))
    t.join(10)
    assert out == [True]
    assert ran.remote_value.status is RemoteValueStatus.ABORTED and fresh.remote_value.status is RemoteValueStatus.ABORTED
    q.resume()


def test_drain_times_out_without_a_worker() -> None:
    q = ClosureQueue()
    _requeued_after_failure(q)
    assert q.pause(timeout=0.05, drain=True) is False  # nobody took the re-run: no quiet point
    assert not q.handing_out  # the timed-out drain no longer hands out
    q.resume()
