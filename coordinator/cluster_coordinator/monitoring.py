"""Prometheus collector of the coordinator (:meth:`ClusterCoordinator.serve_metrics`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxdist.base.monitoring import counter

if TYPE_CHECKING:
    from jaxdist.cluster_coordinator.coordinator import ClusterCoordinator

__all__ = ["CoordinatorCollector"]


class CoordinatorCollector(Collector):
    """Closure-queue and per-worker figures of a :class:`~jaxdist.ClusterCoordinator`."""

    def __init__(self, coordinator: ClusterCoordinator) -> None:
        self._coord = coordinator

    def collect(self) -> Iterator[Metric]:
        q = self._coord.closure_counts
        yield GaugeMetricFamily("jaxdist_coordinator_closures_queued", "Closures waiting for a worker", value=float(q.queued))
        yield GaugeMetricFamily("jaxdist_coordinator_closures_running", "Closures sent to a worker, no result yet",
                                value=float(q.running))
        yield counter("jaxdist_coordinator_closures_done", "Closures that finished successfully", float(q.finished))
        yield counter("jaxdist_coordinator_closures_failed", "Closures that failed with an error", float(q.failed))
        yield counter("jaxdist_coordinator_closures_retried", "Closures re-queued after their worker failed", float(q.retried))
        rows = self._coord.status()
        healthy = GaugeMetricFamily("jaxdist_coordinator_worker_healthy", "1 when the worker takes closures, 0 when failed",
                                    labels=["worker", "address"])
        done = CounterMetricFamily("jaxdist_coordinator_worker_closures_done", "Closures finished, per worker",
                                   labels=["worker", "address"])
        failures = CounterMetricFamily("jaxdist_coordinator_worker_failures", "Times the worker was declared failed",
                                       labels=["worker", "address"])
        for r in rows:
            labels = [r["task"], r["address"]]
            healthy.add_metric(labels, 1.0 if r["healthy"] else 0.0)
            done.add_metric(labels, float(r["closures_done"]))
            failures.add_metric(labels, float(r["failures"]))
        yield healthy
        yield done
        yield failures
