"""TF's custom-training-loop guide with its Keras parts, under strategy.run, on 8 fake CPU devices.

The guide ("Custom training with tf.distribute.Strategy") builds a Keras model, Keras Adam, a Keras
loss with ``reduction=None`` scaled by ``compute_average_loss`` and three Keras metrics in
``strategy.scope()``, then runs ``train_step`` (gradients, ``optimizer.apply_gradients``,
``train_accuracy.update_state``) and ``test_step`` (``model(images)``, metric updates) under
``strategy.run`` inside ``@tf.function`` (here ``@jaxdist.function``). On JAX the gradient comes from
``jax.value_and_grad`` over ``model.stateless_call``. Keras's own JAX custom-loop recipe (state passed
in and out, ``stateless_apply``, ``stateless_update_state``) is checked under ``strategy.run`` too.

The reference is the same model, data, optimizer, loss and metrics trained by Keras's own JAX
custom-loop recipe under ``jax.jit`` on one device, with no jaxdist strategy at all: weights, the
per-step losses and the three metrics' results per epoch must match within 1e-5. Every check runs in
one fresh subprocess with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (see device_checks).
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable
from typing import Any

import pytest
from device_checks import DeviceChecks, assert_passed
from keras_util import guide_images, import_jaxdist_keras

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

NUM_DEVICES = 8
GLOBAL_BATCH = 32
EPOCHS = 2
TOL = 1e-5


CHECKS = DeviceChecks(__file__, "KERAS_LOOP_RESULTS=", devices=NUM_DEVICES, timeout=840, setup=import_jaxdist_keras)
check = CHECKS.check


# ---------------------------------------------------------------------------------------
# The guide's parts (inside the 8-device subprocess)
# ---------------------------------------------------------------------------------------


_data = functools.partial(guide_images, GLOBAL_BATCH)


def _parts(strategy: Any) -> dict[str, Any]:
    """The guide's model, loss, optimizer and metrics, made in ``strategy.scope()`` (None: no scope)."""
    import contextlib

    import keras

    keras.utils.set_random_seed(7)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.Sequential([
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(8, 3, activation="relu"),
            keras.layers.MaxPooling2D(),
            keras.layers.Flatten(),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(10),
        ])
        return {
            "model": model,
            "loss_object": keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
            "optimizer": keras.optimizers.Adam(0.01),
            "test_loss": keras.metrics.Mean(name="test_loss"),
            "train_accuracy": keras.metrics.SparseCategoricalAccuracy(name="train_accuracy"),
            "test_accuracy": keras.metrics.SparseCategoricalAccuracy(name="test_accuracy"),
        }


def _result(parts: dict[str, Any], losses: list[list[float]], epochs: list[dict[str, float]]) -> dict[str, Any]:
    import numpy as np

    return {
        "weights": [np.asarray(w) for w in parts["model"].get_weights()],
        "losses": losses,
        "metrics": epochs,
        "iterations": int(np.asarray(parts["optimizer"].iterations.value)),
    }


def _guide(strategy: Any, compiled: bool = True, build_optimizer: bool = False) -> dict[str, Any]:
    """TF's guide, stateful, as written (JAX's value_and_grad over stateless_call for the gradient); the optimizer
    is built by its first apply_gradients, inside strategy.run, unless ``build_optimizer`` (in the scope: what a
    multi-process strategy needs)."""
    import jax

    import jaxdist

    p = _parts(strategy)
    model, loss_object, optimizer = p["model"], p["loss_object"], p["optimizer"]
    if build_optimizer:
        with strategy.scope():
            optimizer.build(model.trainable_variables)
    test_loss, train_accuracy, test_accuracy = p["test_loss"], p["train_accuracy"], p["test_accuracy"]

    def compute_loss(labels: Any, predictions: Any) -> Any:
        per_example_loss = loss_object(labels, predictions)
        return jaxdist.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)

    def train_step(inputs: Any) -> Any:
        images, labels = inputs

        def loss_fn(trainable: Any) -> Any:
            non_trainable = [v.value for v in model.non_trainable_variables]
            predictions, _ = model.stateless_call(trainable, non_trainable, images, training=True)
            return compute_loss(labels, predictions), predictions

        trainable = [v.value for v in model.trainable_variables]
        (loss, predictions), gradients = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs: Any) -> None:
        images, labels = inputs
        predictions = model(images, training=False)
        t_loss = loss_object(labels, predictions)
        test_loss.update_state(t_loss)
        test_accuracy.update_state(labels, predictions)

    def distributed_train_step(dataset_inputs: Any) -> Any:
        per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
        return strategy.reduce(jaxdist.ReduceOp.SUM, per_replica_losses, axis=None)

    def distributed_test_step(dataset_inputs: Any) -> None:
        strategy.run(test_step, args=(dataset_inputs,))

    if compiled:
        distributed_train_step = jaxdist.function(distributed_train_step)
        distributed_test_step = jaxdist.function(distributed_test_step)
    train, test = _data()
    train_dist = strategy.experimental_distribute_dataset(train)
    test_dist = strategy.experimental_distribute_dataset(test)
    losses, epochs = [], []
    for _ in range(EPOCHS):
        losses.append([float(distributed_train_step(x)) for x in train_dist])
        for x in test_dist:
            distributed_test_step(x)
        epochs.append({m.name: float(m.result()) for m in (train_accuracy, test_loss, test_accuracy)})
        for m in (test_loss, train_accuracy, test_accuracy):
            m.reset_state()
    return _result(p, losses, epochs)


def _keras_recipe(strategy: Any) -> dict[str, Any]:
    """Keras 3's JAX custom-loop recipe: the state goes in and out of the step; ``None``: under ``jax.jit``, no
    strategy (the reference); else under ``strategy.run`` (the state replicated, the batch distributed)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxdist

    p = _parts(strategy)
    model, loss_object, optimizer = p["model"], p["loss_object"], p["optimizer"]
    metrics = {"train": p["train_accuracy"], "test_loss": p["test_loss"], "test": p["test_accuracy"]}
    optimizer.build(model.trainable_variables)

    def compute_loss(labels: Any, predictions: Any) -> Any:
        per_example_loss = loss_object(labels, predictions)
        if strategy is None:
            return jnp.sum(per_example_loss) / GLOBAL_BATCH
        return jaxdist.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH)

    def loss_fn(trainable: Any, non_trainable: Any, x: Any, y: Any) -> Any:
        y_pred, non_trainable = model.stateless_call(trainable, non_trainable, x, training=True)
        return compute_loss(y, y_pred), (y_pred, non_trainable)

    def train_step(state: Any, data: Any) -> Any:
        trainable, non_trainable, optimizer_vars, metric_vars = state
        x, y = data
        (loss, (y_pred, non_trainable)), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, non_trainable, x, y)
        trainable, optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)
        metric_vars = dict(metric_vars, train=metrics["train"].stateless_update_state(metric_vars["train"], y, y_pred))
        return loss, (trainable, non_trainable, optimizer_vars, metric_vars)

    def test_step(state: Any, data: Any) -> Any:
        trainable, non_trainable, metric_vars = state
        x, y = data
        y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=False)
        return dict(
            metric_vars,
            test_loss=metrics["test_loss"].stateless_update_state(metric_vars["test_loss"], loss_object(y, y_pred)),
            test=metrics["test"].stateless_update_state(metric_vars["test"], y, y_pred),
        )

    def fresh_metric_vars() -> dict[str, Any]:
        return {k: [v.value for v in m.variables] for k, m in metrics.items()}

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in optimizer.variables],
    )
    train, test = _data()
    if strategy is None:
        train_fn, test_fn = jax.jit(train_step), jax.jit(test_step)
        train_in, test_in = train, test
    else:
        def train_fn(state: Any, batch: Any) -> Any:
            loss, state = strategy.run(train_step, args=(state, batch))
            return strategy.reduce("sum", loss, axis=None), state

        def test_fn(state: Any, batch: Any) -> Any:
            return strategy.run(test_step, args=(state, batch))

        train_in = strategy.experimental_distribute_dataset(train)
        test_in = strategy.experimental_distribute_dataset(test)
    losses, epochs = [], []
    for _ in range(EPOCHS):
        metric_vars = fresh_metric_vars()
        epoch_losses = []
        for batch in train_in:
            loss, (trainable, non_trainable, optimizer_vars, metric_vars) = train_fn((*state, metric_vars), batch)
            state = (trainable, non_trainable, optimizer_vars)
            epoch_losses.append(float(loss))
        for batch in test_in:
            metric_vars = test_fn((state[0], state[1], metric_vars), batch)
        losses.append(epoch_losses)
        epochs.append({m.name: float(m.stateless_result(metric_vars[k])) for k, m in metrics.items()})
    for variables, values in zip((model.trainable_variables, model.non_trainable_variables, optimizer.variables), state):
        for v, value in zip(variables, values):
            v.assign(np.asarray(value))
    return _result(p, losses, epochs)


_REF: dict[str, Any] = {}


def _reference() -> dict[str, Any]:
    """Keras's own JAX recipe under jax.jit on one device, no jaxdist strategy (computed once)."""
    if "ref" not in _REF:
        _REF["ref"] = _keras_recipe(None)
    return _REF["ref"]


def _assert_same(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    import numpy as np

    assert len(got["weights"]) == len(ref["weights"]), what
    for i, (a, b) in enumerate(zip(got["weights"], ref["weights"])):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{what}: weight {i}")
    np.testing.assert_allclose(got["losses"], ref["losses"], atol=TOL, rtol=TOL, err_msg=f"{what}: losses")
    assert [sorted(e) for e in got["metrics"]] == [sorted(e) for e in ref["metrics"]], (what, got["metrics"])
    for e, (g, r) in enumerate(zip(got["metrics"], ref["metrics"])):
        for name in r:
            np.testing.assert_allclose(g[name], r[name], atol=TOL, rtol=TOL, err_msg=f"{what}: epoch {e} {name}")
    assert got["iterations"] == ref["iterations"] == EPOCHS * 3, (what, got["iterations"], ref["iterations"])


def _strategies() -> dict[str, Callable[[], Any]]:
    import jax

    import jaxdist

    return {
        "one_device": lambda: jaxdist.OneDeviceStrategy(jax.devices()[3]),
        "mirrored": jaxdist.MirroredStrategy,
    }


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------


@check
def guide_one_device_matches_one_device_keras() -> None:
    _assert_same(_guide(_strategies()["one_device"]()), _reference(), "OneDeviceStrategy, jaxdist.function")


@check
def guide_mirrored_matches_one_device_keras() -> None:
    strategy = _strategies()["mirrored"]()
    assert strategy.num_replicas_in_sync == NUM_DEVICES
    _assert_same(_guide(strategy), _reference(), "MirroredStrategy, jaxdist.function")


@check
def guide_mirrored_uncompiled_matches_one_device_keras() -> None:
    """The same steps with strategy.run called directly (each run compiled on its own)."""
    _assert_same(_guide(_strategies()["mirrored"](), compiled=False), _reference(), "MirroredStrategy, run")


@check
def guide_default_strategy_matches_one_device_keras() -> None:
    """No scope at all: the default strategy's run, inside jaxdist.function (Keras variables threaded too)."""
    import jaxdist

    _assert_same(_guide(jaxdist.get_strategy()), _reference(), "default strategy, jaxdist.function")


@check
def keras_recipe_under_run_matches_one_device_keras() -> None:
    for name, make in _strategies().items():
        _assert_same(_keras_recipe(make()), _reference(), f"Keras's JAX recipe, {name}")


@check
def errors_are_jaxdist_errors_that_say_what_to_write() -> None:
    """What is still unsupported raises ConfigurationError naming the fix, never JAX's mesh error."""
    import jax.numpy as jnp
    import keras
    import numpy as np

    import jaxdist
    from jaxdist.errors import ConfigurationError

    strategy = jaxdist.MirroredStrategy()
    x, y = np.ones((16, 4), np.float32), np.zeros((16,), np.int32)
    batch = next(iter(strategy.experimental_distribute_dataset([(x, y)])))

    def raises(fn: Callable[[Any], Any], *needles: str) -> None:
        try:
            strategy.run(fn, args=(batch,))
        except ConfigurationError as e:
            text = str(e)
            assert "Mesh for all inputs" not in text, text
            for needle in needles:
                assert needle in text, (needle, text)
            return
        raise AssertionError(f"{fn.__name__}: no ConfigurationError")

    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        averaging = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        lazy = keras.Sequential([keras.layers.Dense(3)])  # no input shape: built by its first call
    outside = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])

    def averaging_loss(b: Any) -> Any:
        return averaging(b[1], model(b[0]))

    def model_made_outside(b: Any) -> Any:
        return outside(b[0])

    def model_built_inside(b: Any) -> Any:
        return lazy(b[0])

    def per_replica_weight(b: Any) -> Any:
        model.layers[0].bias.assign(jnp.zeros((3,)) + jnp.sum(b[0]) * jaxdist.get_replica_context().replica_id_in_sync_group)
        return 0.0

    raises(averaging_loss, "reduction='sum_over_batch_size'", "reduction=None", "jaxdist.compute_average_loss")
    raises(model_made_outside, "created outside every strategy.scope()", "MirroredStrategy.run")
    raises(model_built_inside, "has no value yet", "build the model")
    raises(per_replica_weight, "differs between replicas", "Keras optimizer")
    # The same loss with reduction='sum' or None is accepted (it sums right).
    summing = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    strategy.run(lambda b: summing(b[1], model(b[0])), args=(batch,))


@check
def variables_follow_their_keras_aggregation() -> None:
    """A Keras variable assigned in replica context: 'mean' averages, 'sum' adds the replicas' changes,
    'only_first_replica' keeps replica 0's (TF's rules for a variable assigned inside strategy.run)."""
    import jax.numpy as jnp
    import keras
    import numpy as np

    import jaxdist

    strategy = jaxdist.MirroredStrategy()

    class Stats(keras.layers.Layer):
        def build(self, shape: Any) -> None:
            self.mean = self.add_weight(shape=(), initializer="zeros", trainable=False, aggregation="mean")
            self.total = self.add_weight(shape=(), initializer="ones", trainable=False, aggregation="sum")
            self.first = self.add_weight(shape=(), initializer="zeros", trainable=False, aggregation="only_first_replica")

        def call(self, x: Any) -> Any:
            self.mean.assign(jnp.mean(x))
            self.total.assign_add(jnp.sum(x))
            self.first.assign(x[0, 0])
            return x

    with strategy.scope():
        layer = Stats()
        layer.build((None, 4))
    x = np.arange(16 * 4, dtype=np.float32).reshape(16, 4)
    batch = next(iter(strategy.experimental_distribute_dataset([x])))
    strategy.run(layer, args=(batch,))
    np.testing.assert_allclose(float(layer.mean.numpy()), x.mean(), rtol=1e-6)
    np.testing.assert_allclose(float(layer.total.numpy()), 1.0 + x.sum(), rtol=1e-6)
    assert float(layer.first.numpy()) == x[0, 0]


@check
def parameter_server_model_in_a_custom_loop_is_refused() -> None:
    """A Keras model built in ParameterServerStrategy.scope() keeps its state on the PS: compiled code on the
    coordinator that reads it raises ConfigurationError naming fit and jaxdist.pull, not JAX's mesh error."""
    import keras
    import numpy as np

    import jaxdist
    from jaxdist.errors import ConfigurationError
    from jaxdist.testing import InProcessCluster

    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        try:
            jaxdist.function(lambda x: model(x))(np.ones((4, 4), np.float32))
        except ConfigurationError as e:
            assert "ParameterServerStrategy.scope()" in str(e) and "jaxdist.pull" in str(e), str(e)
        else:
            raise AssertionError("no ConfigurationError")


check_results = CHECKS.results_fixture()


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", CHECKS.names())
def test_on_8_fake_devices(name: str, check_results: dict[str, str | None]) -> None:
    assert_passed(check_results, name)


if __name__ == "__main__":
    CHECKS.main()
