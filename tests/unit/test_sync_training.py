"""TF's training-loop contract on one CPU device: variables, Optimizer, metrics, jaxdist.function, traps.

The 8-replica versions of these checks are in tests/integration/test_sync_strategies.py;
here the default strategy and OneDeviceStrategy exercise the same code paths without fake devices.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from sklearn import metrics as skm

import jaxdist
import jaxdist.sync as sd
from jaxdist import errors as E
from jaxdist.sync.optimizer import per_variable_layout

pytestmark = pytest.mark.timeout(120)


def _data(n: int = 50, d: int = 6, classes: int = 3, seed: int = 0) -> tuple[Any, Any, Any]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, classes, size=(n,)).astype(np.int32)
    params = {"w": (rng.normal(size=(d, classes)) * 0.3).astype(np.float32), "b": np.zeros(classes, np.float32)}
    return params, x, y


def _per_example(p: Any, x: Any, y: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(x @ p["w"] + p["b"], y)


def _reference(params: Any, batches: list, gbs: int, tx: Any) -> Any:
    p = jax.tree.map(jnp.asarray, params)
    o = tx.init(p)
    for x, y in batches:
        g = jax.grad(lambda p: jnp.sum(_per_example(p, x, y)) / gbs)(p)
        u, o = tx.update(g, o, p)
        p = optax.apply_updates(p, u)
    return p


def _close(a: Any, b: Any, tol: float = 1e-6) -> None:
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


# -- compute_average_loss -------------------------------------------------------------------------


def test_compute_average_loss_is_float_and_div_no_nan() -> None:
    out = sd.compute_average_loss(jnp.array([1, 2, 3, 4]), global_batch_size=2 * 2)
    assert jnp.issubdtype(out.dtype, jnp.floating) and float(out) == 2.5
    assert float(sd.compute_average_loss(np.array([1, 2], np.int32))) == 1.5  # default: rows x 1 replica
    assert float(sd.compute_average_loss(jnp.array([1.0, 2.0]), global_batch_size=0)) == 0.0  # TF's div_no_nan


# -- the TF pattern on the default strategy and OneDevice -------------------------------------------


def _tf_style_training(strategy: Any, batches: list, gbs: int, tx: Any, params0: Any, compile_step: bool) -> Any:
    with strategy.scope():
        params = jaxdist.create_variables(params0)
        optimizer = jaxdist.Optimizer(tx)
        accuracy = jaxdist.metrics.SparseCategoricalAccuracy()

    def train_step(batch: Any) -> Any:
        x, y = batch

        def loss_fn(p: Any) -> Any:
            return jaxdist.compute_average_loss(_per_example(p, x, y), gbs), x @ p["w"] + p["b"]

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(jaxdist.read_variables(params))
        optimizer.apply(grads, params)
        accuracy.update_state(y, logits)
        return loss

    def step(batch: Any) -> Any:
        return strategy.reduce("sum", strategy.run(train_step, args=(batch,)), axis=None)

    step_fn = jaxdist.function(step) if compile_step else step
    for batch in strategy.experimental_distribute_dataset(batches):
        step_fn(batch)
    assert int(optimizer.iterations.value()) == len(batches)
    return jaxdist.read_variables(params), accuracy


def test_default_strategy_variables_optimizer_match_plain_optax() -> None:
    params0, x, y = _data()
    gbs = 16
    batches = [(x[i : i + gbs], y[i : i + gbs]) for i in range(0, len(x), gbs)]  # 16, 16, 16, 2
    tx = optax.adam(0.05)
    got, acc = _tf_style_training(jaxdist.get_strategy(), batches, gbs, tx, params0, compile_step=True)
    _close(got, _reference(params0, batches, gbs, tx))
    assert 0.0 <= float(acc.result()) <= 1.0
    # Eagerly (no jaxdist.function: every op runs as it comes, as TF's default strategy): the same numbers.
    got, _ = _tf_style_training(jaxdist.get_strategy(), batches[:1], gbs, tx, params0, compile_step=False)
    _close(got, _reference(params0, batches[:1], gbs, tx))


def test_one_device_strategy_compiles_once_per_shape() -> None:
    params0, x, y = _data()
    gbs = 16
    batches = [(x[i : i + gbs], y[i : i + gbs]) for i in range(0, len(x), gbs)]
    tx = optax.sgd(0.1, momentum=0.9)
    s = jaxdist.OneDeviceStrategy(0)
    got, _ = _tf_style_training(s, batches, gbs, tx, params0, compile_step=False)
    _close(got, _reference(params0, batches, gbs, tx))
    assert s.trace_count == 2  # full batches and the short last one (OneDevice keeps its real rows, as TF)


def test_run_steps_on_default_and_one_device_match_step_by_step() -> None:
    params0, x, y = _data()
    gbs = 16
    batches = [(x[i : i + gbs], y[i : i + gbs]) for i in range(0, len(x), gbs)]
    tx = optax.sgd(0.1)
    ref = _reference(params0, batches, gbs, tx)
    for strategy in (jaxdist.get_strategy(), jaxdist.OneDeviceStrategy(0)):
        with strategy.scope():
            params = jaxdist.create_variables(params0)
            opt = jaxdist.Optimizer(tx)

        def train_step(batch: Any) -> Any:
            bx, by = batch
            loss, g = jax.value_and_grad(lambda p: jaxdist.compute_average_loss(_per_example(p, bx, by), gbs))(
                jaxdist.read_variables(params)
            )
            opt.apply(g, params)
            return loss

        it = iter(strategy.experimental_distribute_dataset(batches))
        first = strategy.run_steps(train_step, it, steps=3)  # 3 steps in one call
        rest = strategy.run_steps(train_step, it, steps=3)  # the short batch, padded, alone
        assert strategy.run_steps(train_step, it, steps=3) is None
        assert np.shape(strategy.reduce("sum", first, axis=None)) == (3,)  # one loss per step
        assert np.shape(strategy.reduce("sum", rest, axis=None)) == (1,)
        _close(jaxdist.read_variables(params), ref)
        assert int(opt.iterations.value()) == 4


# -- jax.jit / jaxdist.function -------------------------------------------------------------------


def test_jax_jit_around_run_and_reduce_works_without_variables() -> None:
    s = jaxdist.OneDeviceStrategy(0)
    w = s.replicate(jnp.ones((3,)))

    @jax.jit
    def step(w: Any, x: Any) -> Any:
        out = s.run(lambda w, x: jnp.sum(w * x), args=(w, x))
        return s.reduce("mean", out, axis=None)

    assert float(step(w, jnp.arange(3.0))) == 3.0
    assert float(step(w, jnp.arange(3.0) * 2)) == 6.0


def test_variables_inside_plain_jax_jit_are_a_loud_error() -> None:
    with jaxdist.get_strategy().scope():
        v = jaxdist.create_variables({"w": np.ones(2, np.float32)})

    with pytest.raises(E.ConfigurationError, match="jaxdist.function"):
        jax.jit(lambda: v["w"].value() * 2)()
    with pytest.raises(E.ConfigurationError, match="jaxdist.function"):
        jax.jit(lambda: v["w"].assign(jnp.zeros(2)))()

    @jaxdist.function
    def bump() -> Any:
        v["w"].assign_add(jnp.ones(2))
        return v["w"].value()

    np.testing.assert_array_equal(bump(), [2, 2])
    np.testing.assert_array_equal(bump(), [3, 3])
    np.testing.assert_array_equal(v["w"].numpy(), [3, 3])
    assert bump.trace_count == 1


# -- the run-cache trap ------------------------------------------------------------------------------

SCALE = 1.0


def _scaled(x: Any) -> Any:
    return x * SCALE


def test_rebinding_a_captured_global_retraces(caplog: pytest.LogCaptureFixture) -> None:
    global SCALE
    s = jaxdist.OneDeviceStrategy(0)
    x = jnp.ones(2)
    SCALE = 1.0
    assert float(s.run(_scaled, args=(x,))[0]) == 1.0
    SCALE = 3.0  # jax.jit would keep using 1.0
    assert float(s.run(_scaled, args=(x,))[0]) == 3.0
    assert s.trace_count == 2
    assert float(s.run(_scaled, args=(x,))[0]) == 3.0
    assert s.trace_count == 2  # unchanged since: cached
    factor = 2.0

    def closure(v: Any) -> Any:
        return v * factor

    assert float(s.run(closure, args=(x,))[0]) == 2.0
    factor = 5.0  # noqa: F841 - read by closure
    assert float(s.run(closure, args=(x,))[0]) == 5.0
    with caplog.at_level(logging.WARNING, logger="jaxdist.sync.loops"):
        for k in range(4):
            SCALE = 10.0 + k
            assert float(s.run(_scaled, args=(x,))[0]) == SCALE
    assert any("pass it as an argument" in r.message for r in caplog.records)
    SCALE = 1.0


def test_a_function_defined_inside_the_caller_compiles_once() -> None:
    """TF's ``testStrategyRun`` pattern: ``replica_fn`` is made anew on every call of the outer function.

    ``run`` keys it by its code and what it captures (as ``tf.function``), so 50 calls trace once; a
    changed captured value (a scalar, or another array object) traces again and its value is used."""
    s = jaxdist.OneDeviceStrategy(0)
    x = jnp.ones(2)
    w = jnp.full(2, 2.0)

    def step(scale: float, weights: Any) -> Any:
        def helper(v: Any) -> Any:  # a second function made anew each call, read by replica_fn
            return v * weights

        def replica_fn(v: Any, offset: float = scale) -> Any:
            return helper(v) * scale + offset

        return s.run(replica_fn, args=(x,))

    before = s.trace_count
    for _ in range(50):
        assert float(step(1.0, w)[0]) == 3.0
    assert s.trace_count == before + 1  # one compile for 50 function objects
    assert float(step(2.0, w)[0]) == 6.0  # a captured scalar changed: traced again, new value used
    assert s.trace_count == before + 2
    assert float(step(2.0, w)[0]) == 6.0
    assert s.trace_count == before + 2
    w2 = jnp.full(2, 3.0)  # another array object (unhashable): keyed by identity, so traced again
    assert float(step(1.0, w2)[0]) == 4.0
    assert s.trace_count == before + 3
    assert float(step(1.0, w)[0]) == 3.0  # the first array object again: its program is still cached
    assert s.trace_count == before + 3
    # 1 and 1.0 and True are different constants to a trace: not the same key.
    assert float(step(1, w)[0]) == 3.0
    assert s.trace_count == before + 4
    # numpy scalars are keyed by type and value: a new np.float32(1.0) object each call compiles once.
    for _ in range(3):
        assert float(step(np.float32(1.0), w)[0]) == 3.0
    assert s.trace_count == before + 5
    assert float(step(np.float32(2.0), w)[0]) == 6.0
    assert s.trace_count == before + 6


# -- Optimizer state layout ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tx",
    [optax.sgd(0.1), optax.sgd(0.1, momentum=0.9), optax.adam(1e-3), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))],
    ids=["sgd", "momentum", "adam", "clip+adam"],
)
def test_optimizer_state_is_per_variable_like_the_ps(tx: Any) -> None:
    params = {"a": jnp.ones((3, 2)), "b": jnp.zeros((2,))}
    layout = per_variable_layout(tx, params, tx.init(params))
    assert layout is not None
    for leaf, idx in zip(jax.tree.leaves(params), layout):
        single = jax.tree.leaves(tx.init(leaf))
        state = jax.tree.leaves(tx.init(params))
        assert [np.shape(state[j]) for j in idx] == [np.shape(x) for x in single]


def test_optimizer_with_whole_tree_state_checkpoints_by_name(tmp_path: Path) -> None:
    params0 = {"a": np.ones((3,), np.float32), "b": np.ones((2,), np.float32)}
    tx = optax.multi_transform({"fast": optax.sgd(0.5), "slow": optax.adam(0.1)}, {"a": "fast", "b": "slow"})
    s = jaxdist.OneDeviceStrategy(0)
    with s.scope():
        params = jaxdist.create_variables(params0, name="p")
        opt = jaxdist.Optimizer(tx, name="mt")

    def step() -> None:
        opt.apply(jax.grad(lambda p: jnp.sum(p["a"] ** 2) + jnp.sum(p["b"] ** 2))(jaxdist.read_variables(params)), params)

    s.run(step)
    assert opt._layout is None  # labels make the state whole-tree
    ckpt = jaxdist.Checkpoint(s)
    path = ckpt.write(str(tmp_path / "ckpt-1"))
    before = [np.asarray(v.value()) for v in opt.variables]
    s.run(step)
    ckpt.restore(path)
    for v, b in zip(opt.variables, before):
        np.testing.assert_array_equal(np.asarray(v.value()), b)


# -- metrics against scikit-learn ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [jaxdist.get_strategy, lambda: jaxdist.OneDeviceStrategy(0), jaxdist.MirroredStrategy, jaxdist.CentralStorageStrategy,
     lambda: jaxdist.TPUStrategy(devices=jax.devices("cpu"))],
    ids=["default", "one_device", "mirrored", "central_storage", "tpu"],
)
def test_metrics_are_made_and_updated_under_every_synchronous_strategy(make: Any) -> None:
    """jaxdist.metrics in each synchronous strategy's scope, updated inside its run (TPUStrategy on this process's
    CPU devices; the ParameterServerStrategy's case is in tests/integration/test_coordinator.py, the multi-process
    MultiWorkerMirrored and TPU-slice cases in tests/multiprocess/test_sync_multiprocess.py)."""
    strategy = make()
    y = np.array([0, 1, 2, 1], np.int32)
    logits = np.eye(3, dtype=np.float32)[[0, 1, 1, 1]]
    with strategy.scope():
        acc, mean = jaxdist.metrics.SparseCategoricalAccuracy(), jaxdist.metrics.Mean()
    strategy.run(lambda a, b: (acc.update_state(a, b), mean.update_state(b[:, 0]))[-1], args=(jnp.asarray(y), jnp.asarray(logits)))
    assert float(acc.result()) == pytest.approx(0.75)
    assert float(mean.result()) == pytest.approx(0.25)


def test_metrics_match_sklearn_with_a_short_last_batch() -> None:
    rng = np.random.default_rng(1)
    n, c = 45, 4
    y = rng.integers(0, c, size=n).astype(np.int32)
    logits = rng.normal(size=(n, c)).astype(np.float32)
    probs = np.asarray(jax.nn.softmax(logits))
    scores = rng.random(n).astype(np.float32)
    binary = (rng.random(n) < 0.4).astype(np.int32)
    w = rng.random(n).astype(np.float32)
    with jaxdist.get_strategy().scope():
        mean, total = jaxdist.metrics.Mean(), jaxdist.metrics.Sum()
        acc, sacc = jaxdist.metrics.Accuracy(), jaxdist.metrics.SparseCategoricalAccuracy()
        xent = jaxdist.metrics.SparseCategoricalCrossentropy(from_logits=True)
        pxent = jaxdist.metrics.SparseCategoricalCrossentropy()
        auc_exact = jaxdist.metrics.AUC(thresholds=np.unique(scores).tolist())
        auc = jaxdist.metrics.AUC()
        wmean = jaxdist.metrics.Mean(name="wmean")
    @jaxdist.function
    def update(y: Any, logits: Any, probs: Any, scores: Any, binary: Any, w: Any) -> None:
        mean.update_state(scores)
        wmean.update_state(scores, sample_weight=w)
        total.update_state(scores)
        acc.update_state(y, jnp.argmax(logits, -1))
        sacc.update_state(y, logits)
        xent.update_state(y, logits)
        pxent.update_state(y, probs)
        auc_exact.update_state(binary, scores)
        auc.update_state(binary, scores)

    for i in range(0, n, 16):  # 16, 16, 13
        sl = slice(i, i + 16)
        update(y[sl], logits[sl], probs[sl], scores[sl], binary[sl], w[sl])
    np.testing.assert_allclose(mean.result(), scores.mean(), rtol=1e-6)
    np.testing.assert_allclose(wmean.result(), np.average(scores, weights=w), rtol=1e-6)
    np.testing.assert_allclose(total.result(), scores.sum(), rtol=1e-6)
    right = int(round(skm.accuracy_score(y, np.argmax(logits, -1), normalize=False)))
    for m in (acc, sacc):  # exact counts, and the float32 ratio
        assert (float(m.total.value()), float(m.count.value())) == (right, n)
        assert float(m.result()) == float(np.float32(right) / np.float32(n))
    np.testing.assert_allclose(xent.result(), skm.log_loss(y, probs, labels=list(range(c))), rtol=1e-5)
    np.testing.assert_allclose(pxent.result(), skm.log_loss(y, probs, labels=list(range(c))), rtol=1e-5)
    np.testing.assert_allclose(auc_exact.result(), skm.roc_auc_score(binary, scores), rtol=1e-6)
    assert abs(float(auc.result()) - skm.roc_auc_score(binary, scores)) < 0.02  # 200 fixed thresholds
    sacc.reset_state()
    assert float(sacc.result()) == 0.0
    with pytest.raises(NotImplementedError, match="multi_label"):
        jaxdist.metrics.AUC(multi_label=True)


# -- options that must not be silently ignored --------------------------------------------------------------


def test_options_are_honoured_or_rejected() -> None:
    s = jaxdist.OneDeviceStrategy(0)
    with pytest.raises(E.ConfigurationError, match="RunOptions"):
        s.run(lambda: 1, options=object())
    with pytest.raises(TypeError, match="InputOptions"):
        s.experimental_distribute_dataset([(np.ones(4),)], options={"prefetch": 2})
    with pytest.raises(ValueError, match="PER_REPLICA"):
        s.experimental_distribute_dataset(
            [(np.ones(4),)], options=jaxdist.InputOptions(experimental_replication_mode=jaxdist.InputReplicationMode.PER_REPLICA)
        )
    with pytest.raises(ValueError, match="PER_REPLICA"):
        jaxdist.InputOptions(experimental_place_dataset_on_device=True)
    with pytest.raises(ValueError, match="cannot both be True"):
        jaxdist.InputOptions(
            experimental_place_dataset_on_device=True,
            experimental_fetch_to_device=True,
            experimental_replication_mode="per_replica",
        )
    with pytest.raises(TypeError, match="CrossDeviceOps"):
        jaxdist.MirroredStrategy(cross_device_ops="nccl")
    with pytest.raises(ValueError, match="bytes_per_pack"):
        jaxdist.CommunicationOptions(bytes_per_pack=-1)
    with pytest.raises(E.ConfigurationError, match="NCCL needs GPUs"):
        s.run(
            lambda: jaxdist.get_replica_context().all_reduce(
                "sum", jnp.ones(2), options=jaxdist.CommunicationOptions(implementation="NCCL")
            )
        )
    with pytest.raises(E.ConfigurationError, match="MultiWorkerMirroredStrategy"):
        s.run(
            lambda: jaxdist.get_replica_context().all_reduce(
                "sum", jnp.ones(2), options=jaxdist.CommunicationOptions(timeout_seconds=5)
            )
        )
    with pytest.raises(E.ConfigurationError, match="timeout"):
        # a single-process MultiWorkerMirroredStrategy honours it; per call it is refused everywhere
        jaxdist.get_strategy().extended.reduce_to("sum", 1.0, None, options=jaxdist.CommunicationOptions(timeout_seconds=1))
    with pytest.raises(E.ConfigurationError, match="spmd"):
        jaxdist.TPUStrategy(experimental_spmd_xla_partitioning=True, devices=jax.devices())


def test_one_shot_generator_is_refused_on_its_second_epoch() -> None:
    s = jaxdist.get_strategy()

    def gen() -> Any:
        yield (np.arange(4),)
        yield (np.arange(4),)

    ds = s.experimental_distribute_dataset(gen())
    assert len(list(ds)) == 2
    with pytest.raises(E.ConfigurationError, match="one-shot iterator"):
        list(ds)
    again = s.distribute_datasets_from_function(lambda ctx: gen())
    assert len(list(again)) == 2 and len(list(again)) == 2  # the function is called for every pass
    reiterable = s.experimental_distribute_dataset([(np.arange(4),)] * 3)
    assert len(list(reiterable)) == 3 and len(list(reiterable)) == 3


def test_create_variables_follows_the_scope() -> None:
    with jaxdist.get_strategy().scope():
        v = jaxdist.create_variables({"a": np.zeros(2, np.float32)}, name="scoped")
        with pytest.raises(E.ConfigurationError, match="jaxdist.Optimizer"):
            jaxdist.create_variables({"a": np.zeros(2)}, optimizer=optax.sgd(0.1))
    assert isinstance(v["a"], jaxdist.SyncVariable) and v["a"].name == "scoped/a"
    with pytest.raises(E.ConfigurationError, match="scope"):
        jaxdist.create_variables({"a": np.zeros(2)})  # outside any scope: the PS path's error, not a silent local


def test_mirrored_variable_update_rules() -> None:
    with jaxdist.get_strategy().scope():
        v = jaxdist.create_variable(np.zeros(3, np.float32), name="rules")
        r = jaxdist.create_variable(
            np.zeros((), np.float32), name="onread", synchronization="ON_READ", aggregation="SUM"
        )
    with pytest.raises(ValueError, match="does not broadcast"):
        v.assign(1.0)
    with pytest.raises(ValueError, match="NONE"):
        sd.create_variable(np.zeros(1), synchronization="NONE")
    with pytest.raises(ValueError, match="trainable"):
        sd.create_variable(np.zeros(1), synchronization="ON_READ", trainable=True)
    r.assign_add(np.float32(2.0))
    assert float(r.value()) == 2.0 and v.numpy().tolist() == [0, 0, 0]


# -- TPUClusterResolver from a (fake) Cloud TPU VM environment -------------------------------------------

_TPU_ENV = ("TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "TPU_WORKER_ID", "TPU_ACCELERATOR_TYPE",
            "TPU_CHIPS_PER_HOST_BOUNDS", "TPU_HOST_BOUNDS", "MEGASCALE_NUM_SLICES", "MEGASCALE_SLICE_ID",
            "MEGASCALE_COORDINATOR_ADDRESS")


@pytest.fixture
def tpu_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for k in _TPU_ENV + ("TF_CONFIG", "JAXDIST_CLUSTER", "JAXDIST_CLUSTER_RESOLVER", "SLURM_PROCID", "SLURM_STEP_NODELIST"):
        monkeypatch.delenv(k, raising=False)
    return monkeypatch


def test_tpu_resolver_reads_the_tpu_vm_environment(tpu_env: pytest.MonkeyPatch) -> None:
    with pytest.raises(E.ConfigurationError, match="no Cloud TPU VM environment"):
        jaxdist.TPUClusterResolver()
    tpu_env.setenv("TPU_WORKER_HOSTNAMES", "t1v-a-0,t1v-a-1")
    tpu_env.setenv("TPU_WORKER_ID", "1")
    tpu_env.setenv("TPU_ACCELERATOR_TYPE", "v4-16")
    r = jaxdist.TPUClusterResolver(tpu="")
    assert r.hosts == ["t1v-a-0", "t1v-a-1"] and r.task_id == 1 and r.task_type == "worker"
    assert r.num_processes == 2 and r.process_id == 1
    assert r.coordinator_address == "t1v-a-0:8482"
    assert r.cluster_spec().as_dict() == {"worker": ["t1v-a-0:8470", "t1v-a-1:8470"]}
    assert r.master() == "grpc://t1v-a-1:8470" and r.get_job_name() == "worker"
    assert r.num_accelerators() == {"TPU": 4}
    meta = r.get_tpu_system_metadata()
    assert (meta.num_cores, meta.num_hosts, meta.num_of_cores_per_host) == (8, 2, 4)
    assert type(jaxdist.cluster_resolver.detect()) is jaxdist.TPUClusterResolver
    tpu_env.setenv("TPU_ACCELERATOR_TYPE", "v3-16")
    assert jaxdist.TPUClusterResolver().num_accelerators() == {"TPU": 8}  # 2 cores per v3 chip
    tpu_env.setenv("MEGASCALE_NUM_SLICES", "2")
    tpu_env.setenv("MEGASCALE_SLICE_ID", "1")
    tpu_env.setenv("MEGASCALE_COORDINATOR_ADDRESS", "10.0.0.9:1234")
    r2 = jaxdist.TPUClusterResolver(coordinator_name="coordinator", coordinator_address="10.0.0.9:9000")
    assert r2.num_processes == 4 and r2.process_id == 3
    assert r2.cluster_spec().job_tasks("coordinator") == ["10.0.0.9:9000"]
    assert jaxdist.TPUClusterResolver().coordinator_address == "10.0.0.9:8482"


def test_tpu_resolver_refuses_tf_only_arguments(tpu_env: pytest.MonkeyPatch) -> None:
    for kwargs, match in (
        ({"tpu": "my-tpu"}, "Cloud TPU API"),
        ({"tpu": "grpc://10.0.0.2:8470"}, "TPU Nodes"),
        ({"tpu": "local", "zone": "us-central2-b"}, "zone"),
        ({"tpu": "local", "project": "p"}, "project"),
        ({"tpu": "local", "coordinator_name": "c"}, "coordinator_address"),
    ):
        with pytest.raises(E.ConfigurationError, match=match):
            jaxdist.TPUClusterResolver(**kwargs)
    local = jaxdist.TPUClusterResolver(tpu="local")
    assert local.num_processes == 1 and local.hosts == ["localhost"]
    jaxdist.experimental_connect_to_cluster(local)  # one host: nothing to connect
    with pytest.raises(E.ConfigurationError, match="client session"):
        jaxdist.experimental_connect_to_cluster(local, job_name="worker")
    with pytest.raises(E.ConfigurationError, match="MultiWorkerMirroredStrategy"):
        jaxdist.experimental_connect_to_cluster(jaxdist.SimpleClusterResolver({"worker": ["a:1"]}))
    tpu_env.delenv("JAXDIST_TPU_FAKE_DEVICES", raising=False)
    with pytest.raises(E.ConfigurationError, match="no TPU devices"):
        jaxdist.initialize_tpu_system(local)


def test_fake_tpu_topology_and_device_assignment_on_one_device(tpu_env: pytest.MonkeyPatch) -> None:
    tpu_env.setenv("JAXDIST_TPU_FAKE_DEVICES", "cpu")
    topo = jaxdist.initialize_tpu_system(jaxdist.TPUClusterResolver(tpu="local"))
    assert topo.num_tasks == 1 and topo.num_tpus_per_task == len(jax.devices())
    da = jaxdist.DeviceAssignment.build(topo, num_replicas=1)
    s = jaxdist.TPUStrategy(jaxdist.TPUClusterResolver(tpu="local"), experimental_device_assignment=da)
    assert s.num_replicas_in_sync == 1 and s.cluster_resolver.tpu == "local"
    with pytest.raises(E.ConfigurationError, match="cores per replica"):
        jaxdist.DeviceAssignment(topo, np.zeros((1, 2, 4), np.int32))
    with pytest.raises(E.ConfigurationError, match="not both"):
        jaxdist.TPUStrategy(experimental_device_assignment=da, device_assignment=da)


# -- checkpoints on OneDevice / default strategy ----------------------------------------------------------


def test_checkpoints_roundtrip_on_one_device_and_without_strategy(tmp_path: Path) -> None:
    params0, x, y = _data()
    s = jaxdist.OneDeviceStrategy(0)
    tx = optax.adam(0.1)
    with s.scope():
        params = jaxdist.create_variables(params0)
        opt = jaxdist.Optimizer(tx)
        opt.build(params)
        manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(s), str(tmp_path), max_to_keep=2)

    def step(bx: Any, by: Any) -> None:
        g = jax.grad(lambda p: jaxdist.compute_average_loss(_per_example(p, bx, by), 10))(jaxdist.read_variables(params))
        opt.apply(g, params)

    for k in range(3):
        s.run(step, args=(x[:10], y[:10]))
        manager.save(k + 1)
    assert [Path(p).name for p in manager.checkpoints] == ["ckpt-2", "ckpt-3"]
    saved = jaxdist.latest_checkpoint(str(tmp_path))
    data = jaxdist.checkpoint.load(saved, with_optimizer_state=True)
    assert data["step"] == 3 and len(data["optimizer_state"]["params/w"]) == 3  # adam: count, mu, nu
    s.run(step, args=(x[:10], y[:10]))  # move on, then go back
    manager.restore_or_initialize()
    np.testing.assert_array_equal(np.asarray(params["w"]), data["variables"]["params/w"])
    assert int(opt.iterations.value()) == 3
    with jaxdist.get_strategy().scope():  # no strategy: a fresh model, restored
        fresh = jaxdist.create_variables(jax.tree.map(np.zeros_like, params0))
    jaxdist.Checkpoint(None).restore(saved)
    np.testing.assert_array_equal(np.asarray(fresh["w"]), data["variables"]["params/w"])
    with pytest.raises(E.ConfigurationError, match="ledger"):
        jaxdist.Checkpoint(s, ledger=object()).write(str(tmp_path / "x"))


def test_checkpoint_calls_as_tf_numbered_save_write_restore_none_latest(tmp_path: Path) -> None:
    """TF's guide: ``checkpoint.save(prefix)`` every few epochs numbers its saves; ``restore(None)`` does nothing."""
    params0, x, y = _data()
    s = jaxdist.OneDeviceStrategy(0)
    with s.scope():
        params = jaxdist.create_variables(params0)
        opt = jaxdist.Optimizer(optax.adam(0.1))
        opt.build(params)
    checkpoint = jaxdist.Checkpoint(s)
    prefix = str(tmp_path / "ckpt")

    def step() -> None:
        g = jax.grad(lambda p: jaxdist.compute_average_loss(_per_example(p, x[:10], y[:10]), 10))(jaxdist.read_variables(params))
        opt.apply(g, params)

    values = []
    assert checkpoint.save_counter == 0
    for k in range(3):  # the second save under the same prefix used to raise FileExistsError
        s.run(step)
        values.append(np.asarray(params["w"]).copy())
        assert checkpoint.save(prefix) == f"{prefix}-{k + 1}"
        assert checkpoint.save_counter == k + 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert jaxdist.checkpoint.load(f"{prefix}-2")["save_counter"] == 2
    assert jaxdist.latest_checkpoint(str(tmp_path)) == f"{prefix}-3"

    # write: exactly at the path, no numbering, and never over an existing checkpoint.
    exact = checkpoint.write(str(tmp_path / "exact"))
    assert exact == str(tmp_path / "exact") and checkpoint.save_counter == 3
    with pytest.raises(FileExistsError):
        checkpoint.write(f"{prefix}-2")
    assert checkpoint.save_counter == 3

    # restore(None), TF's fresh start: nothing changes, None comes back.
    s.run(step)
    moved = np.asarray(params["w"]).copy()
    fresh = jaxdist.Checkpoint(s)
    assert fresh.restore(None) is None
    assert fresh.save_counter == 0 and fresh.step == 0
    np.testing.assert_array_equal(np.asarray(params["w"]), moved)

    # restore sets save_counter back: the next save goes on numbering after the restored one.
    fresh.restore(jaxdist.latest_checkpoint(str(tmp_path)))
    assert fresh.save_counter == 3
    np.testing.assert_array_equal(np.asarray(params["w"]), values[2])
    assert fresh.save(prefix) == f"{prefix}-4"
    # Restoring an earlier save and saving again would overwrite a later one: refused, the counter stays.
    fresh.restore(f"{prefix}-1")
    assert fresh.save_counter == 1
    np.testing.assert_array_equal(np.asarray(params["w"]), values[0])
    with pytest.raises(FileExistsError):
        fresh.save(prefix)
    assert fresh.save_counter == 1

    # latest_checkpoint: the manager's ckpt-<step> and numbered saves alike, the highest number wins.
    manager = jaxdist.CheckpointManager(jaxdist.Checkpoint(s), str(tmp_path))
    assert manager.save(7) == str(tmp_path / "ckpt-7")
    assert jaxdist.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-7")
    other = jaxdist.Checkpoint(s)
    other.save_counter = 11
    assert other.save(str(tmp_path / "model")) == str(tmp_path / "model-12")
    assert jaxdist.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model-12")
    assert manager.latest_checkpoint == str(tmp_path / "ckpt-7")  # the manager's own, as before


def test_latest_checkpoint_picks_the_highest_complete_numbered_save(tmp_path: Path) -> None:
    def made(name: str, manifest: bool = True, mtime: float | None = None) -> Path:
        d = tmp_path / name
        d.mkdir()
        if manifest:
            (d / "manifest.json").write_text("{}")
            if mtime is not None:
                os.utime(d / "manifest.json", (mtime, mtime))
        return d

    assert jaxdist.latest_checkpoint(str(tmp_path / "absent")) is None
    assert jaxdist.latest_checkpoint(str(tmp_path)) is None
    made("ckpt-2")
    made("model-9")
    assert jaxdist.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model-9")
    made("model-10")  # numerically, not by name ("model-9" > "model-10" as strings)
    assert jaxdist.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model-10")
    made("ckpt-11", manifest=False)  # incomplete: no manifest
    made("ckpt-12.tmp-12345678")  # a save in progress (its manifest is written before the rename)
    (tmp_path / "notes-13").write_text("a file")
    made("checkpoint")  # no number
    assert jaxdist.latest_checkpoint(str(tmp_path)) == str(tmp_path / "model-10")
    # The same number under two prefixes: the one written last.
    made("b-20", mtime=2_000_000_000)
    made("a-20", mtime=1_000_000_000)
    assert jaxdist.latest_checkpoint(str(tmp_path)) == str(tmp_path / "b-20")
