"""jaxdist.SidecarEvaluator as the evaluator task (TF_CONFIG type evaluator) beside a Keras fit writing checkpoints."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from device_checks import fake_devices_env  # noqa: E402

# One script for both tasks, as TF's guide writes it: the task type decides what it does.
SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import jaxdist.keras
    import keras, jaxdist

    ckpt_dir, epochs = sys.argv[1], int(sys.argv[2])
    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 6)).astype(np.float32)
    y = (x[:, 0] - x[:, 2] > 0).astype(np.int32)
    x_eval, y_eval = x[:48], y[:48]

    def build(strategy):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.SGD(0.1), metrics=["accuracy"],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    resolver = jaxdist.TFConfigClusterResolver()
    if resolver.task_type == "evaluator":
        model = build(jaxdist.get_strategy())
        evaluator = jaxdist.SidecarEvaluator(model, (x_eval, y_eval), ckpt_dir, max_evaluations=epochs,
                                             poll_interval=0.05, timeout=240)
        print("EVALUATOR READY", flush=True)
        evaluator.start()
        print("RESULT " + json.dumps({str(k): v for k, v in evaluator.results.items()}), flush=True)
    else:
        model = build(jaxdist.MirroredStrategy())
        ckpt = keras.callbacks.ModelCheckpoint(os.path.join(ckpt_dir, "ckpt-{epoch}.weights.h5"), save_weights_only=True)
        model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, callbacks=[ckpt], verbose=0)
        final = model.evaluate(x_eval, y_eval, return_dict=True, verbose=0)
        print("RESULT " + json.dumps({"final": final, "iterations": int(model.optimizer.iterations.numpy())}), flush=True)
    """
)


def _result(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1].removeprefix("RESULT "))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_evaluator_task_evaluates_new_checkpoints_until_the_last(tmp_path: Path) -> None:
    import numpy as np

    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    ckpt_dir = tmp_path / "ckpt"
    ckpt_dir.mkdir()
    # A checkpoint being written (here: never readable) is retried, then passed over for a newer one.
    (ckpt_dir / "ckpt-0.weights.h5").write_bytes(b"not yet an HDF5 file")
    epochs = 4
    cluster = {"chief": ["127.0.0.1:1"]}
    evaluator_env = dict(fake_devices_env(1), TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "evaluator", "index": 0}}))
    evaluator = subprocess.Popen([sys.executable, str(script), str(ckpt_dir), str(epochs)], env=evaluator_env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert evaluator.stdout is not None
        assert evaluator.stdout.readline().startswith("EVALUATOR READY")
        chief_env = dict(fake_devices_env(8), TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "chief", "index": 0}}))
        chief = subprocess.run([sys.executable, str(script), str(ckpt_dir), str(epochs)], env=chief_env,
                               capture_output=True, text=True, timeout=280)
        assert chief.returncode == 0, chief.stderr[-3000:]
        out, err = evaluator.communicate(timeout=280)
    finally:
        if evaluator.poll() is None:
            evaluator.kill()
            evaluator.communicate()
    assert evaluator.returncode == 0, err[-3000:]
    trained, evaluated = _result(chief.stdout), _result(out)
    # It stopped at the last checkpoint (max_evaluations), never evaluated the unreadable one, and its
    # metrics of the last checkpoint are the chief's own evaluation of its final weights.
    numbers = [int(k) for k in evaluated]  # in evaluation order
    assert numbers == sorted(set(numbers)) and numbers[-1] == epochs and 0 not in numbers, evaluated
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(evaluated[str(epochs)][key], trained["final"][key], rtol=1e-5)
    assert trained["iterations"] == epochs * 6
