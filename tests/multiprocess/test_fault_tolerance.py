"""Worker failures with real SIGKILLs: closures re-run, updates applied exactly once (an in-process
restart of a worker is in ``tests/integration/test_coordinator.py``)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import jaxdist
from jaxdist.cluster_coordinator.remote_value import RemoteValueStatus

from jaxdist.testing import poll_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess]


def _counter_setup(cluster: jaxdist.LocalCluster):  # type: ignore[no-untyped-def]
    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
    with strategy.scope():
        counter = jaxdist.create_variable(np.zeros((), np.int64), name="counter")
        other = jaxdist.create_variable(np.zeros((), np.int64), name="other")  # lands on the other PS
    coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)
    return strategy, coord, counter, other


def test_killed_worker_closures_rerun_and_updates_apply_once() -> None:
    with jaxdist.LocalCluster(num_workers=3, num_ps=2) as cluster:
        strategy, coord, counter, other = _counter_setup(cluster)
        assert counter.ps_index != other.ps_index

        def add_one(i: int) -> int:
            counter.assign_add(1)
            time.sleep(0.02)  # a kill often lands between the two pushes
            jaxdist.apply_gradients  # noqa: B018 - keep the closure non-trivial
            other.assign_add(1)
            return i

        n = 400
        rvs = [coord.schedule(add_one, args=(i,)) for i in range(n)]
        poll_for(lambda: sum(rv.done() for rv in rvs) > 60, 60, what="training to start")
        cluster.kill("worker:1")
        poll_for(lambda: not coord.status()[1]["healthy"], 10, what="worker:1 declared failed")
        poll_for(lambda: sum(rv.done() for rv in rvs) > 200, 60, what="progress without worker:1")
        cluster.restart("worker:1")
        coord.join()
        assert [rv.fetch() for rv in rvs] == list(range(n))
        assert int(counter.numpy()) == n and int(other.numpy()) == n
        assert coord.status()[1]["failures"] >= 1
        assert coord.closure_counts.retried >= 1
        # The restarted worker takes work again, once the coordinator has taken it back (it may
        # still be reconfiguring it: closures scheduled before that could race the reconfiguration).
        poll_for(lambda: coord.status()[1]["healthy"], 30, what="worker:1 taken back")
        before = coord.status()[1]["closures_done"]
        rvs = [coord.schedule(add_one, args=(i,)) for i in range(60)]
        poll_for(lambda: coord.status()[1]["closures_done"] > before, 60, what="worker:1 to take work")
        coord.join()
        assert [rv.fetch() for rv in rvs] == list(range(60))
        coord.shutdown()


@pytest.mark.slow
def test_chaos_2000_closures_exact_counter() -> None:
    """2,000 closures each adding 1 while a random worker is SIGKILLed and restarted every ~1 s."""
    with jaxdist.LocalCluster(num_workers=3, num_ps=2) as cluster:
        strategy, coord, counter, other = _counter_setup(cluster)

        def add_one(i: int) -> int:
            counter.assign_add(1)
            time.sleep(0.008)  # >= 5 s of work on 3 workers, so chaos gets several kills in
            return i

        n = 2000
        with cluster.chaos(every=1.0, downtime=0.3, seed=7) as chaos:
            rvs = [coord.schedule(add_one, args=(i,)) for i in range(n)]
            coord.join()
        assert chaos.kills >= 2, f"only {chaos.kills} kills happened; the run was too fast to test anything"
        assert all(rv.status is RemoteValueStatus.READY for rv in rvs)
        assert sorted(rv.fetch() for rv in rvs) == list(range(n))
        assert int(counter.numpy()) == n
        coord.shutdown()
