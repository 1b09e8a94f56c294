"""PS/worker processes start with jaxdist's malloc settings (re-executing themselves once if needed)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import jaxdist
from jaxdist.base import task_process


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        items = [kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv]
    return {k.decode(): v.decode() for k, v in items}


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
@pytest.mark.parametrize("tuning", ["1", "0"])
def test_task_reexecs_itself_with_malloc_settings_unless_turned_off(tuning: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in task_process.MALLOC_ENV}
    env.update({task_process.ENV_MALLOC_TUNING: tuning, "JAX_PLATFORMS": "cpu"})
    proc = subprocess.Popen([sys.executable, "-m", "jaxdist.ps_server", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            stdin=subprocess.DEVNULL, env=env, text=True)
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("JAXDIST_READY"), line
        got = _environ(proc.pid)  # same pid: exec, not a child
        if tuning == "1":
            assert {k: got.get(k) for k in task_process.MALLOC_ENV} == task_process.MALLOC_ENV
        else:
            assert not any(k in got for k in task_process.MALLOC_ENV)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)  # reaps it and closes its stdout pipe


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_local_cluster_tasks_get_the_settings_up_front() -> None:
    with jaxdist.LocalCluster(num_workers=1, num_ps=1) as cluster:
        for task in ("ps:0", "worker:0"):
            got = _environ(cluster.pid(task))  # type: ignore[arg-type]
            assert {k: got.get(k) for k in task_process.MALLOC_ENV} == task_process.MALLOC_ENV
