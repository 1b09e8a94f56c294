"""Worker failures with real SIGKILLs: closures re-run, updates applied exactly once (an in-process
restart of a worker is in ``tests/integration/test_coordinator.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from kill_points import KillPoints

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
    """A worker SIGKILLed while its closure has made one of its two pushes (on two PS tasks): the
    closure re-runs elsewhere and both pushes apply once; training goes on without the worker; the
    restarted worker is taken back and takes work again."""
    with jaxdist.LocalCluster(num_workers=3, num_ps=2) as cluster:
        strategy, coord, counter, other = _counter_setup(cluster)
        assert counter.ps_index != other.ps_index
        chaos = KillPoints(strategy, 1)
        kill_at = 60  # the closure whose worker dies between its two pushes

        def add_one(i: int) -> int:
            counter.assign_add(1)
            if i == kill_at:
                chaos.hold(0)
            jaxdist.apply_gradients  # noqa: B018 - keep the closure non-trivial
            other.assign_add(1)
            return i

        n = 400
        rvs = [coord.schedule(add_one, args=(i,)) for i in range(n)]
        victim = chaos.kill(cluster, coord)
        assert not coord.status()[victim]["healthy"]
        poll_for(lambda: sum(rv.done() for rv in rvs) > 200, 60, what=f"progress without worker:{victim}")
        cluster.restart(f"worker:{victim}")
        coord.join()
        assert [rv.fetch() for rv in rvs] == list(range(n))
        assert int(counter.numpy()) == n and int(other.numpy()) == n
        assert coord.status()[victim]["failures"] >= 1
        assert coord.closure_counts.retried >= 1
        # The restarted worker takes work again, once the coordinator has taken it back (it may
        # still be reconfiguring it: closures scheduled before that could race the reconfiguration).
        poll_for(lambda: coord.status()[victim]["healthy"], 30, what=f"worker:{victim} taken back")
        before = coord.status()[victim]["closures_done"]
        rvs = [coord.schedule(add_one, args=(i,)) for i in range(60)]
        poll_for(lambda: coord.status()[victim]["closures_done"] > before, 60, what=f"worker:{victim} to take work")
        coord.join()
        assert [rv.fetch() for rv in rvs] == list(range(60))
        coord.shutdown()


@pytest.mark.slow
def test_chaos_2000_closures_exact_counter() -> None:
    """2,000 closures each adding 1 while workers are SIGKILLed and restarted: three kills, each of
    a worker holding a closure that has pushed (:mod:`kill_points`: driven by events, so they land
    whatever the machine's speed)."""
    with jaxdist.LocalCluster(num_workers=3, num_ps=2) as cluster:
        strategy, coord, counter, other = _counter_setup(cluster)
        chaos = KillPoints(strategy, 3)
        n = 2000
        kill_at = {(k + 1) * n // 4: k for k in range(3)}  # closure index -> its kill point

        def add_one(i: int) -> int:
            counter.assign_add(1)
            if i in kill_at:
                chaos.hold(kill_at[i])
            return i

        rvs = [coord.schedule(add_one, args=(i,)) for i in range(n)]
        chaos.run(cluster, coord)
        coord.join()
        assert coord.closure_counts.retried >= chaos.count, coord.closure_counts
        assert all(rv.status is RemoteValueStatus.READY for rv in rvs)
        assert sorted(rv.fetch() for rv in rvs) == list(range(n))
        assert int(counter.numpy()) == n, f"counter after {n} closures and kills of workers {chaos.victims}"
        coord.shutdown()
