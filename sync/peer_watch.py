"""What one process of a ``MultiWorkerMirroredStrategy`` job does about dead peers and stuck steps.

:class:`PeerWatch` holds the process's failure state. A failure reaches it
from process 0's coordination service (a peer stopped heartbeating), from
this process's heartbeats (process 0 says a peer is dead, or process 0 itself
is gone; see :mod:`jaxdist.sync.coordination`) or from its own collective
timeout watcher (``CommunicationOptions(timeout_seconds=...)``: a dispatched
step has not finished in time). The first failure is kept; then, as
``on_peer_failure`` says:

- ``"abort"``: the process logs a :class:`PeerFailedError` message to stderr
  and ends with ``os._exit(EXIT_PEER_FAILED)`` at once, from the thread that
  noticed: the main thread may be blocked inside a collective with the dead
  peer, where no Python code runs.
- ``"raise"``: the failure is recorded and the next strategy call raises it
  (:meth:`PeerWatch.raise_if_failed`, :meth:`PeerWatch.typed_errors`).

It is also the strategy engine's :class:`~jaxdist.sync.engine.DispatchGuard`:
the engine calls it around every program it dispatches, to stop waiting on a
step stuck with a dead peer ("raise" mode) and to time steps for the
collective timeout. See :mod:`jaxdist.sync.multi_worker` for what a survivor
sees, measured.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax

from jaxdist.sync.coordination import PeerFailedError

logger = logging.getLogger(__name__)

__all__ = ["EXIT_PEER_FAILED", "PeerWatch"]

#: Exit status of a process aborted because a peer died: 138 (128 + SIGUSR1) is
#: the code Kubeflow's TFJob ``ExitCode`` restart policy reserves for
#: user-defined retryable failures, so the job is restarted rather than failed.
EXIT_PEER_FAILED = 138

#: Seconds between readiness checks while waiting for a step in "raise" mode.
_POLL_S = 0.002


class PeerWatch:
    """The peer-failure state of one process of a multi-process job (see the module docstring).

    Args:
        on_peer_failure: ``"abort"`` or ``"raise"``.
        task: this process's task (``"worker:1"``), named in the failures it reports.
        rank: this process's rank in the job.
        num_processes: processes in the job (1: nothing to watch; runtime errors are never a peer's).
        peer_timeout_s: silence after which a peer is declared dead.
        heartbeat_interval_s: time between heartbeats.
    """

    def __init__(
        self,
        on_peer_failure: str,
        *,
        task: str,
        rank: int,
        num_processes: int,
        peer_timeout_s: float,
        heartbeat_interval_s: float,
    ) -> None:
        self._mode = on_peer_failure
        self._task = task
        self._rank = rank
        self._nproc = num_processes
        self._peer_timeout = peer_timeout_s
        self._interval = heartbeat_interval_s
        self._failure: PeerFailedError | None = None
        self._lock = threading.Lock()
        self._closed = False
        #: Set while this process serves the coordination service (process 0): an abort then keeps
        #: serving briefly, so the other survivors learn of the failure from their next heartbeat.
        self.serving = False
        self._timeout: float | None = None
        self._watched: tuple[float, list[Any] | None] | None = None

    @property
    def failure(self) -> PeerFailedError | None:
        """The peer failure seen so far, if any."""
        return self._failure

    def close(self) -> None:
        """The process leaves the job: failures reported from now on are ignored, the timeout watcher stops."""
        with self._lock:
            self._closed = True

    # -- failures -------------------------------------------------------------------

    def handle(self, err: PeerFailedError) -> None:
        """A peer failed (the coordination service's and the heartbeats' ``on_failure``): record it, then abort or wait."""
        with self._lock:
            if self._failure is not None or self._closed:
                return
            self._failure = err
        if self._mode == "raise":
            logger.error("peer failure recorded; the next strategy call raises it: %s", err)
            return
        msg = (
            f"jaxdist: PeerFailedError on {self._task} (process {self._rank}): {err}. "
            f"Aborting this process with exit code {EXIT_PEER_FAILED}: it may be blocked in a collective with the "
            "dead peer. Restart every process of the job from the last checkpoint."
        )
        try:
            logger.critical("%s", msg)  # without handlers, logging's last resort prints it to stderr
            if logger.hasHandlers():
                sys.stderr.write(msg + "\n")
            sys.stderr.flush()
            for h in logging.getLogger().handlers:
                h.flush()
            # Said first (above): the main thread may reach interpreter exit meanwhile.
            if self.serving:
                threading.Event().wait(min(1.0, 2 * self._interval))
        finally:
            os._exit(EXIT_PEER_FAILED)

    def raise_if_failed(self) -> None:
        """Raise the recorded failure (a new PeerFailedError, from the recorded one), if any."""
        err = self._failure
        if err is not None:
            raise PeerFailedError(str(err), task=err.task, rank=err.rank) from err

    def await_failure(self, timeout: float) -> PeerFailedError | None:
        """The failure recorded within ``timeout`` seconds, or None."""
        deadline = time.monotonic() + timeout
        while self._failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return self._failure

    @contextlib.contextmanager
    def typed_errors(self) -> Iterator[None]:
        """Raise PeerFailedError for a runtime error that a dead peer caused (and for a failure already recorded)."""
        self.raise_if_failed()
        try:
            yield
        except jax.errors.JaxRuntimeError as e:
            if self._nproc == 1:
                raise
            # A collective with a dead peer fails before the heartbeats notice; wait for them.
            err = self.await_failure(self._peer_timeout + 2 * self._interval)
            if err is None:
                raise
            raise PeerFailedError(str(err), task=err.task, rank=err.rank) from e

    # -- the engine's dispatch guard ---------------------------------------------------

    def before_dispatch(self, in_flight: Any, traced: bool) -> None:
        """Wait for the previous program without blocking in C++ ("raise" mode); start timing the next one."""
        if self._mode == "raise" and self._nproc > 1 and in_flight is not None:
            # A collective stuck on a dead peer can be abandoned with PeerFailedError this way.
            leaves = [x for x in jax.tree.leaves(in_flight) if isinstance(x, jax.Array)]
            while not all(x.is_ready() for x in leaves):  # type: ignore[attr-defined]  # jax.Array's stub lacks it
                self.raise_if_failed()
                time.sleep(_POLL_S)
        if self._timeout is not None and not traced:
            # Watched from before the call: the first collective's set-up (e.g. gloo's rendezvous with the
            # peers) happens inside the dispatch itself and would otherwise wait unwatched.
            self._watched = (time.monotonic(), None)

    def after_dispatch(self, outputs: Any) -> None:
        if self._timeout is not None:
            self._watched = (
                self._watched[0] if self._watched else time.monotonic(),
                [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)],
            )

    def watch(self, outputs: Any) -> None:
        if self._timeout is not None:
            self._watched = (time.monotonic(), [x for x in jax.tree.leaves(outputs) if isinstance(x, jax.Array)])

    # -- the collective timeout --------------------------------------------------------

    def start_timeout_watch(self, limit: float) -> None:
        """Fail the job when a dispatched step has not finished within ``limit`` seconds (TF: DeadlineExceeded)."""
        self._timeout = limit
        threading.Thread(target=self._watch_timeout, name="jaxdist-collective-timeout", daemon=True).start()

    def _watch_timeout(self) -> None:
        assert self._timeout is not None
        limit = self._timeout
        period = min(0.1, limit / 10)
        while not self._closed and self._failure is None:
            time.sleep(period)
            watched = self._watched
            if watched is None:
                continue
            t0, leaves = watched
            if leaves is not None and all(x.is_ready() for x in leaves):
                self._watched = None
                continue
            if time.monotonic() - t0 > limit:
                self.handle(
                    PeerFailedError(
                        f"a step's collectives did not finish within CommunicationOptions(timeout_seconds={limit}) "
                        "(a peer is stuck or too slow)",
                        task=self._task,
                        rank=self._rank,
                    )
                )
                return
