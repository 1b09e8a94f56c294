"""Metrics move with the work (PS, worker, coordinator /metrics scraped over HTTP), and ``jaxdist status``
prints a row for every task."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.base.monitoring import parse_text, scrape
from jaxdist.testing import poll_for

pytestmark = [pytest.mark.timeout(240), pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[Any, Any, Any]]:
    """A 2-PS / 2-worker LocalCluster (metrics on), a coordinator with metrics, a model on both PS."""
    with jaxdist.LocalCluster(num_workers=2, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            params = jaxdist.create_variables({"w": np.zeros((64, 4), np.float32), "b": np.zeros(4, np.float32)},
                                              optimizer=optax.sgd(0.01))
        coord = jaxdist.ClusterCoordinator(strategy)
        coord.serve_metrics(port=0)
        yield cluster, coord, params
        coord.shutdown()


def _run_closures(coord: Any, params: Any, n: int) -> None:
    def step() -> None:
        p = jaxdist.pull(params)
        jaxdist.apply_gradients(params, {k: np.ones_like(v) for k, v in p.items()})

    for _ in range(n):
        coord.schedule(step)
    coord.join()


def _metric(samples: dict[str, float], name: str) -> float:
    assert name in samples, f"{name} not exported; have {sorted(k for k in samples if k.startswith('jaxdist'))}"
    return samples[name]


def test_metrics_endpoints_count_the_work(trained: tuple[Any, Any, Any]) -> None:
    cluster, coord, params = trained
    _run_closures(coord, params, 10)
    ps_addr = [cluster.metrics_address(f"ps:{i}") for i in range(2)]
    w_addr = [cluster.metrics_address(f"worker:{i}") for i in range(2)]
    before_ps = [scrape(a) for a in ps_addr]
    before_w = [scrape(a) for a in w_addr]
    before_c = scrape(f"127.0.0.1:{coord.serve_metrics()}")  # idempotent: the same port
    _run_closures(coord, params, 30)
    after_ps = [scrape(a) for a in ps_addr]
    after_w = [scrape(a) for a in w_addr]
    after_c = scrape(f"127.0.0.1:{coord.serve_metrics()}")

    for addr, b, a in zip(ps_addr, before_ps, after_ps):
        for name in ("jaxdist_ps_pulls_total", "jaxdist_ps_pushes_total", "jaxdist_ps_bytes_pulled_total",
                     "jaxdist_ps_bytes_pushed_total", "jaxdist_ps_updates_applied_total"):
            assert _metric(a, name) > _metric(b, name), name
        # Each PS holds one of the two variables; every closure pulled and pushed it exactly once.
        assert _metric(a, "jaxdist_ps_updates_applied_total") - _metric(b, "jaxdist_ps_updates_applied_total") == 30
        assert _metric(a, "jaxdist_ps_variables") == 1
        assert _metric(a, "jaxdist_ps_duplicates_dropped_total") == 0
        push = 'jaxdist_rpc_server_latency_seconds_count{method="jaxdist.ParameterServer/Push"}'
        # A call's latency is recorded when the server has finished it, which can be just after the
        # client has its answer: wait for the last ones rather than race them.
        poll_for(lambda addr=addr, b=b: _metric(scrape(addr), push) - _metric(b, push) >= 30, 10,
                 what="the 30 pushes' latencies to be recorded")
        assert _metric(scrape(addr), push) - _metric(b, push) == 30
    var_bytes = {k: v for a in after_ps for k, v in a.items() if k.startswith("jaxdist_ps_variable_bytes_pushed_total")}
    # Sizes: w is 64x4 float32 (1 KiB), b is 4 float32; 40 pushes of each so far.
    assert var_bytes == {'jaxdist_ps_variable_bytes_pushed_total{variable="params/w"}': 40 * 1024.0,
                         'jaxdist_ps_variable_bytes_pushed_total{variable="params/b"}': 40 * 16.0}

    done = [_metric(a, "jaxdist_worker_closures_done_total") - _metric(b, "jaxdist_worker_closures_done_total")
            for b, a in zip(before_w, after_w)]
    assert sum(done) == 30
    for b, a in zip(before_w, after_w):
        assert _metric(a, "jaxdist_worker_functions_cached") >= 1
        assert _metric(a, "jaxdist_worker_closures_failed_total") == 0
        assert _metric(a, "jaxdist_worker_bytes_received_total") >= _metric(b, "jaxdist_worker_bytes_received_total")
        assert re.search(r'jaxdist_task_info\{incarnation="[0-9a-f]{32}",index="\d",role="worker"\}', " ".join(a))

    assert _metric(after_c, "jaxdist_coordinator_closures_done_total") - _metric(before_c, "jaxdist_coordinator_closures_done_total") == 30
    assert _metric(after_c, "jaxdist_coordinator_closures_queued") == 0
    assert _metric(after_c, "jaxdist_coordinator_closures_running") == 0
    for i in range(2):
        key = f'jaxdist_coordinator_worker_healthy{{address="{cluster.address(f"worker:{i}")}",worker="worker:{i}"}}'
        assert _metric(after_c, key) == 1.0


def test_metrics_are_prometheus_text(trained: tuple[Any, Any, Any]) -> None:
    cluster, _coord, _params = trained
    with urllib.request.urlopen(f"http://{cluster.metrics_address('ps:0')}/metrics", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    assert "# TYPE jaxdist_ps_updates_applied_total counter" in text
    assert "# TYPE jaxdist_rpc_server_latency_seconds histogram" in text
    info = [v for k, v in parse_text(text).items() if k.startswith("jaxdist_task_info{") and 'role="ps"' in k]
    assert info == [1.0]


def _status(cluster: Any, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **cluster.coordinator_env()}
    return subprocess.run([sys.executable, "-m", "jaxdist.tools.cli", "status", *args], env=env, capture_output=True, text=True, timeout=60)


def test_status_command_shows_every_task(trained: tuple[Any, Any, Any], tmp_path: Path) -> None:
    cluster, coord, params = trained
    _run_closures(coord, params, 5)
    r = _status(cluster)  # cluster and token from JAXDIST_CLUSTER / JAXDIST_TOKEN, as `jaxdist launch` exports them
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert lines[1].split() == ["TASK", "ADDRESS", "HEALTH", "UPTIME", "WORK", "IN", "OUT", "THROUGHPUT", "NET/s"]
    for task in ("ps:0", "ps:1", "worker:0", "worker:1"):
        row = next((ln for ln in lines if ln.startswith(task + " ")), None)
        assert row is not None, f"no row for {task}:\n{r.stdout}"
        assert cluster.address(task) in row and " up " in row, row
        assert ("updates" if task.startswith("ps") else "closures") in row and ("upd/s" in row or "cl/s" in row), row
    assert "4/4 tasks answering" in lines[-1]

    # --cluster @file, --token, JSON output, two refreshes (--watch), a TF_CONFIG-style object.
    spec = tmp_path / "cluster.json"
    spec.write_text(json.dumps({"cluster": cluster.cluster_spec.as_dict(), "task": {"type": "chief", "index": 0}}))
    env = {k: v for k, v in os.environ.items() if k not in ("JAXDIST_CLUSTER", "JAXDIST_TOKEN", "TF_CONFIG")}
    r = subprocess.run([sys.executable, "-m", "jaxdist.tools.cli", "status", "--cluster", f"@{spec}", "--token", cluster.token,
                        "--json", "--watch", "0.2", "--count", "2"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    refreshes = [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]
    assert len(refreshes) == 2
    assert {t["task"] for t in refreshes[1]["tasks"]} == {"ps:0", "ps:1", "worker:0", "worker:1"}
    assert all(t["health"] == "up" and t["work_rate"] is not None for t in refreshes[1]["tasks"])


def test_status_with_a_wrong_token_or_dead_task(trained: tuple[Any, Any, Any]) -> None:
    cluster, _coord, _params = trained
    spec = json.dumps(cluster.cluster_spec.as_dict())
    r = _status(cluster, "--cluster", spec, "--token", "not-the-token")
    assert r.returncode == 1
    assert r.stdout.count(" AUTH ") == 4, r.stdout
    dead = json.dumps({"ps": [cluster.address("ps:0")], "worker": ["127.0.0.1:9"]})  # port 9: nothing listens
    r = _status(cluster, "--cluster", dead, "--timeout", "2")
    assert r.returncode == 1
    assert re.search(r"^worker:0\s+127\.0\.0\.1:9\s+DOWN\s", r.stdout, re.M), r.stdout
    assert "1/2 tasks answering" in r.stdout


def test_status_argument_errors() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("JAXDIST_CLUSTER", "TF_CONFIG")}
    r = subprocess.run([sys.executable, "-m", "jaxdist.tools.cli", "status"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "no cluster given" in r.stderr
    r = subprocess.run([sys.executable, "-m", "jaxdist.tools.cli", "status", "--cluster", "{not json"], env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and "not JSON" in r.stderr
