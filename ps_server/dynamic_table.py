"""Dynamic (hash-keyed) embedding tables: one shard of one table, as a parameter server holds it.

A dynamic table has no vocabulary fixed in advance: its keys are int64 ids or strings, and it
grows as training pushes gradients for new keys, bounded by admission and eviction. This module is
the state of one (table, shard) pair, free of gRPC (like :class:`~jaxdist.ps_server.store.VariableStore`),
so its rules are tested without sockets.

Contract (what a caller may rely on):

- **Lookups are pure reads.** :meth:`DynamicTableShard.lookup` never changes the shard: a key that
  has a row reads it; an admitted key without a row yet reads its *initializer row*, a function of
  ``(table seed, key)`` alone (:func:`initial_rows`); a key not (yet) admitted reads the table's
  default vector. So a re-run closure, a second worker and a backup read identical values, and a
  lookup needs no replication.
- **Every change is a push.** :meth:`DynamicTableShard.apply` takes ``(keys, gradient rows)``:
  duplicate keys in one push are summed first (or a client sends the push *counted*: each distinct
  key once with its summed rows and its occurrence count, :func:`reduce_push`; the same effect, bit
  for bit, with less to send, hash and sort); a key's row is inserted (from its initializer row)
  at its first applied push after admission; the optimizer rule is applied to the pushed rows only
  (per-row state: SGD, Adagrad, lazy Adam); admission counters, recency and frequency, the table's
  step and eviction all advance here. Pushes are applied at most once by the caller's push identity
  (the store's dedupe), so every counter is exact under re-runs and the same sequence of pushes
  gives a bit-identical shard (:meth:`DynamicTableShard.digest`) on a primary and its backup.
- **A step is one applied push to the shard.** Time-to-live counts these steps: a row not pushed for
  more than ``ttl_steps`` steps is evicted at the next push (oldest first, O(evicted)).
- **Admission.** ``min_count=n``: a key gets a row once it has been pushed ``n`` times (occurrences
  counted, duplicates within a push included); the push that reaches ``n`` inserts the row from its
  initializer and its gradient, computed against the default vector, is dropped. ``probability=p``:
  a key is admitted iff a uniform number derived from its hash is below ``p`` (decided by the key,
  identical everywhere and forever). Dropped gradient rows are counted (``admissions_refused``).
  Keys still waiting are held in a bounded FIFO (``max_pending``); the oldest are forgotten first.
- **Eviction.** With ``capacity``, after each push the shard keeps at most ``capacity`` rows,
  removing the least recently pushed (``"lru"``) or least often pushed (``"lfu"``; ties: least
  recent, then smaller key hash) rows. An evicted key starts again from admission.
- **Memory bound.** ``max_bytes`` bounds the bytes of rows + optimizer state; a push whose inserts
  would pass it (after capacity eviction) raises :class:`PayloadTooLargeError` and changes nothing.
  Malformed input (wrong key type, wrong row shape or dtype, key/row count mismatch, non-1-D keys)
  raises a typed error (INVALID_ARGUMENT) and changes nothing.
- **Sharding.** :func:`shard_of` spreads keys over ``num_shards`` by a stable hash independent of the
  table seed; rows never depend on the shard count, so :meth:`DynamicTableShard.restore` can load the
  exports of N shards into M shards (keys routed again by :func:`shard_of`).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from jaxdist.base.errors import (
    ConfigurationError,
    DTypeMismatchError,
    InvalidRequestError,
    PayloadTooLargeError,
    ShapeMismatchError,
)

__all__ = [
    "MAX_PUSH_OCCURRENCES", "AdmissionConfig", "DynamicTableConfig", "DynamicTableShard", "EvictionConfig",
    "ReducedPush", "RowOptimizer", "first_occurrences", "hash_keys", "initial_rows", "reduce_push", "shard_of",
    "sum_rows", "validate_counts",
]

logger = logging.getLogger(__name__)

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
#: Salt of the routing hash: routing never depends on a table's seed.
_ROUTE_SALT = np.uint64(0xD1B54A32D192ED03)
_ADMIT_SALT = np.uint64(0x8CB92BA72F3D8DD7)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic): a stable, well-mixed hash.

    Computed in place on one copy (uint64 arithmetic wraps modulo 2**64 in numpy)."""
    with np.errstate(over="ignore"):
        z = np.add(x, _GOLDEN, dtype=np.uint64)
        t = np.right_shift(z, np.uint64(30))
        z ^= t
        z *= np.uint64(0xBF58476D1CE4E5B9)
        np.right_shift(z, np.uint64(27), out=t)
        z ^= t
        z *= np.uint64(0x94D049BB133111EB)
        np.right_shift(z, np.uint64(31), out=t)
        z ^= t
        return z


def validate_keys(keys: Any, key_dtype: str) -> np.ndarray | list[str]:
    """Checks a batch of keys against the table's key type: an int64 1-D array, or a list of str.

    Raises :class:`DTypeMismatchError` for a key of the wrong type and :class:`ShapeMismatchError`
    for a batch that is not one-dimensional.
    """
    if key_dtype == "int64":
        if isinstance(keys, (list, tuple)) and any(isinstance(k, (str, bytes, float)) for k in keys):
            raise DTypeMismatchError("dynamic table with int64 keys got a non-integer key")
        arr = np.asarray(keys)
        if arr.dtype.kind not in "iu":
            raise DTypeMismatchError(f"dynamic table with int64 keys got keys of dtype {arr.dtype}")
        if arr.ndim != 1:
            raise ShapeMismatchError(f"keys must be one-dimensional, got shape {arr.shape}")
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            raise InvalidRequestError("an unsigned key does not fit in int64")
        return arr.astype(np.int64, copy=False)
    if isinstance(keys, np.ndarray):
        if keys.ndim != 1:
            raise ShapeMismatchError(f"keys must be one-dimensional, got shape {keys.shape}")
        keys = keys.tolist()
    if not isinstance(keys, (list, tuple)):
        raise DTypeMismatchError(f"dynamic table with string keys got {type(keys).__name__}")
    for k in keys:
        if not isinstance(k, str):
            raise DTypeMismatchError(f"dynamic table with string keys got a key of type {type(k).__name__}")
    return list(keys)


def hash_keys(keys: np.ndarray | Sequence[str]) -> np.ndarray:
    """A stable 64-bit hash of each key (uint64), the same in every process, platform and run.

    int64 keys are mixed with SplitMix64; strings are hashed with BLAKE2b of their UTF-8 bytes
    (Python's ``hash`` is salted per process, so never used).
    """
    if isinstance(keys, np.ndarray):
        return _splitmix64(keys.astype(np.int64).view(np.uint64))
    out = np.empty(len(keys), dtype=np.uint64)
    for i, k in enumerate(keys):
        out[i] = int.from_bytes(hashlib.blake2b(k.encode("utf-8"), digest_size=8).digest(), "little")
    return out


def shard_of(hashes: np.ndarray, num_shards: int) -> np.ndarray:
    """Which of ``num_shards`` PS shards holds each key (by its :func:`hash_keys` hash)."""
    return (_splitmix64(hashes ^ _ROUTE_SALT) % np.uint64(num_shards)).astype(np.int64)


#: The most occurrences one counted push may stand for (the sum of its counts): an uncounted push of
#: that many occurrences would carry at least 2^32 keys and gradient rows (tens of GB). Bounds what a
#: hostile count can add to a row's frequency or a pending key's count (int64) per push.
MAX_PUSH_OCCURRENCES = 1 << 32


def first_occurrences(ident: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(distinct values in first-occurrence order, where each first occurs, the distinct index of
    each element)`` of a 1-D array: how a push's keys are deduplicated (by their identity)."""
    uniq, first, inverse = np.unique(ident, return_index=True, return_inverse=True)
    by_first = np.argsort(first, kind="stable")
    rank = np.empty_like(by_first)
    rank[by_first] = np.arange(by_first.shape[0])
    return uniq[by_first], first[by_first], rank[inverse.reshape(-1)]


def sum_rows(grads: np.ndarray, inv: np.ndarray, m: int) -> np.ndarray:
    """The float32 sum of the rows of ``grads`` per distinct key (``inv``: each row's distinct index,
    ``m`` distinct keys), each sum taken in row order starting from +0.0: the one summation of a
    push's duplicate keys, so a shard summing an uncounted push and a client reducing a push before
    sending it (:func:`reduce_push`) give bit-identical rows."""
    # A sum past float32's range is infinite, not an error here: callers check what they send or apply.
    with np.errstate(over="ignore", invalid="ignore"):
        g32 = grads.astype(np.float32, copy=False)
        if m == int(g32.shape[0]):  # no duplicates: a permutation, as the sum below would give it
            gsum = np.empty(g32.shape, dtype=np.float32)
            gsum[inv] = g32
            gsum += np.float32(0.0)  # a sum started from +0.0: -0.0 becomes +0.0
        else:  # in push order, from +0.0 (so bit-identical everywhere)
            gsum = np.zeros((m, *g32.shape[1:]), dtype=np.float32)
            np.add.at(gsum, inv, g32)
    return gsum


def validate_counts(counts: Any, n: int) -> np.ndarray:
    """Checks a counted push's occurrence counts (one per key, each >= 1, summing to at most
    :data:`MAX_PUSH_OCCURRENCES`); returns them as int64.

    Raises:
        InvalidRequestError: counts not integers, not one per key, a count below 1, or too many in all.
    """
    c = np.asarray(counts)
    if c.dtype.kind not in "iu":
        raise InvalidRequestError(f"push counts must be integers, got dtype {c.dtype}")
    if c.shape != (n,):
        raise InvalidRequestError(f"{c.size} push counts for {n} keys: one count per key")
    if n and int(c.min()) < 1:
        raise InvalidRequestError("a push count is below 1 (each key of a counted push occurred at least once)")
    # In float64: exact for every total up to 2^53, and never wrapping (an int64 sum would).
    if n and float(c.sum(dtype=np.float64)) > MAX_PUSH_OCCURRENCES:
        raise InvalidRequestError(f"push counts sum to more than {MAX_PUSH_OCCURRENCES} occurrences")
    return c.astype(np.int64, copy=False)


@dataclass(frozen=True)
class ReducedPush:
    """A push with each distinct key once (:func:`reduce_push`)."""

    #: The distinct keys in first-occurrence order (int64 array, or list of str).
    keys: np.ndarray | list[str]
    #: ``[m, *row_shape]`` float32: each key's gradient rows summed (:func:`sum_rows`).
    grads: np.ndarray
    #: ``[m]`` int64: each key's occurrences.
    counts: np.ndarray
    #: ``[m]`` uint64: :func:`hash_keys` of :attr:`keys` (routing).
    hashes: np.ndarray


def reduce_push(keys: np.ndarray | list[str], grads: np.ndarray) -> ReducedPush:
    """The counted form of a push of one gradient row per key occurrence: each distinct key once,
    with its rows summed and its occurrences counted, exactly as a shard reduces an uncounted push.

    ``keys``: validated flat keys (:func:`validate_keys`); ``grads``: ``[n, *row_shape]``, floating
    point. Keys are distinct by a shard's identity: the int64 key, or a string's 64-bit hash (two
    strings of one hash, which a shard keeps as one row, are merged, the first one's string kept).

    Raises:
        DTypeMismatchError: gradient rows not floating point.
        ShapeMismatchError: not one gradient row per key.
    """
    g = np.asarray(grads)
    if g.dtype.kind != "f":
        raise DTypeMismatchError(f"gradient rows must be floating point, got {g.dtype}")
    if g.ndim < 1 or g.shape[0] != len(keys):
        raise ShapeMismatchError(f"gradient rows of shape {g.shape} for {len(keys)} keys")
    distinct: np.ndarray | list[str]
    if isinstance(keys, np.ndarray):
        distinct, _, inv = first_occurrences(keys)
        hashes = hash_keys(distinct)
    else:
        at: dict[str, int] = {}
        inv = np.fromiter((at.setdefault(k, len(at)) for k in keys), dtype=np.int64, count=len(keys))
        distinct = list(at)
        hashes = hash_keys(distinct)
        ident = hashes.view(np.int64)
        if np.unique(ident).shape[0] != ident.shape[0]:  # two strings of one hash: one key to a shard
            _, first, merged = first_occurrences(ident)
            distinct, hashes, inv = [distinct[int(j)] for j in first], hashes[first], merged[inv]
    m = len(distinct)
    return ReducedPush(distinct, sum_rows(g, inv, m), np.bincount(inv, minlength=m).astype(np.int64), hashes)


def _uniform(bits: np.ndarray) -> np.ndarray:
    """uint64 -> float64 in [0, 1) from the top 53 bits."""
    out = (bits >> np.uint64(11)).astype(np.float64)
    out *= 1.0 / (1 << 53)
    return out


def initial_rows(config: DynamicTableConfig, hashes: np.ndarray) -> np.ndarray:
    """The initializer rows of keys (by hash): a pure function of ``(config.seed, key)``.

    Counter-based: element ``j`` of a key's row draws from ``splitmix64(mix(seed, key) + j)``, so
    the row is the same whichever process, shard or order computes it.
    """
    n = int(hashes.shape[0])
    size = int(np.prod(config.row_shape, dtype=np.int64))
    kind = config.initializer
    if kind == "zeros":
        return np.zeros((n, *config.row_shape), dtype=config.dtype)
    # Normal draws use 2 numbers per element (Box-Muller), uniform the first of them only.
    width = 2 * size if kind == "normal" else size
    base = _splitmix64(hashes ^ _splitmix64(np.asarray([config.seed], dtype=np.uint64)))
    with np.errstate(over="ignore"):
        counters = base[:, None] + np.arange(1, width + 1, dtype=np.uint64)[None, :] * _GOLDEN
    u = _uniform(_splitmix64(counters))
    if kind == "uniform":
        vals = (u * 2.0 - 1.0) * config.init_scale
    elif kind == "normal":
        # sqrt(-2 log(1 - u1)) * cos(2 pi u2) * scale, evaluated in place in that order.
        vals = np.subtract(1.0, u[:, :size])  # (0, 1]: log is finite
        np.log(vals, out=vals)
        vals *= -2.0
        np.sqrt(vals, out=vals)
        angle = u[:, size:]
        angle *= 2.0 * np.pi
        np.cos(angle, out=angle)
        vals *= angle
        vals *= config.init_scale
    else:  # pragma: no cover - DynamicTableConfig.__post_init__ refuses it
        raise ConfigurationError(f"unknown initializer {kind!r}")
    return vals.reshape((n, *config.row_shape)).astype(config.dtype)


@dataclass(frozen=True)
class RowOptimizer:
    """The per-row rule applied to pushed rows only (optax-like parameters).

    - ``"sgd"``: ``row -= lr * g``.
    - ``"adagrad"``: ``acc += g**2; row -= lr * g / sqrt(acc + eps)`` (``acc`` starts at
      ``initial_accumulator``).
    - ``"lazy_adam"``: per-row ``m, v`` and a per-row count ``t`` (pushes the row received):
      ``m = b1*m + (1-b1)*g; v = b2*v + (1-b2)*g**2;
      row -= lr * (m / (1-b1**t)) / (sqrt(v / (1-b2**t)) + eps)``.

    State is float32 whatever the row dtype (like the arithmetic: done in float32, rows stored in
    the table's dtype).
    """

    name: str = "sgd"
    learning_rate: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-7
    initial_accumulator: float = 0.1

    def __post_init__(self) -> None:
        if self.name not in ("sgd", "adagrad", "lazy_adam"):
            raise ConfigurationError(f"dynamic tables support sgd, adagrad and lazy_adam, not {self.name!r}")

    def slot_names(self) -> tuple[str, ...]:
        """Names of the per-row state arrays (each shaped like the rows, float32), plus ``t`` for Adam."""
        return {"sgd": (), "adagrad": ("acc",), "lazy_adam": ("m", "v")}[self.name]


@dataclass(frozen=True)
class AdmissionConfig:
    """When a key gets a row: after ``min_count`` pushes, and/or with ``probability`` (by key hash)."""

    min_count: int = 1
    probability: float = 1.0
    #: Keys waiting for admission held at most (FIFO; the oldest are forgotten).
    max_pending: int = 1 << 20

    def __post_init__(self) -> None:
        if self.min_count < 1 or not 0.0 <= self.probability <= 1.0 or self.max_pending < 1:
            raise ConfigurationError(f"invalid admission {self}")


@dataclass(frozen=True)
class EvictionConfig:
    """Rows kept per shard (``capacity``, by ``policy`` ``"lru"``/``"lfu"``) and a time-to-live in steps."""

    capacity: int | None = None
    policy: str = "lru"
    ttl_steps: int | None = None

    def __post_init__(self) -> None:
        if self.policy not in ("lru", "lfu"):
            raise ConfigurationError(f"eviction policy must be 'lru' or 'lfu', not {self.policy!r}")
        if (self.capacity is not None and self.capacity < 1) or (self.ttl_steps is not None and self.ttl_steps < 1):
            raise ConfigurationError(f"invalid eviction {self}")


@dataclass(frozen=True)
class DynamicTableConfig:
    """A dynamic table's definition (the same on every shard)."""

    name: str
    row_shape: tuple[int, ...]
    dtype: str = "float32"
    key_dtype: str = "int64"
    seed: int = 0
    initializer: str = "normal"
    init_scale: float = 0.05
    default_value: float = 0.0
    optimizer: RowOptimizer = field(default_factory=RowOptimizer)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    eviction: EvictionConfig = field(default_factory=EvictionConfig)
    #: Bound on rows + optimizer state of one shard.
    max_bytes: int = 8 << 30

    def __post_init__(self) -> None:
        object.__setattr__(self, "row_shape", tuple(int(d) for d in self.row_shape))
        if any(d < 1 for d in self.row_shape):
            raise ConfigurationError(f"row_shape must be positive, got {self.row_shape}")
        if np.dtype(self.dtype).kind != "f":
            raise ConfigurationError(f"dynamic table values must be a float dtype, not {self.dtype}")
        if self.key_dtype not in ("int64", "string"):
            raise ConfigurationError(f"key_dtype must be 'int64' or 'string', not {self.key_dtype!r}")
        if self.initializer not in ("normal", "uniform", "zeros"):
            raise ConfigurationError(f"initializer must be normal, uniform or zeros, not {self.initializer!r}")
        if not 0 <= self.seed < (1 << 63):
            raise ConfigurationError("seed must be in [0, 2**63)")

    def row_bytes(self) -> int:
        """Bytes one row costs: its values plus its optimizer state (float32 slots, Adam's count)."""
        size = int(np.prod(self.row_shape, dtype=np.int64))
        extra = 8 if self.optimizer.name == "lazy_adam" else 0
        return size * np.dtype(self.dtype).itemsize + len(self.optimizer.slot_names()) * size * 4 + extra

    def to_json(self) -> dict[str, Any]:
        """A JSON-able form (checkpoint metadata)."""
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> DynamicTableConfig:
        d = dict(d)
        d["row_shape"] = tuple(d["row_shape"])
        d["optimizer"] = RowOptimizer(**d["optimizer"])
        d["admission"] = AdmissionConfig(**d["admission"])
        d["eviction"] = EvictionConfig(**d["eviction"])
        return cls(**d)


@dataclass
class _Counters:
    inserts: int = 0
    admissions_refused: int = 0
    evictions_ttl: int = 0
    evictions_capacity: int = 0
    pending_forgotten: int = 0
    pushes: int = 0


# --------------------------------------------------------------------------- storage
_EMPTY = -1  # an index position never used
_TOMB = -2  # an index position whose entry was removed (probes go on past it)
_FREE = -1  # tick of a free slot
_UNORDERED = -2  # tick of a slot allocated but not yet in the recency order
_INT32_SLOTS = (1 << 31) - 1


def _int_ident_hashes(idents: np.ndarray) -> np.ndarray:
    """The :func:`hash_keys` hash of int64 keys (their identity is the key)."""
    return _splitmix64(idents.view(np.uint64))


def _string_ident_hashes(idents: np.ndarray) -> np.ndarray:
    """String keys are identified by their 64-bit BLAKE2b hash: the identity *is* the hash."""
    return idents.view(np.uint64)


class _HashIndex:
    """A vectorised open-addressing hash index (linear probing): int64 identity -> slot number.

    Each position holds a slot number (int32 while every slot number fits, else int64), ``-1``
    (empty) or ``-2`` (a tombstone: an entry removed; probes go on past it and inserts reuse it). A
    slot's identity is read from the owner's ``ident`` array, so an entry costs 4 bytes. The table is
    kept at most :attr:`MAX_LOAD` full (entries and tombstones); a rebuild sizes it to at most half
    full. Every operation is a handful of numpy passes per probe round, never a loop over keys.
    """

    MAX_LOAD = 0.7
    MIN_SIZE = 1024
    #: Keys re-inserted per pass of a rebuild (bounds its temporary arrays).
    REBUILD_CHUNK = 1 << 22

    def __init__(self, hash_of: Any) -> None:
        self._hash_of = hash_of
        self._table = np.full(self.MIN_SIZE, _EMPTY, dtype=np.int32)
        self.live = 0
        self.tombs = 0

    @property
    def size(self) -> int:
        return int(self._table.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self._table.nbytes)

    def _start(self, idents: np.ndarray) -> np.ndarray:
        return (self._hash_of(idents) & np.uint64(self.size - 1)).astype(np.int64)

    def find(self, idents: np.ndarray, ident_of_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(slot, position)`` of each identity, ``-1`` for both where absent."""
        n = int(idents.shape[0])
        slots = np.full(n, -1, dtype=np.int64)
        where = np.full(n, -1, dtype=np.int64)
        if n == 0 or self.live == 0:
            return slots, where
        mask = self.size - 1
        tab = self._table
        pos = self._start(idents)
        act = np.arange(n)
        want = idents
        while act.size:
            v = tab[pos].astype(np.int64)
            hit = v >= 0
            if hit.any():
                hit[hit] = ident_of_slot[v[hit]] == want[hit]
                slots[act[hit]] = v[hit]
                where[act[hit]] = pos[hit]
            go = ~hit & (v != _EMPTY)
            act, pos, want = act[go], (pos[go] + 1) & mask, want[go]
        return slots, where

    def insert(self, idents: np.ndarray, slots: np.ndarray) -> None:
        """Adds identities known to be absent and distinct (the caller checked), after :meth:`reserve`."""
        n = int(idents.shape[0])
        if n == 0:
            return
        mask = self.size - 1
        tab = self._table
        pos = self._start(idents)
        act = np.arange(n)
        while act.size:
            v = tab[pos]
            free = np.flatnonzero(v < 0)
            placed = np.zeros(act.size, dtype=bool)
            if free.size:
                fp, fs = pos[free], slots[act[free]]
                tab[fp] = fs  # several keys probing one free position: the last write wins it
                won = tab[fp] == fs
                self.tombs -= int(np.count_nonzero(v[free][won] == _TOMB))
                placed[free[won]] = True
            keep = ~placed  # the others probe on (a lost position is occupied now)
            act, pos = act[keep], (pos[keep] + 1) & mask
        self.live += n

    def remove(self, where: np.ndarray) -> None:
        """Removes the entries at these (distinct, occupied) positions."""
        self._table[where] = _TOMB
        self.live -= int(where.shape[0])
        self.tombs += int(where.shape[0])

    def reserve(self, extra: int, live_slots: Any, ident_of_slot: np.ndarray, slot_capacity: int) -> None:
        """Makes room for ``extra`` inserts: rebuilds (and resizes) the table when entries plus
        tombstones would pass :attr:`MAX_LOAD`, or when slot numbers no longer fit int32."""
        wide = slot_capacity > _INT32_SLOTS
        if (self.live + self.tombs + extra <= self.MAX_LOAD * self.size
                and (not wide or self._table.dtype == np.int64)):
            return
        size = self.MIN_SIZE
        while self.live + extra > size // 2:
            size *= 2
        slots = live_slots()
        self._table = np.full(size, _EMPTY, dtype=np.int64 if wide else np.int32)
        self.live = self.tombs = 0
        for i in range(0, int(slots.shape[0]), self.REBUILD_CHUNK):
            chunk = slots[i:i + self.REBUILD_CHUNK]
            self.insert(ident_of_slot[chunk], chunk)


class _KeyedSlots:
    """Keyed entries (a shard's rows, or its keys pending admission) in slots, with a recency order.

    - Per-slot columns (``ident``, ``tick``, the owner's columns, ``str`` for string keys) are numpy
      arrays that grow by doubling (new pages are untouched zeros: they cost memory once used);
      freed slots are reused first.
    - :class:`_HashIndex` maps identities to slots.
    - The recency order is a log of slot numbers, least recent first: touching a slot appends it and
      sets its ``tick`` to the entry's position, so an entry is current iff ``tick[slot]`` equals its
      position (older entries of a re-touched or freed slot are skipped, and dropped by compaction
      when the log fills). Taking the least recent ``k`` entries costs O(k + skipped entries).
    """

    def __init__(self, hash_of: Any, columns: dict[str, tuple[tuple[int, ...], Any]], strings: bool,
                 reserve: int | None = None) -> None:
        #: Slots the columns get at their first growth when the count is bounded (a capacity): their
        #: pages cost memory only once used, and the table never copies its columns below it.
        self.reserve = reserve
        self.index = _HashIndex(hash_of)
        self.hash_of = hash_of
        self._specs: dict[str, tuple[tuple[int, ...], Any]] = {
            "ident": ((), np.int64), "tick": ((), np.int32), **columns}
        if strings:
            self._specs["str"] = ((), object)
        self.cols: dict[str, np.ndarray] = {name: self._column(name, 16) for name in self._specs}
        self.hi = 0  # slots ever used: [0, hi) are allocated or free
        self._free = np.empty(0, dtype=np.int64)
        self._nfree = 0
        # Ticks and the log are int32 (4 bytes per row each) until a slot number or a log position
        # no longer fits; then both are widened to int64.
        self._log = np.empty(1024, dtype=np.int32)
        self._lo = 0
        self._end = 0

    def _column(self, name: str, cap: int) -> np.ndarray:
        shape, dtype = self._specs[name]
        if dtype is object:
            return np.empty((cap, *shape), dtype=object)
        return np.zeros((cap, *shape), dtype=dtype)

    @property
    def live(self) -> int:
        return self.index.live

    @property
    def capacity(self) -> int:
        return int(self.cols["ident"].shape[0])

    def nbytes(self) -> int:
        """Bytes of the slots in use (columns up to the high-water mark), the index and the log."""
        per_slot = sum(a.itemsize * int(np.prod(a.shape[1:], dtype=np.int64)) for a in self.cols.values())
        return self.hi * per_slot + self.index.nbytes + self._log.nbytes + self._free.nbytes

    def find(self, idents: np.ndarray) -> np.ndarray:
        """Slot of each identity, ``-1`` where absent."""
        return self.index.find(idents, self.cols["ident"])[0]

    def alive(self) -> np.ndarray:
        """Slots in use, ascending."""
        return np.flatnonzero(self.cols["tick"][: self.hi] != _FREE)

    def _grow(self, need: int) -> None:
        cap = self.capacity
        if need <= cap:
            return
        new = max(need, 2 * cap)
        if self.reserve is not None and cap < self.reserve and need <= self.reserve:
            new = self.reserve
        if new > _INT32_SLOTS:
            self._widen()
        for name, a in self.cols.items():
            b = self._column(name, new)
            b[: self.hi] = a[: self.hi]
            self.cols[name] = b

    def alloc(self, idents: np.ndarray, strs: np.ndarray | None = None) -> np.ndarray:
        """Slots for identities known to be absent and distinct (freed slots first), indexed; their
        columns other than ``ident``/``str`` hold stale values the caller overwrites."""
        n = int(idents.shape[0])
        reuse = min(n, self._nfree)
        fresh = n - reuse
        self._grow(self.hi + fresh)
        # Before the new slots count as alive: a rebuild re-inserts only the slots in use.
        self.index.reserve(n, self.alive, self.cols["ident"], self.capacity)
        slots = np.concatenate([self._free[self._nfree - reuse: self._nfree][::-1],
                                np.arange(self.hi, self.hi + fresh, dtype=np.int64)])
        self._nfree -= reuse
        self.hi += fresh
        self.cols["ident"][slots] = idents
        self.cols["tick"][slots] = _UNORDERED
        if strs is not None:
            self.cols["str"][slots] = strs
        self.index.insert(idents, slots)
        return slots

    def release(self, slots: np.ndarray) -> None:
        """Frees slots in use (distinct): out of the index and the order, reusable."""
        if slots.size == 0:
            return
        _, where = self.index.find(self.cols["ident"][slots], self.cols["ident"])
        self.index.remove(where)
        self.cols["tick"][slots] = _FREE
        if "str" in self.cols:
            self.cols["str"][slots] = None
        need = self._nfree + int(slots.shape[0])
        if need > self._free.shape[0]:
            grown = np.empty(max(need, 2 * self._free.shape[0], 1024), dtype=np.int64)
            grown[: self._nfree] = self._free[: self._nfree]
            self._free = grown
        self._free[self._nfree: need] = slots
        self._nfree = need

    def touch(self, slots: np.ndarray) -> None:
        """Makes these slots (distinct) the most recent, in the order given."""
        m = int(slots.shape[0])
        if m == 0:
            return
        if self._end + m > self._log.shape[0]:
            self._compact(m)
        self._log[self._end: self._end + m] = slots
        self.cols["tick"][slots] = np.arange(self._end, self._end + m)
        self._end += m

    @property
    def head(self) -> int:
        """Where :meth:`oldest` starts reading the log (restore it to undo an :meth:`oldest`)."""
        return self._lo

    @head.setter
    def head(self, at: int) -> None:
        self._lo = at

    def _current(self, lo: int, hi: int) -> np.ndarray:
        seg = self._log[lo:hi]
        return self.cols["tick"][seg] == np.arange(lo, hi)

    def _widen(self) -> None:
        if self._log.dtype != np.int64:
            self._specs["tick"] = ((), np.int64)
            self.cols["tick"] = self.cols["tick"].astype(np.int64)
            self._log = self._log.astype(np.int64)

    def _compact(self, extra: int) -> None:
        seg = self._log[self._lo: self._end]
        kept = seg[self._current(self._lo, self._end)]
        k = int(kept.shape[0])
        want = max(1024, (3 * (k + extra)) // 2)
        if want > _INT32_SLOTS:
            self._widen()
        if self._log.shape[0] < k + extra or self._log.shape[0] > 3 * want:
            self._log = np.empty(want, dtype=self._log.dtype)
        self._log[:k] = kept
        self.cols["tick"][kept] = np.arange(k)
        self._lo, self._end = 0, k

    def order(self) -> np.ndarray:
        """Slots in use in recency order, least recent first."""
        seg = self._log[self._lo: self._end]
        return seg[self._current(self._lo, self._end)].astype(np.int64)

    def oldest(self, count: int | None = None, below: tuple[str, int] | None = None) -> np.ndarray:
        """The least recent slots, in order: at most ``count`` of them, and (``below=(column,
        bound)``) only while the column is under the bound (the column must grow with recency).
        They are no longer at the head of the order; the caller releases them."""
        taken: list[np.ndarray] = []
        need = count
        chunk = 4096
        while self._lo < self._end and (need is None or need > 0):
            hi = min(self._end, self._lo + max(chunk, 2 * need if need is not None else 0))
            chunk *= 2
            seg = self._log[self._lo: hi]
            idx = np.flatnonzero(self._current(self._lo, hi))
            stop = hi
            if below is not None and idx.size:
                col, bound = below
                under = self.cols[col][seg[idx]] < bound
                if not under.all():
                    first_not = int(np.argmin(under))
                    stop = self._lo + int(idx[first_not])
                    idx = idx[:first_not]
            if need is not None and idx.size > need:
                idx = idx[:need]
                stop = self._lo + int(idx[-1]) + 1
            taken.append(seg[idx])
            if need is not None:
                need -= int(idx.size)
            self._lo = stop
            if stop < hi:
                break
        return np.concatenate(taken).astype(np.int64, copy=False) if taken else np.empty(0, dtype=np.int64)


class DynamicTableShard:
    """One shard of a dynamic table: vectorised storage, thread-safe.

    Storage (:class:`_KeyedSlots`): rows, optimizer slots, the push count ``t`` (lazy Adam only),
    last step and frequency in per-slot numpy columns that grow by doubling, freed slots reused; an
    open-addressing hash index (4 bytes per position, at most 70% full) from the key's identity (the
    int64 key, or a string key's 64-bit hash) to its slot; a log of slot numbers for the recency
    order (LRU, TTL, the export's order). Keys pending admission live in a second such structure.
    Every push, lookup and eviction is a fixed number of numpy passes over the batch (or the
    evicted rows), never a Python loop over keys; LFU eviction selects its victims in O(rows).

    String keys are identified by their 64-bit BLAKE2b hash (:func:`hash_keys`): two strings with the
    same hash would share a row (for n keys, a chance of about n²/2^65: 7e-5 for 50M keys).
    """

    #: Evictions remembered for :meth:`changes_since` (the latest; older ones are forgotten).
    EVICTION_LOG = 1 << 20

    def __init__(self, config: DynamicTableConfig, shard: int = 0, num_shards: int = 1) -> None:
        if not 0 <= shard < num_shards:
            raise ConfigurationError(f"shard {shard} out of range for {num_shards} shards")
        self.config = config
        self.shard = shard
        self.num_shards = num_shards
        self._lock = threading.Lock()
        self._strings = config.key_dtype == "string"
        hash_of = _string_ident_hashes if self._strings else _int_ident_hashes
        shape = config.row_shape
        cols: dict[str, tuple[tuple[int, ...], Any]] = {
            "values": (shape, np.dtype(config.dtype)), "last": ((), np.int64), "freq": ((), np.int64)}
        for s in config.optimizer.slot_names():
            cols["slot_" + s] = (shape, np.float32)
        if config.optimizer.name == "lazy_adam":
            cols["t"] = ((), np.int64)  # pushes received per row (Adam's bias correction)
        cap = config.eviction.capacity
        # A bounded table reserves its columns for its capacity (plus one push's inserts beyond it,
        # evicted right after) at once: untouched pages are free, and no doubling copies them later.
        reserve = None if cap is None else min(cap + max(1024, cap // 8), max(1, config.max_bytes // config.row_bytes()))
        self._rows = _KeyedSlots(hash_of, cols, self._strings, reserve)
        self._pending = _KeyedSlots(hash_of, {"count": ((), np.int64)}, self._strings)
        self._step = 0
        # The latest evictions (step, identity[, string]), oldest first, in [_ev_lo, _ev_end);
        # complete for steps >= _log_floor.
        self._ev_step = np.empty(0, dtype=np.int64)
        self._ev_ident = np.empty(0, dtype=np.int64)
        self._ev_str = np.empty(0, dtype=object)
        self._ev_lo = self._ev_end = 0
        self._log_floor = 0
        self.counters = _Counters()

    # ----------------------------------------------------------------- reading
    @property
    def step(self) -> int:
        return self._step

    def __len__(self) -> int:
        return self._rows.live

    def _identities(self, keys: np.ndarray | list[str], hashes: np.ndarray) -> np.ndarray:
        return hashes.view(np.int64) if self._strings else np.asarray(keys, dtype=np.int64)

    def _admitted_by_probability(self, hashes: np.ndarray) -> np.ndarray:
        p = self.config.admission.probability
        if p >= 1.0:
            return np.ones(hashes.shape[0], dtype=bool)
        return _uniform(_splitmix64(hashes ^ _ADMIT_SALT ^ np.uint64(self.config.seed))) < p

    def _check_routing(self, hashes: np.ndarray) -> None:
        if self.num_shards > 1:
            wrong = shard_of(hashes, self.num_shards) != self.shard
            if wrong.any():
                raise InvalidRequestError(
                    f"{int(wrong.sum())} keys belong to another shard of table {self.config.name!r}"
                )

    def lookup(self, keys: Any) -> tuple[np.ndarray, np.ndarray]:
        """Rows for ``keys`` (a pure read) and a mask: True where the key has or would get a row.

        Returns ``(values [n, *row_shape], admitted [n] bool)``: a row's current value, or for an
        admitted key without a row its initializer row; the default vector where not admitted.
        """
        cfg = self.config
        ks = validate_keys(keys, cfg.key_dtype)
        hashes = hash_keys(ks)
        self._check_routing(hashes)
        ident = self._identities(ks, hashes)
        n = int(ident.shape[0])
        out = np.full((n, *cfg.row_shape), cfg.default_value, dtype=cfg.dtype)
        with self._lock:
            slots = self._rows.find(ident)
            have = slots >= 0
            out[have] = self._rows.cols["values"][slots[have]]
        if cfg.admission.min_count > 1:
            # Without a row, a key reads its initializer only if it is admitted: with a count
            # threshold it gets a row at the push that reaches it, so until then: the default.
            fresh = np.zeros(n, dtype=bool)
        else:
            fresh = ~have & self._admitted_by_probability(hashes)
        if fresh.any():
            out[fresh] = initial_rows(cfg, hashes[fresh])
        return out, have | fresh

    # ----------------------------------------------------------------- writing
    def apply(self, keys: Any, grads: Any, counts: Any = None) -> dict[str, int]:
        """Applies one push of gradient rows (exactly once: the caller dedupes by push identity).

        Two forms, with the same effect: *uncounted* (``counts`` None): one gradient row per key
        occurrence, duplicates allowed (summed here, in push order from +0.0, in float32; keys in
        first-occurrence order); *counted*: each key once (no two keys of one identity), with its
        rows already summed that way (:func:`reduce_push`) and ``counts``, its occurrences. A counted
        push of :func:`reduce_push`'s output changes the shard bit-identically to the uncounted push
        it reduced (rows, state, admission counts, LFU frequencies, recency, counters, answer).

        Validates everything before changing anything. Returns this push's counts:
        ``applied`` rows (distinct keys), ``refused`` gradient rows dropped by admission (occurrences),
        ``inserted``, ``evicted``.

        Raises:
            InvalidRequestError: (counted) counts malformed (:func:`validate_counts`) or a key repeated;
                non-finite gradient rows; keys of another shard.
            DTypeMismatchError, ShapeMismatchError: keys or rows of the wrong type or shape.
        """
        cfg = self.config
        ks = validate_keys(keys, cfg.key_dtype)
        g = np.asarray(grads)
        if g.dtype.kind != "f":
            raise DTypeMismatchError(f"gradient rows must be floating point, got {g.dtype}")
        n = len(ks)
        if g.shape != (n, *cfg.row_shape):
            raise ShapeMismatchError(
                f"gradient rows of shape {g.shape} for {n} keys of rows {cfg.row_shape}"
            )
        occ = None if counts is None else validate_counts(counts, n)
        if not np.isfinite(g).all():
            raise InvalidRequestError("gradient rows contain NaN or infinity")
        hashes = hash_keys(ks)
        self._check_routing(hashes)
        ident = self._identities(ks, hashes)
        if occ is None:
            # Sum duplicates: one update per distinct key, in first-occurrence order (deterministic).
            uid, ufirst, inv = first_occurrences(ident)
            m = int(uid.shape[0])
            occ = np.bincount(inv, minlength=m).astype(np.int64)
            gsum = sum_rows(g, inv, m)
            uhash = hashes[ufirst]
            ustr = np.asarray(ks, dtype=object)[ufirst] if self._strings else None
        else:
            # Counted: the keys are the distinct keys already, in first-occurrence order.
            if n > 1:
                ordered = np.sort(ident)
                if (ordered[1:] == ordered[:-1]).any():
                    raise InvalidRequestError("a key is repeated in a push with counts (each key once, its rows summed)")
            uid, uhash = ident, hashes
            gsum = g.astype(np.float32) + np.float32(0.0)  # a sum starts from +0.0: no -0.0 (as sum_rows)
            ustr = np.asarray(ks, dtype=object).reshape(-1) if self._strings else None
        by_p = self._admitted_by_probability(uhash)
        with self._lock:
            return self._apply_locked(uid, ustr, uhash, by_p, occ, gsum)

    def _apply_locked(
        self, uid: np.ndarray, ustr: np.ndarray | None, uhash: np.ndarray, by_p: np.ndarray, occ: np.ndarray,
        gsum: np.ndarray,
    ) -> dict[str, int]:
        cfg = self.config
        adm = cfg.admission
        rows = self._rows
        m = int(uid.shape[0])
        # 1. Plan without mutating: which keys apply, which get inserted, which are refused.
        slots = rows.find(uid)
        has_row = slots >= 0
        reach = np.zeros(m, dtype=bool)
        waiting = pend_slot = np.empty(0, dtype=np.int64)
        if adm.min_count <= 1:
            insert_apply = ~has_row & by_p
        else:
            insert_apply = np.zeros(m, dtype=bool)
            waiting = np.flatnonzero(~has_row & by_p)
            pend_slot = self._pending.find(uid[waiting])
            seen = np.where(pend_slot >= 0, self._pending.cols["count"][np.maximum(pend_slot, 0)], 0) + occ[waiting]
            reach[waiting[seen >= adm.min_count]] = True
        new_idx = np.flatnonzero(insert_apply | reach)
        projected = rows.live + int(new_idx.shape[0])
        if cfg.eviction.capacity is not None:
            projected = min(projected, cfg.eviction.capacity)
        if projected * cfg.row_bytes() > cfg.max_bytes:
            raise PayloadTooLargeError(
                f"dynamic table {cfg.name!r} shard {self.shard}: {projected} rows x {cfg.row_bytes()} bytes "
                f"would pass its bound of {cfg.max_bytes} bytes"
            )
        # 2. Mutate.
        self._step += 1
        self.counters.pushes += 1
        if new_idx.size:
            new_slots = rows.alloc(uid[new_idx], None if ustr is None else ustr[new_idx])
            c = rows.cols
            c["values"][new_slots] = initial_rows(cfg, uhash[new_idx])
            for s in cfg.optimizer.slot_names():
                c["slot_" + s][new_slots] = cfg.optimizer.initial_accumulator if s == "acc" else 0.0
            if "t" in c:
                c["t"][new_slots] = 0
            c["freq"][new_slots] = 0
            c["last"][new_slots] = self._step
            slots[new_idx] = new_slots
            self.counters.inserts += int(new_idx.size)
        applies = has_row | insert_apply
        refused_rows = int(occ[~applies].sum())
        self.counters.admissions_refused += refused_rows
        apply_idx = np.flatnonzero(applies)
        # Recency: rows admitted by count (inserted, not applied) first, then the applied rows, each
        # in first-occurrence order.
        rows.touch(np.concatenate([slots[reach], slots[apply_idx]]))
        if apply_idx.size:
            sl = slots[apply_idx]
            self._update_rows(sl, gsum[apply_idx])
            rows.cols["last"][sl] = self._step
            rows.cols["freq"][sl] += occ[apply_idx]
        if adm.min_count > 1:
            self._update_pending(uid, ustr, reach, occ, waiting, pend_slot)
        evicted = self._evict()
        return {"applied": int(apply_idx.size), "refused": refused_rows, "inserted": int(new_idx.size),
                "evicted": evicted}

    def _update_pending(
        self, uid: np.ndarray, ustr: np.ndarray | None, reach: np.ndarray, occ: np.ndarray, waiting: np.ndarray,
        pend_slot: np.ndarray,
    ) -> None:
        """The keys pending admission after a push, in first-occurrence order: a key admitted leaves
        them; a key still waiting adds its sightings and becomes the most recent (a new one is
        appended and, past ``max_pending``, the least recent key is forgotten at once).

        Vectorised: the number forgotten is the overshoot of the pending count's path over the push
        (``max(0, max_t(count_t) - max_pending)``, each forgetting capping it); when the keys
        forgotten are the least recent ones, untouched by this push (the usual case), that is all.
        Otherwise (a key forgotten early in a push and sighted, or admitted, later in it) the push's
        waiting keys are replayed one by one (:meth:`_update_pending_bounded`)."""
        pend = self._pending
        admitted = reach[waiting]
        still = ~admitted
        present = pend_slot >= 0
        new = still & ~present
        over = 0
        if waiting.size:
            path = np.cumsum(new.astype(np.int64) - (admitted & present))
            over = max(0, pend.live + int(path.max()) - self.config.admission.max_pending)
        victims = np.empty(0, dtype=np.int64)
        if over:
            head = pend.head
            victims = pend.oldest(over)
            touched = pend_slot[present]
            ticks = pend.cols["tick"]
            if victims.size < over or (touched.size and int(ticks[victims[-1]]) >= int(ticks[touched].min())):
                pend.head = head  # nothing changed yet
                self._update_pending_bounded(uid, ustr, admitted, occ, waiting, pend_slot)
                return
        pend.release(pend_slot[admitted & present])
        known = still & present
        pend.cols["count"][pend_slot[known]] += occ[waiting[known]]
        if new.any():
            at = waiting[new]
            got = pend.alloc(uid[at], None if ustr is None else ustr[at])
            pend.cols["count"][got] = occ[at]
            pend_slot = pend_slot.copy()
            pend_slot[new] = got
        pend.touch(pend_slot[still])
        pend.release(victims)
        self.counters.pending_forgotten += over

    def _update_pending_bounded(
        self, uid: np.ndarray, ustr: np.ndarray | None, admitted: np.ndarray, occ: np.ndarray, waiting: np.ndarray,
        pend_slot: np.ndarray,
    ) -> None:
        """:meth:`_update_pending` when the bound forgets keys: the FIFO replayed key by key."""
        pend = self._pending
        limit = self.config.admission.max_pending
        before = pend.order().tolist()  # slots, least recent first
        head = 0
        gone: set[int] = set()  # slots of `before` admitted, moved to the end or forgotten
        released: list[int] = []
        queue: deque[tuple[bool, int]] = deque()  # this push's entries: (old slot?, slot or event)
        size = pend.live
        forgotten = 0
        for e, (slot, is_admitted) in enumerate(zip(pend_slot.tolist(), admitted.tolist())):
            present = slot >= 0 and slot not in gone
            if is_admitted:
                if present:
                    gone.add(slot)
                    released.append(slot)
                    size -= 1
                continue
            if present:
                gone.add(slot)
                queue.append((True, slot))
                continue
            queue.append((False, e))
            size += 1
            if size > limit:
                while head < len(before) and before[head] in gone:
                    head += 1
                if head < len(before):
                    gone.add(before[head])
                    released.append(before[head])
                    head += 1
                else:
                    old, what = queue.popleft()
                    if old:
                        released.append(what)
                size -= 1
                forgotten += 1
        pend.release(np.asarray(released, dtype=np.int64))
        # Keys still pending from before: their sightings added (a slot is in `queue` once at most).
        event_of = {slot: e for e, slot in enumerate(pend_slot.tolist()) if slot >= 0}
        kept_old = [w for old, w in queue if old]
        if kept_old:
            events = np.asarray([event_of[w] for w in kept_old], dtype=np.int64)
            pend.cols["count"][np.asarray(kept_old, dtype=np.int64)] += occ[waiting[events]]
        fresh = np.asarray([e for old, e in queue if not old], dtype=np.int64)
        slot_of_entry: dict[tuple[bool, int], int] = {}
        if fresh.size:
            at = waiting[fresh]
            got = pend.alloc(uid[at], None if ustr is None else ustr[at])
            pend.cols["count"][got] = occ[at]
            slot_of_entry = {(False, int(e)): int(s) for e, s in zip(fresh.tolist(), got.tolist())}
        pend.touch(np.asarray([w if old else slot_of_entry[(old, w)] for old, w in queue], dtype=np.int64))
        self.counters.pending_forgotten += forgotten

    def _update_rows(self, sl: np.ndarray, g: np.ndarray) -> None:
        opt = self.config.optimizer
        c = self._rows.cols
        w = c["values"][sl].astype(np.float32, copy=False)  # a gathered copy already
        lr = np.float32(opt.learning_rate)
        if opt.name == "sgd":
            w = w - lr * g
        elif opt.name == "adagrad":
            acc = c["slot_acc"][sl] + g * g
            c["slot_acc"][sl] = acc
            w = w - lr * g / np.sqrt(acc + np.float32(opt.eps))
        else:
            b1, b2 = np.float32(opt.b1), np.float32(opt.b2)
            t = c["t"][sl] + 1
            c["t"][sl] = t
            m = b1 * c["slot_m"][sl] + (1 - b1) * g
            v = b2 * c["slot_v"][sl] + (1 - b2) * g * g
            c["slot_m"][sl] = m
            c["slot_v"][sl] = v
            shape = (-1,) + (1,) * len(self.config.row_shape)
            c1 = (1 - b1 ** t.astype(np.float32)).reshape(shape)
            c2 = (1 - b2 ** t.astype(np.float32)).reshape(shape)
            w = w - lr * (m / c1) / (np.sqrt(v / c2) + np.float32(opt.eps))
        c["values"][sl] = w.astype(self.config.dtype)

    def _evict(self) -> int:
        ev = self.config.eviction
        rows = self._rows
        n = 0
        if ev.ttl_steps is not None:
            # The recency order is ordered by last push step too: the expired rows are its head.
            victims = rows.oldest(below=("last", self._step - ev.ttl_steps))
            self._remove(victims)
            self.counters.evictions_ttl += int(victims.size)
            n += int(victims.size)
        if ev.capacity is not None and rows.live > ev.capacity:
            over = rows.live - ev.capacity
            victims = rows.oldest(over) if ev.policy == "lru" else self._lfu_victims(over)
            self._remove(victims)
            self.counters.evictions_capacity += over
            n += over
        return n

    def _lfu_victims(self, k: int) -> np.ndarray:
        """The ``k`` rows least often pushed (ties: least recent step, then smaller key hash), in
        that order: selected by partitions (O(rows)), only the ties at the threshold sorted."""
        c = self._rows.cols
        alive = self._rows.alive()

        def ordered(sl: np.ndarray) -> np.ndarray:
            return sl[np.lexsort((self._rows.hash_of(c["ident"][sl]), c["last"][sl], c["freq"][sl]))]

        if k >= alive.size:
            return ordered(alive)
        freq = c["freq"][alive]
        fk = np.partition(freq, k - 1)[k - 1]
        sure = alive[freq < fk]
        tie = alive[freq == fk]
        need = k - int(sure.size)
        last = c["last"][tie]
        lk = np.partition(last, need - 1)[need - 1]
        sure2 = tie[last < lk]
        tie2 = tie[last == lk]
        tie2 = tie2[np.argsort(self._rows.hash_of(c["ident"][tie2]), kind="stable")][: need - int(sure2.size)]
        return np.concatenate([ordered(sure), ordered(sure2), tie2])

    def _remove(self, slots: np.ndarray) -> None:
        """Evicts the rows in these slots, logged (in order) for :meth:`changes_since`."""
        m = int(slots.shape[0])
        if m == 0:
            return
        c = self._rows.cols
        live = self._ev_end - self._ev_lo
        if self._ev_end + m > self._ev_step.shape[0]:
            cap = max(1024, 2 * (live + m))
            step, ident = np.empty(cap, dtype=np.int64), np.empty(cap, dtype=np.int64)
            step[:live] = self._ev_step[self._ev_lo: self._ev_end]
            ident[:live] = self._ev_ident[self._ev_lo: self._ev_end]
            if self._strings:
                strs = np.empty(cap, dtype=object)
                strs[:live] = self._ev_str[self._ev_lo: self._ev_end]
                self._ev_str = strs
            self._ev_step, self._ev_ident = step, ident
            self._ev_lo, self._ev_end = 0, live
        end = self._ev_end + m
        self._ev_step[self._ev_end: end] = self._step
        self._ev_ident[self._ev_end: end] = c["ident"][slots]
        if self._strings:
            self._ev_str[self._ev_end: end] = c["str"][slots]
        self._ev_end = end
        over = (end - self._ev_lo) - self.EVICTION_LOG
        if over > 0:
            self._log_floor = int(self._ev_step[self._ev_lo + over - 1])
            if self._strings:
                self._ev_str[self._ev_lo: self._ev_lo + over] = None
            self._ev_lo += over
        self._rows.release(slots)

    # ----------------------------------------------------------------- state
    def _keys_of(self, kept: _KeyedSlots, slots: np.ndarray) -> np.ndarray:
        if self._strings:
            return kept.cols["str"][slots].copy()
        return kept.cols["ident"][slots].copy()

    def changes_since(self, step: int) -> tuple[np.ndarray | list[str], np.ndarray, np.ndarray | list[str]]:
        """What changed after shard step ``step`` (for incremental export): ``(changed keys, their
        rows, evicted keys)``.

        Changed: keys whose row was inserted or pushed at a step ``> step`` (rows as now). Evicted:
        keys evicted at a step ``> step`` that have no row now (a key evicted and inserted again is
        only in the changed keys; one inserted and evicted after ``step`` is in the evicted keys, so
        deleting a key that is absent must be a no-op). Applying the evictions, then the changed rows,
        to the shard's state at ``step`` gives its state now. Cost: O(rows) for the changed keys, O(evictions
        logged) for the evicted ones. Read the current :attr:`step` in the same quiet point (no push
        in between) to know where the next call starts.

        Raises:
            ConfigurationError: ``step`` is older than the eviction log reaches (it keeps the latest
                :attr:`EVICTION_LOG` evictions, and none from before a restore): export in full.
        """
        with self._lock:
            if step < self._log_floor:
                raise ConfigurationError(
                    f"dynamic table {self.config.name!r} shard {self.shard}: evictions since step {step} are no longer "
                    f"logged (the log starts at step {self._log_floor}); export the table in full")
            rows = self._rows
            alive = rows.alive()
            sel = alive[rows.cols["last"][alive] > step]
            changed = self._keys_of(rows, sel)
            values = rows.cols["values"][sel]
            # Evicted after ``step``, latest first, each once, and not back since.
            steps = self._ev_step[self._ev_lo: self._ev_end]
            start = self._ev_lo + int(np.searchsorted(steps, step, side="right"))
            ids = self._ev_ident[start: self._ev_end][::-1]
            _, first = np.unique(ids, return_index=True)
            first = np.sort(first)
            gone = first[rows.find(ids[first]) < 0]
            if self._strings:
                evicted: np.ndarray | list[str] = self._ev_str[start: self._ev_end][::-1][gone].tolist()
                return changed.tolist(), values, evicted
            return changed, values, ids[gone].copy()

    def rows_of(self, keys: set[Any] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``(keys, rows)`` of the keys of ``keys`` that have a row now (None: every row), copies,
        keys ascending: int64, or a numpy unicode array for string keys (what an export for serving
        writes; no pickle needed to read it back)."""
        with self._lock:
            rows = self._rows
            if keys is None:
                sl = rows.alive()
            else:
                wanted = list(keys)
                ids = (hash_keys(wanted).view(np.int64) if self._strings
                       else np.fromiter(wanted, dtype=np.int64, count=len(wanted)))
                found = rows.find(ids)
                sl = found[found >= 0]
            if self._strings:
                karr = np.asarray(rows.cols["str"][sl].tolist(), dtype=str) if sl.size else np.zeros(0, dtype="<U1")
            else:
                karr = rows.cols["ident"][sl]
            order = np.argsort(karr, kind="stable")
            return karr[order], rows.cols["values"][sl[order]]  # one gather: a copy

    def stats(self) -> dict[str, int]:
        """Rows, bytes and the cumulative counters (for /metrics and ``jaxdist status``).

        ``bytes`` is rows x :meth:`DynamicTableConfig.row_bytes` (values and optimizer state);
        ``storage_bytes`` is what the shard's arrays use: every per-row column up to the highest slot
        used, the hash indexes and the recency logs (the process's memory beyond it is the interpreter's).
        """
        with self._lock:
            c = self.counters
            n = self._rows.live
            return {
                "rows": n, "bytes": n * self.config.row_bytes(),
                "pending_keys": self._pending.live, "step": self._step, "inserts": c.inserts,
                "admissions_refused": c.admissions_refused, "evictions": c.evictions_ttl + c.evictions_capacity,
                "evictions_ttl": c.evictions_ttl, "evictions_capacity": c.evictions_capacity,
                "pending_forgotten": c.pending_forgotten, "pushes": c.pushes,
                "storage_bytes": self._rows.nbytes() + self._pending.nbytes() + self._ev_step.nbytes * 2,
            }

    def export(self) -> dict[str, Any]:
        """The shard's whole state as numpy arrays (keys in recency order, least recent first).

        String keys are exported as an object array of ``str``. Used by checkpoints, by a backup's
        initial sync and by :meth:`digest`.
        """
        with self._lock:
            rows, pend = self._rows, self._pending
            sl = rows.order()
            c = rows.cols
            ps = pend.order()
            out: dict[str, Any] = {
                "keys": self._keys_of(rows, sl),
                "values": c["values"][sl],
                "t": c["t"][sl] if "t" in c else np.zeros(sl.shape[0], dtype=np.int64),
                "last": c["last"][sl], "freq": c["freq"][sl],
                "pending_keys": self._keys_of(pend, ps),
                "pending_counts": pend.cols["count"][ps],
                "step": np.int64(self._step),
                "counters": np.asarray(list(asdict(self.counters).values()), dtype=np.int64),
            }
            for s in self.config.optimizer.slot_names():
                out["slot_" + s] = c["slot_" + s][sl]
            return out

    def digest(self) -> str:
        """A hash of the exported state: equal on two shards iff keys, rows, state and counters are equal."""
        h = hashlib.sha256()
        for name, arr in sorted(self.export().items()):
            h.update(name.encode())
            a = np.asarray(arr)
            h.update(repr(a.tolist()).encode() if a.dtype == object else a.tobytes())
        return h.hexdigest()

    @classmethod
    def copy_of(
        cls, config: DynamicTableConfig, export: dict[str, Any], shard: int = 0, num_shards: int = 1
    ) -> DynamicTableShard:
        """An exact copy of the shard that gave ``export`` (same placement; its own counters kept):
        what a backup installs, so its :meth:`digest` equals the primary's."""
        new = cls.restore(config, [export], shard, num_shards)
        new.counters = _Counters(*(int(x) for x in export["counters"]))
        return new

    @classmethod
    def restore(
        cls, config: DynamicTableConfig, exports: Sequence[dict[str, Any]], shard: int = 0, num_shards: int = 1
    ) -> DynamicTableShard:
        """A shard built from the exports of all shards of a saved table, for ``shard`` of ``num_shards``.

        The saved table may have had any number of shards: every row and pending key is routed again
        by :func:`shard_of`. Recency is merged by last step (then saved order). Cumulative counters
        are summed into shard 0, so the table's totals survive a change of shard count; the step is
        the largest saved step.

        Raises:
            ValueError: a key saved twice (rows or pending keys), or arrays of mismatched lengths.
        """
        new = cls(config, shard, num_shards)
        strings = new._strings
        fields = ["values", "last", "freq"] + ["slot_" + s for s in config.optimizer.slot_names()]
        if "t" in new._rows.cols:
            fields.append("t")
        got: dict[str, list[np.ndarray]] = {f: [] for f in [*fields, "ident", "str", "e_i", "j"]}
        pend: dict[str, list[np.ndarray]] = {f: [] for f in ("ident", "str", "count")}
        total = np.zeros(len(asdict(new.counters)), dtype=np.int64)

        def mine(keys: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
            arr = np.asarray(keys)
            ks = validate_keys(arr.astype(np.int64) if not strings else arr.tolist(), config.key_dtype)
            hashes = hash_keys(ks)
            idx = np.flatnonzero(shard_of(hashes, num_shards) == shard) if len(ks) else np.empty(0, np.int64)
            ident = new._identities(ks, hashes)[idx]
            return idx, ident, (np.asarray(ks, dtype=object).reshape(-1)[idx] if strings else None)

        for e_i, e in enumerate(exports):
            idx, ident, strs = mine(e["keys"])
            if any(len(np.asarray(e[f])) != len(e["keys"]) for f in fields):
                raise ValueError(f"saved shard {e_i}: arrays of different lengths")
            got["ident"].append(ident)
            got["e_i"].append(np.full(idx.shape[0], e_i, dtype=np.int64))
            got["j"].append(idx)
            for f in fields:
                got[f].append(np.asarray(e[f])[idx])
            if strs is not None:
                got["str"].append(strs)
            pidx, pident, pstrs = mine(e["pending_keys"])
            pend["ident"].append(pident)
            pend["count"].append(np.asarray(e["pending_counts"], dtype=np.int64)[pidx])
            if pstrs is not None:
                pend["str"].append(pstrs)
            total += np.asarray(e["counters"], dtype=np.int64)
            new._step = max(new._step, int(e["step"]))

        def cat(parts: list[np.ndarray], empty: np.ndarray) -> np.ndarray:
            return np.concatenate(parts) if parts else empty

        ident = cat(got["ident"], np.empty(0, np.int64))
        if np.unique(ident).shape[0] != ident.shape[0]:
            raise ValueError("a key is saved twice")
        order = np.lexsort((cat(got["j"], np.empty(0, np.int64)), cat(got["e_i"], np.empty(0, np.int64)),
                            cat(got["last"], np.empty(0, np.int64))))
        if order.size:
            strs = cat(got["str"], np.empty(0, object))[order] if strings else None
            slots = new._rows.alloc(ident[order], strs)
            for f in fields:
                new._rows.cols[f][slots] = np.concatenate(got[f])[order]
            new._rows.touch(slots)
        pident = cat(pend["ident"], np.empty(0, np.int64))
        if pident.size:
            if np.unique(pident).shape[0] != pident.shape[0]:
                raise ValueError("a pending key is saved twice")
            pslots = new._pending.alloc(pident, cat(pend["str"], np.empty(0, object)) if strings else None)
            new._pending.cols["count"][pslots] = np.concatenate(pend["count"])
            new._pending.touch(pslots)
        new._log_floor = new._step  # evictions before the restore are not known here
        if shard == 0:
            new.counters = _Counters(*(int(x) for x in total))
        return new
