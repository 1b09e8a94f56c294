"""Helpers of the tests that run a MultiWorkerMirroredStrategy job as real processes on loopback.

A test module of this folder runs itself as the job's processes (``python <module> <mode> <out>``, each with
its own ``TF_CONFIG`` and fake CPU devices), so this module is imported both by pytest (which puts this folder
on ``sys.path``) and by those processes (started from this folder's file: the same entry of ``sys.path``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

#: Variables that would make a job's process see another cluster (or Keras another backend) than the one the
#: test gives it.
CLUSTER_ENV = (
    "TF_CONFIG", "JAXDIST_CLUSTER", "JAXDIST_CLUSTER_RESOLVER", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS",
    "KERAS_BACKEND", "JAXDIST_TPU_FAKE_DEVICES",
)


def free_port() -> int:
    """A TCP port of 127.0.0.1 that was free a moment ago (the OS's pick for port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def two_worker_configs() -> list[dict[str, Any]]:
    """The two ``TF_CONFIG`` values of a 2-worker cluster on loopback (task 0, task 1)."""
    cluster = {"worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    return [{"cluster": cluster, "task": {"type": "worker", "index": i}} for i in range(2)]


def job_env(devices: int, tf_config: dict[str, Any] | None) -> dict[str, str]:
    """This process's environment for one process of a job: ``devices`` fake CPU devices, ``tf_config`` as
    ``TF_CONFIG`` (None: no cluster), none of :data:`CLUSTER_ENV` inherited."""
    env = dict(os.environ)
    for k in CLUSTER_ENV:
        env.pop(k, None)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def spawn(script: str | Path, args: list[str], devices: int, tf_config: dict[str, Any] | None, *,
          extra_env: dict[str, str] | None = None, stdin: bool = False) -> subprocess.Popen[str]:
    """Start ``python script *args`` as one process of a job (see :func:`job_env`), its output piped."""
    env = job_env(devices, tf_config)
    env.update(extra_env or {})
    return subprocess.Popen([sys.executable, str(script), *args], env=env, stdin=subprocess.PIPE if stdin else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs: list[subprocess.Popen[str]], timeout: float) -> list[tuple[int, str, str]]:
    """Wait for every process (``timeout`` seconds for them all); ``(returncode, stdout, stderr)`` of each.
    A process still running at the deadline, or when waiting fails, is killed (nothing outlives the call)."""
    deadline = time.monotonic() + timeout
    out = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return out


def run_reference_and_two_workers(script: str | Path, out_dir: Path, done: str, timeout: float) -> None:
    """Run ``script`` as a one-device reference (``reference <out_dir>/ref.npz``) beside a 2-process job of 4
    fake devices each (``worker <out_dir>/w<i>.npz``), and fail unless every process exits 0 having printed
    ``done``."""
    configs = two_worker_configs()
    procs = [
        spawn(script, ["reference", str(out_dir / "ref.npz")], 1, None),
        *(spawn(script, ["worker", str(out_dir / f"w{i}.npz")], 4, configs[i]) for i in range(2)),
    ]
    results = finish(procs, timeout)
    for name, (rc, so, se) in zip(("reference", "worker:0", "worker:1"), results):
        assert rc == 0 and done in so, f"{name} failed (rc={rc}):\n{so[-2000:]}\n{se[-5000:]}"
