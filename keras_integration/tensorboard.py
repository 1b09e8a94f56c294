"""A TensorBoard callback for Keras 3 on JAX that needs no TensorFlow.

Keras's own ``keras.callbacks.TensorBoard`` writes through ``tf.summary`` and
fails without TensorFlow, which a jaxdist job does not have. This one writes
the same event files (TensorBoard reads them unchanged) through
``tensorboardX`` (the ``jaxdist[tensorboard]`` extra): a small pure-Python
writer of TensorBoard's event format whose only dependencies (numpy, protobuf)
jaxdist already has.

Same constructor, same layout and tags as Keras's callback, so a TF user's
dashboards keep working:

- ``<log_dir>/train`` and ``<log_dir>/validation``;
- per epoch ``epoch_<metric>`` (and ``epoch_learning_rate``), validation
  metrics without their ``val_`` prefix in ``validation``;
- ``update_freq="batch"`` or ``N``: ``batch_<metric>`` every N-th batch, the
  step counting batches since ``fit`` began;
- ``write_steps_per_second``: ``epoch_steps_per_second`` and
  ``batch_steps_per_second``;
- ``histogram_freq=N``: a histogram of every weight every N-th epoch;
- a standalone ``evaluate`` writes ``evaluation_<metric>_vs_iterations`` at
  the optimizer's iteration count;
- ``profile_batch=(start, stop)``: a JAX profiler trace of those batches in
  ``<log_dir>/plugins/profile`` (``jax.profiler``, which TensorBoard's profile
  plugin reads).

Not available without TensorFlow, and refused rather than ignored:
``write_graph=True`` (Keras's default: here the default is ``False``),
``write_images=True``, ``embeddings_freq`` / ``embeddings_metadata``.

Only process 0 writes under ``MultiWorkerMirroredStrategy`` (every process
sees the same, globally reduced logs; TF's callback wrote the other processes'
copies to temporary directories and deleted them).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import jax
import numpy as np

import keras

logger = logging.getLogger(__name__)

__all__ = ["TensorBoard"]


def _summary_writer() -> Any:
    try:
        from tensorboardX import SummaryWriter
    except ImportError:  # pragma: no cover - depends on the install
        raise ImportError(
            "jaxdist.keras.TensorBoard writes TensorBoard event files through tensorboardX: "
            "pip install 'jaxdist[tensorboard]'"
        ) from None
    return SummaryWriter


def _profile_range(profile_batch: Any) -> tuple[int, int]:
    """Keras's forms: 0 (off), N, (start, stop) or "start,stop"; batches count from 1."""
    value = profile_batch
    if isinstance(value, str):
        try:
            value = [int(p) for p in value.split(",")]
        except ValueError:
            value = None
        if value is not None and len(value) == 1:
            value = value[0]
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        start = stop = int(value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, (int, np.integer)) for v in value):
        start, stop = int(value[0]), int(value[1])
    else:
        start, stop = -1, -1
    if start < 0 or stop < start or (start == 0) != (stop == 0):
        raise ValueError(
            f"profile_batch must be a non-negative integer or a 2-tuple of positive integers (start, stop), got {profile_batch!r}"
        )
    return start, stop


class TensorBoard(keras.callbacks.Callback):
    """Keras's ``TensorBoard`` callback contract, written without TensorFlow (see the module docstring).

    Args:
        log_dir: where the ``train`` and ``validation`` event directories go.
        histogram_freq: write a histogram of every weight every this many epochs (0: never).
        write_graph: must be False (a Keras graph summary needs TensorFlow).
        write_images: must be False.
        write_steps_per_second: also log training steps per second.
        update_freq: ``"epoch"``, ``"batch"`` (every batch) or an int N (every N-th batch).
        profile_batch: batches to trace with the JAX profiler: 0 (none), N, or (start, stop).
        embeddings_freq: must be 0.
        embeddings_metadata: must be None.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str] = "logs",
        histogram_freq: int = 0,
        write_graph: bool = False,
        write_images: bool = False,
        write_steps_per_second: bool = False,
        update_freq: str | int = "epoch",
        profile_batch: Any = 0,
        embeddings_freq: int = 0,
        embeddings_metadata: Any = None,
    ) -> None:
        super().__init__()
        if write_graph:
            raise NotImplementedError("jaxdist.keras.TensorBoard(write_graph=True): writing a Keras graph summary "
                                      "needs TensorFlow; use write_graph=False")
        if write_images:
            raise NotImplementedError("jaxdist.keras.TensorBoard(write_images=True) is not supported; "
                                      "histogram_freq writes the weights as histograms")
        if embeddings_freq or embeddings_metadata is not None:
            raise NotImplementedError("jaxdist.keras.TensorBoard: embeddings_freq / embeddings_metadata (the "
                                      "projector plugin) are not supported")
        if isinstance(histogram_freq, bool) or not isinstance(histogram_freq, int) or histogram_freq < 0:
            raise ValueError(f"histogram_freq must be a non-negative int, got {histogram_freq!r}")
        if update_freq == "batch":
            update_freq = 1
        if update_freq != "epoch" and (isinstance(update_freq, bool) or not isinstance(update_freq, int) or update_freq < 1):
            raise ValueError(f"update_freq must be 'epoch', 'batch' or a positive int, got {update_freq!r}")
        self.log_dir = os.fspath(log_dir)
        self.histogram_freq = histogram_freq
        self.write_steps_per_second = write_steps_per_second
        self.update_freq = update_freq
        self._start_batch, self._stop_batch = _profile_range(profile_batch)
        self._writers: dict[str, Any] = {}
        self._global_train_batch = 0
        self._batch_start = 0.0
        self._epoch_start = 0.0
        self._epoch_iterations = 0
        self._tracing = False
        self._in_fit = False

    # -- writers ----------------------------------------------------------------------------------

    @property
    def _writes(self) -> bool:
        return jax.process_index() == 0

    def _writer(self, which: str) -> Any:
        if which not in self._writers:
            self._writers[which] = _summary_writer()(os.path.join(self.log_dir, which))
        return self._writers[which]

    def _scalars(self, which: str, prefix: str, logs: dict[str, Any] | None, step: int) -> None:
        if not self._writes or not logs:
            return
        writer = self._writer(which)
        for name, value in logs.items():
            scalar = np.asarray(value)
            if scalar.size == 1 and np.issubdtype(scalar.dtype, np.number):
                writer.add_scalar(f"{prefix}{name}", float(scalar.reshape(())), step)

    def _close(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers.clear()

    def _iterations(self) -> int:
        optimizer = getattr(self.model, "optimizer", None)
        return int(np.asarray(optimizer.iterations)) if optimizer is not None else 0

    def _learning_rates(self) -> dict[str, float]:
        optimizer = getattr(self.model, "optimizer", None)
        optimizer = getattr(optimizer, "inner_optimizer", optimizer)  # LossScaleOptimizer
        if optimizer is None:
            return {}
        if hasattr(optimizer, "optimizers"):
            return {f"learning_rate_{o.name}": float(np.asarray(o.learning_rate)) for o in optimizer.optimizers}
        if isinstance(optimizer, keras.optimizers.Optimizer):
            return {"learning_rate": float(np.asarray(optimizer.learning_rate))}
        return {}

    # -- training ---------------------------------------------------------------------------------

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        self._global_train_batch = 0
        self._in_fit = True

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if self.write_steps_per_second:
            self._epoch_iterations = self._iterations()
            self._epoch_start = time.perf_counter()

    def on_train_batch_begin(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        self._global_train_batch += 1
        if self.write_steps_per_second:
            self._batch_start = time.perf_counter()
        if self._start_batch and self._global_train_batch == self._start_batch and self._writes:
            jax.profiler.start_trace(self.log_dir)
            self._tracing = True

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        step = self._global_train_batch
        if self.update_freq != "epoch" and step % int(self.update_freq) == 0:
            values = dict(logs or {})
            if self.write_steps_per_second:
                values["steps_per_second"] = 1.0 / max(time.perf_counter() - self._batch_start, 1e-9)
            self._scalars("train", "batch_", values, step)
        if self._tracing and step >= self._stop_batch:
            self._stop_trace()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        logs = dict(logs or {})
        train = {k: v for k, v in logs.items() if not k.startswith("val_")}
        val = {k[len("val_"):]: v for k, v in logs.items() if k.startswith("val_")}
        train.update(self._learning_rates())
        if self.write_steps_per_second:
            elapsed = max(time.perf_counter() - self._epoch_start, 1e-9)
            train["steps_per_second"] = (self._iterations() - self._epoch_iterations) / elapsed
        self._scalars("train", "epoch_", train, epoch)
        self._scalars("validation", "epoch_", val, epoch)
        if self.histogram_freq and epoch % self.histogram_freq == 0 and self._writes:
            writer = self._writer("train")
            for weight in self.model.weights:
                writer.add_histogram(f"{weight.path.replace(':', '_')}/histogram", np.asarray(weight), epoch)
        for writer in self._writers.values():
            writer.flush()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        self._in_fit = False
        if self._tracing:
            self._stop_trace()
        self._close()

    def _stop_trace(self) -> None:
        jax.profiler.stop_trace()
        self._tracing = False

    # -- evaluation -------------------------------------------------------------------------------

    def on_test_end(self, logs: dict[str, Any] | None = None) -> None:
        # As Keras's callback: every evaluation (fit's validation too) at the optimizer's iteration count.
        if getattr(self.model, "optimizer", None) is not None:
            self._scalars("validation", "evaluation_", {f"{k}_vs_iterations": v for k, v in (logs or {}).items()},
                          self._iterations())
        if self._in_fit:
            for writer in self._writers.values():
                writer.flush()
        else:
            self._close()  # a standalone evaluate: nothing else will close the writers
