"""Pulled values land in recycled buffers (jaxdist.proto.recycle): a value the caller holds is never
overwritten by a later pull, on every transport, whole or sharded; a dropped one is reused."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import numpy as np
import pytest

import jaxdist
from jaxdist.proto import recycle
from jaxdist.proto.ps_wire import CreateSpec, Op, PullSpec, Update
from jaxdist.ps_server.client import PSClient
from jaxdist.testing import InProcessCluster

pytestmark = pytest.mark.timeout(120)

ROWS, COLS = 1024, 512  # 2 MB of float32: pooled


@pytest.fixture
def fresh_pool(monkeypatch: pytest.MonkeyPatch) -> Iterator[recycle.RecvPool]:
    pool = recycle.RecvPool(max_bytes=256 << 20)
    monkeypatch.setattr(recycle, "pool", pool)
    yield pool


def test_a_held_pull_is_never_overwritten_and_a_dropped_one_is_reused(
    ps_client: PSClient, fresh_pool: recycle.RecvPool
) -> None:
    ps_client.create([CreateSpec("w", value=np.zeros((ROWS, COLS), np.float32))])
    ((first, v1),) = ps_client.pull([PullSpec("w")])
    row = first[3]  # a view the caller keeps
    held = []
    for step in range(1, 4):
        ps_client.push([Update("w", Op.ASSIGN_ADD, np.ones((ROWS, COLS), np.float32))])
        ((value, _),) = ps_client.pull([PullSpec("w")])
        assert (value == step).all()
        held.append(value)
        # Every value still held keeps the bytes it was pulled with.
        assert not first.any() and not row.any()
        for k, h in enumerate(held):
            assert (h == k + 1).all()
    assert fresh_pool.reused == 0  # all of them held: each pull got a new buffer
    where = {h.__array_interface__["data"][0] for h in held}
    del held, value
    gc.collect()
    ps_client.push([Update("w", Op.ASSIGN_ADD, np.ones((ROWS, COLS), np.float32))])
    ((again, _),) = ps_client.pull([PullSpec("w")])
    assert (again == 4).all() and fresh_pool.reused == 1
    assert again.__array_interface__["data"][0] in where  # a dropped value's buffer
    assert not first.any() and not row.any()


def test_rows_pulled_by_indices_use_the_pool_too(ps_client: PSClient, fresh_pool: recycle.RecvPool) -> None:
    ps_client.create([CreateSpec("t", value=np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS))])
    idx = np.arange(ROWS - 1, -1, -1)
    ((a, _),) = ps_client.pull([PullSpec("t", indices=idx)])
    ((b, _),) = ps_client.pull([PullSpec("t", indices=idx[::2])])
    expect = np.arange(ROWS * COLS, dtype=np.float32).reshape(ROWS, COLS)
    assert np.array_equal(a, expect[idx]) and np.array_equal(b, expect[idx[::2]])
    del a
    gc.collect()
    ((c, _),) = ps_client.pull([PullSpec("t", indices=idx)])
    assert np.array_equal(c, expect[idx]) and np.array_equal(b, expect[idx[::2]]) and fresh_pool.reused == 1


def test_sharded_pulls_and_lookups_keep_held_values(fresh_pool: recycle.RecvPool) -> None:
    """jaxdist.pull of a sharded variable (one full array, each shard received into its rows) and
    embedding lookups: values the caller holds stay as pulled while the variable changes."""
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(
            cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            with strategy.scope():
                v = jaxdist.create_variable(np.zeros((ROWS, COLS), np.float32), name="s")
            ids = np.random.default_rng(0).integers(0, ROWS, 1024)
            held_pull = jaxdist.pull(v)
            held_rows = v.sparse_read(ids)
            for step in range(1, 4):
                v.assign_add(np.ones((ROWS, COLS), np.float32))
                assert (jaxdist.pull(v) == step).all()  # dropped at once: its buffer is reused next time
                assert (v.sparse_read(ids) == step).all()
                assert not held_pull.any() and not held_rows.any()
            assert fresh_pool.reused >= 2
        finally:
            strategy.close()
