"""The dynamic tables one PS task serves, and their wire form (keys, rows, gradient rows).

A PS task holds at most one shard of each dynamic table
(:class:`~jaxdist.ps_server.dynamic_table.DynamicTableShard`). This module keeps them by name and is
what the servicer's ``CreateDynamicTable``, ``DynamicLookup`` and ``DynamicPush`` RPCs call.

Contract:

- **Create** is idempotent: creating a shard that exists with the same config and placement keeps it
  as it is (a coordinator re-running its setup, or a second worker, never resets a table); another
  config or placement is refused with :class:`VariableExistsError` (``ALREADY_EXISTS``).
- **Lookups** are pure reads (see :mod:`~jaxdist.ps_server.dynamic_table`).
- **Pushes** come uncounted (one gradient row per key occurrence) or counted (each distinct key
  once, its rows summed, with its occurrence count: what this package's clients send), with the
  same effect (:meth:`~jaxdist.ps_server.dynamic_table.DynamicTableShard.apply`), and are forwarded
  to a backup in the form they came in. They are applied at most once per update id, through the
  store's dedupe table (:meth:`~jaxdist.ps_server.store.VariableStore.apply_once`): a re-run
  closure's or a retried push is a duplicate, exactly like a variable push (the servicer puts it
  behind the same run fence).
- **Exports for serving.** Every shard takes part in the export cuts of the store's
  :class:`~jaxdist.ps_server.export_rows.ChangeTracker` (:meth:`DynamicTables.participants`): a full
  export writes its keys and rows, a delta the rows of the keys inserted or pushed since the base
  cut and the keys evicted since, read from the shard's own log
  (:meth:`~jaxdist.ps_server.dynamic_table.DynamicTableShard.changes_since`) at the cut, under the
  table's apply lock, so a push is in exactly one export and the push path pays nothing for it. A
  shard created, restored or installed (a backup's full sync) since the base, or whose eviction log
  no longer reaches back to it, is changed *as a whole*: the exporter writes a full export.
- **Hostile input** (malformed keys, keys of the wrong type, rows of the wrong shape or dtype, an
  unknown table, a push that would pass the shard's memory bound) raises a typed error (gRPC status
  ``INVALID_ARGUMENT``, ``NOT_FOUND``, ``RESOURCE_EXHAUSTED``) before anything changes; the push's id
  is not recorded, so a corrected retry is applied.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import hashlib
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from jaxdist.base.errors import (
    ConfigurationError,
    InvalidRequestError,
    JaxdistError,
    VariableExistsError,
    VariableNotFoundError,
)
from jaxdist.proto import codec, ps_pb2
from jaxdist.proto.ps_wire import out_of_band
from jaxdist.ps_server.checkpoint_io import PieceReader
from jaxdist.ps_server.dynamic_table import DynamicTableConfig, DynamicTableShard
from jaxdist.ps_server.dynamic_export import ShardParticipant

if TYPE_CHECKING:
    # A type only: the PS client imports this module (encode_keys), and a worker has no store (nor its optax).
    from jaxdist.ps_server.store import VariableStore

__all__ = ["STAT_NAMES", "DynamicTables", "config_from_json", "decode_counts", "decode_keys", "dynamic_push_digest",
           "encode_counts", "encode_keys", "install_message", "pack_export", "unpack_export"]

logger = logging.getLogger(__name__)

#: Names of the per-table counters reported in ``GetStatus`` as ``dynamic/<table>/<name>``.
STAT_NAMES = ("rows", "bytes", "inserts", "admissions_refused", "evictions", "pushes", "pending_keys")


def dynamic_push_digest(table: str) -> str:
    """The dedupe-table digest of a push to ``table``: names the table, like a variable push's digest
    names its variables, so one update id given to pushes of two tables is refused, not dropped."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"dynamic:{len(table)}:{table};".encode())
    return h.hexdigest()


def encode_keys(keys: np.ndarray | Sequence[str], out: ps_pb2.DynamicKeys) -> ps_pb2.DynamicKeys:
    """Wire form of a batch of keys: an int64 tensor, or strings."""
    if isinstance(keys, np.ndarray) and keys.dtype.kind in "iu":
        codec.tensor_to_proto(keys.astype(np.int64, copy=False), out.ids)
    else:
        out.is_string = True
        out.strings.extend(list(keys))
    return out


def decode_keys(msg: ps_pb2.DynamicKeys, max_bytes: int) -> np.ndarray | list[str]:
    """The keys of a request, as sent (their type is checked against the table by the shard).

    Raises:
        InvalidRequestError: both or neither form given, or a tensor whose bytes do not match its spec.
    """
    if msg.is_string:
        if msg.HasField("ids"):
            raise InvalidRequestError("dynamic keys carry both ids and strings")
        return list(msg.strings)
    if msg.strings:
        raise InvalidRequestError("dynamic keys carry strings but are not marked as strings")
    if not msg.HasField("ids"):
        raise InvalidRequestError("dynamic keys carry no ids")
    return codec.tensor_from_proto(msg.ids, max_bytes)


def encode_counts(counts: np.ndarray, out: ps_pb2.DynamicPushRequest) -> None:
    """A counted push's occurrence counts into its request (``counts`` field, one per key)."""
    out.counts.extend(np.asarray(counts, dtype=np.int64).tolist())


def decode_counts(msg: ps_pb2.DynamicPushRequest) -> np.ndarray | None:
    """A push's occurrence counts (int64), or None for a push of one row per key occurrence (no counts:
    what every client sent before counted pushes; proto3 cannot tell an empty list from none, and a
    push of no keys is the same either way)."""
    if not msg.counts:
        return None
    return np.array(msg.counts, dtype=np.int64)


#: Allocations from this size up get pages of their own (glibc), given back to the system when freed.
LARGE_ALLOCATION_BYTES = 1 << 20
_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number


def unmap_large_allocations() -> bool:
    """Make glibc serve allocations of :data:`LARGE_ALLOCATION_BYTES` and more with their own pages
    (``mallopt(M_MMAP_THRESHOLD)``), so they go back to the system when freed; True if set.

    Why: by default glibc raises that threshold up to 32 MB as large blocks are freed, so the
    megabytes a dynamic push or lookup allocates and frees (keys, rows, gradient sums) come from the
    per-thread heaps of the server's threads, where fragmentation keeps them: a PS growing a 3M-key
    table kept ~300 MB more that way (``bench/dynamic_scale.py``). Done once, at the first dynamic
    table of the process. Not done on other C libraries, or when ``MALLOC_MMAP_THRESHOLD_`` is set
    (the user's choice stands).
    """
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES))


class DynamicTables:
    """The dynamic table shards of one PS task, by table name. Thread-safe."""

    def __init__(self, store: VariableStore) -> None:
        self.store = store
        self._lock = threading.Lock()  # membership; taken before any table's apply lock
        self._tables: dict[str, DynamicTableShard] = {}
        # Per table: its shard as an export-cut participant (a new one whenever the shard is replaced).
        self._participants: dict[str, ShardParticipant] = {}
        # Per table: held while a push is applied and forwarded, so a backup gets the pushes in the
        # order they were applied here (and a full sync sees none half done).
        self._apply_locks: dict[str, threading.Lock] = {}
        #: Sends one replication message (its dynamic fields set) and its payload arrays to the
        #: backup, if any: set by the servicer (Replication.forward_dynamic). Raises NotPrimaryError
        #: when this task must not acknowledge the change.
        self.forward: Callable[[ps_pb2.ReplicaHeader, list[np.ndarray]], None] | None = None
        self._allocator_set = False

    def create(self, config: DynamicTableConfig, shard: int, num_shards: int) -> bool:
        """Create this task's shard of a table; False if it existed identically (kept as it is).
        A new shard is forwarded to the backup before any push to it can be."""
        with self._lock:
            old = self._tables.get(config.name)
            if old is not None:
                if old.config == config and (old.shard, old.num_shards) == (shard, num_shards):
                    return False
                raise VariableExistsError(
                    f"dynamic table {config.name!r} exists here with another config or placement "
                    f"(shard {old.shard} of {old.num_shards})")
            if not self._tables and not self._allocator_set:
                self._allocator_set = True
                logger.debug("large allocations unmapped when freed: %s", unmap_large_allocations())
            self._place(DynamicTableShard(config, shard, num_shards))
            lock = self._apply_locks[config.name]
            lock.acquire()
        try:
            logger.info("dynamic table %r: shard %d of %d created", config.name, shard, num_shards)
            if self.forward is not None:
                header = ps_pb2.ReplicaHeader()
                header.dynamic_create.CopyFrom(ps_pb2.CreateDynamicTableRequest(
                    config_json=json.dumps(config.to_json()), shard=shard, num_shards=num_shards))
                self.forward(header, [])
        finally:
            lock.release()
        return True

    def get(self, name: str) -> DynamicTableShard:
        with self._lock:
            t = self._tables.get(name)
        if t is None:
            raise VariableNotFoundError(f"no dynamic table {name!r} on this PS task")
        return t

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._tables)

    def lookup(self, name: str, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        return self.get(name).lookup(keys)

    def push(
        self, name: str, keys: Any, grads: np.ndarray, update_id: str, wire: ps_pb2.DynamicPushRequest | None = None,
        occurrences: np.ndarray | None = None,
    ) -> tuple[dict[str, int] | None, bool]:
        """Apply one push of gradient rows at most once per ``update_id``: ``(counts, duplicate)``.

        ``occurrences``: a counted push's count per key (None: one row per occurrence); see
        :meth:`DynamicTableShard.apply`. An applied push is forwarded to the backup (``wire``: the
        request as received, counts included, else encoded here) while the table's apply lock is
        held, in the form it came in, so the backup applies the same push. Its id is recorded even
        when forwarding refused it (this task was deposed meanwhile): the rows here changed, so a
        retry must find it applied.
        """
        table = self.get(name)
        with self._apply_lock(name):
            def change() -> tuple[dict[str, int], JaxdistError | None]:
                counts = table.apply(keys, grads, occurrences)
                if self.forward is None:
                    return counts, None
                header = ps_pb2.ReplicaHeader()
                if wire is not None:
                    header.dynamic_push.CopyFrom(wire)
                else:
                    header.dynamic_push.table, header.dynamic_push.update_id = name, update_id
                    encode_keys(keys, header.dynamic_push.keys)
                    codec.tensor_to_proto(grads, header.dynamic_push.grads)
                    if occurrences is not None:
                        encode_counts(occurrences, header.dynamic_push)
                try:
                    self.forward(header, [])
                except JaxdistError as e:
                    return counts, e
                return counts, None

            result, dup = self.store.apply_once(update_id, dynamic_push_digest(name), change)
        if result is None:
            return None, True
        counts, refused = result
        if refused is not None:
            raise refused
        return counts, False

    def _apply_lock(self, name: str) -> threading.Lock:
        with self._lock:
            return self._apply_locks.setdefault(name, threading.Lock())

    @contextlib.contextmanager
    def frozen(self, payload: list[np.ndarray]) -> Iterator[list[ps_pb2.DynamicInstall]]:
        """Every shard as it is, with no push or create applied until the block ends (a full sync);
        the shards' arrays are appended to ``payload`` (sent after the header: see :func:`install_message`)."""
        with self._lock:
            names = sorted(self._tables)
            with contextlib.ExitStack() as stack:
                for n in names:
                    stack.enter_context(self._apply_locks.setdefault(n, threading.Lock()))
                yield [install_message(self._tables[n], payload) for n in names]

    def forward_installs(self, names: Sequence[str]) -> None:
        """Send the whole shards ``names`` to the backup (after a restore), each under its apply lock:
        no push to it is forwarded between its copy and the backup's install of it."""
        for n in names:
            with self._apply_lock(n):
                if self.forward is not None:
                    header = ps_pb2.ReplicaHeader()
                    payload: list[np.ndarray] = []
                    header.dynamic_installs.append(install_message(self.get(n), payload))
                    self.forward(header, payload)

    def accept_installs(self, installs: Sequence[ps_pb2.DynamicInstall], replace_all: bool,
                        payload: Sequence[np.ndarray] = ()) -> None:
        """Install exact copies of the primary's shards (a backup); ``replace_all``: drop the others.
        ``payload``: the arrays sent out of band (:func:`install_message`), in order; all of them used."""
        shards = []
        rest = iter(payload)
        for m in installs:
            config = config_from_json(m.config_json)
            arrays = {}
            for a in m.arrays:
                if out_of_band(a.tensor) is None:
                    arrays[a.name] = codec.tensor_from_proto(a.tensor)
                else:
                    arr = next(rest, None)
                    if arr is None:
                        raise InvalidRequestError(f"dynamic table install {config.name!r}: its payload is short")
                    arrays[a.name] = arr
            try:
                export = unpack_export(config, arrays.__getitem__)
                shards.append(DynamicTableShard.copy_of(config, export, m.shard, m.num_shards))
            except (KeyError, ValueError, TypeError, IndexError) as e:
                raise InvalidRequestError(f"malformed dynamic table install {config.name!r}: {e}") from e
        if next(rest, None) is not None:
            raise InvalidRequestError("dynamic table installs: more payload arrays than their specs")
        with self._lock:
            if replace_all:
                self._tables, self._participants = {}, {}
            for t in shards:
                self._place(t)

    def save_arrays(self) -> tuple[dict[str, np.ndarray], list[str]]:
        """Every shard's whole state as checkpoint arrays (``dyn/<table>/<field>``), and the table names."""
        with self._lock:
            tables = dict(self._tables)
        out: dict[str, np.ndarray] = {}
        for name, t in sorted(tables.items()):
            out.update(pack_export(name, t.export()))
        return out, sorted(tables)

    def read_restore(self, req: ps_pb2.RestoreRequest) -> list[DynamicTableShard]:
        """The shards ``req.dynamic`` asks for, rebuilt from the saved shards of every file (nothing
        installed: see :meth:`install`).

        Raises:
            InvalidRequestError: a malformed entry or config, a missing, corrupt or mismatched file or array.
        """
        if not req.dynamic:
            return []
        reader = PieceReader(req.directory)
        try:
            built = []
            for e in req.dynamic:
                config = config_from_json(e.config_json)
                if not 0 <= e.shard < e.num_shards:
                    raise InvalidRequestError(f"dynamic table shard {e.shard} out of range for {e.num_shards} shards")
                exports = [unpack_export(config, functools.partial(_read_saved, reader, f.file, f.sha256))
                           for f in e.files]
                try:
                    built.append(DynamicTableShard.restore(config, exports, e.shard, e.num_shards))
                except (ValueError, TypeError, KeyError, IndexError) as err:
                    raise InvalidRequestError(f"dynamic table {config.name!r} in the checkpoint is malformed: {err}") from err
            return built
        finally:
            reader.close()

    def install(self, shards: Sequence[DynamicTableShard]) -> None:
        """Replace (or add) these tables' shards: a restore."""
        with self._lock:
            for t in shards:
                self._place(t)

    def _place(self, shard: DynamicTableShard) -> None:
        """(Under ``_lock``.) Hold ``shard`` as its table's shard; for exports it is wholly new."""
        name = shard.config.name
        self._tables[name] = shard
        lock = self._apply_locks.setdefault(name, threading.Lock())
        self._participants[name] = ShardParticipant(shard, lock, self.store.changes.segment_count())

    def participants(self) -> list[ShardParticipant]:
        """Every shard held here, by table name, as export-cut participants
        (:func:`~jaxdist.ps_server.save_restore.export`)."""
        with self._lock:
            return [self._participants[n] for n in sorted(self._participants)]

    def stats(self) -> dict[str, dict[str, int]]:
        """Each table's :meth:`DynamicTableShard.stats`."""
        with self._lock:
            tables = dict(self._tables)
        return {n: t.stats() for n, t in sorted(tables.items())}

    def status_counters(self) -> dict[str, float]:
        """``dynamic/<table>/<stat>`` counters for ``GetStatus`` (so ``/metrics`` and ``jaxdist status``)."""
        out: dict[str, float] = {}
        for name, st in self.stats().items():
            for k in STAT_NAMES:
                out[f"dynamic/{name}/{k}"] = float(st[k])
        return out


_STRING_FIELDS = ("keys", "pending_keys")


def _read_saved(reader: PieceReader, file: str, sha256: str, key: str) -> np.ndarray:
    return reader.array(file, sha256, key)


def pack_export(table: str, export: dict[str, Any]) -> dict[str, np.ndarray]:
    """A shard's :meth:`~DynamicTableShard.export` as plain numpy arrays ``dyn/<table>/<field>``
    (readable without pickle: string keys become ``<field>.utf8`` bytes and ``<field>.len`` lengths)."""
    out: dict[str, np.ndarray] = {}
    for k, v in export.items():
        key = f"dyn/{table}/{k}"
        arr = np.asarray(v)
        if k in _STRING_FIELDS and arr.dtype == object:
            enc = [s.encode("utf-8") for s in arr.tolist()]
            out[key + ".utf8"] = np.frombuffer(b"".join(enc), dtype=np.uint8).copy()
            out[key + ".len"] = np.asarray([len(b) for b in enc], dtype=np.int64)
        else:
            out[key] = arr
    return out


def unpack_export(config: DynamicTableConfig, read: Callable[[str], np.ndarray]) -> dict[str, Any]:
    """The export :func:`pack_export` wrote for ``config``'s table, read with ``read(key)``."""
    prefix = f"dyn/{config.name}/"
    fields = ["values", "t", "last", "freq", "pending_counts", "step", "counters"]
    fields += ["slot_" + s for s in config.optimizer.slot_names()]
    out: dict[str, Any] = {f: read(prefix + f) for f in fields}
    for f in _STRING_FIELDS:
        if config.key_dtype == "int64":
            out[f] = read(prefix + f)
        else:
            data, lens = read(prefix + f + ".utf8").tobytes(), read(prefix + f + ".len")
            ends = np.cumsum(lens)
            if len(ends) and int(ends[-1]) != len(data):
                raise InvalidRequestError(f"dynamic table {config.name!r}: saved string keys do not match their lengths")
            out[f] = np.asarray([data[int(e - n):int(e)].decode("utf-8") for e, n in zip(ends, lens)], dtype=object)
    return out


def install_message(table: DynamicTableShard, payload: list[np.ndarray] | None = None) -> ps_pb2.DynamicInstall:
    """A whole shard as a replication message (its export, packed as in a checkpoint).

    Without ``payload`` every array is inline (one protobuf message, bounded by gRPC's message
    size). With it, each non-empty array travels *out of band*: its entry carries only its spec
    and the array is appended to ``payload``, sent after the header in frames of
    :data:`~jaxdist.proto.codec.CHUNK_BYTES` like a variable's value (see
    :func:`~jaxdist.proto.ps_wire.out_of_band`), so a shard of any size fits the message limit.
    """
    m = ps_pb2.DynamicInstall(config_json=json.dumps(table.config.to_json()), shard=table.shard,
                              num_shards=table.num_shards)
    for name, arr in pack_export(table.config.name, table.export()).items():
        t = m.arrays.add(name=name).tensor
        if payload is None or arr.nbytes == 0:
            codec.tensor_to_proto(arr, t)
        else:
            arr = codec.as_wire_array(arr)
            codec.spec_to_proto(arr.shape, arr.dtype, t.spec)
            payload.append(arr)
    return m


def config_from_json(text: str) -> DynamicTableConfig:
    """A table config from its JSON (``CreateDynamicTableRequest.config_json``); malformed: INVALID_ARGUMENT."""
    try:
        return DynamicTableConfig.from_json(json.loads(text))
    except ConfigurationError as e:
        raise InvalidRequestError(f"invalid dynamic table config: {e}") from e
    except (ValueError, TypeError, KeyError) as e:
        raise InvalidRequestError(f"malformed dynamic table config: {e}") from e
