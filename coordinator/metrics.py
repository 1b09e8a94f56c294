"""Prometheus metrics of jaxdist processes.

Every service (``jaxdist ps``, ``jaxdist worker``) exports metrics over HTTP
when given ``--metrics-port`` (0 picks a free port, announced in the ready
line as ``metrics_port=N``); a coordinator does with
:meth:`jaxdist.ClusterCoordinator.serve_metrics`.

Contract:

- Each :class:`MetricsExporter` has its own ``CollectorRegistry`` (nothing is
  registered in ``prometheus_client``'s global one), so several tasks in one
  process (tests) do not collide.
- Counters are read from the services' existing ``stats`` dicts *at scrape
  time* (custom collectors): the hot path pays nothing for them. The only
  per-call cost is the RPC latency histogram (:mod:`jaxdist.proto.rpc`).
- Names: ``jaxdist_ps_*``, ``jaxdist_worker_*``, ``jaxdist_coordinator_*``,
  ``jaxdist_rpc_server_*``; counters end in ``_total``; rates (updates/s,
  bytes/s) are ``rate()`` of the counters. Every registry also has
  ``jaxdist_task_info{role,index,incarnation}`` and the ``process_*`` metrics.
- The endpoint is plain HTTP without authentication: it shows counters and
  variable names, nothing else. Bind it (``--metrics-host``) where only your
  monitoring can reach it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import start_http_server
from prometheus_client.registry import Collector

from jaxdist.proto.rpc import dialable_host

logger = logging.getLogger(__name__)

__all__ = ["MetricsExporter", "PSCollector", "WorkerCollector", "CoordinatorCollector"]


class MetricsExporter:
    """A per-process Prometheus registry and its HTTP endpoint.

    Args:
        role: "ps", "worker" or "coordinator" (the ``jaxdist_task_info`` label).
        index: the task index.
        incarnation: the process's incarnation id (changes on restart).
    """

    def __init__(self, role: str, index: int, incarnation: str = "") -> None:
        self.role = role
        self.index = index
        self.incarnation = incarnation
        self.registry = CollectorRegistry(auto_describe=False)
        ProcessCollector(registry=self.registry)
        self.registry.register(_InfoCollector(self))
        self.host: str | None = None
        self.port: int | None = None
        self._httpd: Any = None
        self._lock = threading.Lock()

    def register(self, collector: Collector) -> None:
        self.registry.register(collector)

    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve ``/metrics`` on ``host:port`` (0: a free port) in a daemon thread; returns the port."""
        with self._lock:
            if self._httpd is not None:
                return self.port  # type: ignore[return-value]
            httpd, _thread = start_http_server(port, addr=host, registry=self.registry)
            self._httpd = httpd
            self.host = host
            self.port = int(httpd.server_port)
        logger.info("metrics on http://%s/metrics", self.address)
        return self.port

    @property
    def address(self) -> str:
        """``host:port`` of the endpoint (wildcard binds shown as 127.0.0.1)."""
        host = dialable_host(self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.port}"

    def stop(self) -> None:
        """Stop serving. Idempotent."""
        with self._lock:
            httpd, self._httpd = self._httpd, None
        if httpd is not None:
            httpd.shutdown()
            httpd.server_close()


class _InfoCollector(Collector):
    def __init__(self, exporter: MetricsExporter) -> None:
        self._exporter = exporter
        self._started = time.time()

    def collect(self) -> Iterator[Metric]:
        e = self._exporter
        info = GaugeMetricFamily("jaxdist_task_info", "This jaxdist task (value 1)", labels=["role", "index", "incarnation"])
        info.add_metric([e.role, str(e.index), e.incarnation], 1.0)
        yield info
        yield GaugeMetricFamily("jaxdist_task_start_time_seconds", "Unix time the task started", value=self._started)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


class PSCollector(Collector):
    """PS counters, read from the servicer's ``stats`` and its store at scrape time."""

    def __init__(self, servicer: Any) -> None:
        self._servicer = servicer

    def collect(self) -> Iterator[Metric]:
        sv = self._servicer
        stats = dict(sv.stats)
        store = sv.store
        yield _counter("jaxdist_ps_bytes_pulled", "Bytes of variable values sent to pullers", stats.get("bytes_pulled", 0.0))
        yield _counter("jaxdist_ps_bytes_pushed", "Bytes of updates received in pushes", stats.get("bytes_pushed", 0.0))
        yield _counter("jaxdist_ps_pulls", "Pull calls served", stats.get("pulls", 0.0))
        yield _counter("jaxdist_ps_pushes", "Push calls received (creates and updates)", stats.get("pushes", 0.0))
        yield _counter("jaxdist_ps_duplicates_dropped", "Pushes dropped because their update id was already applied",
                       stats.get("duplicates", 0.0))
        yield _counter("jaxdist_ps_updates_applied", "Atomic pushes applied to the store (rate() = updates/s)",
                       float(store.updates_applied))
        yield GaugeMetricFamily("jaxdist_ps_variables", "Variables (shards) held by this PS", value=float(len(store.info())))
        r = getattr(sv, "replication", None)
        if r is not None:
            from jaxdist.ps_server.replication import ROLE_CODES

            yield GaugeMetricFamily("jaxdist_ps_replica_role", "Replication role: 0 primary, 1 backup, 2 deposed",
                                    value=ROLE_CODES[r.role])
            yield GaugeMetricFamily("jaxdist_ps_replica_epoch", "Replication epoch of this task", value=float(r.epoch))
            yield GaugeMetricFamily("jaxdist_ps_replica_has_backup", "1 while a backup is attached to this primary",
                                    value=1.0 if r.backup else 0.0)
            yield _counter("jaxdist_ps_replica_forwarded", "Changes forwarded to the backup and acknowledged by it", float(r.forwarded))
            yield _counter("jaxdist_ps_replica_degraded", "Times the backup was lost and this primary went on alone",
                           float(r.degraded_events))
        per_var = getattr(sv, "variable_bytes", None)
        if per_var is not None:
            for direction in ("pulled", "pushed"):
                fam = CounterMetricFamily(f"jaxdist_ps_variable_bytes_{direction}", f"Bytes {direction}, per variable",
                                          labels=["variable"])
                for (d, name), nbytes in list(per_var.items()):
                    if d == direction:
                        fam.add_metric([name], nbytes)
                yield fam


class WorkerCollector(Collector):
    """Worker counters, read from the servicer's ``stats`` at scrape time."""

    def __init__(self, servicer: Any) -> None:
        self._servicer = servicer

    def collect(self) -> Iterator[Metric]:
        stats = dict(self._servicer.stats)
        yield _counter("jaxdist_worker_closures_done", "Closures that finished successfully", stats.get("closures_done", 0.0))
        yield _counter("jaxdist_worker_closures_failed", "Closures that raised", stats.get("closures_failed", 0.0))
        yield GaugeMetricFamily("jaxdist_worker_functions_cached", "Closure functions cached by digest",
                                value=stats.get("functions_cached", 0.0))
        if "bytes_in" in stats:
            yield _counter("jaxdist_worker_bytes_received", "Bytes of RunClosures requests", stats["bytes_in"])
            yield _counter("jaxdist_worker_bytes_sent", "Bytes of RunClosures responses", stats.get("bytes_out", 0.0))


class CoordinatorCollector(Collector):
    """Closure-queue and per-worker figures of a :class:`~jaxdist.ClusterCoordinator`."""

    def __init__(self, coordinator: Any) -> None:
        self._coord = coordinator

    def collect(self) -> Iterator[Metric]:
        q = self._coord._queue
        yield GaugeMetricFamily("jaxdist_coordinator_closures_queued", "Closures waiting for a worker", value=float(q.queued))
        yield GaugeMetricFamily("jaxdist_coordinator_closures_running", "Closures sent to a worker, no result yet",
                                value=float(q.inflight))
        yield _counter("jaxdist_coordinator_closures_done", "Closures that finished successfully", float(q.finished))
        yield _counter("jaxdist_coordinator_closures_failed", "Closures that failed with an error", float(q.failed))
        yield _counter("jaxdist_coordinator_closures_retried", "Closures re-queued after their worker failed", float(q.retried))
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


def parse_text(text: str) -> dict[str, float]:
    """Samples of a Prometheus text exposition as ``{'name{label="v",...}': value}`` (tests, tools)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def scrape(address: str, timeout: float = 5.0) -> dict[str, float]:
    """GET ``http://address/metrics`` and parse it with :func:`parse_text`."""
    import urllib.request

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout) as resp:  # noqa: S310 - http only
        return parse_text(resp.read().decode())
