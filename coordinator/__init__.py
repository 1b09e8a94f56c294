"""jaxdist: distributed training for JAX.

Parameter-server training (``ParameterServerStrategy`` + ``ClusterCoordinator``)
on gRPC, and synchronous strategies on XLA collectives.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Every public name is imported when first used (PEP 562's module ``__getattr__``), not by ``import jaxdist``:
# ``jaxdist/__init__`` runs first in every process that imports anything of jaxdist, a PS or worker task too
# (``python -m jaxdist.ps_server`` imports ``jaxdist`` before ``jaxdist.ps_server``), and importing the whole
# public API (the sync wing, optax, the metrics, the coordinator) cost those processes about 1.3 CPU-seconds
# each for modules they never use. ``from jaxdist import X``, ``jaxdist.X``, ``dir(jaxdist)`` and ``__all__``
# are as before; ``tests/unit/test_lazy_imports.py`` checks that a task's entry module imports no more than it
# needs. The imports below are the same names for type checkers and readers.
from jaxdist import keras_bridge

if TYPE_CHECKING:
    from jaxdist import cluster_resolver, errors, metrics
    from jaxdist.checkpoint import Checkpoint, CheckpointManager, latest_checkpoint
    from jaxdist.cluster_coordinator import (
        ClusterCoordinator,
        DataLedger,
        PerWorkerDataset,
        PerWorkerDatasetIterator,
        steps_per_execution,
    )
    from jaxdist.cluster_resolver import (
        ClusterResolver,
        ClusterSpec,
        SimpleClusterResolver,
        TFConfigClusterResolver,
        TPUClusterResolver,
    )
    from jaxdist.base.errors import (
        CancelledError,
        JaxdistError,
        OutOfRangeError,
        PSUnavailableError,
        WorkerUnavailableError,
    )
    from jaxdist.base.input_context import InputContext
    from jaxdist.local_cluster import LocalCluster
    from jaxdist.partitioners import (
        FixedShardsPartitioner,
        MaxSizePartitioner,
        MinSizePartitioner,
        Partitioner,
    )
    from jaxdist.cluster_coordinator.remote_value import PerWorkerValues, RemoteValue, RemoteValueStatus
    from jaxdist.dynamic_embedding import DynamicEmbedding
    from jaxdist.sharded_variable import ShardedVariable, embedding_lookup
    from jaxdist.strategy import ParameterServerStrategy, create_variable, create_variables
    from jaxdist.sync import (
        CentralStorageStrategy,
        CollectiveCommunication,
        CommunicationImplementation,
        CommunicationOptions,
        CrossDeviceOps,
        DeviceAssignment,
        HierarchicalCopyAllReduce,
        InputOptions,
        InputReplicationMode,
        MirroredStrategy,
        MultiWorkerMirroredStrategy,
        NcclAllReduce,
        OneDeviceStrategy,
        Optimizer,
        PerReplica,
        ReduceOp,
        ReductionToOneDevice,
        ReplicaContext,
        SyncVariable,
        TPUStrategy,
        Topology,
        VariableAggregation,
        VariableSynchronization,
        assign_variables,
        compute_average_loss,
        experimental_connect_to_cluster,
        function,
        get_replica_context,
        get_strategy,
        in_cross_replica_context,
        initialize_tpu_system,
        read_variables,
        replicated,
        scale_regularization_loss,
    )
    from jaxdist.ps_server.optimizer import lazy_rows, row_separable
    from jaxdist.variables import SparseGradient, Variable, apply_gradients, pull, push_pull
    from jaxdist.worker.context import current_sync_step, current_worker_index

__version__ = "0.1.0"

__all__ = [
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DeviceAssignment",
    "HierarchicalCopyAllReduce",
    "InputOptions",
    "InputReplicationMode",
    "NcclAllReduce",
    "Optimizer",
    "ReductionToOneDevice",
    "SyncVariable",
    "TPUClusterResolver",
    "Topology",
    "VariableAggregation",
    "VariableSynchronization",
    "assign_variables",
    "experimental_connect_to_cluster",
    "function",
    "in_cross_replica_context",
    "initialize_tpu_system",
    "metrics",
    "read_variables",
    "replicated",
    "CancelledError",
    "CentralStorageStrategy",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "OneDeviceStrategy",
    "PerReplica",
    "ReduceOp",
    "ReplicaContext",
    "TPUStrategy",
    "compute_average_loss",
    "get_replica_context",
    "get_strategy",
    "scale_regularization_loss",
    "Checkpoint",
    "CheckpointManager",
    "ClusterCoordinator",
    "ClusterResolver",
    "ClusterSpec",
    "DataLedger",
    "DynamicEmbedding",
    "FixedShardsPartitioner",
    "InputContext",
    "JaxdistError",
    "LocalCluster",
    "MaxSizePartitioner",
    "MinSizePartitioner",
    "OutOfRangeError",
    "PSUnavailableError",
    "ParameterServerStrategy",
    "Partitioner",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
    "PerWorkerValues",
    "RemoteValue",
    "RemoteValueStatus",
    "ShardedVariable",
    "SimpleClusterResolver",
    "SparseGradient",
    "TFConfigClusterResolver",
    "Variable",
    "WorkerUnavailableError",
    "apply_gradients",
    "create_variable",
    "create_variables",
    "current_sync_step",
    "current_worker_index",
    "embedding_lookup",
    "latest_checkpoint",
    "lazy_rows",
    "cluster_resolver",
    "errors",
    "pull",
    "push_pull",
    "row_separable",
    "steps_per_execution",
]

#: Where each public name is defined: module -> names (``__getattr__`` imports the module when a name is used).
_EXPORTS: dict[str, tuple[str, ...]] = {
    "jaxdist.checkpoint": ("Checkpoint", "CheckpointManager", "latest_checkpoint"),
    "jaxdist.cluster_coordinator": (
        "ClusterCoordinator", "DataLedger", "PerWorkerDataset", "PerWorkerDatasetIterator",
        "steps_per_execution",
    ),
    "jaxdist.cluster_resolver": (
        "ClusterResolver", "ClusterSpec", "SimpleClusterResolver", "TFConfigClusterResolver",
        "TPUClusterResolver",
    ),
    "jaxdist.base.errors": (
        "CancelledError", "JaxdistError", "OutOfRangeError", "PSUnavailableError", "WorkerUnavailableError",
    ),
    "jaxdist.base.input_context": ("InputContext",),
    "jaxdist.local_cluster": ("LocalCluster",),
    "jaxdist.partitioners": ("FixedShardsPartitioner", "MaxSizePartitioner", "MinSizePartitioner", "Partitioner"),
    "jaxdist.cluster_coordinator.remote_value": ("PerWorkerValues", "RemoteValue", "RemoteValueStatus"),
    "jaxdist.dynamic_embedding": ("DynamicEmbedding",),
    "jaxdist.sharded_variable": ("ShardedVariable", "embedding_lookup"),
    "jaxdist.strategy": ("ParameterServerStrategy", "create_variable", "create_variables"),
    "jaxdist.sync": (
        "CentralStorageStrategy", "CollectiveCommunication", "CommunicationImplementation",
        "CommunicationOptions", "CrossDeviceOps", "DeviceAssignment", "HierarchicalCopyAllReduce",
        "InputOptions", "InputReplicationMode", "MirroredStrategy", "MultiWorkerMirroredStrategy",
        "NcclAllReduce", "OneDeviceStrategy", "Optimizer", "PerReplica", "ReduceOp", "ReductionToOneDevice",
        "ReplicaContext", "SyncVariable", "TPUStrategy", "Topology", "VariableAggregation",
        "VariableSynchronization", "assign_variables", "compute_average_loss",
        "experimental_connect_to_cluster", "function", "get_replica_context", "get_strategy",
        "in_cross_replica_context", "initialize_tpu_system", "read_variables", "replicated",
        "scale_regularization_loss",
    ),
    "jaxdist.ps_server.optimizer": ("lazy_rows", "row_separable"),
    "jaxdist.variables": ("SparseGradient", "Variable", "apply_gradients", "pull", "push_pull"),
    "jaxdist.worker.context": ("current_sync_step", "current_worker_index"),
}
_SOURCE: dict[str, str] = {name: module for module, names in _EXPORTS.items() for name in names}

#: Public submodules, and the modules ``import jaxdist`` imported before its names became lazy, reachable as
#: attributes of the package (``jaxdist.strategy.X`` without ``import jaxdist.strategy``) as they were. Not
#: ``jaxdist.keras``: it needs the keras extra and is imported only when asked for (``import jaxdist.keras``).
_SUBMODULES = frozenset({
    "base", "checkpoint", "cluster_coordinator", "cluster_resolver", "dynamic_embedding", "errors", "local_cluster",
    "metrics", "partitioners", "proto", "ps_methods", "ps_server", "sharded_variable", "strategy", "sync",
    "transport", "variables", "worker",
})


# The Keras integration (jaxdist.keras) needs the keras extra and selects Keras's JAX backend when imported,
# so the public API reaches it only lazily, through jaxdist.keras_bridge: strategy.scope() enters Keras's view
# of the strategy once Keras is in use (a scope hook of the sync core, which never imports jaxdist.keras), and
# jaxdist.SidecarEvaluator (TF's name for it, a Keras evaluator) is imported when first asked for.
keras_bridge.install_scope_hook()


def __getattr__(name: str) -> object:
    """Import a public name (or submodule) on first use; later uses find it in the module's globals."""
    module = _SOURCE.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"{__name__}.{name}")
    elif name == "SidecarEvaluator":
        return keras_bridge.sidecar_evaluator()
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__) | _SUBMODULES)
