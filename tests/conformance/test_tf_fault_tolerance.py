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

import time
from typing import Any

import numpy as np
import pytest
from kill_points import KillPoints

import jaxdist

pytestmark = [pytest.mark.timeout(300), pytest.mark.multiprocess, pytest.mark.slow]

#: The loop round at which a closure holds for its kill (its first attempt has pushed ``w`` this often).
_HOLD_ROUND = 3


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
