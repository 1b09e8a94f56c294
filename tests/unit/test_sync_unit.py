"""In-process tests of jaxdist.sync: no fake devices needed (one CPU device is enough).

Covers the input context, the replication analysis, the default strategy, the
coordination service (sans-IO state with a fake clock, then real gRPC on
127.0.0.1 port 0) and the configuration errors of TPU/MultiWorker strategies.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxdist.sync as sd
from jaxdist import errors as E
from jaxdist.cluster_resolver import SimpleClusterResolver
from jaxdist.transport.credentials import Credentials
from jaxdist.sync import coordination as co
from jaxdist.sync._varying import varying_outputs
from jaxdist.testing import poll_for

pytestmark = pytest.mark.timeout(60)


# -- InputContext / ReduceOp ----------------------------------------------------------------


def test_input_context_per_replica_batch_size() -> None:
    ctx = sd.InputContext(num_input_pipelines=2, input_pipeline_id=1, num_replicas_in_sync=8)
    assert ctx.get_per_replica_batch_size(64) == 8
    with pytest.raises(ValueError, match="not divisible"):
        ctx.get_per_replica_batch_size(60)
    with pytest.raises(E.ConfigurationError):
        sd.InputContext(num_input_pipelines=2, input_pipeline_id=2)
    assert sd.InputContext() == sd.InputContext(1, 0, 1)
    with pytest.raises(AttributeError):
        ctx.input_pipeline_id = 0  # type: ignore[misc]


def test_reduce_op_coerce() -> None:
    assert sd.ReduceOp.coerce("sum") is sd.ReduceOp.SUM
    assert sd.ReduceOp.coerce(sd.ReduceOp.MEAN) is sd.ReduceOp.MEAN
    with pytest.raises(ValueError, match="unknown reduce op"):
        sd.ReduceOp.coerce("max")


# -- replication analysis ------------------------------------------------------------------


def _analyse(fn: Any, *avals: Any, varying: list[bool]) -> list[bool]:
    closed = jax.make_jaxpr(fn, axis_env=[("replica", 4)])(*avals)
    return varying_outputs(closed, varying, "replica")


def test_replication_analysis_follows_collectives_and_control_flow() -> None:
    w, x = jnp.ones(3), jnp.ones(3)

    def fn(w: Any, x: Any) -> Any:
        g = jax.grad(lambda w: jnp.sum(jnp.tanh(w * x)))(w)
        s = jax.lax.psum(g, "replica")
        m = jax.lax.pmean(x, "replica")
        loop = jax.lax.fori_loop(0, 2, lambda i, c: c + s, w)
        carry_x = jax.lax.fori_loop(0, 2, lambda i, c: c + x, w)
        cond_inv = jax.lax.cond(jnp.sum(s) > 0, lambda: w, lambda: w * 2)
        cond_var = jax.lax.cond(jnp.sum(x) > 0, lambda: w, lambda: w * 2)
        rid = jax.lax.axis_index("replica")
        j = jax.jit(lambda a, b: (a + 1, b + 1))(w, x)
        return g, s, m, loop, carry_x, cond_inv, cond_var, rid, j[0], j[1], w * 3

    got = _analyse(fn, w, x, varying=[False, True])
    assert got == [True, False, False, False, True, False, True, True, False, True, False]


def test_replication_analysis_scan_carry_fixed_point() -> None:
    def fn(w: Any, x: Any) -> Any:
        # The carry becomes varying only on the second iteration's input: needs the fixed point.
        def body(c: Any, _: Any) -> Any:
            a, b = c
            return (b, a + x), None

        (a, b), _ = jax.lax.scan(body, (w, w), None, length=3)
        return a, b

    assert _analyse(fn, jnp.ones(2), jnp.ones(2), varying=[False, True]) == [True, True]
    assert _analyse(fn, jnp.ones(2), jnp.ones(2), varying=[False, False]) == [False, False]


# -- default strategy -----------------------------------------------------------------------


def test_default_strategy_is_pass_through() -> None:
    s = sd.get_strategy()
    assert s.num_replicas_in_sync == 1 and not sd.has_strategy() and not sd.in_cross_replica_context()
    ctx = sd.get_replica_context()
    assert ctx is not None and ctx.num_replicas_in_sync == 1
    assert s.run(lambda a, b=0: a + b, args=(1,), kwargs={"b": 2}) == 3
    assert s.run(lambda: sd.get_replica_context().all_reduce("sum", 5.0)) == 5.0
    np.testing.assert_allclose(s.reduce("sum", jnp.array([1.0, 2.0])), [1.0, 2.0])
    np.testing.assert_allclose(s.reduce("mean", jnp.array([1.0, 3.0]), axis=0), 2.0)
    assert s.experimental_local_results(4) == (4,)
    batch = (np.arange(6).reshape(3, 2), np.arange(3))
    (got,) = list(s.experimental_distribute_dataset([batch]))
    assert got[0] is not None and np.array_equal(got[0], batch[0])
    (got_b, mask), = list(s.experimental_distribute_dataset([batch], with_mask=True))
    assert np.array_equal(mask, [1, 1, 1]) and np.array_equal(got_b[1], batch[1])
    np.testing.assert_allclose(sd.compute_average_loss(jnp.array([1.0, 3.0])), 2.0)
    np.testing.assert_allclose(sd.scale_regularization_loss(jnp.float32(3.0)), 3.0)
    with s.scope():
        assert sd.get_strategy() is s and sd.get_replica_context() is not None


def test_tpu_strategy_without_tpu_says_how_to_fake_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAXDIST_TPU_FAKE_DEVICES", raising=False)
    with pytest.raises(E.ConfigurationError, match="no TPU devices were found") as info:
        sd.TPUStrategy()
    assert "JAXDIST_TPU_FAKE_DEVICES=cpu" in str(info.value)
    assert "xla_force_host_platform_device_count" in str(info.value)
    s = sd.TPUStrategy(devices=jax.devices("cpu"))
    assert s.num_replicas_in_sync == len(jax.devices("cpu"))


# -- MultiWorkerMirroredStrategy configuration -------------------------------------------------


def test_mwms_single_worker_runs_locally() -> None:
    r = SimpleClusterResolver({"worker": ["127.0.0.1:1"]}, task_type="worker", task_id=0)
    s = sd.MultiWorkerMirroredStrategy(r)
    assert s.num_processes == 1 and s.num_replicas_in_sync == jax.local_device_count()
    assert s.cluster_resolver is r and s.task == "worker:0"
    s.shutdown()


def test_mwms_rejects_non_collective_tasks_and_late_creation() -> None:
    spec = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    with pytest.raises(E.ConfigurationError, match="chief/worker tasks; this task is ps:0"):
        sd.MultiWorkerMirroredStrategy(SimpleClusterResolver(spec, task_type="ps", task_id=0))
    jax.devices()  # JAX is in use in this process: it can no longer join a multi-process job.
    with pytest.raises(E.ConfigurationError, match="before any other JAX call"):
        sd.MultiWorkerMirroredStrategy(SimpleClusterResolver(spec, task_type="worker", task_id=0))
    with pytest.raises(E.ConfigurationError, match="on_peer_failure"):
        sd.MultiWorkerMirroredStrategy(on_peer_failure="ignore")


def test_peer_failed_error_is_a_task_unavailable_error() -> None:
    err = sd.PeerFailedError("worker:1 died", task="worker:1", rank=1)
    assert isinstance(err, E.TaskUnavailableError) and err.task == "worker:1" and err.rank == 1
    assert sd.EXIT_PEER_FAILED == 138


# -- coordination: sans-IO state ------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_state_registration_heartbeats_and_timeouts() -> None:
    clock = FakeClock()
    st = co.CoordinationState(3, "127.0.0.1:9", peer_timeout_s=3.0, session_id="s", clock=clock)
    assert st.register(0, "chief:0", "a")["jax_coordinator_address"] == "127.0.0.1:9"
    st.register(1, "worker:0", "b")
    st.register(1, "worker:0", "b")  # idempotent
    assert st.missing() == [2]
    assert st.wait_all(0.0) == {"ready": False, "missing": ["2"], "failures": []}
    st.register(2, "worker:1", "c")
    assert st.wait_all(0.0)["ready"]
    clock.t = 2.0
    st.heartbeat(1, "b")
    clock.t = 3.5
    # worker:1 is silent since t=0 (> 3 s); worker:0 beat at t=2; rank 0 hosts the state.
    (f,) = st.check(exclude=0)
    assert (f.rank, f.task) == (2, "worker:1") and "presumed dead" in f.message
    assert st.check(exclude=0) == []  # reported once
    assert [m["rank"] for m in st.heartbeat(1, "b")["failures"]] == [2]
    st.leave(1)
    clock.t = 100.0
    assert st.check(exclude=0) == []  # a process that left is not watched
    with pytest.raises(E.InvalidRequestError):
        st.heartbeat(7, "x")


def test_state_restarted_process_fails_the_job() -> None:
    st = co.CoordinationState(2, "h:1", clock=FakeClock())
    st.register(1, "worker:1", "old")
    with pytest.raises(E.ConfigurationError, match="restart every process"):
        st.register(1, "worker:1", "new")
    assert [f.rank for f in st.failures] == [1]
    with pytest.raises(E.ConfigurationError):
        st.heartbeat(1, "new")


# -- coordination: real gRPC on loopback ---------------------------------------------------------------


class _CountingClient(co.CoordinationClient):
    """Counts the heartbeats it has had answered."""

    answered = 0

    def heartbeat(self, *args: Any, **kwargs: Any) -> Any:
        out = super().heartbeat(*args, **kwargs)
        self.answered += 1
        return out


def test_service_detects_a_silent_peer_and_tells_the_others() -> None:
    failures: list[co.PeerFailedError] = []
    client_failures: list[co.PeerFailedError] = []
    st = co.CoordinationState(3, "127.0.0.1:1", peer_timeout_s=0.6)
    svc = co.CoordinationService(st, "127.0.0.1", 0, Credentials("tok"), on_failure=failures.append, check_interval_s=0.05)
    port = svc.start()
    addr = f"127.0.0.1:{port}"
    clients = [_CountingClient(addr, Credentials("tok"), "worker:0") for _ in range(3)]
    senders: list[co.HeartbeatSender] = []
    try:
        for rank, c in enumerate(clients):
            assert c.register(rank, f"worker:{rank}", f"inc{rank}", timeout=5)["num_processes"] == 3
        for rank, c in enumerate(clients):
            c.wait_all(rank, timeout=5)
        for rank in (1, 2):
            sink = client_failures.append if rank == 2 else (lambda e: None)
            h = co.HeartbeatSender(clients[rank], rank, f"inc{rank}", sink, interval_s=0.05, peer_timeout_s=0.6)
            h.start()
            senders.append(h)
        # Live peers are not failed: wait until both have been answered for over a peer timeout's worth.
        poll_for(lambda: all(c.answered >= 15 for c in clients[1:]), 30, what="heartbeats of ranks 1 and 2")
        assert not failures
        senders[0].stop()  # worker:1 goes silent
        t0 = time.monotonic()
        poll_for(lambda: failures and client_failures, 5, what="the silent peer to be reported")
        assert time.monotonic() - t0 < 3
        assert failures[0].task == "worker:1" and failures[0].rank == 1
        assert isinstance(client_failures[0], co.PeerFailedError) and client_failures[0].rank == 1
        with pytest.raises(E.AuthenticationError):
            co.CoordinationClient(addr, Credentials("wrong"), "worker:0").heartbeat(2, "inc2", timeout=2)
    finally:
        for h in senders:
            h.stop()
        for c in clients:
            c.close()
        svc.stop(grace=None)


def test_heartbeat_sender_reports_a_dead_service() -> None:
    st = co.CoordinationState(2, "127.0.0.1:1", peer_timeout_s=30)
    svc = co.CoordinationService(st, "127.0.0.1", 0, Credentials(), on_failure=lambda e: None)
    port = svc.start()
    client = co.CoordinationClient(f"127.0.0.1:{port}", Credentials(), "chief:0")
    got: list[co.PeerFailedError] = []
    done = threading.Event()
    client.register(1, "worker:0", "i", timeout=5)
    h = co.HeartbeatSender(client, 1, "i", lambda e: (got.append(e), done.set()), interval_s=0.05, peer_timeout_s=0.5)
    h.start()
    try:
        svc.stop(grace=None)  # process 0 "dies"
        assert done.wait(5)
        assert got[0].rank == 0 and got[0].task == "chief:0" and "presumed dead" in str(got[0])
    finally:
        h.stop()
        client.close()


def test_wait_all_names_missing_processes() -> None:
    st = co.CoordinationState(3, "127.0.0.1:1")
    svc = co.CoordinationService(st, "127.0.0.1", 0, Credentials(), on_failure=lambda e: None)
    port = svc.start()
    client = co.CoordinationClient(f"127.0.0.1:{port}", Credentials(), "worker:0")
    try:
        client.register(0, "worker:0", "i", timeout=5)
        with pytest.raises(co.PeerFailedError, match="processes 1, 2 did not join"):
            client.wait_all(0, timeout=0.3)
    finally:
        client.close()
        svc.stop(grace=None)


def test_public_api_is_pinned() -> None:
    assert sorted(sd.__all__) == sorted(
        [
            "AXIS",
            "CentralStorageStrategy",
            "CollectiveCommunication",
            "CommunicationImplementation",
            "CommunicationOptions",
            "CrossDeviceOps",
            "DeviceAssignment",
            "EXIT_PEER_FAILED",
            "HierarchicalCopyAllReduce",
            "InputContext",
            "InputOptions",
            "InputReplicationMode",
            "MirroredStrategy",
            "MultiWorkerMirroredStrategy",
            "NcclAllReduce",
            "OneDeviceStrategy",
            "Optimizer",
            "PeerFailedError",
            "PerReplica",
            "ReduceOp",
            "ReductionToOneDevice",
            "ReplicaContext",
            "Strategy",
            "StrategyExtended",
            "SyncVariable",
            "TPUStrategy",
            "Topology",
            "ValueContext",
            "VariableAggregation",
            "VariableSynchronization",
            "assign_variables",
            "compute_average_loss",
            "create_variable",
            "create_variables",
            "experimental_connect_to_cluster",
            "function",
            "get_replica_context",
            "get_strategy",
            "has_strategy",
            "in_cross_replica_context",
            "initialize_tpu_system",
            "read_variables",
            "replicate",
            "replicated",
            "scale_regularization_loss",
        ]
    )
    for name in sd.__all__:
        assert getattr(sd, name) is not None
