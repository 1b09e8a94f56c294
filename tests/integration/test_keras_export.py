"""Export for serving (jaxdist.keras.export_model) and DatasetCreator under the synchronous strategies.

Every check runs in ONE fresh subprocess with 8 fake CPU devices (``DeviceChecks``; the pytest
process stays Keras-free). The exports are checked by what they predict: a model trained under
``OneDeviceStrategy``, ``MirroredStrategy`` (8 replicas) and ``ParameterServerStrategy`` (an
in-process cluster, every variable partitioned over 2 PS) is exported, and

- the ``.keras`` file, loaded by Keras, predicts what the trained model predicts;
- the ``jax`` artifact, loaded in a separate Python process where ``import jaxdist`` and
  ``import keras`` fail (a ``sys.meta_path`` finder refuses them), predicts the same
  (:data:`LOADER`, the loader of docs/export.md);
- ``tf_saved_model`` raises :class:`ExportDependencyError` without TensorFlow, and with it (a
  test that skips when TensorFlow is not installed) the SavedModel predicts the same.

Each trained model's predictions differ from its initial weights' (so a stale export fails).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
from device_checks import DeviceChecks, assert_passed, fake_devices_env
from keras_util import classification_data, import_jaxdist_keras

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

NUM_DEVICES = 8
ATOL = 2e-5


CHECKS = DeviceChecks(__file__, "KERAS_EXPORT_RESULTS=", devices=NUM_DEVICES, timeout=540, setup=import_jaxdist_keras)
check = CHECKS.check

#: Run with ``python -c LOADER artifact_dir inputs.npy outputs.npy``: a process without jaxdist and Keras
#: (their imports fail) loads the artifact as docs/export.md shows and writes its predictions.
LOADER = r"""
import importlib.abc, sys

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("jaxdist", "keras"):
            raise ImportError(f"{name} is blocked in this process")
        return None

sys.meta_path.insert(0, Refuse())
for blocked in ("jaxdist", "keras"):
    try:
        __import__(blocked)
    except ImportError:
        pass
    else:
        raise SystemExit(f"{blocked} could be imported")

import json, pathlib
import numpy as np
import jax

artifact, inputs, outputs = sys.argv[1:4]
d = pathlib.Path(artifact)
manifest = json.loads((d / "manifest.json").read_text())
exported = jax.export.deserialize(bytearray((d / manifest["exported_file"]).read_bytes()))
with np.load(d / manifest["weights_file"]) as npz:
    weights = [npz[w["key"]] for w in manifest["weights"]]
x = np.load(inputs)
y = exported.call(weights, x)
np.save(outputs, np.asarray(y).astype(np.float32))  # float32: numpy cannot save bfloat16 outputs
assert not any(m.split(".")[0] in ("jaxdist", "keras") for m in sys.modules)
print("LOADED", len(weights))
"""


# ---------------------------------------------------------------------------------------
# Helpers (inside the 8-device subprocess)
# ---------------------------------------------------------------------------------------


_data = functools.partial(classification_data, n=96, d=12, classes=4)


def _model(batchnorm: bool = True) -> Any:
    import keras

    layers: list[Any] = [keras.Input((12,)), keras.layers.Dense(16, use_bias=not batchnorm)]
    if batchnorm:  # non-trainable variables (moving statistics) must be exported too
        layers.append(keras.layers.BatchNormalization())
    layers += [keras.layers.Activation("relu"), keras.layers.Dense(4)]
    model = keras.Sequential(layers)
    model.compile(keras.optimizers.Adam(0.05), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _load_blocked(artifact: Path, x: Any) -> Any:
    """The jax artifact's predictions for ``x``, computed in a process where jaxdist and Keras cannot be imported."""
    import numpy as np

    inputs, outputs = artifact.parent / "inputs.npy", artifact.parent / "outputs.npy"
    np.save(inputs, x)
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "KERAS_BACKEND")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run([sys.executable, "-c", LOADER, str(artifact), str(inputs), str(outputs)], env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and "LOADED" in proc.stdout, (proc.stdout, proc.stderr[-4000:])
    return np.load(outputs)


def _check_exports(model: Any, x: Any, initial_pred: Any, want: Any) -> None:
    """The three formats predict ``want`` (the trained model's predictions; a batch size the export never saw)."""
    import keras
    import numpy as np

    import jaxdist.keras

    assert np.abs(want - initial_pred).max() > 1e-2, "training did not move the predictions: the check could not fail"
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        written = jaxdist.keras.export_model(model, root / "model.keras")
        loaded = keras.saving.load_model(written)
        np.testing.assert_allclose(loaded.predict(x, verbose=0), want, atol=ATOL, err_msg=".keras file")

        artifact = jaxdist.keras.export_model(model, root / "artifact", format="jax")
        got = _load_blocked(artifact, x[:37])
        np.testing.assert_allclose(got, want[:37], atol=ATOL, err_msg="jax artifact in a jaxdist/Keras-free process")

        if importlib.util.find_spec("tensorflow") is None:
            try:
                jaxdist.keras.export_model(model, root / "saved_model", format="tf_saved_model")
            except jaxdist.keras.ExportDependencyError as e:
                assert "TensorFlow" in str(e) and isinstance(e, ImportError), e
            else:
                raise AssertionError("tf_saved_model without TensorFlow did not raise ExportDependencyError")
        else:
            _check_saved_model(model, root / "saved_model", x, want)


def _check_saved_model(model: Any, path: Path, x: Any, want: Any) -> None:
    import numpy as np
    import tensorflow as tf

    import jaxdist.keras

    jaxdist.keras.export_model(model, path, format="tf_saved_model")
    served = tf.saved_model.load(str(path))
    np.testing.assert_allclose(np.asarray(served.serve(tf.constant(x))), want, atol=ATOL, err_msg="SavedModel")


def _train_and_check(strategy: Any) -> None:
    import keras

    keras.utils.set_random_seed(3)
    x, y = _data()
    with strategy.scope():
        model = _model()
    initial = model.predict(x, verbose=0)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0)
    _check_exports(model, x, initial, model.predict(x, verbose=0))


# ---------------------------------------------------------------------------------------
# Checks: export
# ---------------------------------------------------------------------------------------


@check
def export_one_device() -> None:
    import jaxdist

    _train_and_check(jaxdist.OneDeviceStrategy("/cpu:0"))


@check
def export_mirrored() -> None:
    import jaxdist

    strategy = jaxdist.MirroredStrategy()
    assert strategy.num_replicas_in_sync == NUM_DEVICES
    _train_and_check(strategy)


class _PerWorker:
    """The per-worker dataset of the PS check (module-level: it pickles to the workers)."""

    def __init__(self, x: Any, y: Any, batch: int) -> None:
        self.items = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]

    def __call__(self, input_context: Any) -> Any:
        return self.items


@check
def export_parameter_servers() -> None:
    """1 worker, 2 PS, every variable partitioned in 2: the exports hold the PS's weights, pulled and assembled."""
    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras
    from jaxdist.testing import InProcessCluster

    keras.utils.set_random_seed(3)
    x, y = _data()
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(),
                                                   variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            with strategy.scope():
                model = _model(batchnorm=False)
            initial = model.predict(x, verbose=0)
            model.fit(jaxdist.keras.DatasetCreator(_PerWorker(x, y, 32)), epochs=3, steps_per_epoch=3, verbose=0)
            kernel = jaxdist.keras.ps_variables(model)[0]
            assert isinstance(kernel, jaxdist.ShardedVariable) and len(kernel.variables) == 2, kernel
            # Change the PS's copy behind the coordinator's back: the exports must pull it, not keep the last sync
            # (model.predict would pull it too: the reference is a plain Keras model given the PS's values).
            moved = kernel.numpy() * 1.5
            kernel.assign(moved)
            assert not np.allclose(np.asarray(model.trainable_variables[0].value), moved)
            plain = _model(batchnorm=False)
            plain.set_weights([v.numpy() for v in jaxdist.keras.ps_variables(model)])
            _check_exports(model, x, initial, plain.predict(x, verbose=0))
            np.testing.assert_allclose(np.asarray(model.trainable_variables[0].value), moved, atol=1e-6)
        finally:
            coord = strategy.coordinator
            if coord is not None:
                coord.shutdown(exit_tasks=False)
            strategy.close()


@check
def export_refuses_what_it_cannot_honour() -> None:
    import jax
    import numpy as np

    import jaxdist.keras

    model = _model()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cases = [
            (lambda: jaxdist.keras.export_model(model, root / "m.h5"), ValueError, "end in .keras"),
            (lambda: jaxdist.keras.export_model(model, root / "m", format="onnx"), ValueError, "unknown format"),
            (lambda: jaxdist.keras.export_model(model, root / "m.keras", platforms=("cpu",)), ValueError, "format='jax'"),
            (lambda: jaxdist.keras.export_model(model, root / "m.keras", input_signature=[1]), ValueError, "does not apply"),
        ]
        (root / "full").mkdir()
        (root / "full" / "f").write_text("x")
        cases.append((lambda: jaxdist.keras.export_model(model, root / "full", format="jax"), ValueError, "not an empty"))
        for fn, exc, text in cases:
            try:
                fn()
            except exc as e:
                assert text in str(e), (text, e)
            else:
                raise AssertionError(f"no {exc.__name__} ({text})")
        # A fixed batch size: the artifact takes exactly that shape.
        sig = jax.ShapeDtypeStruct((5, 12), np.float32)
        artifact = jaxdist.keras.export_model(model, root / "fixed", format="jax", input_signature=sig)
        x, _ = _data(n=5)
        np.testing.assert_allclose(_load_blocked(artifact, x), model.predict(x, verbose=0), atol=ATOL)


@check
def export_bfloat16_weights_are_stored_as_float32() -> None:
    import json

    import keras
    import numpy as np

    import jaxdist.keras

    keras.config.set_dtype_policy("bfloat16")
    try:
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(4)])
    finally:
        keras.config.set_dtype_policy("float32")
    x, _ = _data(n=8)
    with tempfile.TemporaryDirectory() as tmp:
        artifact = jaxdist.keras.export_model(model, Path(tmp) / "a", format="jax")
        manifest = json.loads((artifact / "manifest.json").read_text())
        assert {(w["dtype"], w["stored_dtype"]) for w in manifest["weights"]} == {("bfloat16", "float32")}, manifest
        got = _load_blocked(artifact, x.astype(np.float32))
    np.testing.assert_allclose(got.astype(np.float32), np.asarray(model.predict(x, verbose=0), np.float32), atol=1e-2)


def _call_artifact(artifact: Path, inputs: Any) -> Any:
    """The artifact's outputs for ``inputs`` (in this process: the shapes are what is checked here)."""
    import json

    import jax
    import numpy as np

    manifest = json.loads((artifact / "manifest.json").read_text())
    exported = jax.export.deserialize(bytearray((artifact / manifest["exported_file"]).read_bytes()))
    with np.load(artifact / manifest["weights_file"]) as npz:
        return np.asarray(exported.call([npz[w["key"]] for w in manifest["weights"]], inputs))


@check
def export_subclassed_and_two_input_models() -> None:
    """A subclassed model needs input_signature (None sizes left open); a two-input model takes a list."""
    import jax
    import keras
    import numpy as np

    import jaxdist.keras

    class Sub(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.dense = keras.layers.Dense(3)

        def call(self, x: Any) -> Any:
            return self.dense(x) * 2.0

    sub = Sub()
    x, _ = _data(n=10)
    sub(x)
    a, b = keras.Input((5,)), keras.Input((7,))
    two = keras.Model([a, b], keras.layers.Dense(2)(keras.layers.Concatenate()([a, b])))
    xa, xb = x[:, :5], x[:, 5:]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        try:
            jaxdist.keras.export_model(sub, root / "sub", format="jax")
        except ValueError as e:
            assert "input_signature" in str(e), e
        else:
            raise AssertionError("a subclassed model without input_signature was exported")
        artifact = jaxdist.keras.export_model(sub, root / "sub", format="jax",
                                              input_signature=jax.ShapeDtypeStruct((None, 12), np.float32))
        np.testing.assert_allclose(_call_artifact(artifact, x[:7]), np.asarray(sub(x[:7])), atol=ATOL)
        artifact = jaxdist.keras.export_model(two, root / "two", format="jax")
        np.testing.assert_allclose(_call_artifact(artifact, [xa, xb]), two.predict([xa, xb], verbose=0), atol=ATOL)


# ---------------------------------------------------------------------------------------
# Checks: DatasetCreator under the synchronous strategies
# ---------------------------------------------------------------------------------------


class _PerReplica:
    """A dataset function as TF's DatasetCreator docs write it: per-replica batches of the pipeline's rows."""

    def __init__(self, x: Any, y: Any, global_batch: int) -> None:
        self.x, self.y, self.global_batch = x, y, global_batch
        self.contexts: list[Any] = []

    def __call__(self, input_context: Any) -> Any:
        self.contexts.append(input_context)
        b = input_context.get_per_replica_batch_size(self.global_batch)
        return [(self.x[i:i + b], self.y[i:i + b]) for i in range(0, len(self.x), b)]


def _creator_equals_batches(strategy: Any) -> None:
    """fit/evaluate/predict(DatasetCreator) give what the same global batches passed directly give."""
    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras

    r = strategy.num_replicas_in_sync
    x, y = _data(n=96)
    xv, yv = _data(n=64, seed=1)
    train, val = _PerReplica(x, y, 32), _PerReplica(xv, yv, 32)
    keras.utils.set_random_seed(5)
    with strategy.scope():
        a = _model()
        b = _model()
    b.set_weights(a.get_weights())
    hist_a = a.fit(jaxdist.keras.DatasetCreator(train), epochs=3, steps_per_epoch=3, verbose=0,
                   validation_data=jaxdist.keras.DatasetCreator(val), validation_steps=2)
    eval_a = a.evaluate(val, steps=2, return_dict=True, verbose=0)  # a plain dataset function too
    hist_b = b.fit(jaxdist.keras.Batches([(x[i:i + 32], y[i:i + 32]) for i in range(0, 96, 32)]), epochs=3, verbose=0,
                   validation_data=(xv, yv), validation_batch_size=32)
    eval_b = b.evaluate(xv, yv, batch_size=32, return_dict=True, verbose=0)
    for wa, wb in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(wa, wb, atol=ATOL)
    assert hist_a.history.keys() == hist_b.history.keys(), (hist_a.history, hist_b.history)
    for k in hist_b.history:
        np.testing.assert_allclose(hist_a.history[k], hist_b.history[k], atol=ATOL, err_msg=k)
    for k in eval_b:
        assert abs(eval_a[k] - eval_b[k]) < ATOL, (k, eval_a, eval_b)
    np.testing.assert_allclose(a.predict(jaxdist.keras.DatasetCreator(val), steps=2, verbose=0),
                               a.predict(xv, batch_size=32, verbose=0), atol=ATOL)
    ctx = jaxdist.InputContext(1, 0, r)
    assert train.contexts == [ctx] and val.contexts == [ctx] * 3, (train.contexts, val.contexts)


@check
def dataset_creator_mirrored_equals_direct_input() -> None:
    import jaxdist

    _creator_equals_batches(jaxdist.MirroredStrategy())


@check
def dataset_creator_one_device_equals_direct_input() -> None:
    import jaxdist

    _creator_equals_batches(jaxdist.OneDeviceStrategy("/cpu:0"))


@check
def dataset_creator_refusals_are_clear() -> None:
    import jaxdist
    import jaxdist.keras

    x, y = _data(n=32)
    with jaxdist.MirroredStrategy().scope():
        model = _model()
    creator = jaxdist.keras.DatasetCreator(_PerReplica(x, y, 32))
    cases = [
        (lambda: model.fit(creator, epochs=1, verbose=0), "needs steps_per_epoch"),
        (lambda: model.fit(creator, y, steps_per_epoch=1, verbose=0), "does not take y"),
        (lambda: model.fit(creator, steps_per_epoch=1, class_weight={0: 1.0}, verbose=0), "does not take class_weight"),
        (lambda: model.fit(creator, steps_per_epoch=1, validation_data=creator, verbose=0), "needs validation_steps"),
        (lambda: model.evaluate(creator, verbose=0), "needs steps"),
    ]
    for fn, text in cases:
        try:
            fn()
        except ValueError as e:
            assert text in str(e), (text, e)
        else:
            raise AssertionError(f"no ValueError ({text})")


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


check_results = CHECKS.results_fixture()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", CHECKS.names())
def test_export_and_dataset_creator_on_8_fake_devices(name: str, check_results: dict[str, str | None]) -> None:
    assert_passed(check_results, name)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None,
                    reason="TensorFlow is not installed: the tf_saved_model export needs it (the 8-device checks "
                           "check its ExportDependencyError instead)")
def test_tf_saved_model_predicts_the_trained_model() -> None:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import test_keras_export as t; t.import_jaxdist_keras(); "
            "t.export_one_device(); print('SAVED_MODEL_OK')")
    proc = subprocess.run([sys.executable, "-c", code, str(Path(__file__).parent)], env=fake_devices_env(1),
                          capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0 and "SAVED_MODEL_OK" in proc.stdout, (proc.stdout, proc.stderr[-4000:])


if __name__ == "__main__":
    CHECKS.main()
