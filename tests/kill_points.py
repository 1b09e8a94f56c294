"""Worker SIGKILLs driven by events, not by a timer: every kill lands on a closure in flight, on any machine.

Why: chaos on a timer (``LocalCluster.chaos``: a random worker killed every second) tests something only
when the run outlasts a few periods. On a fast machine the closures were all done before the second
kill ("the run was too fast to test anything"); padding each closure with a sleep only moves the
machine speed at which that happens, and a kill that lands between two closures tests nothing either.

Here a closure says where its worker dies: a closure chosen as kill point ``k`` calls
:meth:`KillPoints.hold` at that point of its body (after some of its pushes, before others). ``hold``
records the closure's worker and waits. The test thread's :meth:`KillPoints.run` waits for kill point 0
to be reached, SIGKILLs that worker, waits until the coordinator has declared it failed (the closure
is then queued again), lets kill point 0 go on, restarts the worker, and goes on with kill point 1
(:meth:`KillPoints.kill` makes one kill and leaves the worker down).
So the run cannot end before every kill happened, and each kill hits a closure that has pushed part
of its updates: exactly the case a re-run must not apply twice.

A kill point's re-run passes :meth:`~KillPoints.hold` without waiting (its kill is done). Kill points
are taken in order, so use at most as many as the cluster has workers: a worker waiting at kill point
``k + 1`` is not free to run kill point ``k``. Not a conftest: ``tests/conftest.py`` owns that name. It
imports nothing from it either, so a test's child process (a coordinator script) can use it too.
"""

from __future__ import annotations

import os
import sys
import time

import cloudpickle
import numpy as np

import jaxdist
from jaxdist.testing import poll_for

# Closures capture a KillPoints and call its hold() on the workers, where this test helper cannot be
# imported: it travels by value, as the test modules themselves do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

#: How long a frozen worker stays frozen if the test never resumes it (LocalCluster.stop resumes it anyway).
_FROZEN_S = 3600.0


class KillPoints:
    """``count`` kill points, in order; create it in the test before scheduling (it creates variables).

    Args:
        strategy: the ParameterServerStrategy the closures run under (its scope creates the variables
            the closures use to report where they wait, and the test to let them go on).
        count: how many kills :meth:`run` makes.
        report_dir: where :meth:`hold` reports a kill point reached, as a file, instead of assigning a
            variable (the workers must share this host's file system: a ``LocalCluster``). For kill points
            a closure's re-run may not pass (one in a per-worker dataset's read: the re-run, on another
            worker, reads another batch): ``hold`` then pushes nothing, and a re-run pushes exactly what
            its first attempt did, as exactly-once pushes require. Waiting is a read either way.
    """

    def __init__(self, strategy: jaxdist.ParameterServerStrategy, count: int, report_dir: str | None = None) -> None:
        with strategy.scope():
            # 1 + the worker index of the first attempt that reached kill point k (0: not reached yet).
            self._reached = ([] if report_dir is not None else
                             [jaxdist.create_variable(np.zeros((), np.int64), name=f"kill_point_{k}") for k in range(count)])
            # Kill points below this value have had their kill: their closures go on.
            self._done = jaxdist.create_variable(np.zeros((), np.int64), name="kill_points_done")
        self._report_dir = report_dir
        self.count = count
        self.kills = 0
        #: The workers killed, in order.
        self.victims: list[int] = []

    def hold(self, k: int) -> None:
        """In a closure: report kill point ``k`` reached on this worker and wait until its kill is done."""
        if self._report_dir is None:
            self._reached[k].assign(np.asarray(jaxdist.current_worker_index() + 1, np.int64))
        elif int(self._done.numpy()) <= k:  # (a re-run passes without reporting)
            path = os.path.join(self._report_dir, f"kill_point_{k}")
            with open(f"{path}.{os.getpid()}", "w") as f:
                f.write(str(jaxdist.current_worker_index() + 1))
            os.replace(f"{path}.{os.getpid()}", path)  # whole, or not there
        while int(self._done.numpy()) <= k:
            time.sleep(0.02)

    def kill(self, cluster: jaxdist.LocalCluster, coord: jaxdist.ClusterCoordinator, timeout: float = 120.0,
             freeze: bool = False) -> int:
        """In the test thread: make the next kill. Waits for its kill point to be reached, SIGKILLs
        that worker, waits until the coordinator has declared it failed (its closures are queued
        again), then lets the kill point go on. Returns the worker's index; it stays down.

        With ``freeze``, the worker is SIGSTOPped instead (silent, as behind a cut link) and stays
        frozen until the test sends it SIGCONT (``os.kill(cluster.pid(...), signal.SIGCONT)``)."""
        k = self.kills
        if k >= self.count:
            raise AssertionError(f"all {self.count} kill points were used")
        poll_for(lambda: self._reached_by(k) != 0, timeout, what=f"a closure to reach kill point {k}")
        worker = self._reached_by(k) - 1
        failures = coord.status()[worker]["failures"]
        if freeze:
            cluster.partition(f"worker:{worker}", _FROZEN_S)
        else:
            cluster.kill(f"worker:{worker}")
        self.kills += 1
        self.victims.append(worker)
        poll_for(lambda: coord.status()[worker]["failures"] > failures, timeout,
                 what=f"worker:{worker} to be declared failed after its {'SIGSTOP' if freeze else 'SIGKILL'} at kill point {k}")
        self._done.assign(np.asarray(k + 1, np.int64))
        return worker

    def _reached_by(self, k: int) -> int:
        """1 + the index of a worker that reached kill point ``k``; 0 when none has yet."""
        if self._report_dir is None:
            return int(self._reached[k].numpy())
        try:
            with open(os.path.join(self._report_dir, f"kill_point_{k}")) as f:
                return int(f.read())
        except FileNotFoundError:
            return 0

    def run(self, cluster: jaxdist.LocalCluster, coord: jaxdist.ClusterCoordinator, timeout: float = 120.0) -> None:
        """In the test thread, while the closures run: make every kill (:meth:`kill`), restarting each
        killed worker before the next; returns once the last one was restarted."""
        while self.kills < self.count:
            cluster.restart(f"worker:{self.kill(cluster, coord, timeout)}")
