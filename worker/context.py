"""The task context: what code running in a jaxdist task may ask about where it runs.

A :class:`TaskContext` carries what used to be process globals: the task's
:class:`~jaxdist.transport.credentials.Credentials`, the PS connections that
variable handles without their own connections go through, which worker this
is (index and count) and the identity of the closure whose pushes are being
made. It lives in a :class:`contextvars.ContextVar`, so several tasks can live
in one process (the in-process test cluster, :mod:`jaxdist.testing`): each
worker service runs every closure and ``dataset_fn`` inside its own context.

**Threads.** A thread does not inherit a ``ContextVar`` (Python 3.11). A
thread that a closure starts therefore sees no context of its own; it falls
back to the context of the process's *only* worker service when exactly one
lives in the process (the usual case: one ``jaxdist worker`` per process),
without the closure's identity. To run code in a helper thread with the
closure's context, start it with ``contextvars.copy_context().run``.
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Iterator
from dataclasses import dataclass, replace

from jaxdist.base.errors import ConfigurationError
from jaxdist.ps_server.connections import PSConnections
from jaxdist.transport.credentials import Credentials
from jaxdist.transport.rpc import PLAINTEXT

__all__ = [
    "ClosureIdentity",
    "TaskContext",
    "current",
    "current_num_workers",
    "current_ps",
    "current_contributor",
    "current_sync_step",
    "current_worker_index",
    "next_update_id",
    "note_sync_step",
    "use",
]


class ClosureIdentity:
    """The identities of the pushes one closure attempt makes: ``prefix/1``, ``prefix/2``, ...

    A closure re-run after its worker failed gets the same prefix (coordinator
    run and closure id), so its pushes repeat their identities and each PS
    applies each of them at most once.
    """

    __slots__ = ("prefix", "_seq", "_lock", "sync_step")

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._seq = 0
        self._lock = threading.Lock()
        #: The synchronous step this closure's gradients belong to, as its last pull learnt it (-1: none).
        self.sync_step = -1

    def next_update_id(self) -> str:
        with self._lock:
            self._seq += 1
            return f"{self.prefix}/{self._seq}"


@dataclass(frozen=True)
class TaskContext:
    """Where the running code is: one task's credentials, PS connections and identity.

    Attributes:
        credentials: token and TLS material of the task.
        ps: the task's connections to the PS tasks (a worker's, once configured).
        worker_index: this worker's index (None outside a worker).
        num_workers: worker slots in the job (None outside a worker).
        identity: the running closure's push identity (None outside a closure).
    """

    credentials: Credentials = PLAINTEXT
    ps: PSConnections | None = None
    worker_index: int | None = None
    num_workers: int | None = None
    identity: ClosureIdentity | None = None

    def for_closure(self, prefix: str) -> TaskContext:
        """This context with a fresh push identity ``prefix/1, prefix/2, ...``."""
        return replace(self, identity=ClosureIdentity(prefix))


_current: contextvars.ContextVar[TaskContext | None] = contextvars.ContextVar("jaxdist_task_context", default=None)

# Contexts of the worker services living in this process, for threads without a context.
_services: dict[int, TaskContext] = {}
_services_lock = threading.Lock()


def register_service(key: int, ctx: TaskContext | None) -> None:
    """Record (``ctx``) or forget (None) the base context of worker service ``key`` in this process."""
    with _services_lock:
        if ctx is None:
            _services.pop(key, None)
        else:
            _services[key] = ctx


def current() -> TaskContext | None:
    """The context of the running code; else the sole worker service's in this process; else None."""
    ctx = _current.get()
    if ctx is not None:
        return ctx
    with _services_lock:
        if len(_services) == 1:
            return next(iter(_services.values()))
    return None


@contextlib.contextmanager
def use(ctx: TaskContext) -> Iterator[TaskContext]:
    """Run the ``with`` block in ``ctx`` (restored afterwards, also on error)."""
    token = _current.set(ctx)
    try:
        yield ctx
    finally:
        _current.reset(token)


def current_ps() -> PSConnections:
    """The PS connections of the running task.

    Raises:
        ConfigurationError: no task context with PS connections here.
    """
    ctx = current()
    if ctx is None or ctx.ps is None:
        raise ConfigurationError(
            "no parameter servers are connected here: use variables created by a ParameterServerStrategy "
            "(on the coordinator), or call this inside a closure on a jaxdist worker (in a thread the closure "
            "starts, pass the closure's context: contextvars.copy_context().run)"
        )
    return ctx.ps


def next_update_id() -> str:
    """The next push identity of the running closure; "" outside a closure (no deduplication)."""
    ctx = _current.get()
    if ctx is None or ctx.identity is None:
        return ""
    return ctx.identity.next_update_id()


def current_contributor() -> int:
    """The worker index of the running closure, which takes part in synchronous steps under it;
    -1 outside a closure (the coordinator's own pulls and pushes never wait or stage)."""
    ctx = _current.get()
    if ctx is None or ctx.identity is None or ctx.worker_index is None:
        return -1
    return ctx.worker_index


def note_sync_step(step: int) -> None:
    """Record the synchronous step the running closure's pull reported (see :func:`current_sync_step`)."""
    ctx = _current.get()
    if ctx is not None and ctx.identity is not None:
        ctx.identity.sync_step = step


def current_sync_step() -> int:
    """Inside a closure of synchronous or bounded-stale training: the step its gradients join (learnt
    by its last pull; the step it computes on has at least ``step - staleness`` steps applied).
    -1 before a pull, under asynchronous training, or outside a closure."""
    ctx = _current.get()
    if ctx is None or ctx.identity is None:
        return -1
    return ctx.identity.sync_step


def current_worker_index() -> int:
    """Index of the worker running the current closure or ``dataset_fn``.

    Use it to shard input per worker, e.g. ``ds[current_worker_index()::num_workers]``.

    Raises:
        RuntimeError: called outside a jaxdist worker.
    """
    ctx = current()
    if ctx is None or ctx.worker_index is None:
        raise RuntimeError("current_worker_index() is only defined inside closures and dataset_fns running on a jaxdist worker")
    return ctx.worker_index


def current_num_workers() -> int:
    """Worker slots of the job, as the coordinator counts them (inside closures and ``dataset_fn``)."""
    ctx = current()
    if ctx is None or ctx.num_workers is None:
        raise RuntimeError("current_num_workers() is only defined on a jaxdist worker")
    return ctx.num_workers
