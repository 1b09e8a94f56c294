"""PSConnections.fan_out: one call per PS task in parallel, results by task, errors after every call finished."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from jaxdist.ps_server.connections import PSConnections


@pytest.fixture
def conns() -> Any:
    c = PSConnections(["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"])  # never dialled: the calls below are local
    yield c
    c.close()


def test_fan_out_results_by_task_and_the_first_call_runs_in_the_callers_thread(conns: PSConnections) -> None:
    def call(i: int) -> Any:
        return lambda client: (i, client is conns.clients[i], threading.get_ident())

    got = conns.fan_out({2: call(2), 0: call(0), 1: call(1)})
    assert sorted(got) == [0, 1, 2]
    assert all(got[i][:2] == (i, True) for i in got)
    assert got[2][2] == threading.get_ident()  # the first named: no hand-off to the pool


def test_fan_out_raises_the_first_error_in_call_order_after_every_call_finished(conns: PSConnections) -> None:
    release, finished = threading.Event(), []

    def first(client: Any) -> None:
        release.set()
        raise KeyError("first")

    def slow(client: Any) -> None:
        assert release.wait(60)
        finished.append("slow")
        raise ValueError("later")

    def fine(client: Any) -> str:
        finished.append("fine")
        return "ok"

    with pytest.raises(KeyError, match="first"):
        conns.fan_out({0: first, 1: slow, 2: fine})
    assert sorted(finished) == ["fine", "slow"]
    with pytest.raises(ValueError, match="later"):
        conns.fan_out({1: slow, 0: lambda c: "ok"})
