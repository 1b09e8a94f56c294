"""Synchronous strategies (all-reduce on XLA collectives).

Public names (re-exported from :mod:`jaxdist`):

- strategies: :class:`MirroredStrategy`, :class:`TPUStrategy`,
  :class:`OneDeviceStrategy`, :class:`CentralStorageStrategy`,
  :class:`MultiWorkerMirroredStrategy`; ``strategy.extended``
  (:class:`StrategyExtended`);
- context: :func:`get_strategy`, :func:`get_replica_context`,
  :func:`in_cross_replica_context`, :func:`has_strategy`, :class:`ReplicaContext`;
- variables: :func:`create_variable`, :func:`create_variables`,
  :func:`read_variables`, :func:`assign_variables`, :class:`SyncVariable`,
  :class:`VariableSynchronization`, :class:`VariableAggregation`;
- training: :class:`Optimizer`, :func:`function`, ``strategy.run_steps`` / ``run_epoch``;
- collectives: :class:`CrossDeviceOps`, :class:`NcclAllReduce`,
  :class:`HierarchicalCopyAllReduce`, :class:`ReductionToOneDevice`,
  :class:`CommunicationOptions`, :class:`CommunicationImplementation`;
- values and input: :class:`ReduceOp`, :class:`PerReplica`,
  :class:`InputContext`, :class:`ValueContext`, :class:`InputOptions`,
  :class:`InputReplicationMode`, :func:`replicate`, :func:`replicated` (declare
  values that must be the same on every replica: an error, not a silent drift);
- loss helpers: :func:`compute_average_loss`, :func:`scale_regularization_loss`;
- TPU set-up: :func:`experimental_connect_to_cluster`,
  :func:`initialize_tpu_system`, :class:`Topology`, :class:`DeviceAssignment`.
"""

from __future__ import annotations

from jaxdist.base.input_context import InputContext, ValueContext
from jaxdist.sync.context import (
    ReplicaContext,
    get_replica_context,
    get_strategy,
    has_strategy,
    in_cross_replica_context,
)
from jaxdist.sync.declare import replicated
from jaxdist.sync.cross_device_ops import (
    CollectiveCommunication,
    CommunicationImplementation,
    CommunicationOptions,
    CrossDeviceOps,
    HierarchicalCopyAllReduce,
    NcclAllReduce,
    ReductionToOneDevice,
)
from jaxdist.sync.extended import StrategyExtended
from jaxdist.sync.function import function
from jaxdist.sync.input_lib import InputOptions, InputReplicationMode
from jaxdist.sync.losses import compute_average_loss, scale_regularization_loss
from jaxdist.sync.multi_worker import EXIT_PEER_FAILED, MultiWorkerMirroredStrategy, PeerFailedError
from jaxdist.sync.optimizer import Optimizer
from jaxdist.sync.reduce_op import ReduceOp
from jaxdist.sync.strategies import CentralStorageStrategy, MirroredStrategy, OneDeviceStrategy, TPUStrategy
from jaxdist.sync.strategy import AXIS, Strategy, replicate
from jaxdist.sync.tpu import DeviceAssignment, Topology, experimental_connect_to_cluster, initialize_tpu_system
from jaxdist.sync.values import PerReplica
from jaxdist.sync.variables import (
    SyncVariable,
    VariableAggregation,
    VariableSynchronization,
    assign_variables,
    create_variable,
    create_variables,
    read_variables,
)

__all__ = [
    "AXIS",
    "CentralStorageStrategy",
    "CollectiveCommunication",
    "CommunicationImplementation",
    "CommunicationOptions",
    "CrossDeviceOps",
    "DeviceAssignment",
    "EXIT_PEER_FAILED",
    "HierarchicalCopyAllReduce",
    "InputContext",
    "InputOptions",
    "InputReplicationMode",
    "MirroredStrategy",
    "MultiWorkerMirroredStrategy",
    "NcclAllReduce",
    "OneDeviceStrategy",
    "Optimizer",
    "PeerFailedError",
    "PerReplica",
    "ReduceOp",
    "ReductionToOneDevice",
    "ReplicaContext",
    "Strategy",
    "StrategyExtended",
    "SyncVariable",
    "TPUStrategy",
    "Topology",
    "ValueContext",
    "VariableAggregation",
    "VariableSynchronization",
    "assign_variables",
    "compute_average_loss",
    "create_variable",
    "create_variables",
    "experimental_connect_to_cluster",
    "function",
    "get_replica_context",
    "get_strategy",
    "has_strategy",
    "in_cross_replica_context",
    "initialize_tpu_system",
    "read_variables",
    "replicate",
    "replicated",
    "scale_regularization_loss",
]
