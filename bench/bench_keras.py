"""Keras 3 ``fit`` on jaxdist's MirroredStrategy against Keras's own ``keras.distribution.DataParallel``.

The same MLP (784-1024-1024-10, Adam, sparse categorical cross-entropy with an
accuracy metric), the same data (random, --examples rows, a multiple of the
global batch so Keras's DataParallel, which cannot split a short batch, runs
too), the same global batch, on the same devices (8 fake CPU devices in this
process unless --devices says otherwise). Each round fits one model per
contender for --epochs epochs; the first epoch (compilation) is not timed,
steps/s is over the later epochs' batches, from a callback's timestamps.
It also times placing one host batch on the devices (median of 31), jaxdist's
way and Keras's, the only per-step code jaxdist adds to Keras's loop.
Rounds alternate which contender goes first. Prints one JSON line per round
and contender, then one line per contender with the median over rounds and
the ratio jaxdist / DataParallel.

Usage: python bench/bench_keras.py [--devices 8] [--rounds 5] [--epochs 3] [--batch 1024] [--examples 16384]
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


def _set_device_count(n: int) -> None:
    # Must happen before JAX starts: the device count is fixed at backend creation.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={n}"])
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _fit_rate(scope: Any, x: Any, y: Any, args: argparse.Namespace) -> float:
    import keras

    class Clock(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.epoch_start: list[float] = []
            self.epoch_end: list[float] = []
            self.steps: list[int] = []
            self._n = 0

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self._n = 0
            self.epoch_start.append(time.perf_counter())

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self._n += 1

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.epoch_end.append(time.perf_counter())
            self.steps.append(self._n)

    keras.utils.set_random_seed(0)
    clock = Clock()
    with scope:
        model = keras.Sequential([
            keras.Input((784,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        model.fit(x, y, batch_size=args.batch, epochs=args.epochs, verbose=0, callbacks=[clock], shuffle=False)
    steps = sum(clock.steps[1:])
    seconds = sum(e - s for s, e in zip(clock.epoch_start[1:], clock.epoch_end[1:]))
    return steps / seconds


def _placement(x: Any, y: Any, devices: list[Any]) -> None:
    """Host batch -> arrays split over the devices, per batch: jaxdist's placement against Keras's own."""
    import jax
    import keras
    from keras.src.backend.jax.trainer import _distribute_data

    import jaxdist
    import jaxdist.keras

    dist = jaxdist.keras.distribution_for(jaxdist.MirroredStrategy(devices))
    data_parallel = keras.distribution.DataParallel(devices=devices)

    def keras_place() -> Any:
        with data_parallel.scope():
            return _distribute_data((x, y))

    for name, place in (("jaxdist_mirrored", lambda: dist.place_batch((x, y))), ("keras_data_parallel", keras_place)):
        for _ in range(3):
            jax.block_until_ready(place())
        times = []
        for _ in range(31):
            t0 = time.perf_counter()
            jax.block_until_ready(place())
            times.append(time.perf_counter() - t0)
        emit(figure="keras_batch_placement", contender=name, rows=len(x), median_ms=round(1e3 * statistics.median(times), 3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices (0: use the real devices as they are)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3, help="per fit; the first is warm-up")
    parser.add_argument("--batch", type=int, default=1024, help="global batch")
    parser.add_argument("--examples", type=int, default=16384)
    args = parser.parse_args()
    if args.examples % args.batch:
        parser.error("--examples must be a multiple of --batch (keras.distribution.DataParallel fails on a short batch)")
    if args.devices:
        _set_device_count(args.devices)

    import jaxdist.keras  # noqa: F401  (KERAS_BACKEND=jax before keras is imported)

    import jax
    import keras
    import numpy as np

    import jaxdist

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.examples, 784)).astype(np.float32)
    y = rng.integers(0, 10, size=args.examples).astype(np.int32)
    devices = jax.devices()
    contenders = {
        "jaxdist_mirrored": lambda: jaxdist.MirroredStrategy(devices).scope(),
        "keras_data_parallel": lambda: keras.distribution.DataParallel(devices=devices).scope(),
    }
    rates: dict[str, list[float]] = {k: [] for k in contenders}
    for r in range(args.rounds):
        order = list(contenders) if r % 2 == 0 else list(reversed(contenders))
        for name in order:
            rate = _fit_rate(contenders[name](), x, y, args)
            rates[name].append(rate)
            emit(figure="keras_fit_round", contender=name, round=r, steps_per_s=round(rate, 3))
    medians = {k: statistics.median(v) for k, v in rates.items()}
    _placement(x[: args.batch], y[: args.batch], devices)
    for name, med in medians.items():
        emit(
            figure="keras_fit_mlp", contender=name, devices=len(devices), platform=devices[0].platform,
            global_batch=args.batch, median_steps_per_s=round(med, 3), rounds=[round(v, 3) for v in rates[name]],
            examples_per_s=round(med * args.batch, 1),
        )
    emit(figure="keras_fit_ratio", jaxdist_over_data_parallel=round(medians["jaxdist_mirrored"] / medians["keras_data_parallel"], 3),
         goal="at least as fast (>= 1.0, within this machine's noise)")


if __name__ == "__main__":
    main()
