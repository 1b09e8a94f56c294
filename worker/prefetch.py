"""Worker-side prefetch of variables: the next step's read overlaps this step's work.

Opt-in, per call: ``jaxdist.pull(tree, prefetch_next=True)`` and
``jaxdist.push_pull(variables, grads, prefetch_next=True)``. Without those
options nothing here runs and every read is fresh.

How it works. A *slot* per (worker process connections, variables, pull dtype)
holds what the next ``pull(tree, prefetch_next=True)`` of that tree returns:

- ``pull(tree, prefetch_next=True)`` takes the slot's values (waiting for them
  if they are still on the way), or pulls now when the slot is empty, too old
  (:data:`PREFETCH_MAX_AGE_S`) or its read failed. Unless the slot was filled by
  ``push_pull`` (below), it then starts a background pull of the same tree into
  the slot and returns: that read runs on the link's down direction while the
  caller computes and pushes its gradients on the up direction (a full-duplex
  link carries both at once).
- ``push_pull(..., prefetch_next=True)`` puts the values its fused call returned
  (read right after the PS applied the push) into the slot; no background pull
  is started by the next ``pull`` then, since the next push-pull fetches again.

Staleness this introduces (the guarantee). Values returned by
``pull(tree, prefetch_next=True)`` were read on the PS *after* the previous
``pull(tree, prefetch_next=True)`` of the same tree on this worker returned
(background pull), or right after this worker's last ``push_pull(...,
prefetch_next=True)`` was applied. In a loop that reads once per step and
pushes once per step, the values a step computes on therefore hold every
update of this worker except, with the background pull, at most its previous
step's own gradients (a delay of one step, as in a pipelined/"delayed SGD"
PS loop; with ``push_pull`` none are missing), plus the other workers'
updates as any asynchronous PS read does. A slot whose read *started* more
than :data:`PREFETCH_MAX_AGE_S` seconds before it is taken is thrown away and
a fresh pull done, so an idle worker (between epochs, while the coordinator
restores or assigns variables) never computes on an old prefetched copy for
longer than that. Writes this worker makes with ``assign``/``scatter_*`` do
not clear the slot: don't mix them with prefetched reads of the same tree.

Not with synchronous or bounded-stale steps: there a read is also the step
barrier, which a prefetch would skip; ``pull(prefetch_next=True)`` raises
:class:`~jaxdist.base.errors.ConfigurationError` when the PS reports steps.

Lifecycle: background reads run on one small thread pool per process (each
read bounded by its deadline). A slot belongs to one set of PS connections
(its key starts with their ``id``): when a worker replaces or closes its
connections, or a strategy closes, :func:`forget` drops their slots (waiting
for reads in flight) and stops the pool once no slot is left; :func:`clear`
drops them all.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

from jaxdist.worker import context as wctx

logger = logging.getLogger(__name__)

__all__ = ["PREFETCH_MAX_AGE_S", "clear", "forget", "store", "take_and_refill"]

#: A prefetched value whose read started longer ago than this is not used (a fresh pull is made).
PREFETCH_MAX_AGE_S = 10.0

_lock = threading.Lock()
_slots: dict[tuple[Any, ...], _Slot] = {}
_pool: futures.ThreadPoolExecutor | None = None


@dataclasses.dataclass
class _Slot:
    started: float  # time.monotonic() when its read started
    future: futures.Future[Any]
    from_push_pull: bool


def _executor() -> futures.ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="jaxdist-prefetch")
        return _pool


def _background_context() -> wctx.TaskContext | None:
    """The caller's task context without its closure identity: a background read is no closure's
    read (it waits at no step barrier and records no step)."""
    ctx = wctx.current()
    return None if ctx is None else dataclasses.replace(ctx, identity=None)


def _slot_of(key: tuple[Any, ...]) -> _Slot | None:
    with _lock:
        return _slots.pop(key, None)


def take_and_refill(key: tuple[Any, ...], read: Callable[[], Any], check_fresh: Callable[[], None]) -> Any:
    """The values for ``pull(tree, prefetch_next=True)`` (see the module docstring).

    ``key`` starts with ``id()`` of the PS connections read through (see :func:`forget`).
    ``read()`` pulls the tree in the calling context (the caller's own pull);
    ``check_fresh()`` runs after a fresh pull made here, in the caller's
    context, and raises if prefetching is not allowed (synchronous steps).
    """
    slot = _slot_of(key)
    values = None
    refill = True
    if slot is not None:
        age = time.monotonic() - slot.started
        try:
            values = slot.future.result()
        except Exception as e:  # noqa: BLE001 - a failed prefetch is replaced by a fresh read below, whose error counts
            logger.info("prefetched read failed (%s: %s); reading again", type(e).__name__, e)
            values = None
        if values is not None and age > PREFETCH_MAX_AGE_S:
            logger.debug("prefetched values are %.1fs old (more than %.0fs): reading again", age, PREFETCH_MAX_AGE_S)
            values = None
        refill = not (values is not None and slot.from_push_pull)
    if values is None:
        values = read()
        check_fresh()
    if refill:
        ctx = _background_context()

        def background() -> Any:
            if ctx is None:
                return read()
            with wctx.use(ctx):
                return read()

        started = time.monotonic()
        fut = _executor().submit(background)
        with _lock:
            _slots[key] = _Slot(started, fut, from_push_pull=False)
    return values


def store(key: tuple[Any, ...], values: Any, started: float) -> None:
    """Keep ``values`` (read by a push-pull that started at ``started``) for the next prefetching pull."""
    fut: futures.Future[Any] = futures.Future()
    fut.set_result(values)
    with _lock:
        old = _slots.get(key)
        _slots[key] = _Slot(started, fut, from_push_pull=True)
    if old is not None:
        old.future.cancel()  # a background read not started yet is not needed any more


def forget(conns: Any) -> None:
    """Drop the slots of PS connections ``conns`` (the task closes them), waiting for their background
    reads in flight to end; the thread pool is shut down once no slot is left. Called by a worker
    when its connections are replaced or closed, and by a strategy's ``close``."""
    global _pool
    with _lock:
        gone = [k for k in _slots if k[0] == id(conns)]
        slots = [_slots.pop(k) for k in gone]
        pool = _pool if not _slots else None
        if pool is not None:
            _pool = None
    for s in slots:
        s.future.cancel()
    futures.wait([s.future for s in slots])
    if pool is not None:
        pool.shutdown(wait=True)


def clear() -> None:
    """Drop every slot of this process (waiting for background reads in flight) and stop the pool."""
    global _pool
    with _lock:
        slots = list(_slots.values())
        _slots.clear()
        pool, _pool = _pool, None
    for s in slots:
        s.future.cancel()
    futures.wait([s.future for s in slots])
    if pool is not None:
        pool.shutdown(wait=True)
