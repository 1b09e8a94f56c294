"""Scaling curves of jaxdist's parameter-server runtime: JSON + a three-panel PNG.

  (a) mlp    MLP 784-1024-1024-10, batch 256, SGD on the PS: steps/s with 1, 2, 4 workers
             (2 PS; schedule --mlp-steps steps then join, after a warm-up). Reference: the same
             MLP trained in this one process with plain jax + optax.
  (b) pull   one float32 variable of 1, 4, 16, 64, 256 MB in 2 shards on 2 PS, pulled by one
             closure on 1 worker: each pull timed inside the closure (after one warm pull),
             median over several pulls -> ms and MB/s. Reference: a plain gRPC server process
             streaming the same number of bytes in 4 MB chunks to this process (median time).
  (c) noop   no-op closures per second (schedule --noop-closures then join, after a warm-up)
             with 1, 2, 4, 8 worker processes (2 PS). Reference: the raw gRPC server's tiny unary
             calls, 16 concurrent.

One LocalCluster per worker count (shared by the panels that use it); every figure is the median
of --repeats runs. Writes --out-dir/scaling.json and --out-dir/scaling.png (matplotlib, the
``bench`` extra: pip install 'jaxdist[bench]'), and prints one JSON line per point.
``--quick`` is a smoke run (fewer worker counts, sizes, steps and repeats).

Usage: python bench/scaling.py [--quick] [--repeats 3] [--out-dir bench/results]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent import futures
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_ps  # noqa: E402
from jaxdist_workloads import JaxdistBench, _capture, tensor_transport  # noqa: E402

MB = bench_ps.MB
HERE = os.path.dirname(os.path.abspath(__file__))

FULL = {"mlp_workers": [1, 2, 4], "noop_workers": [1, 2, 4, 8], "sizes_mb": [1, 4, 16, 64, 256],
        "mlp_steps": 200, "noop_closures": 5000, "repeats": 3}
QUICK = {"mlp_workers": [1, 2], "noop_workers": [1, 2, 4], "sizes_mb": [1, 4, 16, 64],
         "mlp_steps": 30, "noop_closures": 1000, "repeats": 1}


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def pulls_for(mb: float) -> int:
    """Timed pulls per size: more for small variables (noisier), at least 5."""
    return max(5, min(30, int(512 // mb)))


# ----------------------------------------------------------------- raw gRPC
def raw_grpc_reference(sizes_mb: list[float], repeats: int) -> dict[str, Any]:
    """Median seconds to stream each size from a plain gRPC server process, and tiny concurrent calls/s."""
    with bench_ps.raw_grpc_server() as ch:  # its Stream sends the requested number of bytes in 4 MB chunks
        tiny = ch.unary_unary("/raw.Raw/Tiny")
        stream = ch.unary_stream("/raw.Raw/Stream")
        tiny(b"x", timeout=10)
        out: dict[str, Any] = {"stream": []}
        for mb in sizes_mb:
            nbytes = int(mb * MB)
            got = sum(len(c) for c in stream(str(nbytes).encode(), timeout=120))  # warm
            assert got == nbytes, (got, nbytes)
            times = []
            for _ in range(pulls_for(mb)):
                t = time.perf_counter()
                sum(len(c) for c in stream(str(nbytes).encode(), timeout=120))
                times.append(time.perf_counter() - t)
            med = statistics.median(times)
            point = {"mb": mb, "ms": round(med * 1e3, 3), "MBps": round(mb / med, 1), "runs_ms": [round(x * 1e3, 3) for x in times]}
            out["stream"].append(point)
            emit(panel="pull", system="reference", workload="raw_grpc_stream_down", **point)

        def conc() -> float:
            n, t = 4000, time.perf_counter()
            with futures.ThreadPoolExecutor(16) as ex:
                list(ex.map(lambda _: tiny(b"x", timeout=10), range(n)))
            return n / (time.perf_counter() - t)

        vals = [conc() for _ in range(repeats)]
        out["tiny_concurrent_calls_per_s"] = round(statistics.median(vals), 1)
        emit(panel="noop", system="reference", workload="raw_grpc_tiny_concurrent_calls_per_s",
             median=out["tiny_concurrent_calls_per_s"], runs=[round(v, 1) for v in vals])
        return out


# ----------------------------------------------------------------- jaxdist
def _median_runs(fn: Any, repeats: int, nd: int) -> dict[str, Any]:
    vals = [fn() for _ in range(repeats)]
    return {"median": round(statistics.median(vals), nd), "runs": [round(v, nd) for v in vals]}


def run_jaxdist(cfg: dict[str, Any], repeats: int) -> dict[str, list[dict[str, Any]]]:
    res: dict[str, list[dict[str, Any]]] = {"mlp": [], "noop": [], "pull": []}
    counts = sorted(set(cfg["mlp_workers"]) | set(cfg["noop_workers"]) | {1})
    for w in counts:
        t0 = time.monotonic()
        with JaxdistBench(workers=w, ps=2, shards=2) as b:
            startup = time.monotonic() - t0
            if w in cfg["noop_workers"]:
                n = cfg["noop_closures"]
                b.noop_rate(max(1, n // 5))  # warm
                point = {"workers": w, "closures": n, **_median_runs(lambda n=n: b.noop_rate(n), repeats, 1)}
                res["noop"].append(point)
                emit(panel="noop", system="jaxdist", workload="noop_closures_per_s", ps=2, **point)
            if w == 1:
                for mb in cfg["sizes_mb"]:
                    var = b.variable(mb)
                    times = b.pull_times(var, pulls_for(mb))
                    med = statistics.median(times)
                    point = {"mb": mb, "ms": round(med * 1e3, 3), "MBps": round(mb / med, 1), "pulls": len(times),
                             "runs_ms": [round(x * 1e3, 3) for x in times]}
                    res["pull"].append(point)
                    emit(panel="pull", system="jaxdist", workload="pull_ms", workers=1, ps=2, shards=2, **point)
                    del var
            if w in cfg["mlp_workers"]:
                b.mlp_setup("float32")
                steps = cfg["mlp_steps"]
                point = {"workers": w, "steps": steps, **_median_runs(lambda steps=steps: b.mlp_rate(steps), repeats, 2)}
                res["mlp"].append(point)
                emit(panel="mlp", system="jaxdist", workload="mlp_steps_per_s", ps=2, batch=256, **point)
        emit(cluster_workers=w, startup_s=round(startup, 1), total_s=round(time.monotonic() - t0, 1))
    return res


def plain_jax_reference(steps: int, repeats: int) -> dict[str, Any]:
    _, lines = _capture(bench_ps.bench_plain_jax, repeats, steps)
    rec = lines[-1]
    emit(panel="mlp", system="reference", workload="plain_jax_mlp_steps_per_s", steps=steps, median=rec["median"], runs=rec["runs"])
    return {"median": rec["median"], "runs": rec["runs"], "steps": steps}


# ----------------------------------------------------------------- plot
def plot(data: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG (pip install 'jaxdist[bench]')", file=sys.stderr)
        return False
    fig, (ax_a, ax_b, ax_c) = plt.subplots(1, 3, figsize=(17, 5))
    ref = data["reference"]

    mlp = data["jaxdist"]["mlp"]
    ax_a.plot([p["workers"] for p in mlp], [p["median"] for p in mlp], "o-", label="jaxdist (2 PS)")
    for p in mlp:
        ax_a.annotate(f"{p['median']:.1f}", (p["workers"], p["median"]), textcoords="offset points", xytext=(0, 6), ha="center")
    ax_a.axhline(ref["plain_jax_mlp"]["median"], color="gray", ls="--",
                 label=f"plain JAX, 1 process: {ref['plain_jax_mlp']['median']:.1f}")
    ax_a.set(title="(a) MLP 784-1024-1024-10, batch 256", xlabel="workers", ylabel="steps/s", ylim=(0, None))
    ax_a.set_xticks([p["workers"] for p in mlp])
    ax_a.legend()

    pull, stream = data["jaxdist"]["pull"], ref["raw_grpc"]["stream"]
    ax_b.loglog([p["mb"] for p in pull], [p["ms"] for p in pull], "o-", label="jaxdist pull (2 shards, 2 PS), ms")
    ax_b.loglog([p["mb"] for p in stream], [p["ms"] for p in stream], "s--", color="gray", label="raw gRPC stream (4 MB chunks), ms")
    ax_b.set(title="(b) pull of one variable by 1 worker", xlabel="variable size (MB)", ylabel="time per pull (ms)")
    ax_b2 = ax_b.twinx()
    ax_b2.semilogx([p["mb"] for p in pull], [p["MBps"] for p in pull], "o:", color="tab:orange", label="jaxdist MB/s")
    ax_b2.semilogx([p["mb"] for p in stream], [p["MBps"] for p in stream], "s:", color="silver", label="raw gRPC MB/s")
    ax_b2.set(ylabel="MB/s", ylim=(0, None))
    ax_b.set_xticks([p["mb"] for p in pull], [f"{p['mb']:g}" for p in pull])  # after twinx's semilogx reset them
    ax_b.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    h1, l1 = ax_b.get_legend_handles_labels()
    h2, l2 = ax_b2.get_legend_handles_labels()
    ax_b.legend(h1 + h2, l1 + l2, loc="upper left", fontsize="small")

    noop = data["jaxdist"]["noop"]
    ax_c.plot([p["workers"] for p in noop], [p["median"] for p in noop], "o-", label="jaxdist no-op closures/s")
    ax_c.axhline(ref["raw_grpc"]["tiny_concurrent_calls_per_s"], color="gray", ls="--",
                 label=f"raw gRPC tiny calls/s, 16 concurrent: {ref['raw_grpc']['tiny_concurrent_calls_per_s']:,.0f}")
    ax_c.set(title="(c) no-op closures (schedule/join), 2 PS", xlabel="worker processes", ylabel="closures/s", ylim=(0, None))
    ax_c.set_xticks([p["workers"] for p in noop])
    ax_c.legend()

    m = data["meta"]
    fig.suptitle(f"jaxdist scaling, {m['cpus']} CPUs, loopback, median of {m['repeats']}{' (quick)' if m['quick'] else ''}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: fewer points, steps and repeats")
    ap.add_argument("--repeats", type=int, default=None, help="runs per figure (default 3, --quick 1)")
    ap.add_argument("--out-dir", default=os.path.join(HERE, "results"))
    args = ap.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    repeats = args.repeats or cfg["repeats"]

    import jax

    import jaxdist

    t0 = time.monotonic()
    meta = {"quick": args.quick, "repeats": repeats, "cpus": os.cpu_count(), "machine": os.uname().nodename,
            "jaxdist_version": jaxdist.__version__, "jax_version": jax.__version__, "python": sys.version.split()[0],
            "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "transport": tensor_transport(), **cfg}
    meta.pop("repeats", None)
    meta["repeats"] = repeats
    emit(kind="meta", **meta)
    reference = {"raw_grpc": raw_grpc_reference(cfg["sizes_mb"], repeats),
                 "plain_jax_mlp": plain_jax_reference(cfg["mlp_steps"], repeats)}
    jd = run_jaxdist(cfg, repeats)
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    data = {"meta": meta, "jaxdist": jd, "reference": reference}
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "scaling.json")
    with open(json_path, "w") as f:
        json.dump(data, f, indent=1)
    png_path = os.path.join(args.out_dir, "scaling.png")
    plotted = plot(data, png_path)
    emit(kind="done", json=json_path, png=png_path if plotted else None, elapsed_s=meta["elapsed_s"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
