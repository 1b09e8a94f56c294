"""Counted dynamic pushes against one row per key occurrence: one shard's apply, in one process.

Two :class:`~jaxdist.ps_server.dynamic_table.DynamicTableShard` objects (same config) are fed the
same Zipf batches, alternating: one the batch as one gradient row per key occurrence (what every
push was before counted pushes: the shard deduplicates, sums and counts), the other the batch reduced
by :func:`~jaxdist.ps_server.dynamic_table.reduce_push` (each distinct key once, with its count).
Reported, medians over the rounds: the shard's ``apply`` time each way, the client's reduction time,
the request's encoded size each way, and a check that both shards stay bit-identical (digest).

Run: ``python bench/dynamic_push_counts.py [--batch 65536] [--rounds 7]`` (one process, ~10 s of CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from jaxdist.proto import codec, ps_pb2
from jaxdist.ps_server.dynamic_table import (
    AdmissionConfig,
    DynamicTableConfig,
    DynamicTableShard,
    EvictionConfig,
    RowOptimizer,
    reduce_push,
)
from jaxdist.ps_server.dynamic_tables import encode_counts, encode_keys


def request_bytes(keys: np.ndarray, grads: np.ndarray, counts: np.ndarray | None) -> int:
    req = ps_pb2.DynamicPushRequest(table="ids", update_id="run/closure/0")
    encode_keys(keys, req.keys)
    codec.tensor_to_proto(grads, req.grads)
    if counts is not None:
        encode_counts(counts, req)
    return req.ByteSize()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=65536, help="key occurrences per push")
    ap.add_argument("--population", type=int, default=1 << 20, help="ids drawn from [0, population)")
    ap.add_argument("--zipf", type=float, default=1.15, help="Zipf exponent of the ids")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = DynamicTableConfig("ids", (args.dim,), seed=1, optimizer=RowOptimizer("adagrad", 0.05),
                             admission=AdmissionConfig(min_count=2), eviction=EvictionConfig(capacity=1 << 20))
    old, new = DynamicTableShard(cfg), DynamicTableShard(cfg)
    rng = np.random.default_rng(args.seed)

    def batch() -> tuple[np.ndarray, np.ndarray]:
        ids = (rng.zipf(args.zipf, size=args.batch) % args.population).astype(np.int64)
        return ids, rng.standard_normal((args.batch, args.dim)).astype(np.float32)

    for _ in range(2):  # warm both shards (rows exist, pending keys, index grown)
        ids, g = batch()
        old.apply(ids, g)
        red = reduce_push(ids, g)
        new.apply(red.keys, red.grads, red.counts)
    t_old, t_new, t_reduce, distinct = [], [], [], []
    for r in range(args.rounds):
        ids, g = batch()
        order = (0, 1) if r % 2 == 0 else (1, 0)  # alternate which goes first
        for which in order:
            if which == 0:
                t0 = time.perf_counter()
                want = old.apply(ids, g)
                t_old.append(time.perf_counter() - t0)
            else:
                t0 = time.perf_counter()
                red = reduce_push(ids, g)
                t1 = time.perf_counter()
                got = new.apply(red.keys, red.grads, red.counts)
                t2 = time.perf_counter()
                t_reduce.append(t1 - t0)
                t_new.append(t2 - t1)
                distinct.append(len(red.keys))
        assert got == want
    assert old.digest() == new.digest(), "the two shards differ"
    b_old = request_bytes(ids, g, None)
    b_new = request_bytes(red.keys, red.grads, red.counts)
    med = statistics.median
    out = {
        "bench": "dynamic_push_counts", "batch": args.batch, "dim": args.dim, "zipf": args.zipf,
        "rounds": args.rounds, "distinct_fraction": round(med(distinct) / args.batch, 3),
        "apply_uncounted_ms": round(1e3 * med(t_old), 2), "apply_counted_ms": round(1e3 * med(t_new), 2),
        "shard_speedup": round(med(t_old) / med(t_new), 2), "client_reduce_ms": round(1e3 * med(t_reduce), 2),
        "request_bytes_uncounted": b_old, "request_bytes_counted": b_new,
        "bytes_ratio": round(b_new / b_old, 3), "digests_equal": True,
        "rows": len(old), "numpy": np.__version__, "python": sys.version.split()[0],
        "loadavg": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
