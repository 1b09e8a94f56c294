"""ServiceClient: the one base of every jaxdist gRPC client (deadline, metadata, error mapping).

Every call a subclass makes goes through :meth:`ServiceClient._call` (unary
responses) or :meth:`ServiceClient._read_stream` (response streams), which

- sends the credentials' token (``authorization`` metadata) with it,
- gives it a deadline (a ``timeout`` is required: no call waits forever),
- turns a failed call into the typed error for its status code, reason and
  the task called (:func:`jaxdist.proto.status.error_from_rpc`): a PS that
  cannot be reached is a ``PSUnavailableError``, a worker a
  ``WorkerUnavailableError``; message text is never parsed;
- makes a call the server refused as busy (:class:`~jaxdist.base.errors.ServerBusyError`:
  the method's admission cap was full, nothing was done) again, jittered and
  doubling from :data:`BUSY_RETRY_S`, until the call's own deadline; a request
  stream can be made again only when given as a function that builds it (a
  response stream is refused before its first message, so it is read anew).

Subclasses set :attr:`SERVICE` and :attr:`ROLE` and build their methods with
:meth:`_unary` (protobuf messages) or on :attr:`channel` directly.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, ClassVar, TypeVar

import grpc

from jaxdist.base import errors as E
from jaxdist.proto import status
from jaxdist.transport.channel import make_channel, unary_method
from jaxdist.transport.credentials import PLAINTEXT, Credentials

__all__ = ["BUSY_RETRY_S", "ServiceClient"]

logger = logging.getLogger(__name__)

#: The retry jitter's own generator (Python's global one is the user's: random.seed must fix their sequence).
_jitter = random.Random()

#: Waits before a call refused as busy is made again: the first and the longest (each doubles the
#: last, times a uniform 0.5-1.5 so that refused callers spread out); the call's deadline bounds them.
BUSY_RETRY_S = (0.01, 0.5)

_Self = TypeVar("_Self", bound="ServiceClient")
_T = TypeVar("_T")


class ServiceClient:
    """A channel to one task's service and typed calls on it. Thread-safe.

    Args:
        address: ``host:port`` (or a gRPC target) of the task.
        credentials: the token sent with every call and the TLS material of the channel.
        task: the task called, e.g. ``"ps:0"``, named by every error.
        channel: an existing channel to use (made from the same ``credentials``);
            it is then not closed by :meth:`close`.
    """

    #: Full service name, e.g. ``"jaxdist.ParameterServer"``.
    SERVICE: ClassVar[str] = ""
    #: Role of the task called, for error classification: ``"ps"`` or ``"worker"``.
    ROLE: ClassVar[str] = "worker"

    def __init__(
        self, address: str, credentials: Credentials = PLAINTEXT, task: str = "", channel: grpc.Channel | None = None
    ) -> None:
        self.address = address
        self.credentials = credentials
        self.task = task or f"{self.ROLE}:?"
        self._own_channel = channel is None
        self.channel = channel if channel is not None else make_channel(address, credentials)
        self._metadata = credentials.metadata

    def _path(self, method: str) -> str:
        return f"/{self.SERVICE}/{method}"

    def _unary(self, method: str, request_cls: Any, response_cls: Any) -> grpc.UnaryUnaryMultiCallable:
        """A unary method of this service with protobuf request/response classes."""
        return unary_method(self.channel, self._path(method), request_cls, response_cls)

    def _call(self, method: grpc.UnaryUnaryMultiCallable | grpc.StreamUnaryMultiCallable,
              request: Any | Callable[[], Iterator[Any]], timeout: float, **kwargs: Any) -> Any:
        """Call ``method`` with the token and a ``timeout``-second deadline; typed errors.

        ``request`` is a message, or for a request stream a function returning a fresh iterator of
        them (an iterator itself is sent once: it cannot be sent again). A call refused as busy
        (``ServerBusyError``) is made again until ``timeout`` seconds have passed since the first
        attempt; then the last refusal is raised.
        """
        again = callable(request) or not isinstance(request, Iterator)
        return self._attempts(
            lambda left: method(request() if callable(request) else request, metadata=self._metadata, timeout=left,
                                **kwargs), timeout, again)

    def _read_stream(self, call: Callable[[tuple[tuple[str, str], ...], float], _T], timeout: float) -> _T:
        """A response-streaming call: ``call(metadata, timeout)`` starts it (any request stream built
        anew inside) and reads it whole. Typed errors; a busy refusal, which comes before the first
        response message, makes the whole call again as :meth:`_call` does."""
        return self._attempts(lambda left: call(self._metadata, left), timeout, True)

    def _attempts(self, attempt: Callable[[float], _T], timeout: float, again: bool) -> _T:
        """``attempt(seconds left)`` until it returns, or raises something other than a busy refusal
        (``again``: whether it may be made twice), or ``timeout`` seconds have passed."""
        deadline = time.monotonic() + timeout
        wait, longest = BUSY_RETRY_S
        left = timeout
        while True:
            try:
                return attempt(left)
            except grpc.RpcError as e:
                err = self.error(e)
            pause = wait * _jitter.uniform(0.5, 1.5)
            left = deadline - time.monotonic() - pause
            if not (again and isinstance(err, E.ServerBusyError)) or left <= 0:
                raise err from None
            logger.debug("%s busy; calling again in %.3fs", self.task, pause)
            time.sleep(pause)
            wait = min(longest, wait * 2)

    def _future(self, method: grpc.UnaryUnaryMultiCallable, request: Any, timeout: float | None, **kwargs: Any) -> grpc.Future:
        """Start ``method`` asynchronously with the token; map its failure with :meth:`error`."""
        return method.future(request, metadata=self._metadata, timeout=timeout, **kwargs)

    def error(self, e: grpc.RpcError) -> E.JaxdistError:
        """The typed error for a failed call to this task."""
        return status.error_from_rpc(e, self.task, self.ROLE)

    def status_error(self, code: grpc.StatusCode, details: str, reason: str) -> E.JaxdistError:
        """The typed error for a status this task answered on another transport (the data plane)."""
        return status.error_from_status(code, details, reason, self.task, self.ROLE)

    def close(self) -> None:
        """Close the channel (unless it was given)."""
        if self._own_channel:
            self.channel.close()

    def __enter__(self: _Self) -> _Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
