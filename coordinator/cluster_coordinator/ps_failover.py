"""The coordinator's side of PS replication: which task is each shard's primary.

A cluster spec with a ``ps_backup`` job (one backup per ``ps`` task, same
order) turns replication on: ``ParameterServerStrategy`` attaches backup ``i``
to primary ``i`` before any variable exists, and :class:`ReplicaSet` keeps the
current ``[primary, backup]`` address of every shard. When a primary stops
answering, :meth:`ReplicaSet.fail_over` promotes its backup at a newer epoch
and points this process's connections (and, through the coordinator, every
worker's) at it; when the old primary comes back it is attached as the new
backup after a full sync. See :mod:`jaxdist.ps_server.backup` for the PS
side and the guarantees.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

from jaxdist.base.errors import ConfigurationError, JaxdistError, PSUnavailableError
from jaxdist.ps_server.client import PSClient
from jaxdist.ps_server.connections import PSConnections
from jaxdist.transport.credentials import Credentials

logger = logging.getLogger(__name__)

__all__ = ["ReplicaSet"]


class ReplicaSet:
    """Primary and backup address of every PS shard, and the failover steps. Thread-safe."""

    def __init__(self, primaries: Sequence[str], backups: Sequence[str], credentials: Credentials, conns: PSConnections) -> None:
        if len(primaries) != len(backups):
            raise ConfigurationError(
                f"replication needs one 'ps_backup' task per 'ps' task; got {len(primaries)} ps and {len(backups)} ps_backup"
            )
        self._credentials = credentials
        self._conns = conns
        self._lock = threading.Lock()
        self.pairs = [[p, b] for p, b in zip(primaries, backups)]
        self.epochs = [1] * len(primaries)
        self.failovers = 0
        #: The coordinator run begun on every task (""until a coordinator starts): a backup attached
        #: later begins it too, before its full sync, so it fences earlier runs once it is promoted.
        self.run_id = ""
        self._clients: dict[str, PSClient] = {}
        self._closed = False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    def primaries(self) -> list[str]:
        with self._lock:
            return [p for p, _ in self.pairs]

    def backup_of(self, shard: int) -> str:
        with self._lock:
            return self.pairs[shard][1]

    def _client(self, address: str, shard: int, role: str) -> PSClient:
        """A cached client (its channel reconnects by itself after the task restarts)."""
        with self._lock:
            if self._closed:
                raise PSUnavailableError(f"ps:{shard}: the strategy was closed", task=f"ps:{shard}")
            c = self._clients.get(address)
            if c is None:
                c = self._clients[address] = PSClient(address, self._credentials, task=f"ps:{shard} ({role} {address})")
            return c

    def attach_all(self, timeout: float = 600.0) -> None:
        """Attach every backup to its primary (start of the job)."""
        for i in range(len(self.pairs)):
            self.attach(i, timeout=timeout)

    def attach(self, shard: int, timeout: float = 600.0) -> None:
        """Full-sync shard ``shard``'s backup from its primary; from then on every update is on both.

        Raises the primary's or the backup's typed error (e.g. PSUnavailableError) when it fails.
        """
        with self._lock:
            primary, backup = self.pairs[shard]
            epoch = self.epochs[shard]
            run_id = self.run_id
        if run_id:
            self._client(backup, shard, "backup").begin_run(run_id)
        resp = self._client(primary, shard, "primary").set_backup(backup, epoch, timeout=timeout)
        logger.info("ps:%d backup %s attached to %s at epoch %d (%d variables, %d bytes)",
                    shard, backup, primary, epoch, resp.variables, resp.bytes)

    def fail_over(self, shard: int) -> str:
        """Promote shard ``shard``'s backup (its primary is gone); returns the new primary's address.

        This process's connection for the shard is switched to the new primary;
        the caller tells the workers (their cluster spec's ``ps`` list).
        """
        with self._lock:
            old, backup = self.pairs[shard]
            epoch = self.epochs[shard] + 1
        epoch = self._client(backup, shard, "backup").promote(epoch)
        with self._lock:
            self.pairs[shard] = [backup, old]
            self.epochs[shard] = epoch
            self.failovers += 1
        self._conns.replace(shard, backup)
        logger.warning("ps:%d failed over from %s to %s (epoch %d)", shard, old, backup, epoch)
        return backup

    def begin_run(self, run_id: str) -> None:
        """Begin coordinator run ``run_id`` on every backup (the coordinator begins it on the primaries
        through its connections), and on every backup attached from now on. A backup that does not
        answer is skipped (logged): it begins the run when it is attached again."""
        with self._lock:
            self.run_id = run_id
            backups = [(i, b) for i, (_, b) in enumerate(self.pairs)]
        for shard, address in backups:
            try:
                self._client(address, shard, "backup").begin_run(run_id)
            except JaxdistError as e:
                logger.warning("ps:%d backup %s did not begin run %s: %s (it will when it is attached again)",
                               shard, address, run_id, e)

    def status(self, shard: int, timeout: float = 1.0) -> tuple[bool, bool]:
        """``(primary answers, primary has its backup attached)`` for shard ``shard``."""
        alive, has_backup, _, _ = self.probe(shard, timeout)
        return alive, has_backup

    def probe(self, shard: int, timeout: float = 1.0) -> tuple[bool, bool, str, str]:
        """:meth:`status`, the primary's process incarnation ("" when it does not answer: a new one
        at the same address means the primary restarted, with nothing in it) and its address."""
        with self._lock:
            primary = self.pairs[shard][0]
        try:
            st = self._client(primary, shard, "primary").status(timeout=timeout)
        except JaxdistError:
            return False, False, "", primary
        has_backup = st.counters.get("replica_has_backup", 0.0) == 1.0 and st.counters.get("replica_role", 0.0) == 0.0
        return True, has_backup, st.incarnation, primary

    def backup_reachable(self, shard: int, timeout: float = 1.0) -> bool:
        with self._lock:
            backup = self.pairs[shard][1]
        try:
            self._client(backup, shard, "backup").status(timeout=timeout)
            return True
        except JaxdistError:
            return False

    def shutdown_backups(self, reason: str, exit_code: int) -> None:
        """Tell every backup to exit (the job is over); unreachable ones are skipped."""
        for shard in range(len(self.pairs)):
            try:
                self._client(self.backup_of(shard), shard, "backup").shutdown(reason, exit_code, timeout=2.0)
            except JaxdistError:
                pass
