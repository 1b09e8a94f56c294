"""Dynamic tables in export cuts: one table shard as a
:class:`~jaxdist.ps_server.export_rows.CutParticipant` of its PS's export cuts.

A dynamic shard does not mark its changes push by push: at a cut (under the table's apply lock, the
lock its pushes hold) its :class:`ShardChanges` reads them from the shard itself, through
:meth:`~jaxdist.ps_server.dynamic_table.DynamicTableShard.changes_since` (each row's last push step
and a log of the latest evictions), so the push path pays nothing for exports. Each kept segment of
the store's :class:`~jaxdist.ps_server.export_rows.ChangeTracker` is the shard step it began at; a
shard new relative to a cut (created, restored, installed by a backup's full sync) or whose
eviction log no longer reaches back is changed *as a whole*: the exporter writes a full export.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.ps_server.dynamic_table import DynamicTableShard
from jaxdist.ps_server.export_rows import ALL, KeyDelta

__all__ = ["ShardChanges", "ShardParticipant"]


class ShardChanges:
    """A dynamic shard's change record per export segment (a
    :class:`~jaxdist.ps_server.export_rows.KeySegments`): each kept segment is the shard's
    :attr:`~jaxdist.ps_server.dynamic_table.DynamicTableShard.step` when it began, or
    :data:`~jaxdist.ps_server.export_rows.ALL` (the shard is new relative to that cut). The changes
    are read from the shard when a cut asks (:meth:`union`, through the shard's public
    :meth:`~jaxdist.ps_server.dynamic_table.DynamicTableShard.changes_since`), not marked push by push.

    Called with the table's apply lock held (no push between reading a step and the rows).
    """

    __slots__ = ("rows", "segments", "shard")

    def __init__(self, shard: DynamicTableShard, segments: int) -> None:
        self.shard = shard
        self.segments: list[Any] = [ALL] * segments
        #: The changed keys and their rows the last :meth:`union` read (what the cut gathers next).
        self.rows: tuple[list[Any], np.ndarray] | None = None

    def union(self, start: int) -> Any:
        """The changes since the start of segment ``start``: ALL or a KeyDelta (updated keys, and the
        keys evicted with no row now). ALL too when the shard's eviction log no longer reaches back."""
        self.rows = None
        segs = self.segments[start:]
        if not segs or any(s is ALL for s in segs):
            return ALL
        try:
            changed, values, evicted = self.shard.changes_since(int(segs[0]))
        except ConfigurationError:
            return ALL
        keys = _key_list(changed)
        self.rows = (keys, values)
        return KeyDelta(set(keys), set(_key_list(evicted)))

    def compact(self, start: int | None) -> None:
        head = [] if start is None else [ALL if any(s is ALL for s in self.segments[start:]) else self.segments[start]]
        self.segments = head + [self.shard.step]

    def mark_all(self) -> None:
        self.segments[-1] = ALL


def _key_list(keys: np.ndarray | list[str]) -> list[Any]:
    return keys.tolist() if isinstance(keys, np.ndarray) else list(keys)


class ShardParticipant:
    """One shard of a table as a :class:`~jaxdist.ps_server.export_rows.CutParticipant`: its name,
    its :class:`ShardChanges`, the table's apply lock (what its pushes hold), its rows."""

    def __init__(self, shard: DynamicTableShard, lock: threading.Lock, segments: int) -> None:
        self.name = shard.config.name
        self.shard = shard
        self.lock = lock
        self.changes: ShardChanges = ShardChanges(shard, segments)

    def gather(self, keys: set[Any] | None) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, rows)``, keys ascending (int64, or numpy unicode strings: no pickle to read them):
        every row (None), else the rows of ``keys`` that exist: those the cut's :meth:`ShardChanges.union`
        just read (under the same lock), or, for any other set, the rows of the shard's export."""
        cached = self.changes.rows
        self.changes.rows = None
        if keys is not None and cached is not None and len(cached[0]) == len(keys) and keys.issuperset(cached[0]):
            ks, values = cached[0], np.asarray(cached[1])
        else:
            e = self.shard.export()
            ks, values = _key_list(e["keys"]), e["values"]
            if keys is not None:
                at = [i for i, k in enumerate(ks) if k in keys]
                ks, values = [ks[i] for i in at], values[np.asarray(at, dtype=np.int64)]
        if self.shard.config.key_dtype == "int64":
            karr = np.asarray(ks, dtype=np.int64)
        else:
            karr = np.asarray(ks, dtype=str) if ks else np.zeros(0, dtype="<U1")
        order = np.argsort(karr, kind="stable")
        return karr[order], values[order]
