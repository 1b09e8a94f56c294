"""``ModelCheckpoint`` that a multi-process job can use: only process 0 writes to ``filepath``.

Keras's ``keras.callbacks.ModelCheckpoint`` has no multi-process logic: under
``MultiWorkerMirroredStrategy`` every process would write the same file at once
(HDF5 refuses the second writer's lock, or the file is torn). As TF's
``distributed_file_utils`` did, the other processes still make the checkpoint
(reading a multi-process array can be a collective every process must join)
but into a scratch directory they remove at once. In one process it is Keras's
callback unchanged. ``jaxdist.keras`` refuses Keras's own ``ModelCheckpoint`` and
``BackupAndRestore`` in a multi-process ``fit`` and names these instead.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable

import jax

from jaxdist.keras.compat import ModelCheckpointBase

logger = logging.getLogger(__name__)

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint(ModelCheckpointBase):
    """``keras.callbacks.ModelCheckpoint`` (same arguments) whose files only process 0 writes."""

    def save_files(self, save: Callable[[], None]) -> None:
        if jax.process_index() == 0:
            save()
            return
        scratch = tempfile.mkdtemp(prefix="jaxdist-checkpoint-")
        # (Keras is untyped: mypy cannot tell the attribute's type.)
        real: str = self.filepath  # type: ignore[has-type]
        self.filepath = os.path.join(scratch, os.path.basename(real))
        try:
            save()
        finally:
            self.filepath = real
            shutil.rmtree(scratch, ignore_errors=True)
