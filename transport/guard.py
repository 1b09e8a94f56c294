"""The one guard between a call's handler and its caller, for both transports.

What an exception raised while serving a call answers, gRPC and data plane alike:

- a :class:`~jaxdist.base.errors.JaxdistError`: its own status code and
  reason (``VariableNotFoundError`` -> NOT_FOUND, ``VARIABLE_NOT_FOUND``);
- a protobuf ``DecodeError`` (request bytes that are not the message):
  INVALID_ARGUMENT (:class:`~jaxdist.base.errors.InvalidRequestError`);
- anything else: INTERNAL, logged here with its traceback (a bug, not bad
  input). Only that call fails; the server keeps serving.

gRPC handlers (:mod:`jaxdist.transport.handlers`) answer by aborting the call
with the code and the reason in the trailing metadata
(:func:`jaxdist.proto.status.abort`); the data plane
(:mod:`jaxdist.transport.dataplane.server`) writes the same code and reason in
its response envelope. A caller rebuilds the same typed error either way
(:func:`jaxdist.proto.status.error_from_status`). Failures of the connection
itself (nothing can be answered) are the transport's to handle: they pass
through, see ``reraise``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from types import TracebackType

import grpc
from google.protobuf.message import DecodeError

from jaxdist.base import errors as E

logger = logging.getLogger(__name__)

__all__ = ["error_for", "guard"]


def error_for(method: str, exc: Exception) -> E.JaxdistError:
    """The typed error the caller of ``method`` gets for ``exc`` (see the module docstring)."""
    if isinstance(exc, E.JaxdistError):
        return exc
    if isinstance(exc, DecodeError):
        return E.InvalidRequestError(f"{method}: request is not a valid message ({exc})")
    logger.exception("%s failed", method, exc_info=exc)
    return E.RemoteError(f"{method}: {type(exc).__name__}: {exc}", code=grpc.StatusCode.INTERNAL)


class guard:  # noqa: N801 - used like a function: ``with guard(method, answer):``
    """Serve one call of ``method`` inside this ``with`` block; an exception is answered, never raised.

    Args:
        method: the RPC's name, for messages and the log.
        answer: sends the caller the typed error (it may raise, as gRPC's abort does).
        reraise: exceptions it is true for propagate unanswered (the transport's own
            connection failures, a call the client already left).

    A transport may subclass it and override :meth:`answer` and :meth:`reraise`
    instead (one object per call, no closures: the gRPC handlers do).
    """

    __slots__ = ("method", "_answer", "_reraise")

    def __init__(
        self,
        method: str,
        answer: Callable[[E.JaxdistError], object] | None = None,
        reraise: Callable[[Exception], bool] | None = None,
    ) -> None:
        self.method = method
        self._answer = answer
        self._reraise = reraise

    def answer(self, exc: E.JaxdistError) -> None:
        assert self._answer is not None, "give answer= or override answer()"
        self._answer(exc)

    def reraise(self, exc: Exception) -> bool:
        return self._reraise is not None and self._reraise(exc)

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> bool:
        # BaseExceptions (GeneratorExit of a cancelled stream, KeyboardInterrupt) are not answered.
        if not isinstance(exc, Exception) or self.reraise(exc):
            return False
        self.answer(error_for(self.method, exc))
        return True  # answered: the exception ends here
