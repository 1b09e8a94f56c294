"""The sync core's scope and trace hooks: what ``strategy.scope()`` and the traces of compiled code also enter.

The registry is :mod:`jaxdist.base.hooks` (in the shared base, so that ``import jaxdist`` registers Keras's
stand-in hook without importing the sync wing); this module is the sync core's name for it and re-exports
every name, documented there. Code built on the sync core (the Keras integration) registers its hooks through
either name: they are one registry.
"""

from __future__ import annotations

from jaxdist.base.hooks import (
    ScopeHook,
    TraceHook,
    entered_scope_hooks,
    entered_trace_hooks,
    register_scope_hook,
    register_trace_hook,
    scope_hooks,
    trace_hooks,
    unregister_scope_hook,
    unregister_trace_hook,
)

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
