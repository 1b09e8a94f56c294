"""bench/accelerator_check.py: on a machine without an accelerator, one JSON line saying so and exit status 0; with
``--on-cpu``, every check run on CPU devices standing in (the script's own code, exercised)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_without_an_accelerator_it_says_so_and_exits_0() -> None:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "accelerator_check.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stdout
    assert lines[0]["check"] == "accelerator" and lines[0]["found"] is False, lines[0]
    assert lines[0]["platforms"] == ["cpu"], lines[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_check_passes_on_cpu_devices_standing_in() -> None:
    """``--on-cpu``: the script's checks themselves run (2 fake CPU devices for MirroredStrategy, a LocalCluster
    worker on CPU), so the code an accelerator machine runs is exercised here; its figures mean nothing."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip())
    env.pop("KERAS_BACKEND", None)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "accelerator_check.py"), "--on-cpu",
                           "--mlp-steps", "5"], env=env, capture_output=True, text=True, timeout=560)
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    checks = [(d["check"], d.get("strategy")) for d in lines]
    assert checks == [("accelerator", None), ("custom_loop", "OneDeviceStrategy"), ("custom_loop", "MirroredStrategy"),
                      ("keras_fit", "OneDeviceStrategy"), ("keras_fit", "MirroredStrategy"), ("local_cluster", None),
                      ("mlp", None), ("summary", None)], lines
    assert all(d.get("ok", True) for d in lines), lines
    assert [d["replicas"] for d in lines if d["check"] == "custom_loop"] == [1, 2], lines
