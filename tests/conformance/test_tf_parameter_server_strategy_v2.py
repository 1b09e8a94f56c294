"""TF's ``parameter_server_strategy_v2_test.py`` (tensorflow/python/distribute), ported to jaxdist's API.

Each test names the TF test it ports in its docstring; the README beside this file lists every TF test
of the file with its port or the reason it does not apply.

Differences from TF, each for a reason:
- TF starts a multi-process cluster per test class; the ports use :class:`jaxdist.testing.InProcessCluster`
  (real gRPC servers in this process), with TF's numbers of PS and workers, one per test so that the
  strategies' round-robin counters and variable names start fresh as TF's do.
- TF's ``variables.Variable(...)`` inside ``strategy.scope()`` is ``jaxdist.create_variable(...)``; a
  variable's PS is its ``ps_index`` (``device`` is ``/job:ps/task:<i>``).
- TF's strategy ``run`` outside ``ClusterCoordinator.schedule`` runs on the coordinator's devices; with
  one CPU device per process TF's ``num_replicas_in_sync`` is 1, as it is here.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import jaxdist
from jaxdist.testing import InProcessCluster

pytestmark = pytest.mark.timeout(120)

#: TF's usage warning, the part that says what happened (jaxdist's words for the rest).
_USAGE_WARNING = "without using `ClusterCoordinator.schedule`"


@contextlib.contextmanager
def _strategy(partitioner: Any = None, num_ps: int = 2, num_workers: int = 2) -> Iterator[jaxdist.ParameterServerStrategy]:
    with InProcessCluster(num_workers=num_workers, num_ps=num_ps) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), variable_partitioner=partitioner)
        try:
            yield strategy
        finally:
            strategy.close()


def _ps_of(v: Any) -> list[int]:
    return [s.ps_index for s in v.variables] if isinstance(v, jaxdist.ShardedVariable) else [v.ps_index]


# ------------------------------------------------------------------ ParameterServerStrategyV2Test
def test_variable_placement() -> None:
    """Ports ``ParameterServerStrategyV2Test.testVariablePlacement`` (3 PS): variables made in the scope
    go round-robin over the PS tasks. TF's ``v1``, made outside every scope, lives on the coordinator;
    jaxdist has no coordinator-local variables outside a scope (it raises, naming the scopes): see
    ``test_a_variable_outside_every_scope_is_refused``."""
    with _strategy(num_ps=3) as strategy:
        with strategy.scope():
            vs = [jaxdist.create_variable(np.float32(i + 1.0)) for i in range(4)]
        assert [v.ps_index for v in vs] == [0, 1, 2, 0]
        assert [v.device for v in vs] == ["/job:ps/task:0", "/job:ps/task:1", "/job:ps/task:2", "/job:ps/task:0"]


def test_a_variable_outside_every_scope_is_refused() -> None:
    """The rest of ``testVariablePlacement``: TF's ``v1``, made outside the scope. jaxdist's variables
    outside every scope are refused with a ConfigurationError that names the scopes to open."""
    with pytest.raises(jaxdist.errors.ConfigurationError, match="no strategy scope is open"):
        jaxdist.create_variable(np.float32(0.0))


@pytest.mark.parametrize("method", ["run", "reduce"])
def test_run_and_reduce_not_used_with_cluster_coordinator_warn(method: str, caplog: pytest.LogCaptureFixture) -> None:
    """Ports ``testRunNotUsedWithClusterCoordinator`` and ``testReduceNotUsedWithClusterCoordinator``:
    ``strategy.run`` / ``reduce`` called on the coordinator (not inside a scheduled function) logs TF's
    usage warning, and still computes there."""
    with _strategy() as strategy:
        with strategy.scope():
            v = jaxdist.create_variable(np.int64(1), name="v")
        dataset = iter(range(8))
        with caplog.at_level(logging.WARNING):
            if method == "run":
                got = strategy.run(lambda x, w: x + w, args=(next(dataset), v.numpy()))
                assert int(got) == 1
            else:
                assert strategy.reduce("SUM", np.float32(2.0), axis=None) == 2.0
        assert any(_USAGE_WARNING in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_run_used_with_test_only_mode() -> None:
    """Ports ``ParameterServerStrategyV2Test.testRunUsedWithTestOnlyMode``: ``run`` on the coordinator
    computes (TF needs its private ``_allow_run_without_coordinator`` for that; jaxdist only warns)."""
    with _strategy() as strategy:
        with strategy.scope():
            v = jaxdist.create_variable(np.int64(1), name="v")
        dataset = iter(range(15))
        assert int(strategy.run(lambda x, w: x + w, args=(next(dataset), v.numpy()))) == 1


def test_run_inside_a_scheduled_function_does_not_warn(caplog: pytest.LogCaptureFixture) -> None:
    """The other side of ``testRunNotUsedWithClusterCoordinator``: inside a scheduled function ``run``
    and ``reduce`` log no usage warning (TF's ``testRunNotUsedWithClusterCoordinatorSchedule`` checks
    both sides)."""
    with _strategy() as strategy:
        coord = jaxdist.ClusterCoordinator(strategy)
        try:
            def worker_fn(x: float) -> Any:
                return strategy.reduce("SUM", strategy.run(lambda t: t + 1.0, args=(x,)), axis=None)

            with caplog.at_level(logging.WARNING):
                assert float(coord.schedule(worker_fn, args=(3.0,)).fetch()) == 4.0
            assert not any(_USAGE_WARNING in r.getMessage() for r in caplog.records)
        finally:
            coord.shutdown(exit_tasks=False)


def test_distribute_dataset_used_directly() -> None:
    """Ports ``ParameterServerStrategyV2Test.testDistributeDatasetUsedDirectly``: a distributed dataset
    made on the coordinator cannot be iterated there (ValueError): it is for the workers."""
    with _strategy() as strategy:
        dataset = [np.arange(3)]
        with pytest.raises(ValueError):
            iter(strategy.experimental_distribute_dataset(dataset))
        with pytest.raises(ValueError):
            iter(strategy.distribute_datasets_from_function(lambda ctx: dataset))


# ---------------------------------------------------------------------- VariablePartitioningTest
def test_default_no_partition() -> None:
    """Ports ``VariablePartitioningTest.testDefaultNoPartition``."""
    with _strategy() as strategy:
        with strategy.scope():
            v = jaxdist.create_variable(np.array([0, 1, 2, 3]))
        assert isinstance(v, jaxdist.Variable)


def test_basic() -> None:
    """Ports ``VariablePartitioningTest.testBasic``: callable initial values with shape and dtype."""
    with _strategy(jaxdist.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            v1 = jaxdist.create_variable(lambda: np.arange(10, dtype=np.int64).reshape(5, 2), shape=(5, 2), dtype=np.int64)
            v2 = jaxdist.create_variable(lambda: np.arange(6, dtype=np.int64).reshape(6, 1), shape=(6, 1), dtype=np.int64)
        assert isinstance(v1, jaxdist.ShardedVariable) and len(v1.variables) == 2
        assert _ps_of(v1) == [0, 1]
        np.testing.assert_array_equal(v1.variables[0].numpy(), [[0, 1], [2, 3], [4, 5]])
        np.testing.assert_array_equal(v1.variables[1].numpy(), [[6, 7], [8, 9]])
        assert isinstance(v2, jaxdist.ShardedVariable) and len(v2.variables) == 2
        assert _ps_of(v2) == [0, 1]
        np.testing.assert_array_equal(v2.variables[0].numpy(), [[0], [1], [2]])
        np.testing.assert_array_equal(v2.variables[1].numpy(), [[3], [4], [5]])


def test_non_callable_initial_value() -> None:
    """Ports ``VariablePartitioningTest.testNonCallableInitialValue``."""
    with _strategy(jaxdist.FixedShardsPartitioner(4)) as strategy:
        with strategy.scope():
            v = jaxdist.create_variable(np.arange(10))
        assert isinstance(v, jaxdist.ShardedVariable) and len(v.variables) == 4
        assert _ps_of(v) == [0, 1, 0, 1]
        for shard, want in zip(v.variables, [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]):
            np.testing.assert_array_equal(shard.numpy(), want)


def test_num_partitions_larger_than_size() -> None:
    """Ports ``VariablePartitioningTest.testNumPartitionsLargerThanSize``."""
    with _strategy(jaxdist.FixedShardsPartitioner(4)) as strategy:
        with strategy.scope():
            v = jaxdist.create_variable(np.array([0, 1, 2]))
        assert isinstance(v, jaxdist.ShardedVariable) and len(v.variables) == 3
        assert _ps_of(v) == [0, 1, 0]
        assert [shard.numpy().tolist() for shard in v.variables] == [[0], [1], [2]]


def test_partition_to_one() -> None:
    """Ports ``VariablePartitioningTest.testPartitionToOne``: small variables are not partitioned, and
    still go round-robin."""
    with _strategy(jaxdist.MinSizePartitioner(min_shard_bytes=64 << 20, max_shards=2)) as strategy:
        with strategy.scope():
            v1 = jaxdist.create_variable(lambda: np.zeros(10, np.int64), shape=(10,), dtype=np.int64)
            v2 = jaxdist.create_variable(np.arange(10))
        assert isinstance(v1, jaxdist.Variable) and not isinstance(v1, jaxdist.ShardedVariable)
        assert v1.ps_index == 0
        np.testing.assert_array_equal(v1.numpy(), [0] * 10)
        assert isinstance(v2, jaxdist.Variable) and v2.ps_index == 1
        np.testing.assert_array_equal(v2.numpy(), np.arange(10))


def test_colocate_with() -> None:
    """Ports ``VariablePartitioningTest.testColocateWith``."""
    with _strategy(jaxdist.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            v1 = jaxdist.create_variable(np.array([0, 1, 2, 3]))
            with strategy.extended.colocate_vars_with(v1.variables[0]):
                v2 = jaxdist.create_variable(np.array([4, 5]))
        assert isinstance(v1, jaxdist.ShardedVariable)
        assert isinstance(v2, jaxdist.Variable)
        assert v2.device == v1.variables[0].device
        np.testing.assert_array_equal(v2.numpy(), [4, 5])


def test_custom_partition_aware_initializer() -> None:
    """Ports ``VariablePartitioningTest.testCustomPartitionAwareInitializer``: an initializer given each
    partition's shape and offset (TF's ``partition_shape`` / ``partition_offset``) makes only its part
    of a 4x4 identity, on the PS."""
    def identity(shape: tuple[int, ...], dtype: Any, offset: tuple[int, ...]) -> np.ndarray:
        rows = np.arange(offset[0], offset[0] + shape[0])
        return (rows[:, None] == np.arange(shape[1])[None, :]).astype(dtype)

    with _strategy(jaxdist.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            v = jaxdist.create_variable(initializer=identity, shape=(4, 4), dtype=np.int64)
        assert isinstance(v, jaxdist.ShardedVariable) and len(v.variables) == 2
        assert _ps_of(v) == [0, 1]
        np.testing.assert_array_equal(v.variables[0].numpy(), [[1, 0, 0, 0], [0, 1, 0, 0]])
        np.testing.assert_array_equal(v.variables[1].numpy(), [[0, 0, 1, 0], [0, 0, 0, 1]])


def test_partition_when_lack_of_info() -> None:
    """Ports ``VariablePartitioningTest.testPartitionWhenLackOfInfo``: a callable initial value without
    its shape, its dtype, or either."""
    def init() -> np.ndarray:
        return np.array([0, 1, 2, 3], np.int64)

    with _strategy(jaxdist.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            v1 = jaxdist.create_variable(init, dtype=np.int64)
            v2 = jaxdist.create_variable(init, shape=(4,))
            v3 = jaxdist.create_variable(init)
        for v in (v1, v2, v3):
            assert isinstance(v, jaxdist.ShardedVariable) and len(v.variables) == 2
            assert _ps_of(v) == [0, 1]
            np.testing.assert_array_equal(v.variables[0].numpy(), [0, 1])
            np.testing.assert_array_equal(v.variables[1].numpy(), [2, 3])


@pytest.mark.parametrize("returned", [None, [], [0, 1, 1], [2, 2, 1]], ids=["none", "empty", "zero", "too-many"])
def test_invalid_partitioner(returned: Any) -> None:
    """Ports ``VariablePartitioningTest.testInvalidPartitioner``: a partitioner returning None, ``[]``,
    a zero or more partitions than TF allows on other axes is a ValueError naming the partitioner."""
    with _strategy(lambda shape, dtype: returned) as strategy:
        with pytest.raises(ValueError, match="partitioner"):
            with strategy.scope():
                jaxdist.create_variable(np.array([[[0, 1], [2, 3]], [[0, 1], [2, 3]]]))


@pytest.mark.parametrize("restore_shards", [2, 4], ids=["Restore", "RestoreDiffShards"])
def test_checkpoint(tmp_path: Any, restore_shards: int) -> None:
    """Ports ``VariablePartitioningTest.testCheckpoint`` (``Restore`` and ``RestoreDiffShards``): a
    2-shard variable written, then restored into 2 or 4 shards by another strategy. (TF's
    ``DelayedRestore`` cases restore before the variable exists: see the README.)"""
    ckpt = os.path.join(tmp_path, "checkpoint")
    with _strategy(jaxdist.FixedShardsPartitioner(2)) as strategy:
        with strategy.scope():
            w = jaxdist.create_variable(np.ones(4, np.float32), name="model/w")
        assert isinstance(w, jaxdist.ShardedVariable) and len(w.variables) == 2
        w.assign(np.array([1.0, 2.0, 3.0, 4.0], np.float32))
        jaxdist.Checkpoint(strategy).write(ckpt)
    with _strategy(jaxdist.FixedShardsPartitioner(restore_shards)) as strategy:
        with strategy.scope():
            w2 = jaxdist.create_variable(np.ones(4, np.float32), name="model/w")
        jaxdist.Checkpoint(strategy).restore(ckpt)
        assert isinstance(w2, jaxdist.ShardedVariable) and len(w2.variables) == restore_shards
        want = [[1.0, 2.0], [3.0, 4.0]] if restore_shards == 2 else [[1.0], [2.0], [3.0], [4.0]]
        assert [shard.numpy().tolist() for shard in w2.variables] == want


# --------------------------------------------------------------------------- ClusterTypeNameTest
@pytest.fixture(scope="module")
def cluster() -> Iterator[InProcessCluster]:
    """A cluster whose addresses and token the cluster specs below reuse (TF's ``create_cluster_spec``)."""
    with InProcessCluster(num_workers=1, num_ps=1) as c:
        yield c


def _resolver(cluster: InProcessCluster, jobs: dict[str, list[str]], task_type: str | None = None,
              task_id: int | None = None) -> jaxdist.SimpleClusterResolver:
    spec = cluster.cluster_resolver().cluster_spec().as_dict()
    spec.update(jobs)
    spec = {job: tasks for job, tasks in spec.items() if tasks}
    return jaxdist.SimpleClusterResolver(spec, task_type=task_type, task_id=task_id, token=cluster.credentials.token,
                                         tls=cluster.credentials.tls)


def test_arbitrary_job_name(cluster: InProcessCluster) -> None:
    """Ports ``ClusterTypeNameTest.testArbitraryJobName``."""
    resolver = _resolver(cluster, {"chief": ["127.0.0.1:1"], "some_arbitrary_name": ["127.0.0.1:2"]})
    with pytest.raises(ValueError, match="unknown job 'some_arbitrary_name'"):
        jaxdist.ParameterServerStrategy(resolver, connect_timeout=1.0)


def test_arbitrary_current_task_type(cluster: InProcessCluster) -> None:
    """Ports ``ClusterTypeNameTest.testArbitraryCurrentTaskType``."""
    resolver = _resolver(cluster, {"chief": ["127.0.0.1:1"]}, task_type="foobar", task_id=0)
    with pytest.raises(ValueError, match="task type 'foobar' is not one of"):
        jaxdist.ParameterServerStrategy(resolver, connect_timeout=1.0)


def test_more_than_one_chief(cluster: InProcessCluster) -> None:
    """Ports ``ClusterTypeNameTest.testMoreThanOneChief``."""
    resolver = _resolver(cluster, {"chief": [f"127.0.0.1:{p}" for p in (1, 2, 3)]}, task_type="chief", task_id=1)
    with pytest.raises(ValueError, match="at most one 'chief'"):
        jaxdist.ParameterServerStrategy(resolver, connect_timeout=1.0)


def test_less_than_one_worker(cluster: InProcessCluster) -> None:
    """Ports ``ClusterTypeNameTest.testLessThanOneWorker``."""
    resolver = _resolver(cluster, {"chief": ["127.0.0.1:1"], "worker": []}, task_type="ps", task_id=0)
    with pytest.raises(ValueError, match="at least one 'worker'"):
        jaxdist.ParameterServerStrategy(resolver, connect_timeout=1.0)


def test_less_than_one_ps(cluster: InProcessCluster) -> None:
    """Ports ``ClusterTypeNameTest.testLessThanOnePs``."""
    resolver = _resolver(cluster, {"chief": ["127.0.0.1:1"], "ps": []}, task_type="worker", task_id=0)
    with pytest.raises(ValueError, match="at least one 'ps'"):
        jaxdist.ParameterServerStrategy(resolver, connect_timeout=1.0)
