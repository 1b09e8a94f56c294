"""The PS's fence against closures of an earlier coordinator run.

A coordinator that restarts (its script re-run, resuming from a checkpoint) starts a new *run*: its
closures' push identities begin with its run id (``<run>/<closure>/...``, see
:class:`jaxdist.worker.context.ClosureIdentity`). Workers may outlive the coordinator that gave them
closures and still be running one when the new run restores the variables: such a push, applied after
the restore, would change the restored state with an update that the restored data ledger hands out
again. So every coordinator *begins its run* on every PS task before it configures a worker (and again
on a PS task that restarts or is attached as a backup), and from then on the PS refuses, with
:class:`~jaxdist.base.errors.StaleRunError` (``FAILED_PRECONDITION``, not retried), every push whose
identity names another run, before it changes anything. ``begin`` returns only once the pushes of
other runs already admitted have finished: after it, nothing of an earlier run lands.

Pushes without an identity (the coordinator script's own) or with one that names no run (made by hand
on the PS client: no ``/``) are not fenced; nor is anything before the first run begins.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterator

from jaxdist.base.errors import StaleRunError

logger = logging.getLogger(__name__)

__all__ = ["RunFence", "run_of"]


def run_of(update_id: str) -> str:
    """The coordinator run a push identity names ("" for none: no identity, or one made by hand)."""
    run, sep, _ = update_id.partition("/")
    return run if sep else ""


class RunFence:
    """The run this PS serves and the pushes in progress per run. Thread-safe."""

    def __init__(self, task: str = "ps") -> None:
        self.task = task
        self.run = ""  # "" until a coordinator begins its run here
        self._cv = threading.Condition()
        self._admitted: collections.Counter[str] = collections.Counter()  # pushes in progress, per run

    def begin(self, run: str) -> str:
        """Serve ``run`` from now on; returns the run served before. Waits until no push of another
        run admitted earlier is still in progress (new ones are refused meanwhile)."""
        if not run:
            raise ValueError("a run id is not empty")
        with self._cv:
            previous, self.run = self.run, run
            while any(n for r, n in self._admitted.items() if r != run):
                self._cv.wait()
        if previous != run:
            logger.info("%s: coordinator run %s begins (previous %s)", self.task, run, previous or "none")
        return previous

    @contextlib.contextmanager
    def admit(self, update_id: str) -> Iterator[None]:
        """Hold a push with ``update_id`` in progress for as long as the block runs.

        Raises:
            StaleRunError: the identity names a run other than the one this PS serves.
        """
        run = run_of(update_id)
        if not run:
            yield
            return
        with self._cv:
            if self.run and run != self.run:
                raise StaleRunError(
                    f"{self.task} refused a push of coordinator run {run}: it serves run {self.run} (a closure of an "
                    "earlier run, on a worker that outlived its coordinator); nothing was changed")
            self._admitted[run] += 1
        try:
            yield
        finally:
            with self._cv:
                self._admitted[run] -= 1
                if not self._admitted[run]:
                    del self._admitted[run]
                    self._cv.notify_all()
