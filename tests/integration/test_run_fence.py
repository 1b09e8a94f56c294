"""A closure of an earlier coordinator run, on a worker that outlived its coordinator, must not push
onto what a re-run coordinator restored (issue 29), driven by events on one in-process cluster whose
tasks outlive the coordinator script.

Run 1 trains, saves, then schedules closure X, which waits before its push; run 1's coordinator dies
(X keeps running on its worker). Run 2 (a new coordinator of the same cluster) restores the checkpoint
and X is let go. Before the fence, X's push landed on the restored variables while the restored
ledger hands X's batch out again: that batch was trained twice. Now every coordinator begins its run on
every PS task, and the PS refuses X's push (``StaleRunError``) and changes nothing.
"""

from __future__ import annotations

import numpy as np
import pytest

import jaxdist
from jaxdist import checkpoint as ckpt
from jaxdist.errors import StaleRunError
from jaxdist.ps_server.run_fence import RunFence, run_of
from jaxdist.testing import InProcessCluster, poll_for

import inprocess_gates as gates

pytestmark = [pytest.mark.timeout(180)]

EXAMPLES = 12
BATCH = 3
NUM_BATCHES = EXAMPLES // BATCH


def _dataset(ctx):  # type: ignore[no-untyped-def]
    ids = np.arange(EXAMPLES, dtype=np.int64)
    return [ids[i : i + BATCH] for i in range(0, EXAMPLES, BATCH)]


def _counts(batch: np.ndarray) -> np.ndarray:
    return np.bincount(batch, minlength=EXAMPLES).astype(np.int64)


def _train_fn(seen):  # type: ignore[no-untyped-def]
    def train(it):  # type: ignore[no-untyped-def]
        seen.assign_add(_counts(next(it)))

    return train


def test_a_closure_of_an_earlier_run_cannot_push_after_a_restart(tmp_path) -> None:  # type: ignore[no-untyped-def]
    directory = str(tmp_path / "ckpts")
    gate = gates.new_name("x")

    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        # ---- run 1: two batches trained and saved; closure X holds the third, its push not made yet
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            seen = jaxdist.create_variable(np.zeros(EXAMPLES, np.int64), name="seen")
        coord = jaxdist.ClusterCoordinator(strategy, closures_per_rpc=1)
        ds = coord.create_per_worker_dataset(_dataset, exactly_once=True, num_batches=NUM_BATCHES, epochs=1)
        it = iter(ds)
        manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy, coord, ledger=ds.ledger), directory)
        assert manager.restore_or_initialize() is None
        train = _train_fn(seen)
        for _ in range(2):
            coord.schedule(train, args=(it,))
        coord.join()
        path = manager.save(2)

        def closure_x(it):  # type: ignore[no-untyped-def]
            batch = next(it)
            gates.arrive(gate)
            gates.event(gate).wait(60)
            try:
                seen.assign_add(_counts(batch))
            except StaleRunError:
                gates.event(f"{gate}-refused").set()
                raise
            finally:
                gates.event(f"{gate}-ended").set()

        coord.schedule(closure_x, args=(it,))
        poll_for(lambda: gates.arrivals(gate) == 1, 60, what="X to run and wait before its push")
        coord.shutdown(exit_tasks=False)  # run 1's coordinator dies; X goes on on its worker
        strategy.close()

        # ---- run 2: a new coordinator of the same cluster restores the checkpoint, then X pushes
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            seen = jaxdist.create_variable(np.zeros(EXAMPLES, np.int64), name="seen", if_exists="keep")
        coord = jaxdist.ClusterCoordinator(strategy, closures_per_rpc=1)
        try:
            ds = coord.create_per_worker_dataset(_dataset, exactly_once=True, num_batches=NUM_BATCHES, epochs=1)
            it = iter(ds)
            manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy, coord, ledger=ds.ledger), directory)
            assert manager.restore_or_initialize() == path
            restored = seen.numpy()
            np.testing.assert_array_equal(restored, ckpt.load(path)["variables"]["seen"])
            gates.event(gate).set()  # X's push, from run 1
            poll_for(lambda: gates.event(f"{gate}-ended").is_set(), 60, what="X's push to end")
            np.testing.assert_array_equal(seen.numpy(), restored)  # it changed nothing ...
            assert gates.event(f"{gate}-refused").is_set()  # ... refused as a push of an earlier run
            train = _train_fn(seen)
            for _ in range(ds.ledger.remaining):
                coord.schedule(train, args=(it,))
            coord.join()
            np.testing.assert_array_equal(seen.numpy(), np.ones(EXAMPLES, np.int64))  # every example once
        finally:
            coord.shutdown(exit_tasks=False)
            strategy.close()


def test_the_fence_refuses_other_runs_and_waits_for_their_pushes_in_progress() -> None:
    import threading

    fence = RunFence("ps:0")
    assert run_of("r1/7/abc.1") == "r1" and run_of("by-hand") == "" and run_of("") == ""
    with fence.admit("r1/1/x.1"):  # nothing begun yet: every push is admitted
        pass
    assert fence.begin("r1") == ""
    inside, release = threading.Event(), threading.Event()

    def old_push() -> None:
        with fence.admit("r1/2/x.1"):
            inside.set()
            release.wait(60)

    t = threading.Thread(target=old_push)
    t.start()
    assert inside.wait(60)
    began: list[str] = []
    b = threading.Thread(target=lambda: began.append(fence.begin("r2")))
    b.start()
    poll_for(lambda: fence.run == "r2", 60, what="run r2 to be served")
    assert not began  # r1's push in progress is waited for
    with pytest.raises(StaleRunError, match="run r1"):
        with fence.admit("r1/3/x.1"):
            pass
    with fence.admit("r2/1/x.1"), fence.admit("by-hand"), fence.admit(""):
        pass
    release.set()
    t.join(60)
    b.join(60)
    assert began == ["r1"]
