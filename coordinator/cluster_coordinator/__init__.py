"""jaxdist.cluster_coordinator: the coordinator role (TF's ``ClusterCoordinator``).

Users import :class:`ClusterCoordinator` and friends from :mod:`jaxdist`;
this package is where they are built:

- ``coordinator``: the facade (schedule/join/done/fetch/shutdown/status,
  paused) and the membership (add/remove workers, per-worker resources);
- ``dispatch``: the per-worker handles (send, receive, their threads);
- ``failure_handler``: what every failure means (sans-IO, clock injected);
- ``ps_recovery``: the PS watcher (checkpoint-mode recovery, replica failover);
- ``ps_failover``: the replica set (primary/backup of every PS shard);
- ``datasets``: per-worker datasets, the exactly-once data ledger;
- ``closure_queue``, ``remote_value``: closures, their queue and their results;
- ``servicer``: the Coordinator gRPC service (workers join and leave);
- ``monitoring``: the coordinator's Prometheus collector.
"""

from __future__ import annotations

from jaxdist.cluster_coordinator.coordinator import ClosureCounts, ClusterCoordinator
from jaxdist.cluster_coordinator.datasets import (
    DataLedger,
    ExactlyOnceDataset,
    ExactlyOnceIterator,
    PerWorkerDataset,
    PerWorkerDatasetIterator,
    steps_per_execution,
)

__all__ = [
    "ClosureCounts",
    "ClusterCoordinator",
    "DataLedger",
    "ExactlyOnceDataset",
    "ExactlyOnceIterator",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
    "steps_per_execution",
]
