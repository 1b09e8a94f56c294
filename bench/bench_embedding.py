"""Embedding lookups on a sharded table; prints JSON lines.

1M x 64 float32 table (256 MB) in one shard per PS (--ps, default 2; real processes),
batches of 4096 random ids looked up from a worker: lookups/s, ids/s, ids/s per PS (ids/s
over the PS tasks serving them), and bytes moved per lookup against one full pull of the
table (measured on the PS counters). Each figure is the median of --repeats runs of
--lookups lookups; the host's load average is printed with it (a shared host: compare
figures of one run side by side).

``--before-python PATH`` (the interpreter of another checkout, e.g. the code before a change)
instead runs a fine-grained side-by-side: both codes' clusters are up at once (one child process
each, this script with ``--serve``), and batches of --lookups lookups alternate between them,
--pairs times, the order flipped every pair, so a shared host's load drifts over both alike. One
JSON line: each side's median lookups/s, ids/s, ids/s per PS and CPU microseconds per lookup
(the worker's and the PS tasks' together; /proc's 10 ms ticks), the median over pairs of the
after/before speed ratio, and the load average over the run.
Usage: python bench/bench_embedding.py [--repeats 5] [--ps 2] [--lookups 200]
       python bench/bench_embedding.py --before-python PATH [--ps 2] [--lookups 100] [--pairs 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

import jaxdist
from jaxdist.ps_server.client import PSClient


def emit(**kv: object) -> None:
    print(json.dumps(kv), flush=True)


def moved(cluster: jaxdist.LocalCluster) -> float:
    total = 0.0
    for addr in cluster.cluster_spec.job_tasks("ps"):
        with PSClient(addr, cluster.credentials) as c:
            st = c.status()
            total += st.counters["bytes_pulled"] + st.counters["bytes_pushed"]
    return total


def cpu_s(pid: int | None) -> float:
    """CPU seconds (user + system) process ``pid`` has used."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _table(cluster: jaxdist.LocalCluster, ps: int, rows: int, dim: int) -> tuple[Any, jaxdist.ClusterCoordinator]:
    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(),
                                               variable_partitioner=jaxdist.FixedShardsPartitioner(ps))
    with strategy.scope():
        table = jaxdist.create_variable(
            initializer=lambda shape, dtype, offset: np.zeros(shape, dtype), shape=(rows, dim), dtype="float32", name="emb"
        )
    return table, jaxdist.ClusterCoordinator(strategy)


def serve(ps: int) -> None:
    """Child of --before-python: a cluster and the table; each stdin line N runs N lookups in a worker closure."""
    rows, dim, batch = 1_000_000, 64, 4096
    with jaxdist.LocalCluster(num_workers=1, num_ps=ps) as cluster:
        table, coord = _table(cluster, ps, rows, dim)

        def lookups(n: int, seed: int) -> tuple[float, float]:
            rng = np.random.default_rng(seed)
            ids = [rng.integers(0, rows, batch) for _ in range(n)]
            table.sparse_read(ids[0])
            t, c = time.perf_counter(), time.process_time()
            for i in ids:
                table.sparse_read(i)
            return time.perf_counter() - t, time.process_time() - c

        pids = [cluster.pid(("ps", k)) for k in range(ps)]
        coord.schedule(lookups, args=(20, 0)).fetch()
        print("ready", flush=True)
        for seed, line in enumerate(sys.stdin, 1):
            n = int(line)
            before = sum(cpu_s(p) for p in pids)
            s, cpu = coord.schedule(lookups, args=(n, seed)).fetch()
            print(json.dumps({"s": s, "worker_cpu_s": cpu, "ps_cpu_s": sum(cpu_s(p) for p in pids) - before, "n": n}),
                  flush=True)
        coord.shutdown()


def side_by_side(before_python: str, ps: int, pairs: int, n: int) -> None:
    pythons = {"before": before_python, "after": sys.executable}
    kids = {c: subprocess.Popen([py, os.path.abspath(__file__), "--serve", "--ps", str(ps)], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) for c, py in pythons.items()}
    try:
        for kid in kids.values():
            assert kid.stdout is not None
            while kid.stdout.readline().strip() != "ready":
                if kid.poll() is not None:
                    raise SystemExit(f"a side's cluster did not start (exit {kid.returncode})")
        res: dict[str, list[dict[str, float]]] = {c: [] for c in pythons}
        loads = []
        for i in range(pairs):
            for c in (("before", "after") if i % 2 == 0 else ("after", "before")):
                kid = kids[c]
                assert kid.stdin is not None and kid.stdout is not None
                kid.stdin.write(f"{n}\n")
                kid.stdin.flush()
                res[c].append(json.loads(kid.stdout.readline()))
            loads.append(float(open("/proc/loadavg").read().split()[0]))
    finally:
        for kid in kids.values():
            if kid.stdin is not None:
                kid.stdin.close()
        for kid in kids.values():
            kid.wait(timeout=120)
    row: dict[str, object] = {
        "workload": "embedding_lookups_side_by_side", "ps": ps, "transport": "tcp (JAXDIST_SHM=0)" if os.environ.get(
            "JAXDIST_SHM", "1") == "0" else "shm", "table": [1_000_000, 64], "batch_ids": 4096, "pairs": pairs,
        "lookups_per_batch": n, "loadavg_median": statistics.median(loads), "loadavg_range": [min(loads), max(loads)]}
    for c in pythons:
        rate = statistics.median(r["n"] / r["s"] for r in res[c])
        row.update({f"{c}_lookups_per_s": round(rate, 1), f"{c}_ids_per_s": round(rate * 4096),
                    f"{c}_ids_per_s_per_ps": round(rate * 4096 / ps),
                    f"{c}_worker_cpu_us_per_lookup": round(statistics.median(r["worker_cpu_s"] / r["n"] for r in res[c]) * 1e6),
                    f"{c}_ps_cpu_us_per_lookup": round(statistics.median(r["ps_cpu_s"] / r["n"] for r in res[c]) * 1e6)})
    ratios = [b["s"] / a["s"] for b, a in zip(res["before"], res["after"])]
    row.update(after_over_before=round(statistics.median(ratios), 2), pairs_after_faster=sum(r > 1 for r in ratios))
    emit(**row)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--ps", type=int, default=2, help="PS tasks; the table has one shard on each")
    ap.add_argument("--before-python", default=None, help="side by side with the code of this interpreter")
    ap.add_argument("--pairs", type=int, default=15, help="with --before-python: batches per side")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        serve(args.ps)
        return
    if args.before_python:
        side_by_side(args.before_python, args.ps, args.pairs, args.lookups)
        return
    rows, dim, batch = 1_000_000, 64, 4096
    with jaxdist.LocalCluster(num_workers=1, num_ps=args.ps) as cluster:
        table, coord = _table(cluster, args.ps, rows, dim)
        n = args.lookups

        def lookups(seed: int) -> tuple[float, float]:
            """Lookups per second, and the worker process's CPU seconds per lookup."""
            rng = np.random.default_rng(seed)
            ids = [rng.integers(0, rows, batch) for _ in range(n)]
            table.sparse_read(ids[0])
            t, c = time.perf_counter(), time.process_time()
            for i in ids:
                table.sparse_read(i)
            return n / (time.perf_counter() - t), (time.process_time() - c) / n

        def full_pull() -> float:
            t = time.perf_counter()
            jaxdist.pull(table)
            return time.perf_counter() - t

        ps_pids = [cluster.pid(("ps", k)) for k in range(args.ps)]
        rates, worker_cpu, ps_cpu = [], [], []
        for r in range(args.repeats):
            before_ps = sum(cpu_s(p) for p in ps_pids)
            rate, cpu = coord.schedule(lookups, args=(r,)).fetch()
            # The PS's CPU over the closure (n + 1 lookups, and the closure's dispatch: small).
            ps_cpu.append((sum(cpu_s(p) for p in ps_pids) - before_ps) / (n + 1))
            rates.append(rate)
            worker_cpu.append(cpu)
        before = moved(cluster)
        coord.schedule(lookups, args=(99,)).fetch()
        per_lookup = (moved(cluster) - before) / (n + 1)
        before = moved(cluster)
        full_s = statistics.median(coord.schedule(full_pull).fetch() for _ in range(3))
        full = (moved(cluster) - before) / 3
        ids_per_s = statistics.median(rates) * batch
        emit(workload="embedding_lookups_per_s", table=[rows, dim], shards=args.ps, ps=args.ps, batch_ids=batch,
             median=round(statistics.median(rates), 1), runs=[round(x, 1) for x in rates],
             ids_per_s=round(ids_per_s), ids_per_s_per_ps=round(ids_per_s / args.ps),
             worker_cpu_us_per_lookup=round(statistics.median(worker_cpu) * 1e6),
             ps_cpu_us_per_lookup=round(statistics.median(ps_cpu) * 1e6),
             loadavg=open("/proc/loadavg").read().split()[0])
        emit(workload="embedding_bytes_per_lookup", bytes=round(per_lookup), full_pull_bytes=round(full),
             ratio=round(per_lookup / full, 5), full_pull_s=round(full_s, 3))
        coord.shutdown()


if __name__ == "__main__":
    main()
