"""ParameterServerStrategy's set-up refuses what TF refuses, with a typed error that says what to write."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import jaxdist
from jaxdist.testing import InProcessCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[InProcessCluster]:
    with InProcessCluster(num_workers=1, num_ps=2) as c:
        yield c


@pytest.mark.parametrize("returned", [None, 2, [2.0, 1], ["2", "1"], [object(), 1]],
                         ids=["none", "int", "floats", "strings", "object"])
def test_a_partitioner_that_returns_no_list_of_ints_is_a_configuration_error(cluster: InProcessCluster, returned: Any) -> None:
    """A partitioner returning None raised a raw TypeError (other bad returns were ConfigurationError)."""
    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), variable_partitioner=lambda shape, dtype: returned)
    try:
        with strategy.scope():
            with pytest.raises(jaxdist.errors.ConfigurationError, match="partitioner returned .* list of ints"):
                jaxdist.create_variables({"w": np.zeros((4, 2), np.float32)}, name="bad_partitioner")
    finally:
        strategy.close()


def test_a_partitioner_may_return_numpy_ints(cluster: InProcessCluster) -> None:
    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(),
                                               variable_partitioner=lambda shape, dtype: np.array([2, 1]))
    try:
        with strategy.scope():
            params = jaxdist.create_variables({"w": np.arange(8, dtype=np.float32).reshape(4, 2)}, name="np_parts")
        assert isinstance(params["w"], jaxdist.ShardedVariable) and len(params["w"].variables) == 2
        np.testing.assert_array_equal(params["w"].numpy(), np.arange(8, dtype=np.float32).reshape(4, 2))
    finally:
        strategy.close()


@pytest.mark.parametrize(("jobs", "task", "match"), [
    ({"trainer": 1}, (None, None), "unknown job 'trainer'"),
    ({"chief": 2}, (None, None), "at most one 'chief'"),
    ({"evaluator": 2}, (None, None), "at most one 'evaluator'"),
    ({}, ("coordinator", 0), "task type 'coordinator' is not one of"),
    ({}, ("chief", 0), "task chief:0 but the cluster has 0 'chief'"),
    ({}, ("worker", 5), "task worker:5 but the cluster has 1 'worker'"),
], ids=["unknown-job", "two-chiefs", "two-evaluators", "unknown-task-type", "absent-chief", "task-index-out-of-range"])
def test_a_cluster_tf_refuses_is_refused_before_connecting(cluster: InProcessCluster, jobs: dict[str, int],
                                                           task: tuple[str | None, int | None], match: str) -> None:
    """Unknown job names, an unknown task_type and several chiefs were not rejected: the strategy just
    tried to connect (to addresses that may not exist). TF's strategy refuses them; so does jaxdist's,
    with ConfigurationError, before any connection."""
    spec = cluster.cluster_resolver().cluster_spec().as_dict()
    spec.update({job: [f"127.0.0.1:{1 + i}" for i in range(n)] for job, n in jobs.items()})
    resolver = jaxdist.SimpleClusterResolver(spec, task_type=task[0], task_id=task[1], token=cluster.credentials.token, tls=cluster.credentials.tls)
    with pytest.raises(jaxdist.errors.ConfigurationError, match=match):
        jaxdist.ParameterServerStrategy(resolver, connect_timeout=1.0)


def test_a_chief_task_in_the_cluster_is_accepted(cluster: InProcessCluster) -> None:
    spec = cluster.cluster_resolver().cluster_spec().as_dict()
    spec["chief"] = ["127.0.0.1:1"]
    strategy = jaxdist.ParameterServerStrategy(
        jaxdist.SimpleClusterResolver(spec, task_type="chief", task_id=0, token=cluster.credentials.token, tls=cluster.credentials.tls))
    strategy.close()


def test_variables_outside_every_scope_name_both_kinds_of_strategy() -> None:
    """Outside any scope, create_variables said "no ParameterServerStrategy scope is open", also in a program
    with no parameter servers; it names both kinds of scope, and the one-device default strategy's."""
    with pytest.raises(jaxdist.errors.ConfigurationError,
                       match=r"no strategy scope is open.*ParameterServerStrategy.*synchronous.*get_strategy\(\)\.scope\(\)"):
        jaxdist.create_variables({"w": np.zeros(2, np.float32)})
    with jaxdist.get_strategy().scope():  # the default strategy: one device, no parameter servers
        w = jaxdist.create_variables({"w": np.ones(2, np.float32)})["w"]
    np.testing.assert_array_equal(np.asarray(w.numpy()), np.ones(2, np.float32))
