"""TF's ``sharded_variable_test.py`` (tensorflow/python/distribute), ported to jaxdist's API.

Each test names the TF test it ports in its docstring; the README beside this file lists every TF test
of the file with its port or the reason it does not apply.

Differences from TF, each for a reason:
- TF builds a ``ShardedVariable`` from any list of local variables. jaxdist's shards are variables on
  the parameter servers and must follow TF's "div" layout (the first ``rows % k`` shards one row
  longer), the layout TF's own partitioned variables use; a sharded variable is made by the strategy's
  ``variable_partitioner`` (as TF's ``ParameterServerStrategy`` makes them). Where TF's test uses
  another layout (1, 2, 1 rows), the port uses the div layout of the same rows (2, 1, 1) and checks
  each shard's rows accordingly.
- Each test runs its own :class:`jaxdist.testing.InProcessCluster` (2 PS), so that variable names and
  partitioners do not leak between tests.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist
from jaxdist.testing import InProcessCluster

pytestmark = pytest.mark.timeout(120)


@contextlib.contextmanager
def _strategy(partitioner: Any = None, num_workers: int = 1) -> Iterator[jaxdist.ParameterServerStrategy]:
    with InProcessCluster(num_workers=num_workers, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), variable_partitioner=partitioner)
        try:
            yield strategy
        finally:
            strategy.close()


def _sharded(strategy: jaxdist.ParameterServerStrategy, value: Any, name: str = "s") -> jaxdist.ShardedVariable:
    with strategy.scope():
        s = jaxdist.create_variable(np.asarray(value), name=name)
    assert isinstance(s, jaxdist.ShardedVariable)
    return s


# ------------------------------------------------------------------------------- PartitionerTest
def test_fixed_shards_partitioner() -> None:
    """Ports ``PartitionerTest.test_fixed_shards_partitioner``."""
    assert jaxdist.FixedShardsPartitioner(num_shards=2)((10, 3), np.float32) == [2, 1]


def test_min_size_partitioner() -> None:
    """Ports ``PartitionerTest.test_min_size_partitioner``."""
    assert jaxdist.MinSizePartitioner(min_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert jaxdist.MinSizePartitioner(min_shard_bytes=4, max_shards=10)((6, 1), np.float32) == [6, 1]


def test_max_size_partitioner() -> None:
    """Ports ``PartitionerTest.test_max_size_partitioner``."""
    assert jaxdist.MaxSizePartitioner(max_shard_bytes=4)((6, 1), np.float32) == [6, 1]
    assert jaxdist.MaxSizePartitioner(max_shard_bytes=4, max_shards=2)((6, 1), np.float32) == [2, 1]
    assert jaxdist.MaxSizePartitioner(max_shard_bytes=1024)((6, 1), np.float32) == [1, 1]


# ----------------------------------------------------------------------------- ShardedVariableTest
def test_sharded_variable_simple() -> None:
    """Ports ``ShardedVariableTest.test_sharded_variable_simple``: a ShardedVariable made from two
    variables by hand."""
    with _strategy() as strategy:
        with strategy.scope():
            v0 = jaxdist.create_variable(np.array([0]), name="s/part_0")
            v1 = jaxdist.create_variable(np.array([1]), name="s/part_1")
        s = jaxdist.ShardedVariable("s", [v0, v1])
        assert s.variables[0] is v0 and s.variables[1] is v1
        assert s.shape == (2,)
        assert s.dtype == v0.dtype
        assert s.name == "s"
        np.testing.assert_array_equal(s.numpy(), [0, 1])


def test_assign() -> None:
    """Ports ``ShardedVariableTest.test_assign`` (div layout: shards of 2, 1, 1 rows)."""
    with _strategy(jaxdist.FixedShardsPartitioner(3)) as strategy:
        s = _sharded(strategy, [[0, 0], [1, 1], [2, 2], [3, 3]])
        s.assign([[4, 4], [5, 5], [6, 6], [7, 7]])
        np.testing.assert_array_equal(s.variables[0].numpy(), [[4, 4], [5, 5]])
        np.testing.assert_array_equal(s.variables[1].numpy(), [[6, 6]])
        np.testing.assert_array_equal(s.variables[2].numpy(), [[7, 7]])


def test_assign_add() -> None:
    """Ports ``ShardedVariableTest.test_assign_add``."""
    with _strategy(jaxdist.FixedShardsPartitioner(3)) as strategy:
        s = _sharded(strategy, [[0, 0], [1, 1], [2, 2], [3, 3]])
        s.assign_add([[1, 1], [1, 1], [2, 2], [2, 2]])
        np.testing.assert_array_equal(s.variables[0].numpy(), [[1, 1], [2, 2]])
        np.testing.assert_array_equal(s.variables[1].numpy(), [[4, 4]])
        np.testing.assert_array_equal(s.variables[2].numpy(), [[5, 5]])


def test_assign_sub() -> None:
    """Ports ``ShardedVariableTest.test_assign_sub``."""
    with _strategy(jaxdist.FixedShardsPartitioner(3)) as strategy:
        s = _sharded(strategy, [[0, 0], [1, 1], [2, 2], [3, 3]])
        s.assign_sub([[0, 0], [1, 1], [1, 1], [3, 3]])
        np.testing.assert_array_equal(s.variables[0].numpy(), [[0, 0], [0, 0]])
        np.testing.assert_array_equal(s.variables[1].numpy(), [[1, 1]])
        np.testing.assert_array_equal(s.variables[2].numpy(), [[0, 0]])


def test_convert_to_tensor() -> None:
    """Ports ``ShardedVariableTest.test_convert_to_tensor``: the whole value as a numpy and a JAX array."""
    with _strategy(jaxdist.FixedShardsPartitioner(3)) as strategy:
        s = _sharded(strategy, [[0, 0], [1, 1], [2, 2], [3, 3]])
        want = [[0, 0], [1, 1], [2, 2], [3, 3]]
        np.testing.assert_array_equal(np.asarray(s), want)
        np.testing.assert_array_equal(jnp.asarray(s), want)
        np.testing.assert_array_equal(s.read_value(), want)


def test_save_restore(tmp_path: Any) -> None:
    """Ports ``ShardedVariableTest.test_save_restore``."""
    with _strategy(jaxdist.FixedShardsPartitioner(4)) as strategy:
        s = _sharded(strategy, [0, 1, 2, 3])
        cp = jaxdist.Checkpoint(strategy)
        np.testing.assert_array_equal(s.variables[0].numpy(), [0])
        cp.write(os.path.join(tmp_path, "checkpoint"))
        s.variables[0].assign([4])
        np.testing.assert_array_equal(s.variables[0].numpy(), [4])
        cp.restore(os.path.join(tmp_path, "checkpoint"))
        np.testing.assert_array_equal(s.variables[0].numpy(), [0])  # the original weights


def test_save_restore_different_partitions(tmp_path: Any) -> None:
    """Ports ``ShardedVariableTest.test_save_restore_different_partitions``: 4 partitions restored
    into 1, then 1 into 4."""
    fname = os.path.join(tmp_path, "checkpoint")
    with _strategy(jaxdist.FixedShardsPartitioner(4)) as four, _strategy() as one:
        s = _sharded(four, [0, 1, 2, 3])
        cp = jaxdist.Checkpoint(four)
        cp.write(fname)
        with one.scope():
            s2 = jaxdist.create_variable(np.array([0, 0, 0, 0]), name="s")
        assert isinstance(s2, jaxdist.Variable)
        cp2 = jaxdist.Checkpoint(one)
        cp2.restore(fname)  # 4 partitions into 1
        np.testing.assert_array_equal(s2.numpy(), [0, 1, 2, 3])
        s2.assign([5, 10, 15, 20])
        fname2 = os.path.join(tmp_path, "checkpoint2")  # TF overwrites fname; jaxdist refuses to
        cp2.write(fname2)
        cp.restore(fname2)  # 1 partition into 4
        assert [int(v.numpy()[0]) for v in s.variables] == [5, 10, 15, 20]


def test_save_restore_4_to_2_partitions(tmp_path: Any) -> None:
    """Ports ``ShardedVariableTest.test_save_restore_4_to_2_partitions``."""
    fname = os.path.join(tmp_path, "checkpoint")
    with _strategy(jaxdist.FixedShardsPartitioner(4)) as four, _strategy(jaxdist.FixedShardsPartitioner(2)) as two:
        _sharded(four, [0, 1, 2, 3])
        jaxdist.Checkpoint(four).write(fname)
        s2 = _sharded(two, [0, 0, 0, 0])
        jaxdist.Checkpoint(two).restore(fname)
        assert len(s2.variables) == 2
        np.testing.assert_array_equal(s2.variables[0].numpy(), [0, 1])
        np.testing.assert_array_equal(s2.variables[1].numpy(), [2, 3])


def test_validation_errors() -> None:
    """Ports ``ShardedVariableTest.test_validation_errors`` (TF's ``SaveSliceInfo`` case has no jaxdist
    counterpart: a shard's place in its variable is its position in the list)."""
    with _strategy() as strategy:
        with strategy.scope():
            v0 = jaxdist.create_variable(np.array([0]), name="a/part_0")
            i64 = jaxdist.create_variable(np.array([0], np.int64), name="b/part_0")
            i32 = jaxdist.create_variable(np.array([1], np.int32), name="b/part_1")
            w5 = jaxdist.create_variable(np.ones((5, 10), np.float32), name="c/part_0")
            w20 = jaxdist.create_variable(np.ones((5, 20), np.float32), name="c/part_1")
        with pytest.raises(ValueError, match="Expected a list of"):
            jaxdist.ShardedVariable("a", [v0, "not-a-variable"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="same dtype"):
            jaxdist.ShardedVariable("b", [i64, i32])
        with pytest.raises(ValueError, match="every dimension but the first"):
            jaxdist.ShardedVariable("c", [w5, w20])


def test_as_function_input() -> None:
    """Ports ``ShardedVariableTest.test_as_function_input``: a ShardedVariable passed to a scheduled
    function, which assigns it. TF also counts the ``tf.function``'s traces (1 for two variables of the
    same structure); a scheduled Python function is not traced, so that count does not apply."""
    with _strategy(jaxdist.FixedShardsPartitioner(2)) as strategy:
        s = _sharded(strategy, [1, 1], name="s")
        s2 = _sharded(strategy, [2, 2], name="s2")
        coord = jaxdist.ClusterCoordinator(strategy)
        try:
            def func(sharded_var: jaxdist.ShardedVariable) -> None:
                sharded_var.assign(np.array([0, 0]))

            coord.schedule(func, args=(s,))
            coord.join()
            np.testing.assert_array_equal(np.asarray(s), [0, 0])
            coord.schedule(func, args=(s2,))
            coord.join()
            np.testing.assert_array_equal(np.asarray(s2), [0, 0])
        finally:
            coord.shutdown(exit_tasks=False)


def test_flatten() -> None:
    """Ports ``ShardedVariableTest.test_flatten``: a ShardedVariable is one leaf of a pytree (TF's
    ``nest.flatten``); its shards are ``variables`` (TF's ``expand_composites=True``)."""
    with _strategy(jaxdist.FixedShardsPartitioner(2)) as strategy:
        s = _sharded(strategy, [0, 1])
        assert jax.tree_util.tree_leaves(s) == [s]
        assert jax.tree_util.tree_leaves({"s": s}) == [s]
        assert [v.name for v in s.variables] == ["s/part_0", "s/part_1"]


def test_embedding_lookup() -> None:
    """Ports ``ShardedVariableTest.test_embedding_lookup``, its dense lookup (TF's sparse and safe
    sparse lookups take a ``tf.SparseTensor`` of ids: see the README). TF counts one ``ResourceGather``
    per shard (the variable is not read whole); jaxdist's lookup pulls only the rows asked for."""
    with _strategy(jaxdist.FixedShardsPartitioner(3)) as strategy:
        sv = _sharded(strategy, np.arange(10, dtype=np.float32).reshape(5, 2) + 1)
        assert [v.shape for v in sv.variables] == [(2, 2), (2, 2), (1, 2)]
        np.testing.assert_array_equal(jaxdist.embedding_lookup(sv, [0, 3, 4]), [[1.0, 2.0], [7.0, 8.0], [9.0, 10.0]])
        np.testing.assert_array_equal(sv.embedding_lookup(np.array([0, 3, 4])), [[1.0, 2.0], [7.0, 8.0], [9.0, 10.0]])


def test_slicing() -> None:
    """Ports ``ShardedVariableTest.test_slicing`` (8 rows in shards of 3, 3, 2 as TF's)."""
    with _strategy(jaxdist.FixedShardsPartitioner(3)) as strategy:
        full = np.arange(1, 17).reshape(8, 2)
        sv = _sharded(strategy, full)
        assert [v.shape[0] for v in sv.variables] == [3, 3, 2]
        empty = full[0:0]

        def eq(got: Any, want: Any) -> None:
            np.testing.assert_array_equal(got, want)
            assert np.shape(got) == np.shape(want)

        # Positive step.
        eq(sv[:], full)
        eq(sv[:2], [[1, 2], [3, 4]])
        eq(sv[-8:2], [[1, 2], [3, 4]])
        eq(sv[-10:2], [[1, 2], [3, 4]])
        eq(sv[5:], [[11, 12], [13, 14], [15, 16]])
        eq(sv[5:-1], [[11, 12], [13, 14]])
        eq(sv[::3], [[1, 2], [7, 8], [13, 14]])
        eq(sv[::5], [[1, 2], [11, 12]])
        eq(sv[1::6], [[3, 4], [15, 16]])
        eq(sv[1:5:6], [[3, 4]])
        eq(sv[1::7], [[3, 4]])
        eq(sv[2:7], [[5, 6], [7, 8], [9, 10], [11, 12], [13, 14]])
        eq(sv[2:7:2], [[5, 6], [9, 10], [13, 14]])
        eq(sv[2:7:3], [[5, 6], [11, 12]])
        # Negative step.
        eq(sv[::-1], full[::-1])
        eq(sv[2::-1], [[5, 6], [3, 4], [1, 2]])
        eq(sv[2:-8:-1], [[5, 6], [3, 4]])
        eq(sv[2:-10:-1], [[5, 6], [3, 4], [1, 2]])
        eq(sv[4::-1], [[9, 10], [7, 8], [5, 6], [3, 4], [1, 2]])
        eq(sv[-1:-3:-1], [[15, 16], [13, 14]])
        eq(sv[::-5], [[15, 16], [5, 6]])
        eq(sv[6::-6], [[13, 14], [1, 2]])
        eq(sv[6:5:-6], [[13, 14]])
        eq(sv[6::-7], [[13, 14]])
        eq(sv[7:1:-1], [[15, 16], [13, 14], [11, 12], [9, 10], [7, 8], [5, 6]])
        eq(sv[7:1:-2], [[15, 16], [11, 12], [7, 8]])
        eq(sv[7:1:-4], [[15, 16], [7, 8]])
        # Empty slices.
        eq(sv[0:0], empty)
        eq(sv[5:3], empty)
        eq(sv[3:5:-1], empty)
        eq(sv[-1:0], empty)
        eq(sv[2:-1:-1], empty)
        # Other dimensions.
        eq(sv[:, 0], [1, 3, 5, 7, 9, 11, 13, 15])
        eq(sv[:, 0:1], [[1], [3], [5], [7], [9], [11], [13], [15]])
        # Plain indexing.
        eq(sv[2], [5, 6])
        eq(sv[6], [13, 14])
        eq(sv[2, 1], 6)
        eq(sv[-2], [13, 14])
        with pytest.raises(IndexError, match="out of bounds"):
            _ = sv[100]
        with pytest.raises(IndexError, match="out of bounds"):
            _ = sv[-100]
        # Ellipsis.
        eq(sv[...], full)
        eq(sv[..., 0], [1, 3, 5, 7, 9, 11, 13, 15])
        eq(sv[0:1, ...], [[1, 2]])
        # New axis.
        eq(sv[np.newaxis, ...], full[np.newaxis])
        # Boolean masks.
        eq(sv[np.asarray(sv) > 10], [11, 12, 13, 14, 15, 16])
        # Array indices (TF refuses tensors as slice bounds or indices, "not allowed").
        with pytest.raises(TypeError, match="not allowed"):
            _ = sv[jnp.int32(1)::]
        with pytest.raises(TypeError, match="not allowed"):
            _ = sv[: jnp.int32(1) :]
        with pytest.raises(TypeError, match="not allowed"):
            _ = sv[jnp.int32(1)]
        # Inside a scheduled function (TF: inside a tf.function).
        coord = jaxdist.ClusterCoordinator(strategy)
        try:
            eq(coord.schedule(lambda: sv[:, 0]).fetch(), [1, 3, 5, 7, 9, 11, 13, 15])
        finally:
            coord.shutdown(exit_tasks=False)
