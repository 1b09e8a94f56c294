"""Prometheus collector of a PS task (registered in its :class:`~jaxdist.base.monitoring.MetricsExporter`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from jaxdist.base.monitoring import counter
from jaxdist.ps_server.backup import ROLE_CODES

if TYPE_CHECKING:
    from jaxdist.ps_server.servicer import ParameterServerServicer

__all__ = ["PSCollector"]


class PSCollector(Collector):
    """PS counters, read from the servicer's counters, store and replication state at scrape time."""

    def __init__(self, servicer: ParameterServerServicer) -> None:
        self._servicer = servicer

    def collect(self) -> Iterator[Metric]:
        sv = self._servicer
        stats = sv.counters.snapshot()
        store = sv.store
        yield counter("jaxdist_ps_bytes_pulled", "Bytes of variable values sent to pullers", stats["bytes_pulled"])
        yield counter("jaxdist_ps_bytes_pushed", "Bytes of updates received in pushes", stats["bytes_pushed"])
        yield counter("jaxdist_ps_pulls", "Pull calls served", stats["pulls"])
        yield counter("jaxdist_ps_pushes", "Push calls received (creates and updates)", stats["pushes"])
        yield counter("jaxdist_ps_duplicates_dropped", "Pushes dropped because their update id was already applied",
                      stats["duplicates"])
        yield counter("jaxdist_ps_updates_applied", "Atomic pushes applied to the store (rate() = updates/s)",
                      float(store.updates_applied))
        yield counter("jaxdist_ps_shared_pass_pushes", "Exact row pushes applied in a pass over a table shared with other "
                      "pushes (deferred; a push into two tables counts two)", float(store.shared_pass_pushes))
        yield GaugeMetricFamily("jaxdist_ps_variables", "Variables (shards) held by this PS", value=float(len(store.info())))
        r = sv.replication
        yield GaugeMetricFamily("jaxdist_ps_replica_role", "Replication role: 0 primary, 1 backup, 2 deposed",
                                value=ROLE_CODES[r.role])
        yield GaugeMetricFamily("jaxdist_ps_replica_epoch", "Replication epoch of this task", value=float(r.epoch))
        yield GaugeMetricFamily("jaxdist_ps_replica_has_backup", "1 while a backup is attached to this primary",
                                value=1.0 if r.backup else 0.0)
        yield counter("jaxdist_ps_replica_forwarded", "Changes forwarded to the backup and acknowledged by it", float(r.forwarded))
        yield counter("jaxdist_ps_replica_degraded", "Times the backup was lost and this primary went on alone",
                      float(r.degraded_events))
        for direction in ("pulled", "pushed"):
            fam = CounterMetricFamily(f"jaxdist_ps_variable_bytes_{direction}", f"Bytes {direction}, per variable",
                                      labels=["variable"])
            for name, nbytes in sv.counters.variable_bytes(direction).items():
                fam.add_metric([name], nbytes)
            yield fam
        tables = sv.dynamic.stats()
        gauges = {"rows": "Rows held, per dynamic table (this shard)",
                  "bytes": "Bytes of rows and optimizer state, per dynamic table (this shard)",
                  "pending_keys": "Keys waiting for admission, per dynamic table (this shard)"}
        counts = {"inserts": "Rows inserted, per dynamic table", "admissions_refused":
                  "Gradient rows dropped because their key was not admitted, per dynamic table",
                  "evictions": "Rows evicted (capacity or time-to-live), per dynamic table",
                  "pushes": "Pushes applied, per dynamic table"}
        for stat, doc in gauges.items():
            g = GaugeMetricFamily(f"jaxdist_ps_dynamic_{stat}", doc, labels=["table"])
            for name, st in tables.items():
                g.add_metric([name], float(st[stat]))
            yield g
        for stat, doc in counts.items():
            c = CounterMetricFamily(f"jaxdist_ps_dynamic_{stat}", doc, labels=["table"])
            for name, st in tables.items():
                c.add_metric([name], float(st[stat]))
            yield c
