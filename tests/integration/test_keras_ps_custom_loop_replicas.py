"""The guide's Keras custom loop inside ParameterServerStrategy closures, with the worker's ``strategy.run`` over
2 local devices (2 fake CPU devices in one subprocess, in-process cluster): the per-worker dataset function
uses ``strategy.distribute_datasets_from_function`` (each ``next`` gives each replica half of a global batch),
``optimizer.apply_gradients`` (or ``stateless_apply``) sums the 2 replicas' gradients and the metrics add up the
replicas' updates.
Weights, step count and metric results per epoch equal Keras's own JAX recipe on one device within 1e-5
(the reference and the program's parts are test_keras_ps_custom_loop's).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
from device_checks import DeviceChecks, assert_passed
from keras_util import import_jaxdist_keras

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

HALF = 16  # rows per replica: GLOBAL_BATCH (32) over 2 replicas


CHECKS = DeviceChecks(__file__, "KERAS_PS_LOOP_REPLICAS_RESULTS=", devices=2, timeout=600, setup=import_jaxdist_keras)


class Halves:
    """Each replica's input (module-level: it pickles to the workers): every training batch, split in two halves."""

    def __call__(self, input_context: Any) -> Any:
        import test_keras_ps_custom_loop as base

        train, _ = base._data()
        for x, y in train * base.EPOCHS:
            yield x[:HALF], y[:HALF]
            yield x[HALF:], y[HALF:]


class PerWorker:
    """The per-worker dataset function: one batch per local replica at each ``next`` (TF's pattern)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def __call__(self, input_context: Any) -> Any:
        return self.strategy.distribute_datasets_from_function(Halves())


@CHECKS.check
def guide_with_two_replicas_per_worker_matches_one_device_keras() -> None:
    _guide_with_two_replicas("apply_gradients")


@CHECKS.check
def stateless_apply_over_two_replicas_with_an_in_process_ps_is_refused_not_deadlocked() -> None:
    """``optimizer.stateless_apply`` inside a 2-device ``strategy.run`` with the PS tasks in this process (an
    in-process cluster): the PS's optimizer step would wait for the XLA threads the step holds (it hung); a
    ConfigurationError says what to write instead."""
    from jaxdist.errors import ConfigurationError

    try:
        _guide_with_two_replicas("stateless")
    except Exception as e:  # the closure's error, as fetch raises it
        assert isinstance(e, ConfigurationError) or "ConfigurationError" in str(e), (type(e), str(e))
        assert "needs the parameter servers in other processes" in str(e), str(e)
        assert "apply_gradients" in str(e), str(e)
        return
    raise AssertionError("no ConfigurationError")


def _guide_with_two_replicas(form: str) -> None:
    import jax
    import numpy as np
    import test_keras_ps_custom_loop as base

    import jaxdist
    import jaxdist.keras
    from jaxdist.testing import InProcessCluster

    ref = base._reference()
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        coordinator = jaxdist.ClusterCoordinator(strategy)
        p = base._parts(strategy, ref["initial"])
        model, loss_object, optimizer = p["model"], p["loss_object"], p["optimizer"]
        train_loss, train_accuracy = p["train_loss"], p["train_accuracy"]
        optimizer.build(model.trainable_variables)
        optimizer_variables = [np.asarray(v.value) for v in optimizer.variables]

        def train_step(inputs: Any) -> Any:
            images, labels = inputs

            def loss_fn(trainable: Any) -> Any:
                predictions, _ = model.stateless_call(trainable, [], images, training=True)
                loss = jaxdist.compute_average_loss(loss_object(labels, predictions), global_batch_size=base.GLOBAL_BATCH)
                return loss, predictions

            trainable = [v.value for v in model.trainable_variables]
            (loss, predictions), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
            if form == "stateless":
                trainable, _ = optimizer.stateless_apply(optimizer_variables, grads, trainable)
                for variable, value in zip(model.trainable_variables, trainable):
                    variable.assign(value)
            else:
                optimizer.apply_gradients(zip(grads, model.trainable_variables))
            train_accuracy.update_state(labels, predictions)
            return loss

        def step_fn(iterator: Any) -> Any:
            assert strategy.num_replicas_in_sync == 2  # on the worker: its 2 local devices
            loss = strategy.reduce("SUM", strategy.run(train_step, args=(next(iterator),)), axis=None)
            train_loss.update_state(loss)
            return loss

        iterator = iter(coordinator.create_per_worker_dataset(PerWorker(strategy)))
        train, _ = base._data()
        epochs = []
        for _ in range(base.EPOCHS):
            for _ in train:
                coordinator.schedule(step_fn, args=(iterator,)).fetch()
            coordinator.join()
            epochs.append({k: float(p[k].result()) for k in ("train_loss", "train_accuracy")})
            for k in ("train_loss", "train_accuracy"):
                p[k].reset_state()
        assert jaxdist.keras.sync_from_ps(model)
        for i, (a, b) in enumerate(zip(model.get_weights(), ref["weights"])):
            np.testing.assert_allclose(a, b, atol=base.TOL, rtol=base.TOL, err_msg=f"weight {i}")
        assert int(np.asarray(optimizer.iterations.value)) == ref["iterations"]
        for got, want in zip(epochs, ref["metrics"]):
            for k, v in got.items():
                np.testing.assert_allclose(v, want[k], atol=base.TOL, rtol=base.TOL, err_msg=k)


check_results = CHECKS.results_fixture()


@pytest.mark.slow
@pytest.mark.timeout(660)
@pytest.mark.parametrize("name", CHECKS.names())
def test_keras_ps_custom_loop_two_replicas(name: str, check_results: dict[str, str | None]) -> None:
    assert_passed(check_results, name)


if __name__ == "__main__":
    CHECKS.main()
