"""The gRPC helpers under one name: re-exports of :mod:`~jaxdist.transport.channel`,
:mod:`~jaxdist.transport.server` and :mod:`~jaxdist.transport.handlers`.

Nothing is defined here. Only modules of the sync wing (``jaxdist.sync``'s
coordination, multi_worker and tpu modules) still import through it; new code
imports the module that defines a name, and this module goes once they do.
"""

from __future__ import annotations

from jaxdist.transport.channel import (
    DEFAULT_MAX_MESSAGE_BYTES,
    SERVICE_CONFIG,
    channel_options,
    dialable_host,
    is_loopback,
    make_channel,
    unary_method,
    wait_healthy,
)
from jaxdist.transport.credentials import PLAINTEXT
from jaxdist.transport.handlers import stream_in_handler, stream_out_handler, unary_handler
from jaxdist.transport.server import HEALTH_PREFIX, RPC_LATENCY_BUCKETS, Server

__all__ = [
    "DEFAULT_MAX_MESSAGE_BYTES",
    "HEALTH_PREFIX",
    "PLAINTEXT",
    "RPC_LATENCY_BUCKETS",
    "SERVICE_CONFIG",
    "Server",
    "channel_options",
    "dialable_host",
    "is_loopback",
    "make_channel",
    "stream_in_handler",
    "stream_out_handler",
    "unary_handler",
    "unary_method",
    "wait_healthy",
]
