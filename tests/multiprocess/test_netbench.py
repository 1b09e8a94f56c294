"""bench/netbench.py in short: one round at 1 Gbit/s per link, small sizes. The JSON schema, the bare
TCP stream near the configured rate, and jaxdist never faster than its links allow (its tensors
really crossed them: no same-host shared memory). Root and network namespaces are needed (skips,
saying why, otherwise); without TensorFlow the jaxdist side and the link are still run and checked.

Every namespace carries a random tag given to the run; whatever happens (a failure, a timeout that
kills netbench), the fixture removes the namespaces with that tag and kills what still runs in them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.timeout(900)]

BENCH = Path(__file__).resolve().parents[2] / "bench"
NETBENCH = BENCH / "netbench.py"
RATE, RATE_BITS = "1gbit", 1e9
CONFIGURED_MBPS = RATE_BITS / 8 / 2**20  # 119.2 MB/s (MB = 2**20 bytes, as in the benchmark)
SIZE_MB = 16
MLP_STEPS = 20
RUN_TIMEOUT_S = 700


def _load_netbench() -> Any:
    spec = importlib.util.spec_from_file_location("netbench", NETBENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def netbench() -> Any:
    return _load_netbench()


@pytest.fixture(scope="module")
def run(netbench: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    why = netbench.unavailable()
    if why:
        pytest.skip(f"netbench cannot build its emulated cluster here: {why}")
    tag = f"nt{secrets.token_hex(3)}"
    out = tmp_path_factory.mktemp("netbench") / "netbench.jsonl"
    cmd = [sys.executable, str(NETBENCH), "--rounds", "1", "--rates", RATE, "--size-mb", str(SIZE_MB), "--mlp-steps",
           str(MLP_STEPS), "--noop-closures", "200", "--timeout", "300", "--tag", tag, "--out", str(out),
           "--staleness-modes", "async,0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAXDIST_")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        try:
            stdout, stderr = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)  # netbench removes its namespaces on SIGTERM...
            try:
                stdout, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                stdout, stderr = proc.communicate()
            pytest.fail(f"netbench did not finish in {RUN_TIMEOUT_S}s; stderr tail:\n{stderr[-3000:]}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        leftover = netbench.remove_tagged(tag)  # ...and this removes them whatever happened to it
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    yield {"rc": proc.returncode, "lines": lines, "stderr": stderr, "out": out, "tag": tag, "leftover": leftover}


def _one(lines: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    found = [r for r in lines if all(r.get(k) == v for k, v in match.items())]
    assert len(found) == 1, (match, found)
    return found[0]


def _summary(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["workload"]: r for r in lines if r.get("kind") == "summary"}


def test_link_reference_and_jaxdist_over_the_links(run: dict[str, Any]) -> None:
    lines, stderr = run["lines"], run["stderr"]
    assert run["rc"] == 0, stderr[-4000:]
    assert not [r for r in lines if r.get("kind") == "failure"], stderr[-4000:]
    assert run["leftover"] == [], "netbench left namespaces behind"
    assert [json.loads(line) for line in run["out"].read_text().splitlines()] == lines  # same lines in --out

    config = lines[0]
    assert config["kind"] == "config" and config["rates"] == [RATE] and config["rate_bits"] == [RATE_BITS]
    assert config["size_mb"] == SIZE_MB and config["jaxdist_env"] == {"JAXDIST_SHM": "0"}
    lab = _one(lines, kind="lab")
    assert lab["tag"] == run["tag"] and lab["burst_bytes"] == 125_000 and lab["latency"] == "20ms"
    assert set(lab["hosts"]) == {"co", "ps0", "ps1", "w0", "w1"} and len(set(lab["hosts"].values())) == 5

    # The link's own rate: one bare TCP stream through two limited links. tbf counts Ethernet frames,
    # so ~95.6% of the configured rate is TCP payload; the limiter must hold (<= configured + the burst's
    # overshoot), and a loaded 2-core machine must still get well over half of it.
    link_run = _one(lines, kind="link_run")
    link = _one(lines, kind="link")
    for d in ("down", "up"):
        assert 0.6 * CONFIGURED_MBPS <= link_run[f"{d}_MBps"] <= 1.02 * CONFIGURED_MBPS, link_run
        assert link[f"{d}_MBps"] == link_run[f"{d}_MBps"] and link[f"{d}_rounds"] == [link_run[f"{d}_MBps"]]
    assert link["configured_MBps"] == pytest.approx(CONFIGURED_MBPS, abs=0.01)
    for d in ("down", "up"):  # two streams at once: started together, so only the limiter's bound is certain
        assert 0 < link_run[f"pair_{d}_MBps"] <= 2 * 1.02 * CONFIGURED_MBPS, link_run
        assert link[f"pair_{d}_MBps"] == link_run[f"pair_{d}_MBps"]

    rows = _summary(lines)
    names = ["noop_closures_per_s", f"pull_{SIZE_MB}MB_MBps", f"push_{SIZE_MB}MB_MBps", "mlp_steps_per_s"]
    assert list(rows) == names
    for row in rows.values():
        assert row["rate"] == RATE and row["rounds"] == 1
        assert isinstance(row["jaxdist_median"], float) and row["jaxdist_median"] > 0, row
        assert row["jaxdist_rounds"] == [row["jaxdist_median"]]
        assert row["jaxdist_transport"] == "tcp", row  # the data plane's socket: not shared memory, not gRPC
    transport = _one(lines, kind="transport", staleness_run=None)
    assert transport["used"] == ["tcp"] and set(transport["workers"]) == {"worker:0", "worker:1"}
    assert all(t == ["tcp", "tcp"] for t in transport["workers"].values()), transport
    for name in (f"pull_{SIZE_MB}MB_MBps", f"push_{SIZE_MB}MB_MBps"):
        rec = _one(lines, system="jaxdist", workload=name)
        assert rec["cluster"] == "given" and rec["transport"] == "tcp" and rec["workers"] == 2 and rec["ps"] == 2

    # The bytes crossed the limited links: 2 workers use 2 links at once, so no pull or push can beat
    # 2 x the configured rate (shared memory would run at several times that), nor the MLP the steps/s
    # at which 2 links carry its parameters.
    pull, push, mlp = rows[names[1]], rows[names[2]], rows[names[3]]
    for row, stream in ((pull, link["down_MBps"]), (push, link["up_MBps"])):
        assert row["link_MBps"] == stream and row["link_bound"] == pytest.approx(2 * stream, abs=0.02)
        assert row["jaxdist_median"] <= 2 * CONFIGURED_MBPS * 1.05, row
        assert row["jaxdist_fraction_of_link"] == pytest.approx(row["jaxdist_median"] / row["link_bound"], abs=1e-3)
        assert row["target"] == "jaxdist >= 0.9 of the link" and row["met"] in (True, False)
        assert row["jaxdist_fraction_of_pair"] == pytest.approx(row["jaxdist_median"] / row["link_pair_MBps"], abs=1e-3)
    param_mb = 4 * (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10) / 2**20
    assert mlp["jaxdist_median"] <= 2 * CONFIGURED_MBPS * 1.05 / param_mb, mlp
    assert mlp["target"] == "jaxdist >= 2x TF"
    assert _one(lines, kind="qdisc")["drops"] >= 0
    assert f"rate {RATE}: configured" in stderr and "jaxdist moved tensors over: tcp" in stderr


def test_staleness_modes_side_by_side_over_the_links(run: dict[str, Any]) -> None:
    """--staleness-modes async,0: one MLP-only jaxdist run per mode, each summarised; the synchronous
    run applied one optimizer step per pair of worker steps, and every tensor crossed the links."""
    lines = run["lines"]
    assert run["rc"] == 0, run["stderr"][-4000:]
    assert lines[0]["staleness_modes"] == ["async", "0"]
    rows = [r for r in lines if r.get("kind") == "staleness_summary"]
    assert [r["staleness"] for r in rows] == ["async", "0"]
    sync_rec = _one(lines, system="jaxdist", workload="mlp_steps_per_s", staleness="0")
    async_rec = _one(lines, system="jaxdist", workload="mlp_steps_per_s", staleness="async")
    assert sync_rec["steps"] == MLP_STEPS and sync_rec["applied_steps"] == MLP_STEPS // 2  # 2 workers, s=0
    assert "applied_steps" not in async_rec  # no step barrier, nothing to count
    for row, rec in zip(rows, (async_rec, sync_rec)):
        assert row["jaxdist_rounds"] == [rec["median"]] and row["jaxdist_median"] == rec["median"] > 0
        # Never faster than the links carry the parameters (one pull and one push per worker step).
        param_mb = 4 * (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10) / 2**20
        assert row["jaxdist_median"] <= 2 * CONFIGURED_MBPS * 1.05 / param_mb, row
    assert rows[0]["ratio_to_async"] == 1.0
    assert rows[1]["ratio_to_async"] == pytest.approx(rows[1]["jaxdist_median"] / rows[0]["jaxdist_median"], abs=1e-3)
    for mode in ("async", "0"):
        transport = _one(lines, kind="transport", staleness_run=mode)
        assert transport["used"] == ["tcp"], transport
    # The main runs' summary is of the main runs only.
    assert _summary(lines)["mlp_steps_per_s"]["jaxdist_rounds"] == [
        _one(lines, system="jaxdist", workload="mlp_steps_per_s", staleness_run=None)["median"]]


def test_tf_over_the_links(run: dict[str, Any]) -> None:
    lines = run["lines"]
    missing = [r for r in lines if r.get("kind") == "tf_missing"]
    if missing:
        pytest.skip(f"TensorFlow not available: {missing[0]['reason']}")
    assert run["rc"] == 0, run["stderr"][-4000:]
    assert lines[0]["tf_version"]
    rows = _summary(lines)
    for row in rows.values():
        assert isinstance(row["tf_median"], float) and row["tf_median"] > 0, row
        assert row["ratio_jaxdist_to_tf"] == pytest.approx(row["jaxdist_median"] / row["tf_median"], abs=1e-3)
    for name in (f"pull_{SIZE_MB}MB_MBps", f"push_{SIZE_MB}MB_MBps"):
        rec = _one(lines, system="tf", workload=name)
        assert rows[name]["tf_median"] == rec["median_in_closure"]  # timed inside the closures, as jaxdist's
        assert rec["median_in_closure"] <= 2 * CONFIGURED_MBPS * 1.05, rec
    assert _one(lines, system="tf", workload="mlp_steps_per_s")["loss_after"] < 5


def test_rates_bursts_and_the_skip_line(netbench: Any, monkeypatch: pytest.MonkeyPatch,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert netbench.parse_rate("1gbit") == 1e9 and netbench.parse_rate("500mbit") == 5e8
    assert netbench.parse_rate("2.5gbit") == 2.5e9 and netbench.parse_rate("1000") == 1000
    for bad in ("1gbps", "fast", "0gbit", ""):
        with pytest.raises(ValueError):
            netbench.parse_rate(bad)
    assert netbench.default_burst(1e9) == 125_000 and netbench.default_burst(5e9) == 625_000
    assert netbench.default_burst(1e8) == 65_536  # never below one 64 KiB GSO super-packet

    monkeypatch.setattr(netbench.os, "geteuid", lambda: 1000)  # not root: one clear line, exit 0
    monkeypatch.setattr(netbench.shutil, "which", lambda name: f"/usr/sbin/{name}")
    assert netbench.main(["--rounds", "1", "--out", ""]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(out) == 1 and out[0]["kind"] == "skipped" and "root" in out[0]["reason"]
