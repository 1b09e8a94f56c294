"""The nemesis soak (bench/nemesis.py): its invariant checks catch what they should, and a short
soak, one round of every fault kind under a fixed seed (four lanes: faults overlap on different workers,
shards and links), ends with no violation."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from jaxdist.testing import poll_for

BENCH = Path(__file__).resolve().parents[2] / "bench"
SEED = 20261128

pytestmark = [pytest.mark.multiprocess]


@pytest.fixture(scope="module")
def nemesis() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCH))
    try:
        import nemesis

        yield nemesis
    finally:
        sys.path.remove(str(BENCH))


def _final(step: int, batches: int, epochs: int, batch: int) -> dict[str, Any]:
    """What a correct job reports after ``step`` closures."""
    done = step // batches
    return {"step": step, "seen": [float(done)] * batches,
            "idsum": [float(done * sum(range(b * batch, (b + 1) * batch))) for b in range(batches)],
            "per_closure_runs": [[1.0, step], [0.0, batches * epochs - step]], "payload_values": [float(step)],
            "replicas_differ": [], "read_from": [["10.0.0.2:1", "10.0.0.3:1"], ["10.0.0.4:1", "10.0.0.5:1"]]}


def test_the_checks_catch_each_violation(nemesis: ModuleType, tmp_path: Path) -> None:
    args = argparse.Namespace(seed=1, faults=list(nemesis.KINDS), minutes=1.0, batches=4, epochs=10, out=None)
    B = nemesis.BATCH

    def violations(final: dict[str, Any]) -> list[str]:
        soak = nemesis.Soak(args, nemesis.Lab(), tmp_path)
        soak.check(final)
        return soak.violations

    assert violations(_final(12, 4, 10, B)) == []
    lost = _final(12, 4, 10, B)
    lost["seen"][2] -= 1  # a batch lost ...
    lost["idsum"][2] -= sum(range(2 * B, 3 * B))
    assert len(violations(lost)) == 1 and "batch 2" in violations(lost)[0]
    swapped = _final(12, 4, 10, B)
    swapped["idsum"][1] += B  # ... or another batch's examples in its place: the counts agree, the id sums do not
    swapped["idsum"][3] -= B
    assert len(violations(swapped)) == 2
    twice = _final(12, 4, 10, B)
    twice["per_closure_runs"] = [[1.0, 5], [2.0, 1], [1.0, 6], [0.0, 28]]  # a closure's updates applied twice
    assert "per-closure" in violations(twice)[0]
    payload = _final(12, 4, 10, B)
    payload["payload_values"] = [11.0, 12.0]
    assert "payload" in violations(payload)[0]
    diverged = _final(12, 4, 10, B)
    diverged["replicas_differ"] = ["seen"]
    assert "differ" in violations(diverged)[0]
    unswapped = _final(12, 4, 10, B)
    unswapped["read_from"][1][0] = unswapped["read_from"][0][0]  # shard 0 read twice from one process
    assert "not both read" in violations(unswapped)[0]
    assert "whole number of epochs" in violations(_final(13, 4, 10, B))[0]


def test_a_stop_signals_only_the_process_of_the_status_line(nemesis: ModuleType) -> None:
    """The driver SIGSTOPs a task by the pid of the job's latest status line. Once that task exited its
    pid may be another process's: the pid is signalled only while it is the process that started then
    (its start time, /proc/PID/stat field 22, rides on the status line)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        started = nemesis.start_time(proc.pid)
        assert started is not None
        # Another start time than the status line's: the task exited and its pid went to this process.
        assert nemesis.SameProcess.open(proc.pid, str(int(started) + 1)) is None
        assert nemesis.SameProcess.open(proc.pid, None) is None
        same = nemesis.SameProcess.open(proc.pid, started)
        assert same is not None
        with same:
            assert same.send(signal.SIGSTOP)
            poll_for(lambda: _stopped(proc.pid), 10, what="the process stopped")
            assert same.send(signal.SIGCONT)
            poll_for(lambda: not _stopped(proc.pid), 10, what="the process running again")
            proc.kill()
            proc.wait()
            assert not same.send(signal.SIGSTOP)  # gone: nothing else is signalled
        assert nemesis.SameProcess.open(proc.pid, started) is None
    finally:
        proc.kill()
        proc.wait()


def _stopped(pid: int) -> bool:
    """Whether the process is stopped (state T in /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def test_a_resumed_run_is_checked_against_what_earlier_runs_saved(nemesis: ModuleType, tmp_path: Path) -> None:
    """The new run may save before the driver sees its "started" line: only earlier runs' saves count."""
    args = argparse.Namespace(seed=1, faults=list(nemesis.KINDS), minutes=1.0, batches=4, epochs=10, out=None)
    soak = nemesis.Soak(args, nemesis.Lab(), tmp_path)

    class Started:
        run = 2

        def __init__(self, step: int, saved_before: int) -> None:
            self.started, self.saved_before = {"step": step}, saved_before

        def alive(self) -> bool:
            return True

    soak.last_saved = 24  # the re-run resumed at 16 and saved 24 before the driver polled
    soak.wait_started(Started(16, saved_before=16), 1.0)
    assert soak.violations == []
    soak.wait_started(Started(16, saved_before=24), 1.0)  # an earlier run saved 24: lost
    assert len(soak.violations) == 1 and "resumed at step 16 but step 24 was saved" in soak.violations[0]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_short_soak_one_round_of_every_fault_kind(nemesis: ModuleType, tmp_path: Path) -> None:
    why = nemesis.netns_unavailable()
    if why:
        pytest.skip(why)
    out = tmp_path / "soak.jsonl"
    r = subprocess.run([sys.executable, str(BENCH / "nemesis.py"), "--seed", str(SEED), "--rounds", "1", "--minutes", "30",
                        "--interval", "0.1,0.3", "--lanes", "4", "--batches", "8", "--out", str(out), "--workdir", str(tmp_path / "work")],
                       capture_output=True, text=True, timeout=560, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    summary = next((ln for ln in lines if ln["ev"] == "summary"), None)
    assert r.returncode == 0 and summary is not None, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    print(json.dumps(summary))
    assert lines[0]["ev"] == "seed" and lines[0]["seed"] == SEED and f"--seed {SEED}" in lines[0]["replay"]
    assert summary["violations"] == []
    assert summary["faults"] == {k: 1 for k in nemesis.KINDS}  # one round: every kind once
    assert summary["coordinator_runs"] == 2 and summary["closures"] > 0
    assert summary["shm_files_seen"] >= 1  # the leftover check looked at real /dev/shm files
    assert set(summary["recovery"]) == set(nemesis.KINDS)
    assert summary["lanes"] == 4 and summary["overlapped_faults"] >= 1  # faults overlapped on different units
