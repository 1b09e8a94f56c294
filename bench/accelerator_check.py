"""Accelerator check: jaxdist's synchronous strategies, Keras and parameter-server workers on the real devices found.

Run it on a machine with a GPU or TPU (``python bench/accelerator_check.py``; a few minutes, well under 8).
It prints one JSON line per check and exits 1 if any check failed, 0 otherwise:

- ``accelerator``: the devices ``jax.devices()`` found (not CPU). With none, this is the only line
  (``"found": false``) and the script exits 0: the project builds and passes its tests without one.
- ``custom_loop``: TF's custom-loop guide with its Keras parts (Keras model, Adam, loss with
  ``reduction=None`` + ``jaxdist.compute_average_loss``, a metric) under ``strategy.run`` inside
  ``jaxdist.function``, on ``OneDeviceStrategy`` (the first device) and ``MirroredStrategy`` (every
  device); compared with Keras's own JAX recipe under ``jax.jit`` on one device.
- ``keras_fit``: Keras ``fit`` under the same two strategies against Keras's own ``fit`` (no strategy).
- ``local_cluster``: a ``LocalCluster`` (1 PS, 1 worker) whose worker computes on the accelerator
  (``JAX_PLATFORMS`` set to its platform): the worker reports its device, and a closure's gradient,
  computed there, is applied by the PS exactly.
- ``mlp``: the MLP benchmark of ``bench/bench_ps.py`` (784-1024-1024-10, batch 256, SGD on the PS) with the
  worker on the accelerator: steps/s, and the same MLP in one process with plain JAX on the device.

``--on-cpu`` runs every check on the CPU devices instead, to test the script itself (its figures are not
accelerator figures): ``XLA_FLAGS=--xla_force_host_platform_device_count=2 JAX_PLATFORMS=cpu python
bench/accelerator_check.py --on-cpu``.

Comparisons use float32 matmuls at full precision (``jax_default_matmul_precision="highest"``: GPUs
otherwise use TF32); ``max_abs_diff`` is the largest difference of any weight or metric, ``ok`` means
below ``--tol``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def accelerators() -> list[Any]:
    """The devices JAX finds that are not CPUs."""
    import jax

    return [d for d in jax.devices() if d.platform != "cpu"]


def _max_diff(a: list[Any], b: list[Any]) -> float:
    return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))) for x, y in zip(a, b))


# ----------------------------------------------------------------------------------- Keras parts
BATCH = 64
STEPS = 4


def _data() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, 32)).astype(np.float32)
    y = rng.integers(0, 10, size=(BATCH * STEPS,)).astype(np.int32)
    return [(x[i : i + BATCH], y[i : i + BATCH]) for i in range(0, len(x), BATCH)]


def _parts(strategy: Any) -> tuple[Any, Any, Any, Any]:
    import contextlib

    import keras

    keras.utils.set_random_seed(3)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)])
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        optimizer = keras.optimizers.Adam(0.01)
        accuracy = keras.metrics.SparseCategoricalAccuracy()
    return model, loss, optimizer, accuracy


def _guide(strategy: Any) -> tuple[list[Any], float]:
    """The guide's stateful loop under strategy.run (None: Keras's own JAX recipe under jax.jit, no strategy)."""
    import jax
    import jax.numpy as jnp

    import jaxdist

    model, loss_object, optimizer, accuracy = _parts(strategy)
    optimizer.build(model.trainable_variables)
    if strategy is None:
        def loss_fn(trainable: Any, x: Any, y: Any) -> Any:
            pred, _ = model.stateless_call(trainable, [], x, training=True)
            return jnp.sum(loss_object(y, pred)) / BATCH, pred

        @jax.jit
        def step(trainable: Any, opt_vars: Any, acc_vars: Any, x: Any, y: Any) -> Any:
            (_, pred), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, x, y)
            trainable, opt_vars = optimizer.stateless_apply(opt_vars, grads, trainable)
            return trainable, opt_vars, accuracy.stateless_update_state(acc_vars, y, pred)

        state = ([v.value for v in model.trainable_variables], [v.value for v in optimizer.variables],
                 [v.value for v in accuracy.variables])
        for x, y in _data():
            state = step(*state, x, y)
        return [np.asarray(w) for w in state[0]], float(accuracy.stateless_result(state[2]))

    def train_step(inputs: Any) -> Any:
        x, y = inputs

        def loss_fn(trainable: Any) -> Any:
            pred, _ = model.stateless_call(trainable, [], x, training=True)
            return jaxdist.compute_average_loss(loss_object(y, pred), global_batch_size=BATCH), pred

        (loss, pred), grads = jax.value_and_grad(loss_fn, has_aux=True)([v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        accuracy.update_state(y, pred)
        return loss

    @jaxdist.function
    def distributed_step(batch: Any) -> Any:
        return strategy.reduce("SUM", strategy.run(train_step, args=(batch,)), axis=None)

    for batch in strategy.experimental_distribute_dataset(_data()):
        distributed_step(batch)
    return [np.asarray(w) for w in model.get_weights()], float(accuracy.result())


def _fit(strategy: Any) -> tuple[list[Any], float]:
    model, _, optimizer, _ = _parts(strategy)
    import contextlib

    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model.compile(optimizer=optimizer, loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    x = np.concatenate([b[0] for b in _data()])
    y = np.concatenate([b[1] for b in _data()])
    history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return [np.asarray(w) for w in model.get_weights()], float(history.history["loss"][-1])


def _strategies(devices: list[Any]) -> dict[str, Callable[[], Any]]:
    import jaxdist

    return {"OneDeviceStrategy": lambda: jaxdist.OneDeviceStrategy(devices[0]),
            "MirroredStrategy": lambda: jaxdist.MirroredStrategy(devices)}


def check_against_reference(name: str, program: Callable[[Any], tuple[list[Any], float]], devices: list[Any],
                            tol: float) -> bool:
    ref_w, ref_m = program(None)
    ok = True
    for sname, make in _strategies(devices).items():
        t = time.perf_counter()
        strategy = make()
        w, m = program(strategy)
        diff = max(_max_diff(w, ref_w), abs(m - ref_m))
        good = diff <= tol
        ok &= good
        emit(check=name, strategy=sname, replicas=strategy.num_replicas_in_sync, max_abs_diff=diff, ok=good,
             seconds=round(time.perf_counter() - t, 2))
    return ok


# ------------------------------------------------------------------------- LocalCluster on device
def _worker_device() -> str:
    import jax

    return f"{jax.devices()[0].platform}:{jax.devices()[0].device_kind}"


def _quadratic_grad(w: Any) -> Any:
    import jax
    import jax.numpy as jnp

    return jax.jit(jax.grad(lambda v: 0.5 * jnp.sum(v * v)))(w)


def check_local_cluster(platform: str, mlp_steps: int) -> bool:
    import optax

    import jaxdist

    import cloudpickle

    sys.path.insert(0, HERE)
    import bench_ps
    from bench_ps import mlp_init, mlp_loss  # the MLP benchmark's model

    cloudpickle.register_pickle_by_value(bench_ps)  # the worker need not find bench/ on its path

    env = {"JAX_PLATFORMS": platform, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    ok = True
    t = time.perf_counter()
    with jaxdist.LocalCluster(num_workers=1, num_ps=1, env=env) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coordinator = jaxdist.ClusterCoordinator(strategy)
        try:
            seen = coordinator.schedule(_worker_device).fetch()
            with strategy.scope():
                w = jaxdist.create_variable(np.full((1024,), 2.0, np.float32), name="w", optimizer=optax.sgd(0.25))

            def step() -> None:
                jaxdist.apply_gradients(w, _quadratic_grad(jaxdist.pull(w)))

            for _ in range(4):  # w <- w - 0.25 * w: exactly 2 * 0.75^4 (powers of two and 3/4: exact in float32)
                coordinator.schedule(step).fetch()
            value = np.asarray(w.numpy())
            exact = bool(np.all(value == np.float32(2.0 * 0.75**4)))
            on_device = seen.split(":")[0] == platform
            ok = exact and on_device
            emit(check="local_cluster", worker_device=seen, on_device=on_device, exact_updates=exact, ok=ok,
                 seconds=round(time.perf_counter() - t, 2))

            with strategy.scope():
                params = jaxdist.create_variables(mlp_init(), name="mlp", optimizer=optax.sgd(0.01))
            rng = np.random.default_rng(0)
            x = rng.standard_normal((256, 784)).astype(np.float32)
            y = rng.integers(0, 10, 256).astype(np.int32)

            def mlp_step() -> None:
                import jax

                grads = jax.jit(jax.grad(mlp_loss))(jaxdist.pull(params), x, y)
                jaxdist.apply_gradients(params, grads)

            for _ in range(5):  # compile on the worker
                coordinator.schedule(mlp_step)
            coordinator.join()
            t0 = time.perf_counter()
            for _ in range(mlp_steps):
                coordinator.schedule(mlp_step)
            coordinator.join()
            rate = mlp_steps / (time.perf_counter() - t0)
            emit(check="mlp", where=f"LocalCluster: 1 PS, 1 worker computing on {platform}", batch=256,
                 steps_per_s=round(rate, 2), examples_per_s=round(rate * 256), plain_jax_steps_per_s=_plain_mlp(mlp_steps),
                 ok=True)
        finally:
            coordinator.shutdown()
    return ok


def _plain_mlp(steps: int) -> float:
    """The same MLP in this process with plain JAX + optax on the first device (the compute limit)."""
    import jax
    import optax
    from bench_ps import mlp_init, mlp_loss

    tx = optax.sgd(0.01)
    params = jax.tree.map(jax.numpy.asarray, mlp_init())
    state = tx.init(params)

    @jax.jit
    def step(p: Any, s: Any, x: Any, y: Any) -> Any:
        u, s = tx.update(jax.grad(mlp_loss)(p, x, y), s, p)
        return optax.apply_updates(p, u), s

    rng = np.random.default_rng(0)
    x = jax.device_put(rng.standard_normal((256, 784)).astype(np.float32))
    y = jax.device_put(rng.integers(0, 10, 256).astype(np.int32))
    params, state = step(params, state, x, y)
    jax.block_until_ready(params)
    t = time.perf_counter()
    for _ in range(steps):
        params, state = step(params, state, x, y)
    jax.block_until_ready(params)
    return round(steps / (time.perf_counter() - t), 2)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tol", type=float, default=1e-4, help="largest weight/metric difference accepted")
    ap.add_argument("--mlp-steps", type=int, default=200)
    ap.add_argument("--on-cpu", action="store_true",
                    help="run every check on the CPU devices instead (tests the script itself; not accelerator figures)")
    args = ap.parse_args(argv)
    found = accelerators()
    if args.on_cpu:
        import jax

        found = jax.devices("cpu")
    if not found:
        import jax

        emit(check="accelerator", found=False, platforms=sorted({d.platform for d in jax.devices()}),
             note="no accelerator (jax.devices() has only CPUs): nothing to check")
        return 0
    platform = found[0].platform
    emit(check="accelerator", found=True, platform=platform, devices=len(found),
         kinds=sorted({d.device_kind for d in found}), host=os.uname().nodename, on_cpu=bool(args.on_cpu))
    import jax

    jax.config.update("jax_default_matmul_precision", "highest")
    import jaxdist.keras  # noqa: F401  (Keras's JAX backend, before keras is imported)

    ok = True
    for name, fn in (("custom_loop", lambda: check_against_reference("custom_loop", _guide, found, args.tol)),
                     ("keras_fit", lambda: check_against_reference("keras_fit", _fit, found, args.tol)),
                     ("local_cluster", lambda: check_local_cluster(platform, args.mlp_steps))):
        try:
            ok &= bool(fn())
        except Exception:  # noqa: BLE001 - report the failure and go on with the next check
            ok = False
            emit(check=name, ok=False, error=traceback.format_exc()[-3000:])
    emit(check="summary", ok=ok)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
