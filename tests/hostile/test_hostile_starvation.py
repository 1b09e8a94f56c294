"""No caller, with or without the token, can starve a task of its threads.

Real ``jaxdist ps`` / ``jaxdist worker`` processes, with metrics on (``--metrics-port 0``) as
LocalCluster runs them. A probe channel is connected before the hostile calls open, then
health checks, GetStatus (PS) and Heartbeat (worker) must keep answering within 1 s.

No race decides the outcome: the hostile calls are started before the probes (the first 16 on
the probe's own connection; a gRPC server hands each call to its 16-thread pool when the call
arrives), and the probes go on for 3 s (5 s under the full hostile load); without the admission
gate they queue behind 16 held threads within the first round or two.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from hostile_util import (
    HEALTH,
    OK,
    PS,
    WORKER,
    Stalled,
    Task,
    Watches,
    channel,
    dp_connect,
    health_check,
    ps_status,
    push_frames,
    task_process,
    unary,
    wait_connected,
)

from jaxdist.proto import common_pb2, ps_pb2, worker_pb2

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(240)]

SERVICE = {"ps": "jaxdist.ParameterServer", "worker": "jaxdist.Worker"}
#: The liveness call of each role: what the coordinator polls (PS watcher, worker heartbeats).
LIVENESS = {"ps": PS + "GetStatus", "worker": WORKER + "Heartbeat"}


@pytest.fixture
def log_dir(tmp_path: Any) -> str:
    return str(tmp_path)


def _probe(task: Task, role: str, ch: grpc.Channel, seconds: float = 3.0) -> list[str]:
    """Health checks (whole server and the task's service) and the liveness call, each with a 1 s
    deadline, in rounds for ``seconds`` (at least one round; stop after a round with a failure);
    returns what failed to answer OK within 1 s."""
    late: list[str] = []
    end = time.monotonic() + seconds
    while not late:
        for what, call in (
            ("health Check('')", lambda: health_check(ch, "", timeout=1.0)),
            (f"health Check({SERVICE[role]})", lambda: health_check(ch, SERVICE[role], timeout=1.0)),
            (LIVENESS[role], lambda: unary(ch, LIVENESS[role], common_pb2.Empty(), timeout=1.0)),
        ):
            a = call()
            if a.code != OK:
                late.append(f"{what}: {a.code.name}")
        if time.monotonic() >= end:
            break
        time.sleep(0.1)  # pacing of the probes (a liveness probe's period), not a synchronisation
    assert task.alive(), f"the {role} process died:\n{task.log()[-3000:]}"
    return late


@pytest.fixture
def probe_channel() -> Iterator[Any]:
    made: list[grpc.Channel] = []

    def make(task: Task, role: str) -> grpc.Channel:
        ch = channel(task.address)
        made.append(ch)
        wait_connected(ch)
        assert not _probe(task, role, ch, seconds=0), "the task does not answer even before the test"
        return ch

    yield make
    for ch in made:
        ch.close()


# ---------------------------------------------------------------------------- token-less streams
@pytest.mark.parametrize("role", ["ps", "worker"])
def test_tokenless_health_watch_streams_do_not_starve_a_task_with_metrics(role: str, log_dir: str, probe_channel: Any) -> None:
    """With metrics on, 16 token-less Health/Watch streams do not leave GetStatus, Heartbeat and
    health Check unanswered (DEADLINE_EXCEEDED, as they once did) while they stay open."""
    with task_process(role, log_dir, metrics=True) as task:
        ch = probe_channel(task, role)
        watches = Watches()
        try:
            for _ in range(16):  # on the probe's connection: they reach the server before the probes
                watches.open(ch, "")
            watches.first_answers(timeout=10)
            late = _probe(task, role, ch)
            assert not late, f"16 token-less Watch streams starve the {role}: {late}"
        finally:
            watches.close()


# ---------------------------------------------------------------------------- stalled requests
@pytest.mark.parametrize("metrics", [False, True], ids=["no-metrics", "metrics"])
def test_stalled_push_streams_of_a_token_holder_do_not_block_health_checks(metrics: bool, log_dir: str, probe_channel: Any) -> None:
    """16 Push streams that stop after their header (no deadline) do not block other gRPC calls (they
    once blocked every one, health checks included): a stalled request must not take the server's
    ability to answer health checks and GetStatus."""
    with task_process("ps", log_dir, metrics=metrics) as task:
        ch = probe_channel(task, "ps")
        stalled = Stalled()
        try:
            header = push_frames([dict(name="stalled", op=ps_pb2.ASSIGN, value=(common_pb2.FLOAT32, [1 << 20]))])
            for _ in range(16):  # on the probe's connection: they reach the server before the probes
                stalled.open(ch, PS + "Push", header + [b"\0" * 4096])
            late = _probe(task, "ps", ch)
            assert not late, f"16 stalled Push streams of a token holder block the PS: {late}"
        finally:
            stalled.close()


# ------------------------------------------------------------- found while attacking
@pytest.mark.parametrize(("role", "path"), [
    ("ps", PS + "GetStatus"),
    ("ps", HEALTH + "Check"),
    ("worker", WORKER + "Heartbeat"),
    ("worker", HEALTH + "Check"),
])
def test_tokenless_stalled_unary_requests_do_not_starve_a_task_without_metrics(role: str, path: str, log_dir: str, probe_channel: Any) -> None:
    """Without metrics: a token-less caller that opens 16 unary calls and never finishes their request
    message does not starve the task. It once held all 16 server threads (gRPC reads a unary request
    in a pool thread, before the auth check answers UNAUTHENTICATED; health Check needs no token at
    all), and the task answered nothing else, health checks included."""
    with task_process(role, log_dir, metrics=False) as task:
        ch = probe_channel(task, role)
        stalled = Stalled()
        try:
            for _ in range(16):  # on the probe's connection: they reach the server before the probes
                stalled.open(ch, path, md=None)
            late = _probe(task, role, ch)
            assert not late, f"16 token-less stalled {path} requests starve the {role}: {late}"
        finally:
            stalled.close()


# ------------------------------------------------------------------------- everything at once
def _hostile_load(task: Task, role: str, probe: grpc.Channel, stalled: Stalled, watches: Watches, idle: list[Any]) -> None:
    """64 stalled streams and 64 idle connections from token holders, 64 token-less Watch streams
    (the first 16 stalls and 16 watches on the probe's own connection)."""
    port = ps_status(probe).data_port if role == "ps" else 0  # asked before anything is held
    if role == "ps":
        assert port, "the PS announces no data port"
        header = push_frames([dict(name="stalled", op=ps_pb2.ASSIGN, value=(common_pb2.FLOAT32, [1 << 20]))])
        stall_path, first = PS + "Push", header + [b"\0" * 4096]
    else:
        # A RunClosures request that never finishes (a token holder on a slow or hostile link).
        stall_path, first = WORKER + "RunClosures", []
    for i in range(64):
        if i % 8 == 0:
            stalled.channels.append(channel(task.address))
        stalled.open(probe if i < 16 else stalled.channels[-1], stall_path, first)
    for _ in range(64):  # idle gRPC connections of token holders
        ich = channel(task.address)
        idle.append(ich)
        wait_connected(ich)
    if role == "ps":  # and idle data-plane connections (hello done, then nothing)
        for _ in range(64):
            idle.append(dp_connect(port))
    for i in range(64):
        if i % 8 == 0:
            watches.channels.append(channel(task.address))
        watches.open(probe if i < 16 else watches.channels[-1], "")
    watches.first_answers(timeout=10)


@pytest.mark.slow
@pytest.mark.parametrize("role", ["ps", "worker"])
def test_health_and_heartbeats_answer_within_1s_under_hostile_load(role: str, log_dir: str, probe_channel: Any) -> None:
    """Health checks and heartbeats keep answering within 1 s while 64 stalled streams
    and 64 idle connections from token holders and 64 token-less Watch streams are open (metrics on)."""
    with task_process(role, log_dir, metrics=True) as task:
        ch = probe_channel(task, role)
        if role == "worker":  # a configured worker, as in a job
            a = unary(ch, WORKER + "Configure", worker_pb2.ConfigureRequest(cluster_json='{"ps": []}', num_workers=1, coordinator_id="c"))
            assert a.code == OK, a
        stalled, watches, idle = Stalled(), Watches(), []  # type: ignore[var-annotated]
        try:
            _hostile_load(task, role, ch, stalled, watches, idle)
            late = _probe(task, role, ch, seconds=5)
            assert not late, f"under 64 stalled + 64 idle + 64 token-less Watch the {role} is late: {late}"
        finally:
            stalled.close()
            watches.close()
            for c in idle:
                c.close()
