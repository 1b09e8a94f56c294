"""Primary/backup replication of one PS shard.

Every PS task may be the *primary* of its shard (the default: clients read and
push there) or a *backup* (it takes no client calls and applies only what its
primary forwards). The protocol, by message:

* ``SetBackup(address, epoch)`` (coordinator -> primary): under every variable
  lock, the primary sends its whole state (values, optimizer states, versions,
  the ids of applied updates) to the backup as one full-sync INSTALL, then
  forwards every later change before acknowledging it.
* A push is applied on the primary and forwarded (REPLICA_UPDATE, the same
  entries, the same ``update_id``) while the primary still holds the locks of
  the variables it touched, so the backup applies pushes to one variable in
  the primary's order and ends with the same values and versions. The client
  gets its answer only after the backup acknowledged: **an acknowledged update
  is on two processes**. Creates, restores and deletes are forwarded the same
  way (REPLICA_INSTALL / REPLICA_DELETE).
* ``Promote(epoch)`` (coordinator -> backup, after the primary died): the
  backup becomes the primary of a newer epoch. From then on it refuses
  replication from older epochs; a deposed primary that comes back (e.g. after
  a network cut) gets :class:`StaleEpochError` on its next forward, steps down
  and answers clients :class:`NotPrimaryError` - it can never acknowledge an
  update again.

If the backup is unreachable, the primary detaches it and goes on alone
(*degraded*: acknowledged updates then live on one process until the
coordinator attaches a backup again with a new full sync). A pushed update
that failed to reach the backup is not acknowledged as replicated unless the
backup is declared gone: the primary does not block training on a dead
backup, which is the usual primary/backup trade-off (two simultaneous
failures can lose updates; one cannot).

The messages are encoded by :mod:`jaxdist.proto.ps_wire` (``encode_replica_*``); this
module is the protocol's state machine, free of sockets and tested on its own.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np

from jaxdist.base.errors import BackupNotAttachedError, InvalidRequestError, JaxdistError, NotPrimaryError, StaleEpochError
from jaxdist.proto import codec, ps_pb2, ps_wire
from jaxdist.ps_server.dynamic_tables import DynamicTables, config_from_json, decode_counts, decode_keys
from jaxdist.ps_server.optimizer import Optimizer
from jaxdist.ps_server.store import Update, VariableStore

logger = logging.getLogger(__name__)

__all__ = ["ROLE_CODES", "Replication"]

#: Replication roles as numbers, for GetStatus counters and metrics.
ROLE_CODES = {"primary": 0.0, "backup": 1.0, "deposed": 2.0}


# --------------------------------------------------------------------- state
class Replication:
    """The replication role of one PS task, and its link to its backup. Thread-safe.

    ``send(address, header, arrays)`` sends one Replicate stream and raises
    typed jaxdist errors (injected so this class is tested without sockets).
    """

    def __init__(
        self,
        store: VariableStore,
        send: Callable[[str, ps_pb2.ReplicaHeader, list[np.ndarray]], None],
        optimizer_blob: Callable[[Optimizer], bytes],
    ) -> None:
        self.store = store
        self._send = send
        self._optimizer_blob = optimizer_blob
        self._lock = threading.Lock()
        # Serializes full syncs with forwarded creates/deletes (see attach()).
        self._membership = threading.Lock()
        self.role = "primary"  # a key of ROLE_CODES
        self.epoch = 0
        self.backup = ""  # address of the attached backup, "" when none
        self.forwarded = 0
        self.degraded_events = 0
        # Set while this (backup) task applies what its primary forwarded.
        self._from_primary = threading.local()
        store.replicate = self._forward_update
        #: This task's dynamic tables, replicated beside the variables (set by the servicer).
        self.dynamic: DynamicTables | None = None

    # ----------------------------------------------------------- client side
    def check_primary(self, task: str) -> None:
        """Raise :class:`NotPrimaryError` unless this task serves clients."""
        if self.role != "primary":
            raise NotPrimaryError(f"{task} is a {self.role} PS (epoch {self.epoch}); ask the coordinator for the primary")

    # -------------------------------------------------------------- forwarding
    def _deliver(self, header: ps_pb2.ReplicaHeader, arrays: list[np.ndarray]) -> None:
        backup = self.backup
        if not backup:
            return
        try:
            self._send(backup, header, arrays)
            self.forwarded += 1
        except StaleEpochError:
            # A newer primary exists: step down for good, acknowledge nothing more.
            with self._lock:
                self.role, self.backup = "deposed", ""
            logger.error("superseded by a newer primary (backup %s refused epoch %d); stepping down", backup, self.epoch)
            raise NotPrimaryError(f"this PS was superseded (epoch {self.epoch})") from None
        except JaxdistError as e:
            # Backup gone, broken or restarted (BackupNotAttachedError): go on alone rather than stop
            # training; the coordinator sees backup="" in GetStatus and attaches one again.
            with self._lock:
                if self.backup == backup:
                    self.backup = ""
                    self.degraded_events += 1
            logger.warning("backup %s lost (%s: %s); running without a backup", backup, type(e).__name__, e)

    def _forward_update(self, updates: Sequence[Update], update_id: str) -> None:
        if getattr(self._from_primary, "active", False):
            return  # applying what the primary forwarded: nothing to forward
        if self.role != "primary":
            # A client push that passed check_primary just before this task became a
            # backup (full sync) or was deposed: it must not be acknowledged.
            raise NotPrimaryError(f"this PS became a {self.role} (epoch {self.epoch}) during the push")
        if self.backup:
            self._deliver(*ps_wire.encode_replica_update(updates, update_id, self.epoch))

    def forward_dynamic(self, header: ps_pb2.ReplicaHeader, payload: list[np.ndarray]) -> None:
        """Forward a change of a dynamic table (``header``'s dynamic fields set; ``payload``: its
        out-of-band arrays), called while the table's apply lock is held, so the backup gets its
        changes in the order they were applied."""
        if getattr(self._from_primary, "active", False):
            return  # applying what the primary forwarded: nothing to forward
        if self.role != "primary":
            raise NotPrimaryError(f"this PS became a {self.role} (epoch {self.epoch}) during the change")
        if self.backup:
            header.epoch, header.kind = self.epoch, ps_pb2.REPLICA_DYNAMIC
            self._deliver(header, payload)

    def forward_install(self, names: Sequence[str]) -> None:
        """After creating/restoring ``names`` here: copy them to the backup."""
        if not names:
            return
        with self._membership:
            if not self.backup:
                return
            with self.store.frozen(names) as snap:
                variables = [(n, v, self.store.optimizer_of(n), s, ver) for n, v, s, ver in snap]
                self._deliver(*ps_wire.encode_replica_install(variables, self.epoch, self._optimizer_blob))

    def forward_delete(self, names: Sequence[str]) -> None:
        with self._membership:
            if self.backup and names:
                self._deliver(ps_wire.encode_replica_delete(names, self.epoch), [])

    # ----------------------------------------------------------- coordinator
    def attach(self, address: str, epoch: int) -> tuple[int, int]:
        """Make ``address`` this primary's backup: full sync, then forward. Returns (variables, bytes).

        The role and epoch change only once the full sync was delivered: a SetBackup
        that fails (stale epoch, sent to a backup, backup unreachable) changes nothing.
        """
        self._check_attach(epoch)
        with self._membership:
            if not address:
                with self._lock:
                    self._check_attach(epoch)
                    self.role, self.epoch, self.backup = "primary", epoch, ""
                return 0, 0
            dynamic_payload: list[np.ndarray] = []
            with self.store.frozen() as snap, self._dynamic_frozen(dynamic_payload) as installs:
                variables = [(n, v, self.store.optimizer_of(n), s, ver) for n, v, s, ver in snap]
                header, arrays = ps_wire.encode_replica_install(
                    variables, epoch, self._optimizer_blob, full_sync=True, applied_ids=self.store.applied_ids())
                # The tables' arrays travel after the variables', chunked like them (no message limit).
                header.dynamic_installs.extend(installs)
                arrays += dynamic_payload
                self._send(address, header, arrays)  # errors go to the coordinator, which retries
                # Still under every lock: no push falls between the sync and forwarding, and
                # every forward from here on carries the new epoch.
                with self._lock:
                    self._check_attach(epoch)  # a Promote or a newer primary may have come meanwhile
                    self.role, self.epoch, self.backup = "primary", epoch, address
        logger.info("backup %s attached at epoch %d (%d variables)", address, epoch, len(variables))
        return len(variables), sum(a.nbytes for a in arrays)

    def _dynamic_frozen(self, payload: list[np.ndarray]) -> contextlib.AbstractContextManager[list[ps_pb2.DynamicInstall]]:
        return self.dynamic.frozen(payload) if self.dynamic is not None else contextlib.nullcontext([])

    def _check_attach(self, epoch: int) -> None:
        if epoch < self.epoch:
            raise StaleEpochError(f"SetBackup for epoch {epoch}, but this PS is at epoch {self.epoch}")
        if self.role == "backup":
            raise NotPrimaryError(f"SetBackup sent to a backup PS (epoch {self.epoch}); promote it first")

    def promote(self, epoch: int) -> int:
        """Become the primary at ``epoch`` (this task was the backup of a failed primary)."""
        with self._lock:
            if epoch <= self.epoch and self.role != "backup":
                raise StaleEpochError(f"Promote to epoch {epoch}, but this PS is already at epoch {self.epoch} as {self.role}")
            self.role, self.epoch, self.backup = "primary", max(epoch, self.epoch), ""
        logger.warning("promoted to primary at epoch %d", self.epoch)
        return self.epoch

    # ------------------------------------------------------------ backup side
    def accept(self, header: ps_pb2.ReplicaHeader, arrays: Sequence[np.ndarray], optimizer: Callable[[bytes, str], Optimizer | None]) -> None:
        """Apply one message from the primary (this task becomes/stays its backup).

        The message is checked and decoded before anything changes: a refused one
        (stale epoch, malformed installs) leaves the role, the epoch and the variables.
        """
        with self._lock:
            self._check_accept(header)
        if header.kind == ps_pb2.REPLICA_INSTALL:
            variables = ps_wire.decode_replica_installs(header, arrays, optimizer)
        elif header.kind not in (ps_pb2.REPLICA_UPDATE, ps_pb2.REPLICA_DELETE, ps_pb2.REPLICA_DYNAMIC):
            raise InvalidRequestError(f"unknown replication kind {header.kind}")
        if (header.kind == ps_pb2.REPLICA_DYNAMIC or header.dynamic_installs) and self.dynamic is None:
            raise InvalidRequestError("this PS keeps no dynamic tables")
        with self._lock:
            self._check_accept(header)  # again: a Promote or SetBackup may have come meanwhile
            if header.kind == ps_pb2.REPLICA_INSTALL and header.full_sync:
                self.role, self.epoch, self.backup = "backup", header.epoch, ""
        if header.kind == ps_pb2.REPLICA_UPDATE:
            self._from_primary.active = True
            try:
                self.store.apply(ps_wire.decode_updates(header.push, iter(arrays)), header.push.update_id)
            finally:
                self._from_primary.active = False
        elif header.kind == ps_pb2.REPLICA_INSTALL:
            if header.full_sync:
                self.store.replace_all(variables, list(header.applied_ids))
                if self.dynamic is not None:
                    n_var = sum(1 + len(e.state) for e in header.installs)
                    self.dynamic.accept_installs(header.dynamic_installs, replace_all=True, payload=arrays[n_var:])
            else:
                for name, value, opt, state, version in variables:
                    self.store.install(name, value, opt, state, version)
        elif header.kind == ps_pb2.REPLICA_DYNAMIC:
            assert self.dynamic is not None
            self._accept_dynamic(header, self.dynamic, arrays)
        else:
            present = {i.name for i in self.store.info()}
            self.store.delete([n for n in header.deletes if n in present])

    def _accept_dynamic(self, header: ps_pb2.ReplicaHeader, dynamic: DynamicTables, payload: Sequence[np.ndarray]) -> None:
        """Apply a forwarded change of a dynamic table, exactly as the primary did (nothing forwarded on)."""
        self._from_primary.active = True
        try:
            if header.HasField("dynamic_create"):
                c = header.dynamic_create
                dynamic.create(config_from_json(c.config_json), c.shard, c.num_shards)
            elif header.HasField("dynamic_push"):
                p = header.dynamic_push
                dynamic.push(p.table, decode_keys(p.keys, self.store.max_variable_bytes),
                             codec.tensor_from_proto(p.grads, self.store.max_variable_bytes), p.update_id,
                             occurrences=decode_counts(p))
            else:
                dynamic.accept_installs(header.dynamic_installs, replace_all=False, payload=payload)
        finally:
            self._from_primary.active = False

    def _check_accept(self, header: ps_pb2.ReplicaHeader) -> None:
        """(With ``_lock`` held.) StaleEpochError unless this task may apply ``header`` from its primary."""
        if header.epoch < self.epoch or (header.epoch == self.epoch and self.role == "primary" and self.epoch > 0):
            raise StaleEpochError(f"replication from epoch {header.epoch}; this PS is the {self.role} at epoch {self.epoch}")
        if not (header.kind == ps_pb2.REPLICA_INSTALL and header.full_sync) and self.role != "backup":
            # Not a newer primary (that case is above): a task no full sync made a backup, e.g. a
            # backup that restarted at its address. The sender must not step down for it.
            raise BackupNotAttachedError(
                f"replication before a full sync: this PS is a {self.role} at epoch {self.epoch}, not an attached "
                "backup; the primary detaches it and the coordinator attaches it again (SetBackup)")
