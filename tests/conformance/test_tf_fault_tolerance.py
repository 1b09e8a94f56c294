"""TF's ``fault_tolerance_test.py`` (tensorflow/python/distribute/coordinator), its preemption-mid-function
cases, ported to jaxdist's API: a worker is SIGKILLed while TF's test model runs its closure, then restarted.

TF's model (``Model`` there) loops in its training function while a flag variable on the PS is set,
pushing ``w`` each round, then pushes ``iterations += 1``. A closure re-run after its worker died may
loop fewer (or more) rounds than its first attempt, so its pushes differ from the first attempt's: the
re-run must complete, and no update may be applied twice (``iterations`` ends *exactly* at the number of
closures, where TF asserts ``>=``; TF has no exactly-once updates). See docs/exactly-once.md.

Differences from TF, each for a reason:
- The kills are driven by events (:class:`kill_points.KillPoints`), not by sleeps: the closures hold at
  round ``_HOLD_ROUND`` of their loop (after three pushes of ``w``) until their worker was SIGKILLed and
  declared failed, so every kill lands mid-function, whatever the machine's speed.
- Each round of the loop waits 10 ms (TF's spins), so that looping workers leave the CPU to the
  restarts on a small machine; the rounds a re-run makes still depend on when the flag is cleared.
- The model's random matrices are centred and scaled down so that ``w`` stays finite however many rounds
  the loop runs (TF's grow ``w`` by ~25x a round; it never reads ``w`` back, this port does not either).
- ``test_worker_preemption_midst_function`` also runs with the flag cleared *before* the restart (TF clears
  it after, in ``join_training_functions``): the re-run then loops fewer rounds than the first attempt
  every time, the case that once failed the closure with ``UpdateMismatchError``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
from kill_points import KillPoints

import jaxdist
from jaxdist.errors import VariableNotFoundError
from jaxdist.testing import InProcessCluster, Leftovers, poll_for

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess, pytest.mark.slow]

#: The loop round at which a closure holds for its kill (its first attempt has pushed ``w`` this often).
_HOLD_ROUND = 3


class _RepeatedBatch:
    """TF's ``from_tensors([data]).repeat()`` made on the coordinator: one random batch, repeated."""

    def __init__(self) -> None:
        self.data = np.random.default_rng().uniform(size=(1, 10, 10)).astype(np.float32)

    def __iter__(self) -> Any:
        while True:
            yield self.data


class _Model:
    """TF's ``Model``: ``w`` (10x10), ``iterations`` and the ``do_infinite_step`` flag on the PS, a
    per-worker dataset repeating one random batch, and ``train_fn`` scheduled on it."""

    def __init__(self, coord: jaxdist.ClusterCoordinator, chaos: KillPoints) -> None:
        self.coord = coord
        with coord.strategy.scope():
            self.w = jaxdist.create_variable(np.random.default_rng(0).uniform(size=(10, 10)).astype(np.float32), name="w")
            self.iterations = jaxdist.create_variable(np.zeros((), np.int32), name="iterations")
            # Lets the test make train_fn loop (1) so that a worker can be preempted mid-function.
            self.do_infinite_step = jaxdist.create_variable(np.zeros((), np.int32), name="do_infinite_step")

        def dataset_fn() -> Any:
            data = np.random.default_rng().uniform(size=(1, 10, 10)).astype(np.float32)
            while True:
                yield data

        self.iterator = iter(coord.create_per_worker_dataset(dataset_fn))
        self._dataset_fn = dataset_fn
        w, iterations, flag = self.w, self.iterations, self.do_infinite_step

        def train_fn_internal(iterator: Any) -> None:
            x = np.squeeze(next(iterator)) @ w.numpy()
            x = ((np.random.default_rng().uniform(size=(10, 10)) - 0.5) * 1e-3).astype(np.float32) @ x
            w.assign_add(x)

        def train_fn(iterator: Any) -> None:
            train_fn_internal(iterator)
            rounds = 1
            while int(flag.numpy()):
                time.sleep(0.01)  # paces the loop: spinning workers would starve the restarts on a small machine
                train_fn_internal(iterator)
                rounds += 1
                if rounds == _HOLD_ROUND:
                    for k in range(chaos.count):  # a re-run passes the kill points already used
                        chaos.hold(k)
            iterations.assign_add(np.ones((), np.int32))

        self.train_fn = train_fn

    def rebuild_iterators(self, use_dataset_fn: bool = True) -> None:
        """TF's ``rebuild_iterators``: a new per-worker dataset, from its function or as a dataset object
        (a re-iterable one: jaxdist refuses a one-shot iterator, which a restarted worker could not rebuild)."""
        dataset: Any = self._dataset_fn if use_dataset_fn else _RepeatedBatch()
        self.iterator = iter(self.coord.create_per_worker_dataset(dataset))

    def schedule_training_functions(self, num_steps: int) -> list[jaxdist.RemoteValue]:
        return [self.coord.schedule(self.train_fn, args=(self.iterator,)) for _ in range(num_steps)]

    def join_training_functions(self) -> None:
        self.do_infinite_step.assign(np.zeros((), np.int32))
        self.coord.join()


def _start(cluster: jaxdist.LocalCluster, kills: int) -> tuple[jaxdist.ClusterCoordinator, KillPoints, _Model]:
    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
    coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)
    chaos = KillPoints(strategy, kills)
    return coord, chaos, _Model(coord, chaos)


def _run_indefinitely(model: _Model, num_steps: int) -> list[jaxdist.RemoteValue]:
    """TF's ``_create_model_and_run_indefinitely``: the closures loop until the flag is cleared."""
    model.do_infinite_step.assign(np.ones((), np.int32))
    return model.schedule_training_functions(num_steps)


def _assert_every_closure_counted_once(model: _Model, rvs: list[jaxdist.RemoteValue]) -> None:
    assert [rv.fetch() for rv in rvs] == [None] * len(rvs)
    assert int(model.iterations.numpy()) == len(rvs)  # TF: >= (a re-run's push may apply twice there)
    assert np.isfinite(model.w.numpy()).all()


@pytest.mark.parametrize("num_workers,num_ps", [(1, 1), (2, 2)], ids=["single_worker", "multi_worker"])
@pytest.mark.parametrize("flag_cleared", ["after_restart", "before_restart"])
def test_worker_preemption_midst_function(num_workers: int, num_ps: int, flag_cleared: str) -> None:
    """Ports ``testWorkerPreemptionMidstFunction`` (Single- and MultiWorkerFaultToleranceTest)."""
    with jaxdist.LocalCluster(num_workers=num_workers, num_ps=num_ps) as cluster:
        coord, chaos, model = _start(cluster, kills=1)
        rvs = _run_indefinitely(model, 4)
        victim = chaos.kill(cluster, coord)  # a worker holding a closure that pushed w three times
        assert not coord.done()
        if flag_cleared == "before_restart":
            # The re-run loops once (fewer rounds than its first attempt), then pushes iterations.
            model.do_infinite_step.assign(np.zeros((), np.int32))
        cluster.restart(f"worker:{victim}")
        model.join_training_functions()
        _assert_every_closure_counted_once(model, rvs)
        assert coord.closure_counts.retried >= 1
        coord.shutdown()


def test_two_workers_preempted() -> None:
    """Ports ``testTwoWorkersPreempted`` (MultiWorkerFaultToleranceTest; TF skips it with one worker):
    both workers killed mid-function, then both restarted."""
    with jaxdist.LocalCluster(num_workers=2, num_ps=2) as cluster:
        coord, chaos, model = _start(cluster, kills=2)
        rvs = _run_indefinitely(model, 10)
        assert not coord.done()
        victims = [chaos.kill(cluster, coord), chaos.kill(cluster, coord)]
        assert sorted(victims) == [0, 1]  # the second kill's closure can only be on the living worker
        for victim in victims:
            cluster.restart(f"worker:{victim}")
        model.join_training_functions()
        _assert_every_closure_counted_once(model, rvs)
        assert coord.closure_counts.retried >= 2
        coord.shutdown()


@pytest.mark.parametrize("num_workers,num_ps", [(1, 1), (2, 2)], ids=["single_worker", "multi_worker"])
def test_worker_continuous_failure(num_workers: int, num_ps: int) -> None:
    """Ports ``testWorkerContinuousFailure``: a worker killed mid-function and restarted, twice (the
    second kill lands on a closure that is a re-run when one worker runs everything)."""
    with jaxdist.LocalCluster(num_workers=num_workers, num_ps=num_ps) as cluster:
        coord, chaos, model = _start(cluster, kills=2)
        rvs = _run_indefinitely(model, 10)
        assert not coord.done()
        chaos.run(cluster, coord)  # kill, restart, kill, restart
        model.join_training_functions()
        _assert_every_closure_counted_once(model, rvs)
        assert coord.closure_counts.retried >= 2
        coord.shutdown()


def _declared_failed(coord: jaxdist.ClusterCoordinator, index: int, failures_before: int) -> None:
    """Wait until the coordinator has declared worker ``index`` failed (TF: ``check_alive`` is False)."""
    poll_for(lambda: coord.status()[index]["failures"] > failures_before, 60, what=f"worker:{index} declared failed")


def _kill(cluster: jaxdist.LocalCluster, coord: jaxdist.ClusterCoordinator, index: int = 0) -> None:
    before = coord.status()[index]["failures"]
    cluster.kill(f"worker:{index}")
    _declared_failed(coord, index, before)


@pytest.mark.parametrize("num_workers,num_ps", [(1, 1), (2, 2)], ids=["single_worker", "multi_worker"])
def test_worker_preemption_between_functions(num_workers: int, num_ps: int) -> None:
    """Ports ``testWorkerPreemptionBetweenFunctions``: worker 0 killed and restarted between two rounds
    of closures; every closure counts once (TF asserts ``== 2`` then ``== 4`` too)."""
    with jaxdist.LocalCluster(num_workers=num_workers, num_ps=num_ps) as cluster:
        coord, _, model = _start(cluster, kills=0)
        model.schedule_training_functions(2)
        model.join_training_functions()
        assert int(model.iterations.numpy()) == 2
        _kill(cluster, coord)
        cluster.restart("worker:0")
        model.schedule_training_functions(2)
        model.join_training_functions()
        assert int(model.iterations.numpy()) == 4
        coord.shutdown()


@pytest.mark.parametrize("use_dataset_fn", [True, False], ids=["dataset_fn", "dataset"])
def test_handle_dataset_creation_failure(use_dataset_fn: bool) -> None:
    """Ports ``testHandleDatasetCreationFailureWithDatasetFn`` and ``...WithDataset``: per-worker
    datasets are made again (``rebuild_iterators``) while the only worker is down; its restart builds
    them and runs every closure. TF restarts the worker from a thread after 5 s and asserts ``>= 3``;
    here the worker is down (declared failed) before the first schedule, and every one of the 9
    closures counts exactly once."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        coord, _, model = _start(cluster, kills=0)
        _kill(cluster, coord)
        model.schedule_training_functions(3)
        model.rebuild_iterators(use_dataset_fn)
        model.schedule_training_functions(3)
        model.rebuild_iterators(use_dataset_fn)
        model.schedule_training_functions(3)
        cluster.restart("worker:0")
        model.join_training_functions()
        assert int(model.iterations.numpy()) == 9
        coord.shutdown()


def test_numpy_fetched_after_worker_failure() -> None:
    """Ports ``testNumpyFetchedAfterWorkerFailure`` (single worker; TF's multi-worker case is the same):
    a value fetched before the worker is killed is fetched again after."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        coord, _, _model = _start(cluster, kills=0)
        with coord.strategy.scope():
            v = jaxdist.create_variable(np.zeros((), np.int32), name="v")

        def worker_fn() -> tuple[int, int]:
            value = int(v.numpy())
            return value + 1, value - 1

        remote_value = coord.schedule(worker_fn)
        assert remote_value.fetch() == (1, -1)
        _kill(cluster, coord)
        assert remote_value.fetch() == (1, -1)
        coord.shutdown()


def test_fetch_from_ps_after_worker_failure() -> None:
    """Ports ``testFetchFromPSAfterWorkerFailure``: the PS's variables are read while a worker runs a
    closure, while it is down and after it restarted (TF polls on a timer around a delayed kill; here
    each phase is waited for), and the closure, re-run, counts once."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        coord, chaos, model = _start(cluster, kills=1)
        rvs = _run_indefinitely(model, 1)
        reads = [int(model.iterations.numpy())]
        victim = chaos.kill(cluster, coord)  # the closure is mid-function when its worker dies
        reads += [int(model.iterations.numpy()) for _ in range(20)]  # the worker is down
        cluster.restart(f"worker:{victim}")
        poll_for(lambda: coord.status()[victim]["healthy"], 60, what="the restarted worker back")
        reads += [int(model.iterations.numpy()) for _ in range(5)]
        assert set(reads) <= {0}  # the looping closure has not counted itself yet
        model.join_training_functions()
        _assert_every_closure_counted_once(model, rvs)
        coord.shutdown()


@pytest.mark.parametrize("call", ["join", "schedule"])
def test_raises_unavailable_error_at_ps_failure(call: str) -> None:
    """Ports ``testJoinRaisesUnavailableErrorAtPsFailure`` and ``testScheduleRaisesUnavailableErrorAtPsFailure``:
    PS 0 killed while closures loop on its variables; ``join`` (or a later ``schedule``) raises TF's
    ``UnavailableError``, jaxdist's ``PSUnavailableError``."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        coord, _, model = _start(cluster, kills=0)
        _run_indefinitely(model, 10)
        assert not coord.done()  # the closures loop until the flag is cleared
        cluster.kill("ps:0")
        try:
            with pytest.raises(jaxdist.PSUnavailableError):
                if call == "join":
                    coord.join()
                else:
                    while True:
                        coord.schedule(lambda: None).wait(0.05)
        finally:
            coord.shutdown(exit_tasks=False)
            coord.strategy.close()


def test_ps_failure_while_recovery_from_worker_failure() -> None:
    """Ports ``testPSFailureWhileRecoveryFromWokerFailure``: the worker and the PS killed together and
    restarted (the PS empty: no checkpoint to restore from); joining raises (TF's ``UnavailableError``,
    jaxdist's ``PSUnavailableError`` or ``VariableNotFoundError``) instead of training on a PS that lost
    its variables."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        coord, _, model = _start(cluster, kills=0)
        _run_indefinitely(model, 10)
        errors: list[BaseException] = []

        def kill(task: str) -> None:
            try:
                cluster.kill(task)
                cluster.restart(task)
            except BaseException as e:  # noqa: BLE001 - reported to the test thread below
                errors.append(e)

        threads = [threading.Thread(target=kill, args=(task,)) for task in ("worker:0", "ps:0")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        try:
            assert not errors
            # TF: UnavailableError or InvalidArgumentError. Here: the PS unreachable, or back without the
            # variables (VariableNotFoundError), whichever the coordinator meets first.
            with pytest.raises((jaxdist.PSUnavailableError, VariableNotFoundError)):
                model.join_training_functions()
        finally:
            coord.shutdown(exit_tasks=False)
            coord.strategy.close()


def test_cluster_coordinator_destroyed() -> None:
    """Ports ``testClusterCoordinatorDestroyed``: the coordinator's dispatch thread (TF: its worker
    closure-processing threads) runs while it lives and is gone once it is shut down. In-process: no
    process is killed here."""
    with InProcessCluster(num_workers=2, num_ps=1) as cluster:
        before = Leftovers.now()
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coord = jaxdist.ClusterCoordinator(strategy)
        assert coord.schedule(lambda: 1).fetch() == 1
        dispatch = [t for t in Leftovers.now().new_since(before).threads if t.name == "jaxdist-dispatch"]
        assert dispatch, "the coordinator dispatches from its own thread while it lives"
        coord.shutdown(exit_tasks=False)
        strategy.close()
        poll_for(lambda: not any(t.is_alive() for t in dispatch), 30, what="the dispatch thread gone")


class InvalidArgumentError(Exception):
    """Stands for TF's ``errors.InvalidArgumentError`` (what its ``assert_non_positive`` raises)."""


def test_one_worker_preemption_with_cancellation() -> None:
    """Ports ``testOneWorkerPreemptionWithCancellation`` (multi worker): a long closure runs on one
    worker while an error function fails on the other; then the long closure's worker is killed.
    ``join`` raises the error, and the long closure is cancelled (TF: ``CancelledError``): jaxdist lets a
    running closure finish, but one whose worker dies while an error is pending is not re-run. After
    the restart, scheduling works again. TF's long function is 10,000 matrix products and its kill
    comes after a sleep; here the long closure loops until its worker is killed, and each step waits
    for the one before."""
    with jaxdist.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0, closures_per_rpc=1)
        with strategy.scope():
            started = jaxdist.create_variable(np.zeros((), np.int64), name="long_started")
            keep_going = jaxdist.create_variable(np.ones((), np.int64), name="long_keep_going")

        def normal_function() -> float:
            x = np.random.default_rng().uniform(size=(2, 10))
            y = np.random.default_rng().uniform(size=(10, 2))
            return float(np.mean(x @ y))

        def error_function() -> None:
            x = np.random.default_rng().uniform(size=(2, 10))
            y = np.random.default_rng().uniform(size=(10, 2))
            if np.sum(x @ y) > 0:  # TF: check_ops.assert_non_positive
                raise InvalidArgumentError("assert_non_positive failed")

        def long_function() -> int:
            started.assign(np.asarray(jaxdist.current_worker_index() + 1, np.int64))
            while int(keep_going.numpy()):
                time.sleep(0.01)
            return 1

        try:
            for _ in range(3):
                coord.schedule(normal_function)
            long_function_result = coord.schedule(long_function)
            poll_for(lambda: int(started.numpy()) > 0, 60, what="the long closure to start")
            victim = int(started.numpy()) - 1
            failed = coord.schedule(error_function)  # runs on the other worker: the victim is busy
            poll_for(failed.done, 60, what="the error function to fail")
            _kill(cluster, coord, victim)
            with pytest.raises(InvalidArgumentError):
                coord.join()
            with pytest.raises(jaxdist.CancelledError):
                long_function_result.fetch()
            keep_going.assign(np.zeros((), np.int64))
            cluster.restart(f"worker:{victim}")
            rvs = [coord.schedule(normal_function) for _ in range(3)]
            coord.join()
            assert all(isinstance(rv.fetch(), float) for rv in rvs)
        finally:
            coord.shutdown(exit_tasks=False)
            strategy.close()
