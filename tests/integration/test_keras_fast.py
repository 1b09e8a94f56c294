"""Keras ``fit``/``evaluate``/``predict`` under jaxdist's strategies, in the pytest process: the fast lane's
Keras checks (the full parity matrix runs in subprocesses: test_keras_ps.py, test_keras_fit.py).

``import jaxdist.keras`` selects Keras's JAX backend before Keras loads, so Keras can run here. Each check
trains a small model under a strategy and the same model with plain Keras from the same initial weights,
and compares weights, logs and outputs.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402  (before keras: selects the JAX backend)
import keras  # noqa: E402
from jaxdist.testing import InProcessCluster  # noqa: E402

pytestmark = [
    pytest.mark.timeout(240),
    # Keras 3.15's own Variable.numpy() (np.array(self)) meets numpy 2's copy-keyword deprecation: Keras's
    # warning, not jaxdist's (the subprocess checks run without warnings-as-errors).
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]

BATCH = 16


def _data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(3)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 3))).argmax(axis=1).astype(np.int32)
    return x, y


def _model() -> Any:
    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _reference(initial: list[np.ndarray], x: np.ndarray, y: np.ndarray, epochs: int) -> tuple[Any, Any]:
    ref = _model()
    ref.set_weights(initial)
    hist = ref.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return ref, hist


class _Batches:
    """The per-worker dataset: the batches in order (module level: it pickles to the worker)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.items = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]

    def __call__(self, input_context: Any) -> Any:
        return self.items


def test_fit_evaluate_predict_on_parameter_servers_match_keras() -> None:
    x, y = _data()
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(),
                                                   variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            with strategy.scope():
                model = _model()
            initial = model.get_weights()
            hist = model.fit(jaxdist.keras.DatasetCreator(_Batches(x, y)), epochs=2, steps_per_epoch=4, verbose=0)
            got = model.get_weights()
            evaluated = model.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
            predicted = model.predict(x, batch_size=BATCH, verbose=0)
            assert int(model.optimizer.iterations.numpy()) == 8
        finally:
            coord = strategy.coordinator
            if coord is not None:
                coord.shutdown(exit_tasks=False)
            strategy.close()
    ref, ref_hist = _reference(initial, x, y, epochs=2)
    for g, w in zip(got, ref.get_weights()):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    want = ref.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
    assert set(evaluated) == set(want)
    for key in want:
        np.testing.assert_allclose(evaluated[key], want[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(predicted, ref.predict(x, batch_size=BATCH, verbose=0), rtol=1e-5, atol=1e-6)


def test_fit_evaluate_predict_on_one_device_strategy_match_keras() -> None:
    x, y = _data()
    strategy = jaxdist.sync.OneDeviceStrategy("cpu:0")
    with strategy.scope():
        model = _model()
    initial = model.get_weights()
    hist = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    ref, ref_hist = _reference(initial, x, y, epochs=2)
    for g, w in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    np.testing.assert_allclose(model.evaluate(x, y, batch_size=BATCH, verbose=0),
                               ref.evaluate(x, y, batch_size=BATCH, verbose=0), rtol=1e-5)
    np.testing.assert_allclose(model.predict(x, batch_size=BATCH, verbose=0), ref.predict(x, batch_size=BATCH, verbose=0),
                               rtol=1e-5, atol=1e-6)
