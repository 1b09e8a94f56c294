"""Lookups on several PS tasks send every request before reading any answer (pull_specs' ``pipelined``,
PSClient.start_pull, DataPlaneClient.start/finish): same rows, same errors, connections released."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

import jaxdist
from jaxdist.errors import VariableNotFoundError
from jaxdist.proto.ps_wire import CreateSpec, PullSpec
from jaxdist.ps_server.client import PSClient
from jaxdist.testing import InProcessCluster
from jaxdist.transport import dataplane

from conftest import CREDS

pytestmark = pytest.mark.timeout(120)

ROWS, COLS = 5000, 16


@pytest.fixture(params=["shm", "tcp", "grpc"])
def table(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[object, np.ndarray]]:
    if request.param == "tcp":
        monkeypatch.setenv(dataplane.ENV_SHM, "0")
    with InProcessCluster(num_workers=1, num_ps=2, data_plane=request.param != "grpc") as cluster:
        strategy = jaxdist.ParameterServerStrategy(
            cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            init = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
            with strategy.scope():
                v = jaxdist.create_variable(init, name="emb")
            yield v, init
        finally:
            strategy.close()


def test_lookups_spanning_both_ps_match_numpy(table: tuple[object, np.ndarray]) -> None:
    v, init = table
    rng = np.random.default_rng(1)
    for ids in (rng.integers(0, ROWS, 4096), rng.integers(0, ROWS, (8, 33)), np.array([ROWS - 1, 0, 0, 7]),
                np.arange(ROWS // 2 - 3, ROWS // 2 + 3)):
        got = v.sparse_read(ids)  # type: ignore[attr-defined]
        assert got.shape == ids.shape + (COLS,) and np.array_equal(got, init[ids])
    # Every connection was released: many more lookups than the pool holds, in a row.
    for _ in range(40):
        ids = rng.integers(0, ROWS, 100)
        assert np.array_equal(v.sparse_read(ids), init[ids])  # type: ignore[attr-defined]


def test_an_error_on_one_ps_is_raised_after_the_other_answer_is_read(table: tuple[object, np.ndarray]) -> None:
    """A shard deleted on ps:1 fails the lookup with its typed error; ps:0's started pull was still read,
    so its connection stays usable and later lookups of the rows that remain work."""
    v, init = table
    conns = v.variables[0].connections()  # type: ignore[attr-defined]
    conns.client(1).delete([v.variables[1].name])  # type: ignore[attr-defined]
    ids = np.array([0, 1, ROWS - 1])
    for _ in range(3):
        with pytest.raises(VariableNotFoundError):
            v.sparse_read(ids)  # type: ignore[attr-defined]
    assert np.array_equal(v.sparse_read(np.array([0, 5])), init[[0, 5]])  # type: ignore[attr-defined]


def test_started_calls_on_two_servers_finish_in_any_order(ps_server: object) -> None:
    """DataPlaneClient.start/finish: two calls out on one server's two connections, read in reverse order;
    a started call whose answer is an error keeps its connection (the next call on it works)."""
    client = PSClient(ps_server.address, CREDS, task="ps:0")  # type: ignore[attr-defined]
    try:
        a = np.arange(300_000, dtype=np.float32)
        client.create([CreateSpec("a", value=a), CreateSpec("b", value=-a)])
        first = client.start_pull([PullSpec("a", indices=np.arange(10))])
        second = client.start_pull([PullSpec("b")])
        bad = client.start_pull([PullSpec("missing")])
        assert first is not None and second is not None and bad is not None
        (((b, _),), step_b) = second()
        (((x, _),), step_a) = first()
        assert np.array_equal(b, -a) and np.array_equal(x, a[:10]) and step_a == step_b == -1
        with pytest.raises(VariableNotFoundError):
            bad()
        ((again, _),) = client.pull([PullSpec("a", indices=np.array([3]))])
        assert again.tolist() == [3.0]
    finally:
        client.close()
