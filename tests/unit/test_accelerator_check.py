"""bench/accelerator_check.py on a machine without an accelerator: one JSON line saying so, exit status 0."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
