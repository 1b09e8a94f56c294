"""ClusterCoordinator against an in-process cluster (2 PS, 2 workers as real gRPC servers in this process):
TF's contract, per-worker data, elastic membership, PS loss and worker restarts without processes.

Tests that need a real process (SIGKILL, SIGSTOP, exit codes) are in ``tests/multiprocess``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.cluster_coordinator.remote_value import RemoteValue, RemoteValueStatus
from jaxdist.errors import CancelledError, ClosureError, OutOfRangeError, PerWorkerInputError
from jaxdist.testing import InProcessCluster, poll_for
from jaxdist.transport.credentials import Credentials
from jaxdist.worker.coordinator_client import CoordinatorClient
from jaxdist.worker.server import WorkerServer

import inprocess_gates as gates

pytestmark = pytest.mark.timeout(120)


class UserError(Exception):
    pass


@pytest.fixture(scope="module")
def env() -> Iterator[tuple[jaxdist.ParameterServerStrategy, jaxdist.ClusterCoordinator]]:
    with InProcessCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coord = jaxdist.ClusterCoordinator(strategy)
        yield strategy, coord
        coord.shutdown(exit_tasks=False)
        strategy.close()


def _failed_with(rv: RemoteValue, cls: type[BaseException]) -> bool:
    """Whether ``rv`` settled with an error of type ``cls`` (READY, and ``fetch()`` raises it)."""
    if rv.status is not RemoteValueStatus.READY:
        return False
    try:
        rv.fetch()
    except cls:
        return True
    except BaseException:  # noqa: BLE001 - another error: not the one asked about
        return False
    return False


def _worker(coord: jaxdist.ClusterCoordinator, index: int) -> dict[str, Any]:
    return coord.status()[index]


# ------------------------------------------------------------------------------ TF's contract
def test_schedule_join_fetch_and_training(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    with strategy.scope():
        params = jaxdist.create_variables({"w": np.ones((3, 2), np.float32), "b": np.zeros(2, np.float32)}, name="lin", optimizer=optax.sgd(0.5))
        counter = jaxdist.create_variable(np.zeros((), np.int64), name="count")
    assert {params["w"].ps_index, params["b"].ps_index} == {0, 1}  # round-robin over both PS

    def step(i: int) -> tuple[int, np.ndarray]:
        p = jaxdist.pull(params)
        grads = jax.tree.map(jnp.ones_like, p)
        jaxdist.apply_gradients(params, grads)
        counter.assign_add(1)
        return i * i, p["b"]

    rvs = [coord.schedule(step, args=(i,)) for i in range(40)]
    coord.join()
    assert coord.done()
    assert [rv.fetch()[0] for rv in rvs] == [i * i for i in range(40)]
    assert all(rv.status is RemoteValueStatus.READY for rv in rvs)
    assert isinstance(rvs[0].fetch()[1], np.ndarray) and isinstance(rvs[0].get()[1], jax.Array)
    assert int(counter.numpy()) == 40
    np.testing.assert_allclose(params["b"].numpy(), np.full(2, -0.5 * 40))
    # fetch() passes non-remote values through
    fetched = coord.fetch({"a": rvs[1], "b": 7})
    assert fetched["b"] == 7 and fetched["a"][0] == 1


def test_closure_error_semantics(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    release = gates.new_name("release")
    go_fail = gates.new_name("go_fail")

    def fail() -> None:
        # Fails only once the 30 closures below are queued: failing earlier, its error would be
        # raised by one of those schedule() calls (correctly, but not what this test checks).
        gates.event(go_fail).wait(30)
        raise UserError("bad closure")

    def held_ok() -> int:
        gates.arrive(release)
        gates.event(release).wait(30)  # keeps running while `fail` fails on the other worker
        return 1

    ok = coord.schedule(held_ok)
    poll_for(lambda: gates.arrivals(release) == 1, 30, what="the first closure to run")
    bad = coord.schedule(fail)
    queued = [coord.schedule(held_ok) for _ in range(30)]
    gates.event(go_fail).set()
    poll_for(bad.done, 30, what="the failing closure")
    assert not ok.done()
    gates.event(release).set()
    with pytest.raises(UserError) as info:
        coord.join()
    assert "Remote traceback (worker:" in "\n".join(getattr(info.value, "__notes__", []))
    assert "raise UserError" in "\n".join(info.value.__notes__)
    # raised once, then cleared
    coord.join()
    assert coord.done()
    for _ in range(2):
        with pytest.raises(UserError):
            bad.fetch()
    assert ok.fetch() == 1  # it was running: it finished
    cancelled = [rv for rv in queued if rv.status is RemoteValueStatus.ABORTED]
    assert cancelled, "queued closures are cancelled after an error"
    with pytest.raises(CancelledError):
        cancelled[0].fetch()
    # schedule works again afterwards
    assert coord.schedule(lambda: 5).fetch() == 5


def test_error_raised_by_next_schedule_and_done(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    rv = coord.schedule(lambda: 1 / 0)
    rv.wait(30)
    with pytest.raises(ZeroDivisionError):
        coord.done()
    assert coord.done()
    rv = coord.schedule(lambda: [].pop())
    rv.wait(30)
    with pytest.raises(IndexError):
        coord.schedule(lambda: 1)
    coord.join()


def test_remote_value_argument_is_rejected(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    rv = coord.schedule(lambda: 1)
    with pytest.raises(ValueError, match="RemoteValue"):
        coord.schedule(lambda x: x, args=(rv,))
    with pytest.raises(ValueError, match="RemoteValue"):
        coord.schedule(lambda x: x, kwargs={"x": [rv]})
    coord.join()


def test_unpicklable_exception_keeps_type_name_and_traceback(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env

    def raise_local() -> None:
        class Local(Exception):
            def __reduce__(self):  # type: ignore[no-untyped-def]
                raise TypeError("not picklable")

        raise Local("inner")

    rv = coord.schedule(raise_local)
    with pytest.raises(ClosureError) as info:
        coord.join()
    assert "Local" in str(info.value) and "raise Local" in info.value.remote_traceback
    with pytest.raises(ClosureError):
        rv.fetch()


def test_unpicklable_argument_fails_only_its_closure(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    lock = threading.Lock()  # cannot be pickled
    rv = coord.schedule(lambda x: x, args=(lock,))
    with pytest.raises(TypeError):
        coord.join()
    with pytest.raises(TypeError):
        rv.fetch()
    assert coord.schedule(lambda: 2).fetch() == 2


def test_per_worker_dataset_input_context_and_end_of_data(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env

    def dataset_fn(ctx: jaxdist.InputContext) -> list[tuple[int, int, int]]:
        assert ctx.num_input_pipelines == 2 and ctx.num_replicas_in_sync == 1
        assert jaxdist.current_worker_index() == ctx.input_pipeline_id
        return [(ctx.input_pipeline_id, i, ctx.num_input_pipelines) for i in range(5)]

    it = iter(coord.create_per_worker_dataset(dataset_fn))
    with pytest.raises(TypeError, match="schedule"):
        next(it)

    def take(iterator) -> tuple[int, int, int, int]:  # type: ignore[no-untyped-def]
        w, i, n = next(iterator)
        return w, i, n, jaxdist.current_worker_index()

    rvs = [coord.schedule(take, args=(it,)) for _ in range(4)]
    coord.join()
    for w, i, n, worker in (rv.fetch() for rv in rvs):
        assert w == worker and n == 2 and 0 <= i < 5
    # Drain: somebody hits the end of its data, an ordinary closure error.
    rvs = [coord.schedule(take, args=(it,)) for _ in range(12)]
    with pytest.raises(OutOfRangeError):
        coord.join()
    assert any(_failed_with(rv, OutOfRangeError) for rv in rvs)


def test_a_dataset_function_that_raises_fails_create_per_worker_dataset(env) -> None:  # type: ignore[no-untyped-def]
    """TF raises a bad dataset function at ``create_per_worker_dataset``; nothing is left pending."""
    strategy, coord = env
    poll_for(lambda: all(w["healthy"] for w in coord.status()), 30, what="both workers configured")

    def bad_fn(ctx: jaxdist.InputContext) -> list[int]:
        raise UserError(f"no data for pipeline {ctx.input_pipeline_id}")

    with pytest.raises(PerWorkerInputError, match="no data for pipeline") as info:
        coord.create_per_worker_dataset(bad_fn)
    assert isinstance(info.value.__cause__, UserError)  # the function's own exception travels with it
    assert info.value.task.startswith("worker:")
    # The failure is not held for a later, unrelated call.
    assert coord.schedule(lambda: 1).fetch() == 1
    coord.join()
    assert coord.done()


def test_a_failed_per_worker_input_fails_only_its_consumers(env) -> None:  # type: ignore[no-untyped-def]
    """A per-worker input that fails on the workers (here its iterator) fails the closures that consume
    it, with the input's error; closures that do not use it, and join, are unaffected (TF's contract)."""
    strategy, coord = env

    class Unreadable:
        def __iter__(self) -> Iterator[int]:
            raise UserError("shard is unreadable")

    it = iter(coord.create_per_worker_dataset(lambda: Unreadable()))
    rvs = [coord.schedule(lambda x: x * 2, args=(i,)) for i in range(10)]
    coord.join()  # the failed iterators are nobody's business yet
    assert [rv.fetch() for rv in rvs] == [2 * i for i in range(10)]
    consumer = coord.schedule(lambda iterator: next(iterator), args=(it,))
    with pytest.raises(PerWorkerInputError, match="shard is unreadable") as info:
        coord.join()
    assert isinstance(info.value.__cause__, UserError)
    with pytest.raises(PerWorkerInputError):
        consumer.fetch()
    assert coord.schedule(lambda: 3).fetch() == 3  # the error was raised once; the job goes on
    coord.join()


def test_per_worker_values_argument(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    pwv = jaxdist.PerWorkerValues(["zero", "one"])
    rvs = [coord.schedule(lambda v: (v, jaxdist.current_worker_index()), args=(pwv,)) for _ in range(8)]
    coord.join()
    for v, w in (rv.fetch() for rv in rvs):
        assert v == ["zero", "one"][w]


def test_functions_ship_once_per_worker(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env

    def f(x: int) -> int:
        return x + 1

    before = [w["functions_shipped"] for w in coord.status()]
    done_before = [w["closures_done"] for w in coord.status()]
    for _ in range(3):
        rvs = [coord.schedule(f, args=(i,)) for i in range(20)]
        coord.join()
        assert [rv.fetch() for rv in rvs] == list(range(1, 21))
    after = coord.status()
    ran = [i for i, w in enumerate(after) if w["closures_done"] > done_before[i]]
    assert ran
    # Each worker that ran f received its payload once; later calls named it by digest only.
    assert all(after[i]["functions_shipped"] == before[i] + 1 for i in ran)


def test_jit_compiles_once_per_worker(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env

    @jax.jit
    def g(x):  # type: ignore[no-untyped-def]
        return x * 2

    def run(x: float) -> int:
        g(jnp.float32(x))
        return g._cache_size()

    rvs = [coord.schedule(run, args=(float(i),)) for i in range(20)]
    coord.join()
    assert max(rv.fetch() for rv in rvs) == 1


def test_strategy_run_of_a_function_defined_in_the_closure_compiles_once(env) -> None:  # type: ignore[no-untyped-def]
    """TF's ``testStrategyRun``, ported literally: ``replica_fn`` is defined inside the scheduled function,
    so every closure makes a new function object; ``run`` keys it by code and captured values and
    compiles it once per worker: here both in-process workers share this process's local strategy, and
    each holds its own unpickled copy of the closure (so of the captured array): two compiles at most."""
    strategy, coord = env
    offset = np.float32(1.0)
    before = coord.schedule(lambda: strategy.trace_count).fetch()

    def worker_fn(x: float) -> tuple[float, int]:
        def replica_fn(v: Any) -> Any:
            return v + offset

        out = strategy.run(replica_fn, args=(jnp.float32(x),))
        return float(strategy.experimental_local_results(out)[0]), strategy.trace_count

    rvs = [coord.schedule(worker_fn, args=(float(i),)) for i in range(40)]
    coord.join()
    results = [rv.fetch() for rv in rvs]
    assert [r[0] for r in results] == [i + 1.0 for i in range(40)]
    assert 1 <= max(r[1] for r in results) - before <= coord.num_workers  # 40 without the code-keyed cache


def test_metrics_under_the_parameter_server_strategy(env) -> None:  # type: ignore[no-untyped-def]
    """TF's PS tutorial: the accuracy metric is made in the strategy's scope, updated in closures and read
    on the coordinator. Its totals live on the PS; the result is exact over every closure's batch."""
    strategy, coord = env
    rng = np.random.default_rng(0)
    batches = [(rng.integers(0, 3, size=8), rng.normal(size=(8, 3)).astype(np.float32)) for _ in range(12)]
    with strategy.scope():
        accuracy = jaxdist.metrics.SparseCategoricalAccuracy()
        loss = jaxdist.metrics.Mean(name="loss")
    assert all(isinstance(v, jaxdist.metrics.PSAccumulator) for v in accuracy.variables)

    def step(labels: np.ndarray, logits: np.ndarray) -> None:
        preds = strategy.run(lambda x: x * 1.0, args=(jnp.asarray(logits),))  # computed on the worker
        logits_local = np.asarray(strategy.experimental_local_results(preds)[0])
        accuracy.update_state(labels, logits_local)
        loss.update_state(np.abs(logits_local).sum(axis=1))

    for labels, logits in batches:
        coord.schedule(step, args=(labels, logits))
    coord.join()
    labels_all = np.concatenate([b[0] for b in batches])
    logits_all = np.concatenate([b[1] for b in batches])
    expected = float(np.mean(np.argmax(logits_all, axis=1) == labels_all))
    assert float(accuracy.result()) == pytest.approx(expected, abs=1e-6)
    assert float(loss.result()) == pytest.approx(float(np.abs(logits_all).sum(axis=1).mean()), rel=1e-5)
    accuracy.reset_state()
    assert float(accuracy.result()) == 0.0
    assert float(coord.schedule(lambda: float(accuracy.result())).fetch()) == 0.0  # readable in closures too

    # TF's tutorial form: update_state inside replica_fn, under the PS strategy's run (compiled on the
    # worker's devices); the replicas' increments are pushed when run returns. The replica_fn made anew
    # in every closure still compiles once per worker (the metric is among its captured values).
    def tutorial_step(labels: np.ndarray, logits: np.ndarray) -> None:
        def replica_fn(y: Any, x: Any) -> Any:
            accuracy.update_state(y, x)
            return jnp.sum(x)

        strategy.run(replica_fn, args=(jnp.asarray(labels), jnp.asarray(logits)))

    before = coord.schedule(lambda: strategy.trace_count).fetch()
    for labels, logits in batches:
        coord.schedule(tutorial_step, args=(labels, logits))
    coord.join()
    assert float(accuracy.result()) == pytest.approx(expected, abs=1e-6)
    # The batch goes to run undistributed, so every replica counts it (as TF): the sum of the replicas'
    # increments arrived, not one replica's.
    replicas = coord.schedule(lambda: strategy.local_num_replicas).fetch()
    assert float(accuracy.count.value()) == len(labels_all) * replicas
    assert coord.schedule(lambda: strategy.trace_count).fetch() - before <= coord.num_workers

    def inside_jit(labels: np.ndarray, logits: np.ndarray) -> None:
        jax.jit(accuracy.update_state)(jnp.asarray(labels), jnp.asarray(logits))

    rv = coord.schedule(inside_jit, args=batches[0])
    with pytest.raises(jaxdist.errors.ConfigurationError, match="compiled"):
        coord.join()
    assert _failed_with(rv, jaxdist.errors.ConfigurationError)


def test_paused_dispatch_is_a_quiet_point(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    release = gates.new_name("release")
    running = coord.schedule(lambda: gates.event(release).wait(30))
    poll_for(lambda: coord.closure_counts.running == 1, 30, what="the closure to run")
    with coord.paused(timeout=0) as quiet:
        assert not quiet  # one is still running
    gates.event(release).set()
    assert coord.dispatching
    with coord.paused() as quiet:
        assert quiet and coord.closure_counts.running == 0 and not coord.dispatching
        queued = coord.schedule(lambda: 3)
        assert coord.closure_counts.queued == 1  # nothing is handed out while paused
    assert queued.fetch(timeout=30) == 3 and running.fetch() is True


def test_steps_per_execution(env) -> None:  # type: ignore[no-untyped-def]
    strategy, coord = env
    with strategy.scope():
        counter = jaxdist.create_variable(np.zeros((), np.int64), name="spe")
    step = jaxdist.steps_per_execution(lambda: counter.assign_add(1) and None, 10)
    for _ in range(7):
        coord.schedule(step)
    coord.join()
    assert int(counter.numpy()) == 70
    with pytest.raises(ValueError):
        jaxdist.steps_per_execution(step, 0)


def test_one_live_coordinator_per_strategy(env) -> None:  # type: ignore[no-untyped-def]
    """TF's contract: ClusterCoordinator(strategy) again returns the strategy's coordinator (it raised
    ValueError); settings other than the live one's are refused, not ignored."""
    strategy, coord = env
    assert strategy.coordinator is coord
    assert jaxdist.ClusterCoordinator(strategy) is coord
    assert jaxdist.ClusterCoordinator(strategy, failure_timeout=coord.failure_timeout) is coord
    assert coord.schedule(lambda: 3).fetch() == 3  # still working after the constructor ran on it again
    with pytest.raises(jaxdist.errors.ConfigurationError, match="failure_timeout=3.0.*failure_timeout=9"):
        jaxdist.ClusterCoordinator(strategy, failure_timeout=9)
    assert strategy.coordinator is coord and coord.failure_timeout == 3.0


# ------------------------------------------------------------------------------ own clusters
@pytest.fixture
def counter_cluster() -> Iterator[tuple[InProcessCluster, jaxdist.ParameterServerStrategy, Any]]:
    with InProcessCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            counter = jaxdist.create_variable(np.zeros((), np.int64), name="c")
        yield cluster, strategy, counter
        strategy.close()


@pytest.fixture
def make_coordinator() -> Iterator[Any]:
    """Coordinators made through it are shut down at teardown, also when the test failed."""
    made: list[jaxdist.ClusterCoordinator] = []

    def make(strategy: jaxdist.ParameterServerStrategy, **kwargs: Any) -> jaxdist.ClusterCoordinator:
        made.append(jaxdist.ClusterCoordinator(strategy, **kwargs))
        return made[-1]

    yield make
    for coord in made:
        coord.shutdown(exit_tasks=False)


def test_restarted_worker_rebuilds_per_worker_dataset(counter_cluster, make_coordinator) -> None:  # type: ignore[no-untyped-def]
    cluster, strategy, _ = counter_cluster
    coord = make_coordinator(strategy, failure_timeout=2.0)

    def dataset_fn(ctx: jaxdist.InputContext):  # type: ignore[no-untyped-def]
        return iter(range(ctx.input_pipeline_id * 1000, ctx.input_pipeline_id * 1000 + 10_000))

    it = iter(coord.create_per_worker_dataset(dataset_fn))
    take = lambda iterator: (next(iterator), jaxdist.current_worker_index())  # noqa: E731
    for _ in range(20):
        coord.schedule(take, args=(it,))
    coord.join()
    cluster.restart_task("worker:0")  # a new, empty process at the same address
    poll_for(lambda: _worker(coord, 0)["healthy"] and _worker(coord, 0)["failures"] >= 1, 20, what="worker:0 back")
    on0: list[int] = []

    def worker0_took_some() -> bool:
        # Which worker takes a closure is the dispatcher's to say: under load worker:1 can drain a
        # whole round before worker:0 is sent one (fresh-clone run, CI mode), so rounds go on until it has.
        rvs = [coord.schedule(take, args=(it,)) for _ in range(40)]
        coord.join()
        on0.extend(v for v, w in (rv.fetch() for rv in rvs) if w == 0)
        return bool(on0)

    poll_for(worker0_took_some, 60, what="the restarted worker:0 to take closures")
    assert all(0 <= v < 1000 + 10_000 for v in on0)
    assert min(on0) == 0  # a rebuilt iterator starts over
    coord.shutdown(exit_tasks=False)


def test_stopped_worker_closures_go_elsewhere_and_updates_apply_once(counter_cluster, make_coordinator) -> None:  # type: ignore[no-untyped-def]
    cluster, strategy, counter = counter_cluster
    coord = make_coordinator(strategy, failure_timeout=2.0)
    gate = gates.new_name("worker1")

    def add_one(i: int) -> int:
        counter.assign_add(1)
        if jaxdist.current_worker_index() == 1:
            gates.arrive(gate)
            gates.event(gate).wait(30)  # worker:1 is stopped with this closure in flight, its push applied
        return i

    n = 60
    rvs = [coord.schedule(add_one, args=(i,)) for i in range(n)]
    poll_for(lambda: gates.arrivals(gate) >= 1, 30, what="a closure in flight on worker:1")
    cluster.stop_task("worker:1")
    poll_for(lambda: not _worker(coord, 1)["healthy"], 10, what="worker:1 declared failed")
    gates.event(gate).set()  # the stopped service's closure threads end; nobody reads their answers
    coord.join()
    assert [rv.fetch() for rv in rvs] == list(range(n))
    assert coord.closure_counts.retried >= 1
    assert _worker(coord, 1)["failures"] == 1 and _worker(coord, 1)["closures_done"] == 0
    assert int(counter.numpy()) == n  # re-run closures repeated their push identities: applied once
    coord.shutdown(exit_tasks=False)


def test_ps_failure_surfaces_as_ps_unavailable() -> None:
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            a = jaxdist.create_variable(np.zeros(3, np.float32), name="a")
            b = jaxdist.create_variable(np.zeros(3, np.float32), name="b")
        with jaxdist.ClusterCoordinator(strategy) as coord:
            assert coord.schedule(lambda: jaxdist.pull([a, b])).fetch()[1].shape == (3,)
            cluster.stop_task(f"ps:{b.ps_index}")
            rv = coord.schedule(lambda: jaxdist.pull([a, b]))
            t = time.monotonic()
            with pytest.raises(jaxdist.PSUnavailableError) as info:
                coord.join()
            assert time.monotonic() - t < 15
            assert info.value.task == f"ps:{b.ps_index}"
            with pytest.raises(jaxdist.PSUnavailableError):
                rv.fetch()
        strategy.close()


# ------------------------------------------------------------------------------ elastic workers
def test_workers_added_and_removed_by_the_script(counter_cluster, make_coordinator) -> None:  # type: ignore[no-untyped-def]
    cluster, strategy, counter = counter_cluster
    coord = make_coordinator(strategy)
    extra = WorkerServer(credentials=cluster.credentials, task_index=2)
    extra.start()
    try:
        it = iter(coord.create_per_worker_dataset(lambda ctx: iter(range(100, 10_000))))

        def step(iterator) -> tuple[int, int]:  # type: ignore[no-untyped-def]
            counter.assign_add(1)
            return jaxdist.current_worker_index(), next(iterator)

        address = extra.server.address
        assert coord.add_worker(address) == 2
        assert coord.add_worker(address) == 2  # already active: same index
        assert coord.active_workers == 3
        poll_for(lambda: _worker(coord, 2)["healthy"], 30, what="worker:2 configured")
        rvs = [coord.schedule(step, args=(it,)) for _ in range(60)]
        coord.join()
        got = [rv.fetch() for rv in rvs]
        assert all(100 <= v < 10_000 for _, v in got)
        # The new worker takes work, from its own dataset (built before anything else ran there).
        more = [coord.schedule(step, args=(it,)) for _ in range(200)]
        poll_for(lambda: _worker(coord, 2)["closures_done"] > 0, 30, what="worker:2 to take work")
        coord.join()
        assert any(w == 2 for w, _ in (rv.fetch() for rv in more))
        coord.remove_worker(0)
        coord.remove_worker(0)  # idempotent
        assert coord.active_workers == 2 and _worker(coord, 0)["left"] and not _worker(coord, 0)["healthy"]
        rvs = [coord.schedule(step, args=(it,)) for _ in range(30)]
        coord.join()
        assert {w for w, _ in (rv.fetch() for rv in rvs)} <= {1, 2}
        # Re-adding a departed address gives it a new index.
        assert coord.add_worker(cluster.address("worker:0")) == 3
        assert coord.num_workers == 4
        assert int(counter.numpy()) == 290
    finally:
        coord.shutdown(exit_tasks=False)
        extra.stop(grace=None)


def test_workers_join_and_leave_through_the_registration_service(counter_cluster, make_coordinator) -> None:  # type: ignore[no-untyped-def]
    cluster, strategy, counter = counter_cluster
    coord = make_coordinator(strategy)
    reg = coord.serve_registration()
    assert coord.serve_registration() == reg  # idempotent
    extra = WorkerServer(credentials=cluster.credentials, task_index=2)
    extra.start()
    try:
        with CoordinatorClient(reg, cluster.credentials) as client:
            assert client.register(extra.server.address) == 2
            assert client.register(extra.server.address) == 2  # again: the same index
            poll_for(lambda: _worker(coord, 2)["healthy"], 30, what="worker:2 joined")
            # Workers configured by a registration-serving coordinator know where to deregister.
            assert extra.servicer.registration == (reg, extra.server.address)
            assert cluster.worker(0).servicer.registration == (reg, cluster.address("worker:0"))
            rvs = [coord.schedule(lambda: (counter.assign_add(1), jaxdist.current_worker_index())[1]) for _ in range(200)]
            poll_for(lambda: _worker(coord, 2)["closures_done"] > 0, 30, what="worker:2 to take work")
            coord.join()
            assert 2 in {rv.fetch() for rv in rvs}
            assert client.deregister(extra.server.address) == 2
            poll_for(lambda: _worker(coord, 2)["left"], 30, what="worker:2 to leave")
            with pytest.raises(jaxdist.errors.ConfigurationError, match="no active worker"):
                client.deregister(extra.server.address)
        rvs = [coord.schedule(lambda: jaxdist.current_worker_index()) for _ in range(20)]
        coord.join()
        assert {rv.fetch() for rv in rvs} <= {0, 1}
        # A wrong token is refused before anything happens.
        with CoordinatorClient(reg, Credentials("wrong")) as intruder:
            with pytest.raises(jaxdist.errors.AuthenticationError):
                intruder.register("127.0.0.1:9")
        assert coord.num_workers == 3
    finally:
        coord.shutdown(exit_tasks=False)
        extra.stop(grace=None)


# ------------------------------------------------------------------------------ PS recovery
def test_ps_restarted_empty_is_restored_from_the_checkpoint(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Checkpoint mode: dispatch is held while ps:1 is away; its new (empty) process is restored from
    the latest checkpoint and training goes on. ps:0 loses nothing."""
    with InProcessCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            c0 = jaxdist.create_variable(np.zeros((), np.int64), name="c0")
            c1 = jaxdist.create_variable(np.full((), 100, np.int64), name="c1")
        assert (c0.ps_index, c1.ps_index) == (0, 1)
        with jaxdist.ClusterCoordinator(strategy) as coord:
            mgr = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy), str(tmp_path))
            mgr.save(0)
            coord.enable_ps_recovery(mgr, poll_interval=0.1)

            def add() -> None:
                c0.assign_add(1)
                c1.assign_add(1)

            first = [coord.schedule(add) for _ in range(30)]
            coord.join()
            assert int(c1.numpy()) == 130
            cluster.stop_task("ps:1")
            poll_for(lambda: not coord.dispatching, 30, what="dispatch held while ps:1 is away")
            more = [coord.schedule(add) for _ in range(30)]  # they wait (or are retried), not failed
            cluster.restart_task("ps:1")
            poll_for(lambda: coord.ps_recoveries == 1, 60, what="ps:1 restored")
            coord.join()
            assert all(rv.status is RemoteValueStatus.READY for rv in first + more)
            assert coord.dispatching
            assert int(c0.numpy()) == 60  # exactly once: the other PS lost nothing
            assert int(c1.numpy()) == 130  # restored to the checkpoint (100), then the 30 later closures
        strategy.close()


def test_primary_stopped_fails_over_to_its_backup() -> None:
    """Replication: with ps:0 gone, closures meeting it are held and retried; its backup is promoted,
    the workers follow it, and ps:0 restarted (empty) is attached as the new backup.

    ps:0 is stopped between pushes: an in-process stop also closes the stopped primary's channel to
    its backup while its handler threads still run, a double failure a real crash cannot produce (the
    SIGKILL version, with pushes in flight, is tests/multiprocess/test_replication.py). One closure is
    running when ps:0 stops and pushes after it (a gate, not a race), so one closure meets the dead
    primary whatever the watcher does first."""
    in_flight = gates.new_name("in_flight")

    def gated() -> None:
        gates.arrive(in_flight)
        gates.event(in_flight).wait(30)  # ps:0 is stopped while this closure runs; its re-run passes
        counter.assign_add(1)

    with InProcessCluster(num_workers=2, num_ps=1, ps_backups=True) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        replicas = strategy.replicas
        assert replicas is not None
        with strategy.scope():
            counter = jaxdist.create_variable(np.zeros((), np.int64), name="c")
        with jaxdist.ClusterCoordinator(strategy) as coord:
            before = [coord.schedule(lambda: counter.assign_add(1) and None) for _ in range(20)]
            coord.join()
            after = [coord.schedule(gated)]
            poll_for(lambda: gates.arrivals(in_flight) >= 1, 30, what="a closure in flight")
            cluster.stop_task("ps:0")
            gates.event(in_flight).set()
            after += [coord.schedule(lambda: counter.assign_add(1) and None) for _ in range(19)]
            poll_for(lambda: replicas.failovers == 1, 30, what="the failover")
            coord.join()
            assert all(rv.status is RemoteValueStatus.READY for rv in before + after)
            assert int(counter.numpy()) == 40
            assert coord.closure_counts.retried >= 1 and coord.dispatching  # the gated closure, at least
            cluster.restart_task("ps:0")
            poll_for(lambda: replicas.status(0)[1], 30, what="ps:0 attached as the new backup")
            assert replicas.pairs[0] == [cluster.address("ps_backup:0"), cluster.address("ps:0")]
            coord.schedule(lambda: counter.assign_add(1) and None).fetch(timeout=30)
            assert int(counter.numpy()) == 41
        # The coordinator told every task to exit and closed the strategy's connections.
        with pytest.raises(jaxdist.errors.ConfigurationError, match="closed"):
            counter.numpy()
