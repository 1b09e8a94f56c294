"""Runs examples/custom_training_loop.py (TF's custom-training tutorial) on four strategies.

All at once, as separate processes: MirroredStrategy on 8 fake CPU devices,
OneDeviceStrategy, the default strategy (no strategy), and
MultiWorkerMirroredStrategy on 2 processes x 4 fake devices (TF_CONFIG on
loopback). With the same global batch they must end with the same weights
(float32 tolerance), print the tutorial's lines, write checkpoints, and
restore the latest one without a strategy to the last epoch's test accuracy.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from mwms_util import free_port, job_env

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_training_loop.py"
EPOCHS = 2


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_custom_training_loop_example_same_weights_on_every_strategy(tmp_path: Path) -> None:
    cluster = {"worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    runs = {
        "mirrored": (["--strategy", "mirrored"], 8, None),
        "one_device": (["--strategy", "one_device"], 1, None),
        "default": (["--strategy", "default"], 1, None),
        "multi_worker_0": (["--strategy", "multi_worker", "--peer-timeout", "60"], 4, {"cluster": cluster, "task": {"type": "worker", "index": 0}}),
        "multi_worker_1": (["--strategy", "multi_worker", "--peer-timeout", "60"], 4, {"cluster": cluster, "task": {"type": "worker", "index": 1}}),
    }
    procs = {}
    for name, (args, devices, tf_config) in runs.items():
        ckpt = tmp_path / ("ckpt_multi_worker" if name.startswith("multi_worker") else f"ckpt_{name}")
        cmd = [
            sys.executable, str(EXAMPLE), *args, "--epochs", str(EPOCHS), "--global-batch-size", "64",
            "--checkpoint-every", "1", "--checkpoint-dir", str(ckpt), "--weights-out", str(tmp_path / f"{name}.npz"),
        ]
        procs[name] = subprocess.Popen(cmd, env=job_env(devices, tf_config), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    outs = {}
    deadline = time.monotonic() + 400
    try:
        for name, p in procs.items():
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert p.returncode == 0, f"{name} failed (rc={p.returncode}):\n{so[-2000:]}\n{se[-4000:]}"
            outs[name] = so
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.communicate()

    for name, replicas in (("mirrored", 8), ("one_device", 1), ("default", 1), ("multi_worker_0", 8), ("multi_worker_1", 8)):
        out = outs[name]
        assert f"Number of devices: {replicas}" in out, (name, out[-1500:])
        epochs = re.findall(r"Epoch (\d+), Loss: ([\d.]+), Accuracy: ([\d.]+), Test Loss: [\d.]+, Test Accuracy: ([\d.]+)", out)
        assert [int(e[0]) for e in epochs] == list(range(1, EPOCHS + 1)), (name, out[-1500:])
        assert float(epochs[-1][1]) < float(epochs[0][1])  # the loss goes down
        restored = re.search(r"restoring the saved model \(epoch (\d+)\) without strategy: ([\d.]+)", out)
        assert restored is not None and int(restored.group(1)) == EPOCHS, (name, out[-800:])
        assert abs(float(restored.group(2)) - float(epochs[-1][3])) < 0.01, (name, restored.group(2), epochs[-1])
    # Same printed numbers (2 decimals) everywhere, and the same weights within float32 tolerance.
    lines = {n: re.findall(r"Epoch .*?Test Accuracy: [\d.]+", o) for n, o in outs.items()}
    assert len({tuple(v) for v in lines.values()}) == 1, lines
    ref = np.load(tmp_path / "mirrored.npz")
    for name in ("one_device", "default", "multi_worker_0"):
        got = np.load(tmp_path / f"{name}.npz")
        assert sorted(got.files) == sorted(ref.files)
        for k in ref.files:
            np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=1e-6, err_msg=f"{name}:{k}")
    assert not (tmp_path / "multi_worker_1.npz").exists()  # only process 0 writes files
    # MultiWorkerMirrored wrote one checkpoint per save for the whole job (process 0), nothing torn.
    ckpts = sorted(p.name for p in (tmp_path / "ckpt_multi_worker").iterdir())
    assert ckpts == [f"ckpt-{e}" for e in range(1, EPOCHS + 1)], ckpts
    for d in (tmp_path / "ckpt_multi_worker").iterdir():
        assert sorted(f.name for f in d.iterdir()) == ["manifest.json", "vars-0.npz"]


@pytest.mark.timeout(120)
def test_multi_worker_example_asks_for_a_shared_checkpoint_dir() -> None:
    """Each process's own temporary folder left every process but 0 with no checkpoint to restore at the end
    (it crashed there): multi_worker without ``--checkpoint-dir`` stops at once and says what to pass."""
    cluster = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}  # never contacted: the arguments are refused first
    p = subprocess.run(
        [sys.executable, str(EXAMPLE), "--strategy", "multi_worker", "--epochs", "1"],
        env=job_env(1, {"cluster": cluster, "task": {"type": "worker", "index": 1}}), capture_output=True, text=True, timeout=100,
    )
    assert p.returncode == 2, (p.returncode, p.stdout[-1000:], p.stderr[-2000:])
    assert "--strategy multi_worker needs --checkpoint-dir" in p.stderr, p.stderr[-2000:]
    assert "Number of devices" not in p.stdout  # stopped before joining the other process
