"""Consistent sharded checkpoints of parameter-server variables.

A checkpoint is a directory::

    ckpt-<step>/
      manifest.json      written last: step, variables and their shard layout,
                         files with sha256, data ledger, user metadata
      ps-0.npz, ps-1.npz one numpy archive per PS task, written by that PS

**Names.** As TF's ``tf.train.Checkpoint``: :meth:`Checkpoint.save` numbers its
saves (``save(prefix)`` writes ``<prefix>-1``, ``<prefix>-2``, ...: the
checkpoint's ``save_counter``, incremented first), :meth:`Checkpoint.write`
writes exactly at a path, :class:`CheckpointManager` writes
``<directory>/ckpt-<step>``, and :func:`latest_checkpoint` finds the newest of
either kind in a directory.

**Consistency.** :meth:`Checkpoint.save` pauses the coordinator
(:meth:`ClusterCoordinator.paused`: no new closure starts; running ones finish), then every PS snapshots all its
variables under their locks, in parallel. No push is half in a checkpoint,
and the variables of all PS tasks come from one quiet point of training.

**Atomicity.** Files go to ``ckpt-<step>.tmp-<id>/`` (each PS writes its own
file atomically), the manifest is written last, and the directory is renamed
into place. A crash at any point leaves the previous checkpoint intact and a
``.tmp-`` directory that :func:`latest_checkpoint` ignores and
:class:`CheckpointManager` deletes.

**Re-sharding.** The manifest records each variable's full shape and its
shards' row ranges; restore computes, for every shard of the *current*
layout, which rows of which saved shards fill it, and each PS reads those
pieces from the files itself (data never travels through the coordinator).
So 2 PS restore into 3, 4 shards into 1, and back.

**Without a cluster.** :func:`load` reads a checkpoint into numpy arrays on
one machine; the files are plain ``.npz`` (``numpy.load`` reads them).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shutil
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from jaxdist.base.errors import ConfigurationError, PSUnavailableError
from jaxdist.base.files import AtomicFile
from jaxdist.proto import codec, ps_pb2
from jaxdist.ps_server.checkpoint_io import sha256_file
from jaxdist.proto.ps_wire import optimizer_payload
from jaxdist.ps_server.client import PSClient
from jaxdist.ps_server.dynamic_table import DynamicTableConfig
from jaxdist.ps_server.dynamic_tables import unpack_export
from jaxdist.sync import checkpointing as sync_ckpt
from jaxdist.variables import variable_dtype

if TYPE_CHECKING:
    from jaxdist.cluster_coordinator.coordinator import ClusterCoordinator
    from jaxdist.cluster_coordinator.datasets import DataLedger
    from jaxdist.strategy import ParameterServerStrategy
    from jaxdist.sync.strategy import Strategy

logger = logging.getLogger(__name__)

__all__ = ["Checkpoint", "CheckpointManager", "latest_checkpoint", "load", "unflatten"]

MANIFEST = "manifest.json"
FORMAT_VERSION = 1
_CKPT_RE = re.compile(r"^ckpt-(\d+)$")
#: A save of :meth:`Checkpoint.save`: ``<prefix>-<n>`` (the manager's ``ckpt-<step>`` is one too).
_NUMBERED_RE = re.compile(r"^.+-(\d+)$")
#: Seconds between two looks at a PS being restored, while a save waits for it.
_RECOVERY_POLL_S = 0.2


class _ShardsMissing(Exception):
    """A save found PS tasks without variables they should hold (restarted empty): ``{ps index: names}``."""

    def __init__(self, missing: dict[int, set[str]]) -> None:
        super().__init__(", ".join(f"ps:{i}: {sorted(n)}" for i, n in sorted(missing.items())))
        self.missing = missing


def _numbered(name: str) -> int | None:
    """``n`` of a checkpoint directory named ``<prefix>-<n>`` (``ckpt-<step>`` included); None for any other name."""
    if ".tmp-" in name:  # a save in progress, or one a crash left (its manifest may be written already)
        return None
    m = _NUMBERED_RE.match(name)
    return int(m.group(1)) if m else None


def latest_checkpoint(directory: str) -> str | None:
    """The newest complete checkpoint in ``directory`` (TF's ``tf.train.latest_checkpoint``), or None.

    Candidates are the directories named ``<prefix>-<n>`` that hold a
    ``manifest.json`` (complete checkpoints): the ``ckpt-<step>`` of a
    :class:`CheckpointManager` and the ``<prefix>-<n>`` of
    :meth:`Checkpoint.save` alike. The highest ``n`` wins; between equal
    numbers under two prefixes, the one whose manifest was written last.
    TF reads the ``checkpoint`` state file its saves keep; jaxdist keeps
    none and reads the directory names. None when the directory does not
    exist or holds no checkpoint, so
    ``checkpoint.restore(jaxdist.latest_checkpoint(dir))`` does nothing on a
    fresh start (:meth:`Checkpoint.restore` of None is a no-op, as TF's).
    """
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return None
    best: tuple[int, float, str] | None = None
    for n in names:
        number = _numbered(n)
        if number is None:
            continue
        manifest = os.path.join(directory, n, MANIFEST)
        try:
            written = os.path.getmtime(manifest)
        except OSError:  # no manifest: an incomplete checkpoint, or not a checkpoint at all
            continue
        key = (number, written, n)
        if best is None or key > best:
            best = key
    return None if best is None else os.path.join(directory, best[2])


def _read_manifest(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise ConfigurationError(f"{path} is not a complete jaxdist checkpoint (no {MANIFEST})") from None
    if manifest.get("format") != FORMAT_VERSION:
        raise ConfigurationError(f"{path}: unsupported checkpoint format {manifest.get('format')!r}")
    return manifest


@contextmanager
def _quiet(coordinator: ClusterCoordinator | None, timeout: float | None = None, drain: bool = False) -> Iterator[None]:
    """Pause ``coordinator``'s dispatch for the duration of a save/restore.

    ``timeout`` bounds the wait for running closures (None: wait for all).
    ``drain`` (a save's): closures re-queued after their worker failed are
    re-run first (see :meth:`ClusterCoordinator.paused`).
    """
    if coordinator is None:
        yield
        return
    with coordinator.paused(timeout, drain=drain) as quiet:
        if not quiet:
            logger.warning("closures still running after %.0fs; going on without a quiet point", timeout)
        yield


def _coordinator_of(strategy: ParameterServerStrategy | Strategy | None) -> ClusterCoordinator | None:
    """The live ClusterCoordinator of a ParameterServerStrategy (synchronous strategies have none)."""
    if strategy is None or sync_ckpt.is_sync_strategy(strategy):
        return None
    return strategy.coordinator  # type: ignore[union-attr]


class Checkpoint:
    """Saves and restores every variable of ``strategy`` (and their optimizer states).

    Args:
        strategy: the strategy whose variables to save: a ParameterServerStrategy
            (each PS writes its own file), any synchronous strategy, or None for
            variables of the default strategy (see :mod:`jaxdist.sync.checkpointing`).
            Every strategy writes the same format, so checkpoints move between them.
        coordinator: its ClusterCoordinator, paused during save/restore so the
            snapshot is one quiet point of training (default: the strategy's).
        ledger: a ``DataLedger`` (exactly-once data) saved and restored with it.

    Attributes:
        step: the training step, saved in the manifest and set by restore.
        save_counter: how many times :meth:`save` has numbered a save (TF's
            ``save_counter``): 0 on a new Checkpoint, saved in the manifest and
            set back by :meth:`restore`, so saves after a restore go on
            numbering where the restored run stopped.
        metadata: any JSON-serialisable dict, saved and restored.
    """

    def __init__(
        self,
        strategy: ParameterServerStrategy | Strategy | None = None,
        coordinator: ClusterCoordinator | None = None,
        ledger: DataLedger | None = None,
    ) -> None:
        self.strategy = strategy
        self.coordinator = coordinator if coordinator is not None else _coordinator_of(strategy)
        self.ledger = ledger
        self.step = 0
        self.save_counter = 0
        self.metadata: dict[str, Any] = {}

    def _pausing(self) -> ClusterCoordinator | None:
        # A coordinator made after this Checkpoint is paused too.
        return self.coordinator if self.coordinator is not None else _coordinator_of(self.strategy)

    def _ps_strategy(self) -> ParameterServerStrategy:
        # Only called on the PS paths: save/restore hand synchronous strategies to their own writer first.
        return cast("ParameterServerStrategy", self.strategy)

    # -------------------------------------------------------------------- save
    def save(self, file_prefix: str) -> str:
        """Save a numbered checkpoint, as TF's ``Checkpoint.save``: writes ``f"{file_prefix}-{n}"``; returns that path.

        ``n`` is :attr:`save_counter` plus one; the counter takes that value
        once the checkpoint is written (a failed save leaves it, so a retry
        writes the same number). So the TF guide's
        ``checkpoint.save(os.path.join(checkpoint_dir, "ckpt"))`` every few
        epochs writes ``ckpt-1``, ``ckpt-2``, ... in ``checkpoint_dir``, and
        :func:`latest_checkpoint` finds the last. The directory is written as
        :meth:`write` writes it (same consistency, atomicity and errors); an
        existing ``<file_prefix>-<n>`` is never overwritten (FileExistsError:
        TF would overwrite it): a new Checkpoint saving where an earlier run
        saved first restores that run's latest checkpoint, which sets
        :attr:`save_counter` back, as TF's idiom
        ``checkpoint.restore(tf.train.latest_checkpoint(dir))`` does.
        """
        previous = self.save_counter
        self.save_counter = previous + 1  # written into the manifest by write()
        try:
            return self.write(f"{file_prefix}-{self.save_counter}")
        except BaseException:
            self.save_counter = previous
            raise

    def write(self, path: str) -> str:
        """Write a checkpoint directory at exactly ``path`` (must not exist); returns ``path``.

        TF's ``Checkpoint.write``: no numbering, :attr:`save_counter` is
        unchanged (and recorded in the manifest, as :attr:`step` is).
        :class:`CheckpointManager` writes its ``ckpt-<step>`` with it.

        While checkpoint-mode PS recovery is on (``coordinator.enable_ps_recovery``),
        a PS that is down, or restarted empty (its variables missing), is being
        recovered: the save waits until every PS holds its variables again (up
        to the recovery's timeout) and then saves them (the restored values).

        Raises:
            FileExistsError: ``path`` exists.
            PSUnavailableError: a PS cannot be reached, or restarted empty, and
                no recovery brings it back in time (or none is on, or it
                failed): retry once the PS is back and restored.
        """
        if sync_ckpt.is_sync_strategy(self.strategy):  # Mirrored, TPU, ..., default: same format, own writer
            return sync_ckpt.save(self, path)
        deadline: float | None = None
        started = self._pausing()
        failures = started.ps_recovery_failures if started is not None else 0  # a recovery failing from now on ends the wait
        while True:
            coordinator = self._pausing()
            timeout = coordinator.ps_recovery_timeout if coordinator is not None else None
            try:
                return self._save_ps(path)
            except _ShardsMissing as e:
                missing = e.missing
                if timeout is None:
                    first = min(missing)
                    raise PSUnavailableError(
                        f"ps:{first} lacks variables it should hold ({e}): it restarted empty, and no PS recovery "
                        "restores it (ClusterCoordinator.enable_ps_recovery)", task=f"ps:{first}") from None
            except PSUnavailableError as e:
                missing = self._placement()  # a PS is down: wait until every PS is back with its variables
                if timeout is None or not missing or (deadline is not None and time.monotonic() >= deadline):
                    raise
                logger.info("save of %s: %s", path, e)
            if deadline is None:
                deadline = time.monotonic() + timeout
            elif time.monotonic() >= deadline:
                first = min(missing)
                raise PSUnavailableError(f"ps:{first} was not restored in time for the checkpoint; retry the save",
                                         task=f"ps:{first}")
            logger.info("save of %s waits for the PS recovery of %s", path, sorted(f"ps:{i}" for i in missing))
            assert coordinator is not None
            self._wait_restored(missing, deadline, coordinator, failures)

    def _placement(self) -> dict[int, set[str]]:
        """The shard names every PS task should hold."""
        where: dict[int, set[str]] = defaultdict(set)
        for var in self._ps_strategy().variables.values():
            for shard, _ in var.shards():
                where[shard.ps_index].add(shard.name)
        return dict(where)

    def _wait_restored(self, missing: dict[int, set[str]], deadline: float, coordinator: ClusterCoordinator, failures: int) -> None:
        """Wait until every PS of ``missing`` holds the variables named there (``coordinator``'s recovery
        restored them).

        Raises:
            PSUnavailableError: not by ``deadline``, or a recovery failed (more than ``failures`` so far).
        """
        clients = self._ps_strategy().connections.clients
        pending = dict(missing)
        while pending:
            if coordinator.ps_recovery_failures != failures:
                first = min(pending)
                raise PSUnavailableError(f"the recovery of a PS failed (the job fails with its error): ps:{first} "
                                         "cannot be saved", task=f"ps:{first}")
            for i in list(pending):
                try:
                    present = {v.name for v in clients[i].list_variables(timeout=max(1.0, _RECOVERY_POLL_S * 5))}
                except PSUnavailableError:
                    continue  # down again, or still starting: the recovery handles it
                if pending[i] <= present:
                    del pending[i]
            if not pending:
                return
            if time.monotonic() >= deadline:
                first = min(pending)
                raise PSUnavailableError(f"ps:{first} was not restored in time for the checkpoint; retry the save",
                                         task=f"ps:{first}")
            time.sleep(_RECOVERY_POLL_S)

    def _save_ps(self, path: str) -> str:
        strategy = self._ps_strategy()
        path = os.path.abspath(path)
        if os.path.exists(path):
            raise FileExistsError(f"checkpoint {path} already exists")
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        os.makedirs(tmp)
        conns = strategy.connections
        t0 = time.perf_counter()
        try:
            # Drained: a closure whose worker died after it pushed part of its updates is re-run to
            # its end first. Otherwise the snapshot would hold those updates while the ledger below
            # still had its batches handed out, not done: a run resumed from it trains them again.
            with _quiet(self._pausing(), drain=True):
                results = conns.fan_out({i: functools.partial(_save_on, tmp, f"ps-{i}.npz") for i in range(len(conns.clients))})
                ledger_state = self.ledger.state() if self.ledger is not None else None
            files = {r.file_name: {"sha256": r.sha256, "bytes": r.bytes} for r in results.values()}
            # Keyed by (PS task, name): a PS may still hold a stale variable of the same name.
            where = {(i, sv.name): (r.file_name, sv.optimizer_leaves) for i, r in results.items() for sv in r.variables}
            missing = {i: {n for n in names if (i, n) not in where} for i, names in self._placement().items()}
            if any(missing.values()):
                raise _ShardsMissing({i: names for i, names in missing.items() if names})
            dynamic = {}
            for name, table in strategy.dynamic_tables.items():
                holders = sorted(i for i, r in results.items() if name in r.dynamic_tables)
                lacking = sorted(set(range(table.num_shards)) - set(holders))
                if lacking:
                    raise PSUnavailableError(
                        f"ps:{lacking[0]} does not hold its shard of dynamic table {name!r} (it restarted empty?)",
                        task=f"ps:{lacking[0]}")
                dynamic[name] = {"config": table.config.to_json(), "num_shards": table.num_shards,
                                 "files": [results[i].file_name for i in holders]}
            variables = {}
            for name, var in strategy.variables.items():
                shards = []
                for shard, row in var.shards():
                    file, leaves = where[(shard.ps_index, shard.name)]
                    shards.append({"name": shard.name, "file": file, "row_start": row, "shape": list(shard.shape),
                                   "optimizer_leaves": leaves})
                variables[name] = {"shape": list(var.shape), "dtype": _dtype_name(var.dtype), "shards": shards}
            manifest = {
                "format": FORMAT_VERSION,
                "step": int(self.step),
                "save_counter": int(self.save_counter),
                "created": time.time(),
                "num_ps": len(conns.clients),
                "files": files,
                "variables": variables,
                "dynamic_tables": dynamic,
                "ledger": ledger_state,
                "metadata": self.metadata,
            }
            with AtomicFile(os.path.join(tmp, MANIFEST), text=True) as f:
                json.dump(manifest, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        nbytes = sum(f["bytes"] for f in files.values())
        logger.info("saved %s (%.1f MB in %.2fs)", path, nbytes / 2**20, time.perf_counter() - t0)
        return path

    # ----------------------------------------------------------------- restore
    def _restore_dynamic_requests(
        self, path: str, manifest: dict[str, Any], variables: list[str] | None, ps_tasks: set[int] | None,
        by_ps: dict[int, ps_pb2.RestoreRequest],
    ) -> None:
        """Add the dynamic tables to restore to ``by_ps``: every table of the strategy (or those named in
        ``variables``), each shard of the current layout rebuilt by its PS from every saved shard (keys
        routed again by their hash: any saved shard count restores into any current one).

        Raises:
            ConfigurationError: the checkpoint lacks a table, or saved it with another config.
        """
        saved_tables = manifest.get("dynamic_tables") or {}
        files = manifest["files"]
        for name, table in self._ps_strategy().dynamic_tables.items():
            if variables is not None and name not in variables:
                continue
            saved = saved_tables.get(name)
            if saved is None:
                raise ConfigurationError(f"checkpoint {path} has no dynamic table {name!r}")
            if DynamicTableConfig.from_json(saved["config"]) != table.config:
                raise ConfigurationError(
                    f"dynamic table {name!r} is configured differently here than in {path}: {table.config} "
                    f"against {saved['config']}")
            config_json = json.dumps(table.config.to_json())
            for shard in range(table.num_shards):
                if ps_tasks is not None and shard not in ps_tasks:
                    continue
                e = by_ps[shard].dynamic.add(config_json=config_json, shard=shard, num_shards=table.num_shards)
                for f in saved["files"]:
                    e.files.add(file=f, sha256=files[f]["sha256"])

    def restore(
        self, path: str | None, variables: list[str] | None = None, ps_tasks: set[int] | None = None,
        quiesce_timeout: float | None = None,
    ) -> None:
        """Restore variables (all, or the named ones) and optimizer states from ``path``.

        The current layout may differ from the saved one (re-sharding). With
        ``ps_tasks``, only shards placed on those PS tasks are restored (PS
        recovery). Sets :attr:`step`, :attr:`save_counter` (checkpoints
        written before it was recorded leave it unchanged), :attr:`metadata`
        and the ledger.

        ``path`` None does nothing and returns None, as TF's ``restore(None)``:
        ``checkpoint.restore(jaxdist.latest_checkpoint(dir))`` is then the
        whole resume-or-start-fresh idiom (:func:`latest_checkpoint` is None
        when there is no checkpoint yet).

        Raises:
            ConfigurationError: the checkpoint lacks a variable, or shapes differ.
        """
        if path is None:  # TF's fresh start: nothing to restore, nothing changes
            logger.info("restore(None): no checkpoint to restore; the variables keep their values")
            return None
        if sync_ckpt.is_sync_strategy(self.strategy):
            if ps_tasks is not None or quiesce_timeout is not None:
                raise ConfigurationError("restore(ps_tasks=, quiesce_timeout=) apply to ParameterServerStrategy only")
            return sync_ckpt.restore(self, path, variables)
        strategy = self._ps_strategy()
        manifest = _read_manifest(path)
        restores_ledger = self.ledger is not None and manifest.get("ledger") is not None and ps_tasks is None
        if restores_ledger:
            assert self.ledger is not None
            self.ledger.check_restorable()  # before any variable changes: closures hold its positions
        files = manifest["files"]
        names = ([n for n in variables if n not in strategy.dynamic_tables] if variables is not None
                 else list(strategy.variables))
        by_ps: dict[int, ps_pb2.RestoreRequest] = defaultdict(lambda: ps_pb2.RestoreRequest(directory=path))
        payloads: dict[int, tuple[bytes, str]] = {}  # one pickle per optimizer object, not per shard
        for name in names:
            var = strategy.variables[name]
            saved = manifest["variables"].get(name)
            if saved is None:
                raise ConfigurationError(f"checkpoint {path} has no variable {name!r}")
            if list(saved["shape"]) != list(var.shape) or variable_dtype(saved["dtype"]) != var.dtype:
                raise ConfigurationError(
                    f"variable {name!r} is {list(var.shape)} {var.dtype} here but {saved['shape']} {saved['dtype']} in {path}"
                )
            for shard, row in var.shards():
                if ps_tasks is not None and shard.ps_index not in ps_tasks:
                    continue
                req = by_ps[shard.ps_index]
                e = req.entries.add(name=shard.name, with_optimizer_state=True)
                codec.spec_to_proto(shard.shape, shard.dtype, e.spec)
                opt = strategy.optimizers.get(shard.name)
                if opt is not None:
                    if id(opt) not in payloads:
                        payloads[id(opt)] = optimizer_payload(opt)
                    e.optimizer, e.optimizer_digest = payloads[id(opt)]
                for piece in _pieces(saved, row, shard.shape[0] if shard.shape else 0, bool(shard.shape)):
                    e.pieces.add(file=piece[0], source=piece[1], src_start=piece[2], src_stop=piece[3], dst_start=piece[4],
                                 sha256=files[piece[0]]["sha256"])
        self._restore_dynamic_requests(path, manifest, variables, ps_tasks, by_ps)
        conns = strategy.connections
        with _quiet(self._pausing(), quiesce_timeout):
            conns.fan_out({ps: functools.partial(_restore_on, req) for ps, req in by_ps.items()})
            if restores_ledger:
                assert self.ledger is not None
                self.ledger.load_state(manifest["ledger"])
        if ps_tasks is None:
            self.step = manifest["step"]
            if manifest.get("save_counter") is not None:
                self.save_counter = int(manifest["save_counter"])
            self.metadata = dict(manifest.get("metadata") or {})


def _save_on(directory: str, file_name: str, client: PSClient) -> ps_pb2.SaveResponse:
    return client.save(directory, file_name)


def _restore_on(req: ps_pb2.RestoreRequest, client: PSClient) -> int:
    return client.restore(req)


def _dtype_name(dt: np.dtype) -> str:
    return dt.name if dt.kind == "V" or dt.name == "bfloat16" else dt.str


def _pieces(saved: dict[str, Any], dst_row: int, rows: int, has_rows: bool) -> list[tuple[str, str, int, int, int]]:
    """Saved shard pieces ``(file, source, src_start, src_stop, dst_start)`` covering rows [dst_row, dst_row+rows)."""
    if not has_rows:
        s = saved["shards"][0]
        return [(s["file"], s["name"], 0, 0, 0)]
    out = []
    lo, hi = dst_row, dst_row + rows
    for s in saved["shards"]:
        s_lo = s["row_start"]
        s_hi = s_lo + s["shape"][0]
        a, b = max(lo, s_lo), min(hi, s_hi)
        if a < b:
            out.append((s["file"], s["name"], a - s_lo, b - s_lo, a - lo))
    return out


class CheckpointManager:
    """Keeps the last ``max_to_keep`` checkpoints ``directory/ckpt-<step>`` (TF's CheckpointManager)."""

    def __init__(self, checkpoint: Checkpoint, directory: str, max_to_keep: int = 3) -> None:
        if max_to_keep < 1:
            raise ValueError("max_to_keep must be >= 1")
        self.checkpoint = checkpoint
        self.directory = os.path.abspath(directory)
        self.max_to_keep = max_to_keep
        os.makedirs(self.directory, exist_ok=True)
        for n in os.listdir(self.directory):  # leftovers of crashed saves
            if ".tmp-" in n:
                shutil.rmtree(os.path.join(self.directory, n), ignore_errors=True)

    @property
    def latest_checkpoint(self) -> str | None:
        """The manager's own newest ``ckpt-<step>`` (other saves in its directory are not its)."""
        found = self.checkpoints
        return found[-1] if found else None

    @property
    def checkpoints(self) -> list[str]:
        found = []
        for n in os.listdir(self.directory):
            m = _CKPT_RE.match(n)
            if m and os.path.exists(os.path.join(self.directory, n, MANIFEST)):
                found.append((int(m.group(1)), os.path.join(self.directory, n)))
        return [p for _, p in sorted(found)]

    def save(self, step: int | None = None) -> str:
        if step is not None:
            self.checkpoint.step = step
        path = self.checkpoint.write(os.path.join(self.directory, f"ckpt-{self.checkpoint.step}"))
        for old in self.checkpoints[: -self.max_to_keep]:
            shutil.rmtree(old, ignore_errors=True)
        return path

    def restore_or_initialize(self) -> str | None:
        """Restore the latest checkpoint if there is one; returns its path (None: fresh start)."""
        latest = self.latest_checkpoint
        if latest is not None:
            self.checkpoint.restore(latest)
        return latest


def load(path: str, with_optimizer_state: bool = False) -> dict[str, Any]:
    """Read a checkpoint on one machine, without servers.

    Returns ``{"step", "save_counter", "variables": {name: full array}, "dynamic_tables", "metadata",
    "ledger"}`` (``save_counter`` None in a checkpoint written before it was recorded)
    and, with ``with_optimizer_state``, ``"optimizer_state": {name: [leaf arrays]}``
    (row-shaped leaves concatenated across shards, in ``jax.tree.leaves`` order).

    ``"dynamic_tables"`` holds each :class:`~jaxdist.DynamicEmbedding` saved:
    ``{name: {"config": its DynamicTableConfig as JSON, "num_shards", "keys", "values"}}``, the
    shards merged, keys ascending (int64, or a numpy unicode array for string keys), ``values[i]``
    the row of ``keys[i]``; with ``with_optimizer_state`` also ``"optimizer_state"``: per-row state
    aligned with the keys (``"t"``, pushes each row received, and the rule's slots: ``"acc"`` for
    Adagrad, ``"m"``/``"v"`` for lazy Adam). Keys waiting for admission and the counters are not
    returned (they are state of training, restored by :meth:`Checkpoint.restore`).
    Every file's sha256 is verified.
    """
    manifest = _read_manifest(path)
    archives = {}
    for file, info in manifest["files"].items():
        full = os.path.join(path, file)
        if sha256_file(full) != info["sha256"]:
            raise ConfigurationError(f"checkpoint file {full} is corrupt (sha256 mismatch)")
        archives[file] = np.load(full, allow_pickle=False)
    try:
        out_vars, out_opt = {}, {}
        for name, saved in manifest["variables"].items():
            parts = [archives[s["file"]][f"param/{s['name']}"] for s in saved["shards"]]
            out_vars[name] = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)
            if with_optimizer_state:
                n = saved["shards"][0]["optimizer_leaves"]
                leaves = []
                for i in range(n):
                    ls = [archives[s["file"]][f"opt/{s['name']}/{i}"] for s in saved["shards"]]
                    row = len(ls) > 1 and all(leaf.ndim and leaf.shape[1:] == tuple(saved["shape"][1:]) for leaf in ls)
                    leaves.append(np.concatenate(ls, axis=0) if row else ls[0])
                out_opt[name] = leaves
        out_dynamic = {name: _load_dynamic(name, entry, archives, with_optimizer_state)
                       for name, entry in (manifest.get("dynamic_tables") or {}).items()}
    finally:
        for a in archives.values():
            a.close()
    result: dict[str, Any] = {"step": manifest["step"], "save_counter": manifest.get("save_counter"), "variables": out_vars,
                              "dynamic_tables": out_dynamic, "metadata": manifest.get("metadata") or {},
                              "ledger": manifest.get("ledger")}
    if with_optimizer_state:
        result["optimizer_state"] = out_opt
    return result


def _load_dynamic(name: str, entry: dict[str, Any], archives: dict[str, Any], with_optimizer_state: bool) -> dict[str, Any]:
    """One saved dynamic table, its shards' files merged (see :func:`load`)."""
    config = DynamicTableConfig.from_json(entry["config"])
    exports = []
    for file in entry["files"]:
        if file not in archives:
            raise ConfigurationError(f"checkpoint dynamic table {name!r} names file {file!r}, which it does not list")
        exports.append(unpack_export(config, archives[file].__getitem__))
    keys = np.concatenate([e["keys"] for e in exports])
    if config.key_dtype == "string":
        keys = np.asarray(keys.tolist(), dtype=str) if len(keys) else np.zeros(0, dtype="<U1")
    order = np.argsort(keys, kind="stable")
    out: dict[str, Any] = {"config": entry["config"], "num_shards": entry["num_shards"], "keys": keys[order],
                           "values": np.concatenate([e["values"] for e in exports])[order]}
    if with_optimizer_state:
        state = {"t": np.concatenate([e["t"] for e in exports])[order]}
        for slot in config.optimizer.slot_names():
            state[slot] = np.concatenate([e["slot_" + slot] for e in exports])[order]
        out["optimizer_state"] = state
    return out


def unflatten(variables: dict[str, Any], prefix: str) -> Any:
    """Nested dicts from ``{prefix}/a/b``-style names (as ``create_variables`` names dict pytrees)."""
    tree: dict[str, Any] = {}
    for name, value in variables.items():
        if not name.startswith(prefix + "/"):
            continue
        node = tree
        *parents, leaf = name[len(prefix) + 1 :].split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree
