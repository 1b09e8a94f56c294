"""Synchronous-strategy benchmarks; prints one JSON line per figure.

Figures (8 fake CPU devices in this process unless --devices says otherwise):
  mlp_train_step             MLP 784-1024-1024-10, global batch 2048, Adam, MirroredStrategy:
                             steps/s of strategy.run on an already-distributed batch
  mlp_train_step_with_input  the same, feeding a new host batch each step through
                             experimental_distribute_dataset (split + host->device copies)
  mlp_single_device          the same model and global batch, plain jax.jit on one device
  all_reduce                 psum of 16 MiB (float32) per replica over the 8 replicas:
                             ms per all-reduce and all-reduces/s
  all_reduce_2proc           (unless --no-multiprocess) the same 16 MiB all-reduce between
                             2 processes x 1 device on loopback via MultiWorkerMirroredStrategy (gloo)
  mlp_steps_per_execution    the same MLP written TF's way (mirrored variables, jaxdist.Optimizer),
                             k steps per compiled call with strategy.run_steps (lax.scan) for
                             k = 1 and k = --steps-per-execution (default 10), measured side by side:
                             rounds alternate the two, each round runs the same number of steps

Each figure is the median of --runs runs of --steps steps after a warm-up.
Usage: python bench/bench_sync.py [--devices 8] [--runs 5] [--steps 10] [--no-multiprocess]
                                  [--steps-per-execution 10] [--only steps_per_execution]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

MiB = 1 << 20


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def _set_device_count(n: int) -> None:
    # Must happen before JAX starts: the device count is fixed at backend creation.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _timed_runs(step: Any, runs: int, steps: int) -> tuple[float, list[float]]:
    """Median steps/s over ``runs`` runs of ``steps`` calls of ``step()`` (which blocks)."""
    rates = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        rates.append(steps / (time.perf_counter() - t0))
    return statistics.median(rates), rates


def bench_local(args: argparse.Namespace) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import jaxdist.sync as sd

    gbs = args.global_batch
    sizes = [784, 1024, 1024, 10]
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes) - 1)
    params0 = {
        f"l{i}": {
            "w": np.asarray(jax.random.normal(k, (a, b)) * (2.0 / a) ** 0.5, np.float32),
            "b": np.zeros((b,), np.float32),
        }
        for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))
    }
    tx = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(gbs, 784)).astype(np.float32), rng.integers(0, 10, size=(gbs,)).astype(np.int32))
        for _ in range(4)
    ]

    def per_example_loss(p: Any, x: Any, y: Any) -> Any:
        h = x
        for i in range(len(sizes) - 1):
            h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            if i < len(sizes) - 2:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y)

    def train_step(p: Any, o: Any, batch: Any) -> Any:
        x, y = batch
        loss, g = jax.value_and_grad(lambda p: sd.compute_average_loss(per_example_loss(p, x, y), gbs))(p)
        g = sd.get_replica_context().all_reduce(sd.ReduceOp.SUM, g)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    strategy = sd.MirroredStrategy()
    r = strategy.num_replicas_in_sync
    with strategy.scope():
        params = strategy.replicate(params0)
        opt_state = strategy.replicate(tx.init(params))
    dist_batches = list(strategy.experimental_distribute_dataset(batches))
    state = {"p": params, "o": opt_state, "i": 0}

    def dist_step() -> None:
        state["p"], state["o"], loss = strategy.run(train_step, args=(state["p"], state["o"], dist_batches[state["i"] % 4]))
        state["i"] += 1
        jax.block_until_ready(loss.stacked)

    for _ in range(2):
        dist_step()
    rate, rates = _timed_runs(dist_step, args.runs, args.steps)
    emit(bench="mlp_train_step", strategy="MirroredStrategy", replicas=r, global_batch=gbs, model="784-1024-1024-10",
         optimizer="adam", steps_per_s=round(rate, 3), runs=[round(x, 3) for x in rates], traces=strategy.trace_count)

    def input_iter() -> Any:
        while True:
            yield from strategy.experimental_distribute_dataset(batches)

    it = input_iter()

    def input_step() -> None:
        state["p"], state["o"], loss = strategy.run(train_step, args=(state["p"], state["o"], next(it)))
        jax.block_until_ready(loss.stacked)

    input_step()
    rate, rates = _timed_runs(input_step, args.runs, args.steps)
    emit(bench="mlp_train_step_with_input", strategy="MirroredStrategy", replicas=r, global_batch=gbs,
         steps_per_s=round(rate, 3), runs=[round(x, 3) for x in rates])

    # Single device, same global batch, plain jax.jit.
    dev = jax.devices()[0]

    @jax.jit
    def single_step(p: Any, o: Any, x: Any, y: Any) -> Any:
        loss, g = jax.value_and_grad(lambda p: jnp.mean(per_example_loss(p, x, y)))(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    sp = jax.device_put(params0, dev)
    so = jax.device_put(tx.init(sp), dev)
    sb = [jax.device_put(b, dev) for b in batches]
    single = {"p": sp, "o": so, "i": 0}

    def one_step() -> None:
        x, y = sb[single["i"] % 4]
        single["p"], single["o"], loss = single_step(single["p"], single["o"], x, y)
        single["i"] += 1
        loss.block_until_ready()

    for _ in range(2):
        one_step()
    rate, rates = _timed_runs(one_step, args.runs, args.steps)
    emit(bench="mlp_single_device", replicas=1, global_batch=gbs, steps_per_s=round(rate, 3),
         runs=[round(x, 3) for x in rates])

    # 16 MiB per replica all-reduce.
    n = args.allreduce_mib * MiB // 4
    x = strategy.experimental_distribute_values_from_function(lambda ctx: np.full((n,), 1.0, np.float32))

    def allreduce(v: Any) -> Any:
        return jax.lax.psum(v, sd.AXIS)

    out = strategy.run(allreduce, args=(x,))
    assert not isinstance(out, sd.PerReplica) and float(out[0]) == r

    def ar_step() -> None:
        strategy.run(allreduce, args=(x,)).block_until_ready()

    ar_step()
    rate, rates = _timed_runs(ar_step, args.runs, args.steps)
    emit(bench="all_reduce", replicas=r, mib_per_replica=args.allreduce_mib, ms=round(1000 / rate, 2),
         all_reduces_per_s=round(rate, 2), runs=[round(x, 2) for x in rates])


def bench_steps_per_execution(args: argparse.Namespace) -> None:
    """k steps per compiled call (run_steps, lax.scan) against one step per call, side by side."""
    import jax
    import numpy as np
    import optax

    import jaxdist

    gbs = args.global_batch
    sizes = [784, 1024, 1024, 10]
    keys = jax.random.split(jax.random.PRNGKey(0), len(sizes) - 1)
    params0 = {
        f"l{i}": {
            "w": np.asarray(jax.random.normal(k, (a, b)) * (2.0 / a) ** 0.5, np.float32),
            "b": np.zeros((b,), np.float32),
        }
        for i, (k, a, b) in enumerate(zip(keys, sizes[:-1], sizes[1:]))
    }
    rng = np.random.default_rng(0)
    k_big = args.steps_per_execution
    batches = [
        (rng.normal(size=(gbs, 784)).astype(np.float32), rng.integers(0, 10, size=(gbs,)).astype(np.int32))
        for _ in range(k_big)
    ]

    def per_example_loss(p: Any, x: Any, y: Any) -> Any:
        h = x
        for i in range(len(sizes) - 1):
            h = h @ p[f"l{i}"]["w"] + p[f"l{i}"]["b"]
            if i < len(sizes) - 2:
                h = jax.nn.relu(h)
        return optax.softmax_cross_entropy_with_integer_labels(h, y)

    strategy = jaxdist.MirroredStrategy()
    with strategy.scope():
        params = jaxdist.create_variables(params0)
        optimizer = jaxdist.Optimizer(optax.adam(1e-3))
        optimizer.build(params)

    def train_step(batch: Any) -> Any:
        x, y = batch
        loss, g = jax.value_and_grad(lambda p: jaxdist.compute_average_loss(per_example_loss(p, x, y), gbs))(
            jaxdist.read_variables(params)
        )
        optimizer.apply(g, params)
        return loss

    dist = list(strategy.experimental_distribute_dataset(batches))  # already on the devices: input is not timed

    def cycle() -> Any:
        while True:
            yield from dist

    it = cycle()
    steps_per_round = k_big * max(1, args.steps // k_big)

    def run_round(k: int) -> float:
        t0 = time.perf_counter()
        for _ in range(steps_per_round // k):
            out = strategy.run_steps(train_step, it, steps=k)
        jax.block_until_ready(out)
        return steps_per_round / (time.perf_counter() - t0)

    for k in (1, k_big):  # compile both before timing
        run_round(k)
    rates: dict[int, list[float]] = {1: [], k_big: []}
    for r in range(args.runs):
        for k in ((1, k_big) if r % 2 == 0 else (k_big, 1)):
            rates[k].append(run_round(k))
    med = {k: statistics.median(v) for k, v in rates.items()}
    for k in (1, k_big):
        emit(bench="mlp_steps_per_execution", strategy="MirroredStrategy", replicas=strategy.num_replicas_in_sync,
             platform=strategy.devices[0].platform, global_batch=gbs, k=k, steps_per_round=steps_per_round,
             steps_per_s=round(med[k], 3), runs=[round(x, 3) for x in rates[k]], traces=strategy.trace_count)
    emit(bench="mlp_steps_per_execution_ratio", k=k_big, ratio_k_over_1=round(med[k_big] / med[1], 3))


def _child_allreduce(args: argparse.Namespace) -> None:
    import jaxdist.sync as sd

    strategy = sd.MultiWorkerMirroredStrategy()
    import jax
    import numpy as np

    n = args.allreduce_mib * MiB // 4
    x = strategy.experimental_distribute_values_from_function(lambda ctx: np.full((n,), 1.0, np.float32))

    def allreduce(v: Any) -> Any:
        return jax.lax.psum(v, sd.AXIS)

    def step() -> None:
        strategy.run(allreduce, args=(x,)).block_until_ready()

    for _ in range(3):
        step()
    rate, rates = _timed_runs(step, args.runs, args.steps)
    if strategy.process_index == 0:
        emit(bench="all_reduce_2proc", processes=strategy.num_processes, replicas=strategy.num_replicas_in_sync,
             mib_per_replica=args.allreduce_mib, ms=round(1000 / rate, 2), all_reduces_per_s=round(rate, 2),
             runs=[round(x, 2) for x in rates], collectives="gloo")
    strategy.shutdown()


def bench_multiprocess(args: argparse.Namespace) -> None:
    ports = []
    for _ in range(2):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            ports.append(s.getsockname()[1])
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for i in range(2):
        env = dict(os.environ)
        env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
        env["JAX_PLATFORMS"] = "cpu"
        env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})
        cmd = [sys.executable, __file__, "--child-allreduce", "--runs", str(args.runs), "--steps", str(args.steps),
               "--allreduce-mib", str(args.allreduce_mib)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for i, p in enumerate(procs):
        out, err = p.communicate(timeout=300)
        if p.returncode != 0:
            emit(bench="all_reduce_2proc", error=f"process {i} rc={p.returncode}", stderr=err[-2000:])
        sys.stdout.write(out)
        sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", type=int, default=8, help="fake CPU devices (0: the real devices, e.g. a GPU)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--global-batch", type=int, default=2048)
    ap.add_argument("--allreduce-mib", type=int, default=16)
    ap.add_argument("--no-multiprocess", action="store_true", help="skip the 2-process all-reduce")
    ap.add_argument("--steps-per-execution", type=int, default=10, help="k of the steps-per-execution figure")
    ap.add_argument("--only", choices=["steps_per_execution"], default=None, help="run one figure only")
    ap.add_argument("--child-allreduce", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child_allreduce:
        _child_allreduce(args)
        return
    if args.devices:
        _set_device_count(args.devices)
    if args.only == "steps_per_execution":
        bench_steps_per_execution(args)
        return
    bench_local(args)
    bench_steps_per_execution(args)
    if not args.no_multiprocess:
        bench_multiprocess(args)


if __name__ == "__main__":
    main()
