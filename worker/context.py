"""The task context: what code running in a jaxdist task may ask about where it runs.

A :class:`TaskContext` carries what used to be process globals: the task's
:class:`~jaxdist.transport.credentials.Credentials`, the PS connections that
variable handles without their own connections go through, which worker this
is (index and count) and the identity of the closure whose pushes are being
made. It lives in a :class:`contextvars.ContextVar`, so several tasks can live
in one process (the in-process test cluster, :mod:`jaxdist.testing`): each
worker service runs every closure and ``dataset_fn`` inside its own context.

**Threads.** A thread does not inherit a ``ContextVar`` (Python 3.11). So that
every push made inside a closure carries an update identity,
:func:`inherit_in_threads` (installed by every worker service) makes a
``threading.Thread`` started inside a closure, and each call submitted to a
``concurrent.futures.ThreadPoolExecutor`` there, run in the closure's context
with a *child* identity of its own: ``<parent>/<site>.<n>``, where ``site``
names the line that started it (module, function, line) and ``n`` counts the
threads started from that line by the parent so far. A re-run of the closure
that starts its threads from the same lines in the same order gives them the
same identities, whatever the scheduling, so their pushes are deduplicated
like the closure's own. Outside closures threads start as before.

Such a thread keeps its identity when it switches to a copy of the closure's
context (``contextvars.copy_context().run``, as ``asyncio.to_thread`` does).
A push made on a worker from a thread without an identity of its own (one
started by other means, with no context or sharing another thread's through
``copy_context().run``: its pushes have no fixed position) is refused with
:class:`~jaxdist.base.errors.UnidentifiedPushError` before anything is sent,
never sent as an at-least-once push.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import hashlib
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from types import FrameType
from typing import Any, TypeVar

from jaxdist.base.errors import ConfigurationError, UnidentifiedPushError
from jaxdist.ps_server.connections import PSConnections
from jaxdist.transport.credentials import Credentials
from jaxdist.transport.credentials import PLAINTEXT

__all__ = [
    "ClosureIdentity",
    "TaskContext",
    "current",
    "current_num_workers",
    "current_ps",
    "current_contributor",
    "current_sync_step",
    "current_worker_index",
    "inherit_in_threads",
    "next_update_id",
    "note_sync_step",
    "use",
]


_T = TypeVar("_T")

_SHARED = (
    "a push from a thread that shares the closure's context (contextvars.copy_context().run) without an identity "
    "of its own has no fixed position among the closure's pushes, so a re-run could apply it twice: start the "
    "thread with threading.Thread or a concurrent.futures.ThreadPoolExecutor inside the closure (each gets an "
    "identity of its own), or push from the closure's thread"
)
_NONE = (
    "a push on a worker from a thread without the closure's identity: it could be applied twice if the closure "
    "is re-run. Start helper threads inside the closure with threading.Thread or a "
    "concurrent.futures.ThreadPoolExecutor (they inherit the closure's identity), or push from the closure's thread"
)


class ClosureIdentity:
    """The identities of the pushes one thread of a closure attempt makes: ``prefix/<signature>.<n>``.

    A push's identity follows what it names: its ``signature`` (the digest of
    the variables and ops it touches, :func:`jaxdist.ps_server.store.push_digest`)
    and ``n``, its count among this thread's pushes with that signature
    (``prefix/1``, ``prefix/2``, ... for pushes without a signature). A closure
    re-run after its worker failed gets the same prefix (coordinator run and
    closure id), so its ``n``-th push of the same variables and ops repeats the
    identity of the first attempt's, and each PS applies it at most once,
    whatever else either attempt pushed in between: a re-run that takes another
    path (a data-dependent loop that runs fewer rounds, a branch on a value
    read from the PS) neither collides with the first attempt's pushes nor
    repeats them. A thread the closure starts gets a :meth:`child` identity
    (its own counts), so pushes of concurrent threads never race for positions.

    An identity belongs to one thread (the one that made it, or for a child
    the one that calls :meth:`bind`): a push from another thread sharing it
    (``contextvars.copy_context().run``) would take a position that depends on
    scheduling, so :meth:`next_update_id` refuses it.
    """

    __slots__ = ("prefix", "_counts", "_children", "_owner", "_lock", "sync_step", "pushed")

    def __init__(self, prefix: str, owner: int | None = None, pushed: threading.Event | None = None) -> None:
        self.prefix = prefix
        #: Set once this closure attempt (any of its threads: children share it) asked for a push
        #: identity, i.e. made a push that may have been applied.
        self.pushed = pushed if pushed is not None else threading.Event()
        #: Pushes made so far, per signature ("": pushes without one).
        self._counts: dict[str, int] = {}
        self._children: dict[str, int] = {}
        #: ``threading.get_ident()`` of the thread whose pushes these are (0: not bound yet).
        self._owner = threading.get_ident() if owner is None else owner
        self._lock = threading.Lock()
        #: The synchronous step this closure's gradients belong to, as its last pull learnt it (-1: none).
        self.sync_step = -1

    def bind(self) -> None:
        """Make the calling thread the owner (a child identity, in the thread or call it was made for)."""
        self._owner = threading.get_ident()

    def owned_by_caller(self) -> bool:
        """Whether the calling thread is the one whose pushes these identities are."""
        return threading.get_ident() == self._owner

    def next_update_id(self, signature: str = "") -> str:
        """The identity of this thread's next push naming ``signature``: ``prefix/<signature>.<n>``
        for its ``n``-th such push (``prefix/<n>`` without a signature: a position among every push
        without one).

        Raises:
            UnidentifiedPushError: called from another thread than the owner.
        """
        if not self.owned_by_caller():
            raise UnidentifiedPushError(_SHARED)
        self.pushed.set()
        with self._lock:
            n = self._counts[signature] = self._counts.get(signature, 0) + 1
        return f"{self.prefix}/{signature}.{n}" if signature else f"{self.prefix}/{n}"

    def child(self, site: str) -> ClosureIdentity:
        """A new identity ``prefix/<site>.<n>`` for the ``n``-th thread (or submitted call) started
        from ``site`` by this identity's thread; unbound until :meth:`bind`."""
        with self._lock:
            n = self._children[site] = self._children.get(site, 0) + 1
        return ClosureIdentity(f"{self.prefix}/{site}.{n}", owner=0, pushed=self.pushed)


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
        """This context with a fresh push identity under ``prefix`` (owned by the calling thread)."""
        return replace(self, identity=ClosureIdentity(prefix))

    def for_child(self, site: str) -> TaskContext:
        """This context for a thread started from ``site`` by the identity's thread (see :meth:`ClosureIdentity.child`)."""
        assert self.identity is not None
        return replace(self, identity=self.identity.child(site))


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


def next_update_id(own_connections: bool = True, signature: str = "") -> str:
    """The next push identity of the running closure's thread; "" for a push that carries none.

    The identity is the context's, if it belongs to this thread; else the one
    this thread got when the closure started it (it may have switched to a
    copy of the closure's context since). See :meth:`ClosureIdentity.next_update_id`.

    Args:
        own_connections: whether the pushed variables have connections of
            their own (the coordinator's handles); False for handles that
            push through the task's connections (a worker's).
        signature: what the push names (:func:`jaxdist.ps_server.store.push_digest`
            of the whole push, every PS's part): the identity counts pushes per
            signature, so a re-run closure's pushes line up with its first
            attempt's by what they update, not by their place among all pushes.

    Raises:
        UnidentifiedPushError: a push inside a closure's context from a thread
            without an identity of its own, or a worker-side push
            (``own_connections`` False) from a thread with none: it cannot be
            deduplicated, so it is not sent.
    """
    ctx = _current.get()
    shared = ctx.identity if ctx is not None else None
    if shared is not None and shared.owned_by_caller():
        return shared.next_update_id(signature)
    own: ClosureIdentity | None = getattr(_thread_identity, "identity", None)
    if own is not None:
        return own.next_update_id(signature)
    if shared is not None:
        raise UnidentifiedPushError(_SHARED)
    if not own_connections:
        raise UnidentifiedPushError(_NONE)
    return ""


# ---------------------------------------------------------------- threads inherit the closure's context
_inherit_lock = threading.Lock()
_inheriting = False
#: Set while ThreadPoolExecutor.submit runs: the pool's own threads started there carry no closure context.
_in_submit = threading.local()
#: The identity a thread (or executor call) got when a closure started it, whatever context it runs in.
_thread_identity = threading.local()


def _site(frame: FrameType | None) -> str:
    """A short, host-independent name of the line ``frame`` is at: module, function and line."""
    if frame is None:
        return "0" * 8
    code = frame.f_code
    where = f"{frame.f_globals.get('__name__', '')}:{getattr(code, 'co_qualname', code.co_name)}:{frame.f_lineno}"
    return hashlib.blake2b(where.encode(), digest_size=4).hexdigest()


def _run_as(ctx: TaskContext, fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Run ``fn`` in ``ctx``, whose identity becomes the calling thread's (for the call)."""
    assert ctx.identity is not None
    ctx.identity.bind()
    outer = getattr(_thread_identity, "identity", None)
    _thread_identity.identity = ctx.identity
    try:
        with use(ctx):
            return fn(*args, **kwargs)
    finally:
        _thread_identity.identity = outer


def _closure_context() -> TaskContext | None:
    ctx = _current.get()
    return ctx if ctx is not None and ctx.identity is not None else None


def inherit_in_threads() -> None:
    """Make threads and executor calls started inside a closure run in its context (idempotent, process-wide).

    ``threading.Thread.start`` and ``concurrent.futures.ThreadPoolExecutor.submit``
    called from a closure's context give the new thread (or the submitted
    call) that context with a child identity (:meth:`TaskContext.for_child`);
    called anywhere else they behave exactly as before. An executor's own
    worker threads carry no context (the calls they run each carry their
    submitter's).
    """
    global _inheriting
    with _inherit_lock:
        if _inheriting:
            return
        _inheriting = True
        # Typed loosely: they are wrapped and replaced, whatever their exact stub signatures.
        start: Callable[..., None] = threading.Thread.start
        submit: Callable[..., concurrent.futures.Future[Any]] = concurrent.futures.ThreadPoolExecutor.submit

        @functools.wraps(start)
        def start_in_context(self: threading.Thread) -> None:
            ctx = _closure_context()
            if ctx is not None and self.ident is None and not getattr(_in_submit, "active", False):
                child = ctx.for_child(_site(sys._getframe(1)))
                self.run = functools.partial(_run_as, child, self.run)  # type: ignore[method-assign]
            start(self)

        @functools.wraps(submit)
        def submit_in_context(self: concurrent.futures.ThreadPoolExecutor, fn: Callable[..., Any], /, *args: Any,
                              **kwargs: Any) -> concurrent.futures.Future[Any]:
            ctx = _closure_context()
            if ctx is None:
                return submit(self, fn, *args, **kwargs)
            child = ctx.for_child(_site(sys._getframe(1)))
            outer = getattr(_in_submit, "active", False)
            _in_submit.active = True
            try:
                return submit(self, _run_as, child, fn, *args, **kwargs)
            finally:
                _in_submit.active = outer

        setattr(threading.Thread, "start", start_in_context)  # noqa: B010 - a method replaced on purpose
        setattr(concurrent.futures.ThreadPoolExecutor, "submit", submit_in_context)  # noqa: B010


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
