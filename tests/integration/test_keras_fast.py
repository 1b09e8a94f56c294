"""Keras ``fit``/``evaluate``/``predict`` under jaxdist's strategies, ``export_model`` and ``python -m jaxdist.keras``,
in the pytest process: the fast lane's Keras checks (the full parity matrix runs in subprocesses: test_keras_ps.py,
test_keras_fit.py, test_keras_export.py).

``import jaxdist.keras`` selects Keras's JAX backend before Keras loads, so Keras can run here. Each check
trains a small model under a strategy and the same model with plain Keras from the same initial weights,
and compares weights, logs and outputs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import runpy
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

import jax  # noqa: E402
import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402  (before keras: selects the JAX backend)
import keras  # noqa: E402
from jaxdist.keras import compat  # noqa: E402
from jaxdist.testing import InProcessCluster  # noqa: E402
from keras_util import SMALL_BATCH, BatchList, small_classification, small_mlp  # noqa: E402

pytestmark = [
    pytest.mark.timeout(240),
    # Keras 3.15's own Variable.numpy() (np.array(self)) meets numpy 2's copy-keyword deprecation: Keras's
    # warning, not jaxdist's (the subprocess checks run without warnings-as-errors).
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]

BATCH = SMALL_BATCH


def _data() -> tuple[np.ndarray, np.ndarray]:
    return small_classification(seed=3)


def _model() -> Any:
    return small_mlp(metrics=["accuracy"])


def _reference(initial: list[np.ndarray], x: np.ndarray, y: np.ndarray, epochs: int) -> tuple[Any, Any]:
    ref = _model()
    ref.set_weights(initial)
    hist = ref.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return ref, hist


def _served(artifact: Path, x: np.ndarray) -> np.ndarray:
    """The predictions of a ``format="jax"`` artifact, loaded as docs/export.md shows (no Keras, no jaxdist)."""
    manifest = json.loads((artifact / "manifest.json").read_text())
    exported = jax.export.deserialize(bytearray((artifact / manifest["exported_file"]).read_bytes()))
    with np.load(artifact / manifest["weights_file"]) as npz:
        weights = [npz[w["key"]] for w in manifest["weights"]]
    return np.asarray(exported.call(weights, x))


def test_fit_evaluate_predict_export_on_parameter_servers_match_keras(tmp_path: Path) -> None:
    """fit, evaluate and predict equal plain Keras's; both exports (written while the PS hold the trained
    weights: export_model pulls them) predict as the trained model does."""
    x, y = _data()
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(),
                                                   variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            with strategy.scope():
                model = _model()
            initial = model.get_weights()
            hist = model.fit(jaxdist.keras.DatasetCreator(BatchList(x, y)), epochs=2, steps_per_epoch=4, verbose=0)
            got = model.get_weights()
            evaluated = model.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
            predicted = model.predict(x, batch_size=BATCH, verbose=0)
            assert int(model.optimizer.iterations.numpy()) == 8
            artifact = jaxdist.keras.export_model(model, tmp_path / "served", format="jax")
            saved = jaxdist.keras.export_model(model, tmp_path / "model.keras")
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
    assert sorted(p.name for p in artifact.iterdir()) == ["manifest.json", "model.jaxexport", "weights.npz"]
    np.testing.assert_allclose(_served(artifact, x), predicted, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(keras.saving.load_model(saved).predict(x, batch_size=BATCH, verbose=0), predicted,
                               rtol=1e-5, atol=1e-6)


#: The synchronous strategies on the devices this process has (the 8-device matrix: test_keras_fit.py).
SYNC_STRATEGIES: dict[str, Callable[[], Any]] = {
    "one_device": lambda: jaxdist.sync.OneDeviceStrategy("cpu:0"),
    "mirrored": lambda: jaxdist.sync.MirroredStrategy(),
}


@pytest.mark.parametrize("name", sorted(SYNC_STRATEGIES))
def test_fit_evaluate_predict_on_sync_strategies_match_keras(name: str) -> None:
    x, y = _data()
    strategy = SYNC_STRATEGIES[name]()
    replicas = jax.local_device_count() if name == "mirrored" else 1
    assert strategy.num_replicas_in_sync == replicas
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


def _main(*argv: str) -> tuple[int, str, str]:
    """``python -m jaxdist.keras *argv`` in this process: its exit status, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    saved_argv = sys.argv
    sys.argv = ["jaxdist.keras", *argv]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exited:
            runpy.run_module("jaxdist.keras", run_name="__main__", alter_sys=True)
    finally:
        sys.argv = saved_argv
    code = exited.value.code
    return (code if isinstance(code, int) else 1), out.getvalue(), err.getvalue()


def test_python_m_jaxdist_keras_checks_the_installed_keras_and_prints_the_table() -> None:
    """The entry point: no argument checks the installed Keras (exit 0, one summary line); ``--table`` prints
    the registry's table (the one docs/keras-internals.md holds); anything else is a usage error (exit 2)."""
    code, out, _ = _main()
    assert code == 0, out
    assert out.startswith(f"Keras {keras.__version__}: {len(compat.INTERNALS)} internals"), out
    assert out.rstrip().endswith("; 0 changed"), out
    code, out, _ = _main("--table")
    page = (Path(__file__).resolve().parents[2] / "docs" / "keras-internals.md").read_text()
    begin, end = "<!-- BEGIN generated: python -m jaxdist.keras --table -->\n", "\n<!-- END generated -->"
    assert code == 0 and out == page.split(begin, 1)[1].split(end, 1)[0].strip("\n") + "\n"
    assert "`keras.src.backend.jax.trainer.JAXTrainer.fit`" in out
    code, _, err = _main("--tabel")
    assert code == 2 and err == "usage: python -m jaxdist.keras [--table]\n"
