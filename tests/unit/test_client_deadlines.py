"""The PS client's deadlines follow the work a call asks for, not only the bytes it sends: a create's
by the bytes the PS makes, an identified push's by the PS working on it while it answers health checks."""

from __future__ import annotations

import threading
from typing import Any

import grpc
import numpy as np
import pytest

from jaxdist.base.errors import ConfigurationError, InvalidRequestError, PSUnavailableError
from jaxdist.proto.ps_wire import Op
from jaxdist.ps_server import client as ps_client_module
from jaxdist.ps_server.client import (
    DEFAULT_PUSH_WORK_TIMEOUT_S,
    PUSH_WORK_TIMEOUT_ENV,
    CreateSpec,
    PSClient,
    PullSpec,
    Update,
    create_deadline,
    deadline_for,
    push_work_timeout,
)
from jaxdist.testing import poll_for

pytestmark = pytest.mark.timeout(60)


def _init(shape, dtype, offset):  # type: ignore[no-untyped-def]
    return np.zeros(shape, dtype)


def test_a_create_by_initializer_gets_the_time_its_shard_needs_though_nothing_travels() -> None:
    small = create_deadline([CreateSpec("s", shape=(4, 3), dtype="float32", initializer=_init)])
    third_of_2m_x_64 = create_deadline([CreateSpec("t", shape=(666_667, 64), dtype="float32", initializer=_init)])
    assert small == pytest.approx(deadline_for(0), abs=0.01)  # a small create: the base deadline
    # 170 MB made on the PS (its initializer runs there): far more than moving those bytes would be given.
    assert third_of_2m_x_64 > deadline_for(666_667 * 64 * 4) + 20
    doubled = create_deadline([CreateSpec("t", shape=(666_667, 64), dtype="float64", initializer=_init)])
    assert doubled - deadline_for(0) == pytest.approx(2 * (third_of_2m_x_64 - deadline_for(0)))


def test_a_create_deadline_adds_up_its_entries_values_included() -> None:
    one = create_deadline([CreateSpec("a", value=np.zeros((1000, 1000), np.float32))])
    two = create_deadline([CreateSpec("a", value=np.zeros((1000, 1000), np.float32)),
                           CreateSpec("b", shape=(1000, 1000), dtype=np.float32, initializer=_init)])
    assert two - deadline_for(0) == pytest.approx(2 * (one - deadline_for(0)))
    # A dtype that cannot travel is refused as encoding the create refuses it.
    with pytest.raises(InvalidRequestError):
        create_deadline([CreateSpec("c", shape=(10,), dtype="not-a-dtype", initializer=_init)])


# --------------------------------------------------------------- a push outlasting its deadline
class _SlowApply:
    """A PS store hook run inside each push's apply step (variables locked) that holds the push
    until the test releases it: a slow optimizer step, controlled by events, not by time."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0

    def __call__(self, updates: object, update_id: str) -> None:
        self.calls += 1
        self.entered.set()
        assert self.release.wait(120), "the test never released the push"


@pytest.fixture
def short_push_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Transfer deadlines of a fraction of a second: the held push outlasts several of them.
    monkeypatch.setattr(ps_client_module, "_BASE_DEADLINE_S", 0.3)


def _push_in_thread(client: Any, update: Update, update_id: str) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["answer"] = client.push([update], update_id=update_id)
        except BaseException as e:  # handed to the test's thread
            result["error"] = e

    t = threading.Thread(target=run, name="jaxdist-test-push", daemon=True)
    t.start()
    return t, result


@pytest.mark.usefixtures("short_push_deadline")
def test_a_push_the_ps_works_on_past_its_deadline_completes_once(ps_server: Any, ps_client: Any) -> None:
    ps_client.create([CreateSpec("w", value=np.zeros(4, np.float32))])
    hook = _SlowApply()
    ps_server.store.replicate = hook
    t, result = _push_in_thread(ps_client, Update("w", Op.ASSIGN_ADD, np.ones(4, np.float32)), "u-slow")
    try:
        assert hook.entered.wait(60)
        # The deadline passed (twice) while the PS, alive, was still applying: the client kept the push.
        poll_for(lambda: ps_client.push_resends >= 2, timeout=60, what="the client to resend the held push")
        assert "error" not in result and t.is_alive()
    finally:
        hook.release.set()
    t.join(60)
    assert not t.is_alive()
    assert "error" not in result, result.get("error")
    versions, _duplicate = result["answer"]
    assert versions == [2]  # created at 1, the push applied once
    assert hook.calls == 1  # the resent copies waited for the first and did nothing
    ps_server.store.replicate = None
    ((value, version),) = ps_client.pull([PullSpec("w")])
    np.testing.assert_array_equal(value, np.ones(4, np.float32))
    assert version == 2


@pytest.mark.usefixtures("short_push_deadline")
@pytest.mark.parametrize("transport", ["data_plane", "data_plane_tcp", "grpc"])
def test_a_push_to_a_ps_that_dies_while_applying_fails_as_unavailable(ps_server: Any, transport: str) -> None:
    # A client of its own: the ps_client fixture checks a live data-plane connection at its end.
    client = PSClient(ps_server.address, ps_server.credentials, task="ps:0", data_plane=transport != "grpc",
                      shared_memory=transport == "data_plane")
    try:
        client.create([CreateSpec("w", value=np.zeros(4, np.float32))])
        hook = _SlowApply()
        ps_server.store.replicate = hook
        t, result = _push_in_thread(client, Update("w", Op.ASSIGN_ADD, np.ones(4, np.float32)), "u-dead")
        stopping = threading.Thread(target=ps_server.stop, kwargs={"grace": None}, name="jaxdist-test-stop")
        try:
            assert hook.entered.wait(60)
            poll_for(lambda: client.push_resends >= 1, timeout=60, what="the client to resend the held push")
            # The PS goes (its sockets close; its stop waits for the push handler held in the hook,
            # so it runs beside the test until the hook is released).
            stopping.start()
            # Failed at once, not after the push work limit (30 min): no health check answers now.
            t.join(60)
            assert not t.is_alive()
        finally:
            hook.release.set()
        if stopping.ident is not None:
            stopping.join(60)
        assert isinstance(result.get("error"), PSUnavailableError), result
    finally:
        client.close()


def test_a_push_without_an_identity_is_not_sent_again(ps_server: Any, ps_client: Any,
                                                       short_push_deadline: None) -> None:
    # Without an update id the PS cannot tell a resent copy from a new push: the deadline fails it.
    ps_client.create([CreateSpec("w", value=np.zeros(4, np.float32))])
    hook = _SlowApply()
    ps_server.store.replicate = hook
    t, result = _push_in_thread(ps_client, Update("w", Op.ASSIGN_ADD, np.ones(4, np.float32)), "")
    try:
        t.join(60)
        assert not t.is_alive()
    finally:
        hook.release.set()
    err = result.get("error")
    assert isinstance(err, PSUnavailableError) and err.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED, result
    assert ps_client.push_resends == 0
    # The PS finished the one push it got once released; nothing was sent twice.
    ps_server.store.replicate = None
    poll_for(lambda: ps_client.pull([PullSpec("w")])[0][1] == 2, timeout=60, what="the held push to land")
    assert hook.calls == 1


@pytest.mark.parametrize("raw", ["0", "-5", "soon", "inf"])
def test_a_bad_push_work_timeout_is_refused(monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    monkeypatch.setenv(PUSH_WORK_TIMEOUT_ENV, raw)
    with pytest.raises(ConfigurationError, match=PUSH_WORK_TIMEOUT_ENV):
        push_work_timeout()


def test_the_push_work_timeout_defaults_and_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PUSH_WORK_TIMEOUT_ENV, raising=False)
    assert push_work_timeout() == DEFAULT_PUSH_WORK_TIMEOUT_S
    monkeypatch.setenv(PUSH_WORK_TIMEOUT_ENV, "90")
    assert push_work_timeout() == 90.0


@pytest.mark.usefixtures("short_push_deadline")
def test_a_pull_waiting_for_a_slow_push_past_its_deadline_is_asked_again(ps_server: Any, ps_client: Any) -> None:
    # A pull of a variable a push holds (the PS applies a push atomically) waits for that push's optimizer
    # step; past its deadline, with the PS answering health checks, the client asks again instead of failing
    # (the exact mode's dense Adam on a 10M-row table under load: bench/recsys.py's pulls timed out at 12 s).
    ps_client.create([CreateSpec("w", value=np.zeros(4, np.float32))])
    hook = _SlowApply()
    ps_server.store.replicate = hook
    t, result = _push_in_thread(ps_client, Update("w", Op.ASSIGN_ADD, np.ones(4, np.float32)), "u-held")
    pulled: dict[str, Any] = {}

    def pull() -> None:
        try:
            pulled["answer"] = ps_client.pull([PullSpec("w")])
        except BaseException as e:  # handed to the test's thread
            pulled["error"] = e

    puller = threading.Thread(target=pull, name="jaxdist-test-pull", daemon=True)
    try:
        assert hook.entered.wait(60)
        puller.start()
        poll_for(lambda: ps_client.pull_retries >= 2, timeout=60, what="the client to ask for the held pull again")
        assert "error" not in pulled and puller.is_alive()
    finally:
        hook.release.set()
    puller.join(60)
    t.join(60)
    assert not puller.is_alive() and not t.is_alive()
    assert "error" not in pulled, pulled.get("error")
    ((value, version),) = pulled["answer"]
    np.testing.assert_array_equal(value, np.ones(4, np.float32))  # the value after the push it waited for
    assert version == 2


@pytest.mark.usefixtures("short_push_deadline")
def test_a_pull_with_a_given_timeout_is_not_asked_again(ps_server: Any, ps_client: Any) -> None:
    ps_client.create([CreateSpec("w", value=np.zeros(4, np.float32))])
    hook = _SlowApply()
    ps_server.store.replicate = hook
    t, _ = _push_in_thread(ps_client, Update("w", Op.ASSIGN_ADD, np.ones(4, np.float32)), "u-held2")
    try:
        assert hook.entered.wait(60)
        with pytest.raises(PSUnavailableError) as info:
            ps_client.pull([PullSpec("w")], timeout=0.3)
        assert info.value.grpc_code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert ps_client.pull_retries == 0
    finally:
        hook.release.set()
    t.join(60)
    assert not t.is_alive()


@pytest.mark.usefixtures("short_push_deadline")
def test_a_dynamic_push_the_ps_works_on_past_its_deadline_completes_once(ps_server: Any, ps_client: Any) -> None:
    # A dynamic table's push can outlast its transfer deadline (a doubling copies the shard's
    # columns): resent under its id while the PS answers, applied once.
    from jaxdist.ps_server.dynamic_table import DynamicTableConfig, RowOptimizer

    ps_client.create_dynamic_table(DynamicTableConfig("d", (2,), initializer="zeros",
                                                      optimizer=RowOptimizer("sgd", 1.0)), 0, 1)
    entered, release = threading.Event(), threading.Event()
    calls: list[object] = []

    def slow_forward(header: object, payload: object = None) -> None:  # runs inside the push, after the table applied it
        calls.append(header)
        entered.set()
        assert release.wait(120), "the test never released the push"

    ps_server.servicer.dynamic.forward = slow_forward
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["answer"] = ps_client.dynamic_push("d", np.array([1, 2]), -np.ones((2, 2), np.float32),
                                                      update_id="dyn-slow")
        except BaseException as e:  # handed to the test's thread
            result["error"] = e

    t = threading.Thread(target=run, name="jaxdist-test-dynamic-push", daemon=True)
    t.start()
    try:
        assert entered.wait(60)
        poll_for(lambda: ps_client.push_resends >= 2, timeout=60, what="the client to resend the held push")
        assert "error" not in result and t.is_alive()
    finally:
        release.set()
    t.join(60)
    assert not t.is_alive()
    assert "error" not in result, result.get("error")
    assert result["answer"].duplicate  # the copy that got through waited for the first one
    assert len(calls) == 1
    ps_server.servicer.dynamic.forward = None
    rows, _ = ps_client.dynamic_lookup("d", np.array([1, 2]))
    np.testing.assert_array_equal(rows, np.ones((2, 2), np.float32))  # applied once
