"""Replication's state machine without sockets: a SetBackup that fails changes nothing."""

from __future__ import annotations

import numpy as np
import pytest

from jaxdist.errors import NotPrimaryError, PSUnavailableError, StaleEpochError
from jaxdist.proto import ps_pb2
from jaxdist.ps_server.backup import Replication
from jaxdist.ps_server.store import VariableStore

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
