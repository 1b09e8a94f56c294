"""A dynamic embedding table grown to 50M keys in one training run: PS memory and training speed.

One PS process (``jaxdist.LocalCluster``; its one worker idles: the strategy needs one), the coordinator training a small click model on it with a
``jaxdist.DynamicEmbedding`` (dim 16, Adagrad, the recsys default for sparse features):
each example is one id; its row goes through an MLP 16-32-1 (JAX, on the coordinator, SGD) to a
logistic loss against a label fixed by the id. Each step looks up the batch's rows on the PS
(one RPC), computes gradients, and pushes the rows' gradients back (one RPC, through the PS client
with a push identity, so a push that outlasts its deadline while the shard grows is resent and
applied once: the coordinator's own ``apply_gradients`` pushes carry no identity).

Ids per batch of ``--batch`` (default 65,536): 45% new ids, 45% the previous step's new ids again
(admission is ``min_count=2``: a key gets its row at its second sighting, so the table grows by
~29.5k rows per step), 5% ids seen once only (they wait in the bounded pending set, ``max_pending``,
and are forgotten), 5% a Zipf(1.2) hot set over the first million ids. Eviction: LRU at
``--capacity`` rows (default 50M): once the table is full, every step evicts as many rows as it
admits, so the run measures the speed at 50M keys while evicting.

Figures (JSON lines on stdout, and appended to ``--out``): a progress line every ``--every`` steps
(keys held, PS RSS and peak RSS from ``/proc/<pid>/status``, the bytes of keys + rows + optimizer
state held, steps/s); then a summary: median step time over windows of ``--window`` steps at 1M keys
(the first three windows once ``--low`` keys are held) and at 50M keys (the windows after the table is full),
their ratio, and RSS / held bytes at the end.

Usage: python bench/dynamic_scale.py [--target 50000000] [--batch 65536] [--after-full 150]
           [--out bench/results/dynamic_scale.jsonl]
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import jaxdist  # noqa: E402
from jaxdist.ps_server.dynamic_table import reduce_push  # noqa: E402

DIM = 16
HIDDEN = 32
KEY_BYTES = 8


def emit(out: str | None, **kv: Any) -> None:
    line = json.dumps(kv)
    print(line, flush=True)
    if out:
        with open(out, "a") as f:
            f.write(line + "\n")


def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes."""
    got = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                got[name] = int(rest.split()[0]) * 1024
    return got


def make_step(lr: float) -> Any:
    def loss_fn(rows: jax.Array, params: dict[str, jax.Array], labels: jax.Array) -> jax.Array:
        h = jax.nn.relu(rows @ params["w1"] + params["b1"])
        logits = (h @ params["w2"] + params["b2"])[:, 0]
        return jnp.mean(jnp.logaddexp(0.0, logits) - labels * logits)

    @jax.jit
    def step(rows: jax.Array, params: dict[str, jax.Array], labels: jax.Array) -> tuple[Any, ...]:
        loss, (g_rows, g_params) = jax.value_and_grad(loss_fn, argnums=(0, 1))(rows, params, labels)
        params = jax.tree_util.tree_map(lambda p, g: p - lr * g, params, g_params)
        return loss, g_rows, params

    return step


class IdStream:
    """The id mix described in the module docstring (deterministic from ``seed``)."""

    def __init__(self, batch: int, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.n_new = int(batch * 0.45)
        self.n_once = int(batch * 0.05)
        self.n_hot = batch - 2 * self.n_new - self.n_once
        self.next_id = 0
        self.prev_new = np.empty(0, dtype=np.int64)
        self.once_base = 1 << 50  # a separate id range: never repeated

    def next(self) -> np.ndarray:
        new = np.arange(self.next_id, self.next_id + self.n_new, dtype=np.int64)
        self.next_id += self.n_new
        repeat = self.prev_new if self.prev_new.size else new  # the first step: its ids twice
        once = np.arange(self.once_base, self.once_base + self.n_once, dtype=np.int64)
        self.once_base += self.n_once
        hot = (self.rng.zipf(1.2, size=self.n_hot) % 1_000_000).astype(np.int64)
        self.prev_new = new
        ids = np.concatenate([new, repeat, once, hot])
        return ids[self.rng.permutation(ids.size)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=int, default=50_000_000, help="keys to reach (the table's capacity)")
    ap.add_argument("--capacity", type=int, default=None, help="LRU capacity (default: --target)")
    ap.add_argument("--batch", type=int, default=65_536)
    ap.add_argument("--after-full", type=int, default=150, help="steps run once the table is full")
    ap.add_argument("--window", type=int, default=20, help="steps per timing window")
    ap.add_argument("--every", type=int, default=50, help="steps between progress lines")
    ap.add_argument("--max-pending", type=int, default=1 << 20)
    ap.add_argument("--low", type=int, default=1_000_000, help="keys held for the first timing windows")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="also append the JSON lines to this file")
    args = ap.parse_args()
    capacity = args.capacity or args.target
    row_bytes = DIM * 4 * 2  # float32 values + Adagrad accumulator
    held_per_key = row_bytes + KEY_BYTES

    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        pid = cluster.pid("ps:0")
        assert pid is not None
        # On a shared machine, if memory runs out, this benchmark's processes go first (not the others').
        for p in (pid, os.getpid()):
            try:
                with open(f"/proc/{p}/oom_score_adj", "w") as f:
                    f.write("1000")
            except OSError:
                pass
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            table = jaxdist.DynamicEmbedding(
                DIM, name="ids", optimizer="adagrad", learning_rate=0.05, min_count=2,
                max_pending=args.max_pending, capacity=capacity, eviction_policy="lru",
                max_bytes_per_shard=64 << 30)
        base = proc_status(pid)
        emit(args.out, bench="dynamic_scale", what="config", target=args.target, capacity=capacity,
             batch=args.batch, dim=DIM, optimizer="adagrad", min_count=2, max_pending=args.max_pending,
             eviction="lru", held_bytes_per_key=held_per_key, ps_rss_empty=base["VmRSS"],
             python=sys.version.split()[0], numpy=np.__version__, cpus=os.cpu_count(),
             loadavg=os.getloadavg()[0])
        key = jax.random.PRNGKey(args.seed)
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (DIM, HIDDEN)) * 0.3, "b1": jnp.zeros(HIDDEN),
                  "w2": jax.random.normal(k2, (HIDDEN, 1)) * 0.3, "b2": jnp.zeros(1)}
        step_fn = make_step(0.05)
        stream = IdStream(args.batch, args.seed)
        times: list[tuple[int, float]] = []  # (keys held before the step, seconds)
        full_at = None
        step = 0
        rows_held = 0
        t_window = time.perf_counter()
        losses: list[float] = []
        while True:
            ids = stream.next()
            labels = ((ids * 0x9E3779B1) >> 7 & 1).astype(np.float32)
            t0 = time.perf_counter()
            rows = table.lookup(ids)
            loss, g_rows, params = step_fn(jnp.asarray(rows), params, jnp.asarray(labels))
            # The PS client's push, with an identity: the coordinator's own pushes carry none, and
            # an identified push that outlasts its deadline (a shard's growth step) is resent.
            # Counted, as DynamicEmbedding.apply_gradients sends it: each distinct id once.
            pushed = reduce_push(ids.astype(np.int64), np.asarray(g_rows))
            resp = table.connections().client(0).dynamic_push("ids", pushed.keys, pushed.grads,
                                                              update_id=f"dynamic-scale/{step}", counts=pushed.counts)
            counts = {"inserted": resp.inserted, "evicted": resp.evicted}
            dt = time.perf_counter() - t0
            times.append((rows_held, dt))
            losses.append(float(loss))
            rows_held += counts["inserted"] - counts["evicted"]
            step += 1
            if full_at is None and rows_held >= capacity:
                full_at = step
            if step % args.every == 0 or (full_at is not None and step == full_at + args.after_full):
                st = table.stats()
                mem = proc_status(pid)
                now = time.perf_counter()
                held = st["rows"] * held_per_key
                emit(args.out, bench="dynamic_scale", what="progress", step=step, keys=st["rows"],
                     pending_keys=st["pending_keys"], inserts=st["inserts"], evictions=st["evictions"],
                     admissions_refused=st["admissions_refused"], held_bytes=held, ps_rss=mem["VmRSS"],
                     ps_peak_rss=mem["VmHWM"], rss_over_held=round(mem["VmRSS"] / held, 3) if held else None,
                     steps_per_s=round(args.every / (now - t_window), 3) if step % args.every == 0 else None,
                     loss=round(statistics.mean(losses[-args.every:]), 4), loadavg=os.getloadavg()[0])
                t_window = now
                rows_held = st["rows"]  # a push resent after its deadline answers zero counts (a duplicate)
            if full_at is not None and step >= full_at + args.after_full:
                break
        st = table.stats()
        mem = proc_status(pid)

    def window_medians(sel: list[float]) -> list[float]:
        return [statistics.median(sel[i:i + args.window]) for i in range(0, len(sel) - args.window + 1, args.window)]

    at_low = [dt for held, dt in times if held >= args.low][: 3 * args.window]
    at_full = [dt for held, dt in times[full_at:]]
    w1, wf = window_medians(at_low), window_medians(at_full)
    m1, mf = statistics.median(w1), statistics.median(wf)
    held = st["rows"] * held_per_key
    emit(args.out, bench="dynamic_scale", what="summary", low_keys=args.low, steps=step, keys=st["rows"], inserts=st["inserts"],
         evictions=st["evictions"], admissions_refused=st["admissions_refused"], pending_keys=st["pending_keys"],
         held_bytes=held, ps_rss=mem["VmRSS"], ps_peak_rss=mem["VmHWM"], ps_rss_empty=base["VmRSS"],
         rss_over_held=round(mem["VmRSS"] / held, 3), peak_rss_over_held=round(mem["VmHWM"] / held, 3),
         step_s_at_low_windows=[round(x, 4) for x in w1], step_s_at_full_windows=[round(x, 4) for x in wf],
         examples_per_s_at_low=round(args.batch / m1), examples_per_s_at_full=round(args.batch / mf),
         speed_full_over_low=round(m1 / mf, 3), max_step_s=round(max(dt for _, dt in times), 3),
         loadavg=os.getloadavg()[0])


if __name__ == "__main__":
    main()
