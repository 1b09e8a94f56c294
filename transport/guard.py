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
from collections.abc import Callable, Iterator
from contextlib import contextmanager

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


@contextmanager
def guard(
    method: str,
    answer: Callable[[E.JaxdistError], object],
    reraise: Callable[[Exception], bool] = lambda exc: False,
) -> Iterator[None]:
    """Serve one call of ``method`` inside this block; an exception is answered, never raised.

    Args:
        method: the RPC's name, for messages and the log.
        answer: sends the caller the typed error (it may raise, as gRPC's abort does).
        reraise: exceptions it is true for propagate unanswered (the transport's own
            connection failures, a call the client already left).
    """
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - one bad call must not take the server down
        if reraise(exc):
            raise
        answer(error_for(method, exc))
