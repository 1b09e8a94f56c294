"""The dynamic tables one PS task serves, and their wire form (keys, rows, gradient rows).

A PS task holds at most one shard of each dynamic table
(:class:`~jaxdist.ps_server.dynamic_table.DynamicTableShard`). This module keeps them by name and is
what the servicer's ``CreateDynamicTable``, ``DynamicLookup`` and ``DynamicPush`` RPCs call.

Contract:

- **Create** is idempotent: creating a shard that exists with the same config and placement keeps it
  as it is (a coordinator re-running its setup, or a second worker, never resets a table); another
  config or placement is refused with :class:`VariableExistsError` (``ALREADY_EXISTS``).
- **Lookups** are pure reads (see :mod:`~jaxdist.ps_server.dynamic_table`).
- **Pushes** are applied at most once per update id, through the store's dedupe table
  (:meth:`~jaxdist.ps_server.store.VariableStore.apply_once`): a re-run closure's or a retried push is
  a duplicate, exactly like a variable push (the servicer puts it behind the same run fence).
- **Hostile input** (malformed keys, keys of the wrong type, rows of the wrong shape or dtype, an
  unknown table, a push that would pass the shard's memory bound) raises a typed error (gRPC status
  ``INVALID_ARGUMENT``, ``NOT_FOUND``, ``RESOURCE_EXHAUSTED``) before anything changes; the push's id
  is not recorded, so a corrected retry is applied.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdist.base.errors import (
    ConfigurationError,
    InvalidRequestError,
    VariableExistsError,
    VariableNotFoundError,
)
from jaxdist.proto import codec, ps_pb2
from jaxdist.ps_server.dynamic_table import DynamicTableConfig, DynamicTableShard
from jaxdist.ps_server.store import VariableStore

__all__ = ["STAT_NAMES", "DynamicTables", "config_from_json", "decode_keys", "dynamic_push_digest", "encode_keys"]

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


class DynamicTables:
    """The dynamic table shards of one PS task, by table name. Thread-safe."""

    def __init__(self, store: VariableStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._tables: dict[str, DynamicTableShard] = {}

    def create(self, config: DynamicTableConfig, shard: int, num_shards: int) -> bool:
        """Create this task's shard of a table; False if it existed identically (kept as it is)."""
        with self._lock:
            old = self._tables.get(config.name)
            if old is not None:
                if old.config == config and (old.shard, old.num_shards) == (shard, num_shards):
                    return False
                raise VariableExistsError(
                    f"dynamic table {config.name!r} exists here with another config or placement "
                    f"(shard {old.shard} of {old.num_shards})")
            self._tables[config.name] = DynamicTableShard(config, shard, num_shards)
        logger.info("dynamic table %r: shard %d of %d created", config.name, shard, num_shards)
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

    def push(self, name: str, keys: Any, grads: np.ndarray, update_id: str) -> tuple[dict[str, int] | None, bool]:
        """Apply one push of gradient rows at most once per ``update_id``: ``(counts, duplicate)``."""
        table = self.get(name)
        return self.store.apply_once(update_id, dynamic_push_digest(name), lambda: table.apply(keys, grads))

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


def config_from_json(text: str) -> DynamicTableConfig:
    """A table config from its JSON (``CreateDynamicTableRequest.config_json``); malformed: INVALID_ARGUMENT."""
    try:
        return DynamicTableConfig.from_json(json.loads(text))
    except ConfigurationError as e:
        raise InvalidRequestError(f"invalid dynamic table config: {e}") from e
    except (ValueError, TypeError, KeyError) as e:
        raise InvalidRequestError(f"malformed dynamic table config: {e}") from e
