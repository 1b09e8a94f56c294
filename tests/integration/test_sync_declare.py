"""``jaxdist.replicated``: the functional style's forgotten all-reduce is loud, on 8 fake CPU devices.

As tests/integration/test_sync_contract.py: the device count is fixed when JAX
starts, so every check runs in ONE fresh subprocess with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` that prints one JSON
line ``{check: null | traceback}``; each test asserts on one check.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import pytest
from device_checks import DeviceChecks, assert_passed
from sync_util import global_batches, mlp_data, per_example_loss, reference_training

NUM_DEVICES = 8
GBS = 32

CHECKS = DeviceChecks(__file__, "SYNC_DECLARE_RESULTS=", timeout=420)
check = CHECKS.check


# ---------------------------------------------------------------------------------------
# Shared model: a 2-layer MLP on 100 rows, global batch 32 (3 full batches and a short one of 4)
# ---------------------------------------------------------------------------------------


def _grad_step(params: Any, batch: Any, lr: float = 0.1) -> Any:
    """One plain SGD step on one device (what each run_steps step computes from the same params)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    bx, by = batch
    g = jax.grad(lambda p: jnp.sum(per_example_loss(p, bx, by)) / GBS)(jax.tree.map(jnp.asarray, params))
    return jax.tree.map(lambda a, b: np.asarray(a - lr * b), params, g)


def _functional_step(tx: Any, all_reduce: bool, declare: bool = True) -> Callable[..., Any]:
    """The functional train step: state in, state out; ``all_reduce=False`` is the forgotten all-reduce."""
    import jax
    import optax

    import jaxdist

    def train_step(p: Any, o: Any, batch: Any) -> Any:
        bx, by = batch
        loss, g = jax.value_and_grad(lambda p: jaxdist.compute_average_loss(per_example_loss(p, bx, by), GBS))(p)
        if all_reduce:
            g = jaxdist.get_replica_context().all_reduce("sum", g)
        u, o = tx.update(g, o, p)
        new = (optax.apply_updates(p, u), o)
        return (jaxdist.replicated(new) if declare else new), loss

    return train_step


def _close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    import jax
    import numpy as np

    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol, err_msg=str(path))


def _expect(exc: type[BaseException], match: str, fn: Callable[[], Any]) -> BaseException:
    try:
        fn()
    except exc as e:
        assert match in str(e), f"{type(e).__name__} without {match!r}: {e}"
        return e
    raise AssertionError(f"expected {exc.__name__} ({match!r})")


def _assert_replicated(tree: Any) -> None:
    import jax

    import jaxdist

    for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=lambda x: isinstance(x, jaxdist.PerReplica)):
        assert isinstance(leaf, jax.Array) and not isinstance(leaf, jaxdist.PerReplica), (path, type(leaf))
        assert leaf.sharding.is_fully_replicated, (path, leaf.sharding)


def _mesh_strategies() -> list[Any]:
    """Every multi-replica strategy of one process: Mirrored, TPU (fake), CentralStorage, MultiWorkerMirrored."""
    import jaxdist
    from jaxdist.cluster_resolver import SimpleClusterResolver

    os.environ["JAXDIST_TPU_FAKE_DEVICES"] = "cpu"
    try:
        tpu = jaxdist.TPUStrategy()
    finally:
        del os.environ["JAXDIST_TPU_FAKE_DEVICES"]
    mwms = jaxdist.MultiWorkerMirroredStrategy(
        SimpleClusterResolver({"worker": ["127.0.0.1:1"]}, task_type="worker", task_id=0)
    )
    return [jaxdist.MirroredStrategy(), tpu, jaxdist.CentralStorageStrategy(), mwms]


def _close_strategies(strategies: list[Any]) -> None:
    for s in strategies:
        if hasattr(s, "shutdown"):
            s.shutdown()


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------


@check
def forgotten_all_reduce_with_declaration_raises_on_every_strategy() -> None:
    import jax
    import optax

    import jaxdist
    from jaxdist.errors import ConfigurationError

    params, x, y = mlp_data()
    tx = optax.sgd(0.1, momentum=0.9)
    step = _functional_step(tx, all_reduce=False)
    strategies = _mesh_strategies()
    try:
        for s in strategies:
            p, o = s.replicate(params), s.replicate(tx.init(params))
            batch = next(iter(s.experimental_distribute_dataset(global_batches(x, y, GBS))))
            e = _expect(ConfigurationError, "declared replicated may differ between replicas", lambda: s.run(step, args=(p, o, batch)))
            msg = str(e)
            # names the output path (params and the momentum trace) and how to fix it
            for path in ("output [0][0]['w1']", "output [0][0]['b2']", "output [0][1][0].trace['w1']"):
                assert path in msg, (s, path, msg)
            assert "test_sync_declare.py" in msg  # the declaration's call site
            for fix in ("all_reduce('sum', grads)", "jaxdist.Optimizer", "strategy.reduce"):
                assert fix in msg, (s, fix, msg)
            assert f"their {s.num_replicas_in_sync} copies" in msg

            # The same under jaxdist.function and jax.jit (TF's @tf.function around distributed_train_step).
            @jaxdist.function
            def compiled(p: Any, o: Any, batch: Any) -> Any:
                (p, o), loss = s.run(step, args=(p, o, batch))
                return p, o, s.reduce("sum", loss, axis=None)

            _expect(ConfigurationError, "output [0][0]['w1']", lambda: compiled(p, o, batch))
            _expect(ConfigurationError, "output [0][0]['w1']", lambda: jax.jit(compiled.__wrapped__)(p, o, batch))
    finally:
        _close_strategies(strategies)


@check
def declared_values_that_fn_does_not_return_are_checked_too() -> None:
    import jax
    import jax.numpy as jnp

    import jaxdist
    from jaxdist.errors import ConfigurationError

    params, x, y = mlp_data()
    s = jaxdist.MirroredStrategy()
    p = s.replicate(params)
    batch = next(iter(s.experimental_distribute_dataset(global_batches(x, y, GBS))))

    def grads_only(all_reduce: bool) -> Callable[..., Any]:
        def fn(p: Any, batch: Any) -> Any:
            bx, by = batch
            g = jax.grad(lambda p: jaxdist.compute_average_loss(per_example_loss(p, bx, by), GBS))(p)
            if all_reduce:
                g = jaxdist.get_replica_context().all_reduce("sum", g)
            g = jaxdist.replicated(g)  # an assertion in the middle of fn
            return jnp.sum(g["w1"]) * 0 + jnp.sum(bx)  # per-replica output, not declared

        return fn

    e = _expect(ConfigurationError, "leaf ['w1']", lambda: s.run(grads_only(False), args=(p, batch)))
    assert "\n  - jaxdist.replicated() at" in str(e)  # not returned: named by its call site and leaf
    out = s.run(grads_only(True), args=(p, batch))
    assert isinstance(out, jaxdist.PerReplica)  # undeclared outputs keep their kind

    # Declared inside an inner transformation: cannot leave it; refused with where to declare instead.
    def in_scan(p: Any) -> Any:
        def body(c: Any, _: Any) -> Any:
            return jaxdist.replicated(c * 2), None

        c, _ = jax.lax.scan(body, p["b1"], None, length=2)
        return c

    _expect(ConfigurationError, "declare the transformation's result in fn itself", lambda: s.run(in_scan, args=(p,)))

    # A replica-dependent value (replica_id) declared replicated: raises; all-reduced: replicated.
    def rid(reduce: bool) -> Callable[[], Any]:
        def fn() -> Any:
            r = jaxdist.get_replica_context().replica_id_in_sync_group.astype(jnp.float32)
            return jaxdist.replicated(jaxdist.get_replica_context().all_reduce("sum", r) if reduce else r)

        return fn

    _expect(ConfigurationError, "output (the value)", lambda: s.run(rid(False)))
    total = s.run(rid(True))
    _assert_replicated(total)
    assert float(total) == 28.0

    # Cross-replica context: an assertion on the values at hand.
    with s.scope():
        assert jaxdist.replicated(p) is p
        pr = s.run(lambda b: b[0], args=(batch,))
        _expect(ConfigurationError, "is a PerReplica value", lambda: jaxdist.replicated({"x": pr}))
        on_read = jaxdist.create_variable(jnp.zeros(()), synchronization="on_read", aggregation="sum", name="count")
    _expect(ConfigurationError, "sync-on-read variable", lambda: jaxdist.replicated(on_read))


@check
def all_reduced_step_returns_replicated_params_equal_to_one_device() -> None:
    import jax
    import optax

    import jaxdist

    params, x, y = mlp_data()
    batches = global_batches(x, y, GBS)  # 32, 32, 32 and a short 4
    tx = optax.sgd(0.1, momentum=0.9)
    ref = reference_training(params, batches, tx, GBS, epochs=2)
    step = _functional_step(tx, all_reduce=True)
    strategies = _mesh_strategies()
    try:
        for s in strategies:
            # CentralStorage keeps replicated values on its parameter device, the batch on all 8: jax.jit (and so
            # jaxdist.function) refuses arguments on different device sets, declaration or not (known limitation).
            modes = ("run",) if isinstance(s, jaxdist.CentralStorageStrategy) else ("run", "function", "jit")
            for mode in modes:
                p, o = s.replicate(params), s.replicate(tx.init(params))

                def compiled(p: Any, o: Any, batch: Any, s: Any = s) -> Any:
                    (p, o), loss = s.run(step, args=(p, o, batch))
                    return p, o, s.reduce("sum", loss, axis=None)

                call = {"run": compiled, "function": jaxdist.function(compiled), "jit": jax.jit(compiled)}[mode]
                for _ in range(2):
                    for batch in s.experimental_distribute_dataset(batches):
                        p, o, _loss = call(p, o, batch)
                        _assert_replicated((p, o))
                _close(p, ref)
    finally:
        _close_strategies(strategies)

    # One replica (OneDevice, the default strategy): the declaration is a no-op that returns the value, and the
    # step without an all-reduce is right there (one replica's gradient is the whole gradient).
    for s in (jaxdist.OneDeviceStrategy("cpu:3"), jaxdist.get_strategy()):
        for all_reduce in (False, True):
            step1 = _functional_step(tx, all_reduce=all_reduce)
            p, o = s.replicate(params), s.replicate(tx.init(params))
            for _ in range(2):
                for batch in s.experimental_distribute_dataset(batches):
                    (p, o), _loss = s.run(step1, args=(p, o, batch))
                    for leaf in jax.tree.leaves((p, o), is_leaf=lambda v: isinstance(v, jaxdist.PerReplica)):
                        assert isinstance(leaf, jax.Array), (s, type(leaf))
            _close(p, ref)


@check
def declaration_under_run_steps_and_run_epoch() -> None:
    import jax

    import jaxdist
    from jaxdist.errors import ConfigurationError

    params, x, y = mlp_data()
    batches = global_batches(x, y, GBS)
    expected = [_grad_step(params, b) for b in batches]

    def sgd_from(all_reduce: bool) -> Callable[..., Any]:
        def step(batch: Any, p: Any) -> Any:
            bx, by = batch
            g = jax.grad(lambda p: jaxdist.compute_average_loss(per_example_loss(p, bx, by), GBS))(p)
            if all_reduce:
                g = jaxdist.get_replica_context().all_reduce("sum", g)
            return jaxdist.replicated(jax.tree.map(lambda a, b: a - 0.1 * b, p, g))

        return step

    strategies = _mesh_strategies()
    try:
        for s in strategies:
            p = s.replicate(params)
            dist = s.experimental_distribute_dataset(batches)
            _expect(ConfigurationError, "output ['w1']", lambda: s.run_steps(sgd_from(False), iter(dist), steps=3, args=(p,)))
            _expect(ConfigurationError, "output ['w1']", lambda: s.run_epoch(sgd_from(False), dist, args=(p,)))
            good = sgd_from(True)
            it = iter(dist)
            first, tail = s.run_steps(good, it, steps=3, args=(p,)), s.run_steps(good, it, steps=3, args=(p,))
            _assert_replicated((first, tail))
            for k in range(3):
                _close(jax.tree.map(lambda a, k=k: a[k], first), expected[k])
            _close(jax.tree.map(lambda a: a[0], tail), expected[3])
            epoch = s.run_epoch(good, dist, args=(p,))
            _assert_replicated(epoch)
            for k in range(4):
                _close(jax.tree.map(lambda a, k=k: a[k], epoch), expected[k])
    finally:
        _close_strategies(strategies)

    for s in (jaxdist.OneDeviceStrategy(2), jaxdist.get_strategy()):  # one replica: a no-op, either way
        for all_reduce in (False, True):
            out = s.run_steps(sgd_from(all_reduce), iter(s.experimental_distribute_dataset(batches[:3])), steps=3, args=(params,))
            for k in range(3):
                _close(jax.tree.map(lambda a, k=k: a[k], out), expected[k])


@check
def the_original_trap_is_loud() -> None:
    """The trap the declaration exists for: a functional loop that forgets the all-reduce and feeds the params back in."""
    import numpy as np
    import optax

    import jaxdist
    from jaxdist.errors import ConfigurationError

    params, x, y = mlp_data()
    batches = global_batches(x, y, GBS)
    tx = optax.sgd(0.1)
    records = _Records()
    logging.getLogger("jaxdist.sync.loops").addHandler(records)
    try:
        s = jaxdist.MirroredStrategy()
        forgetful = _functional_step(tx, all_reduce=False, declare=False)
        p, o = s.replicate(params), s.replicate(tx.init(params))
        for batch in s.experimental_distribute_dataset(batches):
            (p, o), _loss = s.run(forgetful, args=(p, o, batch))
        # What used to happen silently: every replica trained its own copy.
        assert isinstance(p["w1"], jaxdist.PerReplica)
        copies = s.experimental_local_results(p["w1"])
        assert not np.allclose(np.asarray(copies[0]), np.asarray(copies[1]))
        # Now: feeding the per-replica params back where replicated ones went is a warning naming the argument...
        fed_back = [m for m in records.messages if "per-replica value where an earlier call passed a replicated one" in m]
        assert len(fed_back) == 1, records.messages  # once: when run compiles for the per-replica params
        for name in ("strategy.run(train_step)", "args[0]['w1']", "output [0][0]['w1'] of strategy.run(train_step)",
                     "jaxdist.replicated"):
            assert name in fed_back[0], (name, fed_back[0])
        # ...and with the declaration the very first step raises, before anything runs.
        p0 = s.replicate(params)
        _expect(
            ConfigurationError,
            "output [0][0]['w1']",
            lambda: s.run(_functional_step(tx, all_reduce=False), args=(p0, s.replicate(tx.init(params)), batch)),
        )

        # Per-replica state that is meant (per-replica values in, per-replica values out) is not warned about.
        records.messages.clear()
        keys = s.experimental_distribute_values_from_function(lambda ctx: np.full((2,), ctx.replica_id_in_sync_group, np.uint32))
        for _ in range(3):
            keys = s.run(lambda k: k + 1, args=(keys,))
        assert records.messages == [], records.messages
    finally:
        logging.getLogger("jaxdist.sync.loops").removeHandler(records)


# ---------------------------------------------------------------------------------------
# Runner
# ---------------------------------------------------------------------------------------


check_results = CHECKS.results_fixture()


@pytest.mark.slow
@pytest.mark.timeout(480)
@pytest.mark.parametrize("name", CHECKS.names())
def test_sync_declare_on_8_fake_devices(name: str, check_results: dict[str, str | None]) -> None:
    assert_passed(check_results, name)


if __name__ == "__main__":
    CHECKS.main()
