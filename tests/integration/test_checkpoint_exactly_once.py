"""Exactly-once data across a coordinator restart, when the checkpoint was taken while a failed worker's
closures were queued again (issue 29, item 1), driven by events on in-process clusters.

The interleaving: closure A trains its batch (its push applied) and its worker dies before reporting it,
so A is queued again; the other worker is busy with closure B; a save starts and pauses dispatch; B
finishes. Before the fix, the save's quiet point was "nothing running": it snapshot the PS with A's
update applied while the data ledger still had A's batch handed out, not done, so the run resumed from
that checkpoint trained A's batch a second time. A save now also re-runs such closures (their pushes
are deduplicated) before it snapshots, so every batch is either done and in the snapshot, or not
started and not in it. The resumed run (a new coordinator on a new cluster: the old one died with its
script) ends exact: every example counted once per epoch.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np
import pytest

import jaxdist
from jaxdist import checkpoint as ckpt
from jaxdist.errors import ConfigurationError
from jaxdist.testing import InProcessCluster, poll_for

import inprocess_gates as gates

pytestmark = [pytest.mark.timeout(180)]

EXAMPLES = 24  # example ids 0..23
BATCH = 3  # 8 batches of 3 ids
NUM_BATCHES = EXAMPLES // BATCH
EPOCHS = 2


def _dataset(ctx):  # type: ignore[no-untyped-def]
    ids = np.arange(EXAMPLES, dtype=np.int64)
    return [ids[i : i + BATCH] for i in range(0, EXAMPLES, BATCH)]


def _counts(batch: np.ndarray) -> np.ndarray:
    return np.bincount(batch, minlength=EXAMPLES).astype(np.int64)


@contextlib.contextmanager
def _script(cluster: InProcessCluster, directory: str):  # type: ignore[no-untyped-def]
    """One run of the training script: variables, coordinator, exactly-once data, manager, restore."""
    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
    try:
        with strategy.scope():
            # seen[i]: how many times example i was trained on (each batch adds its ids' counts once).
            seen = jaxdist.create_variable(np.zeros(EXAMPLES, np.int64), name="seen")
        coord = jaxdist.ClusterCoordinator(strategy, closures_per_rpc=1, failure_timeout=2.0)
        try:
            ds = coord.create_per_worker_dataset(_dataset, exactly_once=True, num_batches=NUM_BATCHES, epochs=EPOCHS)
            manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(strategy, coord, ledger=ds.ledger), directory)
            resumed = manager.restore_or_initialize()
            yield seen, coord, ds, iter(ds), manager, resumed
        finally:
            # The script ends (or is killed with its cluster): what runs or is queued now is lost with it.
            coord.shutdown(exit_tasks=False)
    finally:
        strategy.close()


def _worker_of(name: str, workers: int) -> int:
    """The worker a closure that called ``gates.arrive(f"{name}-{worker}")`` ran on."""
    found = [w for w in range(workers) if gates.arrivals(f"{name}-{w}")]
    assert len(found) == 1, found
    return found[0]


def _train_fn(seen):  # type: ignore[no-untyped-def]
    # A new function per run: a function's captured variables are pickled the first time it is scheduled.
    def train(it):  # type: ignore[no-untyped-def]
        seen.assign_add(_counts(next(it)))

    return train


@pytest.mark.parametrize("steps", [1, 2], ids=["one-push", "two-steps-one-pushed"])
def test_save_while_a_failed_workers_closure_is_requeued_then_restart_is_exact(tmp_path, steps: int) -> None:  # type: ignore[no-untyped-def]
    """``steps=2``: A is a ``steps_per_execution`` closure of two batches killed between its two pushes
    (half of its work in the PS): the resumed run must neither repeat the pushed half nor lose the rest."""
    directory = str(tmp_path / "ckpts")
    a_gate, b_gate = gates.new_name("a"), gates.new_name("b")

    # ---- run 1: the checkpoint is taken while A (its worker dead, its push applied) is queued again
    saved: dict[str, str] = {}
    with InProcessCluster(num_workers=2, num_ps=1) as cluster, _script(cluster, directory) as (seen, coord, ds, it, manager, resumed):
        assert resumed is None

        def closure_a(it):  # type: ignore[no-untyped-def]
            # One step: pushes its batch; after the first step, waits (first attempt only: the test sets
            # the event once the worker is stopped) with that push applied.
            seen.assign_add(_counts(next(it)))
            if len(it) == steps - 1:
                gates.arrive(f"{a_gate}-{jaxdist.current_worker_index()}")
                gates.event(a_gate).wait(60)

        def closure_b(it):  # type: ignore[no-untyped-def]
            gates.arrive(f"{b_gate}-{jaxdist.current_worker_index()}")
            gates.event(b_gate).wait(60)
            seen.assign_add(_counts(next(it)))

        train = _train_fn(seen)
        fn_a = jaxdist.steps_per_execution(closure_a, steps) if steps > 1 else closure_a
        rv_a = coord.schedule(fn_a, args=(it,))
        poll_for(lambda: any(gates.arrivals(f"{a_gate}-{w}") for w in range(2)), 60, what="A to push and wait")
        rv_b = coord.schedule(closure_b, args=(it,))
        a_worker = _worker_of(a_gate, 2)
        poll_for(lambda: gates.arrivals(f"{b_gate}-{1 - a_worker}") == 1, 60, what="B to run on the other worker")
        failures = coord.closure_counts.retried
        cluster.stop_task(f"worker:{a_worker}")  # A's worker dies with A's push applied, before reporting it
        poll_for(lambda: coord.closure_counts.retried > failures, 60, what="A to be queued again")
        gates.event(a_gate).set()  # the stopped service's thread ends; A's re-run will not wait
        for _ in range(2):
            coord.schedule(train, args=(it,))  # queued behind A, never started before the save: not in it
        saver = threading.Thread(target=lambda: saved.setdefault("path", manager.save(1)), name="saver")
        saver.start()
        poll_for(lambda: not coord.dispatching, 60, what="the save to pause dispatch")
        gates.event(b_gate).set()  # B finishes: nothing runs any more
        saver.join(60)
        assert not saver.is_alive()
        # The snapshot is consistent: a batch is counted in it exactly when the ledger says it is done.
        saved_ckpt = ckpt.load(saved["path"])
        done = saved_ckpt["ledger"]["done"]
        expect = np.zeros(EXAMPLES, np.int64)
        for p in done:
            expect += _counts(_dataset(None)[p % NUM_BATCHES])
        np.testing.assert_array_equal(saved_ckpt["variables"]["seen"], expect)
        assert rv_b.fetch(timeout=60) is None
        rv_a.fetch(timeout=60)

    # ---- run 2: resume from the checkpoint on a new cluster and train to the end of the data
    with InProcessCluster(num_workers=2, num_ps=1) as cluster, _script(cluster, directory) as (seen, coord, ds, it, manager, resumed):
        assert resumed == saved["path"]
        train = _train_fn(seen)
        remaining = NUM_BATCHES * EPOCHS - ds.ledger.completed
        for _ in range(remaining):
            coord.schedule(train, args=(it,))
        coord.join()
        assert ds.ledger.completed == NUM_BATCHES * EPOCHS
        np.testing.assert_array_equal(seen.numpy(), np.full(EXAMPLES, EPOCHS, np.int64))  # every example once per epoch


def test_restore_is_refused_while_closures_hold_batches_and_changes_nothing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A ledger restored under queued or running closures would hand their batches out again (trained
    twice): ``restore`` refuses before it changes any variable; after ``join`` it restores."""
    directory = str(tmp_path / "ckpts")
    gate = gates.new_name("hold")

    with InProcessCluster(num_workers=1, num_ps=1) as cluster, _script(cluster, directory) as (seen, coord, ds, it, manager, _):
        train = _train_fn(seen)
        for _ in range(2):
            coord.schedule(train, args=(it,))
        coord.join()
        path = manager.save(2)

        def held(it):  # type: ignore[no-untyped-def]
            gates.arrive(gate)
            gates.event(gate).wait(60)
            seen.assign_add(_counts(next(it)))

        coord.schedule(held, args=(it,))
        coord.schedule(train, args=(it,))  # queued behind it
        poll_for(lambda: gates.arrivals(gate) == 1, 60, what="the closure to run")
        before = seen.numpy()
        try:
            with pytest.raises(ConfigurationError, match="2 scheduled closure"):
                manager.checkpoint.restore(path)
            np.testing.assert_array_equal(seen.numpy(), before)  # the PS was not restored either
        finally:
            gates.event(gate).set()
        coord.join()
        assert ds.ledger.completed == 4
        manager.checkpoint.restore(path)  # nothing holds a batch now
        assert ds.ledger.completed == 2
        np.testing.assert_array_equal(seen.numpy(), ckpt.load(path)["variables"]["seen"])
