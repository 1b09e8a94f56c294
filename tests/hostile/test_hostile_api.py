"""Hostile use of the public Python API (``import jaxdist``) on real LocalClusters: exactly-once has
no side doors (helper threads, steps_per_execution + exactly-once data), CheckpointManager.save
during PS recovery, LocalCluster(log_dir=...) creating its folder.

Deterministic: worker and PS kills happen at points the test waits for, never by chance.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from conftest import poll_for
from kill_points import KillPoints

import jaxdist
from jaxdist.errors import ConfigurationError, JaxdistError, OutOfRangeError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

MakeStrategy = Callable[[jaxdist.LocalCluster], jaxdist.ParameterServerStrategy]


@pytest.fixture
def make_strategy() -> Iterator[MakeStrategy]:
    """Makes a cluster's ParameterServerStrategy; shuts its coordinator down and closes it after the test."""
    made: list[jaxdist.ParameterServerStrategy] = []

    def make(cluster: jaxdist.LocalCluster) -> jaxdist.ParameterServerStrategy:
        made.append(jaxdist.ParameterServerStrategy(cluster.cluster_resolver()))
        return made[-1]

    yield make
    for strategy in made:
        if strategy.coordinator is not None:
            strategy.coordinator.shutdown(exit_tasks=False)
        strategy.close()


# ------------------------------------------------------------------------------ exactly-once side doors
def _start_helper(kind: str, fn: Any) -> None:
    """Run ``fn`` in a thread the closure starts, and wait for it."""
    if kind == "thread":
        t = threading.Thread(target=fn, name="closure-helper")
        t.start()
        t.join()
    else:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            pool.submit(fn).result()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["thread", "executor"])
def test_pushes_from_a_closures_helper_thread_are_applied_exactly_once(kind: str, make_strategy: MakeStrategy) -> None:
    """Pushes made from a thread that a closure starts must carry an identity too: when it was
    thread-local they carried none, so a closure re-run after its worker died applied them twice
    (under SIGKILL chaos 1,000 closures ended at 1,028-1,058). Here one closure pushes +1 from a helper thread
    and +1 from its own thread, then waits; its worker is SIGKILLed while it waits and the closure
    runs again on the other worker. Both counters must end at exactly 1 (or the helper's push is
    refused with an error and its counter stays 0)."""
    with jaxdist.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = make_strategy(cluster)
        with strategy.scope():
            helper_count = jaxdist.create_variable(np.zeros((), np.int64), name="helper_count")
            own_count = jaxdist.create_variable(np.zeros((), np.int64), name="own_count")
            first_worker = jaxdist.create_variable(np.zeros((), np.int64), name="first_worker")  # 1 + index
            release = jaxdist.create_variable(np.zeros((), np.int64), name="release")
        coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)

        def step() -> str:
            outcome: list[BaseException | None] = []

            def helper() -> None:
                try:
                    helper_count.assign_add(np.ones((), np.int64))
                    outcome.append(None)
                except Exception as e:  # noqa: BLE001 - a refusal is an allowed answer; reported below
                    outcome.append(e)

            _start_helper(kind, helper)
            own_count.assign_add(np.ones((), np.int64))
            first_worker.assign(np.asarray(jaxdist.current_worker_index() + 1, np.int64))
            while int(release.numpy()) == 0:  # the first attempt waits here until its worker is killed
                time.sleep(0.05)
            if outcome[0] is not None:
                raise outcome[0]
            return "pushed"

        rv = coord.schedule(step)
        poll_for(lambda: int(first_worker.numpy()) != 0, 120, what="the closure's first attempt to push")
        victim = int(first_worker.numpy()) - 1
        cluster.kill(f"worker:{victim}")
        release.assign(np.ones((), np.int64))
        try:
            rv.fetch()
            refused = None
        except Exception as e:  # noqa: BLE001
            refused = e
        helper, own = int(helper_count.numpy()), int(own_count.numpy())
        coord.shutdown(exit_tasks=False)
        assert own == 1, f"the closure's own push landed {own} times"
        if refused is None:
            assert helper == 1, f"a push from the closure's helper {kind} landed {helper} times after one re-run (exactly once: 1)"
        else:
            assert helper == 0, f"the helper's push was refused ({refused!r}) but landed {helper} times"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_helper_thread_pushes_are_exact_under_sigkill_chaos(make_strategy: MakeStrategy) -> None:
    """Closures each push +1 from a ``threading.Thread``, +1 from a ``ThreadPoolExecutor`` call and +1
    from their own thread while workers are SIGKILLed and restarted: every counter ends at exactly the
    number of closures. Three kills, driven by events (:mod:`kill_points`), whatever the machine's
    speed: each lands on a closure held at another point of its body (after the helper thread's push,
    after the executor's, after all three), so each re-run repeats a different set of pushes."""
    with jaxdist.LocalCluster(num_workers=3, num_ps=1) as cluster:
        strategy = make_strategy(cluster)
        with strategy.scope():
            counts = [jaxdist.create_variable(np.zeros((), np.int64), name=f"count_{k}") for k in ("thread", "executor", "own")]
        chaos = KillPoints(strategy, 3)
        coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)
        one = np.ones((), np.int64)
        n = 600
        # closure index -> its kill point; kill point k holds after the first k + 1 of the three pushes
        kill_at = {(k + 1) * n // 4: k for k in range(3)}

        def add_one(i: int) -> int:
            k = kill_at.get(i)
            _start_helper("thread", lambda: counts[0].assign_add(one))
            if k == 0:
                chaos.hold(k)
            _start_helper("executor", lambda: counts[1].assign_add(one))
            if k == 1:
                chaos.hold(k)
            counts[2].assign_add(one)
            if k == 2:
                chaos.hold(k)
            return i

        rvs = [coord.schedule(add_one, args=(i,)) for i in range(n)]
        chaos.run(cluster, coord)
        coord.join()
        got, retried = [int(c.numpy()) for c in counts], coord.closure_counts.retried
        coord.shutdown(exit_tasks=False)
        assert retried >= chaos.count, f"{retried} closures re-run after {chaos.count} kills, each of a worker holding one"
        assert sorted(rv.fetch() for rv in rvs) == list(range(n))
        assert got == [n, n, n], f"thread, executor and own-thread counters after {n} closures and kills of workers {chaos.victims}: {got}"


@pytest.mark.slow
def test_a_rerun_that_takes_another_path_completes_and_applies_nothing_twice(make_strategy: MakeStrategy) -> None:
    """A re-run that takes another path (here: which variable it pushes first depends on the worker)
    completes. A push's identity follows what it names: the re-run's push of another variable is a new
    update (applied once), its push of the same variable with the same op as the first attempt's is that
    update again (dropped: nothing is applied twice). It once failed the closure with UpdateMismatchError
    (identities were positions among all the closure's pushes)."""
    with jaxdist.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = make_strategy(cluster)
        with strategy.scope():
            per_worker = [jaxdist.create_variable(np.zeros((), np.int64), name=f"w{i}") for i in range(2)]
            first_worker = jaxdist.create_variable(np.zeros((), np.int64), name="first_worker")  # 1 + index
            release = jaxdist.create_variable(np.zeros((), np.int64), name="release")
            finished = jaxdist.create_variable(np.zeros((), np.int64), name="finished")
        coord = jaxdist.ClusterCoordinator(strategy, failure_timeout=2.0)

        def step() -> int:
            w = jaxdist.current_worker_index()
            per_worker[w].assign_add(np.ones((), np.int64))  # push 1: its variable depends on the path taken
            first_worker.assign(np.asarray(w + 1, np.int64))
            while int(release.numpy()) == 0:
                time.sleep(0.05)
            finished.assign_add(np.ones((), np.int64))
            return w

        rv = coord.schedule(step)
        poll_for(lambda: int(first_worker.numpy()) != 0, 120, what="the closure's first attempt to push")
        victim = int(first_worker.numpy()) - 1
        cluster.kill(f"worker:{victim}")
        release.assign(np.ones((), np.int64))
        assert rv.fetch() == 1 - victim  # the re-run, on the other worker
        values = [int(v.numpy()) for v in per_worker]
        got_first, got_finished = int(first_worker.numpy()), int(finished.numpy())
        retried = coord.closure_counts.retried
        coord.shutdown(exit_tasks=False)
        assert retried >= 1
        # Each attempt's own variable once; the re-run's first_worker push was the first attempt's update.
        assert values == [1, 1] and got_first == victim + 1 and got_finished == 1, (values, got_first, got_finished)


@pytest.mark.slow
def test_steps_per_execution_with_an_exactly_once_iterator_trains_every_batch_once(make_strategy: MakeStrategy) -> None:
    """``steps_per_execution(fn, k)`` with an ``exactly_once=True`` iterator. It once failed: the second
    inner ``next()`` raised ``OutOfRangeError: end of data`` while ``ledger.completed`` was 0; the
    first step's push had landed and its batch went back to the ledger, so a retry trained it twice.
    Either k batches per closure work (every batch trained exactly once), or the combination is
    refused before anything is applied."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = make_strategy(cluster)
        with strategy.scope():
            seen = jaxdist.create_variable(np.zeros(8, np.int64), name="seen")
        coord = jaxdist.ClusterCoordinator(strategy)

        def dataset_fn(ctx: jaxdist.InputContext) -> list[np.ndarray]:
            ids = np.arange(8, dtype=np.int64)
            return [ids[i : i + 2] for i in range(0, 8, 2)]  # 4 batches of 2 example ids

        ds = coord.create_per_worker_dataset(dataset_fn, exactly_once=True, num_batches=4)
        it = iter(ds)

        def train(iterator: Any) -> None:
            ids = next(iterator)
            seen.scatter_add(ids, np.ones(len(ids), np.int64))

        error = None
        try:
            for _ in range(2):  # 2 closures x 2 steps = the 4 batches
                coord.schedule(jaxdist.steps_per_execution(train, 2), args=(it,))
            coord.join()
        except Exception as e:  # noqa: BLE001 - what happened is asserted below
            error = e
        trained, completed = seen.numpy().copy(), ds.ledger.completed
        replay = None
        if isinstance(error, OutOfRangeError):  # show what a retry of the returned batches does
            for _ in range(4 - completed):
                coord.schedule(train, args=(it,))
            try:
                coord.join()
            except OutOfRangeError:
                pass
            replay = seen.numpy().tolist()
        coord.shutdown(exit_tasks=False)
        if error is None:
            assert trained.tolist() == [1] * 8 and completed == 4, f"trained {trained.tolist()}, ledger completed {completed}"
        else:
            assert not isinstance(error, OutOfRangeError), (
                f"the data is not over, yet steps_per_execution(train, 2) got {error!r}; ledger.completed={completed}, "
                f"rows trained so far {trained.tolist()}; training the returned batches then gives {replay}")
            assert not trained.any(), f"refused ({error!r}) only after a step was applied: {trained.tolist()}"


# ------------------------------------------------------------------------------ checkpoints and logs
def _get_status_calls(cluster: jaxdist.LocalCluster, task: str) -> float:
    """GetStatus calls the task served so far (its Prometheus endpoint; LocalCluster turns metrics on)."""
    with urllib.request.urlopen(f"http://{cluster.metrics_address(task)}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jaxdist_rpc_server_latency_seconds_count") and "GetStatus" in line)


@pytest.mark.slow
def test_checkpoint_save_during_ps_recovery_is_retryable_or_waits(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, make_strategy: MakeStrategy
) -> None:
    """``CheckpointManager.save`` during PS recovery raises a retryable, typed error (not a
    configuration error), or waits for the recovery and saves the restored values. It once raised
    ConfigurationError ("variable missing on ps:1; was the PS restarted empty?") for a temporary state.

    The recovery is held (10 s at most) where it is about to restore the restarted PS, so the save
    runs while the coordinator knows the PS came back empty and is restoring it."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = make_strategy(cluster)
        with strategy.scope():
            a = jaxdist.create_variable(np.full(3, 1.0, np.float32), name="a")
            b = jaxdist.create_variable(np.full(3, 2.0, np.float32), name="b")
        assert a.ps_index != b.ps_index
        coord = jaxdist.ClusterCoordinator(strategy)
        manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy), str(tmp_path / "ckpt"))
        manager.save(0)

        restoring, hold = threading.Event(), threading.Event()
        original = jaxdist.Checkpoint.restore

        def held_restore(self: Any, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("ps_tasks"):  # the recovery of a restarted PS
                restoring.set()
                hold.wait(10)
            return original(self, *args, **kwargs)

        monkeypatch.setattr(jaxdist.Checkpoint, "restore", held_restore)
        victim = f"ps:{b.ps_index}"
        polls = _get_status_calls(cluster, victim)
        coord.enable_ps_recovery(manager, poll_interval=0.2)
        # The watcher knows the PS's incarnation once it polled it twice (a PS killed before that is
        # never seen to restart: a separate race, not this item's).
        poll_for(lambda: _get_status_calls(cluster, victim) >= polls + 2, 60, what="the PS watcher to poll the PS")
        cluster.kill(victim)
        cluster.restart(victim)
        poll_for(restoring.is_set, 60, what="the coordinator to start recovering the restarted PS")
        try:
            path = manager.save(1)
            error = None
        except Exception as e:  # noqa: BLE001 - asserted below
            path, error = None, e
        finally:
            hold.set()
        poll_for(lambda: coord.ps_recoveries >= 1, 60, what="the recovery to finish")
        again = manager.save(2)  # once recovered, a save works
        coord.shutdown(exit_tasks=False)
        assert error is None or not isinstance(error, ConfigurationError), (
            f"save during PS recovery raised a configuration error for a temporary state: {error!r}")
        assert error is None or isinstance(error, JaxdistError), f"save during PS recovery raised an untyped {error!r}"
        if path is not None:
            saved = jaxdist.checkpoint.load(path)["variables"]
            assert np.array_equal(saved["b"], np.full(3, 2.0, np.float32)) and np.array_equal(saved["a"], np.full(3, 1.0, np.float32))
        assert np.array_equal(jaxdist.checkpoint.load(again)["variables"]["b"], np.full(3, 2.0, np.float32))


@pytest.mark.slow
def test_checkpoint_save_of_a_ps_restarted_empty_without_recovery_is_a_retryable_error(tmp_path: Any, make_strategy: MakeStrategy) -> None:
    """Without PS recovery: nothing will restore the PS, so the save fails, with
    PSUnavailableError (UNAVAILABLE: retry once the PS is restored), not a ConfigurationError; and
    nothing is left in the checkpoint directory."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = make_strategy(cluster)
        with strategy.scope():
            jaxdist.create_variable(np.full(3, 1.0, np.float32), name="a")
        coord = jaxdist.ClusterCoordinator(strategy)
        manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy), str(tmp_path / "ckpt"))
        cluster.kill("ps:0")
        cluster.restart("ps:0")
        with pytest.raises(jaxdist.errors.PSUnavailableError) as e:
            manager.save(1)
        coord.shutdown(exit_tasks=False)
        assert not isinstance(e.value, ConfigurationError) and e.value.code.name == "UNAVAILABLE"
        assert os.listdir(tmp_path / "ckpt") == [] and manager.latest_checkpoint is None


def test_local_cluster_creates_a_missing_log_dir(tmp_path: Any) -> None:
    """``LocalCluster(log_dir=...)`` creates a missing folder (it once did not)."""
    log_dir = tmp_path / "not" / "yet"
    with jaxdist.LocalCluster(num_workers=1, num_ps=1, log_dir=str(log_dir)) as cluster:
        assert cluster.is_running("ps:0") and cluster.is_running("worker:0")
        assert {"ps-0.log", "worker-0.log"} <= set(os.listdir(log_dir))
