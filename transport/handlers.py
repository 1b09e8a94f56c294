"""gRPC method handlers over raw bytes, each call served inside the one guard.

Handlers are registered with raw-bytes (de)serializers: a request is parsed
inside the handler, so garbage bytes become INVALID_ARGUMENT instead of an
opaque INTERNAL, and any exception is answered by
:class:`jaxdist.transport.guard.guard` with its typed status (the data plane
answers through the same guard).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from jaxdist.base import errors as E
from jaxdist.proto import status
from jaxdist.transport.guard import guard

__all__ = ["stream_in_handler", "stream_out_handler", "stream_stream_handler", "unary_handler"]


class _Serve(guard):
    """The guard of one gRPC call: abort with the typed status."""

    __slots__ = ("_context",)

    def __init__(self, method: str, context: grpc.ServicerContext) -> None:
        super().__init__(method)
        self._context = context

    def answer(self, exc: E.JaxdistError) -> None:
        status.abort(self._context, exc)

    def reraise(self, exc: Exception) -> bool:
        # An error of a call this handler made itself, or of a call whose client already
        # left (its abort has nobody to reach): nothing to answer.
        if isinstance(exc, grpc.RpcError):
            return True
        return not isinstance(exc, (E.JaxdistError, DecodeError)) and self._context.is_active() is False


def unary_handler(method: str, parse: Callable[[bytes], Any], fn: Callable[[Any, grpc.ServicerContext], Any]) -> grpc.RpcMethodHandler:
    """Unary handler: ``parse(raw)`` then ``fn(request, context) -> message``."""

    def handle(raw: bytes, context: grpc.ServicerContext) -> bytes:
        with _Serve(method, context):
            return fn(parse(raw), context).SerializeToString()
        raise AssertionError("unreachable")  # the guard answered by aborting, which raises

    return grpc.unary_unary_rpc_method_handler(handle)


def stream_in_handler(method: str, fn: Callable[[Iterator[bytes], grpc.ServicerContext], Any]) -> grpc.RpcMethodHandler:
    """Client-streaming handler over raw frames; ``fn`` returns a message."""

    def handle(frames: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        with _Serve(method, context):
            return fn(frames, context).SerializeToString()
        raise AssertionError("unreachable")

    return grpc.stream_unary_rpc_method_handler(handle)


def stream_out_handler(method: str, parse: Callable[[bytes], Any], fn: Callable[[Any, grpc.ServicerContext], Iterator[bytes]]) -> grpc.RpcMethodHandler:
    """Server-streaming handler; ``fn`` yields raw frames."""

    def handle(raw: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        with _Serve(method, context):
            yield from fn(parse(raw), context)

    return grpc.unary_stream_rpc_method_handler(handle)


def stream_stream_handler(method: str, fn: Callable[[Iterator[bytes], grpc.ServicerContext], Iterator[bytes]]) -> grpc.RpcMethodHandler:
    """Bidirectional-streaming handler over raw frames; ``fn`` yields raw frames."""

    def handle(frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        with _Serve(method, context):
            yield from fn(frames, context)

    return grpc.stream_stream_rpc_method_handler(handle)
