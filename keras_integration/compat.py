"""Every Keras internal jaxdist touches, in one place: the fence around Keras's private API.

Keras 3 has no public hook for what :mod:`jaxdist.keras` needs in a few places (per-batch input
placement, running a model under the strategy it was built in, a stateless training step on a
parameter-server worker), so jaxdist reaches past the public API there. All those reaches are in
this module, and only here:

- every ``keras.src`` import (kind ``import``, or ``subclassed`` for a private class jaxdist's
  classes derive from);
- every private attribute of a Keras object read, called or written (kind ``private``);
- every attribute jaxdist replaces on a Keras class or model (kind ``replaced``): Keras's JAX
  trainer's entry points and step-function factories, its epoch iterator's distributed input,
  a model's step functions;
- every member of a Keras class that a jaxdist subclass overrides where the class or the member
  is private (kind ``subclassed``);
- every public-named member of Keras's private JAX-backend classes jaxdist calls (kind
  ``backend``: its contract is the backend's, not Keras's public API).

:data:`INTERNALS` lists each one with the path jaxdist reaches it by, what jaxdist uses it for,
which jaxdist modules use it (through the functions here) and, for a callable, the signature
jaxdist was written against (``str(inspect.signature(...))`` on the Keras the ``keras`` extra
pins). Other jaxdist modules use the functions and names below, never Keras's internals.

Checks (so a Keras upgrade fails in one place, naming what changed):

- ``python -m jaxdist.keras`` checks every entry against the installed Keras
  (:func:`check_internals`); ``tests/unit/test_keras_compat.py`` runs it, and checks by reading
  the sources that no other jaxdist module imports ``keras.src`` or touches a listed private or
  replaced name;
- ``python -m jaxdist.keras --table`` prints the table of ``docs/keras-internals.md``
  (the test keeps the page equal to it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import keras

from jaxdist.base.errors import ConfigurationError

try:
    from keras.src.backend.common import global_state
    from keras.src.backend.jax.trainer import JAXEpochIterator, JAXTrainer
    from keras.src.losses import loss as keras_loss_module
    from keras.src.distribution.distribution_lib import Distribution
    from keras.src.trainers.data_adapters import data_adapter_utils
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter
    from keras.src.saving.keras_saveable import KerasSaveable
    from keras.src.utils import rng_utils
except ImportError as e:  # pragma: no cover - depends on the installed Keras
    raise ConfigurationError(
        f"Keras {keras.__version__} lacks an internal jaxdist.keras relies on ({e}): install the Keras range jaxdist's "
        "keras extra pins (pip install 'jaxdist[keras]'); docs/keras-internals.md lists what jaxdist uses"
    ) from e

logger = logging.getLogger(__name__)

__all__ = [
    "INTERNALS",
    "DataAdapter",
    "Distribution",
    "Internal",
    "ModelCheckpointBase",
    "check_internals",
    "clip_gradients",
    "flatten_layers",
    "flatten_metrics_in_order",
    "get_jax_iterator",
    "get_numpy_iterator",
    "get_random_seed",
    "inbound_node_count",
    "initial_epoch",
    "install_custom_loop_patches",
    "install_pickle_patch",
    "replace_on_instance",
    "in_stateless_scope",
    "in_symbolic_scope",
    "name_scope_caller",
    "install_trainer_patches",
    "loss_and_updates",
    "markdown_table",
    "outside_stateless_scope",
    "pack_x_y_sample_weight",
    "raw_learning_rate",
    "uses_weight_decay",
    "set_initial_epoch",
    "set_step_function",
    "should_eval",
    "stateless_test_step",
    "step_function",
    "stored_value",
    "symbolic_build",
    "unpack_x_y_sample_weight",
    "update_metrics_variables",
    "variable_layout",
]

#: What an entry is (see the module docstring).
KINDS = ("import", "private", "replaced", "subclassed", "backend")


@dataclasses.dataclass(frozen=True)
class Internal:
    """One Keras internal jaxdist relies on.

    Attributes:
        path: how jaxdist reaches it: a ``keras.src`` import path, or a public Keras class (or the private
            class it lives on) followed by the attribute, e.g. ``keras.Model._symbolic_build``.
        kind: one of :data:`KINDS`.
        use: what jaxdist uses it for (and what breaks if it changes).
        used_by: the jaxdist modules that depend on it (through this module).
        signature: ``str(inspect.signature(obj))`` of a callable on the pinned Keras; None for an
            attribute that is not called (a class used as a base only, a property, an instance attribute).
        on_instance: an attribute Keras sets on each instance (in ``__init__``), not on the class: checked
            on a small compiled model and its parts.
    """

    path: str
    kind: str
    use: str
    used_by: tuple[str, ...]
    signature: str | None = None
    on_instance: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.path}: kind {self.kind!r} is not one of {KINDS}")

    @property
    def name(self) -> str:
        """The last component of :attr:`path` (the attribute name)."""
        return self.path.rpartition(".")[2]


_TRAINER = "keras.src.backend.jax.trainer.JAXTrainer"
_EPOCH_ITERATOR = "keras.src.backend.jax.trainer.JAXEpochIterator"
_DISTRIBUTION = "keras.src.distribution.distribution_lib.Distribution"
_DATA_ADAPTER = "keras.src.trainers.data_adapters.data_adapter.DataAdapter"
_ADAPTER_UTILS = "keras.src.trainers.data_adapters.data_adapter_utils"

#: Every Keras internal jaxdist touches (kept literal: tests/unit/test_keras_compat.py reads it from
#: this file's source, and docs/keras-internals.md shows it as a table).
INTERNALS: tuple[Internal, ...] = (
    # -- keras.src imports -------------------------------------------------------------------------
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer",
        kind="import",
        use="Keras's JAX training loop (the base of keras.Model on JAX): jaxdist replaces its entry points and "
            "step-function factories (the `replaced` rows below)",
        used_by=("jaxdist.keras.distribution",),
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXEpochIterator",
        kind="import",
        use="the iterator Keras's JAX loop reads batches from: jaxdist replaces its distributed input "
            "(`_get_distributed_iterator`)",
        used_by=("jaxdist.keras.distribution",),
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter_utils.get_numpy_iterator",
        kind="import",
        use="`Batches.get_numpy_iterator`: batches of a plain iterable as numpy, as Keras's generator adapter does",
        used_by=("jaxdist.keras.data",),
        signature="(iterable)",
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter_utils.get_jax_iterator",
        kind="import",
        use="`Batches.get_jax_iterator`: the batches Keras's JAX loop (and jaxdist's placement) reads",
        used_by=("jaxdist.keras.data",),
        signature="(iterable)",
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter_utils.unpack_x_y_sample_weight",
        kind="import",
        use="a PS worker's step splits a batch into (x, y, sample_weight) as Keras's train_step does",
        used_by=("jaxdist.keras.ps_worker",),
        signature="(data)",
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter_utils.pack_x_y_sample_weight",
        kind="import",
        use="a PS worker's step re-packs a batch whose ids were renumbered into a compact embedding table",
        used_by=("jaxdist.keras.ps_worker",),
        signature="(x, y=None, sample_weight=None)",
    ),
    Internal(
        path="keras.src.backend.common.global_state.get_global_attribute",
        kind="import",
        use="reads the current Keras StatelessScope, to leave it while an optimizer first used inside strategy.run "
            "is built eagerly (outside the trace); and the SymbolicScope, in which a DynamicEmbedding layer building "
            "a model gives shapes only (called anywhere else outside jaxdist's fit, it raises)",
        used_by=("jaxdist.keras.custom_loop", "jaxdist.keras.layers"),
        signature="(name, default=None, set_to_default=False)",
    ),
    Internal(
        path="keras.src.backend.common.name_scope.name_scope",
        kind="private",
        use="the Keras name scope stack (global attribute 'name_scope_stack', each entry's `caller`): a variable "
            "made in ParameterServerStrategy.scope() inside an optimizer's own name scope tells which Keras "
            "optimizers were made there (the one a custom loop's model is trained with)",
        used_by=("jaxdist.keras.ps_model",),
        signature="(name, caller=None, deduplicate=True, override_parent=None)",
    ),
    Internal(
        path="keras.src.saving.keras_saveable.KerasSaveable",
        kind="import",
        use="the base of every Keras object that pickles (models, layers, optimizers, metrics, losses): its "
            "__reduce__ is replaced (below)",
        used_by=("jaxdist.keras.ps_custom_loop",),
    ),
    Internal(
        path="keras.src.saving.keras_saveable.KerasSaveable.__reduce__",
        kind="replaced",
        use="how Keras models, optimizers and metrics pickle (a whole saved model): one made in "
            "ParameterServerStrategy.scope() and captured by a scheduled closure pickles instead as a reference to "
            "its state on the parameter servers (jaxdist.keras.ps_custom_loop); every other object as Keras does",
        used_by=("jaxdist.keras.ps_custom_loop",),
        signature="(self)",
    ),
    Internal(
        path="keras.metrics.Metric.result",
        kind="replaced",
        use="on one coordinator metric trained in ParameterServerStrategy closures (that instance only): reads the "
            "accumulators on the parameter servers into its variables first, then Keras's result",
        used_by=("jaxdist.keras.ps_custom_loop",),
        signature="(self)",
    ),
    Internal(
        path="keras.metrics.Metric.reset_state",
        kind="replaced",
        use="on that coordinator metric only: Keras's reset, then the parameter servers' accumulators reset too",
        used_by=("jaxdist.keras.ps_custom_loop",),
        signature="(self)",
    ),
    Internal(
        path="keras.metrics.Metric.update_state",
        kind="replaced",
        use="on a worker's copy of such a metric only: traced inside strategy.run as Keras's; called eagerly in a "
            "closure's body, its increments are pushed to the accumulators",
        used_by=("jaxdist.keras.ps_custom_loop",),
        signature="(self, *args, **kwargs)",
    ),
    Internal(
        path="keras.optimizers.Optimizer.stateless_apply",
        kind="replaced",
        use="on a worker's copy of an optimizer trained on the parameter servers only: pushes the summed gradients "
            "(the PS applies the optimizer, whose state lives there) and returns the PS's values after the push",
        used_by=("jaxdist.keras.ps_custom_loop",),
        signature="(self, optimizer_variables, grads, trainable_variables)",
    ),
    Internal(
        path="keras.src.backend.common.global_state.set_global_attribute",
        kind="import",
        use="leaves the current Keras StatelessScope for that build, and restores it after",
        used_by=("jaxdist.keras.custom_loop",),
        signature="(name, value)",
    ),
    Internal(
        path="keras.src.utils.rng_utils.get_random_seed",
        kind="import",
        use="whether the user seeded Keras: if not, the processes of a multi-process strategy agree on process "
            "0's seed so initial weights match (what keras.distribution.initialize does)",
        used_by=("jaxdist.keras.scope",),
        signature="()",
    ),
    # -- private classes subclassed, and the members jaxdist's subclasses override ------------------
    Internal(
        path="keras.src.distribution.distribution_lib.Distribution",
        kind="subclassed",
        use="base of PSDistribution, what ParameterServerStrategy.scope() makes current: it notes the variables "
            "made in the scope (called positionally: device_mesh, batch_dim_name, auto_shard_dataset)",
        used_by=("jaxdist.keras.ps_model",),
        signature="(device_mesh, batch_dim_name=None, auto_shard_dataset=True)",
    ),
    Internal(
        path="keras.src.distribution.distribution_lib.Distribution.get_variable_layout",
        kind="subclassed",
        use="PSDistribution: Keras asks it for each variable made in the scope; jaxdist notes the variable",
        used_by=("jaxdist.keras.ps_model",),
        signature="(self, variable)",
    ),
    Internal(
        path="keras.src.distribution.distribution_lib.Distribution.get_data_layout",
        kind="subclassed",
        use="PSDistribution: refuses Keras's own input placement under ParameterServerStrategy",
        used_by=("jaxdist.keras.ps_model",),
        signature="(self, data_shape)",
    ),
    Internal(
        path="keras.src.distribution.distribution_lib.Distribution.get_tensor_layout",
        kind="subclassed",
        use="PSDistribution: no layout for intermediate tensors",
        used_by=("jaxdist.keras.ps_model",),
        signature="(self, path)",
    ),
    Internal(
        path="keras.src.distribution.distribution_lib.Distribution.distribute_dataset",
        kind="subclassed",
        use="PSDistribution: datasets pass through (the workers read their own)",
        used_by=("jaxdist.keras.ps_model",),
        signature="(self, dataset)",
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter.DataAdapter",
        kind="subclassed",
        use="base of jaxdist.keras.Batches (Keras takes any DataAdapter as fit/evaluate/predict input)",
        used_by=("jaxdist.keras.data",),
        signature="()",
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter.DataAdapter.get_numpy_iterator",
        kind="subclassed",
        use="Batches: the epoch's batches as numpy",
        used_by=("jaxdist.keras.data",),
        signature="(self)",
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter.DataAdapter.get_jax_iterator",
        kind="subclassed",
        use="Batches: the epoch's batches for the JAX loop (also read by jaxdist's distributed input)",
        used_by=("jaxdist.keras.data", "jaxdist.keras.distribution"),
        signature="(self)",
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter.DataAdapter.get_tf_dataset",
        kind="subclassed",
        use="Batches: refused (JAX backend only)",
        used_by=("jaxdist.keras.data",),
        signature="(self)",
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter.DataAdapter.get_torch_dataloader",
        kind="subclassed",
        use="Batches: refused (JAX backend only)",
        used_by=("jaxdist.keras.data",),
        signature="(self)",
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter.DataAdapter.num_batches",
        kind="subclassed",
        use="Batches: the epoch length when the iterable has len() (a property)",
        used_by=("jaxdist.keras.data",),
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter.DataAdapter.batch_size",
        kind="subclassed",
        use="Batches: None, batches may differ in size (a property)",
        used_by=("jaxdist.keras.data",),
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter.DataAdapter.has_partial_batch",
        kind="subclassed",
        use="Batches: None, unknown (a property)",
        used_by=("jaxdist.keras.data",),
    ),
    Internal(
        path="keras.src.trainers.data_adapters.data_adapter.DataAdapter.partial_batch_size",
        kind="subclassed",
        use="Batches: None, unknown (a property)",
        used_by=("jaxdist.keras.data",),
    ),
    Internal(
        path="keras.callbacks.ModelCheckpoint._save_model",
        kind="subclassed",
        use="jaxdist.keras.ModelCheckpoint writes from process 0 only: the other processes still save (a collective "
            "read), with the public `filepath` attribute pointed into a scratch directory while _save_model runs",
        used_by=("jaxdist.keras.checkpoint",),
        signature="(self, epoch, batch, logs)",
    ),
    # -- attributes jaxdist replaces ---------------------------------------------------------------
    Internal(
        path="keras.src.backend.jax.trainer.JAXEpochIterator._get_distributed_iterator",
        kind="replaced",
        use="per-batch input placement: while a StrategyDistribution is current, each global batch is split over "
            "the strategy's replicas (short batches replicated); Keras's own code otherwise. Keras's public hook "
            "(Distribution.get_data_layout) is asked once per fit and cached, so it cannot place a short last batch",
        used_by=("jaxdist.keras.distribution",),
        signature="(self, distribution)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.fit",
        kind="replaced",
        use="runs under the distribution of the strategy the model was built in (TF's rule, also outside the scope); "
            "a model built in ParameterServerStrategy.scope() goes to jaxdist.keras.ps_fit.fit, which takes the same "
            "parameters; multi-process: Keras's file-writing callbacks refused (the `callbacks` argument is bound "
            "by name)",
        used_by=("jaxdist.keras.distribution", "jaxdist.keras.ps_fit"),
        signature="(self, x=None, y=None, batch_size=None, epochs=1, verbose='auto', callbacks=None, "
                  "validation_split=0.0, validation_data=None, shuffle=True, class_weight=None, sample_weight=None, "
                  "initial_epoch=0, steps_per_epoch=None, validation_steps=None, validation_batch_size=None, "
                  "validation_freq=1)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.evaluate",
        kind="replaced",
        use="as fit (PS models: jaxdist.keras.ps_fit.evaluate, exactly-once over the workers)",
        used_by=("jaxdist.keras.distribution", "jaxdist.keras.ps_fit"),
        signature="(self, x=None, y=None, batch_size=None, verbose='auto', sample_weight=None, steps=None, "
                  "callbacks=None, return_dict=False, **kwargs)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.predict",
        kind="replaced",
        use="as fit (PS models: Keras's own predict on the coordinator with the PS's weights)",
        used_by=("jaxdist.keras.distribution", "jaxdist.keras.ps_fit"),
        signature="(self, x, batch_size=None, verbose='auto', steps=None, callbacks=None)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.train_on_batch",
        kind="replaced",
        use="as fit; refused under a multi-process strategy and under ParameterServerStrategy",
        used_by=("jaxdist.keras.distribution",),
        signature="(self, x, y=None, sample_weight=None, class_weight=None, return_dict=False)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.test_on_batch",
        kind="replaced",
        use="as train_on_batch",
        used_by=("jaxdist.keras.distribution",),
        signature="(self, x, y=None, sample_weight=None, return_dict=False)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.predict_on_batch",
        kind="replaced",
        use="as train_on_batch",
        used_by=("jaxdist.keras.distribution",),
        signature="(self, x)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.make_train_function",
        kind="replaced",
        use="after Keras makes model.train_function, jaxdist wraps it under a StrategyDistribution: the loop waits "
            "for the step 2 calls back (XLA's CPU client can deadlock when the loop runs far ahead)",
        used_by=("jaxdist.keras.distribution",),
        signature="(self, force=False)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.make_test_function",
        kind="replaced",
        use="as make_train_function, for model.test_function",
        used_by=("jaxdist.keras.distribution",),
        signature="(self, force=False)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.make_predict_function",
        kind="replaced",
        use="as make_train_function, and in a multi-process job predict's outputs are gathered to every process",
        used_by=("jaxdist.keras.distribution",),
        signature="(self, force=False)",
    ),
    Internal(
        path="keras.optimizers.Optimizer.apply",
        kind="replaced",
        use="what apply_gradients and stateless_apply call: inside a synchronous strategy's run it first sums the "
            "replicas' gradients (TF's contract), and builds an optimizer first used there outside the trace",
        used_by=("jaxdist.keras.custom_loop",),
        signature="(self, grads, trainable_variables=None)",
    ),
    Internal(
        path="keras.metrics.Metric.stateless_update_state",
        kind="replaced",
        use="inside a synchronous strategy's run the new metric values are combined across replicas by each "
            "variable's aggregation (metrics exact over the global batch)",
        used_by=("jaxdist.keras.custom_loop",),
        signature="(self, metric_variables, *args, **kwargs)",
    ),
    Internal(
        path="keras.src.losses.loss.reduce_weighted_values",
        kind="replaced",
        use="how every Keras loss's __call__ reduces its per-example values (looked up as a module global at each "
            "call): inside a synchronous strategy's run a reduction that averages over the replica's examples is "
            "refused (TF refuses it too): reduction=None with jaxdist.compute_average_loss is what sums right",
        used_by=("jaxdist.keras.custom_loop",),
        signature="(values, sample_weight=None, mask=None, reduction='sum_over_batch_size', dtype=None)",
    ),
    Internal(
        path="keras.Model.train_function",
        kind="replaced",
        use="the step Keras's fit loop calls as train_function(state, iterator) -> (logs, state): wrapped by the "
            "make_train_function replacement, and replaced by BackupAndRestore while a resumed epoch reads its "
            "already-trained batches",
        used_by=("jaxdist.keras.distribution", "jaxdist.keras.backup"),
        on_instance=True,
    ),
    Internal(
        path="keras.Model.test_function",
        kind="replaced",
        use="the step of evaluate's loop, (state, iterator) -> (logs, state): wrapped by the make_test_function "
            "replacement",
        used_by=("jaxdist.keras.distribution",),
        on_instance=True,
    ),
    Internal(
        path="keras.Model.predict_function",
        kind="replaced",
        use="the step of predict's loop, (state, iterator) -> (outputs, state): wrapped by the make_predict_function "
            "replacement",
        used_by=("jaxdist.keras.distribution",),
        on_instance=True,
    ),
    # -- private attributes read, called or written -------------------------------------------------
    Internal(
        path="keras.Model._symbolic_build",
        kind="private",
        use="builds the model, its compiled loss and metrics from one batch before its PS state is made (coordinator) "
            "and before a worker's copy runs its first step",
        used_by=("jaxdist.keras.ps_fit", "jaxdist.keras.ps_worker"),
        signature="(self, iterator=None, data_batch=None)",
    ),
    Internal(
        path="keras.Model._should_eval",
        kind="private",
        use="fit under ParameterServerStrategy validates on the epochs Keras's fit would (validation_freq)",
        used_by=("jaxdist.keras.ps_fit",),
        signature="(self, epoch, validation_freq)",
    ),
    Internal(
        path="keras.Model._initial_epoch",
        kind="private",
        use="the epoch a callback moved fit's start to in on_train_begin: read by fit under ParameterServerStrategy, "
            "written by BackupAndRestore (set when resuming, cleared when fit ends)",
        used_by=("jaxdist.keras.ps_fit", "jaxdist.keras.backup"),
        on_instance=True,
    ),
    Internal(
        path="keras.Model._flatten_metrics_in_order",
        kind="private",
        use="evaluate(return_dict=False) under ParameterServerStrategy returns the list in Keras's order",
        used_by=("jaxdist.keras.ps_fit",),
        signature="(self, logs)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer._update_metrics_variables",
        kind="private",
        use="a PS worker's stateless training step updates the metric variables as Keras's train_step does",
        used_by=("jaxdist.keras.ps_worker",),
        signature="(self, metrics_variables, unscaled_loss, x, y, y_pred, sample_weight)",
    ),
    Internal(
        path="keras.layers.Layer._flatten_layers",
        kind="private",
        use="finds a model's Embedding layers (row-sparse tables under ParameterServerStrategy)",
        used_by=("jaxdist.keras.ps_embedding",),
        signature="(self, include_self=True, recursive=True)",
    ),
    Internal(
        path="keras.layers.Layer._inbound_nodes",
        kind="private",
        use="an Embedding called more than once (shared) stays dense",
        used_by=("jaxdist.keras.ps_embedding",),
        on_instance=True,
    ),
    Internal(
        path="keras.optimizers.Optimizer._clip_gradients",
        kind="private",
        use="a PS worker clips gradients with the user's clipnorm / global_clipnorm / clipvalue, Keras's own code",
        used_by=("jaxdist.keras.ps_worker",),
        signature="(self, grads)",
    ),
    Internal(
        path="keras.optimizers.Optimizer._learning_rate",
        kind="private",
        use="the learning rate as given (a float, a variable or a schedule): a schedule is refused under "
            "ParameterServerStrategy (optimizer.learning_rate would evaluate it)",
        used_by=("jaxdist.keras.ps_optimizers",),
        on_instance=True,
    ),
    Internal(
        path="keras.Variable._layout",
        kind="private",
        use="the layout Keras gave a variable (None outside a distribution): its device mesh tells which jaxdist "
            "strategy's scope made it (an optimizer's slots take their model variable's), for strategy.run",
        used_by=("jaxdist.keras.distribution",),
        on_instance=True,
    ),
    Internal(
        path="keras.optimizers.Optimizer._use_weight_decay",
        kind="private",
        use="whether the optimizer's weight_decay applies to a variable (exclude_from_weight_decay): the PS "
            "applies Keras's decay to the same variables",
        used_by=("jaxdist.keras.ps_optimizers",),
        signature="(self, variable)",
    ),
    Internal(
        path="keras.Variable._value",
        kind="private",
        use="the array a variable holds, None while Keras's fit holds the state itself (.value would fall back to "
            "the initializer): its sharding tells which strategy's replicas hold a model; inside strategy.run it is "
            "the value the compiled program takes (None: the variable was created inside the trace, refused)",
        used_by=("jaxdist.keras.distribution", "jaxdist.keras.custom_loop"),
        on_instance=True,
    ),
    # -- public-named members of the private JAX backend -------------------------------------------
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.compute_loss_and_updates",
        kind="backend",
        use="a PS worker's training step differentiates it (jax.value_and_grad), as the JAX backend's train_step does "
            "(called positionally)",
        used_by=("jaxdist.keras.ps_worker",),
        signature="(self, trainable_variables, non_trainable_variables, metrics_variables, x, y, sample_weight, "
                  "training=False, optimizer_variables=None)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXTrainer.test_step",
        kind="backend",
        use="a PS worker's evaluation step, the JAX backend's stateless test_step(state, data) -> (logs, state) with "
            "state = (trainable, non_trainable, metrics) values",
        used_by=("jaxdist.keras.ps_worker",),
        signature="(self, state, data)",
    ),
    Internal(
        path="keras.src.backend.jax.trainer.JAXEpochIterator.data_adapter",
        kind="backend",
        use="the replaced `_get_distributed_iterator` reads the epoch's batches from it (and a Batches' `per_process`)",
        used_by=("jaxdist.keras.distribution",),
        on_instance=True,
    ),
)


# ------------------------------------------------------------------------------------------------
# Imports (kind "import" and "subclassed"): the names other modules use
# ------------------------------------------------------------------------------------------------

get_numpy_iterator = data_adapter_utils.get_numpy_iterator
get_jax_iterator = data_adapter_utils.get_jax_iterator
unpack_x_y_sample_weight = data_adapter_utils.unpack_x_y_sample_weight
pack_x_y_sample_weight = data_adapter_utils.pack_x_y_sample_weight
get_random_seed = rng_utils.get_random_seed


class ModelCheckpointBase(keras.callbacks.ModelCheckpoint):
    """``keras.callbacks.ModelCheckpoint`` whose file writing a subclass can surround: :meth:`save_files`.

    Keras's callback writes in its private ``_save_model(epoch, batch, logs)``; this class overrides
    it (the one place) and calls :meth:`save_files` with the write to run.
    """

    def _save_model(self, epoch: int, batch: int | None, logs: dict[str, Any] | None) -> None:
        self.save_files(functools.partial(super()._save_model, epoch, batch, logs))

    def save_files(self, save: Callable[[], None]) -> None:
        """Write this epoch's (or batch's) checkpoint: ``save()`` runs Keras's own writing (to ``self.filepath``)."""
        save()


# ------------------------------------------------------------------------------------------------
# Private attributes (kind "private") and the JAX backend's members (kind "backend")
# ------------------------------------------------------------------------------------------------


def symbolic_build(model: Any, data_batch: Any) -> None:
    """Build ``model``, its compiled loss and metrics from one batch, as Keras's fit does first."""
    model._symbolic_build(data_batch=data_batch)


def should_eval(model: Any, epoch: int, validation_freq: Any) -> bool:
    """Whether Keras's fit validates after ``epoch`` with this ``validation_freq``."""
    return bool(model._should_eval(epoch, validation_freq))


def initial_epoch(model: Any) -> int | None:
    """The first epoch a callback moved ``model``'s fit to in ``on_train_begin`` (None: not moved)."""
    value: int | None = model._initial_epoch
    return value


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """Make ``model``'s fit start at ``epoch`` (from ``on_train_begin``); None: at fit's own ``initial_epoch``."""
    model._initial_epoch = epoch


def flatten_metrics_in_order(model: Any, logs: dict[str, Any]) -> Any:
    """``evaluate``'s logs as the list ``return_dict=False`` gives, in Keras's order."""
    return model._flatten_metrics_in_order(logs)


def update_metrics_variables(model: Any, metrics_variables: Any, unscaled_loss: Any, x: Any, y: Any, y_pred: Any,
                             sample_weight: Any) -> Any:
    """Keras's stateless metric update of the JAX train step: ``(logs, new metric variable values)``."""
    return model._update_metrics_variables(metrics_variables, unscaled_loss, x, y, y_pred, sample_weight)


def flatten_layers(model: Any) -> list[Any]:
    """Every layer of ``model``, nested ones included (the model itself too, first)."""
    return list(model._flatten_layers())


def inbound_node_count(layer: Any) -> int:
    """How many times ``layer`` was called in a functional graph."""
    return len(layer._inbound_nodes)


def clip_gradients(optimizer: Any, grads: Any) -> Any:
    """``grads`` clipped by ``optimizer``'s clipnorm / global_clipnorm / clipvalue (Keras's code)."""
    return optimizer._clip_gradients(grads)


def raw_learning_rate(optimizer: Any) -> Any:
    """The learning rate as given to ``optimizer`` (a float, a variable, a schedule or a callable), or None."""
    return getattr(optimizer, "_learning_rate", None)


def uses_weight_decay(optimizer: Any, variable: Any) -> bool:
    """Whether Keras applies ``optimizer``'s ``weight_decay`` to ``variable`` (``exclude_from_weight_decay``)."""
    return bool(optimizer._use_weight_decay(variable))


def stored_value(variable: Any) -> Any:
    """The array ``variable`` holds, or None while Keras's fit holds the state itself."""
    return getattr(variable, "_value", None)


def variable_layout(variable: Any) -> Any:
    """The layout Keras gave ``variable`` (a ``TensorLayout``), or None (made outside any distribution)."""
    return getattr(variable, "_layout", None)


def loss_and_updates(model: Any) -> Callable[..., Any]:
    """``model.compute_loss_and_updates`` (JAX backend): ``(trainable, non_trainable, metrics, x, y, sample_weight,
    training=, optimizer_variables=) -> (loss, (unscaled_loss, y_pred, non_trainable, metrics))``."""
    fn: Callable[..., Any] = model.compute_loss_and_updates
    return fn


def stateless_test_step(model: Any) -> Callable[..., Any]:
    """``model.test_step`` (JAX backend): ``(state, data) -> (logs, state)``, state ``(trainable, non_trainable,
    metrics)`` values."""
    fn: Callable[..., Any] = model.test_step
    return fn


# ------------------------------------------------------------------------------------------------
# Replaced attributes (kind "replaced")
# ------------------------------------------------------------------------------------------------

#: ``fit``-like entry points of Keras's JAX trainer jaxdist wraps.
MODEL_ENTRY_POINTS = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch")

#: Step kinds: the factory Keras's loops call, and the model attribute it sets.
STEP_FUNCTIONS = {
    "train": ("make_train_function", "train_function"),
    "test": ("make_test_function", "test_function"),
    "predict": ("make_predict_function", "predict_function"),
}

#: The Keras originals of the attributes :func:`install_trainer_patches` replaced (path -> object).
_originals: dict[str, Any] = {}


def step_function(model: Any, kind: str) -> Any:
    """``model``'s current step function of ``kind`` (``"train"``, ``"test"`` or ``"predict"``), or None."""
    return getattr(model, STEP_FUNCTIONS[kind][1])


def set_step_function(model: Any, kind: str, fn: Any) -> None:
    """Make ``fn`` the step function Keras's ``kind`` loop calls on ``model`` (until Keras makes a new one)."""
    setattr(model, STEP_FUNCTIONS[kind][1], fn)


def install_trainer_patches(
    distributed_batches: Callable[[Any, Any], Iterator[Any] | None],
    entry_point: Callable[[Callable[..., Any], str], Callable[..., Any]],
    step: Callable[[Any, str, Any], Any],
) -> None:
    """Replace the attributes of Keras's JAX trainer jaxdist hooks into (call once; the caller keeps it so).

    Args:
        distributed_batches: ``(distribution, data_adapter) -> iterator of placed batches``, or None to let
            Keras's own ``_get_distributed_iterator`` run (Keras calls it once per epoch while a distribution
            is current).
        entry_point: ``(keras_method, name) -> replacement`` for each of :data:`MODEL_ENTRY_POINTS`.
        step: ``(model, kind, step_function) -> step_function``: called each time Keras's
            ``make_<kind>_function`` has made (or kept) the model's step function; what it returns becomes
            the model's step function (return the one given to keep it).

    Raises:
        ConfigurationError: the installed Keras lacks one of the attributes (a Keras outside the range
            jaxdist's ``keras`` extra pins).
    """
    targets = [(JAXEpochIterator, "_get_distributed_iterator")]
    targets += [(JAXTrainer, name) for name in MODEL_ENTRY_POINTS]
    targets += [(JAXTrainer, make) for make, _ in STEP_FUNCTIONS.values()]
    missing = [f"{cls.__name__}.{name}" for cls, name in targets if not callable(getattr(cls, name, None))]
    if missing:  # pragma: no cover - depends on the installed Keras
        raise ConfigurationError(
            f"Keras {keras.__version__} is outside the range jaxdist supports (pip install 'jaxdist[keras]'): it has no "
            f"{', '.join(missing)} (docs/keras-internals.md)"
        )

    original_iterator = JAXEpochIterator._get_distributed_iterator
    _originals[f"{_EPOCH_ITERATOR}._get_distributed_iterator"] = original_iterator

    @functools.wraps(original_iterator)
    def _get_distributed_iterator(self: Any, distribution: Any) -> Iterator[Any]:
        placed = distributed_batches(distribution, self.data_adapter)
        if placed is not None:
            return placed
        return original_iterator(self, distribution)

    JAXEpochIterator._get_distributed_iterator = _get_distributed_iterator

    for name in MODEL_ENTRY_POINTS:
        original = getattr(JAXTrainer, name)
        _originals[f"{_TRAINER}.{name}"] = original
        setattr(JAXTrainer, name, entry_point(original, name))

    for kind, (make_name, attribute) in STEP_FUNCTIONS.items():
        original_make = getattr(JAXTrainer, make_name)
        _originals[f"{_TRAINER}.{make_name}"] = original_make
        setattr(JAXTrainer, make_name, _after_make(original_make, kind, attribute, step))


#: What :func:`install_custom_loop_patches` replaces: (registry path, class, attribute).
CUSTOM_LOOP_TARGETS = (
    ("keras.optimizers.Optimizer.apply", keras.optimizers.Optimizer, "apply"),
    ("keras.metrics.Metric.stateless_update_state", keras.metrics.Metric, "stateless_update_state"),
    ("keras.src.losses.loss.reduce_weighted_values", keras_loss_module, "reduce_weighted_values"),
)


def install_custom_loop_patches(
    optimizer_apply: Callable[[Any], Any],
    metric_stateless_update: Callable[[Any], Any],
    loss_reduction: Callable[[Any], Any],
) -> None:
    """Replace ``Optimizer.apply``, ``Metric.stateless_update_state`` and the loss reduction (call once).

    Each argument is ``(keras_original) -> replacement``, called with the function Keras defines.
    The methods are replaced on the public class (its subclasses inherit the replacement; a subclass
    that overrides the method keeps its own, which usually calls the base's); the loss reduction is
    the module function ``keras.src.losses.loss.reduce_weighted_values``, which ``Loss.__call__``
    looks up at each call.
    """
    for (path, cls, name), make in zip(CUSTOM_LOOP_TARGETS, (optimizer_apply, metric_stateless_update, loss_reduction)):
        original = getattr(cls, name)
        _originals[path] = original
        setattr(cls, name, functools.wraps(original)(make(original)))


_PICKLE_PATH = "keras.src.saving.keras_saveable.KerasSaveable.__reduce__"


def install_pickle_patch(make: Callable[[Any], Any]) -> None:
    """Replace ``KerasSaveable.__reduce__`` (how Keras models, layers, optimizers, metrics and losses pickle) by
    ``make(keras_original)`` (call once)."""
    original = KerasSaveable.__reduce__
    _originals[_PICKLE_PATH] = original
    KerasSaveable.__reduce__ = functools.wraps(original)(make(original))


#: The methods :func:`replace_on_instance` may replace on one Keras object: (class, attribute).
INSTANCE_TARGETS = (
    (keras.metrics.Metric, "result"),
    (keras.metrics.Metric, "reset_state"),
    (keras.metrics.Metric, "update_state"),
    (keras.optimizers.Optimizer, "stateless_apply"),
)


def replace_on_instance(obj: Any, name: str, fn: Callable[..., Any]) -> None:
    """Make ``obj.<name>`` call ``fn`` for this one object (its class, and every other instance, keep Keras's).

    Raises:
        ValueError: ``name`` of ``obj``'s class is not one of :data:`INSTANCE_TARGETS`.
    """
    if not any(isinstance(obj, cls) and name == attr for cls, attr in INSTANCE_TARGETS):
        raise ValueError(f"{type(obj).__name__}.{name} is not a registered instance replacement")
    object.__setattr__(obj, name, fn)  # bypasses Keras's attribute tracking: a method, not state


def name_scope_caller() -> Any:
    """The object whose Keras name scope is innermost now (e.g. the optimizer creating its variables), or None."""
    stack = global_state.get_global_attribute("name_scope_stack")
    if not stack:
        return None
    return getattr(stack[-1], "caller", None)


def in_stateless_scope() -> bool:
    """Whether a Keras ``StatelessScope`` is current (jaxdist's trace scope is one)."""
    return global_state.get_global_attribute("stateless_scope") is not None


def in_symbolic_scope() -> bool:
    """Whether a Keras ``SymbolicScope`` is current (Keras is building a model or computing output shapes)."""
    return global_state.get_global_attribute("symbolic_scope") is not None


@contextlib.contextmanager
def outside_stateless_scope() -> Iterator[None]:
    """No Keras StatelessScope is current for the block (the current one, if any, is restored after)."""
    scope = global_state.get_global_attribute("stateless_scope")
    global_state.set_global_attribute("stateless_scope", None)
    try:
        yield
    finally:
        global_state.set_global_attribute("stateless_scope", scope)


def _after_make(make: Any, kind: str, attribute: str, step: Callable[[Any, str, Any], Any]) -> Any:
    @functools.wraps(make)
    def make_function(self: Any, force: bool = False) -> Any:
        make(self, force)
        current = getattr(self, attribute)
        replacement = step(self, kind, current)
        if replacement is not current:
            setattr(self, attribute, replacement)
        return replacement

    return make_function


# ------------------------------------------------------------------------------------------------
# The check against the installed Keras, and the table of docs/keras-internals.md
# ------------------------------------------------------------------------------------------------


def _resolve(path: str) -> Any:
    """The object at dotted ``path``: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        module_name = ".".join(parts[:cut])
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError: the caller reports it missing
        return obj
    raise ImportError(f"no module of {path!r} can be imported")


def _probes() -> dict[str, Any]:
    """Instances to look for instance attributes on: a small compiled model and its parts."""
    import numpy as np

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    iterator = JAXEpochIterator(x=np.zeros((4, 3), np.float32), batch_size=2)
    return {
        "keras.Model": model,
        "keras.layers.Layer": model.layers[0],
        "keras.optimizers.Optimizer": model.optimizer,
        "keras.Variable": model.variables[0],
        _EPOCH_ITERATOR: iterator,
    }


def check_internals(internals: tuple[Internal, ...] = INTERNALS) -> list[str]:
    """What differs between ``internals`` and the installed Keras: one line per entry that is missing or
    whose signature changed (empty: jaxdist's assumptions hold). Replaced attributes are checked as Keras
    defines them (before :func:`install_trainer_patches` replaced them)."""
    problems = []
    probes: dict[str, Any] | None = None
    for entry in internals:
        owner, _, name = entry.path.rpartition(".")
        try:
            if entry.on_instance:
                if probes is None:
                    probes = _probes()
                if owner not in probes:
                    problems.append(f"{entry.path}: no instance of {owner} to look for the attribute on")
                    continue
                if not hasattr(probes[owner], name):
                    problems.append(f"{entry.path}: missing (instances of {owner} have no attribute {name!r})")
                continue
            obj = _originals.get(entry.path) or _resolve(entry.path)
        except (ImportError, AttributeError) as e:
            problems.append(f"{entry.path}: missing ({type(e).__name__}: {e})")
            continue
        if entry.signature is None:
            continue
        try:
            found = str(inspect.signature(obj))
        except (TypeError, ValueError) as e:
            problems.append(f"{entry.path}: expected a callable with signature {entry.signature}, got {e}")
            continue
        if found != entry.signature:
            problems.append(f"{entry.path}: signature changed: expected {entry.signature}, found {found}")
    return problems


def markdown_table(internals: tuple[Internal, ...] = INTERNALS) -> str:
    """The registry as the Markdown table of ``docs/keras-internals.md`` (one row per entry, registry order)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|")

    rows = ["| Keras internal | kind | signature | jaxdist's use | used by |", "|---|---|---|---|---|"]
    for e in internals:
        signature = f"`{cell(e.signature)}`" if e.signature is not None else ("instance attribute" if e.on_instance else "")
        used_by = ", ".join(f"`{m}`" for m in e.used_by)
        rows.append(f"| `{e.path}` | {e.kind} | {signature} | {cell(e.use)} | {used_by} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``python -m jaxdist.keras``: check the installed Keras (exit 1 on a difference); ``--table``: print
    the registry as docs/keras-internals.md's table."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--table"]:
        sys.stdout.write(markdown_table())
        return 0
    if args:
        sys.stderr.write("usage: python -m jaxdist.keras [--table]\n")
        return 2
    problems = check_internals()
    for line in problems:
        print(line)
    counts = {k: sum(e.kind == k for e in INTERNALS) for k in KINDS}
    print(f"Keras {keras.__version__}: {len(INTERNALS)} internals ({', '.join(f'{n} {k}' for k, n in counts.items())}); "
          f"{len(problems)} changed")
    return 1 if problems else 0
