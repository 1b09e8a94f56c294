"""TF's custom-training-loop guide with its Keras parts, inside ClusterCoordinator closures under
ParameterServerStrategy (in-process cluster: real gRPC PS and worker services in one process).

The guide's Keras model, Adam, ``SparseCategoricalCrossentropy(reduction=None)`` scaled by
``jaxdist.compute_average_loss``, and three Keras metrics (train loss ``Mean``, train accuracy, test
accuracy) are made in ``ParameterServerStrategy.scope()``; each training step is a closure whose
``strategy.run(train_step)`` takes the gradient with ``jax.value_and_grad`` over ``model.stateless_call``
and calls ``optimizer.apply_gradients`` and ``train_accuracy.update_state`` (the state lives on the PS: the
closure pulls the weights, pushes the gradients, the PS applies Keras's Adam); the closure's body updates
the train loss ``Mean`` eagerly; each test step is a closure whose ``strategy.run`` calls ``model(x)`` and
the test metric. With 1 worker and the steps scheduled one after another, the weights, step count and the
three metrics' results per epoch must equal Keras's own JAX recipe under ``jax.jit`` on one device, no
jaxdist, within 1e-5. Keras picks its backend at import, so the checks run in one fresh subprocess
(see device_checks).

Keras's stateless recipe in closures (``optimizer.stateless_apply(optimizer_variables, grads, trainable)``,
the PS applies the optimizer once and the call returns the PS's values after that push) is checked against
``apply_gradients`` in the same closures and against single-device Keras, for SGD and Adam; and
``metric.stateless_update_state`` (a pure function: the PS accumulators are not touched).
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

GLOBAL_BATCH = 32
EPOCHS = 2
TOL = 1e-5


CHECKS = DeviceChecks(__file__, "KERAS_PS_LOOP_RESULTS=", devices=1, timeout=600, setup=import_jaxdist_keras)
check = CHECKS.check


_data = functools.partial(guide_images, GLOBAL_BATCH)


def _parts(strategy: Any, weights: list[Any] | None = None) -> dict[str, Any]:
    """The guide's model, loss, optimizer and metrics, made in ``strategy.scope()`` (None: no scope); the model's
    initial ``weights`` set when given, so the comparison does not rest on Keras's seeding alone (Keras seeds
    each initializer from Python's global ``random``; a coordinator's heartbeat thread drew from it too, which
    made seeded initial weights depend on timing: tests/unit/test_failure_handler.py guards that)."""
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
        if weights is not None:
            model.set_weights(weights)
        return {
            "model": model,
            "loss_object": keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
            "optimizer": keras.optimizers.Adam(0.01),
            "train_loss": keras.metrics.Mean(name="train_loss"),
            "train_accuracy": keras.metrics.SparseCategoricalAccuracy(name="train_accuracy"),
            "test_accuracy": keras.metrics.SparseCategoricalAccuracy(name="test_accuracy"),
        }


METRICS = ("train_loss", "train_accuracy", "test_accuracy")


def _reference() -> dict[str, Any]:
    """Keras's own JAX custom-loop recipe under jax.jit on one device, no jaxdist strategy."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    p = _parts(None)
    model, loss_object, optimizer = p["model"], p["loss_object"], p["optimizer"]
    initial = [np.asarray(w) for w in model.get_weights()]
    optimizer.build(model.trainable_variables)

    def loss_fn(trainable: Any, non_trainable: Any, x: Any, y: Any) -> Any:
        y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=True)
        return jnp.sum(loss_object(y, y_pred)) / GLOBAL_BATCH, y_pred

    @jax.jit
    def train_step(state: Any, data: Any) -> Any:
        trainable, non_trainable, optimizer_vars, mv = state
        x, y = data
        (loss, y_pred), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, non_trainable, x, y)
        trainable, optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)
        mv = dict(mv, train_loss=p["train_loss"].stateless_update_state(mv["train_loss"], loss),
                  train_accuracy=p["train_accuracy"].stateless_update_state(mv["train_accuracy"], y, y_pred))
        return trainable, non_trainable, optimizer_vars, mv

    @jax.jit
    def test_step(trainable: Any, non_trainable: Any, mv: Any, data: Any) -> Any:
        x, y = data
        y_pred, _ = model.stateless_call(trainable, non_trainable, x, training=False)
        return dict(mv, test_accuracy=p["test_accuracy"].stateless_update_state(mv["test_accuracy"], y, y_pred))

    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    optimizer_vars = [v.value for v in optimizer.variables]
    train, test = _data()
    epochs = []
    for _ in range(EPOCHS):
        mv = {k: [v.value for v in p[k].variables] for k in METRICS}
        for batch in train:
            trainable, non_trainable, optimizer_vars, mv = train_step((trainable, non_trainable, optimizer_vars, mv), batch)
        for batch in test:
            mv = test_step(trainable, non_trainable, mv, batch)
        epochs.append({k: float(p[k].stateless_result(mv[k])) for k in METRICS})
    return {"weights": [np.asarray(w) for w in trainable], "metrics": epochs, "iterations": EPOCHS * len(train),
            "initial": initial}


def _guide_in_closures(strategy: Any, coordinator: Any, initial: list[Any]) -> dict[str, Any]:
    """The guide's loop: each step a closure, scheduled one after another on the cluster's worker."""
    import jax
    import numpy as np

    import jaxdist
    import jaxdist.keras

    p = _parts(strategy, initial)
    model, loss_object, optimizer = p["model"], p["loss_object"], p["optimizer"]
    train_loss, train_accuracy, test_accuracy = p["train_loss"], p["train_accuracy"], p["test_accuracy"]

    def train_step(inputs: Any) -> Any:
        images, labels = inputs

        def loss_fn(trainable: Any) -> Any:
            non_trainable = [v.value for v in model.non_trainable_variables]
            predictions, _ = model.stateless_call(trainable, non_trainable, images, training=True)
            per_example_loss = loss_object(labels, predictions)
            return jaxdist.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH), predictions

        (loss, predictions), gradients = jax.value_and_grad(loss_fn, has_aux=True)(
            [v.value for v in model.trainable_variables])
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        train_accuracy.update_state(labels, predictions)
        return loss

    def test_step(inputs: Any) -> None:
        images, labels = inputs
        predictions = model(images, training=False)
        test_accuracy.update_state(labels, predictions)

    def distributed_train_step(batch: Any) -> Any:
        per_replica_losses = strategy.run(train_step, args=(batch,))
        loss = strategy.reduce(jaxdist.ReduceOp.SUM, per_replica_losses, axis=None)
        train_loss.update_state(loss)  # eagerly, in the closure's body
        return loss

    def distributed_test_step(batch: Any) -> None:
        strategy.run(test_step, args=(batch,))

    train, test = _data()
    epochs = []
    for _ in range(EPOCHS):
        for batch in train:
            coordinator.schedule(distributed_train_step, args=(batch,)).fetch()
        for batch in test:
            coordinator.schedule(distributed_test_step, args=(batch,)).fetch()
        coordinator.join()
        epochs.append({k: float(p[k].result()) for k in METRICS})
        for k in METRICS:
            p[k].reset_state()
    assert jaxdist.keras.sync_from_ps(model)
    return {"weights": [np.asarray(w) for w in model.get_weights()], "metrics": epochs,
            "iterations": int(np.asarray(optimizer.iterations.value)), "model": model}


def _assert_same(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    import numpy as np

    assert len(got["weights"]) == len(ref["weights"]), what
    for i, (a, b) in enumerate(zip(got["weights"], ref["weights"])):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{what}: weight {i}")
    for e, (g, r) in enumerate(zip(got["metrics"], ref["metrics"])):
        assert sorted(g) == sorted(r), (what, g, r)
        for name in r:
            np.testing.assert_allclose(g[name], r[name], atol=TOL, rtol=TOL, err_msg=f"{what}: epoch {e} {name}")
    assert got["iterations"] == ref["iterations"], (what, got["iterations"], ref["iterations"])


def _cluster(num_ps: int = 2) -> Any:
    from jaxdist.testing import InProcessCluster

    return InProcessCluster(num_workers=1, num_ps=num_ps)


@check
def guide_in_ps_closures_matches_one_device_keras() -> None:
    import jaxdist

    ref = _reference()
    with _cluster() as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coordinator = jaxdist.ClusterCoordinator(strategy)
        got = _guide_in_closures(strategy, coordinator, ref["initial"])
        # The weights live on the PS (two tasks: the model's variables are spread over both).
        assert len({v.ps_index for v in jaxdist.keras.ps_variables(got["model"])}) == 2
    _assert_same(got, ref, "guide in ParameterServerStrategy closures")


class EndlessBatches:
    """A per-worker dataset function (module-level: it pickles to the workers): the training batches, repeated."""

    def __call__(self, input_context: Any) -> Any:
        train, _ = _data()
        while True:
            yield from train


@check
def tf_ps_tutorial_pattern_on_two_workers_counts_every_step_once() -> None:
    """TF's PS tutorial's shape: a per-worker dataset, ``next(iterator)`` in the scheduled function, closures
    spread over 2 workers at once. Every step is applied once (the PS step counter), and the metric counts
    every example once (its accumulated count)."""
    import jax
    import numpy as np

    import jaxdist
    import jaxdist.keras
    from jaxdist.testing import InProcessCluster

    closures = 12
    with InProcessCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coordinator = jaxdist.ClusterCoordinator(strategy)
        p = _parts(strategy)
        model, loss_object, optimizer, accuracy = p["model"], p["loss_object"], p["optimizer"], p["train_accuracy"]

        def replica_fn(batch: Any) -> Any:
            images, labels = batch

            def loss_fn(trainable: Any) -> Any:
                predictions, _ = model.stateless_call(trainable, [], images, training=True)
                loss = jaxdist.compute_average_loss(loss_object(labels, predictions), global_batch_size=GLOBAL_BATCH)
                return loss, predictions

            (loss, predictions), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                [v.value for v in model.trainable_variables])
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            accuracy.update_state(labels, predictions)
            return loss

        def step_fn(iterator: Any) -> Any:
            return strategy.reduce("SUM", strategy.run(replica_fn, args=(next(iterator),)), axis=None)

        iterator = iter(coordinator.create_per_worker_dataset(EndlessBatches()))
        losses = [coordinator.schedule(step_fn, args=(iterator,)) for _ in range(closures)]
        coordinator.join()
        assert all(np.isfinite(float(rv.fetch())) for rv in losses)
        assert 0.0 <= float(accuracy.result()) <= 1.0
        total, count = (float(np.asarray(v.value)) for v in accuracy.variables)
        assert count == closures * GLOBAL_BATCH, (total, count)
        assert jaxdist.keras.sync_from_ps(model)
        assert int(np.asarray(optimizer.iterations.value)) == closures
        # The user's own pickling (pickle, copy.deepcopy) is Keras's: a standalone copy, not bound to the PS.
        import pickle

        from jaxdist.keras.ps_custom_loop import binding

        copied = pickle.loads(pickle.dumps(accuracy))
        assert type(copied) is type(accuracy) and all(binding(v) is None for v in copied.variables)
        accuracy.reset_state()
        assert float(accuracy.result()) == 0.0
        assert float(np.asarray(accuracy.variables[1].value)) == 0.0


@check
def unsupported_uses_raise_jaxdist_errors_that_say_what_to_write() -> None:
    """stateless_apply of a PS-trained optimizer, a weight assigned in the step, two optimizers in the scope:
    ConfigurationError naming the fix (never JAX's mesh error)."""
    import jax
    import keras
    import numpy as np

    import jaxdist
    from jaxdist.errors import ConfigurationError

    x, y = np.ones((4, 3), np.float32), np.zeros((4,), np.int32)

    def raises(coordinator: Any, fn: Callable[..., Any], *needles: str) -> None:
        try:
            coordinator.schedule(fn, args=((x, y),))
            coordinator.join()
        except Exception as e:  # the closure's error, as join raises it (once: the next schedule starts clean)
            text = str(e)
            assert isinstance(e, ConfigurationError) or "ConfigurationError" in text, (type(e), text)
            assert "Mesh for all inputs" not in text, text
            for needle in needles:
                assert needle in text, (needle, text)
            return
        raise AssertionError(f"{fn.__name__}: no ConfigurationError")

    with _cluster(num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coordinator = jaxdist.ClusterCoordinator(strategy)
        with strategy.scope():
            model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            optimizer = keras.optimizers.SGD(0.1)

        def stateless_with(optimizer_variables: Any, cut: int = 0) -> Callable[..., Any]:
            def stateless(batch: Any) -> Any:
                def replica_fn(b: Any) -> Any:
                    trainable = [v.value for v in model.trainable_variables]
                    grads = jax.grad(lambda t: model.stateless_call(t, [], b[0])[0].sum())(trainable)
                    if cut:
                        trainable, grads = trainable[:-cut], grads[:-cut]
                    optimizer.stateless_apply(optimizer_variables, grads, trainable)
                    return 0.0

                return strategy.run(replica_fn, args=(batch,))

            return stateless

        def reads_optimizer_state(batch: Any) -> Any:
            return strategy.run(lambda b: [v.value for v in optimizer.variables][0], args=(batch,))

        def assigns_weight(batch: Any) -> Any:
            def replica_fn(b: Any) -> Any:
                model.layers[0].bias.assign(model.layers[0].bias + 1.0)
                return 0.0

            return strategy.run(replica_fn, args=(batch,))

        # SGD with momentum=0 builds no slots: its variables are the step count and the learning rate.
        sgd_vars = [np.zeros((), np.int64), np.zeros((), np.float32)]
        adam = keras.optimizers.Adam(0.1)  # outside the scope: another optimizer's state, for the checks below
        adam.build(model.trainable_variables)
        raises(coordinator, stateless_with([np.asarray(v.value) for v in adam.variables]),
               "optimizer_variables are not this optimizer's variables", "optimizer.build(model.trainable_variables)")
        raises(coordinator, stateless_with(sgd_vars[:1]), "expected 2 values of shapes [(), ()], got 1")
        raises(coordinator, stateless_with(None), "optimizer_variables must be a list")
        raises(coordinator, stateless_with(sgd_vars, cut=1), "trainable_variables must be the values of the model's",
               "got 1 of shapes [(3, 2)]")
        raises(coordinator, reads_optimizer_state, "is read inside strategy.run", "stateless_apply")
        # A right call inside run, but the PS serves from this process (an in-process cluster): refused, not hung.
        built = keras.optimizers.SGD(0.1)
        built.build(model.trainable_variables)
        raises(coordinator, stateless_with([np.asarray(v.value) for v in built.variables]),
               "needs the parameter servers in other processes", "jaxdist.LocalCluster")
        import jaxdist.keras

        assert jaxdist.keras.sync_from_ps(model)
        assert int(np.asarray(optimizer.iterations.value)) == 0  # none of the refused calls pushed anything
        raises(coordinator, assigns_weight, "lives on the parameter servers", "optimizer.apply_gradients")

    with _cluster(num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coordinator = jaxdist.ClusterCoordinator(strategy)
        with strategy.scope():
            model2 = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
            optimizers = [keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.1)]  # kept: candidates while alive

        def uses_model(batch: Any) -> Any:
            return strategy.run(lambda b: model2(b[0]), args=(batch,))

        raises(coordinator, uses_model, "2 Keras optimizers", "model.compile(optimizer=optimizer)")
        assert len(optimizers) == 2


def _stateless_model(strategy: Any, optimizer: str, weights: list[Any] | None = None) -> tuple[Any, Any]:
    import contextlib

    import keras

    keras.utils.set_random_seed(11)
    with strategy.scope() if strategy is not None else contextlib.nullcontext():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])
        if weights is not None:
            model.set_weights(weights)
        return model, (keras.optimizers.Adam(0.05) if optimizer == "adam" else keras.optimizers.SGD(0.1, momentum=0.5))


def _regression_batches() -> list[tuple[Any, Any]]:
    import numpy as np

    rng = np.random.default_rng(5)
    return [(rng.normal(size=(16, 3)).astype(np.float32), rng.normal(size=(16, 2)).astype(np.float32))
            for _ in range(6)]


@check
def stateless_recipe_in_ps_closures_matches_apply_gradients_and_one_device_keras() -> None:
    """Keras's JAX recipe in ParameterServerStrategy closures, 1 PS / 1 worker: ``stateless_apply`` (its new values
    assigned back to the model's variables, Keras's way) trains exactly as ``apply_gradients`` in the same closures
    and as the recipe on one device without jaxdist, for SGD (momentum) and Adam; every closure's call returns the
    values the PS holds right after its push (the last one: the PS's final weights); the PS counts one step each."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxdist
    import jaxdist.keras

    batches = _regression_batches()
    for name in ("sgd", "adam"):
        model, optimizer = _stateless_model(None, name)
        initial = [np.asarray(w) for w in model.get_weights()]
        optimizer.build(model.trainable_variables)
        trainable = [v.value for v in model.trainable_variables]
        optimizer_vars = [v.value for v in optimizer.variables]

        def loss_fn(t: Any, x: Any, y: Any, m: Any = model) -> Any:
            return jnp.mean((m.stateless_call(t, [], x)[0] - y) ** 2)

        for x, y in batches:
            grads = jax.grad(loss_fn)(trainable, x, y)
            trainable, optimizer_vars = optimizer.stateless_apply(optimizer_vars, grads, trainable)
        ref = [np.asarray(w) for w in trainable]

        got: dict[str, list[Any]] = {}
        for form in ("stateless", "apply_gradients"):
            with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:  # stateless_apply in run: PS processes
                strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
                coordinator = jaxdist.ClusterCoordinator(strategy)
                model, optimizer = _stateless_model(strategy, name, initial)
                optimizer.build(model.trainable_variables)  # Keras's recipe: the optimizer_variables' structure
                optimizer_variables = [np.asarray(v.value) for v in optimizer.variables]

                def replica_fn(batch: Any, form: str = form, model: Any = model, optimizer: Any = optimizer,
                               optimizer_variables: Any = optimizer_variables) -> Any:
                    x, y = batch
                    trainable = [v.value for v in model.trainable_variables]
                    grads = jax.grad(lambda t: jnp.mean((model.stateless_call(t, [], x)[0] - y) ** 2))(trainable)
                    if form == "apply_gradients":
                        optimizer.apply_gradients(zip(grads, model.trainable_variables))
                        return trainable
                    trainable, opt_vars = optimizer.stateless_apply(optimizer_variables, grads, trainable)
                    assert opt_vars == optimizer_variables  # the state lives on the PS: returned as given
                    for variable, value in zip(model.trainable_variables, trainable):
                        variable.assign(value)  # Keras's recipe assigns back: the PS holds these values already
                    return trainable

                def step_fn(batch: Any, replica_fn: Any = replica_fn) -> Any:
                    return strategy.run(replica_fn, args=(batch,))

                returned = [coordinator.schedule(step_fn, args=(b,)).fetch() for b in batches]
                coordinator.join()
                assert jaxdist.keras.sync_from_ps(model)
                weights = [np.asarray(w) for w in model.get_weights()]
                assert int(np.asarray(optimizer.iterations.value)) == len(batches), (name, form)
                if form == "stateless":
                    for a, b in zip(jax.tree.leaves(returned[-1]), weights):
                        np.testing.assert_array_equal(np.asarray(a), b)
                    # each call returned the PS's values after its own push: the next closure starts from them
                    assert not any(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                   zip(jax.tree.leaves(returned[0]), jax.tree.leaves(returned[1])))
                got[form] = weights
        for form, weights in got.items():
            assert len(weights) == len(ref)
            for i, (a, b) in enumerate(zip(weights, ref)):
                np.testing.assert_allclose(a, b, atol=TOL, rtol=TOL, err_msg=f"{name} {form}: weight {i}")


@check
def stateless_apply_in_the_closure_body_pushes_once_and_returns_the_ps_values() -> None:
    """``stateless_apply`` called eagerly in a closure's body (outside strategy.run): the push goes at once, the
    call returns the PS's values after it, the step counter moves by one."""
    import jax
    import numpy as np

    import jaxdist
    import jaxdist.keras

    with _cluster(num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coordinator = jaxdist.ClusterCoordinator(strategy)
        model, optimizer = _stateless_model(strategy, "sgd")
        before = [np.asarray(w) for w in model.get_weights()]
        optimizer.build(model.trainable_variables)
        optimizer_variables = [np.asarray(v.value) for v in optimizer.variables]

        def body(_: Any) -> Any:
            grads = [np.ones(tuple(v.shape), np.float32) for v in model.trainable_variables]
            trainable = [np.asarray(v.value) for v in model.trainable_variables]
            return optimizer.stateless_apply(optimizer_variables, grads, trainable)[0]

        returned = coordinator.schedule(body, args=(0,)).fetch()
        assert jaxdist.keras.sync_from_ps(model)
        assert int(np.asarray(optimizer.iterations.value)) == 1
        for r, w, b in zip(jax.tree.leaves(returned), model.get_weights(), before):
            np.testing.assert_array_equal(np.asarray(r), np.asarray(w))
            np.testing.assert_allclose(np.asarray(w), b - 0.1, rtol=1e-6, atol=1e-6)  # SGD(0.1), gradient 1


@check
def stateless_apply_of_a_rerun_closure_attempt_is_applied_once() -> None:
    """A closure attempt re-run (a fresh identity with the closure's prefix, as the worker service makes for a
    re-run after a worker failure) whose step is traced anew: its stateless_apply push has the first attempt's
    identity, so the PS applies it once (one step on the counter, the weights moved once)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import jaxdist
    import jaxdist.keras
    from jaxdist.worker import context as wctx

    x, y = _regression_batches()[0]
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:  # stateless_apply in run: PS processes
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coordinator = jaxdist.ClusterCoordinator(strategy)
        model, optimizer = _stateless_model(strategy, "sgd")
        optimizer.build(model.trainable_variables)
        optimizer_variables = [np.asarray(v.value) for v in optimizer.variables]

        def make_replica_fn(attempt: int) -> Any:  # another captured value each attempt: traced (sites counted) anew
            def replica_fn(b: Any) -> Any:
                trainable = [v.value for v in model.trainable_variables]
                grads = jax.grad(lambda t: jnp.mean((model.stateless_call(t, [], b[0])[0] - b[1]) ** 2))(trainable)
                grads = [g * (attempt - attempt + 1) for g in grads]
                return optimizer.stateless_apply(optimizer_variables, grads, trainable)[0]

            return replica_fn

        def twice(batch: Any) -> Any:
            ctx = wctx.current()
            assert ctx is not None and ctx.identity is not None
            out = []
            for attempt in range(2):
                with wctx.use(ctx.for_closure(ctx.identity.prefix)):  # the attempt's identity, as a re-run gets it
                    out.append(strategy.run(make_replica_fn(attempt), args=(batch,)))
            assert strategy.trace_count >= 2, strategy.trace_count
            return out

        first, second = coordinator.schedule(twice, args=((x, y),)).fetch()
        assert jaxdist.keras.sync_from_ps(model)
        assert int(np.asarray(optimizer.iterations.value)) == 1
        for a, b, w in zip(jax.tree.leaves(first), jax.tree.leaves(second), model.get_weights()):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(w))
            np.testing.assert_array_equal(np.asarray(b), np.asarray(w))


@check
def metric_stateless_update_state_in_ps_closures_is_a_pure_function() -> None:
    """``metric.stateless_update_state`` inside strategy.run of a closure returns the updated values (the
    metric's variables read their reset values in a run), and pushes nothing: the PS accumulators stay as they
    are; ``update_state`` in the same closure still accumulates on the PS."""
    import keras
    import numpy as np

    import jaxdist

    x, y = _regression_batches()[0]
    with _cluster(num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coordinator = jaxdist.ClusterCoordinator(strategy)
        model, _ = _stateless_model(strategy, "sgd")
        with strategy.scope():
            mse = keras.metrics.MeanSquaredError()
            mae = keras.metrics.MeanAbsoluteError()

        def step_fn(batch: Any) -> Any:
            def replica_fn(b: Any) -> Any:
                pred = model(b[0])
                mae.update_state(b[1], pred)
                return mse.stateless_update_state([v.value for v in mse.variables], b[1], pred)

            return strategy.run(replica_fn, args=(batch,))

        out = [np.asarray(v) for v in coordinator.schedule(step_fn, args=((x, y),)).fetch()]
        coordinator.join()
        pred = np.asarray(model(x))
        expected = keras.metrics.MeanSquaredError()
        expected.update_state(y, pred)
        np.testing.assert_allclose(out, [np.asarray(v.value) for v in expected.variables], rtol=1e-5)
        assert float(mse.result()) == 0.0 and float(np.asarray(mse.variables[1].value)) == 0.0  # nothing pushed
        np.testing.assert_allclose(float(mae.result()), float(np.mean(np.abs(y - pred))), rtol=1e-5)


check_results = CHECKS.results_fixture()


@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", CHECKS.names())
def test_keras_ps_custom_loop(name: str, check_results: dict[str, str | None]) -> None:
    assert_passed(check_results, name)


if __name__ == "__main__":
    CHECKS.main()
