"""``BackupAndRestore`` that resumes mid-epoch, as tf.keras did and Keras 3 does not.

Keras 3's ``keras.callbacks.BackupAndRestore`` writes the batch it stopped at
but never reads it: a run killed mid-epoch restarts that epoch from its first
batch, training the batches before the backup twice. tf.keras resumed at the batch. This
callback keeps Keras's constructor and adds what resuming at the batch needs:

- **What a backup holds**: the model's weights with the optimizer's state
  (``model.save_weights``: the iteration count too), the metric variables (so
  the resumed epoch's metrics cover the whole epoch), the epoch and the batches
  of it already trained.
- **Atomic**: each backup is written under a new name and published by
  replacing ``latest.json``; a process killed while writing leaves the previous
  backup in place. Older backups are removed once the new one is published.
- **Resuming**: ``fit`` starts at the backed-up epoch, and the first
  ``batch`` batches of that epoch are read from the input and not trained (the
  batch callbacks still see them, so step counts and the progress bar match an
  uninterrupted run). With a deterministic model and input (no shuffling, or
  an input that yields the same batches each epoch) the run ends with the
  weights of an uninterrupted run.
- ``save_freq``: ``"epoch"``, or every N batches (an epoch end is always a
  backup too, so a resumed run never re-reads a finished epoch).
- ``delete_checkpoint``: remove ``backup_dir`` when ``fit`` finishes.
- Keras's callback leaves the model's initial epoch set after ``fit``, so a
  later ``fit`` on the same model skips epochs; this one clears it.

Synchronous strategies, ``MultiWorkerMirroredStrategy`` across processes
included: process 0 writes the backups and every process reads them, so
``backup_dir`` must be a directory every process sees (shared storage).

``ParameterServerStrategy``: the model's state lives on the parameter servers,
so a backup is a :class:`jaxdist.Checkpoint` of the model's PS variables
(optimizer state and step counter included) and of its dynamic tables
(:class:`jaxdist.keras.layers.DynamicEmbedding`) taken at a quiet point: ``fit``
waits for every step scheduled so far to be applied and counted before the
backup (:class:`jaxdist.keras.ps_fit.FitControl`), so the backup holds exactly
the steps it names. A re-run (the coordinator script started again, against
fresh or surviving parameter servers) restores those variables into the PS
and skips the resumed epoch's trained steps by reading their batches on a
worker. With one worker (or a ``dataset_fn`` whose batches do not depend on
which worker reads them) and a deterministic model the re-run ends with the
weights of an uninterrupted run; with several workers the steps are applied
in the order they arrive, as in any asynchronous run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from typing import Any

import jax
import numpy as np

import keras

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.files import AtomicFile
from jaxdist.checkpoint import Checkpoint
from jaxdist.keras import compat
from jaxdist.keras.distribution import StrategyDistribution
from jaxdist.keras.ps_fit import FitControl
from jaxdist.keras.ps_model import PSDistribution, PSModel, ps_model

logger = logging.getLogger(__name__)

__all__ = ["BackupAndRestore"]

_LATEST = "latest.json"


class BackupAndRestore(keras.callbacks.Callback, FitControl):
    """Back up training state every epoch or every ``save_freq`` batches; resume from it at that batch.

    Args:
        backup_dir: where backups go; the same directory in the re-run resumes from it.
        save_freq: ``"epoch"`` or a positive int (batches).
        double_checkpoint: accepted for Keras's signature; every backup here is already kept until its
            successor is complete, so ``False`` and ``True`` behave the same (a torn backup is never read).
        delete_checkpoint: remove ``backup_dir`` when ``fit`` ends normally.
    """

    def __init__(self, backup_dir: str | os.PathLike[str], save_freq: str | int = "epoch",
                 double_checkpoint: bool = False, delete_checkpoint: bool = True) -> None:
        super().__init__()
        if not backup_dir:
            raise ValueError("BackupAndRestore: backup_dir is required")
        if save_freq != "epoch" and (isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1):
            raise ValueError(f"BackupAndRestore: save_freq must be 'epoch' or a positive int, got {save_freq!r}")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = bool(double_checkpoint)
        self.delete_checkpoint = delete_checkpoint
        self._writer = True
        self._epoch = 0
        self._batches_done = 0  # batches of the current epoch trained (or skipped on resume)
        self._since_save = 0
        self._serial = 0
        self._resume_metrics: list[np.ndarray] | None = None
        self._skip = 0
        self._skipped_call = False
        self._ps: PSModel | None = None  # the model's PS state, under ParameterServerStrategy

    # -- files ------------------------------------------------------------------------------------

    def _path(self, name: str) -> str:
        return os.path.join(self.backup_dir, name)

    def _latest(self) -> dict[str, Any] | None:
        try:
            with open(self._path(_LATEST)) as f:
                latest: dict[str, Any] = json.load(f)
        except FileNotFoundError:
            return None
        return latest

    def _save(self) -> None:
        if self._writer:
            self._save_into(self.backup_dir)
            return
        # Reading a multi-process array can be a collective: every process makes the backup (TF's non-chief
        # workers did too), the others into a temporary directory they then remove.
        scratch = tempfile.mkdtemp(prefix="jaxdist-backup-")
        try:
            self._save_into(scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _save_into(self, directory: str) -> None:
        model = self.model  # Callback.model syncs the JAX state onto the model's variables first
        os.makedirs(directory, exist_ok=True)
        self._serial += 1
        stem = f"backup-{self._serial}"
        if self._ps is not None:
            # fit made this a quiet point: the PS holds exactly the steps trained so far.
            ckpt = Checkpoint(self._ps.strategy)
            ckpt.step = self._ps.steps_applied()
            ckpt.write(os.path.join(directory, f"{stem}.ckpt"))
        else:
            model.save_weights(os.path.join(directory, f"{stem}.weights.h5"), overwrite=True)
        metrics = {f"m{i}": np.asarray(v.value) for i, v in enumerate(model.metrics_variables)}
        with AtomicFile(os.path.join(directory, f"{stem}.metrics.npz")) as f:
            np.savez(f, **metrics)  # type: ignore[arg-type]
        record = {"serial": self._serial, "stem": stem, "epoch": self._epoch, "batch": self._batches_done}
        with AtomicFile(os.path.join(directory, _LATEST), text=True) as f:
            json.dump(record, f)  # the backup exists once this file is in place
        for name in os.listdir(directory):
            if name.startswith("backup-") and not name.startswith(f"{stem}."):
                old = os.path.join(directory, name)
                if os.path.isdir(old):
                    shutil.rmtree(old)
                else:
                    os.remove(old)
        self._since_save = 0

    # -- fit --------------------------------------------------------------------------------------

    def on_train_begin(self, logs: dict[str, Any] | None = None) -> None:
        dist = keras.distribution.distribution()  # fit runs under the model's strategy's distribution
        if dist is not None and not isinstance(dist, (StrategyDistribution, PSDistribution)):
            raise NotImplementedError(
                "jaxdist.keras.BackupAndRestore supports jaxdist's strategies; "
                f"not {type(getattr(dist, 'strategy', dist)).__name__}"
            )
        # Under ParameterServerStrategy, fit made the model's PS state before on_train_begin.
        self._ps = ps_model(self.model) if isinstance(dist, PSDistribution) else None
        # Every process of a multi-process strategy holds the same (replicated) state: process 0 writes the
        # backups, every process reads them (backup_dir must be one directory all of them see).
        self._writer = jax.process_index() == 0
        self._epoch, self._batches_done, self._since_save, self._skip = 0, 0, 0, 0
        self._resume_metrics = None
        latest = self._latest()
        if isinstance(dist, StrategyDistribution) and dist.multi_process:
            self._check_every_process_sees(latest)
        if latest is None:
            return
        model = self.model
        if not model.built:
            raise ValueError("BackupAndRestore: build the model (call it on a batch, or give keras.Input) before fit")
        if model.optimizer is not None and not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)
        stem = latest["stem"]
        if self._ps is not None:
            self._restore_ps(self._ps, self._path(f"{stem}.ckpt"))
        else:
            model.load_weights(self._path(f"{stem}.weights.h5"))
        self._serial = int(latest["serial"])
        self._epoch, self._skip = int(latest["epoch"]), int(latest["batch"])
        if self._skip:
            # Only a mid-epoch backup's metrics are the resumed epoch's partial sums (at an epoch's end they may be
            # the validation's, and a new epoch starts from the reset values anyway).
            with np.load(self._path(f"{stem}.metrics.npz")) as saved:
                self._resume_metrics = [saved[f"m{i}"] for i in range(len(saved.files))]
        # Keras's fit reads its first epoch from here after on_train_begin (its own callback sets it too).
        compat.set_initial_epoch(model, self._epoch)
        if self._skip and self._ps is None:
            self._skip_trained_batches(model)  # read through the batch callbacks, which count them
        elif self._skip:
            # fit under ParameterServerStrategy asks ps_resume_step and starts the epoch there (no batch callbacks
            # for the trained steps).
            self._batches_done = self._skip
        logger.info("resuming from %s: epoch %d, batch %d", self._path(stem), self._epoch, self._skip)

    def _restore_ps(self, pm: PSModel, path: str) -> None:
        """Restore the model's PS variables (values, optimizer state, step counter) and dynamic tables (keys, rows,
        optimizer state, counters) from backup ``path``."""
        names = [v.name for v in pm.trainable + pm.non_trainable + [pm.iterations]] + [d.table.name for d in pm.dynamic]
        try:
            Checkpoint(pm.strategy).restore(path, variables=names)
        except ConfigurationError as e:
            raise ConfigurationError(f"BackupAndRestore: the backup in {self.backup_dir!r} is not of this model "
                                     f"(same model, built the same way, as the interrupted run?): {e}") from e
        pm.sync()  # the coordinator's Keras variables and optimizer.iterations follow

    # -- what fit under ParameterServerStrategy asks (FitControl) ----------------------------------

    def ps_resume_step(self) -> int:
        return self._skip if self._ps is not None else 0

    def ps_wants_quiet_point(self, epoch: int, steps_done: int) -> bool:
        if self.save_freq == "epoch":
            return False
        return self._since_save + (steps_done - self._batches_done) >= int(self.save_freq)

    def _check_every_process_sees(self, latest: dict[str, Any] | None) -> None:
        """Every process must resume from the same backup (process 0's): else their steps would differ
        and the job would hang in its first collective."""
        from jax.experimental import multihost_utils

        serial = -1 if latest is None else int(latest["serial"])
        seen = np.asarray(multihost_utils.process_allgather(np.array([serial], np.int64))).ravel().tolist()
        if len(set(seen)) > 1:
            raise ConfigurationError(
                f"BackupAndRestore: the processes see different backups in {self.backup_dir!r} (serial per process, "
                f"-1 for none: {seen}); backup_dir must be one directory every process reads (shared storage)"
            )

    def _skip_trained_batches(self, model: Any) -> None:
        """Wrap the train function so its first calls read their batches without training them."""
        train = compat.step_function(model, "train")
        per_call = max(1, int(model.steps_per_execution))

        def train_function(state: Any, iterator: Any) -> Any:
            if self._skip <= 0:
                compat.set_step_function(model, "train", train)  # done skipping: Keras's own function from now on
                return train(state, iterator)
            for _ in range(min(per_call, self._skip)):
                try:
                    next(iterator)
                except StopIteration:
                    break
            self._skip -= per_call
            self._skipped_call = True
            return {}, state

        compat.set_step_function(model, "train", train_function)

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch = epoch
        if self._resume_metrics is not None:
            # fit reset the metrics at this epoch's start: the backed-up epoch's partial sums come back.
            for v, value in zip(self.model.metrics_variables, self._resume_metrics, strict=True):
                v.assign(value)
            self._resume_metrics = None
        else:
            self._batches_done = 0

    def on_train_batch_end(self, batch: int, logs: dict[str, Any] | None = None) -> None:
        trained = batch + 1 - self._batches_done  # batch is the last index of this call (steps_per_execution)
        self._batches_done = batch + 1
        skipped, self._skipped_call = self._skipped_call, False
        if self.save_freq == "epoch" or skipped:
            return  # a batch read but not trained (resuming) changes nothing worth a backup
        self._since_save += trained
        if self._since_save >= int(self.save_freq):
            self._save()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        self._epoch, self._batches_done = epoch + 1, 0
        self._save()

    def on_train_end(self, logs: dict[str, Any] | None = None) -> None:
        compat.set_initial_epoch(self.model, None)  # a later fit of this model starts at its own initial_epoch
        if self.delete_checkpoint and self._writer:
            shutil.rmtree(self.backup_dir, ignore_errors=True)
