"""Parameter-server benchmarks; prints one JSON line per figure.

Workloads (2 workers + 2 PS, real processes on loopback):
  noop_closures   no-op closures per second through schedule/join
  pull / push     MB/s for one 64 MB float32 variable in 2 shards (2 PS), read /
                  assign_add-ed by 2 workers at once (timed inside the closures)
  mlp             MLP 784-1024-1024-10, batch 256, SGD on the PS: steps/s
and, in the same run, the transport's limits measured the same way:
  raw_grpc_*      a plain gRPC server process: tiny unary calls/s (sequential and
                  16 concurrent), 64 MB streamed in 4 MB chunks, 64 MB in one unary call
  plain_jax_mlp   the same MLP trained in one process with jax + optax (compute limit)

Each figure is the median of --repeats runs. Usage: python bench/bench_ps.py [--repeats 5] [--workers 1,2,4]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import numpy as np

MB = 1 << 20


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def median_of(fn: Any, repeats: int) -> tuple[float, list[float]]:
    vals = [fn() for _ in range(repeats)]
    return statistics.median(vals), vals


# ----------------------------------------------------------------- raw gRPC
_RAW_SERVER = textwrap.dedent(
    """
    import sys, grpc
    from concurrent import futures
    CHUNK = b"\\0" * (4 << 20)
    BIG = b"\\0" * (64 << 20)
    def tiny(req, ctx): return b"ok"
    def stream(req, ctx):  # the request says how many bytes to stream, in 4 MB chunks
        left = int(req)
        while left > 0:
            n = min(left, len(CHUNK))
            yield CHUNK if n == len(CHUNK) else CHUNK[:n]
            left -= n
    def upload(it, ctx):
        n = 0
        for c in it: n += len(c)
        return str(n).encode()
    def big(req, ctx): return BIG
    h = grpc.method_handlers_generic_handler("raw.Raw", {
        "Tiny": grpc.unary_unary_rpc_method_handler(tiny),
        "Stream": grpc.unary_stream_rpc_method_handler(stream),
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
        "Big": grpc.unary_unary_rpc_method_handler(big)})
    opts = [("grpc.max_send_message_length", 128 << 20), ("grpc.max_receive_message_length", 128 << 20)]
    s = grpc.server(futures.ThreadPoolExecutor(16), options=opts)
    s.add_generic_rpc_handlers((h,))
    port = s.add_insecure_port("127.0.0.1:0")
    s.start()
    print(port, flush=True)
    sys.stdin.read()
    """
)


_RAW_TCP_SERVER = textwrap.dedent(
    """
    import socket, sys
    N, BUF = 64 << 20, 4 << 20
    ls = socket.socket()
    for o in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        ls.setsockopt(socket.SOL_SOCKET, o, BUF)
    ls.bind(("127.0.0.1", 0)); ls.listen()
    print(ls.getsockname()[1], flush=True)
    c, _ = ls.accept()
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, mv = b"\\0" * N, memoryview(bytearray(N))
    while True:
        cmd = c.recv(1)
        if not cmd:
            break
        if cmd == b"d":
            c.sendall(payload)
        else:
            got = 0
            while got < N:
                got += c.recv_into(mv[got:], N - got)
            c.sendall(b"k")
    """
)


def bench_raw_tcp(repeats: int) -> dict[str, float]:
    """The transport under jaxdist's data plane, bare: 64 MB over one loopback TCP connection between
    two Python processes (``sendall`` from a buffer, ``recv_into`` a preallocated one, 4 MB socket
    buffers), 3 transfers per run."""
    import socket

    proc = subprocess.Popen([sys.executable, "-c", _RAW_TCP_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        n = 64 * MB
        s = socket.socket()
        for o in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            s.setsockopt(socket.SOL_SOCKET, o, 4 * MB)
        s.settimeout(60)
        s.connect(("127.0.0.1", port))
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        payload, mv = b"\0" * n, memoryview(bytearray(n))

        def down() -> float:
            t = time.perf_counter()
            for _ in range(3):
                s.sendall(b"d")
                got = 0
                while got < n:
                    got += s.recv_into(mv[got:], n - got)
            return 3 * 64 / (time.perf_counter() - t)

        def up() -> float:
            t = time.perf_counter()
            for _ in range(3):
                s.sendall(b"u")
                s.sendall(payload)
                s.recv(1)
            return 3 * 64 / (time.perf_counter() - t)

        out = {}
        for name, fn in [("raw_tcp_stream_down_MBps", down), ("raw_tcp_stream_up_MBps", up)]:
            fn()  # warm
            med, vals = median_of(fn, repeats)
            out[name] = med
            emit(workload=name, median=round(med, 1), runs=[round(v, 1) for v in vals])
        s.close()
        return out
    finally:
        proc.wait(10)


@contextlib.contextmanager
def raw_grpc_server() -> Iterator[Any]:
    """A plain gRPC server process (``raw.Raw``: Tiny, Stream of N bytes, Upload, Big) and a channel to it."""
    import grpc

    proc = subprocess.Popen([sys.executable, "-c", _RAW_SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(proc.stdout.readline())  # type: ignore[union-attr]
        opts = [("grpc.max_send_message_length", 128 << 20), ("grpc.max_receive_message_length", 128 << 20)]
        ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=opts)
        try:
            yield ch
        finally:
            ch.close()
    finally:
        proc.stdin.close()  # type: ignore[union-attr]
        proc.wait(10)


def bench_raw_grpc(repeats: int) -> dict[str, float]:
    with raw_grpc_server() as ch:
        tiny = ch.unary_unary("/raw.Raw/Tiny")
        stream = ch.unary_stream("/raw.Raw/Stream")
        upload = ch.stream_unary("/raw.Raw/Upload")
        big = ch.unary_unary("/raw.Raw/Big")
        tiny(b"x", timeout=10)
        chunk = b"\0" * (4 << 20)

        def seq() -> float:
            n, t = 2000, time.perf_counter()
            for _ in range(n):
                tiny(b"x", timeout=10)
            return n / (time.perf_counter() - t)

        def conc() -> float:
            n, t = 4000, time.perf_counter()
            with futures.ThreadPoolExecutor(16) as ex:
                list(ex.map(lambda _: tiny(b"x", timeout=10), range(n)))
            return n / (time.perf_counter() - t)

        def down() -> float:
            t = time.perf_counter()
            for _ in range(3):
                sum(len(c) for c in stream(str(64 << 20).encode(), timeout=30))
            return 3 * 64 / (time.perf_counter() - t)

        def up() -> float:
            t = time.perf_counter()
            for _ in range(3):
                upload(iter([chunk] * 16), timeout=30)
            return 3 * 64 / (time.perf_counter() - t)

        def unary_big() -> float:
            t = time.perf_counter()
            for _ in range(3):
                big(b"x", timeout=30)
            return 3 * 64 / (time.perf_counter() - t)

        out = {}
        for name, fn in [("raw_grpc_tiny_sequential_calls_per_s", seq), ("raw_grpc_tiny_concurrent_calls_per_s", conc),
                         ("raw_grpc_stream_down_MBps", down), ("raw_grpc_stream_up_MBps", up), ("raw_grpc_unary_64MB_MBps", unary_big)]:
            med, vals = median_of(fn, repeats)
            out[name] = med
            emit(workload=name, median=round(med, 1), runs=[round(v, 1) for v in vals])
        return out


# ------------------------------------------------------------ plain jax MLP
def mlp_init(seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    sizes = [784, 1024, 1024, 10]
    return {
        f"l{i}": {"w": (rng.standard_normal((m, n)) * np.sqrt(2 / m)).astype(np.float32), "b": np.zeros(n, np.float32)}
        for i, (m, n) in enumerate(zip(sizes[:-1], sizes[1:]))
    }


def mlp_loss(p: Any, x: Any, y: Any) -> Any:
    import jax.numpy as jnp
    import optax

    h = x
    for i in range(3):
        h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
        if i < 2:
            h = jnp.maximum(h, 0)
    return optax.softmax_cross_entropy_with_integer_labels(h, y).mean()


def bench_plain_jax(repeats: int, steps: int) -> float:
    import jax
    import optax

    tx = optax.sgd(0.01)
    params = jax.tree.map(jax.numpy.asarray, mlp_init())
    state = tx.init(params)

    @jax.jit
    def step(p: Any, s: Any, x: Any, y: Any) -> Any:
        g = jax.grad(mlp_loss)(p, x, y)
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 784)).astype(np.float32)
    y = rng.integers(0, 10, 256).astype(np.int32)
    params, state = step(params, state, x, y)

    def run() -> float:
        nonlocal params, state
        t = time.perf_counter()
        for _ in range(steps):
            params, state = step(params, state, x, y)
        jax.block_until_ready(params)
        return steps / (time.perf_counter() - t)

    med, vals = median_of(run, repeats)
    emit(workload="plain_jax_mlp_steps_per_s", median=round(med, 2), runs=[round(v, 2) for v in vals])
    return med


# ------------------------------------------------------------------ jaxdist
def bench_jaxdist(repeats: int, workers: int, mlp_steps: int, raw: dict[str, float], plain: float) -> None:
    # The workloads themselves live in jaxdist_workloads.py (shared with compare_tf.py and scaling.py);
    # this adds the ratios to the references measured above. Imported here: it imports this module.
    from jaxdist_workloads import JaxdistBench

    with JaxdistBench(workers=workers, ps=2) as b:
        b.noop_rate(1000)  # warm
        med, vals = median_of(lambda: b.noop_rate(5000), repeats)
        emit(workload="jaxdist_noop_closures_per_s", workers=workers, median=round(med, 1), runs=[round(v, 1) for v in vals],
             ratio_to_raw_concurrent_calls=round(med / raw["raw_grpc_tiny_concurrent_calls_per_s"], 2))

        big = b.variable(64)  # 64 MB in 2 shards on 2 PS, pulled / pushed by every worker at once
        for name, ref in [("pull", "raw_grpc_stream_down_MBps"), ("push", "raw_grpc_stream_up_MBps")]:
            med, vals = median_of(lambda name=name: b.transfer_rate(name, big, 64), repeats)
            emit(workload=f"jaxdist_{name}_64MB_MBps", workers=workers, ps=2, median=round(med, 1), runs=[round(v, 1) for v in vals],
                 ratio_to_raw_stream=round(med / raw[ref], 2))

        b.mlp_setup()  # MLP 784-1024-1024-10, batch 256, SGD on the PS
        med, vals = median_of(lambda: b.mlp_rate(mlp_steps), repeats)
        emit(workload="jaxdist_mlp_steps_per_s", workers=workers, ps=2, batch=256, median=round(med, 2),
             runs=[round(v, 2) for v in vals], examples_per_s=round(med * 256), ratio_to_plain_jax=round(med / plain, 2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--workers", default="2", help="comma-separated worker counts, e.g. 1,2,4")
    ap.add_argument("--mlp-steps", type=int, default=200)
    args = ap.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    emit(machine=os.uname().nodename, cpus=os.cpu_count(), python=sys.version.split()[0])
    raw = bench_raw_grpc(args.repeats)
    plain = bench_plain_jax(args.repeats, args.mlp_steps)
    for workers in (int(w) for w in args.workers.split(",")):
        bench_jaxdist(args.repeats, workers, args.mlp_steps, raw, plain)


if __name__ == "__main__":
    main()
