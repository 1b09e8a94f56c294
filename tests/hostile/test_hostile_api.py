"""Issue 19, items 8 and 9 through the public Python API (``import jaxdist``) on real LocalClusters:
exactly-once has no side doors (helper threads, steps_per_execution + exactly-once data),
CheckpointManager.save during PS recovery, LocalCluster(log_dir=...) creating its folder.

Deterministic: worker and PS kills happen at points the test waits for, never by chance.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import pytest
from conftest import poll_for

import jaxdist
from jaxdist.errors import ConfigurationError, JaxdistError, OutOfRangeError

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]


# ------------------------------------------------------------------------------ item 8
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
def test_pushes_from_a_closures_helper_thread_are_applied_exactly_once(kind: str) -> None:
    """Item 8: pushes made from a thread that a closure starts carry no identity (it is
    thread-local), so a closure re-run after its worker died applies them twice (under SIGKILL
    chaos 1,000 closures ended at 1,028-1,058). Here one closure pushes +1 from a helper thread
    and +1 from its own thread, then waits; its worker is SIGKILLed while it waits and the closure
    runs again on the other worker. Both counters must end at exactly 1 (or the helper's push is
    refused with an error and its counter stays 0)."""
    with jaxdist.LocalCluster(num_workers=2, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
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
def test_steps_per_execution_with_an_exactly_once_iterator_trains_every_batch_once() -> None:
    """Item 8: ``steps_per_execution(fn, k)`` with an ``exactly_once=True`` iterator: the second inner
    ``next()`` raises ``OutOfRangeError: end of data`` while ``ledger.completed`` is 0; the first
    step's push has landed and its batch goes back to the ledger, so a retry trains it twice.
    Either k batches per closure work (every batch trained exactly once), or the combination is
    refused before anything is applied."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
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


# ------------------------------------------------------------------------------ item 9
def _get_status_calls(cluster: jaxdist.LocalCluster, task: str) -> float:
    """GetStatus calls the task served so far (its Prometheus endpoint; LocalCluster turns metrics on)."""
    with urllib.request.urlopen(f"http://{cluster.metrics_address(task)}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("jaxdist_rpc_server_latency_seconds_count") and "GetStatus" in line)


@pytest.mark.slow
def test_checkpoint_save_during_ps_recovery_is_retryable_or_waits(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 9: ``CheckpointManager.save`` during PS recovery raises ConfigurationError ("variable
    missing on ps:1; was the PS restarted empty?") for a temporary state. It must raise a
    retryable, typed error (not a configuration error), or wait for the recovery and save the
    restored values.

    The recovery is held (10 s at most) where it is about to restore the restarted PS, so the save
    runs while the coordinator knows the PS came back empty and is restoring it."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
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


def test_local_cluster_creates_a_missing_log_dir(tmp_path: Any) -> None:
    """Item 9: ``LocalCluster(log_dir=...)`` does not create a missing folder."""
    log_dir = tmp_path / "not" / "yet"
    with jaxdist.LocalCluster(num_workers=1, num_ps=1, log_dir=str(log_dir)) as cluster:
        assert cluster.is_running("ps:0") and cluster.is_running("worker:0")
        assert {"ps-0.log", "worker-0.log"} <= set(os.listdir(log_dir))
