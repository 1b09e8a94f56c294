"""The public API's only reaches into the Keras integration (:mod:`jaxdist.keras`): both lazy, both here.

``jaxdist.keras`` needs the ``keras`` extra and selects Keras's JAX backend when it is imported,
so nothing imports it unless Keras is in use. The sync core (``jaxdist.sync``) never imports it;
the rest of the public API only through this module (``tests/unit/test_layers.py`` checks both):

- **Scope hook.** ``import jaxdist`` registers :func:`scope_hook` as the sync core's ``"keras"``
  scope hook (:mod:`jaxdist.sync.hooks`, whose registry is :mod:`jaxdist.base.hooks`: registering it imports no
  sync wing). Inside a ``strategy.scope()`` it does nothing while
  Keras is not imported; once ``keras`` is imported on its JAX backend it imports
  :mod:`jaxdist.keras` (which registers :func:`jaxdist.keras.scope.keras_scope` under the same name,
  replacing this stand-in) and enters the strategy's Keras distribution; on another backend it logs
  a warning once and enters nothing (``import jaxdist.keras`` would raise instead).
- **``jaxdist.SidecarEvaluator``** (TF's name for it): the package's module-level ``__getattr__``
  asks :func:`sidecar_evaluator` for the class when the name is first used.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from contextlib import AbstractContextManager
from typing import Any

from jaxdist.base.hooks import register_scope_hook

logger = logging.getLogger(__name__)

__all__ = ["SCOPE_HOOK", "install_scope_hook", "scope_hook", "sidecar_evaluator"]

#: The name of Keras's scope hook in :mod:`jaxdist.sync.hooks`.
SCOPE_HOOK = "keras"

_warned_lock = threading.Lock()
_warned_backend = False


def scope_hook(strategy: Any) -> AbstractContextManager[Any]:
    """Keras's view of ``strategy`` when Keras is in use in this process (see the module docstring).

    Keras is never imported here: a program that has not imported it gets nothing.
    """
    global _warned_backend
    keras = sys.modules.get("keras")
    if keras is None:
        return contextlib.nullcontext()
    backend_fn = getattr(getattr(keras, "config", None), "backend", None)
    backend = backend_fn() if callable(backend_fn) else None
    if backend != "jax":
        with _warned_lock:
            warn, _warned_backend = not _warned_backend, True
        if warn:
            logger.warning(
                "keras is imported with the %r backend: jaxdist strategies distribute Keras only on JAX "
                "(set KERAS_BACKEND=jax, or import jaxdist.keras before keras); Keras models in %s.scope() are "
                "NOT distributed",
                backend,
                type(strategy).__name__,
            )
        return contextlib.nullcontext()
    from jaxdist.keras.scope import keras_scope

    return keras_scope(strategy)


def install_scope_hook() -> None:
    """Register :func:`scope_hook` as the sync core's ``"keras"`` scope hook (``import jaxdist`` does)."""
    register_scope_hook(SCOPE_HOOK, scope_hook)


def sidecar_evaluator() -> type:
    """:class:`jaxdist.keras.SidecarEvaluator` (imports :mod:`jaxdist.keras`)."""
    from jaxdist.keras.sidecar import SidecarEvaluator

    return SidecarEvaluator
