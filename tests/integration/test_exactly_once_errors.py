"""Exactly-once data when a closure fails with an error of its own (issue 29, the holes after item 1),
driven by events on in-process clusters.

A closure that raises after some of its pushes were applied used to give its batch back to the data
ledger; the batch was handed out again to a later closure, whose pushes carry that closure's own
identities, so the part already pushed was applied a second time. The same for a closure re-queued
after its worker died (its first attempt may have pushed) and then cancelled by another closure's
error. The contract now: a closure's batches go back only when no push of it can have been applied
(it never ran, or its only attempt failed before any push, as its worker reports); otherwise they are
*consumed*: never handed out again, listed in ``ledger.consumed``, not in ``ledger.remaining``.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxdist
from jaxdist.testing import InProcessCluster, poll_for

import inprocess_gates as gates

pytestmark = [pytest.mark.timeout(180)]

EXAMPLES = 12
BATCH = 3
NUM_BATCHES = EXAMPLES // BATCH


def _dataset(ctx):  # type: ignore[no-untyped-def]
    ids = np.arange(EXAMPLES, dtype=np.int64)
    return [ids[i : i + BATCH] for i in range(0, EXAMPLES, BATCH)]


def _counts(batch: np.ndarray) -> np.ndarray:
    return np.bincount(batch, minlength=EXAMPLES).astype(np.int64)


class Boom(RuntimeError):
    pass


@pytest.fixture
def job():  # type: ignore[no-untyped-def]
    with InProcessCluster(num_workers=2, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            with strategy.scope():
                # seen[i]: how many times example i was trained on; halves[i]: how many times the first
                # half of a two-push closure reached example i.
                seen = jaxdist.create_variable(np.zeros(EXAMPLES, np.int64), name="seen")
            coord = jaxdist.ClusterCoordinator(strategy, closures_per_rpc=1, failure_timeout=2.0)
            try:
                ds = coord.create_per_worker_dataset(_dataset, exactly_once=True, num_batches=NUM_BATCHES, epochs=1)
                yield cluster, seen, coord, ds, iter(ds)
            finally:
                coord.shutdown(exit_tasks=False)
        finally:
            strategy.close()


def _train_rest(seen, coord, ds, it) -> None:  # type: ignore[no-untyped-def]
    def train(it):  # type: ignore[no-untyped-def]
        seen.assign_add(_counts(next(it)))

    for _ in range(ds.ledger.remaining):
        coord.schedule(train, args=(it,))
    coord.join()


def test_a_closure_that_fails_after_a_push_consumes_its_batch(job) -> None:  # type: ignore[no-untyped-def]
    """The closure pushes its batch, then raises: that push stays applied, and the batch is never handed
    out again (before the fix it was, and its examples were trained twice)."""
    cluster, seen, coord, ds, it = job

    def push_then_fail(it):  # type: ignore[no-untyped-def]
        seen.assign_add(_counts(next(it)))
        raise Boom("after the push")

    coord.schedule(push_then_fail, args=(it,))
    with pytest.raises(Boom):
        coord.join()
    _train_rest(seen, coord, ds, it)
    np.testing.assert_array_equal(seen.numpy(), np.ones(EXAMPLES, np.int64))  # batch 0 once, by the failed closure
    assert ds.ledger.consumed == [0] and ds.ledger.completed == NUM_BATCHES - 1 and ds.ledger.remaining == 0


def test_a_closure_that_fails_before_any_push_gives_its_batch_back(job) -> None:  # type: ignore[no-untyped-def]
    """No push was made: nothing of the batch is applied, so a later closure trains it (as before)."""
    cluster, seen, coord, ds, it = job

    def fail_first(it):  # type: ignore[no-untyped-def]
        next(it)
        raise Boom("before any push")

    coord.schedule(fail_first, args=(it,))
    with pytest.raises(Boom):
        coord.join()
    assert ds.ledger.consumed == [] and ds.ledger.remaining == NUM_BATCHES
    _train_rest(seen, coord, ds, it)
    np.testing.assert_array_equal(seen.numpy(), np.ones(EXAMPLES, np.int64))


def test_a_requeued_closure_cancelled_by_another_error_consumes_its_batch(job) -> None:  # type: ignore[no-untyped-def]
    """A pushes its batch and its worker dies before reporting it: A is queued again (its push applied).
    Before A's re-run starts, closure C fails with an error of its own, which cancels every queued
    closure, A included. A's batch must not go back: a later closure would push it again."""
    cluster, seen, coord, ds, it = job
    a_gate, c_gate = gates.new_name("a"), gates.new_name("c")

    def closure_a(it):  # type: ignore[no-untyped-def]
        seen.assign_add(_counts(next(it)))
        gates.arrive(f"{a_gate}-{jaxdist.current_worker_index()}")
        gates.event(a_gate).wait(60)  # first attempt: held until its worker is stopped

    def closure_c(it):  # type: ignore[no-untyped-def]
        next(it)
        gates.arrive(f"{c_gate}-{jaxdist.current_worker_index()}")
        gates.event(c_gate).wait(60)
        raise Boom("C fails")

    rv_a = coord.schedule(closure_a, args=(it,))
    poll_for(lambda: any(gates.arrivals(f"{a_gate}-{w}") for w in range(2)), 60, what="A to push and wait")
    a_worker = next(w for w in range(2) if gates.arrivals(f"{a_gate}-{w}"))
    coord.schedule(closure_c, args=(it,))
    poll_for(lambda: gates.arrivals(f"{c_gate}-{1 - a_worker}") == 1, 60, what="C to run on the other worker")
    retried = coord.closure_counts.retried
    cluster.stop_task(f"worker:{a_worker}")  # A's push is applied; its worker dies before reporting A
    poll_for(lambda: coord.closure_counts.retried > retried, 60, what="A to be queued again")
    gates.event(a_gate).set()  # the stopped service's thread ends
    gates.event(c_gate).set()  # C fails: A, queued behind no worker, is cancelled
    with pytest.raises(Boom):
        coord.join()
    with pytest.raises(jaxdist.errors.CancelledError):
        rv_a.fetch(timeout=60)
    cluster.restart_task(f"worker:{a_worker}")
    _train_rest(seen, coord, ds, it)
    np.testing.assert_array_equal(seen.numpy(), np.ones(EXAMPLES, np.int64))
    # A's batch (position 0) is consumed; C's (position 1) was read but never pushed: it went back.
    assert ds.ledger.consumed == [0] and ds.ledger.completed == NUM_BATCHES - 1
