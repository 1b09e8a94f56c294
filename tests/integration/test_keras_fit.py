"""Keras 3 compile/fit/evaluate/predict under every synchronous jaxdist strategy, on 8 fake CPU devices.

The device count is fixed when JAX starts and the other test modules import
JAX with one device (and without Keras), so every check runs in ONE fresh
subprocess (``python tests/integration/test_keras_fit.py``) with
``XLA_FLAGS=--xla_force_host_platform_device_count=8`` that prints one JSON
line ``{check: null | traceback}``; each test asserts on one check's result.

The reference of every comparison is Keras's own single-device run (no
strategy, no ``keras.distribution``) of the same deterministic program with
the same global batch.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from device_checks import DeviceChecks, assert_passed, fake_devices_env
from keras_util import classification_data, import_jaxdist_keras

# Not imported here: Keras picks its backend at import, and the pytest process must stay Keras-free.
if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

NUM_DEVICES = 8
ROOT = Path(__file__).resolve().parents[2]

# float32: 8 replicas sum the gradient in another order than one device does.
ATOL = 2e-5


CHECKS = DeviceChecks(__file__, "KERAS_CHECK_RESULTS=", devices=NUM_DEVICES, timeout=540, setup=import_jaxdist_keras)
check = CHECKS.check


# ---------------------------------------------------------------------------------------
# Helpers (inside the 8-device subprocess)
# ---------------------------------------------------------------------------------------


_data = functools.partial(classification_data, n=100, d=12, classes=4)


def _model(kind: str, d: int = 12, classes: int = 4) -> Any:
    import keras

    if kind == "sequential":
        return keras.Sequential(
            [keras.Input((d,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(classes)]
        )
    if kind == "functional":
        inp = keras.Input((d,))
        h = keras.layers.Dense(16, activation="relu")(inp)
        h = keras.layers.Concatenate()([h, inp])
        return keras.Model(inp, keras.layers.Dense(classes)(h))

    class Subclassed(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.hidden = keras.layers.Dense(16, activation="relu")
            self.out = keras.layers.Dense(classes)

        def call(self, x: Any) -> Any:
            return self.out(self.hidden(x))

    m = Subclassed()
    m.build((None, d))
    return m


class _Recorder:
    """A callback factory recording what Keras's callbacks saw (batch ends, epoch logs)."""

    def __new__(cls) -> Any:
        import keras

        class Recorder(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.batch_ends: list[int] = []
                self.epoch_logs: list[dict[str, float]] = []

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                self.batch_ends.append(batch)

            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                self.epoch_logs.append({k: float(v) for k, v in (logs or {}).items()})

        return Recorder()


def _train(strategy: Any, kind: str = "sequential", fit_input: Callable[[], dict[str, Any]] | None = None,
           epochs: int = 2, optimizer: str = "adam") -> dict[str, Any]:
    """Build, compile and fit in ``strategy.scope()`` (None: no strategy at all); evaluate and predict."""
    import contextlib

    import keras
    import numpy as np

    x, y = _data()
    keras.utils.set_random_seed(7)
    scope = strategy.scope() if strategy is not None else contextlib.nullcontext()
    rec = _Recorder()
    with scope:
        model = _model(kind)
        opt = keras.optimizers.Adam(0.01) if optimizer == "adam" else keras.optimizers.SGD(0.1, momentum=0.9)
        model.compile(
            optimizer=opt,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy", keras.metrics.SparseCategoricalCrossentropy(from_logits=True, name="xent")],
            steps_per_execution=2,
        )
        inputs = fit_input() if fit_input else {"x": x, "y": y, "batch_size": 32}
        history = model.fit(**inputs, epochs=epochs, validation_data=(x[:50], y[:50]), callbacks=[rec], verbose=0)
        ev = model.evaluate(x, y, batch_size=24, return_dict=True, verbose=0)
        pred = model.predict(x, batch_size=32, verbose=0)
    return {
        "model": model,
        "weights": [np.asarray(w) for w in model.get_weights()],
        "history": history.history,
        "evaluate": ev,
        "predict": pred,
        "batch_ends": rec.batch_ends,
        "epoch_logs": rec.epoch_logs,
    }


def _assert_same(got: dict[str, Any], ref: dict[str, Any], what: str) -> None:
    import numpy as np

    assert len(got["weights"]) == len(ref["weights"]), what
    for i, (a, b) in enumerate(zip(got["weights"], ref["weights"])):
        np.testing.assert_allclose(a, b, atol=ATOL, rtol=1e-5, err_msg=f"{what}: weight {i}")
    assert got["history"].keys() == ref["history"].keys(), (what, got["history"].keys(), ref["history"].keys())
    for k in ref["history"]:
        np.testing.assert_allclose(got["history"][k], ref["history"][k], atol=ATOL, rtol=1e-5, err_msg=f"{what}: {k}")
    assert got["evaluate"].keys() == ref["evaluate"].keys(), what
    for k in ref["evaluate"]:
        np.testing.assert_allclose(got["evaluate"][k], ref["evaluate"][k], atol=ATOL, rtol=1e-5, err_msg=f"{what}: eval {k}")
    np.testing.assert_allclose(got["predict"], ref["predict"], atol=ATOL, rtol=1e-5, err_msg=f"{what}: predict")
    assert got["batch_ends"] == ref["batch_ends"], (what, got["batch_ends"], ref["batch_ends"])
    assert len(got["epoch_logs"]) == len(ref["epoch_logs"]), what


def _strategies() -> dict[str, Callable[[], Any]]:
    import jax

    import jaxdist

    return {
        "default": jaxdist.get_strategy,
        "one_device": lambda: jaxdist.OneDeviceStrategy("cpu:3"),
        "mirrored": jaxdist.MirroredStrategy,
        "central_storage": jaxdist.CentralStorageStrategy,
        "tpu": lambda: jaxdist.TPUStrategy(devices=jax.devices("cpu")),
        "multi_worker": jaxdist.MultiWorkerMirroredStrategy,  # no TF_CONFIG: one process, every local device
    }


_REF: dict[Any, dict[str, Any]] = {}


def _reference(kind: str = "sequential", key: str = "arrays", fit_input: Any = None, epochs: int = 2) -> dict[str, Any]:
    if (kind, key, epochs) not in _REF:
        _REF[(kind, key, epochs)] = _train(None, kind, fit_input, epochs)
    return _REF[(kind, key, epochs)]


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------


def _check_strategy(name: str) -> None:
    import jax
    import keras

    import jaxdist.keras

    strategy = _strategies()[name]()
    got = _train(strategy)
    _assert_same(got, _reference(), name)
    model = got["model"]
    dist = jaxdist.keras.distribution_for(strategy)
    if name == "default":
        assert dist is None
        assert keras.distribution.distribution() is None
        return
    # Every variable (model, optimizer, metrics) lives on exactly the strategy's devices.
    want = set(strategy.devices)
    for v in [*model.variables, *model.optimizer.variables, *model.metrics_variables]:
        assert set(v.value.sharding.device_set) == want, (name, v.path, v.value.sharding)
    counts = dist.placement_counts
    if strategy.num_replicas_in_sync > 1:
        # 100 rows in batches of 32 (32, 32, 32, 4), validation 50 (32, 18), evaluate 100 in 24s (.., 4),
        # predict (.., 4): both kinds of batch were placed.
        assert counts["split"] > 0 and counts["replicated"] > 0, counts
    else:
        assert counts["split"] > 0, counts
    if name == "one_device":
        assert want == {jax.devices("cpu")[3]}


for _name in ("default", "one_device", "mirrored", "central_storage", "tpu", "multi_worker"):
    CHECKS.add(f"strategy_{_name}_matches_single_device", (lambda n: lambda: _check_strategy(n))(_name))


@check
def functional_and_subclassed_on_mirrored() -> None:
    import jaxdist

    strategy = jaxdist.MirroredStrategy()
    for kind in ("functional", "subclassed"):
        _assert_same(_train(strategy, kind), _reference(kind), kind)


@check
def sgd_momentum_parity_on_8_devices() -> None:
    """Parity: the same deterministic fit on 8 replicas and on one device ends with the same weights."""
    import jaxdist

    ref = _train(None, optimizer="sgd", epochs=4)
    got = _train(jaxdist.MirroredStrategy(), optimizer="sgd", epochs=4)
    _assert_same(got, ref, "sgd momentum, 4 epochs")


def _generator_input() -> dict[str, Any]:
    x, y = _data()

    def gen() -> Any:
        for i in range(0, len(x), 20):  # 5 batches of 20 rows: 20 % 8 != 0, every batch is computed whole
            yield x[i : i + 20], y[i : i + 20]

    return {"x": gen()}


def _pydataset_input() -> dict[str, Any]:
    import keras

    x, y = _data()

    class Digits(keras.utils.PyDataset):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, i: int) -> Any:
            rows = slice(i * 32, min(len(x), (i + 1) * 32))
            return x[rows], y[rows]

    return {"x": Digits()}


def _batches_input() -> dict[str, Any]:
    import jaxdist.keras

    x, y = _data()
    return {"x": jaxdist.keras.Batches([(x[i : i + 40], y[i : i + 40]) for i in range(0, len(x), 40)])}


@check
def generator_pydataset_and_iterable_inputs_on_mirrored() -> None:
    import jaxdist

    strategy = jaxdist.MirroredStrategy()
    # A generator is one pass (Keras reads it once): one epoch.
    _assert_same(_train(strategy, fit_input=_generator_input, epochs=1),
                 _reference(key="generator", fit_input=_generator_input, epochs=1), "generator")
    _assert_same(_train(strategy, fit_input=_pydataset_input), _reference(key="pydataset", fit_input=_pydataset_input),
                 "PyDataset")
    got = _train(strategy, fit_input=_batches_input)
    _assert_same(got, _reference(key="batches", fit_input=_batches_input), "jaxdist.keras.Batches")
    assert len(got["history"]["loss"]) == 2  # re-iterated: the second epoch trained too


@check
def metrics_are_exact_with_a_short_last_batch() -> None:
    """Accuracy and loss over 100 rows in batches of 32 (last 4 rows over 8 replicas) equal the numpy ones."""
    import keras
    import numpy as np

    import jaxdist

    x, y = _data()
    strategy = jaxdist.MirroredStrategy()
    keras.utils.set_random_seed(3)
    with strategy.scope():
        model = _model("sequential")
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    ev = model.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
    with strategy.scope():
        logits = model.predict(x, batch_size=32, verbose=0)
    assert logits.shape == (100, 4)
    acc = float(np.mean(np.argmax(logits, axis=1) == y))
    z = logits - logits.max(axis=1, keepdims=True)
    xent = float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(100), y]))
    assert abs(ev["accuracy"] - acc) < 1e-6, (ev, acc)
    assert abs(ev["loss"] - xent) < 1e-5, (ev, xent)


@check
def train_on_batch_with_a_short_batch() -> None:
    import keras
    import numpy as np

    import jaxdist

    x, y = _data()
    results = []
    for strategy in (None, jaxdist.MirroredStrategy()):
        keras.utils.set_random_seed(5)
        with strategy.scope() if strategy else __import__("contextlib").nullcontext():
            model = _model("sequential")
            model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            model.train_on_batch(x[:32], y[:32])
            model.train_on_batch(x[32:52], y[32:52])  # 20 rows over 8 replicas
            results.append([np.asarray(w) for w in model.get_weights()])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, atol=ATOL)


@check
def a_model_keeps_its_strategy_outside_the_scope_and_in_other_threads() -> None:
    """TF's rule: fit/evaluate/predict use the strategy the model was built in, wherever they are called."""
    import threading

    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras
    from jaxdist.base.errors import ConfigurationError

    x, y = _data()
    strategy = jaxdist.MirroredStrategy()
    keras.utils.set_random_seed(7)
    with strategy.scope():
        model = _model("sequential")
        model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    dist = jaxdist.keras.distribution_for(strategy)
    before = dist.placement_counts["split"]
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # outside the scope
    after_fit = dist.placement_counts["split"]
    assert after_fit > before, (before, after_fit)
    out: dict[str, Any] = {}
    t = threading.Thread(target=lambda: out.update(ev=model.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)))
    t.start()
    t.join(120)
    assert "ev" in out and dist.placement_counts["split"] > after_fit, out
    for v in model.variables:
        assert set(v.value.sharding.device_set) == set(strategy.devices), v.path
    # A model built outside every scope cannot be trained inside one: a clear error, not XLA's device mismatch.
    plain = _model("sequential")
    plain.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with strategy.scope():
        try:
            plain.fit(x, y, batch_size=32, epochs=1, verbose=0)
        except ConfigurationError as e:
            assert "inside the strategy's scope" in str(e), e
        else:
            raise AssertionError("a model built outside the scope was fitted inside it")
    np.testing.assert_equal(len(plain.get_weights()), 4)




# ---------------------------------------------------------------------------------------
# Tests (run in pytest; each asserts on one check of the shared subprocess)
# ---------------------------------------------------------------------------------------


check_results = CHECKS.results_fixture()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", CHECKS.names())
def test_keras_on_8_fake_devices(name: str, check_results: dict[str, str | None]) -> None:
    assert_passed(check_results, name)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy", ["default", "one_device", "mirrored", "central_storage", "tpu", "multi_worker"])
def test_keras_fit_example(strategy: str) -> None:
    """examples/keras_fit.py trains digits to >= 90% test accuracy on each strategy (8 fake devices)."""
    env = fake_devices_env(NUM_DEVICES)
    if strategy == "tpu":
        env["JAXDIST_TPU_FAKE_DEVICES"] = "cpu"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "keras_fit.py"), "--strategy", strategy, "--epochs", "4", "--verbose", "0"],
        env=env, capture_output=True, text=True, timeout=280, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["strategy"] == strategy
    assert result["replicas"] == (1 if strategy in ("default", "one_device") else NUM_DEVICES), result
    assert result["test_accuracy"] >= 0.9, result
    assert abs(result["test_accuracy"] - result["predict_accuracy"]) < 1e-6, result


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_keras_prints_its_figures() -> None:
    """bench/bench_keras.py (one tiny round): JSON lines with both contenders' medians, the ratio and placement times."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench_keras.py"), "--rounds", "1", "--epochs", "2", "--batch", "64",
         "--examples", "256"],
        env=fake_devices_env(NUM_DEVICES), capture_output=True, text=True, timeout=280, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    by_figure: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_figure.setdefault(row["figure"], []).append(row)
    assert {r["contender"] for r in by_figure["keras_fit_mlp"]} == {"jaxdist_mirrored", "keras_data_parallel"}
    assert all(r["devices"] == NUM_DEVICES and r["median_steps_per_s"] > 0 for r in by_figure["keras_fit_mlp"])
    assert by_figure["keras_fit_ratio"][0]["jaxdist_over_data_parallel"] > 0
    assert {r["contender"] for r in by_figure["keras_batch_placement"]} == {"jaxdist_mirrored", "keras_data_parallel"}


@pytest.mark.timeout(120)
def test_import_refuses_another_keras_backend() -> None:
    env = fake_devices_env(1)
    env["KERAS_BACKEND"] = "tensorflow"
    code = (
        "import jaxdist.base.errors as E\n"
        "try:\n    import jaxdist.keras\n"
        "except E.ConfigurationError as e:\n    print('REFUSED', 'KERAS_BACKEND' in str(e))\n"
        "import sys; print('KERAS_IMPORTED', 'keras' in sys.modules)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    assert "REFUSED True" in proc.stdout and "KERAS_IMPORTED False" in proc.stdout, (proc.stdout, proc.stderr[-2000:])


@pytest.mark.timeout(120)
def test_import_selects_the_jax_backend() -> None:
    code = "import jaxdist.keras, keras, os; print(keras.config.backend(), os.environ['KERAS_BACKEND'])"
    proc = subprocess.run([sys.executable, "-c", code], env=fake_devices_env(1), capture_output=True, text=True, timeout=100)
    assert proc.stdout.split() == ["jax", "jax"], (proc.stdout, proc.stderr[-2000:])


if __name__ == "__main__":
    CHECKS.main()
