"""How Python objects that carry code travel (closures, their arguments and results, optimizers,
initializers): cloudpickle, with every code object's file name kept.

cloudpickle 3.1.3 started writing ``<dynamic-code>`` as the file name of each
code object it pickles by value (so that payloads are byte-identical wherever a
function was defined). A traceback from such code, a closure failing on a
worker, then names no file and shows no source line, and the user cannot tell
which of their lines raised. jaxdist keeps the file name: :class:`Pickler`
writes code objects with :mod:`marshal` (the format of ``.pyc`` files: the
whole code object, file name and line table included), and everything else as
cloudpickle does. Payloads stay deterministic for a given definition site,
which is what the workers' function cache (keyed by the payload's digest)
needs.

Both ends must run the same Python minor version, as cloudpickle already
requires for code. Loading is plain :func:`pickle.loads` (``cloudpickle.loads``
is the same function).
"""

from __future__ import annotations

import contextvars
import io
import marshal
import pickle
import types
from collections import ChainMap
from typing import Any

import cloudpickle

__all__ = ["Pickler", "dumps", "shipping"]

#: True while a :class:`Pickler` pickles (an object travelling to another jaxdist process).
_SHIPPING: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxdist_shipping", default=False)


def shipping() -> bool:
    """Whether the pickling in progress is jaxdist's (:class:`Pickler`: a closure, its arguments or results, going to
    another process), not ``pickle.dumps`` / ``copy.deepcopy`` of the user's: an object whose ``__reduce__``
    sends a reference to state kept elsewhere (a Keras model trained on parameter servers) does it only then."""
    return _SHIPPING.get()


def _reduce_code(code: types.CodeType) -> tuple[Any, tuple[bytes]]:
    return marshal.loads, (marshal.dumps(code),)


class Pickler(cloudpickle.Pickler):
    """cloudpickle's pickler, except that code objects keep their file names (module docstring)."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)

    def dump(self, obj: Any) -> None:
        token = _SHIPPING.set(True)  # see shipping()
        try:
            super().dump(obj)
        finally:
            _SHIPPING.reset(token)


def dumps(obj: Any, protocol: int = pickle.HIGHEST_PROTOCOL) -> bytes:
    """``obj`` pickled by :class:`Pickler`; raises what pickling raises."""
    buf = io.BytesIO()
    Pickler(buf, protocol=protocol).dump(obj)
    return buf.getvalue()
