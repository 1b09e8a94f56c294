"""Dispatch: the coordinator's per-worker handles. Send closures, receive results, run the threads.

Each :class:`WorkerHandle` owns two threads for one worker task:

- ``jaxdist-worker-<i>``: while the worker is healthy, takes batches from
  the closure queue (no more than the worker's fair share of what is
  queued, so long closures still spread out), sends them in one
  RunClosures call and reports the answer; while it is not, (re)configures
  it, with backoff, until it answers;
- ``jaxdist-heartbeat-<i>``: heartbeats the healthy worker.

Nothing here decides anything: every answer, failure and missed heartbeat
is reported to the :class:`~jaxdist.cluster_coordinator.failure_handler.FailureHandler`,
and the decisions it returns are carried out by the :class:`DispatchHost`
(the coordinator). The handle only keeps what the wire needs: which
functions the worker already holds, and the call in flight (so that a worker
declared dead has it cancelled).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import CancelledError as FutureCancelledError
from dataclasses import dataclass
from typing import Protocol

import cloudpickle
import grpc
from jaxdist.base import errors as E
from jaxdist.cluster_coordinator.closure_queue import Closure, ClosureQueue
from jaxdist.cluster_coordinator.failure_handler import ClosureReport, Decision, FailureHandler, Outcome
from jaxdist.cluster_coordinator.remote_value import resolve_per_worker
from jaxdist.proto import worker_pb2
from jaxdist.proto.status import reason_of
from jaxdist.transport.credentials import Credentials
from jaxdist.worker import closure_args
from jaxdist.worker.client import WorkerClient

logger = logging.getLogger(__name__)

__all__ = ["DispatchHost", "DispatchSettings", "WorkerHandle"]

_OUTCOMES = {
    worker_pb2.CLOSURE_OK: Outcome.OK,
    worker_pb2.CLOSURE_ERROR: Outcome.ERROR,
    worker_pb2.FUNCTION_UNKNOWN: Outcome.FUNCTION_UNKNOWN,
    worker_pb2.RESOURCE_UNKNOWN: Outcome.RESOURCE_UNKNOWN,
    worker_pb2.SKIPPED: Outcome.SKIPPED,
}

#: First and longest wait between attempts to (re)configure an unreachable worker.
_MIN_BACKOFF_S = 0.05
_MAX_BACKOFF_S = 1.0
#: How long one wait for closures lasts before the loop looks at its state again.
_GET_TIMEOUT_S = 0.2


@dataclass(frozen=True)
class DispatchSettings:
    """How the coordinator talks to its workers (see :class:`ClusterCoordinator`'s arguments)."""

    closures_per_rpc: int
    heartbeat_interval: float
    failure_timeout: float
    closure_timeout: float | None


class DispatchHost(Protocol):
    """What a handle needs from the coordinator that owns it."""

    @property
    def active_workers(self) -> int:
        """Workers taking part in the job (a handle's fair share of the queue divides by it)."""
        ...

    def configure_request(self, handle: WorkerHandle) -> worker_pb2.ConfigureRequest:
        """The Configure request for ``handle``'s worker (cluster, index, run id, registration)."""
        ...

    def worker_configured(self, handle: WorkerHandle, incarnation: str) -> None:
        """``handle``'s worker answered Configure as process ``incarnation``."""
        ...

    def apply(self, decisions: Sequence[Decision]) -> None:
        """Carry out the failure handler's decisions, in order."""
        ...


def _rebuild_error(r: worker_pb2.ClosureResult, task: str) -> BaseException:
    """The closure's own exception (type and all) from the worker's answer, with its remote traceback."""
    exc: BaseException | None = None
    if r.error:
        try:
            exc = cloudpickle.loads(r.error)
        except Exception:  # noqa: BLE001 - class not importable here
            exc = None
    if not isinstance(exc, BaseException):
        last = r.traceback.strip().splitlines()[-1] if r.traceback.strip() else r.error_type
        exc = E.ClosureError(f"closure failed on {task}: {last}", r.traceback)
    try:
        exc.add_note(f"Remote traceback ({task}):\n{r.traceback}")
    except AttributeError:  # pragma: no cover - Python < 3.11
        pass
    return exc


class WorkerHandle:
    """The coordinator's end of one worker task: its client, its threads, its call in flight.

    ``start``/``stop``/``join``, then ``close`` (the client). Thread-safe.
    """

    def __init__(
        self,
        index: int,
        address: str,
        credentials: Credentials,
        *,
        queue: ClosureQueue,
        failures: FailureHandler,
        settings: DispatchSettings,
        host: DispatchHost,
    ) -> None:
        self.index = index
        self.address = address
        self.task = f"worker:{index}"
        self.client = WorkerClient(address, credentials, task=self.task)
        self._queue = queue
        self._failures = failures
        self._settings = settings
        self._host = host
        # Digests of the functions this worker process holds. Changed under _lock; the run thread,
        # the only one that sends, reads it without (set membership is atomic).
        self._shipped: set[str] = set()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._inflight: grpc.Future | None = None
        self._run_thread = threading.Thread(target=self._run_loop, name=f"jaxdist-worker-{index}", daemon=True)
        self._hb_thread = threading.Thread(target=self._heartbeat_loop, name=f"jaxdist-heartbeat-{index}", daemon=True)

    # ---------------------------------------------------------------- lifecycle
    def start(self) -> None:
        self._run_thread.start()
        self._hb_thread.start()

    def stop(self) -> None:
        """Stop both threads (soon) and cancel the call in flight."""
        self._stop.set()
        self.cancel_inflight()

    def join(self, timeout: float) -> None:
        self._run_thread.join(timeout)
        self._hb_thread.join(timeout)

    def close(self) -> None:
        self.client.close()

    # ------------------------------------------------------- what the host asks
    @property
    def functions_shipped(self) -> int:
        """Functions this worker process holds, as far as the coordinator knows."""
        with self._lock:
            return len(self._shipped)

    def cancel_inflight(self) -> None:
        """Cancel the RunClosures call in flight, if any (the worker was declared dead)."""
        with self._lock:
            fut = self._inflight
        if fut is not None:
            fut.cancel()

    def forget_function(self, digest: str) -> None:
        with self._lock:
            self._shipped.discard(digest)

    def forget_functions(self) -> None:
        """The worker is a new process: it holds no function."""
        with self._lock:
            self._shipped.clear()

    def configure(self, timeout: float) -> None:
        """Send the worker its current configuration (e.g. new PS primaries). Raises JaxdistError."""
        self.client.configure(self._host.configure_request(self), timeout=timeout)

    # ---------------------------------------------------------------- heartbeat
    def _heartbeat_loop(self) -> None:
        interval = self._settings.heartbeat_interval
        while not self._stop.wait(interval):
            if not self._failures.is_healthy(self.index):
                continue
            try:
                st = self.client.heartbeat(timeout=interval * 2)
            except E.JaxdistError:
                self._host.apply(self._failures.heartbeat_missed(self.index))
                continue
            self._host.apply(self._failures.heartbeat_answered(self.index, st.incarnation))

    # --------------------------------------------------------------------- run
    def _run_loop(self) -> None:
        backoff = _MIN_BACKOFF_S
        while not self._stop.is_set():
            if not self._failures.is_healthy(self.index):
                if self._reconfigure():
                    backoff = _MIN_BACKOFF_S
                else:
                    self._stop.wait(backoff)
                    backoff = min(backoff * 2, _MAX_BACKOFF_S)
                continue
            # Batch only what this worker's fair share allows, so long closures still spread out.
            share = -(-self._queue.queued // max(1, self._host.active_workers))
            batch = self._queue.get(self.index, max_n=max(1, min(self._settings.closures_per_rpc, share)), timeout=_GET_TIMEOUT_S)
            if batch and self._stop.is_set():  # leaving: these go to other workers
                self._host.apply(self._failures.not_sent(batch))
            elif batch:
                try:
                    self._execute(batch)
                except Exception as e:  # noqa: BLE001 - a bug here must fail closures, never hang join()
                    logger.exception("%s: unexpected error dispatching closures", self.task)
                    self._host.apply(self._failures.dispatch_crashed(batch, e))

    def _reconfigure(self) -> bool:
        """(Re)configure the worker; True when it answered."""
        try:
            resp = self.client.configure(self._host.configure_request(self), timeout=max(2.0, self._settings.failure_timeout))
        except E.JaxdistError as e:
            logger.debug("%s not reachable yet: %s", self.task, e)
            return False
        self._host.worker_configured(self, resp.incarnation)
        return True

    def _execute(self, batch: list[Closure]) -> None:
        req = worker_pb2.RunRequest(incarnation=self._failures.incarnation(self.index))
        digests = []
        for i, cl in enumerate(batch):
            fp = cl.function
            call = req.calls.add(closure_id=cl.id, attempt=cl.attempt, fn_digest=fp.digest, resource_id=cl.resource_id)
            if fp.digest not in self._shipped:
                call.fn_payload = fp.payload
            digests.append(fp.digest)
            try:
                args, kwargs = resolve_per_worker((cl.args, cl.kwargs), self.index) if cl.per_worker else (cl.args, cl.kwargs)
                call.args = closure_args.dumps(args, kwargs)
            except Exception as e:  # noqa: BLE001 - an argument that cannot be pickled is the closure's error
                self._host.apply(self._failures.arguments_failed(batch, i, e))
                return
        with self._lock:
            fut = self.client.run_future(req, timeout=self._settings.closure_timeout)
            self._inflight = fut
        try:
            resp = fut.result()
        except grpc.RpcError as e:
            self._host.apply(self._failures.call_failed(self.index, batch, e.code(), reason_of(e), e.details() or ""))
            return
        except (grpc.FutureCancelledError, FutureCancelledError):
            self._host.apply(self._failures.call_failed(self.index, batch, grpc.StatusCode.CANCELLED, details="declared failed"))
            return
        finally:
            with self._lock:
                self._inflight = None
        with self._lock:
            self._shipped.update(digests)
        reports = []
        for cl, r in zip(batch, resp.results):
            outcome = _OUTCOMES.get(r.status, Outcome.SKIPPED)
            if outcome is Outcome.OK:
                reports.append(ClosureReport(cl, outcome, r.value))
            elif outcome is Outcome.ERROR:
                reports.append(ClosureReport(cl, outcome, error=_rebuild_error(r, self.task)))
            else:
                reports.append(ClosureReport(cl, outcome))
        self._host.apply(self._failures.closures_returned(self.index, reports))
