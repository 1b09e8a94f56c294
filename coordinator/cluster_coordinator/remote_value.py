"""RemoteValue and PerWorkerValues: results and per-worker handles on the coordinator.

A :class:`RemoteValue` is settled once, by the coordinator (the closure
queue and the dispatch threads, through :class:`Closure`'s ``succeed``/
``fail``/``cancel``), and read by the user. The per-worker handles
(:class:`PerWorkerResource`) travel to workers as persistent ids of the
argument protocol (:mod:`jaxdist.worker.closure_args`).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence
from typing import Any

import cloudpickle
import jax
import numpy as np

from jaxdist.worker.closure_args import PersistentId, WorkerResident, resource_ref

__all__ = ["RemoteValue", "RemoteValueStatus", "PerWorkerValues", "PerWorkerResource", "PerWorkerResourceValues", "resolve_per_worker"]


class RemoteValueStatus(enum.Enum):
    NOT_READY = "NOT_READY"  # scheduled, queued or running
    READY = "READY"  # has a value or a non-retryable error
    ABORTED = "ABORTED"  # cancelled before it could run (an earlier closure failed)


class RemoteValue:
    """The future result of a scheduled closure.

    ``fetch()`` blocks until the closure finished and returns its value as
    numpy arrays (any pytree). If the closure raised, ``fetch()`` raises that
    error, every time. If it was cancelled because another closure failed,
    ``fetch()`` raises :class:`jaxdist.base.errors.CancelledError`.
    """

    __slots__ = ("closure_id", "_status", "_payload", "_value", "_has_value", "_error", "_event", "_lock")

    def __init__(self, closure_id: int) -> None:
        self.closure_id = closure_id
        self._status = RemoteValueStatus.NOT_READY
        self._payload: bytes | None = None
        self._value: Any = None
        self._has_value = False
        self._error: BaseException | None = None
        # Made by the first waiter (under _lock), not here: most values are settled before anyone
        # waits, and a threading.Event (a Condition and its lock) was the largest part of the
        # coordinator's cost per schedule() (profiled with 1,000 simulated workers).
        self._event: threading.Event | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------- coordinator side
    # Like concurrent.futures.Future.set_result: called by the coordinator
    # (through Closure), never by users. The first call settles the value;
    # later calls are ignored, so a re-run closure cannot overwrite a result.
    def _settle(self, status: RemoteValueStatus, payload: bytes | None, error: BaseException | None) -> None:
        with self._lock:
            if self._status is not RemoteValueStatus.NOT_READY:
                return  # a result is set once (a re-executed closure cannot overwrite it)
            self._payload = payload
            self._error = error
            self._status = status  # last: done() reads it without the lock
            if self._event is not None:
                self._event.set()

    def set_result(self, payload: bytes) -> None:
        """Settle with a pickled result (READY)."""
        self._settle(RemoteValueStatus.READY, payload, None)

    def set_error(self, error: BaseException) -> None:
        """Settle with the closure's error (READY; ``fetch()`` raises it)."""
        self._settle(RemoteValueStatus.READY, None, error)

    def set_aborted(self, error: BaseException) -> None:
        """Settle as cancelled before it ran (ABORTED; ``fetch()`` raises ``error``)."""
        self._settle(RemoteValueStatus.ABORTED, None, error)

    # -------------------------------------------------------------- user side
    @property
    def status(self) -> RemoteValueStatus:
        return self._status

    def done(self) -> bool:
        return self._status is not RemoteValueStatus.NOT_READY

    def wait(self, timeout: float | None = None) -> bool:
        """Block until settled (at most ``timeout`` seconds); returns whether it is."""
        if self._status is not RemoteValueStatus.NOT_READY:
            return True
        with self._lock:
            if self._status is not RemoteValueStatus.NOT_READY:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def fetch(self, timeout: float | None = None) -> Any:
        """Block until ready; return the value (numpy leaves) or raise the closure's error.

        Raises:
            TimeoutError: ``timeout`` seconds passed first.
        """
        if not self.wait(timeout):
            raise TimeoutError(f"closure {self.closure_id} not finished after {timeout}s")
        if self._error is not None:
            raise self._error
        with self._lock:
            if not self._has_value:
                self._value = cloudpickle.loads(self._payload) if self._payload else None
                self._payload = None
                self._has_value = True
            return self._value

    def get(self, timeout: float | None = None) -> Any:
        """Like :meth:`fetch`, with array leaves as ``jax.Array``."""
        return jax.tree.map(lambda x: jax.numpy.asarray(x) if isinstance(x, np.ndarray) else x, self.fetch(timeout))

    def __repr__(self) -> str:
        return f"<RemoteValue closure={self.closure_id} {self._status.value}>"


class PerWorkerResource(WorkerResident):
    """A handle to an object living on one worker (a dataset, an iterator).

    Passed to a closure, it arrives as the object itself on that worker.
    """

    __slots__ = ("resource_id", "worker_index")

    def __init__(self, resource_id: int, worker_index: int) -> None:
        self.resource_id = resource_id
        self.worker_index = worker_index

    def persistent_id(self) -> PersistentId:
        return resource_ref(self.resource_id)

    def __repr__(self) -> str:
        return f"<PerWorkerResource {self.resource_id} on worker:{self.worker_index}>"


class PerWorkerValues:
    """One value per worker; a closure receiving it as an argument gets its own worker's value.

    Workers that join later get their value created when they join.
    Subclasses override :meth:`value_for`.
    """

    def __init__(self, values: Sequence[Any]) -> None:
        self._values = list(values)

    @property
    def values(self) -> tuple[Any, ...]:
        return tuple(self._values)

    def value_for(self, worker_index: int) -> Any:
        """The value a closure running on worker ``worker_index`` receives."""
        return self._values[worker_index]

    def __repr__(self) -> str:
        return f"PerWorkerValues({self._values!r})"


class PerWorkerResourceValues(PerWorkerValues):
    """PerWorkerValues for a per-worker resource: worker ``i`` always maps to the resource on ``i``."""

    def __init__(self, resource_id: int, builds: Any = None) -> None:
        self.resource_id = resource_id
        #: The coordinator's record of how the resource's builds ended (``Cluster``'s; None: not kept).
        self.builds = builds

    @property
    def values(self) -> tuple[Any, ...]:  # pragma: no cover - informational
        raise AttributeError("per-worker resource handles are resolved per worker; pass them to schedule()")

    def value_for(self, worker_index: int) -> Any:
        return PerWorkerResource(self.resource_id, worker_index)

    def __repr__(self) -> str:
        return f"PerWorkerValues(resource={self.resource_id})"


def _is_per_worker(x: Any) -> bool:
    return isinstance(x, PerWorkerValues)


def resolve_per_worker(structure: Any, worker_index: int) -> Any:
    """``structure`` with every :class:`PerWorkerValues` leaf replaced by worker ``worker_index``'s value."""
    return jax.tree.map(
        lambda x: x.value_for(worker_index) if isinstance(x, PerWorkerValues) else x, structure, is_leaf=_is_per_worker
    )
