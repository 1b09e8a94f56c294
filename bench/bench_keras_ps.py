"""Keras ``fit`` on jaxdist's ParameterServerStrategy against jaxdist's own custom-loop closures, and a big embedding.

Figure ``keras_ps_fit_mlp``: the same MLP (--hidden wide, 2 hidden layers,
Adam 1e-3, sparse categorical cross-entropy; 784 inputs, 10 classes), the
same per-worker batches (--batch rows), the same steps per closure
(--spe), on one ``LocalCluster`` (--ps PS and --workers worker processes)
and one ClusterCoordinator:

- ``keras_fit``: ``model.fit(DatasetCreator(fn), steps_per_epoch=--steps)``
  (Keras's callbacks, progress machinery and exact metrics included);
- ``custom_loop``: TF's custom-training-loop tutorial, ported: variables from
  ``strategy.create_variables(params, optimizer=optax.adam(1e-3))``, a closure
  of --spe steps each ``jaxdist.pull`` + jitted ``value_and_grad`` +
  ``jaxdist.apply_gradients`` (also returning the loss sum and the correct
  count, as the tutorial's metrics), --steps/--spe closures then ``join``.

Each round runs one fit of --epochs epochs per contender; the first epoch
(compilation, worker-side model building) is not timed; steps/s is over the
later epochs. Rounds alternate which contender goes first. Prints one JSON
line per round and contender, then the medians and the overhead
``keras_fit / custom_loop`` (goal: Keras's layer costs <= 10%, ratio >= 0.9).

Figure ``keras_ps_embedding``: ``Embedding(--vocab, --dim)`` (default
1M x 64) partitioned over the PS tasks, trained by ``fit`` with SGD (a
row-sparse rule: only looked-up rows move; each worker reads its shard of
the batches); steps/s, bytes pulled from the PS per step (minus the
epoch-end syncs), and the accuracy (``evaluate`` on the training data, and
the last epoch's running training accuracy) against single-process Keras
fitted on the same data in the same order (--skip-embedding to skip).

Usage: python bench/bench_keras_ps.py [--rounds 3] [--epochs 3] [--steps 40] [--spe 4] [--batch 256]
       [--hidden 256] [--workers 2] [--ps 2] [--vocab 1000000] [--dim 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


class MnistLike:
    """Per-worker batches of random 784-feature rows (picklable: it travels to the workers)."""

    def __init__(self, batch: int, seed: int = 0, batches: int = 8) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        w = rng.normal(size=(784, 10)).astype(np.float32)
        self.items = []
        for _ in range(batches):
            x = rng.normal(size=(batch, 784)).astype(np.float32)
            self.items.append((x, np.argmax(x @ w, axis=1).astype(np.int32)))

    def __call__(self, input_context: Any = None) -> Any:
        return self

    def __iter__(self) -> Any:
        while True:
            yield from self.items


class EmbeddingData:
    """Rows of --ids ids each in [0, vocab); the label is the first id's parity (learned per row of the table)."""

    def __init__(self, vocab: int, n: int, batch: int, seed: int = 1) -> None:
        import numpy as np

        rng = np.random.default_rng(seed)
        self.ids = rng.integers(0, vocab, size=(n, 8)).astype(np.int32)
        self.y = (self.ids[:, 0] % 2).astype(np.int32)
        self.batch = batch

    def __call__(self, input_context: Any = None) -> Any:
        batches = [(self.ids[i:i + self.batch], self.y[i:i + self.batch]) for i in range(0, len(self.ids), self.batch)]
        if input_context is None:
            return batches
        return batches[input_context.input_pipeline_id::input_context.num_input_pipelines]  # this worker's shard


def _keras_rate(strategy: Any, data: Any, args: argparse.Namespace) -> float:
    import keras

    import jaxdist.keras

    with strategy.scope():
        model = keras.Sequential([keras.Input((784,)), keras.layers.Dense(args.hidden, activation="relu"),
                                  keras.layers.Dense(args.hidden, activation="relu"), keras.layers.Dense(10)])
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=args.spe)
    marks: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if epoch == 1:
                marks.append(time.perf_counter())

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if epoch == args.epochs - 1:
                marks.append(time.perf_counter())

    model.fit(jaxdist.keras.DatasetCreator(data), epochs=args.epochs, steps_per_epoch=args.steps, verbose=0,
              callbacks=[Clock()])
    return (args.epochs - 1) * args.steps / (marks[1] - marks[0])


def _mlp_loss(p: Any, x: Any, y: Any) -> Any:
    import jax
    import jax.numpy as jnp
    import optax

    h = x
    for i, layer in enumerate(p):
        h = h @ layer["w"] + layer["b"]
        if i < len(p) - 1:
            h = jax.nn.relu(h)
    loss = optax.softmax_cross_entropy_with_integer_labels(h, y).mean()
    return loss, jnp.sum(jnp.argmax(h, -1) == y)


class CustomSteps:
    """One closure of the custom loop: ``spe`` steps of pull, jitted value_and_grad, apply_gradients."""

    def __init__(self, variables: Any, spe: int) -> None:
        self.variables = variables
        self.spe = spe
        self._grad: Any = None

    def __getstate__(self) -> dict[str, Any]:
        return {"variables": self.variables, "spe": self.spe, "_grad": None}

    def __call__(self, it: Any) -> tuple[float, int]:
        import jax

        import jaxdist

        if self._grad is None:  # compiled once per worker (the function is unpickled once per worker)
            self._grad = jax.jit(jax.value_and_grad(_mlp_loss, has_aux=True))
        total, correct = 0.0, 0
        for _ in range(self.spe):
            x, y = next(it)
            (loss, right), grads = self._grad(jaxdist.pull(self.variables), x, y)
            jaxdist.apply_gradients(self.variables, grads)
            total += float(loss)
            correct += int(right)
        return total, correct


def _custom_rate(strategy: Any, coord: Any, data: Any, args: argparse.Namespace, round_: int) -> float:
    import numpy as np
    import optax

    rng = np.random.default_rng(round_)
    sizes = [784, args.hidden, args.hidden, 10]
    params = [{"w": (rng.normal(size=(a, b)) * np.sqrt(2 / a)).astype(np.float32), "b": np.zeros(b, np.float32)}
              for a, b in zip(sizes[:-1], sizes[1:])]
    with strategy.scope():
        variables = strategy.create_variables(params, name=f"mlp{round_}", optimizer=optax.adam(1e-3))

    steps = CustomSteps(variables, args.spe)
    spe = args.spe

    it = iter(coord.create_per_worker_dataset(data))
    closures = args.steps // spe
    start = 0.0
    for epoch in range(args.epochs):
        if epoch == 1:
            start = time.perf_counter()
        rvs = [coord.schedule(steps, args=(it,)) for _ in range(closures)]
        coord.join()
        _ = [rv.fetch() for rv in rvs]
    return (args.epochs - 1) * closures * spe / (time.perf_counter() - start)


def _embedding(strategy: Any, args: argparse.Namespace) -> None:
    import keras
    import numpy as np

    import jaxdist.keras

    data = EmbeddingData(args.vocab, args.emb_examples, args.batch)
    steps = -(-args.emb_examples // args.batch)

    def make() -> Any:
        model = keras.Sequential([keras.Input((8,), dtype="int32"), keras.layers.Embedding(args.vocab, args.dim),
                                  keras.layers.Flatten(), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(2.0), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    def pulled() -> int:
        return sum(c.status().counters["bytes_pulled"] for c in strategy.connections.clients)

    with strategy.scope():
        model = make()
    initial = model.get_weights()
    model_bytes = sum(w.nbytes for w in initial)
    marks: list[float] = []

    class Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            if epoch == 1:
                marks.append(time.perf_counter())

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            marks.append(time.perf_counter())

    before = pulled()
    hist = model.fit(jaxdist.keras.DatasetCreator(data), epochs=args.epochs, steps_per_epoch=steps, verbose=0,
                     callbacks=[Clock()])
    per_step = (pulled() - before - args.epochs * model_bytes) / (args.epochs * steps)
    rate = (args.epochs - 1) * steps / (marks[-1] - marks[1]) if args.epochs > 1 else float("nan")
    table = jaxdist.keras.ps_variables(model)[0]
    ref = make()
    ref.set_weights(initial)
    t0 = time.perf_counter()
    ref_hist = ref.fit(data.ids, data.y, batch_size=args.batch, epochs=args.epochs, shuffle=False, verbose=0)
    ref_rate = args.epochs * steps / (time.perf_counter() - t0)
    emit(figure="keras_ps_embedding", vocab=args.vocab, dim=args.dim, shards=len(getattr(table, "variables", [table])),
         workers=args.workers, ps=args.ps, batch=args.batch, steps_per_epoch=steps, epochs=args.epochs,
         steps_per_s=round(rate, 2), bytes_pulled_per_step=int(per_step), table_bytes=args.vocab * args.dim * 4,
         final_train_accuracy=round(hist.history["accuracy"][-1], 4),
         keras_single_process_train_accuracy=round(ref_hist.history["accuracy"][-1], 4),
         accuracy=round(model.evaluate(data.ids, data.y, batch_size=args.batch, return_dict=True, verbose=0)["accuracy"], 4),
         keras_single_process_accuracy=round(ref.evaluate(data.ids, data.y, batch_size=args.batch, return_dict=True,
                                                          verbose=0)["accuracy"], 4),
         keras_single_process_steps_per_s=round(ref_rate, 2))
    _ = np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40, help="steps per epoch")
    parser.add_argument("--spe", type=int, default=4, help="steps per closure")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--ps", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--emb-examples", type=int, default=4096)
    parser.add_argument("--skip-embedding", action="store_true")
    args = parser.parse_args()
    if args.steps % args.spe:
        parser.error("--steps must be a multiple of --spe (both contenders run whole closures)")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jaxdist.keras  # noqa: F401  (KERAS_BACKEND=jax before keras loads; the workers inherit it)

    import jaxdist

    rates: dict[str, list[float]] = {"keras_fit": [], "custom_loop": []}
    with jaxdist.LocalCluster(num_workers=args.workers, num_ps=args.ps) as cluster:
        strategy = jaxdist.ParameterServerStrategy(
            cluster.cluster_resolver(), variable_partitioner=jaxdist.MinSizePartitioner(max_shards=args.ps))
        coord = jaxdist.ClusterCoordinator(strategy)
        data = MnistLike(args.batch)
        for r in range(args.rounds):
            order = ["keras_fit", "custom_loop"] if r % 2 == 0 else ["custom_loop", "keras_fit"]
            for who in order:
                rate = _keras_rate(strategy, data, args) if who == "keras_fit" else _custom_rate(strategy, coord, data, args, r)
                rates[who].append(rate)
                emit(figure="keras_ps_fit_mlp", round=r, contender=who, steps_per_s=round(rate, 2), workers=args.workers,
                     ps=args.ps, batch=args.batch, hidden=args.hidden, steps_per_execution=args.spe)
        for who, values in rates.items():
            emit(figure="keras_ps_fit_mlp", contender=who, median_steps_per_s=round(statistics.median(values), 2),
                 rounds=len(values))
        ratio = statistics.median(rates["keras_fit"]) / statistics.median(rates["custom_loop"])
        emit(figure="keras_ps_fit_ratio", keras_fit_over_custom_loop=round(ratio, 3), goal_at_least=0.9,
             met=ratio >= 0.9)
        if not args.skip_embedding:
            _embedding(strategy, args)
        coord.shutdown()


if __name__ == "__main__":
    main()
