"""Closures and the coordinator's closure queue (no gRPC, no threads started here).

Queue contract (TF's ``_CoordinatedClosureQueue``, made exact):

- ``put`` blocks only while ``max_size`` closures are queued.
- A closure that fails with a user error records that error (the first one
  wins) and cancels every queued closure: their RemoteValues become ABORTED
  and ``fetch()`` raises :class:`jaxdist.base.errors.CancelledError`.
- The recorded error is raised once, by the next ``raise_if_error`` (called
  from ``schedule``/``join``/``done``), and then cleared.
- ``wait`` (``join``) returns when nothing is queued or running; if an error
  was recorded it waits for the running closures to finish, then raises it.
- ``retry`` re-queues a closure whose worker failed while it may have run
  (at the front, so it runs next; its ``attempt`` and the ``retried``
  count go up); ``return_unrun`` re-queues one that certainly never ran
  (its batch was skipped, its function had to be resent, its arguments
  were never sent): same place, no attempt counted. After an error (or a
  stop) both cancel the closure instead.
- ``set_held`` stops handing out closures while a PS is suspect (a level,
  set from the failure handler's state); ``pause``/``resume`` are the
  nestable quiet points of checkpoints. Either stops dispatch.
- ``pause(drain=True)`` (a checkpoint save's) also settles the closures
  that may have run in part: untagged closures re-queued by ``retry``
  (``attempt > 0``) are still handed out while every pause in effect is
  such a draining one, and it returns only once none is queued or running.
  Its quiet point then holds no half-applied closure: every update on the
  PS tasks belongs to a closure that finished, and every queued closure
  never ran.
- Tagged closures run only on their worker (per-worker resources) and take
  precedence over untagged ones on that worker.
"""

from __future__ import annotations

import collections
import hashlib
import itertools
import os
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from jaxdist.base.errors import CancelledError
from jaxdist.proto import pickling
from jaxdist.cluster_coordinator.remote_value import RemoteValue

#: Closures waiting in the queue before ``schedule`` blocks. TF uses 256K; we
#: keep it smaller because every queued closure holds its arguments in memory.
DEFAULT_MAX_QUEUED = 64 * 1024

_ids = itertools.count(1)


_STDLIB_PREFIXES = tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})


def _ship_module_by_value(fn: Callable[..., Any]) -> None:
    """Make the user's own modules travel with their functions.

    cloudpickle ships ``__main__`` functions by value but names functions of
    importable modules by reference, which a worker can only resolve if the
    same module is importable there. User code (a module file outside the
    standard library and site-packages, e.g. ``train.py`` beside the script,
    or a test file) is registered to travel by value instead.
    """
    name = getattr(fn, "__module__", None)
    if not name or name == "__main__" or name in _by_value or name.split(".")[0] == "jaxdist":
        return
    module = sys.modules.get(name)
    path = getattr(module, "__file__", None)
    if module is None or not path:
        return
    path = os.path.abspath(path)
    if not path.startswith(_STDLIB_PREFIXES) and "site-packages" not in path:
        cloudpickle.register_pickle_by_value(module)
    _by_value.add(name)


_by_value: set[str] = set()


class FunctionPayload:
    """A function pickled once, addressed by its sha256 digest."""

    __slots__ = ("digest", "payload", "__weakref__")

    def __init__(self, fn: Callable[..., Any]) -> None:
        _ship_module_by_value(fn)
        self.payload = pickling.dumps(fn)
        self.digest = hashlib.sha256(self.payload).hexdigest()


_payload_cache: weakref.WeakKeyDictionary[Any, FunctionPayload] = weakref.WeakKeyDictionary()
_payload_lock = threading.Lock()


def function_payload(fn: Callable[..., Any]) -> FunctionPayload:
    """Pickle ``fn`` once per function object.

    The function's captured globals and closure cells are snapshotted the
    first time it is scheduled (as TF traces a ``tf.function`` once).
    """
    try:
        with _payload_lock:
            cached = _payload_cache.get(fn)
        if cached is not None:
            return cached
        fp = FunctionPayload(fn)
        with _payload_lock:
            _payload_cache[fn] = fp
        return fp
    except TypeError:  # not weak-referenceable (e.g. a bound builtin): pickle every time
        return FunctionPayload(fn)


@dataclass(eq=False)
class Closure:
    """One scheduled call ``fn(*args, **kwargs)`` and the RemoteValue it settles.

    ``succeed``/``fail``/``cancel`` settle it (once; one of the ledger hooks
    ``on_done``/``on_cancel``/``on_consumed`` runs, at most once).
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    id: int = field(default_factory=lambda: next(_ids))
    attempt: int = 0
    tag: int | None = None  # worker index for per-worker resource closures
    resource_id: int = 0  # non-zero: the result stays on the worker as this resource
    per_worker: bool = False  # arguments hold PerWorkerValues, resolved per worker at dispatch
    on_done: Callable[[], None] | None = None  # called once when it finished successfully
    # Called once when it is cancelled or fails with no push of it possibly applied (its batches go back).
    on_cancel: Callable[[], None] | None = None
    # Called once instead of ``on_cancel`` when it fails or is cancelled after a push of it may have been
    # applied (an attempt made one, or an attempt's worker died): its batches are consumed, never re-issued.
    on_consumed: Callable[[], None] | None = None
    # Per-worker resource closures: told how each build ended (None: built; else the error, a
    # CancelledError when it was cancelled unrun). Called once, after the RemoteValue is settled.
    on_settled: Callable[[BaseException | None], None] | None = None
    remote_value: RemoteValue = field(init=False)
    _fp: FunctionPayload | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        self.remote_value = RemoteValue(self.id)

    @property
    def function(self) -> FunctionPayload:
        if self._fp is None:
            self._fp = function_payload(self.fn)
        return self._fp

    def succeed(self, payload: bytes) -> None:
        """It ran: settle its value with ``payload`` (a resource closure's value stays on its worker)."""
        if not self.resource_id:
            self.remote_value.set_result(payload)
        if self.on_done is not None:
            self.on_done()
        self.on_cancel = self.on_consumed = None
        self._settled(None)

    def fail(self, error: BaseException, pushed: bool = False) -> None:
        """It failed for good: ``fetch()`` raises ``error``. Its data positions go back to the ledger,
        unless a push of it may have been applied (``pushed``: the failing attempt made one; or an
        earlier attempt ran, ``attempt > 0``): then they are consumed (handing them out again would
        apply those pushes twice, under the new closure's push identities)."""
        self._give_back(consumed=pushed or self.attempt > 0)
        self.remote_value.set_error(error)
        self._settled(error)

    def cancel(self, error: BaseException) -> None:
        """It will not run (again): ``fetch()`` raises ``error`` (ABORTED). Its data positions go back,
        unless an earlier attempt ran (``attempt > 0``: re-queued after its worker failed, its pushes
        may be applied): then they are consumed."""
        self._give_back(consumed=self.attempt > 0)
        self.remote_value.set_aborted(error)
        self._settled(error)

    def _settled(self, error: BaseException | None) -> None:
        hook, self.on_settled = self.on_settled, None
        if hook is not None:
            hook(error)

    def _give_back(self, consumed: bool) -> None:
        hook = self.on_consumed if consumed else self.on_cancel
        self.on_cancel = self.on_consumed = None
        if hook is not None:
            hook()


class ClosureQueue:
    """Thread-safe queue of closures with TF's error and cancellation semantics.

    Consumers do not block here: the dispatcher takes closures with
    :meth:`take` when its listener (:meth:`set_listener`) says some may have
    become available, so no thread ever waits per worker. The only threads
    that wait are the user's (``put`` on a full queue, ``wait``/``pause``/
    ``raise_if_error``), and each is woken only when its own condition may
    have changed (room freed; nothing running; an error; a stop).
    """

    def __init__(self, max_size: int = DEFAULT_MAX_QUEUED) -> None:
        self._max_size = max_size
        self._queue: collections.deque[Closure] = collections.deque()
        # Tagged closures per worker; only non-empty deques are kept (the dispatcher scans the keys).
        self._tagged: dict[int, collections.deque[Closure]] = {}
        self._n_tagged = 0
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # put() waiting for room
        self._settled = threading.Condition(self._lock)  # wait/pause/raise_if_error: nothing running, or an error
        self._listener: Callable[[], None] | None = None
        self._inflight = 0
        self._error: BaseException | None = None
        self._stopped = False
        self._paused = 0
        self._draining = 0  # pause(drain=True) calls still waiting (counted in _paused too)
        self._requeued_ran = 0  # untagged closures queued with attempt > 0: they may have run in part
        self._held = False
        self.finished = 0
        self.failed = 0
        self.retried = 0

    def set_listener(self, listener: Callable[[], None] | None) -> None:
        """Call ``listener()`` (from any thread, outside the queue's lock) whenever closures may
        have become available to :meth:`take`: one was queued or re-queued, dispatch was resumed
        or released. It must be cheap and must not block (the dispatcher's wake-up)."""
        self._listener = listener

    def _available(self) -> None:
        listener = self._listener
        if listener is not None:
            listener()

    # --------------------------------------------------------------- producers
    def put(self, closure: Closure) -> None:
        with self._lock:
            while len(self._queue) >= self._max_size and not self._stopped and self._error is None:
                self._room.wait()
            if self._error is not None or self._stopped:
                self._cancel(closure)
                return
            self._queue.append(closure)
        self._available()

    def put_tagged(self, worker: int, closure: Closure) -> None:
        with self._lock:
            closure.tag = worker
            self._tagged.setdefault(worker, collections.deque()).append(closure)
            self._n_tagged += 1
        self._available()

    def put_tagged_front(self, worker: int, closures: list[Closure]) -> None:
        """Queue ``closures`` for ``worker`` ahead of its other tagged closures, in order."""
        if not closures:
            return
        with self._lock:
            q = self._tagged.setdefault(worker, collections.deque())
            for c in reversed(closures):
                c.tag = worker
                q.appendleft(c)
            self._n_tagged += len(closures)
        self._available()

    def drop_tagged(self, worker: int) -> list[Closure]:
        """Remove the closures tagged for ``worker`` (it left); returns them."""
        with self._lock:
            dropped = list(self._tagged.pop(worker, ()))
            self._n_tagged -= len(dropped)
            return dropped

    # --------------------------------------------------------------- consumers
    def take(self, worker: int, max_n: int = 1, *, extend_to: int = 0, extend_fn: Callable[..., Any] | None = None) -> list[Closure]:
        """Up to ``max_n`` closures for ``worker``, at once: its tagged closure first (alone),
        else untagged ones; [] when there is none or dispatch is paused, held or stopped.
        Then, up to ``extend_to`` in all, more untagged ones as long as the next one's function
        is ``extend_fn`` (the dispatcher batches past a fair share only closures it knows are short).
        What is returned counts as running until it is marked finished, failed or re-queued."""
        with self._lock:
            if self._stopped or self._held:
                return []
            if self._paused:
                if not self._draining_now():
                    return []
                return self._take_draining(worker, max_n)
            batch = self._take_tagged(worker)
            if batch:
                return batch
            q = self._queue
            if not q:
                return []
            full = len(q) >= self._max_size
            if max_n == 1:
                batch = [q.popleft()]
            else:
                batch = [q.popleft() for _ in range(min(max_n, len(q)))]
            if extend_fn is not None:
                while len(batch) < extend_to and q and q[0].fn is extend_fn:
                    batch.append(q.popleft())
            self._requeued_ran -= sum(c.attempt > 0 for c in batch)
            self._inflight += len(batch)
            if full:
                self._room.notify(len(batch))
            return batch

    def _take_tagged(self, worker: int) -> list[Closure]:
        """Under the lock: ``worker``'s oldest tagged closure, alone (a resource closure: later
        closures may need the resource), counted as running; [] when it has none."""
        tagged = self._tagged.get(worker)
        if not tagged:
            return []
        batch = [tagged.popleft()]
        self._n_tagged -= 1
        if not tagged:
            del self._tagged[worker]
        self._inflight += 1
        return batch

    def _draining_now(self) -> bool:
        # Under the lock. Every pause in effect drains, and closures that may have run are queued.
        return self._paused == self._draining and self._requeued_ran > 0

    def _take_draining(self, worker: int, max_n: int) -> list[Closure]:
        """Under the lock, during a drain: ``worker``'s tagged closure first (it rebuilds a per-worker
        resource the re-runs may need, and pushes nothing), else up to ``max_n`` queued closures that
        may have run in part (``attempt > 0``), oldest re-queue first; nothing else starts."""
        batch = self._take_tagged(worker)
        if batch:
            return batch
        reruns: list[Closure] = []
        rest: collections.deque[Closure] = collections.deque()
        full = len(self._queue) >= self._max_size
        for c in self._queue:
            (reruns if c.attempt > 0 and len(reruns) < max_n else rest).append(c)
        if not reruns:
            return []
        self._queue = rest
        self._requeued_ran -= len(reruns)
        self._inflight += len(reruns)
        if full:
            self._room.notify(len(reruns))
        return reruns

    def tagged_workers(self) -> list[int]:
        """Workers that have tagged (per-worker resource) closures queued."""
        with self._lock:
            return list(self._tagged)

    def has_untagged(self) -> bool:
        return bool(self._queue)

    def head(self) -> Closure | None:
        """The untagged closure :meth:`take` would hand out next (None: none queued). A glance: it
        stays queued, and another thread may take it first."""
        try:
            return self._queue[0]
        except IndexError:
            return None

    def _settle_check(self) -> None:
        # Under the lock. Waiters want: nothing running (pause, raise_if_error), nothing queued or
        # running (wait), an error, or a stop; wake them only then, not for every finished batch.
        if self._inflight == 0 or self._error is not None or self._stopped:
            self._settled.notify_all()

    def mark_finished(self, n: int = 1) -> None:
        with self._lock:
            self._inflight -= n
            self.finished += n
            self._settle_check()

    def mark_failed(self, error: BaseException, record: bool = True) -> None:
        """A running closure failed with a non-retryable error. ``record=False``: count it, but
        record no error (a per-worker input that failed fails its consumers, not the job)."""
        with self._lock:
            self._inflight -= 1
            self.failed += 1
            if record and self._error is None:
                self._error = error
                self._cancel_all_queued()
                self._room.notify_all()
            self._settle_check()

    def retry(self, closure: Closure) -> None:
        """Re-queue a running closure whose worker failed before reporting it: a new attempt."""
        self._requeue(closure, new_attempt=True)

    def return_unrun(self, closure: Closure) -> None:
        """Re-queue a closure handed out that certainly did not run: no attempt is counted."""
        self._requeue(closure, new_attempt=False)

    def _requeue(self, closure: Closure, new_attempt: bool) -> None:
        with self._lock:
            self._inflight -= 1
            requeued = self._error is None and not self._stopped
            if not requeued:
                self._cancel(closure)
            else:
                if new_attempt:
                    closure.attempt += 1
                    self.retried += 1
                if closure.tag is not None:
                    self._tagged.setdefault(closure.tag, collections.deque()).appendleft(closure)
                    self._n_tagged += 1
                else:
                    self._queue.appendleft(closure)
                    if closure.attempt > 0:
                        self._requeued_ran += 1
            self._settle_check()
        if requeued:
            self._available()

    # ------------------------------------------------------------------- error
    def _cancel(self, closure: Closure) -> None:
        closure.cancel(
            CancelledError(f"closure {closure.id} was cancelled because an earlier closure failed; please reschedule the function")
        )

    def _cancel_all_queued(self) -> None:
        for c in self._queue:
            self._cancel(c)
        self._queue.clear()
        self._requeued_ran = 0
        for q in self._tagged.values():
            for c in q:
                self._cancel(c)
        self._tagged.clear()
        self._n_tagged = 0

    def raise_if_error(self, deadline: float | None = None) -> bool:
        """Raise the recorded error once (after running closures finished), then clear it.

        Exactly one caller gets the error: several threads may be in ``join``/``done``/``schedule``
        at once, and whichever takes the error first clears it while the others wait here for the
        running closures; those find it gone and return (as TF: the error is raised once).

        Returns False, the error still recorded, when ``deadline`` (a ``time.monotonic()`` value;
        None: no limit) passes while closures still run; True when there is no error to raise."""
        with self._lock:
            if self._error is None:
                return True
            while self._inflight > 0 and not self._stopped:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._settled.wait(left)
            err, self._error = self._error, None
        if err is not None:
            raise err
        return True

    def has_error(self) -> bool:
        return self._error is not None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or running (``join``); raise a recorded error.

        Returns False if ``timeout`` passed first.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            # Tagged (per-worker resource) closures still queued do not hold join(): they wait for
            # their worker, which may be down; once a worker takes one it counts as running.
            while (self._queue or self._inflight > 0) and self._error is None and not self._stopped:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._settled.wait(left)
        # The error waits for the running closures too: within the same timeout.
        return self.raise_if_error(deadline)

    def done(self) -> bool:
        """True when nothing is queued or running; raises a recorded error."""
        self.raise_if_error()
        with self._lock:
            return not self._queue and self._inflight == 0

    def fail_all(self, error: BaseException) -> None:
        """Record ``error`` (if none is) and cancel everything queued; it surfaces from join/schedule/done."""
        with self._lock:
            if self._error is None:
                self._error = error
                self._cancel_all_queued()
            self._room.notify_all()
            self._settled.notify_all()

    def pause(self, timeout: float | None = None, drain: bool = False) -> bool:
        """Stop handing out closures and wait until none is running (a quiet point); nestable.

        With ``drain``, closures re-queued after their worker failed
        (``attempt > 0``: they may have run in part, their updates partly
        applied) are still handed out while every pause in effect drains,
        and the wait lasts until none of them is queued or running either
        (their re-runs repeat their push identities, so nothing is applied
        twice). Queued closures that never ran stay queued. A drain needs a
        healthy worker to re-run them: it waits for one as long as
        ``timeout`` allows.

        Returns False if running closures (or, draining, re-queued ones) did
        not finish within ``timeout`` (the queue stays paused; call :meth:`resume`).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._paused += 1
            if drain:
                self._draining += 1
            wake = drain and self._draining_now()
        if wake:  # re-queued closures were held back by the pause only: the dispatcher may take them now
            self._available()
        with self._lock:
            try:
                # (A recorded error cancels every queued closure: a drain then waits for the running ones only.)
                while (self._inflight > 0 or (drain and self._requeued_ran > 0)) and not self._stopped:
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        return False
                    self._settled.wait(left)
                return True
            finally:
                if drain:
                    self._draining -= 1

    def resume(self) -> None:
        """Undo one :meth:`pause`."""
        with self._lock:
            self._paused = max(0, self._paused - 1)
            # A drain left alone may go on re-running closures (held back while this pause did not drain).
            resumed = self._paused == 0 or self._draining_now()
        if resumed:
            self._available()

    def set_held(self, held: bool) -> None:
        """Hold (True) or release dispatch; closures running go on. Not nested: a level."""
        with self._lock:
            self._held = held
        if not held:
            self._available()

    @property
    def held(self) -> bool:
        return self._held

    @property
    def dispatching(self) -> bool:
        """False while paused (:meth:`pause`), held (:meth:`set_held`) or stopped. (A draining pause
        still hands out re-queued closures: :attr:`handing_out` is what the dispatcher reads.)"""
        return not (self._paused or self._held or self._stopped)

    @property
    def handing_out(self) -> bool:
        """Whether :meth:`take` may hand out closures now: dispatching, or a drain (``pause(drain=True)``)
        re-running closures that may have run in part."""
        with self._lock:
            if self._held or self._stopped:
                return False
            return not self._paused or self._draining_now()

    def stop(self) -> None:
        """Cancel everything queued and wake every waiter (coordinator shutdown)."""
        with self._lock:
            self._stopped = True
            self._cancel_all_queued()
            self._room.notify_all()
            self._settled.notify_all()

    @property
    def queued(self) -> int:
        return len(self._queue) + self._n_tagged

    @property
    def inflight(self) -> int:
        return self._inflight
