"""Synchronous and bounded-stale parameter-server training on an in-process cluster (2 PS, 2 workers
as real gRPC servers): the PS aggregates each step's gradients and applies their mean once; a worker
never runs more than ``staleness`` steps ahead of the slowest. SIGKILLed workers are in
``tests/multiprocess/test_sync_ps_staleness.py``."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.testing import InProcessCluster, poll_for

import inprocess_gates as gates

pytestmark = pytest.mark.timeout(180)

BATCH = 16


def batch_for(worker: int, step: int) -> tuple[np.ndarray, np.ndarray]:
    """A deterministic batch per (worker, step): the equivalence test rebuilds the combined batch from it."""
    rng = np.random.default_rng(1000 * step + worker)
    x = rng.normal(size=(BATCH, 8)).astype(np.float32)
    y = (x @ np.arange(24, dtype=np.float32).reshape(8, 3) / 10 + 0.5).astype(np.float32)
    return x, y


def loss(p: dict[str, Any], x: Any, y: Any) -> Any:
    return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)


grad_fn = jax.jit(jax.grad(loss))


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"w": rng.normal(size=(8, 3)).astype(np.float32) * 0.1, "b": np.zeros(3, np.float32)}


@pytest.fixture
def cluster() -> Iterator[InProcessCluster]:
    with InProcessCluster(num_workers=2, num_ps=2) as c:
        yield c


def _all_healthy(coord: jaxdist.ClusterCoordinator) -> bool:
    return all(row["healthy"] for row in coord.status())


def test_synchronous_two_workers_equal_one_process_with_the_combined_batch(cluster: InProcessCluster) -> None:
    strategy = jaxdist.ParameterServerStrategy(
        cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2), staleness=0)
    with strategy.scope():
        params = jaxdist.create_variables(initial(), optimizer=optax.adam(0.05))
    assert isinstance(params["w"], jaxdist.ShardedVariable)  # the step must land on both shards alike
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        poll_for(lambda: _all_healthy(coord), 30, what="both workers configured (they join the steps)")

        def train_step() -> tuple[int, int]:
            p = jaxdist.pull(params)
            step, worker = jaxdist.current_sync_step(), jaxdist.current_worker_index()
            x, y = batch_for(worker, step)
            jaxdist.apply_gradients(params, grad_fn(p, x, y))
            return step, worker

        steps = 15
        rvs = [coord.schedule(train_step) for _ in range(2 * steps)]
        coord.join()
        ran = [rv.fetch() for rv in rvs]
        by_step: dict[int, list[int]] = {}
        for step, worker in ran:
            by_step.setdefault(step, []).append(worker)
        assert sorted(by_step) == list(range(len(by_step)))
        full = sum(sorted(ws) == [0, 1] for ws in by_step.values())
        # Each step holds one gradient of each worker (an idle worker may sit out the last one).
        assert full >= steps - 1, by_step
        assert all(len(set(ws)) == len(ws) for ws in by_step.values())  # never two of one worker

        # One process, the combined batch of each step, the same optimizer applied once per step.
        ref = {k: jnp.asarray(v) for k, v in initial().items()}
        tx = optax.adam(0.05)
        state = tx.init(ref)
        for step in sorted(by_step):
            parts = [batch_for(w, step) for w in sorted(by_step[step])]
            x = np.concatenate([a for a, _ in parts])
            y = np.concatenate([b for _, b in parts])
            updates, state = tx.update(grad_fn(ref, x, y), state, ref)
            ref = optax.apply_updates(ref, updates)
        got = jaxdist.pull(params)
        np.testing.assert_allclose(got["w"], np.asarray(ref["w"]), rtol=2e-5, atol=2e-6)
        np.testing.assert_allclose(got["b"], np.asarray(ref["b"]), rtol=2e-5, atol=2e-6)
        # Async training would differ: the same gradients applied one by one move the weights elsewhere.
        assert not np.allclose(got["w"], initial()["w"], atol=1e-3)

        reports = coord.step_barrier.reports()  # type: ignore[union-attr]
        assert [r.applied for r in reports] == [len(by_step)] * 2  # both PS applied every step, once
        assert reports[0].clocks == reports[1].clocks
        assert reports[0].max_lead == 0
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()


@pytest.mark.parametrize("staleness", [1, 3])
def test_bounded_staleness_no_worker_runs_more_than_s_steps_ahead(cluster: InProcessCluster, staleness: int) -> None:
    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), staleness=staleness)
    with strategy.scope():
        v = jaxdist.create_variable(np.zeros(4, np.float32), name="v", optimizer=optax.sgd(1.0))
    coord = jaxdist.ClusterCoordinator(strategy)
    gate = gates.new_name("slow-worker")
    started = gates.new_name("started")
    try:
        poll_for(lambda: _all_healthy(coord), 30, what="both workers configured")

        def step(i: int) -> tuple[int, int]:
            worker = jaxdist.current_worker_index()
            if worker == 1:
                gates.arrive(started)
                assert gates.event(gate).wait(60), "the test never released worker 1"
            jaxdist.pull(v)
            jaxdist.apply_gradients(v, -np.ones(4, np.float32))  # each step adds 1 (the mean of -1s)
            return worker, jaxdist.current_sync_step()

        n = 4 * (staleness + 2)
        rvs = [coord.schedule(step, args=(i,)) for i in range(n)]
        barrier = coord.step_barrier
        assert barrier is not None
        # Worker 1 holds its first step; worker 0 runs ahead until the barrier stops it: exactly
        # `staleness` steps ahead of worker 1 when its pull opens, then its next pull waits.
        poll_for(lambda: gates.arrivals(started) >= 1, 30, what="worker 1 holding its step")
        poll_for(lambda: barrier.reports()[0].waiting == [0], 30, what="worker 0 stopped at the barrier")
        reports = barrier.reports()
        for r in reports:  # v lives on ps:0, but every PS keeps the same clock
            assert r.clocks == {0: staleness + 1, 1: 0} and r.applied == 0
        assert reports[v.ps_index].max_lead == staleness
        assert sum(rv.done() for rv in rvs) == staleness + 1  # worker 0's steps 0..s, no more
        gates.event(gate).set()
        coord.join()
        ran = [rv.fetch() for rv in rvs]
        reports = barrier.reports()
        assert reports[v.ps_index].max_lead == staleness  # the bound held, and was reached
        assert reports[0].applied == reports[1].applied and reports[0].clocks == reports[1].clocks
        applied = reports[0].applied
        assert float(v.numpy()[0]) == pytest.approx(applied)  # one optimizer step per global step
        # Every closure's step is one of its worker's, in order, each step once per worker.
        for w in (0, 1):
            mine = [s for worker, s in ran if worker == w]
            assert len(mine) == len(set(mine))
    finally:
        gates.event(gate).set()
        coord.shutdown(exit_tasks=False)
        strategy.close()


def test_staleness_argument_is_checked(cluster: InProcessCluster) -> None:
    for bad in (-1, 1.5, True, "0"):
        with pytest.raises(ValueError):
            jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), staleness=bad)  # type: ignore[arg-type]
    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), staleness=0)
    try:
        with pytest.raises(jaxdist.errors.ConfigurationError):
            jaxdist.ClusterCoordinator(strategy, closures_per_rpc=4)  # batches would hold several steps
        coord = jaxdist.ClusterCoordinator(strategy, closures_per_rpc=1)
        assert coord.closures_per_rpc == 1
        coord.shutdown(exit_tasks=False)
    finally:
        strategy.close()


def test_asynchronous_default_applies_every_push(cluster: InProcessCluster) -> None:
    from jaxdist.proto.ps_wire import SyncKind

    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
    with strategy.scope():
        v = jaxdist.create_variable(np.zeros(2, np.float32), name="v", optimizer=optax.sgd(1.0))
    # As a synchronous coordinator that died would leave them: every PS still runs steps.
    for c in strategy.connections.clients:
        c.sync_steps(SyncKind.CONFIGURE, staleness=0, members=[0, 1])
    coord = jaxdist.ClusterCoordinator(strategy)  # asynchronous: turns the steps off
    try:
        assert coord.step_barrier is None

        def step() -> int:
            jaxdist.pull(v)
            jaxdist.apply_gradients(v, -np.ones(2, np.float32))
            return jaxdist.current_sync_step()

        rvs = [coord.schedule(step) for _ in range(10)]
        coord.join()
        assert [rv.fetch() for rv in rvs] == [-1] * 10
        np.testing.assert_array_equal(v.numpy(), [10.0, 10.0])
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()


def test_ps_refuses_bad_sync_requests_with_typed_errors_and_changes_nothing(cluster: InProcessCluster) -> None:
    import grpc

    from jaxdist.errors import InvalidRequestError, StepMembershipError
    from jaxdist.proto import ps_pb2
    from jaxdist.transport.channel import make_channel
    from jaxdist.proto.ps_wire import CreateSpec, Op, SyncKind, Update
    from jaxdist.ps_server.client import PSClient

    client = PSClient(cluster.address("ps:0"), cluster.credentials, task="ps:0")
    try:
        client.create([CreateSpec("v", value=np.zeros(2, np.float32), optimizer=optax.sgd(1.0))])
        client.sync_steps(SyncKind.CONFIGURE, staleness=0, members=[0])
        g = [Update("v", Op.APPLY_GRADIENT, np.ones(2, np.float32))]
        # Garbage: bytes, unknown kind, negative worker, negative members: INVALID_ARGUMENT with a reason.
        with make_channel(cluster.address("ps:0")) as ch:
            raw = ch.unary_unary("/jaxdist.ParameterServer/SyncSteps")
            for body in (b"\xff\xfe garbage", ps_pb2.SyncStepsRequest(kind=42).SerializeToString(),
                         ps_pb2.SyncStepsRequest(kind=ps_pb2.SYNC_COMMIT, contributor=-3).SerializeToString(),
                         ps_pb2.SyncStepsRequest(kind=ps_pb2.SYNC_CONFIGURE, members=[-1]).SerializeToString()):
                with pytest.raises(grpc.RpcError) as e:
                    raw(body, metadata=cluster.credentials.metadata, timeout=5)
                assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, body
        # A worker outside the steps: FAILED_PRECONDITION; its gradients are not applied.
        with pytest.raises(StepMembershipError) as e2:
            client.push_step(g, "x/1", contributor=3, commit=True)
        assert e2.value.code == grpc.StatusCode.FAILED_PRECONDITION
        with pytest.raises(StepMembershipError):
            client.sync_steps(SyncKind.COMMIT, 3)
        # Gradients mixed with another op in one step's push: refused, nothing staged.
        with pytest.raises(InvalidRequestError):
            client.push_step(g + [Update("v", Op.ASSIGN_ADD, np.ones(2, np.float32))], "x/2", contributor=0)
        # A wrong shape is refused before it is staged (never at apply time).
        with pytest.raises(jaxdist.errors.ShapeMismatchError):
            client.push_step([Update("v", Op.APPLY_GRADIENT, np.ones(3, np.float32))], "x/3", contributor=0)
        r = client.sync_steps(SyncKind.STATUS)
        assert r.uncommitted == 0 and r.applied == 0 and r.clocks == {0: 0}
        # The member's push is staged (not applied) and applied once it commits.
        resp = client.push_step(g, "x/4", contributor=0)
        assert resp.staged and resp.step == 0
        ((value, _),) = client.pull([ps_wire_pull("v")])
        np.testing.assert_array_equal(value, [0.0, 0.0])
        assert client.sync_steps(SyncKind.COMMIT, 0).applied == 1
        ((value, _),) = client.pull([ps_wire_pull("v")])
        np.testing.assert_array_equal(value, [-1.0, -1.0])
        assert client.push_step(g, "x/4", contributor=0, commit=True).duplicate  # exactly once
        client.sync_steps(SyncKind.CONFIGURE, staleness=-1)  # back to asynchronous: applied at once
        assert not client.push_step(g, "x/5", contributor=0).staged
        ((value, _),) = client.pull([ps_wire_pull("v")])
        np.testing.assert_array_equal(value, [-2.0, -2.0])
    finally:
        client.close()


def ps_wire_pull(name: str) -> Any:
    from jaxdist.proto.ps_wire import PullSpec

    return PullSpec(name)


def test_synchronous_steps_keep_the_transfer_dtype_rule(cluster: InProcessCluster) -> None:
    """bf16 gradients (mixed precision) are staged as sent and averaged in the variable's float32."""
    import ml_dtypes

    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), staleness=0)
    with strategy.scope():
        params = jaxdist.create_variables(initial(), optimizer=optax.sgd(0.1))
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        poll_for(lambda: _all_healthy(coord), 30, what="both workers configured")

        def train_step() -> tuple[int, int]:
            p = jaxdist.pull(params)
            step, worker = jaxdist.current_sync_step(), jaxdist.current_worker_index()
            x, y = batch_for(worker, step)
            jaxdist.apply_gradients(params, grad_fn(p, x, y), transfer_dtype=jnp.bfloat16)
            return step, worker

        rvs = [coord.schedule(train_step) for _ in range(8)]
        coord.join()
        by_step: dict[int, list[int]] = {}
        for step, worker in (rv.fetch() for rv in rvs):
            by_step.setdefault(step, []).append(worker)
        ref = {k: jnp.asarray(v) for k, v in initial().items()}
        for step in sorted(by_step):
            grads = [grad_fn(ref, *batch_for(w, step)) for w in sorted(by_step[step])]
            rounded = [jax.tree.map(lambda a: np.asarray(a).astype(ml_dtypes.bfloat16).astype(np.float32), g) for g in grads]
            mean = jax.tree.map(lambda *a: sum(a[1:], a[0]) / np.float32(len(a)), *rounded)
            ref = jax.tree.map(lambda v, g: v - np.float32(0.1) * g, ref, mean)
        got = jaxdist.pull(params)
        np.testing.assert_allclose(got["w"], np.asarray(ref["w"]), rtol=2e-5, atol=2e-6)
        assert got["w"].dtype == np.float32
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()


def test_a_removed_worker_leaves_the_steps_and_training_goes_on(cluster: InProcessCluster) -> None:
    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), staleness=0)
    with strategy.scope():
        v = jaxdist.create_variable(np.zeros(2, np.float32), name="v", optimizer=optax.sgd(1.0))
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        poll_for(lambda: _all_healthy(coord), 30, what="both workers configured")
        barrier = coord.step_barrier
        assert barrier is not None and barrier.members == {0, 1}

        def step() -> int:
            jaxdist.pull(v)
            jaxdist.apply_gradients(v, -np.ones(2, np.float32))
            return jaxdist.current_worker_index()

        rvs = [coord.schedule(step) for _ in range(10)]
        coord.join()
        coord.remove_worker(1)
        assert barrier.members == {0}
        rvs += [coord.schedule(step) for _ in range(10)]
        coord.join()
        assert [rv.fetch() for rv in rvs[10:]] == [0] * 10  # worker 0 alone: each of its steps applies
        reports = barrier.reports()
        assert all(r.clocks.keys() == {0} for r in reports)
        assert float(v.numpy()[0]) == pytest.approx(reports[0].applied)
        assert reports[0].applied >= 15  # ~5 two-gradient steps, then 10 of worker 0's own
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()


def test_a_closure_failed_after_a_partial_push_holds_neither_the_steps_nor_join(cluster: InProcessCluster) -> None:
    """A closure's push is staged on one PS and refused by the other (there, a gradient mixed with
    another op), and the closure fails: its gradient is never committed. The other worker, waiting at
    the barrier for that step, waited forever before, and join() with it (raise_if_error waits for the
    running closures). Its worker is now withdrawn from the steps: join() raises the closure's error,
    and training goes on with both workers."""
    from jaxdist.base.errors import InvalidRequestError

    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), staleness=0)
    with strategy.scope():
        params = jaxdist.create_variables({"a": np.zeros(2, np.float32), "b": np.zeros(2, np.float32)},
                                          optimizer=optax.sgd(1.0))
    a, b = params["a"], params["b"]
    assert {a.ps_index, b.ps_index} == {0, 1}
    coord = jaxdist.ClusterCoordinator(strategy)
    held, release = gates.new_name("partial-push-made"), gates.new_name("partial-push-release")
    try:
        poll_for(lambda: _all_healthy(coord), 30, what="both workers configured")
        barrier = coord.step_barrier
        assert barrier is not None

        def good() -> int:
            jaxdist.pull(params)
            jaxdist.apply_gradients(params, {"a": -np.ones(2, np.float32), "b": -np.ones(2, np.float32)})
            return jaxdist.current_worker_index()

        def partial() -> None:
            from jaxdist.variables import push_updates

            jaxdist.pull(params)
            g = np.ones(2, np.float32)
            try:  # a's PS stages its gradient; b's PS refuses a gradient pushed with another op
                push_updates([(a, "apply_gradient", g, None), (b, "apply_gradient", g, None), (b, "assign_add", g, None)])
            except InvalidRequestError:
                gates.arrive(held)
                assert gates.event(release).wait(60), "the test never released the failing closure"
                raise
            raise AssertionError("the mixed push was not refused")

        coord.schedule(partial)
        poll_for(lambda: gates.arrivals(held) >= 1, 30, what="the partial push made")
        rvs = [coord.schedule(good) for _ in range(4)]
        # The other worker commits step 0, then its next closure waits at the barrier for step 1.
        poll_for(lambda: any(r.waiting for r in barrier.reports()), 30, what="a closure waiting at the barrier")
        gates.event(release).set()
        with pytest.raises(InvalidRequestError):
            coord.join()
        assert all(rv.status is not jaxdist.RemoteValueStatus.NOT_READY for rv in rvs)
        assert barrier.members == {0, 1} and not barrier.pending_drops
        rvs = [coord.schedule(good) for _ in range(6)]
        coord.join()
        assert sorted({rv.fetch() for rv in rvs}) == [0, 1]  # both workers still train
        reports = barrier.reports()
        assert reports[0].clocks == reports[1].clocks and not any(r.uncommitted for r in reports)
    finally:
        gates.event(release).set()
        coord.shutdown(exit_tasks=False)
        strategy.close()


def test_row_reads_wait_at_the_barrier_and_sparse_gradients_are_averaged(cluster: InProcessCluster) -> None:
    strategy = jaxdist.ParameterServerStrategy(
        cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2), staleness=0)
    with strategy.scope():
        table = jaxdist.create_variable(np.zeros((10, 2), np.float32), name="table", optimizer=optax.sgd(1.0))
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        poll_for(lambda: _all_healthy(coord), 30, what="both workers configured")

        def step() -> tuple[int, int]:
            w = jaxdist.current_worker_index()
            table.sparse_read(np.array([w, 9]))  # only rows: the barrier still holds the read
            s = jaxdist.current_sync_step()
            # Row 9 (shard 1) from both workers; row 0 (shard 0) from worker 0 only: shard 0 gets no
            # push from worker 1, yet its step's mean divides by the step's 2 workers.
            rows = [0, 9] if w == 0 else [9]
            jaxdist.apply_gradients(table, jaxdist.SparseGradient(rows, -np.ones((len(rows), 2), np.float32)))
            return s, w

        rvs = [coord.schedule(step) for _ in range(12)]
        coord.join()
        ran = [rv.fetch() for rv in rvs]
        assert all(s >= 0 for s, _ in ran)  # every read waited at the barrier and learnt its step
        by_step: dict[int, list[int]] = {}
        for s, w in ran:
            by_step.setdefault(s, []).append(w)
        v = table.numpy()
        # Sparse rows of a step are averaged over the step's workers (a row one worker did not push is
        # its zero, as in one process with the combined batch): row 9 moves 1 per step; row 0 moves
        # 1/(workers in the step) for each step worker 0 was in.
        assert float(v[9, 0]) == pytest.approx(len(by_step))
        want = sum(1.0 / len(ws) for ws in by_step.values() if 0 in ws)
        assert float(v[0, 0]) == pytest.approx(want)
        assert want < sum(1.0 for ws in by_step.values() if 0 in ws)  # some steps had both workers
        reports = coord.step_barrier.reports()  # type: ignore[union-attr]
        assert reports[0].applied == reports[1].applied == len(by_step) and reports[0].max_lead == 0
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()
