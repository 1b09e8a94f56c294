"""What the transport's defences against hostile peers cost; prints one JSON line per figure (median of --repeats).

- ``grpc_unary_calls_per_s``: sequential tiny unary calls on one channel, to
  ``jaxdist`` (a :class:`jaxdist.transport.server.Server` with a token: the
  admission gate, lanes and request-streaming handlers) beside ``reference``
  (a plain ``grpc.server`` with only a token-checking interceptor and one
  16-thread pool: the design before the gate).
- ``grpc_stream_mb_per_s``: one client stream of 64 MB in 4 MB frames, same two servers.
- ``shm_slot_read_gb_per_s``: 64 MB copied out of a region's slots in 2 MB
  chunks, ``jaxdist`` (the server's :class:`PeerRegion`: ``preadv`` from the
  file) beside ``reference`` (a mapping: ``memcpy``, what the server did before).
- ``dp_push_mb_per_s`` / ``dp_pull_mb_per_s``: 64 MB pushed to / pulled from a
  data-plane server in this process through shared memory: a sealed region the
  server maps (``sealed``, what clients offer first), a named region the server
  holds as a file (``named``, ``JAXDIST_SHM_SEALED=0``), a named region the
  server maps (``reference``: unsafe, what the server did before it held named regions as files), and
  over the socket alone (``socket``), for scale.

Usage: python bench/bench_admission.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import hmac
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import numpy as np

from jaxdist.transport.credentials import Credentials
from jaxdist.transport.dataplane import shm
from jaxdist.transport.server import Server

TOKEN = "bench-token"
MD = (("authorization", f"Bearer {TOKEN}"),)
MB = 1 << 20


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def median_of(fn: Callable[[], float], repeats: int) -> float:
    fn()  # warm-up
    return statistics.median(fn() for _ in range(repeats))


class _Raw:
    def __init__(self, data: bytes = b"") -> None:
        self.data = data

    def SerializeToString(self) -> bytes:  # noqa: N802 - the protobuf method name
        return self.data


def _ping(request: bytes, context: grpc.ServicerContext) -> bytes:
    return b""


def _drain(frames: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    n = 0
    for f in frames:
        n += len(f)
    return str(n).encode()


class _TokenOnly(grpc.ServerInterceptor):
    """The reference's auth: a token check in an interceptor, nothing else."""

    def __init__(self) -> None:
        self._expected = f"Bearer {TOKEN}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> None:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "no token")

        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        for key, value in details.invocation_metadata or ():
            if key == "authorization" and hmac.compare_digest(value.encode(), self._expected):
                return continuation(details)
        return self._deny


def _reference() -> tuple[Any, int]:
    s = grpc.server(futures.ThreadPoolExecutor(16), interceptors=[_TokenOnly()],
                    options=[("grpc.max_receive_message_length", 64 * MB)])
    s.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("b.Svc", {
        "Ping": grpc.unary_unary_rpc_method_handler(_ping),
        "Drain": grpc.stream_unary_rpc_method_handler(_drain),
    }),))
    port = s.add_insecure_port("127.0.0.1:0")
    s.start()
    return s, port


def _jaxdist() -> tuple[Any, int]:
    from jaxdist.transport.handlers import stream_in_handler, unary_handler

    s = Server(credentials=Credentials(token=TOKEN))
    s.add_service("b.Svc", {
        "Ping": unary_handler("Ping", lambda raw: raw, lambda req, ctx: _Raw()),
        "Drain": stream_in_handler("Drain", lambda frames, ctx: _Raw(_drain(frames, ctx))),
    })
    return s, s.start()


def grpc_figures(repeats: int) -> None:
    calls, frames = 2000, [b"\1" * (4 * MB)] * 16
    for name, make in (("reference", _reference), ("jaxdist", _jaxdist)):
        server, port = make()
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 * MB)])
        ping, drain = ch.unary_unary("/b.Svc/Ping"), ch.stream_unary("/b.Svc/Drain")

        def unary_rate(ping: Any = ping) -> float:
            t0 = time.perf_counter()
            for _ in range(calls):
                ping(b"", metadata=MD, timeout=10)
            return calls / (time.perf_counter() - t0)

        def stream_rate(drain: Any = drain) -> float:
            t0 = time.perf_counter()
            assert drain(iter(frames), metadata=MD, timeout=60) == str(64 * MB).encode()
            return 64 / (time.perf_counter() - t0)

        emit(figure="grpc_unary_calls_per_s", server=name, median=round(median_of(unary_rate, repeats), 1))
        emit(figure="grpc_stream_mb_per_s", server=name, median=round(median_of(stream_rate, repeats), 1))
        ch.close()
        server.stop(None)


def shm_figures(repeats: int) -> None:
    slot = shm.SHM_SLOT_BYTES
    made = shm.create_region(slot)
    if made is None:
        emit(figure="shm_slot_read_gb_per_s", skipped="no /dev/shm here")
        return
    path, mapped = made
    fd = os.open(path, os.O_RDWR)
    peer = shm.PeerRegion(fd, slot)
    dst = np.empty(64 * MB, np.uint8)
    try:
        for name, region in (("reference", mapped), ("jaxdist", peer)):
            def rate(region: Any = region) -> float:
                t0 = time.perf_counter()
                for i, start in enumerate(range(0, dst.nbytes, slot)):
                    region.read(i & 1, 0, dst[start:start + slot])
                return dst.nbytes / (time.perf_counter() - t0) / 1e9

            emit(figure="shm_slot_read_gb_per_s", reader=name, median=round(median_of(rate, repeats), 2))
    finally:
        peer.close()
        mapped.close()
        shm.unlink(path)


def _mapped_open_region(header: bytes) -> Any:
    """The reference: the server maps the peer's region (as it did before it held named regions as files)."""
    import mmap

    slot_bytes, _ = shm.ATTACH.unpack_from(header)
    name = header[shm.ATTACH.size:].decode()
    fd = os.open(os.path.join(shm.SHM_DIR, name), os.O_RDWR)
    try:
        return shm.Region(mmap.mmap(fd, shm.Region.size(slot_bytes)), slot_bytes)
    finally:
        os.close(fd)


def dataplane_figures(repeats: int) -> None:
    from contextlib import contextmanager

    from jaxdist.transport import dataplane
    from jaxdist.transport.dataplane import server as dp_server

    size = 64 * MB
    sink = np.empty(size, np.uint8)
    source = np.ones(size, np.uint8)

    @contextmanager
    def push(header: bytes, payload: Any) -> Iterator[tuple[bytes, list[np.ndarray]]]:
        payload.read_into([sink])
        yield b"", []

    @contextmanager
    def pull(header: bytes, payload: Any) -> Iterator[tuple[bytes, list[np.ndarray]]]:
        yield b"", [source]

    creds = Credentials(token=TOKEN)
    real_open = dp_server.open_region
    sealed_env = os.environ.get(shm.ENV_SHM_SEALED)
    for name, opener, use_shm, sealed in (("socket", real_open, False, False),
                                          ("reference", _mapped_open_region, True, False),
                                          ("named", real_open, True, False), ("sealed", real_open, True, True)):
        if sealed and not shm.sealed_enabled():
            emit(figure="dp_push_mb_per_s", server=name, skipped="no sealed regions here")
            continue
        dp_server.open_region = opener
        os.environ[shm.ENV_SHM_SEALED] = "1" if sealed else "0"
        try:
            with dataplane.DataPlaneServer({dataplane.PUSH: push, dataplane.PULL: pull}, credentials=creds) as srv:
                client = dataplane.DataPlaneClient("127.0.0.1", srv.port, creds, shared_memory=use_shm)
                out = np.empty(size, np.uint8)

                def push_rate(client: Any = client) -> float:
                    t0 = time.perf_counter()
                    client.call(dataplane.PUSH, b"", [source], timeout=60)
                    return 64 / (time.perf_counter() - t0)

                def pull_rate(client: Any = client, out: np.ndarray = out) -> float:
                    t0 = time.perf_counter()
                    client.call(dataplane.PULL, b"", [], timeout=60, receive=lambda body: [out])
                    return 64 / (time.perf_counter() - t0)

                emit(figure="dp_push_mb_per_s", server=name, median=round(median_of(push_rate, repeats), 1),
                     shm=client.shm_connections > 0, mapped=client.mapped_connections > 0)
                emit(figure="dp_pull_mb_per_s", server=name, median=round(median_of(pull_rate, repeats), 1),
                     shm=client.shm_connections > 0, mapped=client.mapped_connections > 0)
                client.close()
        finally:
            dp_server.open_region = real_open
            if sealed_env is None:
                os.environ.pop(shm.ENV_SHM_SEALED, None)
            else:
                os.environ[shm.ENV_SHM_SEALED] = sealed_env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--only", default="grpc,shm,dp", help="comma-separated groups: grpc, shm, dp")
    args = ap.parse_args()
    if "grpc" in args.only:
        grpc_figures(args.repeats)
    if "shm" in args.only:
        shm_figures(args.repeats)
    if "dp" in args.only:
        dataplane_figures(args.repeats)


if __name__ == "__main__":
    main()
