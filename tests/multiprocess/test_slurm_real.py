"""SlurmClusterResolver inside a real ``srun`` step.

Needs a Slurm cluster that answers ``sinfo`` (``sudo deploy/slurm/local_slurm.sh``
starts a single-node one); skipped otherwise.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"

_PROBE = r"""
import json, os, sys
from jaxdist.cluster_resolver import detect
r = detect()
print("JAXDIST_VIEW " + json.dumps({
    "resolver": type(r).__name__,
    "rank": int(os.environ["SLURM_PROCID"]),
    "node": os.environ.get("SLURMD_NODENAME"),
    "cluster": r.cluster_spec().as_dict(),
    "task": [r.task_type, r.task_id],
    "address": r.master(),
    "argv": sys.argv[1:],
    "token": os.environ.get("JAXDIST_TOKEN"),
}), flush=True)
"""


def _slurm_ready() -> str | None:
    """None when srun can be used, else why not."""
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return "srun/sinfo not on PATH; run `sudo deploy/slurm/local_slurm.sh` to start a local Slurm"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%T"], check=False, capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"sinfo does not answer ({e}); start Slurm with `sudo deploy/slurm/local_slurm.sh`"
    states = out.stdout.split()
    if out.returncode != 0 or not any(s in ("idle", "mixed") for s in states):
        return (
            f"no idle Slurm node (sinfo rc={out.returncode}, states={states}, {out.stderr.strip()!r}); "
            "start Slurm with `sudo deploy/slurm/local_slurm.sh`"
        )
    return None


def _free_port_base(n: int) -> int:
    """The first of ``n`` consecutive ports free on 127.0.0.1, below the kernel's ephemeral range.

    Not a port-0 pick: srun listens for its tasks' I/O on ephemeral ports, and a task base taken
    from that range can land next to them. A jaxdist client dialing a peer's port that srun holds
    speaks gRPC to srun's I/O listener ("failed reading io init message", the step's output lost:
    seen when a fresh-clone run's job and another's ran at once).
    """
    import random
    import socket

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    low = max(13000, min(20000, ephemeral_low - 4096))  # above local_slurm.sh's SrunPortRange (12000-12999)
    for _ in range(200):
        base = random.randrange(low, ephemeral_low - n)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports below {ephemeral_low}")


def _run_step(ntasks: int, jobs: dict[str, int], *srun_args: str) -> list[dict]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TF_CONFIG", "JAXDIST_CLUSTER", "JAXDIST_CLUSTER_RESOLVER", "CUDA_VISIBLE_DEVICES")
    }
    env["JAXDIST_SLURM_JOBS"] = json.dumps(jobs)
    env["JAXDIST_SLURM_PORT_BASE"] = "23456"
    cmd = [
        "srun",
        f"--ntasks={ntasks}",
        "--kill-on-bad-exit=1",
        "--time=2",
        "--job-name=jaxdist-test",
        *srun_args,
        sys.executable,
        "-c",
        _PROBE,
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=90, env=env)
    assert proc.returncode == 0, f"srun failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    views = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("JAXDIST_VIEW ")]
    assert len(views) == ntasks, proc.stdout + proc.stderr
    return sorted(views, key=lambda v: v["rank"])


@pytest.fixture(scope="module")
def slurm() -> None:
    why = _slurm_ready()
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("distribution", ["block", "cyclic"])
def test_srun_tasks_agree_on_one_cluster(slurm: None, distribution: str) -> None:
    jobs = {"chief": 1, "ps": 2, "worker": 2}
    views = _run_step(5, jobs, f"--distribution={distribution}")
    assert {v["resolver"] for v in views} == {"SlurmClusterResolver"}
    # Every task sees the same cluster ...
    cluster = views[0]["cluster"]
    assert all(v["cluster"] == cluster for v in views)
    assert {job: len(addrs) for job, addrs in cluster.items()} == jobs
    # ... and each is a distinct task of it, at an address on its own node.
    tasks = [tuple(v["task"]) for v in views]
    assert sorted(tasks) == sorted((job, i) for job, n in jobs.items() for i in range(n))
    assert tasks[0] == ("chief", 0)  # ranks go to jobs in sorted name order
    addresses = [v["address"] for v in views]
    assert len(set(addresses)) == 5
    for v in views:
        assert v["address"] == cluster[v["task"][0]][v["task"][1]]
        assert v["address"].rsplit(":", 1)[0] == v["node"]
        assert 23456 <= int(v["address"].rsplit(":", 1)[1]) < 23456 + 5


def test_srun_six_tasks_all_workers(slurm: None) -> None:
    views = _run_step(6, {"worker": 6})
    assert sorted(v["task"][1] for v in views) == list(range(6))
    assert all(v["cluster"] == views[0]["cluster"] for v in views)


def test_train_sbatch_gives_every_task_its_role(slurm: None, tmp_path: Path) -> None:
    """Submit deploy/slurm/train.sbatch with a stand-in `jaxdist` that reports what it got."""
    if shutil.which("sbatch") is None:
        pytest.skip("sbatch not on PATH")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (tmp_path / "probe.py").write_text(_PROBE)
    fake = bindir / "jaxdist"
    fake.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(tmp_path / "probe.py"))} "$@"\n')
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "JAXDIST_CLUSTER", "JAXDIST_TOKEN")}
    env["PATH"] = f"{bindir}{os.pathsep}{env.get('PATH', '')}"
    cmd = [
        "sbatch", "--wait", "--cpus-per-task=1", "--mem-per-cpu=64M", "--time=2",
        f"--chdir={tmp_path}", f"--output={tmp_path}/out-%j.txt",
        str(DEPLOY / "slurm" / "train.sbatch"), "--epochs", "1",
    ]
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=100, env=env)
    outs = "".join(p.read_text() for p in tmp_path.glob("out-*.txt"))
    assert proc.returncode == 0, f"sbatch failed ({proc.returncode}): {proc.stderr}\n{outs}"
    views = sorted(
        (json.loads(line.split(" ", 1)[1]) for line in outs.splitlines() if line.startswith("JAXDIST_VIEW ")),
        key=lambda v: v["rank"],
    )
    assert [tuple(v["task"]) for v in views] == [
        ("chief", 0), ("ps", 0), ("ps", 1), ("worker", 0), ("worker", 1),
    ], outs
    assert all(v["cluster"] == views[0]["cluster"] for v in views)
    assert all(
        v["argv"] == ["task", "--host", "0.0.0.0", "--", "python", "train.py", "--epochs", "1"] for v in views
    )
    tokens = {v["token"] for v in views}
    assert len(tokens) == 1 and len(tokens.pop() or "") == 64, "one generated token shared by all tasks"


_TRAIN = r"""
import numpy as np, optax, jax, jax.numpy as jnp
import jaxdist
from jaxdist.cluster_resolver import detect
resolver = detect()
assert type(resolver).__name__ == "SlurmClusterResolver", resolver
strategy = jaxdist.ParameterServerStrategy(resolver)
with strategy.scope():
    params = jaxdist.create_variables({"w": np.zeros(4, np.float32)}, optimizer=optax.sgd(1.0))
coord = jaxdist.ClusterCoordinator(strategy)
# Each closure pulls w and pushes the same gradient, -target/256 (exact in binary): after 256 closures
# w is target exactly, whichever worker ran which closure and however stale its pull was (a descent
# on a loss would end wherever the workers' interleaving left it).
target = np.arange(4, dtype=np.float32)
step_grad = jax.jit(lambda p: {"w": jnp.zeros_like(p["w"]) - jnp.asarray(target) / 256})
def step():
    jaxdist.apply_gradients(params, step_grad(jaxdist.pull(params)))
    return jaxdist.current_worker_index()
rvs = [coord.schedule(step) for _ in range(256)]
coord.join()
print("TRAINED", params["w"].numpy().tolist(), sorted({rv.fetch() for rv in rvs}), flush=True)
coord.shutdown()
"""


def test_srun_trains_a_jaxdist_job(slurm: None, tmp_path: Path) -> None:
    """Each Slurm task becomes chief / PS / worker by its rank (`jaxdist task`); the job trains and ends."""
    import socket

    node = subprocess.run(["sinfo", "-h", "-o", "%N"], capture_output=True, text=True, timeout=15).stdout.split()[0]
    if not socket.gethostbyname(node).startswith("127."):
        pytest.skip(f"Slurm node {node} does not resolve to loopback; this test only talks to 127.0.0.0/8")
    script = tmp_path / "train.py"
    script.write_text(_TRAIN)
    env = {k: v for k, v in os.environ.items() if k not in ("TF_CONFIG", "JAXDIST_CLUSTER", "JAXDIST_CLUSTER_RESOLVER")}
    env["JAXDIST_SLURM_JOBS"] = json.dumps({"chief": 1, "ps": 1, "worker": 2})
    env["JAXDIST_SLURM_PORT_BASE"] = str(_free_port_base(4))
    env["JAXDIST_TOKEN"] = "slurm-test-token"
    env["JAX_PLATFORMS"] = "cpu"
    cmd = ["srun", "--ntasks=4", "--time=3", "--job-name=jaxdist-train", sys.executable, "-m", "jaxdist.tools.cli", "task",
           "--host", "127.0.0.1", "--", sys.executable, str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=110, env=env, cwd=tmp_path)
    assert proc.returncode == 0, f"srun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("TRAINED")]
    assert line, proc.stdout + proc.stderr[-3000:]
    w, workers = line[0].split(" ", 1)[1].rsplit(" [", 1)
    assert json.loads(w) == [0.0, 1.0, 2.0, 3.0]
    assert json.loads("[" + workers) == [0, 1]
