"""``SidecarEvaluator``: TF's sidecar evaluation contract for Keras 3 models on JAX.

The evaluator is its own task (TF_CONFIG ``{"task": {"type": "evaluator", ...}}``,
which jaxdist's resolvers accept) running the training script's model definition:
it watches the directory where training writes checkpoints, loads each new one into
its model and evaluates it, while training goes on elsewhere. As in TF:

- checkpoints are the files ``keras.callbacks.ModelCheckpoint`` writes with
  ``filepath=os.path.join(checkpoint_dir, "ckpt-{epoch}.weights.h5")`` and
  ``save_weights_only=True``: weights with the optimizer's state (its iteration
  count is logged with the metrics);
- only the newest checkpoint is evaluated when several appeared since the last
  evaluation;
- a checkpoint that cannot be read yet (training is still writing it) is tried
  again at the next poll;
- ``max_evaluations=N`` stops after evaluating the checkpoint numbered ``N`` or
  later (TF compares the number at the end of the checkpoint's name);
- ``callbacks`` go to ``model.evaluate`` (e.g. ``jaxdist.keras.TensorBoard``,
  which writes ``evaluation_<metric>_vs_iterations`` at the optimizer's step).

Added: ``timeout`` (TF waits for a new checkpoint forever, as ``timeout=None``
does here) and ``results``, each evaluated checkpoint's metrics.
"""

from __future__ import annotations

import logging
import os
import re
import time
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

__all__ = ["SidecarEvaluator"]

_CHECKPOINT = re.compile(r"^(?P<stem>.*-(?P<number>\d+))\.weights\.h5$")


class SidecarEvaluator:
    """Evaluate each new checkpoint in ``checkpoint_dir`` with ``model`` (TF's ``tf.keras.utils.SidecarEvaluator``).

    Args:
        model: a compiled Keras model with the training model's architecture (and optimizer, to
            read its iteration count).
        data: an ``(x, y)`` or ``(x, y, sample_weight)`` tuple of arrays, or what ``model.evaluate`` takes as
            its input (a generator or ``PyDataset`` of batches, ``jaxdist.keras.Batches``).
        checkpoint_dir: where training's ``ModelCheckpoint`` writes ``<name>-<number>.weights.h5``.
        steps: ``model.evaluate``'s ``steps`` (None: the whole ``data``).
        max_evaluations: stop after the checkpoint numbered this or higher (None: never).
        callbacks: passed to ``model.evaluate``.
        poll_interval: seconds between looks at ``checkpoint_dir``.
        timeout: stop when no new checkpoint appeared for this many seconds (None: wait forever).
    """

    def __init__(self, model: Any, data: Any, checkpoint_dir: str | os.PathLike[str], steps: int | None = None,
                 max_evaluations: int | None = None, callbacks: list[Any] | None = None,
                 poll_interval: float = 1.0, timeout: float | None = None) -> None:
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise ValueError(f"SidecarEvaluator: steps must be a positive int or None, got {steps!r}")
        if max_evaluations is not None and (isinstance(max_evaluations, bool) or not isinstance(max_evaluations, int)
                                            or max_evaluations < 1):
            raise ValueError(f"SidecarEvaluator: max_evaluations must be a positive int or None, got {max_evaluations!r}")
        if poll_interval <= 0 or (timeout is not None and timeout <= 0):
            raise ValueError("SidecarEvaluator: poll_interval and timeout must be positive")
        self.model, self.data, self.steps = model, data, steps
        # TF's `data` is a dataset of (x, y) batches; here arrays come as an (x, y[, sample_weight]) tuple
        # (evaluate's own arguments), anything else (a generator, a PyDataset, Batches) as evaluate's x.
        self._data: tuple[Any, ...] = tuple(data) if isinstance(data, tuple) and len(data) in (2, 3) else (data,)
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.max_evaluations, self.callbacks = max_evaluations, list(callbacks or [])
        self.poll_interval, self.timeout = poll_interval, timeout
        #: {checkpoint number: the metrics ``evaluate`` returned for it}, in evaluation order.
        self.results: dict[int, dict[str, float]] = {}

    def _newest(self) -> tuple[int, str] | None:
        try:
            names = os.listdir(self.checkpoint_dir)
        except FileNotFoundError:
            return None  # training has not made it yet
        found = [(int(m["number"]), os.path.join(self.checkpoint_dir, name))
                 for name in names if (m := _CHECKPOINT.match(name)) is not None]
        return max(found) if found else None

    def start(self) -> None:
        """Evaluate checkpoints as they appear until ``max_evaluations`` or ``timeout`` (see the class docstring)."""
        last = -1
        waiting_since = time.monotonic()
        while True:
            newest = self._newest()
            if newest is None or newest[0] <= last:
                if self.timeout is not None and time.monotonic() - waiting_since > self.timeout:
                    logger.info("no new checkpoint in %s for %.0f s: SidecarEvaluator stops", self.checkpoint_dir,
                                self.timeout)
                    return
                time.sleep(self.poll_interval)
                continue
            number, path = newest
            if not self._load(path):
                time.sleep(self.poll_interval)  # being written: the next poll tries again (or a newer one)
                continue
            last, waiting_since = number, time.monotonic()
            logger.info("evaluation starts: model weights loaded from %s", path)
            metrics = self.model.evaluate(*self._data, steps=self.steps, callbacks=self.callbacks, verbose=2,
                                          return_dict=True)
            self.results[number] = {k: float(np.asarray(v)) for k, v in metrics.items()}
            logger.info("end of evaluation of %s (optimizer step %s). Metrics: %s", path, self._iterations(),
                        " ".join(f"{k}={v}" for k, v in self.results[number].items()))
            if self.max_evaluations is not None and number >= self.max_evaluations:
                logger.info("last checkpoint evaluated: SidecarEvaluator stops")
                return

    def _load(self, path: str) -> bool:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None and not optimizer.built:
            optimizer.build(self.model.trainable_variables)  # its state is in the file: build it to load it
        try:
            self.model.load_weights(path)
        except (OSError, ValueError, KeyError) as e:  # h5py: truncated or half-written file
            logger.info("cannot read %s yet (%s: %s); trying again", path, type(e).__name__, e)
            return False
        return True

    def _iterations(self) -> int | None:
        optimizer = getattr(self.model, "optimizer", None)
        return None if optimizer is None else int(np.asarray(optimizer.iterations))
