"""ParameterServerStrategy's TF strategy methods, and checkpoints between PS and synchronous strategies.

A real LocalCluster (2 PS, 2 workers with 2 fake CPU devices each):

- inside ``strategy.scope()``, ``jaxdist.get_strategy()`` is the PS strategy;
  ``extended.colocate_vars_with`` / ``variable_created_in_scope`` work;
- a per-worker dataset function calls ``strategy.distribute_datasets_from_function``
  (each worker's ``dataset_fn`` sees its worker index as ``input_pipeline_id``);
- closures call ``strategy.run`` on the worker's 2 local devices (an XLA
  all-reduce between them), ``reduce``, ``experimental_local_results`` and
  ``gather``, and push the gradients to the sharded PS variables;
- the PS checkpoint (every variable sharded over both PS) is restored into a
  MirroredStrategy on 8 fake devices in another process, evaluated, trained
  one step and saved; that checkpoint goes back into the PS strategy, and
  both are read with no strategy at all.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

GBS = 8  # per worker: 2 replicas x 4 rows


def _data() -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = rng.integers(0, 3, size=(64,)).astype(np.int32)
    params = {"w": (rng.normal(size=(6, 3)) * 0.3).astype(np.float32), "b": np.zeros((3,), np.float32)}
    return params, x, y


def _per_example(p: Any, x: Any, y: Any) -> Any:
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(x @ p["w"] + p["b"], y)


def _accuracy(p: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean(np.argmax(x @ p["w"] + p["b"], -1) == y))


def _child_mirrored(ckpt_in: str, ckpt_out: str, out: str) -> None:
    """8 fake devices: restore the PS checkpoint into MirroredStrategy, evaluate, train a step, save."""
    import jax
    import optax

    import jaxdist

    params0, x, y = _data()
    s = jaxdist.MirroredStrategy()
    assert s.num_replicas_in_sync == 8
    with s.scope():
        v = jaxdist.create_variables({k: np.zeros_like(a) for k, a in params0.items()})  # the PS names: params/...
        opt = jaxdist.Optimizer(optax.adam(0.01))
        acc = jaxdist.metrics.SparseCategoricalAccuracy()
    ckpt = jaxdist.Checkpoint(s)
    ckpt.restore(ckpt_in)
    restored = {k: np.asarray(a) for k, a in jaxdist.read_variables(v).items()}

    def eval_step(batch: Any) -> None:
        bx, by = batch
        p = jaxdist.read_variables(v)
        acc.update_state(by, bx @ p["w"] + p["b"])

    for b in s.experimental_distribute_dataset([(x[i : i + 24], y[i : i + 24]) for i in range(0, 64, 24)]):
        s.run(eval_step, args=(b,))

    def train_step(batch: Any) -> None:
        bx, by = batch
        g = jax.grad(lambda p: jaxdist.compute_average_loss(_per_example(p, bx, by), 64))(jaxdist.read_variables(v))
        opt.apply(g, v)

    s.run(train_step, args=(next(iter(s.experimental_distribute_dataset([(x, y)]))),))
    ckpt.step = 2
    ckpt.write(ckpt_out)
    with jaxdist.get_strategy().scope():  # and with no strategy at all
        plain = jaxdist.create_variables({k: np.zeros_like(a) for k, a in params0.items()})
    jaxdist.Checkpoint(None).restore(ckpt_in)
    no_strategy_same = all(np.array_equal(np.asarray(plain[k]), restored[k]) for k in restored)
    np.savez(out, accuracy=float(acc.result()), no_strategy_same=no_strategy_same, **restored)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ps_strategy_methods_and_checkpoints_across_strategies(tmp_path: Path) -> None:
    import jax
    import optax

    import jaxdist

    params0, x, y = _data()
    with jaxdist.LocalCluster(num_workers=2, num_ps=2, env={"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}) as cluster:
        strategy = jaxdist.ParameterServerStrategy(
            cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2)
        )
        coordinator: jaxdist.ClusterCoordinator | None = None
        try:
            with strategy.scope():
                assert jaxdist.get_strategy() is strategy and jaxdist.get_replica_context() is None
                params = jaxdist.create_variables(params0, optimizer=optax.adam(0.01))
                scale = jaxdist.create_variable(np.ones((), np.float32), name="scale")
                with strategy.extended.colocate_vars_with(scale):
                    colo = jaxdist.create_variable(np.zeros((5,), np.float32), name="colo")
            assert jaxdist.get_strategy() is not strategy
            assert isinstance(params["w"], jaxdist.ShardedVariable)  # 6 rows over the 2 PS
            assert not isinstance(colo, jaxdist.ShardedVariable) and colo.ps_index == scale.ps_index
            assert strategy.extended.variable_created_in_scope(params["w"].variables[1])
            assert strategy.extended.variable_created_in_scope(colo)

            def dataset_fn(ctx: jaxdist.InputContext) -> Any:
                b = ctx.get_per_replica_batch_size(GBS)
                tag = 100 * ctx.input_pipeline_id + 10 * ctx.num_input_pipelines + ctx.num_replicas_in_sync
                rows = np.arange(ctx.input_pipeline_id * 32, (ctx.input_pipeline_id + 1) * 32)
                while True:
                    for i in range(0, 32, b):
                        sel = rows[i : i + b]
                        yield x[sel], y[sel], np.full((b,), tag, np.int32)

            def per_worker_dataset_fn() -> Any:
                return strategy.distribute_datasets_from_function(dataset_fn)

            coordinator = jaxdist.ClusterCoordinator(strategy)
            iterator = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))

            def replica_fn(p: Any, batch: Any) -> Any:
                bx, by, tag = batch
                loss, g = jax.value_and_grad(lambda p: jaxdist.compute_average_loss(_per_example(p, bx, by), GBS))(p)
                return loss, jaxdist.get_replica_context().all_reduce("sum", g), tag

            def step(it: Any) -> Any:
                batch = next(it)
                loss, grads, tag = strategy.run(replica_fn, args=(jaxdist.pull(params), batch))
                jaxdist.apply_gradients(params, grads)
                total = strategy.reduce("sum", loss, axis=None)
                parts = strategy.experimental_local_results(tag)
                gathered = strategy.gather(tag, axis=0)
                return (float(total), [int(np.asarray(t)[0]) for t in parts], np.asarray(gathered).shape,
                        strategy.num_replicas_in_sync, jaxdist.current_worker_index())

            results = [coordinator.schedule(step, args=(iterator,)) for _ in range(12)]
            coordinator.join()
            fetched = [r.fetch() for r in results]
            for total, tags, gathered_shape, replicas, worker in fetched:
                assert replicas == 2 and gathered_shape == (GBS,) and np.isfinite(total)
                assert tags == [100 * worker + 22] * 2  # this worker's pipeline: id, 2 pipelines, 2 replicas
            assert {f[4] for f in fetched} <= {0, 1}
            # On the coordinator, run uses its own devices (one here).
            out = strategy.run(lambda a: a * 2, args=(np.float32(3),))
            assert float(out) == 6.0 and strategy.local_num_replicas == 1

            ps_ckpt = jaxdist.Checkpoint(strategy)
            ps_ckpt.step = 1
            ckpt1 = ps_ckpt.write(str(tmp_path / "ckpt-1"))
            manifest = json.loads((Path(ckpt1) / "manifest.json").read_text())
            assert len(manifest["variables"]["params/w"]["shards"]) == 2 and manifest["num_ps"] == 2
            saved1 = jaxdist.checkpoint.load(ckpt1, with_optimizer_state=True)

            env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
            proc = subprocess.run(
                [sys.executable, __file__, "mirrored", ckpt1, str(tmp_path / "ckpt-2"), str(tmp_path / "mirrored.npz")],
                env=env, capture_output=True, text=True, timeout=240,
            )
            assert proc.returncode == 0, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
            got = np.load(tmp_path / "mirrored.npz")
            trained = {k: saved1["variables"][f"params/{k}"] for k in params0}
            for k in params0:
                np.testing.assert_array_equal(got[k], trained[k])  # PS shards concatenated, exactly
            assert float(got["accuracy"]) == _accuracy(trained, x, y)  # evaluated under MirroredStrategy
            assert bool(got["no_strategy_same"])

            # And back: the Mirrored checkpoint into the PS strategy (2 shards per variable again).
            names = [f"params/{k}" for k in params0]
            jaxdist.Checkpoint(strategy).restore(str(tmp_path / "ckpt-2"), variables=names)
            saved2 = jaxdist.checkpoint.load(str(tmp_path / "ckpt-2"), with_optimizer_state=True)
            pulled = jaxdist.pull(params)
            for k in params0:
                np.testing.assert_array_equal(np.asarray(pulled[k]), saved2["variables"][f"params/{k}"])
            ckpt3 = jaxdist.Checkpoint(strategy).write(str(tmp_path / "ckpt-3"))
            saved3 = jaxdist.checkpoint.load(ckpt3, with_optimizer_state=True)
            for name in names:  # the optimizer state made the round trip too (adam: count, mu, nu)
                assert len(saved3["optimizer_state"][name]) == len(saved2["optimizer_state"][name]) == 3
                for a, b in zip(saved3["optimizer_state"][name], saved2["optimizer_state"][name]):
                    np.testing.assert_array_equal(a, b)
            assert jaxdist.latest_checkpoint(str(tmp_path)) == ckpt3
        finally:
            if coordinator is not None:
                coordinator.shutdown(exit_tasks=False)  # ends its dispatch loop thread
            strategy.close()


if __name__ == "__main__":
    mode, *rest = sys.argv[1:]
    if mode == "mirrored":
        _child_mirrored(*rest)
