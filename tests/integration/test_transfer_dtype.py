"""Gradients pushed, and values pulled, in bfloat16/float16 (half the bytes); the PS keeps the
variable and runs the optimizer in the variable's dtype (mixed precision)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.errors import DTypeMismatchError
from jaxdist.ps_server.optimizer import Optimizer
from jaxdist.proto.ps_wire import Op, Update
from jaxdist.ps_server.store import VariableStore
from jaxdist.proto.ps_wire import GRADIENT_OPS, NARROW_FLOATS, transfer_dtype, wire_value

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
def test_wire_value_casts_only_what_it_should() -> None:
    f32, grad = np.dtype(np.float32), Op.APPLY_GRADIENT
    assert wire_value(np.ones(3, np.float64), f32, grad).dtype == f32
    assert wire_value([1.0, 2.0], f32, grad, BF16).dtype == BF16  # plain Python values too
    assert wire_value(np.ones(3, np.float32), f32, grad, BF16).dtype == BF16
    assert wire_value(jnp.ones(3, jnp.float32), f32, grad, BF16).dtype == BF16  # cast by XLA
    assert wire_value(np.ones(3, BF16), f32, grad).dtype == BF16  # already narrow: travels as is
    assert wire_value(np.ones(3, np.int32), np.dtype(np.int32), grad, BF16).dtype == np.int32  # not a float variable
    assert wire_value(np.ones(3, np.float16), np.dtype(np.float16), grad, BF16).dtype == np.float16  # not wider
    assert wire_value(np.ones(3, BF16), f32, Op.ASSIGN).dtype == f32  # only gradients (and pulls) travel narrow
    assert wire_value(np.ones(3, BF16), f32, Op.SPARSE_APPLY_GRADIENT).dtype == BF16
    keep = np.ones(3, np.float32)
    assert wire_value(keep, f32, Op.ASSIGN_ADD) is keep  # already in its transfer dtype: no copy


@pytest.mark.timeout(30)
@pytest.mark.parametrize("op", list(Op) + [None])
@pytest.mark.parametrize("var", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int32])
@pytest.mark.parametrize("offered", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, np.int16, np.int32])
def test_one_rule_decides_what_clients_send_and_the_ps_accepts(op: Op | None, var: object, offered: object) -> None:
    """What a client sends (the value's dtype offered) is what the PS accepts: never a
    DTypeMismatchError for what a client made, and a narrow dtype only where the rule allows it."""
    var_dt, off = np.dtype(var), np.dtype(offered)
    sent = transfer_dtype(var_dt, op, off)
    assert transfer_dtype(var_dt, op, sent) == sent  # the PS accepts what the client sends
    if sent != var_dt:
        assert (op is None or op in GRADIENT_OPS) and sent in NARROW_FLOATS and var_dt.itemsize > sent.itemsize
    if op is not None and op not in GRADIENT_OPS:
        assert sent == var_dt


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
            return sum(c.status().counters["bytes_pushed"] for c in strategy.connections.clients)

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


@pytest.mark.timeout(60)
def test_store_reads_a_narrow_copy_once_per_version() -> None:
    store = VariableStore()
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(4, 3) + np.float32(1e-3)
    store.create("w", value=x, optimizer=Optimizer(optax.sgd(0.5)))
    store.create("i", value=np.arange(4, dtype=np.int32))
    with store.reading("w", as_dtype=BF16) as r:
        first = r.value
        assert r.dtype == BF16 and first.dtype == BF16 and r.version == 1
        np.testing.assert_array_equal(first, x.astype(BF16))
    with store.reading("w", as_dtype=BF16) as r:
        assert r.value is first  # cached for this version
    with store.reading("w", as_dtype=np.float32) as r:  # its own dtype: as stored
        assert r.value.dtype == np.float32
    with store.reading("w", np.array([3, 0]), as_dtype=np.float16) as r:
        np.testing.assert_array_equal(r.value, x[[3, 0]].astype(np.float16))
    with store.reading("w", known_version=1, as_dtype=BF16) as r:
        assert r.value is None and r.dtype == BF16
    g = np.ones((4, 3), np.float32)
    store.apply([Update("w", Op.APPLY_GRADIENT, g)])  # the next version is rounded from the optimizer's XLA output
    with store.reading("w", as_dtype=BF16) as r:
        assert r.version == 2 and r.value is not first
        np.testing.assert_array_equal(r.value, (x - 0.5).astype(BF16))
    with store.reading("w") as r:  # the variable itself stays float32, exact
        np.testing.assert_array_equal(r.value, x - 0.5)
    store.apply([Update("w", Op.ASSIGN_ADD, g)])  # and after an in-place write
    with store.reading("w", as_dtype=BF16) as r:
        np.testing.assert_array_equal(r.value, (x + 0.5).astype(BF16))
    from jaxdist.errors import InvalidRequestError

    for name, dt in [("i", BF16), ("w", np.int8), ("w", np.float64)]:
        with pytest.raises(InvalidRequestError):
            with store.reading(name, as_dtype=dt):
                pass


@pytest.mark.timeout(180)
@pytest.mark.multiprocess
def test_mixed_precision_pull_halves_pulled_bytes() -> None:
    with jaxdist.LocalCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        rng = np.random.default_rng(1)
        init = {"w": rng.normal(size=(64, 32)).astype(np.float32), "step": np.arange(6, dtype=np.int32)}
        with strategy.scope():
            v = jaxdist.create_variables(init, name="mp", optimizer=optax.sgd(0.1))

        def pulled() -> float:
            return sum(c.status().counters["bytes_pulled"] for c in strategy.connections.clients)

        before = pulled()
        full = jaxdist.pull(v)
        mid = pulled()
        half = jaxdist.pull(v, dtype=jnp.bfloat16)
        after = pulled()
        assert after - mid == pytest.approx(64 * 32 * 2 + 6 * 4) and mid - before == pytest.approx(64 * 32 * 4 + 6 * 4)
        assert half["w"].dtype == BF16 and half["step"].dtype == np.int32  # only wider floats are narrowed
        np.testing.assert_array_equal(half["w"], full["w"].astype(BF16))
        np.testing.assert_array_equal(half["step"], init["step"])
        with pytest.raises(ValueError, match="bfloat16 or float16"):
            jaxdist.pull(v, dtype=np.int8)
        strategy.close()


@pytest.mark.timeout(60)
def test_narrow_pull_over_both_transports(ps_client: object) -> None:
    from jaxdist.errors import InvalidRequestError
    from jaxdist.ps_server.client import CreateSpec, PullSpec

    x = np.random.default_rng(2).normal(size=(300, 700)).astype(np.float32)  # > one 4 MiB gRPC frame
    ps_client.create([CreateSpec("x", value=x)])  # type: ignore[attr-defined]
    ((got, ver),) = ps_client.pull([PullSpec("x", as_dtype=BF16)])  # type: ignore[attr-defined]
    assert ver == 1 and got.dtype == BF16 and np.array_equal(got, x.astype(BF16))
    ((rows, _),) = ps_client.pull([PullSpec("x", indices=np.array([7, 1]), as_dtype=np.float16)])  # type: ignore[attr-defined]
    assert np.array_equal(rows, x[[7, 1]].astype(np.float16))
    with pytest.raises(InvalidRequestError):
        ps_client.pull([PullSpec("x", as_dtype=np.int8)])  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_apply_gradient_method_sends_bf16_like_apply_gradients() -> None:
    """``v.apply_gradient(bf16)`` used to cast the gradient up to float32 before sending it; it now
    sends what ``apply_gradients(v, bf16)`` sends: half the bytes, the same update on the PS."""
    from jaxdist.testing import InProcessCluster

    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            init = np.linspace(-1, 1, 64 * 32, dtype=np.float32).reshape(64, 32)
            with strategy.scope():
                by_method = jaxdist.create_variable(init, name="by_method", optimizer=optax.sgd(0.1))
                by_tree = jaxdist.create_variable(init, name="by_tree", optimizer=optax.sgd(0.1))
            g = np.random.default_rng(3).normal(size=(64, 32)).astype(BF16)
            counters = cluster.ps(0).servicer.counters

            def pushed() -> float:
                return counters.snapshot()["bytes_pushed"]

            before = pushed()
            by_method.apply_gradient(g)
            mid = pushed()
            jaxdist.apply_gradients(by_tree, g)
            after = pushed()
            assert mid - before == after - mid == g.nbytes  # bf16 on the wire both ways
            np.testing.assert_array_equal(by_method.numpy(), by_tree.numpy())
        finally:
            strategy.close()
