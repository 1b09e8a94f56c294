"""Synchronous strategies on 8 fake CPU devices, checked against hand-computed values.

The other test modules import JAX with one CPU device, and the device count
is fixed when JAX starts, so every check here runs in ONE fresh subprocess
(``python tests/test_sync_strategies.py``) with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``. The subprocess runs
all checks and prints one JSON line ``{check: null | traceback}``; each test
below asserts on one check's result.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from device_checks import DeviceChecks, assert_passed
from sync_util import global_batches, mlp_data, per_example_loss, reference_training

NUM_DEVICES = 8

# ---------------------------------------------------------------------------------------
# Checks (run inside the 8-device subprocess)
# ---------------------------------------------------------------------------------------

CHECKS = DeviceChecks(__file__, "SYNC_CHECK_RESULTS=", timeout=240)
check = CHECKS.check


def _tx() -> Any:
    import optax

    return optax.sgd(0.1, momentum=0.9)


def _train(strategy: Any, params: Any, batches: list, gbs: int, epochs: int = 1, with_mask: bool = False) -> Any:
    import jax
    import numpy as np
    import optax

    import jaxdist.sync as sd

    tx = _tx()

    def step(p: Any, o: Any, batch: Any) -> Any:
        if with_mask:
            (x, y), mask = batch
        else:
            (x, y), mask = batch, None

        def loss_fn(p: Any) -> Any:
            return sd.compute_average_loss(per_example_loss(p, x, y), gbs, sample_weight=mask)

        loss, g = jax.value_and_grad(loss_fn)(p)
        g = sd.get_replica_context().all_reduce(sd.ReduceOp.SUM, g)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o, loss

    with strategy.scope():
        p = strategy.replicate(params)
        o = strategy.replicate(tx.init(p))
    dist = strategy.experimental_distribute_dataset(batches, with_mask=with_mask)
    for _ in range(epochs):
        for batch in dist:
            p, o, loss = strategy.run(step, args=(p, o, batch))
    assert strategy.trace_count == 1, strategy.trace_count  # one compiled step, short batch included
    return jax.tree.map(np.asarray, p)


def _assert_tree_close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    import jax
    import numpy as np

    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol, err_msg=str(path))


@check
def mirrored_training_matches_single_device() -> None:
    import jax

    import jaxdist.sync as sd

    params, x, y = mlp_data(n=96)
    batches = global_batches(x, y, 32)
    s = sd.MirroredStrategy()
    assert s.num_replicas_in_sync == 8 and list(s.devices) == jax.local_devices()
    _assert_tree_close(_train(s, params, batches, 32, epochs=2), reference_training(params, batches, _tx(), 32, epochs=2))


@check
def mirrored_short_last_batch_with_mask_matches_single_device() -> None:
    import jaxdist.sync as sd

    params, x, y = mlp_data(n=100)  # 32, 32, 32, then 4 rows
    batches = global_batches(x, y, 32)
    got = _train(sd.MirroredStrategy(), params, batches, 32, epochs=2, with_mask=True)
    _assert_tree_close(got, reference_training(params, batches, _tx(), 32, epochs=2))


@check
def tpu_strategy_code_path_matches_single_device() -> None:
    import jax

    import jaxdist.sync as sd
    from jaxdist.errors import ConfigurationError

    os.environ.pop("JAXDIST_TPU_FAKE_DEVICES", None)
    try:
        sd.TPUStrategy()
    except ConfigurationError as e:
        msg = str(e)
        assert "no TPU" in msg and "JAXDIST_TPU_FAKE_DEVICES=cpu" in msg and "devices=jax.devices('cpu')" in msg, msg
    else:
        raise AssertionError("TPUStrategy() without TPUs must raise ConfigurationError")
    params, x, y = mlp_data(n=64)
    batches = global_batches(x, y, 16)
    ref = reference_training(params, batches, _tx(), 16, epochs=1)
    os.environ["JAXDIST_TPU_FAKE_DEVICES"] = "cpu"
    try:
        s = sd.TPUStrategy()
    finally:
        del os.environ["JAXDIST_TPU_FAKE_DEVICES"]
    assert s.num_replicas_in_sync == 8
    _assert_tree_close(_train(s, params, batches, 16), ref)
    _assert_tree_close(_train(sd.TPUStrategy(devices=jax.devices("cpu")), params, batches, 16), ref)


@check
def one_device_and_central_storage_match_single_device() -> None:
    import jax

    import jaxdist.sync as sd

    params, x, y = mlp_data(n=64)
    batches = global_batches(x, y, 16)
    ref = reference_training(params, batches, _tx(), 16, epochs=1)
    one = sd.OneDeviceStrategy("cpu:3")
    assert one.device == jax.devices()[3] and one.num_replicas_in_sync == 1
    first = next(iter(one.experimental_distribute_dataset(batches)))
    assert not isinstance(first[0], sd.PerReplica) and first[0].devices() == {jax.devices()[3]}
    _assert_tree_close(_train(one, params, batches, 16), ref)

    cs = sd.CentralStorageStrategy()
    assert cs.num_replicas_in_sync == 8 and cs.parameter_device == jax.devices("cpu")[0]
    with cs.scope():
        v = cs.replicate({"w": params["w1"]})
    assert v["w"].devices() == {cs.parameter_device}
    _assert_tree_close(_train(cs, params, batches, 16), ref)
    # Updated variables come back to the parameter device after each step.
    out = cs.run(lambda p: jax.tree.map(lambda a: a * 2, p), args=(v,))
    assert out["w"].devices() == {cs.parameter_device}


@check
def reduce_matches_hand_computed() -> None:
    import jax.numpy as jnp
    import numpy as np

    import jaxdist.sync as sd

    s = sd.MirroredStrategy()
    pr = s.experimental_distribute_values_from_function(
        lambda ctx: np.array([ctx.replica_id_in_sync_group, 2 * ctx.replica_id_in_sync_group + 1], np.float32)
    )
    assert isinstance(pr, sd.PerReplica) and pr.shape == (2,) and pr.num_replicas == 8
    # sum_r r = 28, sum_r (2r+1) = 64
    np.testing.assert_allclose(s.reduce(sd.ReduceOp.SUM, pr, axis=None), [28, 64])
    np.testing.assert_allclose(s.reduce(sd.ReduceOp.MEAN, pr, axis=None), [3.5, 8])
    np.testing.assert_allclose(s.reduce("sum", pr, axis=0), 92)
    np.testing.assert_allclose(s.reduce("mean", pr, axis=0), 92 / 16)
    # A non-distributed value, as TF: MEAN returns it, SUM raises, 0 stays 0; with an axis it counts
    # as the same value on every replica (TF's run(reduce_sum)).
    try:
        s.reduce("sum", jnp.array([1.0, 2.0]), axis=None)
    except ValueError as e:
        assert "non-DistributedValues" in str(e)
    else:
        raise AssertionError("SUM of a non-distributed value must raise ValueError, as in TF")
    np.testing.assert_allclose(s.reduce("mean", jnp.array([1.0, 2.0]), axis=None), [1, 2])
    assert s.reduce("sum", 0) == 0
    np.testing.assert_allclose(s.reduce("mean", np.array([1.0, 3.0]), axis=0), 2)
    np.testing.assert_allclose(s.reduce("sum", np.array([1.0, 3.0]), axis=0), 32)
    # A replicated output of run is each replica's own (equal) value: TF returns them per replica, SUM adds them.
    same = s.run(lambda v: sd.get_replica_context().all_reduce("sum", v), args=(pr,))
    assert not isinstance(same, sd.PerReplica)
    np.testing.assert_allclose(s.reduce("sum", same), [8 * 28, 8 * 64])
    np.testing.assert_allclose(s.reduce("mean", same), [28, 64])
    tree = s.reduce("sum", {"a": pr, "b": (pr,)}, axis=None)
    np.testing.assert_allclose(tree["b"][0], [28, 64])
    out = s.reduce("sum", pr)
    assert out.sharding.is_fully_replicated
    # run output reduced: per-replica losses r / 2
    losses = s.run(lambda: sd.get_replica_context().replica_id_in_sync_group.astype(jnp.float32) / 2)
    np.testing.assert_allclose(s.reduce("sum", losses), 14)
    try:
        s.run(lambda v: s.reduce("sum", v), args=(pr,))
    except RuntimeError as e:
        assert "cross-replica" in str(e)
    else:
        raise AssertionError("reduce inside run must raise")


@check
def gather_matches_hand_computed() -> None:
    import numpy as np

    import jaxdist.sync as sd

    s = sd.MirroredStrategy()
    vals = [r * 10 + np.arange(6, dtype=np.float32).reshape(2, 3) for r in range(8)]
    pr = s.experimental_distribute_values_from_function(lambda ctx: vals[ctx.replica_id_in_sync_group])
    np.testing.assert_array_equal(s.gather(pr, axis=0), np.concatenate(vals, axis=0))
    np.testing.assert_array_equal(s.gather(pr, axis=1), np.concatenate(vals, axis=1))
    np.testing.assert_array_equal(s.gather(pr, axis=-1), np.concatenate(vals, axis=1))
    np.testing.assert_array_equal(s.gather(np.ones((1, 2)), axis=0), np.ones((1, 2)))  # non-distributed: unchanged
    replicated_out = s.run(lambda: np.ones((1, 2), np.float32) + 0)
    np.testing.assert_array_equal(s.gather(replicated_out, axis=0), np.ones((8, 2)))  # 8 equal replica values
    # In-replica all_gather agrees with the cross-replica gather.
    out = s.run(lambda v: sd.get_replica_context().all_gather(v, axis=0), args=(pr,))
    assert not isinstance(out, sd.PerReplica)
    np.testing.assert_array_equal(out, np.concatenate(vals, axis=0))


@check
def local_results_match_hand_computed() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxdist.sync as sd

    s = sd.MirroredStrategy()
    pr = s.experimental_distribute_values_from_function(lambda ctx: np.float32(ctx.replica_id_in_sync_group) * 3)
    local = s.experimental_local_results(pr)
    assert len(local) == 8
    for r, v in enumerate(local):
        assert float(v) == 3 * r and v.devices() == {jax.devices()[r]}
    rep = s.replicate(jnp.arange(3.0))
    copies = s.experimental_local_results(rep)
    assert [c.devices() for c in copies] == [{d} for d in jax.devices()]
    for c in copies:
        np.testing.assert_array_equal(c, [0, 1, 2])
    tree = s.experimental_local_results({"a": pr, "k": 5})
    assert [float(t["a"]) for t in tree] == [3.0 * r for r in range(8)] and all(t["k"] == 5 for t in tree)
    assert s.experimental_local_results(7) == (7,)


@check
def dataset_distribution_matches_hand_computed() -> None:
    import numpy as np

    import jaxdist.sync as sd

    s = sd.MirroredStrategy()
    x = np.arange(32, dtype=np.float32).reshape(16, 2)
    y = np.arange(16, dtype=np.int32)
    (bx, by), = list(s.experimental_distribute_dataset([(x, y)]))
    assert isinstance(bx, sd.PerReplica) and bx.shape == (2, 2) and bx.stacked.shape == (8, 2, 2)
    for r, v in enumerate(by.values):
        np.testing.assert_array_equal(v, [2 * r, 2 * r + 1])
    assert bx.stacked.sharding == s.per_replica_sharding

    # Dict batches from a generator; the short last batch of 5 rows with a mask: TF's split,
    # ceil(5 / 8) = 1 row each in order: 1, 1, 1, 1, 1, 0, 0, 0 real rows (padded to 2 rows each).
    def gen() -> Any:
        yield {"y": y}
        yield {"y": y[:5]}

    out = list(s.experimental_distribute_dataset(gen(), with_mask=True))
    assert len(out) == 2
    batch, mask = out[1]
    got_y = [np.asarray(v).tolist() for v in batch["y"].values]
    got_m = [np.asarray(v).tolist() for v in mask.values]
    assert got_y == [[0], [1], [2], [3], [4], [], [], []], got_y
    assert got_m == [[1, 0]] * 5 + [[0, 0]] * 3, got_m
    assert batch["y"].stacked.shape == (8, 2)  # one static shape for every batch
    assert [np.asarray(v).tolist() for v in out[0][1].values] == [[1, 1]] * 8

    # Without a mask the split is the same (TF's), and the padding rows are known to the strategy.
    short = list(s.experimental_distribute_dataset([(y,), (y[:8],)]))
    assert [np.asarray(v).tolist() for v in short[1][0].values] == [[r] for r in range(8)]
    uneven = list(s.experimental_distribute_dataset([(y,), (y[:5],)]))
    assert [len(v) for v in uneven[1][0].values] == [1, 1, 1, 1, 1, 0, 0, 0]
    np.testing.assert_array_equal(s.gather(uneven[1][0], axis=0), y[:5])
    assert len(list(s.experimental_distribute_dataset([(y,), (y[:5],)], drop_remainder=True))) == 1
    # Re-iterable over a re-iterable source.
    ds = s.experimental_distribute_dataset([(y,)] * 3)
    assert len(list(ds)) == 3 and len(list(ds)) == 3


@check
def datasets_from_function_matches_hand_computed() -> None:
    import numpy as np

    import jaxdist.sync as sd

    s = sd.MirroredStrategy()
    seen = []

    def dataset_fn(ctx: sd.InputContext) -> Any:
        seen.append(ctx)
        b = ctx.get_per_replica_batch_size(32)
        data = np.arange(42, dtype=np.int32)  # 10 full per-replica batches of 4, then 2 rows
        return [data[i : i + b] for i in range(0, len(data), b)]

    steps = list(s.distribute_datasets_from_function(dataset_fn, with_mask=True))
    assert seen == [sd.InputContext(num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=8)]
    assert len(steps) == 2
    x0, m0 = steps[0]
    assert [np.asarray(v).tolist() for v in x0.values] == [list(range(4 * r, 4 * r + 4)) for r in range(8)]
    x1, m1 = steps[1]
    got = [np.asarray(v).tolist() for v in x1.values]
    assert got[:3] == [[32, 33, 34, 35], [36, 37, 38, 39], [40, 41]] and got[3:] == [[]] * 5, got
    assert x1.stacked.shape == (8, 4)  # padded to the per-replica batch size
    assert [np.asarray(v).tolist() for v in m1.values][:4] == [[1] * 4, [1] * 4, [1, 1, 0, 0], [0] * 4]


@check
def loss_helpers_match_hand_computed() -> None:
    import jax.numpy as jnp
    import numpy as np

    import jaxdist.sync as sd

    s = sd.MirroredStrategy()
    per_ex = s.experimental_distribute_values_from_function(lambda ctx: np.array([1, 2, 3, 4], np.float32))
    w = s.experimental_distribute_values_from_function(lambda ctx: np.array([1, 1, 0, 0], np.float32))

    def fn(losses: Any, w: Any) -> Any:
        return (
            sd.compute_average_loss(losses, global_batch_size=32),
            sd.compute_average_loss(losses),  # 4 rows x 8 replicas
            sd.compute_average_loss(losses, 32, sample_weight=w),
            sd.compute_average_loss(jnp.stack([losses, losses], axis=1), 32, sample_weight=w),
            sd.scale_regularization_loss(jnp.float32(8.0)),
            sd.scale_regularization_loss([jnp.float32(2.0), jnp.float32(6.0)]),
        )

    out = s.run(fn, args=(per_ex, w))
    for got, want in zip(out, [10 / 32, 10 / 32, 3 / 32, 6 / 32, 1.0, 1.0]):
        vals = got.values if isinstance(got, sd.PerReplica) else (got,)
        np.testing.assert_allclose(np.asarray(vals, np.float32), want, rtol=1e-6)
    # The replicas' losses add up to the global-batch mean: 8 * 10 / 32.
    per_replica = s.run(lambda losses: sd.compute_average_loss(losses, 32), args=(per_ex,))
    assert isinstance(per_replica, sd.PerReplica)
    np.testing.assert_allclose(s.reduce("sum", per_replica), 2.5)
    with s.scope():
        for helper in (lambda: sd.compute_average_loss(jnp.ones(4)), lambda: sd.scale_regularization_loss(1.0)):
            try:
                helper()
            except RuntimeError as err:
                assert "cross replica context" in str(err)
            else:
                raise AssertionError("loss helpers must refuse the cross-replica context")
    np.testing.assert_allclose(sd.compute_average_loss(jnp.array([1.0, 2.0, 3.0, 4.0])), 2.5)
    for bad in (lambda: sd.compute_average_loss(jnp.float32(1.0), 4), lambda: sd.compute_average_loss(jnp.ones(4), 2.5)):
        try:
            bad()
        except ValueError:
            pass
        else:
            raise AssertionError("invalid arguments must raise ValueError")


@check
def run_compiles_once_and_classifies_outputs() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxdist.sync as sd

    s = sd.MirroredStrategy()
    params = s.replicate({"w": jnp.ones((3,))})
    xs = s.experimental_distribute_values_from_function(
        lambda ctx: np.full((3,), ctx.replica_id_in_sync_group, np.float32)
    )

    def fn(p: Any, x: Any, scale: float, mode: str) -> Any:
        g = jax.grad(lambda w: jnp.sum(w * x) * scale)(p["w"])  # per-replica gradient
        total = jax.lax.psum(g, "replica")
        looped = jax.lax.fori_loop(0, 3, lambda i, c: c + total, jnp.zeros(3))
        branch = jax.lax.cond(jnp.sum(total) > 0, lambda: p["w"] + 1, lambda: p["w"] - 1)
        jitted = jax.jit(lambda a, b: (a * 2, b * 2))(p["w"], g)
        return {"g": g, "total": total, "looped": looped, "branch": branch, "jit": jitted, "mode": len(mode)}

    for _ in range(4):
        out = s.run(fn, args=(params, xs, 1.0), kwargs={"mode": "ab"})
    assert s.trace_count == 1, s.trace_count
    assert isinstance(out["g"], sd.PerReplica) and isinstance(out["jit"][1], sd.PerReplica)
    for k in ("total", "looped", "branch"):
        assert isinstance(out[k], jax.Array) and out[k].sharding.is_fully_replicated, k
    assert not isinstance(out["jit"][0], sd.PerReplica) and int(out["mode"]) == 2
    np.testing.assert_allclose(out["total"], [28.0] * 3)  # sum_r r
    np.testing.assert_allclose(out["looped"], [84.0] * 3)
    assert [float(v[0]) for v in out["g"].values] == [float(r) for r in range(8)]
    s.run(fn, args=(params, xs, 1.0), kwargs={"mode": "abc"})  # new static value: one more trace
    s.run(fn, args=(params, xs, 2.0), kwargs={"mode": "ab"})  # same signature: cached
    assert s.trace_count == 2, s.trace_count
    # Outputs feed straight back in without copies.
    out2 = s.run(lambda a, b: (a + 1, b * 2), args=(out["total"], out["g"]))
    assert out2[0].sharding.is_fully_replicated and isinstance(out2[1], sd.PerReplica)


@check
def contexts_follow_tf() -> None:
    import jax.numpy as jnp
    import numpy as np

    import jaxdist.sync as sd
    from jaxdist.errors import ConfigurationError

    s = sd.MirroredStrategy()
    default = sd.get_strategy()
    assert default.num_replicas_in_sync == 1 and not sd.has_strategy()
    assert sd.get_replica_context() is not None and sd.get_replica_context().num_replicas_in_sync == 1
    with s.scope():
        assert sd.get_strategy() is s and sd.get_replica_context() is None and sd.in_cross_replica_context()
        seen = []

        def fn() -> Any:
            ctx = sd.get_replica_context()
            seen.append((sd.get_strategy(), ctx.num_replicas_in_sync, sd.in_cross_replica_context()))
            return ctx.replica_id_in_sync_group, ctx.all_reduce("mean", jnp.float32(ctx.replica_id_in_sync_group))

        ids, mean = s.run(fn)
        assert seen == [(s, 8, False)]
        assert [int(v) for v in ids.values] == list(range(8))
        np.testing.assert_allclose(mean, 3.5)
        try:
            with sd.OneDeviceStrategy(0).scope():
                pass
        except ConfigurationError:
            pass
        else:
            raise AssertionError("entering another strategy's scope must raise")
    assert sd.get_strategy() is default


# ---------------------------------------------------------------------------------------
# Tests (run in pytest; each asserts on one check of the shared subprocess)
# ---------------------------------------------------------------------------------------


check_results = CHECKS.results_fixture()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CHECKS.names())
def test_sync_on_8_fake_devices(name: str, check_results: dict[str, str | None]) -> None:
    assert_passed(check_results, name)


if __name__ == "__main__":
    CHECKS.main()
