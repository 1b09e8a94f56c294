"""jaxdist.push_pull and pull(prefetch_next=True) inside closures on an in-process cluster (2 PS as real
gRPC servers): exactly-once of the fused call (a re-sent call included), the staleness bound of the
prefetch, its age bound, and its refusal under synchronous steps."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.worker import prefetch
from jaxdist.errors import ConfigurationError
from jaxdist.ps_server.client import PSClient
from jaxdist.testing import InProcessCluster

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def cluster() -> Iterator[InProcessCluster]:
    with InProcessCluster(num_workers=1, num_ps=2) as c:
        yield c


def _strategy_and_params(cluster: InProcessCluster, **kw: Any) -> tuple[Any, dict[str, Any]]:
    strategy = jaxdist.ParameterServerStrategy(
        cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2), **kw)
    with strategy.scope():
        # A counter per PS: sgd(1.0) of a gradient of -1 adds 1 per applied step. "w" is sharded on both PS.
        params = jaxdist.create_variables({"w": np.zeros((4, 2), np.float32), "b": np.zeros(3, np.float32)},
                                          optimizer=optax.sgd(1.0))
    assert isinstance(params["w"], jaxdist.ShardedVariable)
    return strategy, params


def _minus_ones(p: Any) -> Any:
    return {k: -np.ones_like(v) for k, v in p.items()}


def test_push_pull_in_closures_applies_each_step_once_even_when_a_call_is_resent(
    cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    resent: list[bool] = []
    original = PSClient.push_pull

    def send_twice(self: PSClient, *args: Any, **kwargs: Any) -> Any:
        first = original(self, *args, **kwargs)  # as if its answer were lost and the call re-sent
        again = original(self, *args, **kwargs)
        resent.append(again[0].duplicate and not first[0].duplicate)
        return again

    monkeypatch.setattr(PSClient, "push_pull", send_twice)
    strategy, params = _strategy_and_params(cluster)
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        def step() -> dict[str, Any]:
            p = jaxdist.pull(params)
            return jaxdist.push_pull(params, _minus_ones(p))

        rvs = [coord.schedule(step) for _ in range(5)]
        coord.join()
        got = [rv.fetch() for rv in rvs]
        # Each answer holds its own step, applied once on both PS (both shards of w, and b).
        for k, values in enumerate(got, start=1):
            np.testing.assert_array_equal(values["w"], np.full((4, 2), k))
            np.testing.assert_array_equal(values["b"], np.full(3, k))
        assert len(resent) == 5 * 2 and all(resent)  # every call went to both PS twice; the repeats were duplicates
        np.testing.assert_array_equal(jaxdist.pull(params)["w"], np.full((4, 2), 5))
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()


def test_prefetched_pull_misses_at_most_the_previous_step(cluster: InProcessCluster) -> None:
    strategy, params = _strategy_and_params(cluster)
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        def step() -> tuple[float, float]:
            p = jaxdist.pull(params, prefetch_next=True)
            jaxdist.apply_gradients(params, _minus_ones(p))
            # The PS tasks are read at once, not atomically together (as any pull): bound every value.
            values = np.concatenate([p["w"].ravel(), p["b"]])
            return float(values.min()), float(values.max())

        n = 12
        seen = []
        for _ in range(n):  # one step at a time: step k's pull follows k applied steps
            rv = coord.schedule(step)
            coord.join()
            seen.append(rv.fetch())
        assert seen[0] == (0, 0)  # nothing prefetched yet: a fresh read
        for k, (lo, hi) in enumerate(seen):
            assert k - 1 <= lo <= hi <= k, (k, seen)  # the bound: every own update but the previous step's
        np.testing.assert_array_equal(jaxdist.pull(params)["w"], np.full((4, 2), n))  # every push applied once
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()


def test_a_prefetch_older_than_the_age_bound_is_not_used(cluster: InProcessCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prefetch, "PREFETCH_MAX_AGE_S", 0.0)
    strategy, params = _strategy_and_params(cluster)
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        def step() -> float:
            p = jaxdist.pull(params, prefetch_next=True)
            jaxdist.apply_gradients(params, _minus_ones(p))
            return float(p["w"][0, 0])

        seen = []
        for _ in range(5):
            rv = coord.schedule(step)
            coord.join()
            seen.append(rv.fetch())
        assert seen == [0, 1, 2, 3, 4]  # every prefetch was too old: each read was fresh
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()


def test_push_pull_kept_for_the_next_prefetching_pull_has_no_staleness(cluster: InProcessCluster) -> None:
    strategy, params = _strategy_and_params(cluster)
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        def step() -> float:
            p = jaxdist.pull(params, prefetch_next=True)  # served by the last push_pull after the first step
            jaxdist.push_pull(params, _minus_ones(p), prefetch_next=True)
            return float(p["w"][0, 0])

        rvs = [coord.schedule(step) for _ in range(8)]
        coord.join()
        assert [rv.fetch() for rv in rvs] == list(range(8))  # one worker: every step saw all earlier ones
        np.testing.assert_array_equal(jaxdist.pull(params)["b"], np.full(3, 8))
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()


def test_prefetch_is_refused_under_synchronous_steps(cluster: InProcessCluster) -> None:
    strategy, params = _strategy_and_params(cluster, staleness=0)
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        def prefetching() -> None:
            jaxdist.pull(params, prefetch_next=True)

        def fused() -> None:
            p = jaxdist.pull(params)
            jaxdist.push_pull(params, _minus_ones(p))

        for fn in (prefetching, fused):
            rv = coord.schedule(fn)
            with pytest.raises(ConfigurationError, match="synchronous"):
                coord.join()
                rv.fetch()
        np.testing.assert_array_equal(jaxdist.pull(params)["w"], np.zeros((4, 2)))  # nothing applied
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()
