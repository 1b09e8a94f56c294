"""Events shared by a test and the closures it schedules on an ``InProcessCluster``.

Closures travel pickled by value with their test module, so an object they
capture is a copy on the worker (and a ``threading.Event`` cannot be pickled
at all). A closure that calls ``inprocess_gates.event(name)`` finds this module
by reference instead: the worker services live in the test's process, so it is
the test's own event. Names are made unique per test with :func:`new_name`.
"""

from __future__ import annotations

import itertools
import threading

_lock = threading.Lock()
_events: dict[str, threading.Event] = {}
_arrivals: dict[str, int] = {}
_ids = itertools.count()


def new_name(prefix: str) -> str:
    return f"{prefix}-{next(_ids)}"


def event(name: str) -> threading.Event:
    """The event called ``name`` (made on first use)."""
    with _lock:
        ev = _events.get(name)
        if ev is None:
            ev = _events[name] = threading.Event()
        return ev


def arrive(name: str) -> None:
    """Count one arrival at ``name`` (a closure saying it started)."""
    with _lock:
        _arrivals[name] = _arrivals.get(name, 0) + 1


def arrivals(name: str) -> int:
    with _lock:
        return _arrivals.get(name, 0)
