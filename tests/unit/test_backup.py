"""Replication's state machine without sockets: a SetBackup that fails changes nothing; a push is applied
at most once whatever replication answers."""

from __future__ import annotations

import numpy as np
import pytest

from jaxdist.errors import BackupNotAttachedError, NotPrimaryError, PSUnavailableError, StaleEpochError
from jaxdist.proto import ps_pb2, ps_wire
from jaxdist.ps_server.backup import Replication
from jaxdist.ps_server.store import Update, VariableStore

pytestmark = pytest.mark.timeout(60)


class FakeBackup:
    """``send`` of a Replication: records what reaches the backup, or fails while ``down``."""

    def __init__(self) -> None:
        self.down = False
        self.sent: list[tuple[str, ps_pb2.ReplicaHeader]] = []

    def __call__(self, address: str, header: ps_pb2.ReplicaHeader, arrays: list[np.ndarray]) -> None:
        if self.down:
            raise PSUnavailableError(f"{address} is unreachable", task="backup")
        self.sent.append((address, header))


def state(r: Replication) -> tuple[str, int, str]:
    return r.role, r.epoch, r.backup


def test_failed_set_backup_changes_nothing() -> None:
    store = VariableStore()
    store.create("v", value=np.ones(2, np.float32))
    backup = FakeBackup()
    r = Replication(store, backup, lambda opt: b"")
    backup.down = True
    with pytest.raises(PSUnavailableError):
        r.attach("127.0.0.1:1", 5)
    assert state(r) == ("primary", 0, "")
    backup.down = False
    assert r.attach("b:1", 1) == (1, 8)  # a lower epoch than the failed one is still accepted
    assert state(r) == ("primary", 1, "b:1") and backup.sent[-1][1].full_sync
    with pytest.raises(StaleEpochError):
        r.attach("b:2", 0)
    assert state(r) == ("primary", 1, "b:1")
    r.attach("", 2)  # detach at a newer epoch
    assert state(r) == ("primary", 2, "")


def test_set_backup_on_a_backup_is_refused_unchanged() -> None:
    store = VariableStore()
    r = Replication(store, FakeBackup(), lambda opt: b"")
    r.accept(ps_pb2.ReplicaHeader(epoch=3, kind=ps_pb2.REPLICA_INSTALL, full_sync=True), [], lambda blob, digest: None)
    assert state(r) == ("backup", 3, "")
    with pytest.raises(NotPrimaryError):
        r.attach("b:1", 4)
    assert state(r) == ("backup", 3, "")


def _wired(primary_store: VariableStore, backup: Replication) -> Replication:
    """A primary whose forwards reach ``backup`` as its Replicate handler would apply them."""

    def send(address: str, header: ps_pb2.ReplicaHeader, arrays: list[np.ndarray]) -> None:
        backup.accept(header, arrays, lambda blob, digest: None)

    return Replication(primary_store, send, lambda opt: b"")


def test_a_backup_that_restarted_is_detached_and_the_primary_goes_on() -> None:
    """A fresh process at the backup's address (never full-synced) is not a newer primary: the
    push is applied once and acknowledged, the primary stays primary, degraded, until a new SetBackup."""
    store = VariableStore()
    store.create("v", value=np.zeros(2, np.float32))
    old_backup = Replication(VariableStore(), FakeBackup(), lambda opt: b"")
    primary = _wired(store, old_backup)
    primary.attach("b:1", 1)
    assert state(old_backup) == ("backup", 1, "")
    primary.store.apply([Update("v", "assign_add", np.ones(2, np.float32))], "run/1/x.1")
    restarted = Replication(VariableStore(), FakeBackup(), lambda opt: b"")  # the backup's new process
    header, arrays = ps_wire.encode_replica_update([Update("v", "assign_add", np.ones(2, np.float32))], "run/2/x.1", 1)
    with pytest.raises(BackupNotAttachedError):
        restarted.accept(header, arrays, lambda blob, digest: None)
    assert state(restarted) == ("primary", 0, "")  # refused: nothing changed there
    primary._send = _wired(VariableStore(), restarted)._send  # the backup's address now reaches the new process
    _, duplicate = store.apply([Update("v", "assign_add", np.ones(2, np.float32))], "run/2/x.1")
    assert not duplicate and state(primary) == ("primary", 1, "") and primary.degraded_events == 1
    np.testing.assert_array_equal(store.read("v"), [2.0, 2.0])
    primary.attach("b:1", 2)  # the coordinator attaches the restarted backup with a full sync
    assert state(restarted) == ("backup", 2, "")
    np.testing.assert_array_equal(restarted.store.read("v"), [2.0, 2.0])


def test_a_push_refused_after_its_apply_is_never_applied_twice() -> None:
    """A push whose forward is refused (this primary was superseded, or stepped down) changed the
    values here all the same: its id is recorded, so the client's retry, if the coordinator keeps
    this task as the primary, is a duplicate, and a full sync carries the id with the values."""
    store = VariableStore()
    store.create("v", value=np.zeros(2, np.float32))
    backup = FakeBackup()
    primary = Replication(store, backup, lambda opt: b"")
    primary.attach("b:1", 1)

    def superseded(address: str, header: ps_pb2.ReplicaHeader, arrays: list[np.ndarray]) -> None:
        raise StaleEpochError("replication from epoch 1; this PS is the primary at epoch 2")

    primary._send = superseded
    push = [Update("v", "assign_add", np.ones(2, np.float32))]
    with pytest.raises(NotPrimaryError):
        store.apply(push, "run/7/x.1")
    assert primary.role == "deposed"
    assert store.was_applied("run/7/x.1")
    primary._send = backup
    primary.attach("b:2", 1)  # the coordinator's view: still the primary of epoch 1
    _, duplicate = store.apply(push, "run/7/x.1")  # the client's retry
    assert duplicate
    np.testing.assert_array_equal(store.read("v"), [1.0, 1.0])
    full_sync = backup.sent[-1][1]
    assert full_sync.full_sync and any(i.endswith(":run/7/x.1") for i in full_sync.applied_ids)


def test_a_push_whose_variables_a_full_sync_replaced_is_not_recorded() -> None:
    """A client push racing with the full sync that makes this task a backup: its change went to
    the replaced variables, so its id stays out of the new dedupe table (the primary's forward of
    the same push must still apply here)."""
    store = VariableStore()
    store.create("v", value=np.zeros(2, np.float32))
    r = Replication(store, FakeBackup(), lambda opt: b"")

    def full_sync_meanwhile(updates: object, update_id: str) -> None:
        r.accept(ps_pb2.ReplicaHeader(epoch=3, kind=ps_pb2.REPLICA_INSTALL, full_sync=True), [],
                 lambda blob, digest: None)
        store.replace_all([("v", np.zeros(2, np.float32), None, None, 1)], [])
        raise NotPrimaryError("this PS became a backup during the push")

    store.replicate = full_sync_meanwhile
    with pytest.raises(NotPrimaryError):
        store.apply([Update("v", "assign_add", np.ones(2, np.float32))], "run/1/x.1")
    assert not store.was_applied("run/1/x.1")
    np.testing.assert_array_equal(store.read("v"), [0.0, 0.0])
