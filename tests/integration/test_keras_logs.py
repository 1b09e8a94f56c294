"""Keras's progress bar, History, CSVLogger and jaxdist.keras.TensorBoard on a jaxdist strategy (8 fake devices).

The event files are read back here with tensorboardX's own protobuf messages
and the TFRecord framing TensorBoard reads, so a tag or step that TensorBoard
would not see fails the test. Runs in one subprocess (see device_checks.py).
"""

from __future__ import annotations

import importlib.util
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from device_checks import DeviceChecks, assert_passed
from keras_util import import_jaxdist_keras

if importlib.util.find_spec("keras") is None or importlib.util.find_spec("tensorboardX") is None:
    pytest.skip("needs the keras and tensorboard extras: pip install 'jaxdist[keras,tensorboard]'", allow_module_level=True)


CHECKS = DeviceChecks(__file__, "KERAS_LOGS_RESULTS=", timeout=300, setup=import_jaxdist_keras)
check = CHECKS.check

ROWS, GBS, EPOCHS = 100, 32, 3  # 4 batches an epoch, the last one short (4 rows)


def _records(path: Path) -> Iterator[bytes]:
    """The records of one TFRecord file (length, its CRC, data, its CRC)."""
    data = path.read_bytes()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        pos += 12
        yield data[pos : pos + length]
        pos += length + 4


def _events(log_dir: Path) -> dict[str, list[tuple[int, Any]]]:
    """{tag: [(step, simple_value or histogram)]} of every event file under ``log_dir``."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, Any]]] = {}
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        for record in _records(path):
            event = Event.FromString(record)
            for value in event.summary.value:
                got = value.histo if value.HasField("histo") else value.simple_value
                out.setdefault(value.tag, []).append((event.step, got))
    return out


def _fit(log_dir: Path, **tensorboard: Any) -> tuple[Any, Any, str]:
    import contextlib
    import io

    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras

    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    keras.utils.set_random_seed(0)
    strategy = jaxdist.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
        model.compile(optimizer=keras.optimizers.SGD(0.05),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    log_dir.mkdir(parents=True, exist_ok=True)
    callbacks = [jaxdist.keras.TensorBoard(str(log_dir), **tensorboard),
                 keras.callbacks.CSVLogger(str(log_dir / "log.csv"))]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        history = model.fit(x, y, batch_size=GBS, epochs=EPOCHS, validation_data=(x[:40], y[:40]),
                            callbacks=callbacks, verbose=1)
    return model, history, out.getvalue()


@check
def mirrored_fit_writes_progress_history_csv_and_tensorboard() -> None:
    import csv
    import tempfile

    import numpy as np

    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        _, history, printed = _fit(log_dir, update_freq=2, histogram_freq=1, write_steps_per_second=True)
        h = history.history
        # Keras's own progress bar ran, with its time per step (the throughput line).
        assert "Epoch 3/3" in printed and "/step" in printed, printed[-2000:]
        assert len(h["loss"]) == EPOCHS and len(h["val_loss"]) == EPOCHS
        # CSVLogger: one row per epoch, the History's values.
        rows = list(csv.DictReader((log_dir / "log.csv").open()))
        assert [int(r["epoch"]) for r in rows] == list(range(EPOCHS))
        np.testing.assert_allclose([float(r["loss"]) for r in rows], h["loss"], rtol=1e-6)
        np.testing.assert_allclose([float(r["val_accuracy"]) for r in rows], h["val_accuracy"], rtol=1e-6)
        train, val = _events(log_dir / "train"), _events(log_dir / "validation")
        # Per epoch: the History's values at steps 0..2, validation without the val_ prefix.
        for tag, key, events in (("epoch_loss", "loss", train), ("epoch_accuracy", "accuracy", train),
                                 ("epoch_loss", "val_loss", val), ("epoch_accuracy", "val_accuracy", val)):
            assert [s for s, _ in events[tag]] == list(range(EPOCHS)), (tag, events.get(tag))
            np.testing.assert_allclose([v for _, v in events[tag]], h[key], rtol=1e-6)
        np.testing.assert_allclose([v for _, v in train["epoch_learning_rate"]], [0.05] * EPOCHS, rtol=1e-6)
        assert all(v > 0 for _, v in train["epoch_steps_per_second"])
        # Per batch every 2nd of the 12 batches, counted from the start of fit.
        assert [s for s, _ in train["batch_loss"]] == [2, 4, 6, 8, 10, 12]
        assert [s for s, _ in train["batch_steps_per_second"]] == [2, 4, 6, 8, 10, 12]
        # A histogram of every weight every epoch (2 kernels + 2 biases).
        histograms = {t: e for t, e in train.items() if t.endswith("/histogram")}
        assert len(histograms) == 4, sorted(train)
        for tag, events in histograms.items():
            assert [s for s, _ in events] == list(range(EPOCHS)), tag
            assert all(hist.num > 0 for _, hist in events)
        # Every evaluation at the optimizer's iteration count (4 steps an epoch), as Keras's callback.
        assert [s for s, _ in val["evaluation_loss_vs_iterations"]] == [4, 8, 12]


@check
def standalone_evaluate_writes_and_closes_its_writers() -> None:
    import tempfile
    import threading

    import numpy as np

    import jaxdist.keras

    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        model, _, _ = _fit(log_dir / "fit")
        before = set(threading.enumerate())
        rng = np.random.default_rng(1)
        x = rng.normal(size=(40, 6)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int32)
        result = model.evaluate(x, y, batch_size=GBS, callbacks=[jaxdist.keras.TensorBoard(str(log_dir / "eval"))],
                                return_dict=True, verbose=0)
        val = _events(log_dir / "eval" / "validation")
        assert [s for s, _ in val["evaluation_loss_vs_iterations"]] == [4 * EPOCHS]
        np.testing.assert_allclose(val["evaluation_loss_vs_iterations"][0][1], result["loss"], rtol=1e-6)
        # The writers' threads ended with the evaluation (nothing else would close them). A closed writer's
        # multiprocessing queue ends its feeder thread when the queue is collected: collect while waiting.
        import gc

        from jaxdist.testing import poll_for

        def ended() -> bool:
            gc.collect()
            return not [t for t in set(threading.enumerate()) - before if t.is_alive()]

        poll_for(ended, 30, what="the TensorBoard writers' threads to end")


@check
def profile_batch_writes_a_jax_trace() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        _fit(log_dir, profile_batch=(2, 3))
        traces = list((log_dir / "plugins" / "profile").rglob("*.xplane.pb"))
        assert len(traces) == 1 and traces[0].stat().st_size > 0, traces


@check
def what_needs_tensorflow_is_refused_not_ignored() -> None:
    import jaxdist.keras

    for kwargs, error in (({"write_graph": True}, NotImplementedError), ({"write_images": True}, NotImplementedError),
                          ({"embeddings_freq": 1}, NotImplementedError),
                          ({"embeddings_metadata": {"e": "m.tsv"}}, NotImplementedError),
                          ({"update_freq": 0}, ValueError), ({"update_freq": "step"}, ValueError),
                          ({"histogram_freq": -1}, ValueError), ({"profile_batch": (3, 1)}, ValueError),
                          ({"profile_batch": "a,b"}, ValueError), ({"profile_batch": (0, 2)}, ValueError)):
        try:
            jaxdist.keras.TensorBoard("unused", **kwargs)
        except error:
            continue
        raise AssertionError(f"TensorBoard({kwargs}) did not raise {error.__name__}")


check_results = CHECKS.results_fixture()


@pytest.mark.slow
@pytest.mark.timeout(360)
@pytest.mark.parametrize("name", CHECKS.names())
def test_keras_logs_on_8_fake_devices(name: str, check_results: dict[str, str | None]) -> None:
    assert_passed(check_results, name)


if __name__ == "__main__":
    CHECKS.main()
