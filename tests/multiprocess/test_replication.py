"""Primary/backup replication of PS shards: the protocol without sockets, then real SIGKILLs."""

from __future__ import annotations

import time

import grpc
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.errors import BackupNotAttachedError, NotPrimaryError, PSUnavailableError, StaleEpochError
from jaxdist.proto import codec, ps_pb2, ps_wire
from jaxdist.proto.ps_wire import Op, PullSpec, Update
from jaxdist.ps_server.client import PSClient
from jaxdist.ps_server.optimizer import Optimizer
from jaxdist.ps_server.backup import Replication
from jaxdist.ps_server.store import VariableStore

from jaxdist.testing import poll_for


# ------------------------------------------------------------- sans-IO protocol
class _Pair:
    """A primary and a backup Replication wired by direct calls (the wire format is still exercised)."""

    def __init__(self) -> None:
        self.stores = {"p": VariableStore(), "b": VariableStore()}
        self.opts: dict[str, Optimizer] = {}
        self.down: set[str] = set()
        self.reps = {k: Replication(s, self._send, lambda opt: b"") for k, s in self.stores.items()}

    def _optimizer(self, blob: bytes, digest: str) -> Optimizer | None:
        return self.opts.get(digest)

    def _send(self, address: str, header: ps_pb2.ReplicaHeader, arrays: list[np.ndarray]) -> None:
        if address in self.down:
            raise PSUnavailableError(f"{address} is down")
        # Through the real encoding: bytes out, FrameReader back in.
        frames = list(codec.iter_frames(arrays))
        header = ps_pb2.ReplicaHeader.FromString(header.SerializeToString())
        reader = codec.FrameReader(ps_wire.replica_payload_specs(header, 1 << 30))
        for f in frames:
            reader.feed(f)
        self.reps[address].accept(header, reader.finish(), self._optimizer)


def _value(store: VariableStore, name: str) -> np.ndarray:
    with store.reading(name) as r:
        return np.array(r.value)


@pytest.mark.timeout(60)
def test_updates_reach_the_backup_in_order_with_the_same_versions_and_ids() -> None:
    pair = _Pair()
    p, b = pair.stores["p"], pair.stores["b"]
    opt = Optimizer(optax.sgd(0.5, momentum=0.9), "m")
    pair.opts["m"] = opt
    p.create("w", value=np.ones(4, np.float32), optimizer=opt)
    pair.reps["p"].attach("b", epoch=1)  # full sync of the existing variable
    assert pair.reps["b"].role == "backup" and _value(b, "w").tolist() == [1.0] * 4
    for i in range(5):
        p.apply([Update("w", Op.APPLY_GRADIENT, np.full(4, i, np.float32))], update_id=f"c/{i}")
    p.create("t", value=np.zeros((3, 2), np.int32))
    pair.reps["p"].forward_install(["t"])
    p.apply([Update("t", Op.SCATTER_ADD, np.ones((2, 2), np.int32), np.array([0, 2]))], update_id="s/1")
    np.testing.assert_array_equal(_value(b, "w"), _value(p, "w"))  # momentum state followed the same order
    np.testing.assert_array_equal(_value(b, "t"), [[1, 1], [0, 0], [1, 1]])
    assert {i.name: i.version for i in b.info()} == {i.name: i.version for i in p.info()}
    # A client push reaching the backup's store directly is never acknowledged ...
    with pytest.raises(NotPrimaryError):
        b.apply([Update("w", Op.APPLY_GRADIENT, np.ones(4, np.float32))], update_id="c/9")
    # ... and a retried push after failover is a duplicate on the promoted backup.
    pair.reps["b"].promote(2)
    assert b.apply([Update("w", Op.APPLY_GRADIENT, np.ones(4, np.float32))], update_id="c/3")[1] is True


@pytest.mark.timeout(60)
def test_full_sync_carries_applied_ids_and_later_pushes_are_forwarded() -> None:
    pair = _Pair()
    p, b = pair.stores["p"], pair.stores["b"]
    p.create("c", value=np.zeros((), np.int64))
    p.apply([Update("c", Op.ASSIGN_ADD, np.ones((), np.int64))], update_id="x/1")
    pair.reps["p"].attach("b", epoch=1)
    assert b.apply([Update("c", Op.ASSIGN_ADD, np.ones((), np.int64))], update_id="x/1")[1] is True
    p.apply([Update("c", Op.ASSIGN_ADD, np.ones((), np.int64))], update_id="x/2")
    assert int(_value(b, "c")) == 2 and int(_value(p, "c")) == 2


@pytest.mark.timeout(60)
def test_dead_backup_degrades_and_a_promoted_backup_fences_the_old_primary() -> None:
    pair = _Pair()
    p, b = pair.stores["p"], pair.stores["b"]
    p.create("c", value=np.zeros((), np.int64))
    pair.reps["p"].attach("b", epoch=1)
    # The backup is promoted (the coordinator thought the primary dead) ...
    assert pair.reps["b"].promote(2) == 2
    pair.reps["b"].check_primary("ps:0")
    # ... so the old primary's next forward is refused: it steps down and acknowledges nothing.
    with pytest.raises(NotPrimaryError):
        p.apply([Update("c", Op.ASSIGN_ADD, np.ones((), np.int64))], update_id="y/1")
    assert pair.reps["p"].role == "deposed"
    with pytest.raises(NotPrimaryError):
        pair.reps["p"].check_primary("ps:0")
    with pytest.raises(StaleEpochError):
        pair.reps["b"].accept(ps_pb2.ReplicaHeader(epoch=1, kind=ps_pb2.REPLICA_DELETE), [], pair._optimizer)
    # A new backup that is down: the primary goes on alone (degraded) and says so.
    pair.down.add("p")
    with pytest.raises(PSUnavailableError):
        pair.reps["b"].attach("p", epoch=2)
    pair.reps["b"].backup = "p"
    b.apply([Update("c", Op.ASSIGN_ADD, np.ones((), np.int64))], update_id="z/1")
    assert pair.reps["b"].backup == "" and pair.reps["b"].degraded_events == 1


# ---------------------------------------------------------------- real processes
@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_backup_refuses_clients_and_stale_replication_over_grpc() -> None:
    with jaxdist.LocalCluster(num_workers=1, num_ps=1, ps_backups=True) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            v = jaxdist.create_variable(np.arange(4, dtype=np.float32), name="v", optimizer=optax.sgd(1.0))
        v.apply_gradient(np.ones(4, np.float32))
        with PSClient(cluster.address("ps_backup:0"), cluster.credentials, task="ps_backup:0") as backup:
            with pytest.raises(NotPrimaryError) as e:
                backup.pull([PullSpec("v")])
            assert e.value.grpc_code == grpc.StatusCode.UNAVAILABLE
            with pytest.raises(NotPrimaryError):
                backup.push([Update("v", Op.ASSIGN, np.zeros(4, np.float32))])
            st = backup.status()
            assert st.counters["replica_role"] == 1.0 and st.counters["updates_applied"] >= 1
            with pytest.raises(StaleEpochError) as e2:
                backup.replicate(ps_pb2.ReplicaHeader(epoch=0, kind=ps_pb2.REPLICA_DELETE), [])
            assert e2.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.RpcError) as e3:  # a garbage header: INVALID_ARGUMENT, and the server lives
                backup._replicate(iter([b"\xff\xff\xff"]), metadata=backup.credentials.metadata, timeout=5)
            assert e3.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert backup.status().counters["replica_role"] == 1.0
        assert strategy.replicas is not None
        # Promote the backup by hand: it now has every acknowledged update.
        strategy.replicas.fail_over(0)
        np.testing.assert_array_equal(v.numpy(), np.arange(4, dtype=np.float32) - 1.0)
        strategy.close()


@pytest.mark.timeout(300)
@pytest.mark.multiprocess
def test_counter_is_exact_despite_sigkill_of_primaries() -> None:
    """N closures each add 1; the primary of ps:0 is SIGKILLed, restarted (it becomes the backup),
    then the promoted backup is SIGKILLed too: the counters still end at exactly N."""
    n = 240
    with jaxdist.LocalCluster(num_workers=2, num_ps=2, ps_backups=True) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            c0 = jaxdist.create_variable(np.zeros((), np.int64), name="c0")
            c1 = jaxdist.create_variable(np.zeros((), np.int64), name="c1")
        assert (c0.ps_index, c1.ps_index) == (0, 1)
        coord = jaxdist.ClusterCoordinator(strategy)

        def add() -> None:
            time.sleep(0.01)
            jaxdist.variables.push_updates([(c0, Op.ASSIGN_ADD, np.ones((), np.int64), None), (c1, Op.ASSIGN_ADD, np.ones((), np.int64), None)])

        rvs = [coord.schedule(add) for _ in range(n)]

        def finished() -> int:
            return sum(1 for rv in rvs if rv.done())

        poll_for(lambda: finished() >= n // 4, timeout=120)
        cluster.kill("ps:0")  # SIGKILL the primary of shard 0
        poll_for(lambda: strategy.replicas.failovers >= 1, timeout=60)  # type: ignore[union-attr]
        cluster.restart("ps:0")  # comes back empty; the coordinator attaches it as the new backup
        poll_for(lambda: strategy.replicas.status(0)[1], timeout=60)  # type: ignore[union-attr]
        poll_for(lambda: finished() >= n // 2, timeout=120)
        cluster.kill("ps_backup:0")  # now the primary: fail back over to the restarted ps:0
        poll_for(lambda: strategy.replicas.failovers >= 2, timeout=60)  # type: ignore[union-attr]
        coord.join()
        assert [rv.fetch() for rv in rvs] == [None] * n
        assert int(c0.numpy()) == n
        assert int(c1.numpy()) == n
        assert strategy.replicas.pairs[0][0] == cluster.address("ps:0")  # type: ignore[union-attr]
        coord.shutdown()
        strategy.close()


@pytest.mark.timeout(120)
@pytest.mark.multiprocess
def test_a_restarted_backup_is_detached_and_the_push_applied_once_over_grpc() -> None:
    """The backup restarts at its address and nobody has attached it again yet: the primary's next
    forward reaches a fresh process, which answers BackupNotAttachedError. The primary goes on alone
    (degraded, still the primary) and applies the push once; it does not step down as if superseded
    (which had left the push applied without its id, so the client's retry applied it twice)."""
    with jaxdist.LocalCluster(num_workers=1, num_ps=1, ps_backups=True) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            v = jaxdist.create_variable(np.zeros(4, dtype=np.float32), name="v")
        v.assign_add(np.ones(4, np.float32))
        cluster.kill("ps_backup:0")
        cluster.restart("ps_backup:0")  # a fresh process at the same address, not a backup yet
        with PSClient(cluster.address("ps_backup:0"), cluster.credentials, task="ps_backup:0") as fresh:
            header, arrays = ps_wire.encode_replica_update([Update("v", Op.ASSIGN_ADD, np.ones(4, np.float32))], "r/1/x.1", 1)
            with pytest.raises(BackupNotAttachedError) as e:
                fresh.replicate(header, arrays)
            assert e.value.grpc_code == grpc.StatusCode.FAILED_PRECONDITION
        v.assign_add(np.ones(4, np.float32))  # forwarded to the fresh process: refused, the primary goes on
        np.testing.assert_array_equal(v.numpy(), [2.0] * 4)
        with PSClient(cluster.address("ps:0"), cluster.credentials, task="ps:0") as primary:
            st = primary.status()
            assert st.counters["replica_role"] == 0.0 and st.counters["replica_degraded"] >= 1
        strategy.close()
