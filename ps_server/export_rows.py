"""What changed on a parameter server since an export, and the PS's part of an export for serving.

An *incremental export* (:mod:`jaxdist.serving_export`) writes, after one full export, only what
changed: per variable the rows changed since the previous export, per keyed (dynamic) table the
keys updated and the keys evicted. This module is the PS side of it, free of gRPC:

**Tracking.** Every variable of a :class:`~jaxdist.ps_server.store.VariableStore` has a
:class:`RowChanges`: per *segment* (the time between two export cuts) a row bitmap (one byte per
row, allocated on the first row-sparse change), or "every row" (a dense update: a gradient applied
by the dense rule, an assign; the exact mode's row pushes, whose dense rule may move any row;
creation, restore), or nothing. The store marks it under the variable's lock, in the same critical
section that applies the push, so an export cut (which holds every variable lock) sees a push
either whole or not at all: no update is missed or counted in two exports. A duplicate push
(dedupe) changes nothing and marks nothing. Keyed tables keep a :class:`KeyChanges` (keys updated,
keys evicted, last event wins) and take part in the cut through :class:`CutParticipant`.

**Cuts.** :class:`ChangeTracker` numbers the cuts of one *generation*, a random id made when the
store starts tracking (a PS process start, a backup's full sync). An export names the cut of the
export it follows (its *base*); the PS answers with the changes since that cut (the union of the
segments from it on) and makes a new cut. It keeps the segments from the base on, merged into one,
plus the new one: so a base may be named again (the export that made the newer cut failed or was
never published: the next delta is again relative to the base, and still complete), and naming a
base tells the PS that the changes before it are no longer needed. A base the PS cannot answer
(another generation: the PS restarted, or a backup took over; a cut it no longer keeps) is
refused (:attr:`CutResult.available` False), never answered with a partial delta: the exporter
then writes a full export.

A delta may hold rows that did not change (a row pushed back to its old value, every row of a
densely updated variable): applying it is still exact. It never lacks a changed row.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

__all__ = [
    "ALL", "ChangeTracker", "CutParticipant", "CutResult", "KeyChanges", "KeyDelta", "KeySegments", "RowChanges",
    "rows_key", "ids_key", "value_key", "keys_key", "evicted_key",
]


class _All:
    """Every row (or key) changed in a segment."""

    def __repr__(self) -> str:
        return "ALL"


#: A segment in which every row changed.
ALL = _All()


def value_key(name: str) -> str:
    """The ``.npz`` key of a variable (shard) written whole."""
    return f"value/{name}"


def ids_key(name: str) -> str:
    """The ``.npz`` key of a variable's changed row ids (int64, global row numbers, ascending)."""
    return f"ids/{name}"


def rows_key(name: str) -> str:
    """The ``.npz`` key of a variable's changed rows (in the order of its ids)."""
    return f"rows/{name}"


def keys_key(name: str) -> str:
    """The ``.npz`` key of a keyed table's updated (or, in a full export, all) keys."""
    return f"keys/{name}"


def evicted_key(name: str) -> str:
    """The ``.npz`` key of a keyed table's keys evicted since the base."""
    return f"evicted/{name}"


class RowChanges:
    """The changed rows of one variable, per segment (aligned with its :class:`ChangeTracker`'s).

    Marked with the variable's lock held; cut with every lock held.
    """

    __slots__ = ("nrows", "segments")

    def __init__(self, nrows: int, segments: int) -> None:
        self.nrows = nrows  # rows (dim 0); 0 for a scalar, whose only change is ALL
        # A variable made inside a segment is wholly new relative to every cut before it.
        self.segments: list[Any] = [ALL] * segments

    def mark_rows(self, idx: np.ndarray) -> None:
        """Rows ``idx`` (local, int64, in range) changed."""
        last = self.segments[-1]
        if last is ALL:
            return
        if last is None:
            last = self.segments[-1] = np.zeros(self.nrows, dtype=bool)
        last[idx] = True

    def mark_all(self) -> None:
        self.segments[-1] = ALL

    def union(self, start: int) -> Any:
        """The rows changed in segments ``start:``: None (none), ALL, or a bool bitmap (a new array)."""
        out: Any = None
        for s in self.segments[start:]:
            if s is ALL:
                return ALL
            if s is not None:
                out = s.copy() if out is None else np.logical_or(out, s, out=out)
        return out

    def compact(self, start: int | None) -> None:
        """Keep the segments from ``start`` on merged into one (None: keep none), and open a new one."""
        self.segments = ([self.union(start)] if start is not None else []) + [None]


@dataclass
class KeyDelta:
    """What a keyed table's changes since a cut amount to: keys to upsert, keys to delete."""

    updated: set[Any]
    evicted: set[Any]


class KeyChanges:
    """The changed keys of one keyed (dynamic) table, per segment: keys updated (inserted or pushed)
    and keys evicted, the last event of a key winning (an evicted key inserted again is updated; an
    updated key evicted is evicted). The table marks it under its own lock.
    """

    __slots__ = ("segments",)

    def __init__(self, segments: int) -> None:
        self.segments: list[Any] = [ALL] * segments

    def _last(self) -> KeyDelta | None:
        last = self.segments[-1]
        if last is ALL:
            return None
        if last is None:
            last = self.segments[-1] = KeyDelta(set(), set())
        return last

    def mark_updated(self, keys: Iterable[Any]) -> None:
        last = self._last()
        if last is not None:
            for k in keys:
                last.updated.add(k)
                last.evicted.discard(k)

    def mark_evicted(self, keys: Iterable[Any]) -> None:
        last = self._last()
        if last is not None:
            for k in keys:
                last.evicted.add(k)
                last.updated.discard(k)

    def mark_all(self) -> None:
        self.segments[-1] = ALL

    def union(self, start: int) -> Any:
        """The changes of segments ``start:`` (later events win): None, ALL, or a new :class:`KeyDelta`."""
        out: KeyDelta | None = None
        for s in self.segments[start:]:
            if s is ALL:
                return ALL
            if s is None:
                continue
            if out is None:
                out = KeyDelta(set(), set())
            out.updated -= s.evicted
            out.evicted -= s.updated
            out.updated |= s.updated
            out.evicted |= s.evicted
        return out

    def compact(self, start: int | None) -> None:
        self.segments = ([self.union(start)] if start is not None else []) + [None]


class KeySegments(Protocol):
    """What a cut needs of a keyed table's change record: :class:`KeyChanges` (marked as the table
    changes), or a record that reads the changes from the table at the cut (a dynamic table's shard
    logs its own: :class:`~jaxdist.ps_server.dynamic_export.ShardChanges`). ``union`` gives None,
    :data:`ALL` or a :class:`KeyDelta`, like :meth:`KeyChanges.union`."""

    segments: list[Any]

    def union(self, start: int) -> Any: ...

    def compact(self, start: int | None) -> None: ...

    def mark_all(self) -> None: ...


class CutParticipant(Protocol):
    """A keyed table taking part in an export cut (the plug-in point of dynamic tables).

    The table marks :attr:`changes` (made by :meth:`ChangeTracker.new_keys`) under :attr:`lock`
    whenever it inserts, updates or evicts a key, in the critical section that changes the rows
    (a restore or full sync that replaces the table calls :meth:`KeyChanges.mark_all`), or its
    :attr:`changes` reads them from the table when cut (:class:`KeySegments`). During a cut
    the store takes every variable lock, then :attr:`lock` of each participant (in the order given),
    and calls :meth:`gather`: a table never takes a variable lock while it holds its own. A table
    that is replaced whole in a delta makes the exporter write a full export (a delta cannot say
    which keys it lost).
    """

    name: str
    lock: Any  # a context manager: the lock the table's pushes hold

    @property
    def changes(self) -> KeySegments:
        """The table's change record (read by the cut; an attribute in an implementation)."""
        ...

    def gather(self, keys: set[Any] | None) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, values)`` of the rows present among ``keys`` (None: every row), copies; called
        with :attr:`lock` held. Keys as int64 or a numpy string array; values ``[n, *row_shape]``."""
        ...


@dataclass
class CutResult:
    """What a cut answered: the new cut (the next export's base), and whether the asked delta exists."""

    generation: str
    cut: int
    available: bool = True


class ChangeTracker:
    """Numbers export cuts and keeps the segments between them (see the module docstring).

    ``cut`` is called with every participant's lock held (the store's :meth:`export_cut`);
    :meth:`new_rows` / :meth:`new_keys` under the lock that guards the set of participants.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.generation = uuid.uuid4().hex
        self.cut_number = 0
        self.starts: list[int] = [0]  # the cut each kept segment starts at

    def restart(self) -> None:
        """A new generation (the state was replaced wholesale: a backup's full sync): no delta can
        be answered relative to an earlier cut."""
        with self._lock:
            self.generation = uuid.uuid4().hex
            self.starts = [self.cut_number]

    def new_rows(self, nrows: int) -> RowChanges:
        with self._lock:
            return RowChanges(nrows, len(self.starts))

    def new_keys(self) -> KeyChanges:
        with self._lock:
            return KeyChanges(len(self.starts))

    def segment_count(self) -> int:
        """Segments kept now: the length of a new participant's ``segments`` (each ALL, wholly new)."""
        with self._lock:
            return len(self.starts)

    def cut(self, base_generation: str, base_cut: int, delta: bool,
            changes: Sequence[RowChanges | KeySegments]) -> tuple[CutResult, list[Any] | None]:
        """Make a new cut; for ``delta``, the changes of every entry of ``changes`` since the base.

        Returns ``(result, unions)``: ``unions`` (None unless ``delta``) holds, per entry, None,
        :data:`ALL`, a row bitmap or a :class:`KeyDelta`. When the base cannot be answered and
        ``delta`` is set, nothing changes and ``result.available`` is False.
        """
        with self._lock:
            start: int | None = None
            if base_generation == self.generation and base_cut in self.starts:
                start = self.starts.index(base_cut)
            if delta and start is None:
                return CutResult(self.generation, self.cut_number, available=False), None
            for c in changes:
                if len(c.segments) != len(self.starts):  # made under another generation: wholly changed
                    c.segments = [ALL] * len(self.starts)
            unions = [c.union(start) for c in changes] if delta and start is not None else None
            self.cut_number += 1
            for c in changes:
                c.compact(start)
            self.starts = ([base_cut] if start is not None else []) + [self.cut_number]
            return CutResult(self.generation, self.cut_number), unions


def bitmap_ids(bitmap: Any, nrows: int) -> np.ndarray | None:
    """Local row ids of a union: None for ALL (the whole variable), else int64 ascending."""
    if bitmap is ALL:
        return None
    if bitmap is None:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(bitmap).astype(np.int64)

