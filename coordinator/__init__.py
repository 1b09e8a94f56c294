"""jaxdist: distributed training for JAX.

Parameter-server training (``ParameterServerStrategy`` + ``ClusterCoordinator``)
on gRPC, and synchronous strategies on XLA collectives.
"""

from __future__ import annotations

from jaxdist import cluster_resolver, errors, keras_bridge, metrics
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
from jaxdist.ps_server.optimizer import lazy_rows
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
    "steps_per_execution",
]


# The Keras integration (jaxdist.keras) needs the keras extra and selects Keras's JAX backend when imported,
# so the public API reaches it only lazily, through jaxdist.keras_bridge: strategy.scope() enters Keras's view
# of the strategy once Keras is in use (a scope hook of the sync core, which never imports jaxdist.keras), and
# jaxdist.SidecarEvaluator (TF's name for it, a Keras evaluator) is imported when first asked for.
keras_bridge.install_scope_hook()


def __getattr__(name: str) -> object:
    if name == "SidecarEvaluator":
        return keras_bridge.sidecar_evaluator()
    raise AttributeError(f"module 'jaxdist' has no attribute {name!r}")
