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
