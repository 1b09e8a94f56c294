"""Real processes: a worker process joins (``--register-with``) and leaves on SIGTERM, exactly-once data
under SIGKILL chaos, a SIGSTOPped (partitioned) worker. In-process versions of the rest are in
``tests/integration/test_coordinator.py``; the ledger itself in ``tests/unit/test_datasets.py``."""

from __future__ import annotations

import time

import numpy as np
import pytest

import jaxdist
from jaxdist.cluster_coordinator.remote_value import RemoteValueStatus

from jaxdist.testing import poll_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]


def test_worker_joins_and_leaves_while_training() -> None:
    with jaxdist.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            counter = jaxdist.create_variable(np.zeros((), np.int64), name="c")
        coord = jaxdist.ClusterCoordinator(strategy)
        reg = coord.serve_registration()

        def step() -> int:
            counter.assign_add(1)
            time.sleep(0.01)
            return jaxdist.current_worker_index()

        rvs = [coord.schedule(step) for _ in range(600)]
        poll_for(lambda: sum(rv.done() for rv in rvs) > 50, 60, what="training to start")
        # A third worker process starts and registers itself with the running coordinator.
        name = cluster.add_worker(register_with=reg)
        poll_for(lambda: coord.active_workers == 3, 30, what="worker 3 to register")
        poll_for(lambda: coord.status()[2]["closures_done"] > 0, 60, what="the new worker to take work")
        assert coord.status()[2]["address"] == cluster.address(name)
        # worker:0 leaves gracefully (SIGTERM -> deregisters, exits 0); training goes on.
        assert cluster.terminate("worker:0") == 0
        poll_for(lambda: coord.status()[0]["left"], 30, what="worker:0 to leave")
        coord.join()
        assert int(counter.numpy()) == 600
        assert sorted(set(rv.fetch() for rv in rvs)) == [0, 1, 2]
        done_after = [rv.fetch() for rv in rvs[-100:]]
        assert 0 not in done_after[-20:]
        assert coord.active_workers == 2
        coord.shutdown()


def _id_dataset(num_examples: int, batch: int):  # type: ignore[no-untyped-def]
    def dataset_fn(ctx: jaxdist.InputContext) -> list[np.ndarray]:
        ids = np.arange(num_examples, dtype=np.int64)
        return [ids[i : i + batch] for i in range(0, num_examples, batch)]

    return dataset_fn


@pytest.mark.slow
def test_exactly_once_data_under_chaos() -> None:
    """Sum of trained example ids == sum of the data set's ids, while workers are SIGKILLed."""
    n, batch = 6000, 5
    with jaxdist.LocalCluster(num_workers=3, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            id_sum = jaxdist.create_variable(np.zeros((), np.int64), name="id_sum")
            seen = jaxdist.create_variable(np.zeros(n, np.int64), name="seen")
        coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)
        ds = coord.create_per_worker_dataset(_id_dataset(n, batch), exactly_once=True, num_batches=n // batch)
        it = iter(ds)

        def train(iterator) -> int:  # type: ignore[no-untyped-def]
            ids = next(iterator)
            id_sum.assign_add(ids.sum())
            time.sleep(0.01)
            seen.scatter_add(ids, np.ones(len(ids), np.int64))
            return int(ids[0])

        with cluster.chaos(every=1.0, downtime=0.3, seed=3) as chaos:
            rvs = [coord.schedule(train, args=(it,)) for _ in range(n // batch)]
            coord.join()
        assert chaos.kills >= 2
        assert int(id_sum.numpy()) == n * (n - 1) // 2
        assert np.array_equal(seen.numpy(), np.ones(n, np.int64))
        assert sorted(rv.fetch() for rv in rvs) == list(range(0, n, batch))
        assert ds.ledger.completed == n // batch
        # The epoch is over: the next closure's next() is end of data.
        coord.schedule(train, args=(it,))
        with pytest.raises(jaxdist.OutOfRangeError):
            coord.join()
        coord.shutdown()


def test_partitioned_worker_is_detected_and_its_closure_retried() -> None:
    with jaxdist.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            counter = jaxdist.create_variable(np.zeros((), np.int64), name="c")
        coord = jaxdist.ClusterCoordinator(strategy, heartbeat_interval=0.3, failure_timeout=1.5)

        def slow() -> int:
            counter.assign_add(1)
            time.sleep(0.05)
            return jaxdist.current_worker_index()

        rvs = [coord.schedule(slow) for _ in range(120)]
        poll_for(lambda: sum(rv.done() for rv in rvs) > 10, 60, what="start")
        t = time.monotonic()
        cluster.partition("worker:1", 6.0)  # frozen: silent, as behind a cut link
        poll_for(lambda: not coord.status()[1]["healthy"], 10, what="detection")
        detect = time.monotonic() - t
        assert detect < 5.0, detect
        coord.join()
        assert int(counter.numpy()) == 120
        assert all(rv.status is RemoteValueStatus.READY for rv in rvs)
        poll_for(lambda: coord.status()[1]["healthy"], 30, what="worker:1 back after the partition")
        coord.shutdown()
