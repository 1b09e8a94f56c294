"""Real processes: a worker process joins (``--register-with``) and leaves on SIGTERM, exactly-once data
under SIGKILL chaos, a SIGSTOPped (partitioned) worker. In-process versions of the rest are in
``tests/integration/test_coordinator.py``; the ledger itself in ``tests/unit/test_datasets.py``."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time

import numpy as np
import pytest
from kill_points import KillPoints

import jaxdist
from jaxdist.cluster_coordinator.remote_value import RemoteValueStatus

from jaxdist.testing import poll_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]


def test_worker_joins_and_leaves_while_training() -> None:
    """A third worker process registers itself while closures are queued and takes some; worker:0
    leaves gracefully (SIGTERM) while closures are queued, and none of the later ones runs there.
    Both happen while training is held at a point (closures from index 100, then from 400, wait
    for the test), so the run cannot be over before them, however fast the machine."""
    with jaxdist.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            counter = jaxdist.create_variable(np.zeros((), np.int64), name="c")
            stage = jaxdist.create_variable(np.zeros((), np.int64), name="stage")  # how far the test let training go
            waiting = jaxdist.create_variable(np.zeros(3, np.int64), name="waiting")  # per worker: the stage it waits for
        coord = jaxdist.ClusterCoordinator(strategy)
        reg = coord.serve_registration()

        def step(i: int) -> int:
            counter.assign_add(1)
            need = 2 if i >= 400 else 1 if i >= 100 else 0
            if need:
                me = jaxdist.current_worker_index()
                waiting.scatter_update(np.array([me]), np.array([need], np.int64))
                while int(stage.numpy()) < need:
                    time.sleep(0.02)
            return jaxdist.current_worker_index()

        def waits_for(worker: int, need: int) -> bool:
            return int(waiting.numpy()[worker]) >= need

        rvs = [coord.schedule(step, args=(i,)) for i in range(600)]
        poll_for(lambda: waits_for(0, 1) and waits_for(1, 1), 60, what="both workers to reach closure 100 and up")
        # A third worker process starts and registers itself with the running coordinator.
        name = cluster.add_worker(register_with=reg)
        poll_for(lambda: coord.active_workers == 3, 30, what="worker 3 to register")
        poll_for(lambda: waits_for(2, 1), 60, what="the new worker to take a queued closure")
        assert coord.status()[2]["address"] == cluster.address(name)
        stage.assign(np.ones((), np.int64))
        poll_for(lambda: coord.status()[2]["closures_done"] > 0, 60, what="the new worker to finish closures")
        # worker:0 leaves gracefully (SIGTERM -> deregisters, exits 0) while it waits in closure 400 or up
        # (its call is cancelled and its closures run elsewhere); training goes on without it.
        poll_for(lambda: waits_for(0, 2), 60, what="worker:0 to reach closure 400 and up")
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            leaving = pool.submit(cluster.terminate, "worker:0")  # returns once worker:0 has exited
            poll_for(lambda: coord.status()[0]["left"], 30, what="worker:0 to leave")
            stage.assign(np.full((), 2, np.int64))
            assert leaving.result(timeout=60) == 0
        coord.join()
        assert int(counter.numpy()) == 600
        ran_on = [rv.fetch() for rv in rvs]
        assert sorted(set(ran_on)) == [0, 1, 2]
        assert 0 not in ran_on[-100:], "a closure queued when worker:0 left ran there"
        assert coord.active_workers == 2
        coord.shutdown()


def _id_dataset(num_examples: int, batch: int):  # type: ignore[no-untyped-def]
    def dataset_fn(ctx: jaxdist.InputContext) -> list[np.ndarray]:
        ids = np.arange(num_examples, dtype=np.int64)
        return [ids[i : i + batch] for i in range(0, num_examples, batch)]

    return dataset_fn


@pytest.mark.slow
def test_exactly_once_data_under_chaos() -> None:
    """Sum of trained example ids == sum of the data set's ids, while workers are SIGKILLed: three
    kills, each of a worker holding a closure between its two pushes (:mod:`kill_points`: driven by
    events, so they land whatever the machine's speed)."""
    n, batch = 6000, 5
    with jaxdist.LocalCluster(num_workers=3, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            id_sum = jaxdist.create_variable(np.zeros((), np.int64), name="id_sum")
            seen = jaxdist.create_variable(np.zeros(n, np.int64), name="seen")
        chaos = KillPoints(strategy, 3)
        coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)
        ds = coord.create_per_worker_dataset(_id_dataset(n, batch), exactly_once=True, num_batches=n // batch)
        it = iter(ds)
        closures = n // batch
        kill_at = {(k + 1) * closures // 4: k for k in range(3)}  # closure index -> its kill point

        def train(iterator, i: int) -> int:  # type: ignore[no-untyped-def]
            ids = next(iterator)
            id_sum.assign_add(ids.sum())
            if i in kill_at:
                chaos.hold(kill_at[i])
            seen.scatter_add(ids, np.ones(len(ids), np.int64))
            return int(ids[0])

        rvs = [coord.schedule(train, args=(it, i)) for i in range(closures)]
        chaos.run(cluster, coord)
        coord.join()
        assert coord.closure_counts.retried >= chaos.count, coord.closure_counts
        assert int(id_sum.numpy()) == n * (n - 1) // 2, f"after kills of workers {chaos.victims}"
        assert np.array_equal(seen.numpy(), np.ones(n, np.int64))
        assert sorted(rv.fetch() for rv in rvs) == list(range(0, n, batch))
        assert ds.ledger.completed == n // batch
        # The epoch is over: the next closure's next() is end of data.
        coord.schedule(train, args=(it, -1))
        with pytest.raises(jaxdist.OutOfRangeError):
            coord.join()
        coord.shutdown()


def test_partitioned_worker_is_detected_and_its_closure_retried() -> None:
    """A worker frozen (SIGSTOP: silent, as behind a cut link) while it holds a closure is declared
    failed and the closure re-runs elsewhere; once it answers again it is taken back."""
    with jaxdist.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            counter = jaxdist.create_variable(np.zeros((), np.int64), name="c")
        freeze = KillPoints(strategy, 1)
        coord = jaxdist.ClusterCoordinator(strategy, heartbeat_interval=0.3, failure_timeout=1.5)

        def step(i: int) -> int:
            counter.assign_add(1)
            if i == 10:
                freeze.hold(0)
            return jaxdist.current_worker_index()

        rvs = [coord.schedule(step, args=(i,)) for i in range(120)]
        frozen = freeze.kill(cluster, coord, freeze=True)  # returns once the coordinator declared it failed
        coord.join()
        assert coord.closure_counts.retried >= 1, coord.closure_counts
        assert int(counter.numpy()) == 120
        assert all(rv.status is RemoteValueStatus.READY for rv in rvs)
        os.kill(cluster.pid(f"worker:{frozen}"), signal.SIGCONT)  # the partition ends
        poll_for(lambda: coord.status()[frozen]["healthy"], 30, what=f"worker:{frozen} back after the partition")
        coord.shutdown()
