"""What a PS task counts: calls and bytes served, per variable too (GetStatus, metrics, the final log line)."""

from __future__ import annotations

import threading
from collections.abc import Iterable

__all__ = ["PSCounters"]


class PSCounters:
    """Counters of one PS task. Thread-safe; updated on every pull and push.

    Keys of :meth:`snapshot`: ``bytes_pulled``, ``bytes_pushed``, ``pulls``,
    ``pushes`` (creates included) and ``duplicates`` (pushes whose update id
    was already applied).
    """

    KEYS = ("bytes_pulled", "bytes_pushed", "pulls", "pushes", "duplicates")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._totals = dict.fromkeys(self.KEYS, 0.0)
        self._variable_bytes: dict[tuple[str, str], float] = {}  # ("pulled"|"pushed", variable) -> bytes

    def add(self, **amounts: float) -> None:
        """Add to counters by key (``pulls=1, bytes_pulled=n``)."""
        with self._lock:
            for k, v in amounts.items():
                self._totals[k] += v

    def add_variable_bytes(self, direction: str, sizes: Iterable[tuple[str, int]]) -> None:
        """Add ``(variable, bytes)`` moved in ``direction`` ("pulled" or "pushed")."""
        with self._lock:
            for name, nbytes in sizes:
                key = (direction, name)
                self._variable_bytes[key] = self._variable_bytes.get(key, 0.0) + nbytes

    def snapshot(self) -> dict[str, float]:
        """The totals now, by key."""
        with self._lock:
            return dict(self._totals)

    def variable_bytes(self, direction: str) -> dict[str, float]:
        """Bytes moved in ``direction`` ("pulled" or "pushed"), per variable."""
        with self._lock:
            return {name: n for (d, name), n in self._variable_bytes.items() if d == direction}
