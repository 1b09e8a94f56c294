"""What ``strategy.scope()`` and the traces of compiled code also enter: hooks registered by the code built on
the sync core (the registry itself; the sync core reads it as :mod:`jaxdist.sync.hooks`, which re-exports
every name here).

The registry lives in the shared base, not in :mod:`jaxdist.sync`, so that registering a hook costs no import
of the sync wing (jax, optax): ``import jaxdist`` registers the Keras stand-in below, and a task process (a PS or
a worker: ``jaxdist/__init__`` runs first in every one) never imports the sync wing it does not use. It is pure
Python and imports nothing of jaxdist.

The sync core never imports what is built on it (the Keras integration, :mod:`jaxdist.keras`, is one;
``tests/unit/test_layers.py`` checks it): such code registers a *scope hook* here instead, as the
cluster resolvers register themselves with the code that looks them up. Inside every
``strategy.scope()`` (:func:`jaxdist.sync.context.enter_scope`) each registered hook is called with
the strategy and the context manager it returns is entered, in registration order, after the strategy
became current; they are exited in reverse order before it stops being current.

Registered by jaxdist itself: ``"keras"``, Keras's view of the strategy. ``import jaxdist`` registers
:func:`jaxdist.keras_bridge.scope_hook` (nothing until Keras is imported; on Keras's JAX backend it
imports :mod:`jaxdist.keras`), and ``import jaxdist.keras`` replaces it with
:func:`jaxdist.keras.scope.keras_scope`.

*Trace hooks* are the same for the traces of compiled code: ``strategy.run`` (each trace of ``fn``,
inside its variable frame and replica context), ``run_steps`` on the default strategy and
:func:`jaxdist.function` (each trace of the function, inside its frame) enter every registered trace
hook's context manager around the user's code, in registration order. A hook thus sees the frame
(:func:`jaxdist.sync.context.current_frame`) and replica context the user's code sees; it is how code
built on the core threads state of its own objects through a trace as variables of the frame.
Registered by jaxdist itself: ``"keras"`` (``import jaxdist.keras``): Keras variables read and assigned
in the trace become variables of the frame (:mod:`jaxdist.keras.custom_loop`). While any trace hook is
registered, ``strategy.run`` always runs its discovery trace (a hook's objects may be variables even
when the strategy has none of its own).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "ScopeHook",
    "TraceHook",
    "entered_scope_hooks",
    "entered_trace_hooks",
    "register_scope_hook",
    "register_trace_hook",
    "scope_hooks",
    "trace_hooks",
    "unregister_scope_hook",
    "unregister_trace_hook",
]

#: ``hook(strategy)`` returns the context manager to enter inside ``strategy.scope()``
#: (``contextlib.nullcontext()`` for nothing).
ScopeHook = Callable[[Any], AbstractContextManager[Any]]

#: ``hook(strategy)`` returns the context manager to enter around the user's code in a trace of compiled
#: code (``strategy``: the strategy whose ``run`` traces it, None for :func:`jaxdist.function`).
TraceHook = Callable[[Any], AbstractContextManager[Any]]

_lock = threading.Lock()
_hooks: dict[str, ScopeHook] = {}
_trace_hooks: dict[str, TraceHook] = {}


def register_scope_hook(name: str, hook: ScopeHook) -> None:
    """Enter ``hook(strategy)`` inside every ``strategy.scope()`` from now on.

    A hook already registered under ``name`` is replaced, keeping its place in the order (how
    ``jaxdist.keras`` takes over from the stand-in ``import jaxdist`` registers).
    """
    if not callable(hook):
        raise TypeError(f"scope hook {name!r} must be callable, got {type(hook).__name__}")
    with _lock:
        _hooks[name] = hook


def unregister_scope_hook(name: str) -> ScopeHook | None:
    """Remove the hook registered under ``name``; returns it (None: there was none)."""
    with _lock:
        return _hooks.pop(name, None)


def scope_hooks() -> dict[str, ScopeHook]:
    """The registered hooks by name, in the order they are entered (a copy)."""
    with _lock:
        return dict(_hooks)


@contextlib.contextmanager
def entered_scope_hooks(strategy: Any) -> Iterator[None]:
    """Enter every registered hook's context for ``strategy`` (the hooks registered when the block starts)."""
    with _lock:
        hooks = list(_hooks.values())
    with contextlib.ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook(strategy))
        yield


def register_trace_hook(name: str, hook: TraceHook) -> None:
    """Enter ``hook(strategy)`` around the user's code in every trace of compiled code from now on.

    A hook already registered under ``name`` is replaced, keeping its place in the order.
    """
    if not callable(hook):
        raise TypeError(f"trace hook {name!r} must be callable, got {type(hook).__name__}")
    with _lock:
        _trace_hooks[name] = hook


def unregister_trace_hook(name: str) -> TraceHook | None:
    """Remove the trace hook registered under ``name``; returns it (None: there was none)."""
    with _lock:
        return _trace_hooks.pop(name, None)


def trace_hooks() -> dict[str, TraceHook]:
    """The registered trace hooks by name, in the order they are entered (a copy)."""
    with _lock:
        return dict(_trace_hooks)


@contextlib.contextmanager
def entered_trace_hooks(strategy: Any) -> Iterator[None]:
    """Enter every registered trace hook's context for ``strategy`` (None: a :func:`jaxdist.function` trace)."""
    with _lock:
        hooks = list(_trace_hooks.values())
    if not hooks:
        yield
        return
    with contextlib.ExitStack() as stack:
        for hook in hooks:
            stack.enter_context(hook(strategy))
        yield
