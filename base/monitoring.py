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
  per-call cost is the RPC latency histogram (:mod:`jaxdist.transport.server`).
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

from jaxdist.transport.channel import dialable_host

logger = logging.getLogger(__name__)

__all__ = ["MetricsExporter", "counter", "parse_text", "scrape"]


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


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    """A counter family with one sample (collectors build these at scrape time)."""
    return CounterMetricFamily(name, doc, value=value)


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
