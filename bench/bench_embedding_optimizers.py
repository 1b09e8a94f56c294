"""Keras ``fit`` of a large embedding under ParameterServerStrategy, per optimizer and mode; prints JSON lines.

The model: ``--ids`` Zipf-distributed ids per example into ``Embedding(--rows,
--dim)`` (partitioned over --ps PS tasks by ``MinSizePartitioner``), then
``Dense(64, relu)`` and ``Dense(1)``, binary cross-entropy; --workers worker
processes and --ps PS processes of a ``LocalCluster``; ``fit`` with
``steps_per_execution=--spe``. The first epoch (compilation) is not timed;
examples/s is over the later ones. Bytes pulled and pushed per step are the PS
counters' over the timed epochs (minus the epoch-end syncs of the whole model),
shown against the batch's distinct ids and the table's size.

Contenders (``--configs``): ``sgd``, ``adagrad``, ``adam`` (the exact mode:
Keras's dense rule on the PS, rows on the wire) and ``adam_lazy``
(``jaxdist.keras.lazy_embeddings``). ``--before-python PATH`` also runs each
optimizer with another jaxdist (the interpreter of a checkout of the code
before this change, e.g. ``/work/main/.venv/bin/python``), alternating with
this one round by round, so both sets of figures come from one run
(``adam_lazy`` has no "before": the mode did not exist). Every contender
runs in a fresh process with its own cluster. Medians over --rounds.

Usage: python bench/bench_embedding_optimizers.py [--rows 1000000] [--dim 16] [--rounds 3]
       [--before-python /path/to/other/python]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


class ZipfData:
    """Per-worker batches: --ids Zipf(1.1) ids per example in [0, rows), a label from the ids (picklable)."""

    def __init__(self, rows: int, ids: int, batch: int, batches: int = 16, seed: int = 0) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        self.items = []
        for _ in range(batches):
            x = ((rng.zipf(1.1, size=(batch, ids)) - 1) % rows).astype(np.int32)
            y = ((x[:, 0].astype(np.int64) * 2654435761) % 7 < 3).astype(np.float32)[:, None]
            self.items.append((x, y))

    def __call__(self, input_context: Any = None) -> Any:
        return self

    def __iter__(self) -> Any:
        while True:
            yield from self.items


def run_one(config: str, args: argparse.Namespace) -> dict[str, Any]:
    """One contender in this process: its own cluster, one fit; the figures as a dict."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jaxdist.keras  # noqa: F401  (KERAS_BACKEND=jax before keras loads; the workers inherit it)

    import keras
    import numpy as np

    import jaxdist

    opt = {"sgd": lambda: keras.optimizers.SGD(0.05), "adagrad": lambda: keras.optimizers.Adagrad(0.05),
           "adam": lambda: keras.optimizers.Adam(1e-3), "adam_lazy": lambda: keras.optimizers.Adam(1e-3)}[config]
    # One epoch's batches, repeated: the timed epochs see the batches (and compact-table sizes) the first compiled.
    data = ZipfData(args.rows, args.ids, args.batch, batches=args.steps)
    distinct = statistics.mean(len(np.unique(x)) for x, _ in data.items)
    with jaxdist.LocalCluster(num_workers=args.workers, num_ps=args.ps) as cluster:
        strategy = jaxdist.ParameterServerStrategy(
            cluster.cluster_resolver(), variable_partitioner=jaxdist.MinSizePartitioner(max_shards=args.ps))
        with strategy.scope():
            model = keras.Sequential([keras.Input((args.ids,), dtype="int32"), keras.layers.Embedding(args.rows, args.dim),
                                      keras.layers.Flatten(), keras.layers.Dense(64, activation="relu"),
                                      keras.layers.Dense(1)])
            model.compile(opt(), keras.losses.BinaryCrossentropy(from_logits=True), steps_per_execution=args.spe)
        if config == "adam_lazy":
            jaxdist.keras.lazy_embeddings(model)
        model_bytes = sum(w.nbytes for w in model.get_weights())

        def moved() -> tuple[int, int]:
            c = [cl.status().counters for cl in strategy.connections.clients]
            return sum(x["bytes_pulled"] for x in c), sum(x["bytes_pushed"] for x in c)

        marks: list[tuple[float, tuple[int, int]]] = []

        class Clock(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
                if epoch == 1:
                    marks.append((time.perf_counter(), moved()))

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                if epoch >= 1:
                    marks.append((time.perf_counter(), moved()))

        model.fit(jaxdist.keras.DatasetCreator(data), epochs=args.epochs, steps_per_epoch=args.steps, verbose=0,
                  callbacks=[Clock()])
        (t0, (pull0, push0)), (t1, (pull1, push1)) = marks[0], marks[-1]
        timed_epochs = args.epochs - 1
        steps = timed_epochs * args.steps
        # Each epoch end pulls the whole model to the coordinator (Keras's weights); that is not a step's.
        pulled = (pull1 - pull0 - timed_epochs * model_bytes) / steps
        pushed = (push1 - push0) / steps
        strategy.close()
    return dict(examples_per_s=round(steps * args.batch * args.workers / (t1 - t0), 1),
                bytes_pulled_per_step=int(pulled), bytes_pushed_per_step=int(pushed),
                distinct_ids_per_step=round(distinct, 1), row_bytes=args.dim * 4,
                table_bytes=args.rows * args.dim * 4)


def spawn(python: str, config: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [python, str(HERE), "--one", config, "--rows", str(args.rows), "--dim", str(args.dim), "--ids", str(args.ids),
           "--batch", str(args.batch), "--steps", str(args.steps), "--epochs", str(args.epochs), "--spe", str(args.spe),
           "--workers", str(args.workers), "--ps", str(args.ps)]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{config} with {python} failed (rc={proc.returncode}):\n{proc.stderr[-3000:]}")
    got: dict[str, Any] = json.loads(lines[-1])
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=1_000_000)
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--ids", type=int, default=8, help="ids per example")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--steps", type=int, default=16, help="steps per epoch")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--spe", type=int, default=4)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--ps", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--configs", default="sgd,adagrad,adam,adam_lazy")
    ap.add_argument("--before-python", default=None, help="the python of the code before (its jaxdist)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per contender")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.epochs < 2:
        ap.error("--epochs must be >= 2 (the first one is not timed)")
    if args.one:
        print(json.dumps(run_one(args.one, args)), flush=True)
        return
    configs = args.configs.split(",")
    versions = [("after", sys.executable)] + ([("before", args.before_python)] if args.before_python else [])
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in range(args.rounds):
        order = versions if r % 2 == 0 else versions[::-1]
        for config in configs:
            for version, python in order:
                if version == "before" and config == "adam_lazy":
                    continue
                got = spawn(python, config, args)
                results.setdefault((config, version), []).append(got)
                emit(figure="embedding_fit", round=r, optimizer=config, code=version, **got)
    for (config, version), runs in results.items():
        med = {k: statistics.median(x[k] for x in runs) for k in ("examples_per_s", "bytes_pulled_per_step",
                                                                   "bytes_pushed_per_step")}
        emit(figure="embedding_fit_median", optimizer=config, code=version, rounds=len(runs), rows=args.rows,
             dim=args.dim, batch=args.batch, ids_per_example=args.ids, workers=args.workers, ps=args.ps,
             distinct_ids_per_step=runs[0]["distinct_ids_per_step"], table_bytes=runs[0]["table_bytes"],
             examples_per_s=med["examples_per_s"], bytes_pulled_per_step=int(med["bytes_pulled_per_step"]),
             bytes_pushed_per_step=int(med["bytes_pushed_per_step"]))


if __name__ == "__main__":
    main()
