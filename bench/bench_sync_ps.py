"""Synchronous (``staleness=0``) and bounded-stale PS training next to asynchronous: MLP steps/s.

One LocalCluster (real processes on loopback: --workers workers, --ps PS; each MLP weight split in
--ps shards); per round, each mode in turn gets a fresh strategy and coordinator on it
(``ParameterServerStrategy(staleness=...)``), is warmed up (jit on every worker), then times
--steps steps of ``jaxdist_workloads.py``'s MLP (784-1024-1024-10, batch 256, SGD on the PS;
one step = pull, gradient on the worker, push). A step is one closure, so under ``staleness=0``
two workers' closures make one applied (averaged) step: steps/s counts closures, as for async.

Prints JSON lines: an info line, then one line per mode with the median over --repeats rounds
(modes alternate within each round) and ``runs``; ``applied_steps`` is the optimizer steps the PS
applied in the last round (async: one per closure).
Usage: python bench/bench_sync_ps.py [--repeats 3] [--steps 200] [--workers 2] [--ps 2] [--modes async,0,2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxdist_workloads as jw  # noqa: E402
from bench_ps import mlp_init  # noqa: E402


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def run_mode(cluster: Any, staleness: int | None, steps: int, workers: int, shards: int, tag: str) -> tuple[float, int]:
    """Steps/s of ``steps`` MLP closures under ``staleness``, and the optimizer steps the PS applied."""
    import optax

    import jaxdist

    strategy = jaxdist.ParameterServerStrategy(
        cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(shards), staleness=staleness)
    coord = jaxdist.ClusterCoordinator(strategy)
    try:
        with strategy.scope():
            params = jaxdist.create_variables(mlp_init(), name=f"mlp_{tag}", optimizer=optax.sgd(0.01))
        train_step = jw._make_train_step(params, None)
        it = iter(coord.create_per_worker_dataset(jw._mlp_dataset_fn))
        for _ in range(2 * workers):  # warm: jit on every worker
            coord.schedule(train_step, args=(it,))
        coord.join()
        barrier = coord.step_barrier
        before = barrier.reports()[0].applied if barrier is not None else 0
        t = time.perf_counter()
        for _ in range(steps):
            coord.schedule(train_step, args=(it,))
        coord.join()
        rate = steps / (time.perf_counter() - t)
        applied = barrier.reports()[0].applied - before if barrier is not None else steps
        return rate, applied
    finally:
        coord.shutdown(exit_tasks=False)
        strategy.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--ps", type=int, default=2)
    ap.add_argument("--modes", default="async,0,2", help="comma-separated: async, or a staleness >= 0")
    args = ap.parse_args()
    modes: list[int | None] = [None if m == "async" else int(m) for m in args.modes.split(",")]

    import jaxdist

    emit(system="jaxdist", jaxdist_version=getattr(jaxdist, "__version__", "?"), workers=args.workers, ps=args.ps,
         steps=args.steps, repeats=args.repeats)
    runs: dict[int | None, list[float]] = {m: [] for m in modes}
    applied: dict[int | None, int] = {}
    with jaxdist.LocalCluster(num_workers=args.workers, num_ps=args.ps) as cluster:
        for r in range(args.repeats):
            for m in modes:
                rate, applied[m] = run_mode(cluster, m, args.steps, args.workers, args.ps, f"{r}_{m}")
                runs[m].append(rate)
    for m in modes:
        emit(system="jaxdist", workload="mlp_steps_per_s", mode="async" if m is None else f"staleness={m}",
             staleness=m, workers=args.workers, ps=args.ps, steps=args.steps, applied_steps=applied[m],
             transport=jw.tensor_transport(), median=statistics.median(runs[m]), runs=runs[m])


if __name__ == "__main__":
    main()
