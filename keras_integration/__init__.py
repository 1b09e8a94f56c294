"""Keras 3 ``compile`` / ``fit`` / ``evaluate`` / ``predict`` under jaxdist strategies (``pip install 'jaxdist[keras]'``).

Usage, as in TF's Keras distribution guide::

    import jaxdist.keras   # selects Keras's JAX backend (KERAS_BACKEND=jax) before Keras loads
    import keras
    import jaxdist

    strategy = jaxdist.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential([...])
        model.compile(optimizer="adam", loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=64, epochs=3)   # 64 = the global batch
    # fit/evaluate/predict use the strategy the model was built in, inside or outside the scope (as TF).

Once ``keras`` is imported (on the JAX backend), every ``strategy.scope()``
makes the strategy's Keras distribution current
(:func:`jaxdist.keras.scope.distribution_for`): variables made inside are
mirrored on the strategy's replicas, and Keras's own training loop splits
each global batch over them (:mod:`jaxdist.keras.distribution`).

Guarantees per strategy (global batch = ``batch_size``, as in TF):

- ``MirroredStrategy``, ``TPUStrategy``, ``OneDeviceStrategy``: the batch is
  split over the replicas, the gradient is the global batch's mean loss's
  (the all-reduce inserted by XLA), metrics are exact (a short last batch is
  computed whole on every replica: no padding, no dropped rows).
- ``CentralStorageStrategy``: the same results; under Keras the variables are
  mirrored on the compute devices rather than kept on the parameter device.
- ``MultiWorkerMirroredStrategy``: the same, over every process's devices;
  every process feeds the same input and keeps its replicas' rows (TF's
  ``DATA`` auto-shard policy); the processes agree on Keras's random seed so
  initial weights match; ``predict`` gathers its outputs to every process.
  ``*_on_batch`` raise NotImplementedError there. Per-process input (TF's
  ``FILE`` policy, each process reading its own files):
  ``Batches(iterable, per_process=True)``.
- default strategy: Keras unchanged (one device).
- ``ParameterServerStrategy`` (:mod:`jaxdist.keras.ps_fit`): the model's
  variables live on the PS (partitioned by ``variable_partitioner``), the
  optimizer (SGD, Adam, AdamW, Adamax, Nadam, RMSprop, Adagrad, Ftrl: Keras's own update rules) runs
  there, ``fit`` dispatches ``steps_per_execution`` steps per
  ``ClusterCoordinator`` closure. Input: ``DatasetCreator(dataset_fn)`` with
  ``steps_per_epoch`` (TF's rule), or arrays (each worker reads its shard).
  A worker that dies mid-``fit`` has its closures re-run elsewhere: every
  epoch applies exactly ``steps_per_epoch`` steps, none twice; epoch metrics
  are the exact sum of the closures' metric states. ``evaluate`` visits
  every example exactly once, also when workers die; ``predict`` runs on the
  coordinator with the PS's weights. Embeddings move only the looked-up
  rows, whatever the optimizer, applied exactly (Keras's result) or lazily
  (:func:`lazy_embeddings`; :mod:`jaxdist.keras.ps_embedding`). ``*_on_batch`` raise
  NotImplementedError. Dynamic embedding tables (no vocabulary fixed in advance,
  admission, eviction): :class:`jaxdist.keras.layers.DynamicEmbedding`.

Logs: Keras's own progress bar (time per step), ``History`` and ``CSVLogger``
work unchanged on every strategy; :class:`jaxdist.keras.TensorBoard` replaces
``keras.callbacks.TensorBoard`` (which needs TensorFlow) with the same
contract and event files (``pip install 'jaxdist[tensorboard]'``).
:class:`jaxdist.keras.BackupAndRestore` resumes a killed run mid-epoch (on every
strategy, parameter servers included);
:class:`jaxdist.keras.ModelCheckpoint` is Keras's, writing from process 0 only
(Keras's own two are refused in a multi-process ``fit``: every process would
write the same files);
:class:`jaxdist.keras.SidecarEvaluator` (also ``jaxdist.SidecarEvaluator``)
evaluates each new checkpoint from an evaluator task.

Input (synchronous strategies): numpy arrays, Python generators and
``keras.utils.PyDataset`` as Keras takes them, any re-iterable of
batches through :class:`jaxdist.keras.Batches`, and TF's
:class:`jaxdist.keras.DatasetCreator` (per-process pipelines of per-replica
batches, with ``steps_per_epoch``).

Export for serving: :func:`jaxdist.keras.export_model` writes a model trained
under any strategy as a ``.keras`` file, a ``jax.export`` artifact served
without jaxdist or Keras, or TF's SavedModel.

Importing this module raises :class:`~jaxdist.base.errors.ConfigurationError`
when Keras was already imported with another backend.

Keras internals: where Keras has no public hook, jaxdist replaces attributes of
Keras's JAX trainer and reads a few private attributes; every one of them is in
:mod:`jaxdist.keras.compat` (listed in its ``INTERNALS``, and in
``docs/keras-internals.md``), which is the only module that touches them.
"""

from __future__ import annotations

from jaxdist.keras.backend import require_jax_backend

require_jax_backend()

import keras  # noqa: E402,F401  (after the backend is chosen)

from jaxdist.keras.backup import BackupAndRestore  # noqa: E402
from jaxdist.keras.checkpoint import ModelCheckpoint  # noqa: E402
from jaxdist.keras.custom_loop import install_custom_loop_support  # noqa: E402
from jaxdist.keras.data import Batches, DatasetCreator  # noqa: E402
from jaxdist.keras.distribution import (  # noqa: E402
    StrategyDistribution,
    install_data_placement,
)
from jaxdist.keras import layers  # noqa: E402  (jaxdist.keras.layers.DynamicEmbedding)
from jaxdist.keras.export import EXPORT_FORMATS, ExportDependencyError, export_model  # noqa: E402
from jaxdist.keras.ps_custom_loop import install_ps_custom_loop_support  # noqa: E402
from jaxdist.keras.ps_model import (  # noqa: E402
    PSDistribution,
    dynamic_tables,
    epoch_end_sync,
    lazy_embeddings,
    ps_variables,
    sync_from_ps,
)
from jaxdist.keras.ps_optimizers import UnsupportedOptimizerError  # noqa: E402
from jaxdist.keras.scope import distribution_for, keras_scope  # noqa: E402
from jaxdist.keras.sidecar import SidecarEvaluator  # noqa: E402
from jaxdist.keras.tensorboard import TensorBoard  # noqa: E402
from jaxdist.keras_bridge import SCOPE_HOOK  # noqa: E402
from jaxdist.sync.hooks import register_scope_hook  # noqa: E402

install_data_placement()
# Keras models, optimizers, metrics and losses inside strategy.run / jaxdist.function (TF's custom training loop).
install_custom_loop_support()
# ... and inside ClusterCoordinator closures under ParameterServerStrategy (the state on the parameter servers).
install_ps_custom_loop_support()
# Every strategy.scope() enters the strategy's Keras distribution from now on (the sync core's scope hook;
# this replaces the stand-in that `import jaxdist` registered, jaxdist.keras_bridge.scope_hook).
register_scope_hook(SCOPE_HOOK, keras_scope)

__all__ = [
    "BackupAndRestore",
    "Batches",
    "DatasetCreator",
    "EXPORT_FORMATS",
    "ExportDependencyError",
    "ModelCheckpoint",
    "PSDistribution",
    "SidecarEvaluator",
    "StrategyDistribution",
    "TensorBoard",
    "UnsupportedOptimizerError",
    "distribution_for",
    "dynamic_tables",
    "epoch_end_sync",
    "export_model",
    "install_data_placement",
    "keras_scope",
    "layers",
    "lazy_embeddings",
    "ps_variables",
    "require_jax_backend",
    "sync_from_ps",
]
