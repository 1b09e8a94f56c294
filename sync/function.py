"""``jaxdist.function``: compile a whole function that calls ``strategy.run`` (TF's ``@tf.function``).

``jax.jit`` works around functions that call ``strategy.run`` and
``strategy.reduce`` on values passed as arguments. When the function touches
*variables* (a model made with ``jaxdist.create_variables``, an optimizer's
state, metrics), ``jax.jit`` alone would capture their values as constants
and lose the updates; ``jaxdist.function`` threads them through the compiled
function instead: it traces the function once to find the variables it
uses, passes their current values in and writes the updated ones back, so

    @jaxdist.function
    def distributed_train_step(batch):
        per_replica_losses = strategy.run(train_step, args=(batch,))
        return strategy.reduce("sum", per_replica_losses, axis=None)

is one XLA program per input signature, as in TF. Array arguments are
traced; any other argument (strings, objects) is static (hashable, part of
the cache key). Called inside another compiled function it runs inline.
The variables a function uses must not depend on its data.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax

from jaxdist.base.errors import ConfigurationError
from jaxdist.sync import context as ctx_lib
from jaxdist.sync.hooks import entered_trace_hooks
from jaxdist.sync.variables import GlobalFrame, SyncVariable

if TYPE_CHECKING:
    from jaxdist.sync.strategy import Strategy

logger = logging.getLogger(__name__)

__all__ = ["function", "Function"]


def _is_dynamic(x: object) -> bool:
    import numpy as np

    return isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex, bool))


def _aval_key(a: Any) -> tuple[Any, ...]:
    import numpy as np

    if isinstance(a, (int, float, complex, bool)):
        return (type(a).__name__,)
    aval = getattr(a, "aval", None)
    sharding = getattr(a, "sharding", None) if isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) else None
    return (tuple(np.shape(a)), str(a.dtype), bool(getattr(aval, "weak_type", False)), sharding)


class Function:
    """A compiled function that threads jaxdist variables (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        functools.update_wrapper(self, fn)
        self._fn = fn
        self._cache: dict[Any, tuple[Callable[..., Any], list[SyncVariable], list[list[SyncVariable]], set[Strategy]]] = {}
        #: How many times the function was traced (discovery passes not counted).
        self.trace_count = 0

    def __get__(self, obj: Any, objtype: Any = None) -> Any:
        if obj is None:
            return self
        return functools.partial(self, obj)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if ctx_lib.current_frame() is not None or ctx_lib.current_replica() is not None:
            return self._fn(*args, **kwargs)  # nested in compiled code: part of the caller's program
        leaves, tree = jax.tree.flatten((args, kwargs))
        dyn_mask = tuple(_is_dynamic(x) for x in leaves)
        statics = tuple(x for x, d in zip(leaves, dyn_mask) if not d)
        dyn = [x for x, d in zip(leaves, dyn_mask) if d]
        key = (tree, dyn_mask, statics, tuple(_aval_key(a) for a in dyn))
        try:
            hash(key)
        except TypeError:
            raise TypeError(
                "jaxdist.function: non-array arguments are static and must be hashable; got "
                f"{[type(s).__name__ for s in statics]}"
            ) from None
        entry = self._cache.get(key)
        if entry is None:
            entry = self._compile(tree, dyn_mask, statics, dyn)
            self._cache[key] = entry
        jitted, touched, assigned_box, strategies = entry
        values = [v.storage for v in touched]
        # XLA:CPU with more devices than cores must not queue multi-device programs behind each other (see
        # MeshEngine.dispatch): share the strategies' pacing, so run() and compiled functions take turns.
        engines = [s.engine for s in strategies]
        for e in engines:
            e.raise_if_failed()  # MultiWorkerMirrored: a recorded peer failure surfaces here too
        for e in engines:
            e.wait_in_flight()
        out, new_values = jitted(values, dyn)
        for e in engines:
            e.note_in_flight((out, new_values))  # and watched for CommunicationOptions(timeout_seconds)
        for v, nv in zip(assigned_box[0], new_values):
            v.distribute_strategy.engine.write_variable(v, nv)
        for e in engines:
            e.adopt_replicated(out)
        return out

    def _call(self, frame: GlobalFrame, tree: Any, dyn_mask: tuple[bool, ...], statics: tuple, dyn: Any) -> Any:
        it_d, it_s = iter(dyn), iter(statics)
        args, kwargs = jax.tree.unflatten(tree, [next(it_d) if d else next(it_s) for d in dyn_mask])
        with ctx_lib.enter_frame(frame), entered_trace_hooks(None):
            out = self._fn(*args, **kwargs)
        if any(isinstance(x, SyncVariable) for x in jax.tree.leaves(out)):
            raise TypeError("a jaxdist.function returned a variable: return its value (var.value())")
        return out

    def _compile(self, tree: Any, dyn_mask: tuple[bool, ...], statics: tuple, dyn: list[Any]) -> Any:
        dframe = GlobalFrame(discover=True, parent=None)
        jax.make_jaxpr(lambda *d: self._call(dframe, tree, dyn_mask, statics, d))(*dyn)
        touched = list(dframe.touched)
        strategies = {v.distribute_strategy for v in touched} | dframe.strategies
        assigned_box: list[list[SyncVariable]] = [[]]

        def program(values: list[Any], d: list[Any]) -> Any:
            self.trace_count += 1
            frame = GlobalFrame(discover=False, parent=None)
            frame.values = dict(zip(touched, values))
            out = self._call(frame, tree, dyn_mask, statics, d)
            extra = [v for v in frame.touched if v not in frame.values and v not in touched]
            if extra:
                raise ConfigurationError(f"jaxdist.function: variables {[v.name for v in extra]} appeared after discovery")
            assigned = list(frame.assigned)
            assigned_box[0] = assigned
            return out, [frame.values[v] for v in assigned]

        logger.debug("jaxdist.function(%s): %d variables", getattr(self._fn, "__name__", self._fn), len(touched))
        return jax.jit(program), touched, assigned_box, strategies


def function(fn: Callable[..., Any] | None = None) -> Any:
    """Decorator: compile ``fn`` with ``jax.jit``, threading jaxdist variables (see the module docstring).

    Usable as ``@jaxdist.function`` or ``jaxdist.function(fn)``.
    """
    if fn is None:
        return function
    return Function(fn)
