"""The compiled programs of ``strategy.run``: what one is, the cache that keeps them, and when one is stale.

``strategy.run`` (:mod:`jaxdist.sync.loops`) compiles ``fn`` once per
(function, argument structure and signature) and keeps the result in the
strategy's :class:`ProgramCache` (an LRU of :data:`RUN_CACHE_SIZE`). A cached
program bakes in the globals and closure variables ``fn`` read when it was
traced: :func:`captures` records them and :func:`changed_capture` tells when
one was rebound since, so ``run`` traces again instead of using stale values.
"""

from __future__ import annotations

import threading
import types
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from jaxdist.sync.variables import SyncVariable

__all__ = ["Program", "ProgramCache", "RETRACE_WARN_AFTER", "RUN_CACHE_SIZE", "captures", "changed_capture", "fn_key"]

#: Compiled ``run`` programs kept per strategy (LRU). Each entry is one traced
#: function and input signature; 64 covers a train step, an eval step and a
#: few shapes (e.g. a short last batch) with room to spare, while bounding the
#: memory that executables of one-off lambdas could pin.
RUN_CACHE_SIZE = 64

#: A function whose captured globals change on this many consecutive calls is
#: retraced each time (correct, but slow): warn once, naming the global.
RETRACE_WARN_AFTER = 3


@dataclass
class Program:
    """One compiled ``run``: the jitted shard_map plus how to rebuild its outputs."""

    jitted: Callable[..., Any]
    out_tree: Any
    out_varying: list[bool]
    variables: list[SyncVariable]
    assigned: list[SyncVariable]
    rows_used: bool
    captures: list[tuple[Any, Any, Any]] = field(default_factory=list)
    owner: Any = None  # weakref to a bound method's instance
    retraces: int = 0


class ProgramCache:
    """An LRU of compiled programs by key, safe to use from several threads.

    A key is ``(fn_key(fn), in_tree, kinds, signature, statics, steps, scanned, nested)``
    (built by :func:`jaxdist.sync.loops.run_program`).
    """

    def __init__(self, size: int = RUN_CACHE_SIZE) -> None:
        self._size = size
        self._programs: OrderedDict[Any, Program] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Program | None:
        """The program under ``key`` (now the most recently used), or None."""
        with self._lock:
            program = self._programs.get(key)
            if program is not None:
                self._programs.move_to_end(key)
            return program

    def put(self, key: Any, program: Program) -> None:
        """Keep ``program`` under ``key``, dropping the least recently used past the size."""
        with self._lock:
            self._programs[key] = program
            while len(self._programs) > self._size:
                self._programs.popitem(last=False)

    def keys(self) -> list[Any]:
        """The keys cached now, least recently used first."""
        with self._lock:
            return list(self._programs)

    def __len__(self) -> int:
        return len(self._programs)


# ---------------------------------------------------------------------------------------
# The run-cache trap: functions whose captured globals changed since they were traced
# ---------------------------------------------------------------------------------------

#: Modules whose functions are library code, not user code: not scanned for captured globals.
_LIBRARY_PREFIXES = ("jax", "jaxlib", "numpy", "optax", "jaxdist", "flax", "haiku", "equinox", "chex", "ml_dtypes")


#: Depth to which functions held in closure cells (helpers defined beside the run function) are
#: keyed by their code too; deeper ones are keyed by identity.
_KEY_DEPTH = 3
#: Types whose values are keyed by value (immutable, compared exactly, hashed cheaply).
_VALUE_TYPES = frozenset({int, bool, str, bytes, type(None), type(Ellipsis)})


class _Identity:
    """A key part that is one object, compared by identity, and that keeps the object alive.

    Holding the object is the safety of identity keys: while the key is in a
    cache, no other object can be born with the same ``id`` and be taken for it.
    """

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Identity) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<identity of {type(self.obj).__name__} at {id(self.obj):#x}>"


def _value_key(v: Any, depth: int) -> Any:
    """How a captured value enters a function's cache key.

    Immutable scalars and strings by value and exact type (``1``, ``1.0`` and
    ``True`` are different constants to a trace; floats by ``repr``, so
    ``-0.0`` and ``0.0`` differ and a NaN equals itself; numpy scalars by
    their type and bytes); tuples of those
    element by element; user functions by their own code key; anything else
    (arrays, lists, dicts, models, variables, strategies) by identity. An
    array or a list is unhashable, and equal contents would not prove that the
    trace's baked-in constants are the same without comparing them all, so
    identity is the only cheap, exact test: the same object hits, a new one
    traces again.
    """
    t = type(v)
    if t in _VALUE_TYPES:
        return (t, v)
    if t is float or t is complex:
        return (t, repr(v))
    if isinstance(v, np.generic) and v.dtype.kind in "biufc":  # a numpy scalar: immutable, by its exact bytes
        return (t, v.tobytes())
    if t is tuple:
        return (tuple, tuple(_value_key(x, depth) for x in v))
    if t is types.FunctionType and depth < _KEY_DEPTH and not _is_library(v):
        return _function_key(v, depth + 1)
    return _Identity(v)


def _is_library(f: Any) -> bool:
    return str(getattr(f, "__module__", "") or "").startswith(_LIBRARY_PREFIXES)


_EMPTY_CELL = ("empty cell",)


def _function_key(f: types.FunctionType, depth: int) -> Any:
    """A plain function's key: its code, its globals, and what its closure cells and defaults hold.

    This is ``tf.function``'s rule for a function object made anew on every
    call (a ``replica_fn`` defined inside the function a closure runs): two
    function objects made by the same ``def`` with the same captured values
    are the same program, so ``run`` compiles once. A cell or default that
    holds another value (by :func:`_value_key`'s comparison) is another key,
    so a changed captured value traces again instead of using a stale one.
    """
    cells = []
    for cell in f.__closure__ or ():
        try:
            cells.append(_value_key(cell.cell_contents, depth))
        except ValueError:  # an empty cell (a name assigned later)
            cells.append(_EMPTY_CELL)
    defaults = tuple(_value_key(d, depth) for d in f.__defaults__ or ())
    kwdefaults = tuple(sorted((k, _value_key(d, depth)) for k, d in (f.__kwdefaults__ or {}).items()))
    return ("code", f.__code__, _Identity(f.__globals__), tuple(cells), defaults, kwdefaults)


def fn_key(fn: Callable[..., Any]) -> Any:
    """Cache key of a callable.

    Bound methods by (function, instance id); plain Python functions by their
    code and captured values (:func:`_function_key`), so a function defined
    inside the caller's loop body or closure compiles once; any other
    callable (a ``functools.partial``, a jitted function, an object with
    ``__call__``) by identity.
    """
    if isinstance(fn, types.MethodType):
        return ("method", fn.__func__, id(fn.__self__))
    if type(fn) is types.FunctionType:
        return _function_key(fn, 0)
    return fn


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= _code_names(c)
    return names


def captures(fn: Callable[..., Any], depth: int = 0, seen: set[int] | None = None) -> list[tuple[Any, Any, Any]]:
    """``(holder, key, value)`` for every global and closure cell ``fn`` (and user functions it calls) reads.

    A cached compiled program bakes these values in; if one is rebound, the
    program is stale. Functions of libraries (jax, numpy, optax, jaxdist...)
    are not scanned. Attribute lookups (``self.model``) and in-place
    mutation of an array are not visible here.
    """
    seen = set() if seen is None else seen
    f = fn.__func__ if isinstance(fn, types.MethodType) else fn
    if hasattr(f, "func") and hasattr(f, "args"):  # functools.partial
        f = f.func
    code = getattr(f, "__code__", None)
    if code is None or id(f) in seen or depth > 2:
        return []
    seen.add(id(f))
    out: list[tuple[Any, Any, Any]] = []
    for cell in getattr(f, "__closure__", None) or ():
        try:
            out.append((cell, None, cell.cell_contents))
        except ValueError:  # an empty cell (a name assigned later)
            pass
    glb = getattr(f, "__globals__", {})
    for name in sorted(_code_names(code)):
        if name in glb:
            out.append((glb, name, glb[name]))
    for _, _, v in list(out):
        if isinstance(v, types.FunctionType) and not str(getattr(v, "__module__", "") or "").startswith(
            _LIBRARY_PREFIXES
        ):
            out.extend(captures(v, depth + 1, seen))
    return out


def changed_capture(caps: list[tuple[Any, Any, Any]]) -> str | None:
    """The name of the first captured global/cell that no longer holds the traced object, else None."""
    for holder, key, value in caps:
        if key is None:
            try:
                now = holder.cell_contents
            except ValueError:
                return "<closure cell>"
            if now is not value:
                return "<closure variable>"
        elif holder.get(key, _MISSING) is not value:
            return str(key)
    return None


_MISSING = object()
