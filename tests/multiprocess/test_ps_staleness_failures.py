"""Synchronous PS training (``staleness=0``) with real worker failures: a SIGKILLed or frozen worker
is dropped from the steps (they never wait for it forever), its closure runs again elsewhere, and
every closure's gradient lands in exactly one step on both PS shards alike."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.testing import poll_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]


def _setup(cluster: jaxdist.LocalCluster, n: int):  # type: ignore[no-untyped-def]
    strategy = jaxdist.ParameterServerStrategy(
        cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2), staleness=0)
    with strategy.scope():
        # Closure i's gradient is -1 at entry i: with SGD(1.0) entry i ends at 1/(gradients in its step).
        ids = jaxdist.create_variable(np.zeros(n, np.float32), name="ids", optimizer=optax.sgd(1.0))
        counter = jaxdist.create_variable(np.zeros((), np.int64), name="counter")
    assert isinstance(ids, jaxdist.ShardedVariable)
    coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)
    poll_for(lambda: all(r["healthy"] for r in coord.status()), 60, what="both workers configured")

    def step(i: int) -> int:
        jaxdist.pull(ids)
        g = np.zeros(n, np.float32)
        g[i] = -1.0
        time.sleep(0.02)  # a kill often lands between the pull and the push
        jaxdist.apply_gradients(ids, g)
        counter.assign_add(1)  # not a gradient: applied at once, exactly once
        return jaxdist.current_sync_step()

    return strategy, coord, ids, counter, step


def _check_exactly_once(coord: jaxdist.ClusterCoordinator, ids: jaxdist.ShardedVariable, counter, n: int) -> None:  # type: ignore[no-untyped-def]
    assert int(counter.numpy()) == n
    v = ids.numpy()
    # Every closure's gradient is in exactly one step (never lost, never twice), of 1 or 2 gradients.
    assert set(np.unique(v).tolist()) <= {0.5, 1.0}, np.unique(v)
    assert (v == 1.0).any(), "no step ran with one worker: the failure never mattered"
    reports = coord.step_barrier.reports()  # type: ignore[union-attr]
    # Both shards applied the same steps; each applied step is the mean of its gradients, once:
    # the sum over entries of 1/(gradients in its step) is the number of steps.
    assert reports[0].applied == reports[1].applied and reports[0].clocks == reports[1].clocks
    assert float(v.sum()) == pytest.approx(reports[0].applied)
    assert n / 2 <= reports[0].applied < n


def test_sigkilled_worker_is_dropped_and_synchronous_training_completes() -> None:
    n = 160
    with jaxdist.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy, coord, ids, counter, step = _setup(cluster, n)
        try:
            rvs = [coord.schedule(step, args=(i,)) for i in range(n)]
            poll_for(lambda: sum(rv.done() for rv in rvs) > 30, 60, what="training to start")
            cluster.kill("worker:1")
            poll_for(lambda: not coord.status()[1]["healthy"], 10, what="worker:1 declared failed")
            done = sum(rv.done() for rv in rvs)
            poll_for(lambda: sum(rv.done() for rv in rvs) > done + 20, 60, what="steps going on without worker:1")
            assert 1 not in coord.step_barrier.members  # type: ignore[union-attr]
            cluster.restart("worker:1")
            coord.join()
            assert all(isinstance(rv.fetch(), int) for rv in rvs)
            assert coord.status()[1]["failures"] >= 1
            _check_exactly_once(coord, ids, counter, n)
        finally:  # a failure must not leave the coordinator's threads behind
            coord.shutdown()
            strategy.close()


def test_frozen_worker_is_dropped_after_the_failure_timeout() -> None:
    n = 80
    with jaxdist.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy, coord, ids, counter, step = _setup(cluster, n)
        try:
            rvs = [coord.schedule(step, args=(i,)) for i in range(n)]
            poll_for(lambda: sum(rv.done() for rv in rvs) > 20, 60, what="training to start")
            # Frozen mid-step (until the test thaws it, below): its step waits, then drops it.
            cluster.partition("worker:1", seconds=3600.0)
            poll_for(lambda: not coord.status()[1]["healthy"], 20, what="worker:1 declared failed after the timeout")
            done = sum(rv.done() for rv in rvs)
            poll_for(lambda: sum(rv.done() for rv in rvs) > done + 10, 60, what="steps going on without worker:1")
            os.kill(cluster.pid("worker:1"), signal.SIGCONT)  # it thaws while steps go on
            coord.join()  # it is fenced (its late push is refused), rejoins
            assert all(isinstance(rv.fetch(), int) for rv in rvs)
            _check_exactly_once(coord, ids, counter, n)
        finally:  # a failure must not leave the coordinator's threads behind
            coord.shutdown()
            strategy.close()
