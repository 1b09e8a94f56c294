"""Gradients pushed in bfloat16/float16 (half the bytes); the PS runs the optimizer in the variable's dtype."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.errors import DTypeMismatchError
from jaxdist.ps_server.optimizer import Optimizer
from jaxdist.ps_server.store import Op, Update, VariableStore
from jaxdist.variables import gradient_array

BF16 = np.dtype(ml_dtypes.bfloat16)


@pytest.mark.timeout(60)
def test_store_widens_narrow_gradients_and_rejects_them_elsewhere() -> None:
    store = VariableStore()
    store.create("w", value=np.ones(8, np.float32), optimizer=Optimizer(optax.sgd(0.5)))
    g = np.linspace(-1, 1, 8).astype(np.float32)
    store.apply([Update("w", Op.APPLY_GRADIENT, g.astype(BF16))])
    with store.reading("w") as r:
        got = np.array(r.value)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, 1 - 0.5 * g.astype(BF16).astype(np.float32))
    store.apply([Update("w", Op.SPARSE_APPLY_GRADIENT, np.ones((3,), np.float16), np.array([0, 0, 7]))])
    with store.reading("w") as r:
        assert r.value[0] == pytest.approx(got[0] - 1.0) and r.value[7] == pytest.approx(got[7] - 0.5)
    for op, value in [(Op.ASSIGN, np.zeros(8, BF16)), (Op.APPLY_GRADIENT, np.zeros(8, np.float64)), (Op.APPLY_GRADIENT, np.zeros(8, np.int16))]:
        with pytest.raises(DTypeMismatchError):
            store.apply([Update("w", op, value)])


@pytest.mark.timeout(30)
def test_gradient_array_casts_only_what_it_should() -> None:
    f32 = np.dtype(np.float32)
    assert gradient_array(np.ones(3, np.float64), f32).dtype == f32
    assert gradient_array([1.0, 2.0], f32, BF16).dtype == BF16  # plain Python values too
    assert gradient_array(np.ones(3, np.float32), f32, BF16).dtype == BF16
    assert gradient_array(jnp.ones(3, jnp.float32), f32, BF16).dtype == BF16  # cast by XLA
    assert gradient_array(np.ones(3, BF16), f32).dtype == BF16  # already narrow: travels as is
    assert gradient_array(np.ones(3, np.int32), np.dtype(np.int32), BF16).dtype == np.int32  # not a float variable
    assert gradient_array(np.ones(3, np.float16), np.dtype(np.float16), BF16).dtype == np.float16  # not wider


@pytest.mark.timeout(180)
@pytest.mark.multiprocess
def test_bf16_transfer_halves_pushed_bytes_and_trains_the_same_model() -> None:
    with jaxdist.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        init = {"w": np.ones((64, 32), np.float32), "b": np.zeros(32, np.float32)}
        with strategy.scope():
            full = jaxdist.create_variables(init, name="full", optimizer=optax.sgd(0.1))
            half = jaxdist.create_variables(init, name="half", optimizer=optax.sgd(0.1))
        grads = {"w": np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32), "b": np.full(32, 0.3, np.float32)}

        def pushed() -> float:
            return sum(c.status().counters["bytes_pushed"] for c in strategy._conns.clients)

        before = pushed()
        jaxdist.apply_gradients(full, grads)
        mid = pushed()
        jaxdist.apply_gradients(half, grads, transfer_dtype=jnp.bfloat16)
        after = pushed()
        assert after - mid == pytest.approx((mid - before) / 2, rel=0.02)
        got_full, got_half = jaxdist.pull(full), jaxdist.pull(half)
        assert got_half["w"].dtype == np.float32
        np.testing.assert_allclose(got_half["w"], got_full["w"], atol=0.1 * 2**-8 * np.abs(grads["w"]).max())
        expect = init["w"] - 0.1 * grads["w"].astype(BF16).astype(np.float32)
        np.testing.assert_allclose(got_half["w"], expect, rtol=1e-6)
        with pytest.raises(ValueError, match="transfer_dtype"):
            jaxdist.apply_gradients(half, grads, transfer_dtype=np.int8)
        strategy.close()
