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
  duplicate keys in one push are summed first; a key's row is inserted (from its initializer row)
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
from collections import OrderedDict, deque
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
    "AdmissionConfig", "DynamicTableConfig", "DynamicTableShard", "EvictionConfig", "RowOptimizer",
    "hash_keys", "initial_rows", "shard_of",
]

logger = logging.getLogger(__name__)

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
#: Salt of the routing hash: routing never depends on a table's seed.
_ROUTE_SALT = np.uint64(0xD1B54A32D192ED03)
_ADMIT_SALT = np.uint64(0x8CB92BA72F3D8DD7)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on a uint64 array (wrapping arithmetic): a stable, well-mixed hash."""
    with np.errstate(over="ignore"):
        z = (x + _GOLDEN) & _MASK64
        z = ((z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK64
        z = ((z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK64
        return z ^ (z >> np.uint64(31))


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


def _uniform(bits: np.ndarray) -> np.ndarray:
    """uint64 -> float64 in [0, 1) from the top 53 bits."""
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def initial_rows(config: DynamicTableConfig, hashes: np.ndarray) -> np.ndarray:
    """The initializer rows of keys (by hash): a pure function of ``(config.seed, key)``.

    Counter-based: element ``j`` of a key's row draws from ``splitmix64(mix(seed, key) + j)``, so
    the row is the same whichever process, shard or order computes it.
    """
    n = int(hashes.shape[0])
    size = int(np.prod(config.row_shape, dtype=np.int64))
    base = _splitmix64(hashes ^ _splitmix64(np.asarray([config.seed], dtype=np.uint64)))
    with np.errstate(over="ignore"):
        counters = base[:, None] + np.arange(1, 2 * size + 1, dtype=np.uint64)[None, :] * _GOLDEN
    u = _uniform(_splitmix64(counters))
    kind = config.initializer
    if kind == "zeros":
        vals = np.zeros((n, size))
    elif kind == "uniform":
        vals = (u[:, :size] * 2.0 - 1.0) * config.init_scale
    elif kind == "normal":
        u1 = 1.0 - u[:, :size]  # (0, 1]: log is finite
        vals = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u[:, size:]) * config.init_scale
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


class DynamicTableShard:
    """One shard of a dynamic table: rows in contiguous arrays, a key -> slot map, thread-safe.

    Storage: values and optimizer slots are arrays of ``slot`` rows that grow by doubling; freed
    slots (evictions) are reused. ``_order`` keeps keys in recency order (least recent first) for
    LRU and TTL.
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
        self._slot: dict[Any, int] = {}
        self._order: OrderedDict[Any, None] = OrderedDict()  # recency, least recent first
        self._pending: OrderedDict[Any, int] = OrderedDict()  # key -> sightings so far
        self._free: list[int] = []
        self._step = 0
        # (step, key) of the latest evictions, oldest first; complete for steps >= _log_floor.
        self._evicted_log: deque[tuple[int, Any]] = deque()
        self._log_floor = 0
        self.counters = _Counters()
        cap = 16
        self._values = np.zeros((cap, *config.row_shape), dtype=config.dtype)
        self._slots = {s: np.zeros((cap, *config.row_shape), dtype=np.float32) for s in config.optimizer.slot_names()}
        self._t = np.zeros(cap, dtype=np.int64)  # pushes received per row (Adam's bias correction)
        self._last = np.zeros(cap, dtype=np.int64)  # step of the last push
        self._freq = np.zeros(cap, dtype=np.int64)  # pushes received (LFU)
        self._hash = np.zeros(cap, dtype=np.uint64)
        self._keys: list[Any] = [None] * cap

    # ----------------------------------------------------------------- reading
    @property
    def step(self) -> int:
        return self._step

    def __len__(self) -> int:
        return len(self._slot)

    def _key_list(self, keys: np.ndarray | list[str]) -> list[Any]:
        return keys.tolist() if isinstance(keys, np.ndarray) else list(keys)

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
        klist = self._key_list(ks)
        n = len(klist)
        out = np.full((n, *cfg.row_shape), cfg.default_value, dtype=cfg.dtype)
        with self._lock:
            slots = np.fromiter((self._slot.get(k, -1) for k in klist), dtype=np.int64, count=n)
            have = slots >= 0
            out[have] = self._values[slots[have]]
            by_p = self._admitted_by_probability(hashes)
            if cfg.admission.min_count > 1:
                # Without a row, a key reads its initializer only if it is admitted: with a count
                # threshold it gets a row at the push that reaches it, so until then: the default.
                fresh = np.zeros(n, dtype=bool)
            else:
                fresh = ~have & by_p
        if fresh.any():
            out[fresh] = initial_rows(cfg, hashes[fresh])
        return out, have | fresh

    # ----------------------------------------------------------------- writing
    def _grow(self, need: int) -> None:
        cap = self._values.shape[0]
        if need <= cap:
            return
        new = max(need, cap * 2)

        def grown(a: np.ndarray) -> np.ndarray:
            b = np.zeros((new, *a.shape[1:]), dtype=a.dtype)
            b[:cap] = a
            return b

        self._values = grown(self._values)
        self._slots = {s: grown(a) for s, a in self._slots.items()}
        self._t, self._last, self._freq, self._hash = (grown(a) for a in (self._t, self._last, self._freq, self._hash))
        self._keys.extend([None] * (new - cap))

    def _remove(self, key: Any) -> None:
        """Evict ``key`` (logged for :meth:`changes_since`)."""
        self._evicted_log.append((self._step, key))
        if len(self._evicted_log) > self.EVICTION_LOG:
            self._log_floor = self._evicted_log.popleft()[0]
        slot = self._slot.pop(key)
        self._order.pop(key, None)
        self._keys[slot] = None
        self._free.append(slot)

    def _insert(self, key: Any, h: np.uint64, row: np.ndarray) -> int:
        if self._free:
            slot = self._free.pop()
        else:
            slot = len(self._slot)
            self._grow(slot + 1)
        self._slot[key] = slot
        self._order[key] = None
        self._values[slot] = row
        for a in self._slots.values():
            a[slot] = self.config.optimizer.initial_accumulator if a is self._slots.get("acc") else 0.0
        self._t[slot] = 0
        self._freq[slot] = 0
        self._last[slot] = self._step
        self._hash[slot] = h
        self._keys[slot] = key
        self.counters.inserts += 1
        return slot

    def apply(self, keys: Any, grads: Any) -> dict[str, int]:
        """Applies one push of gradient rows (exactly once: the caller dedupes by push identity).

        Validates everything before changing anything. Returns this push's counts:
        ``applied`` rows, ``refused`` gradient rows dropped by admission, ``inserted``, ``evicted``.
        """
        cfg = self.config
        ks = validate_keys(keys, cfg.key_dtype)
        g = np.asarray(grads)
        if g.dtype.kind != "f":
            raise DTypeMismatchError(f"gradient rows must be floating point, got {g.dtype}")
        klist = self._key_list(ks)
        if g.shape != (len(klist), *cfg.row_shape):
            raise ShapeMismatchError(
                f"gradient rows of shape {g.shape} for {len(klist)} keys of rows {cfg.row_shape}"
            )
        if not np.isfinite(g).all():
            raise InvalidRequestError("gradient rows contain NaN or infinity")
        hashes = hash_keys(ks)
        self._check_routing(hashes)
        # Sum duplicates: one update per distinct key, in first-occurrence order (deterministic).
        uniq: dict[Any, int] = {}
        occ: list[int] = []
        for k in klist:
            j = uniq.get(k)
            if j is None:
                uniq[k] = len(occ)
                occ.append(1)
            else:
                occ[j] += 1
        inv = np.fromiter((uniq[k] for k in klist), dtype=np.int64, count=len(klist))
        gsum = np.zeros((len(uniq), *cfg.row_shape), dtype=np.float32)
        np.add.at(gsum, inv, g.astype(np.float32))
        ukeys = list(uniq)
        first = np.zeros(len(uniq), dtype=np.int64)
        first[inv[::-1]] = np.arange(len(klist))[::-1]
        uhash = hashes[first]
        by_p = self._admitted_by_probability(uhash)
        with self._lock:
            return self._apply_locked(ukeys, uhash, by_p, np.asarray(occ, dtype=np.int64), gsum, inv)

    def _apply_locked(
        self, ukeys: list[Any], uhash: np.ndarray, by_p: np.ndarray, occ: np.ndarray, gsum: np.ndarray, inv: np.ndarray
    ) -> dict[str, int]:
        cfg = self.config
        adm = cfg.admission
        # 1. Plan without mutating: which keys apply, which get inserted, which are refused.
        has_row = np.fromiter((k in self._slot for k in ukeys), dtype=bool, count=len(ukeys))
        insert_apply = ~has_row & by_p & (adm.min_count <= 1)
        reach = np.zeros(len(ukeys), dtype=bool)
        if adm.min_count > 1:
            for i, k in enumerate(ukeys):
                if not has_row[i] and by_p[i] and self._pending.get(k, 0) + int(occ[i]) >= adm.min_count:
                    reach[i] = True
        n_insert = int(insert_apply.sum() + reach.sum())
        projected = len(self._slot) + n_insert
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
        refused_rows = 0
        inserted = 0
        apply_idx: list[int] = []
        apply_slots: list[int] = []
        # Initializer rows of every key this push inserts, in one vectorised call.
        new_idx = np.flatnonzero(insert_apply | reach)
        init = initial_rows(cfg, uhash[new_idx])
        init_at = {int(i): j for j, i in enumerate(new_idx)}
        for i, k in enumerate(ukeys):
            if has_row[i]:
                apply_idx.append(i)
                apply_slots.append(self._slot[k])
            elif insert_apply[i]:
                slot = self._insert(k, uhash[i], init[init_at[i]])
                inserted += 1
                apply_idx.append(i)
                apply_slots.append(slot)
            else:
                refused_rows += int(occ[i])
                if reach[i]:
                    self._pending.pop(k, None)
                    self._insert(k, uhash[i], init[init_at[i]])
                    inserted += 1
                elif by_p[i] and adm.min_count > 1:
                    self._pending[k] = self._pending.pop(k, 0) + int(occ[i])
                    while len(self._pending) > adm.max_pending:
                        self._pending.popitem(last=False)
                        self.counters.pending_forgotten += 1
        self.counters.admissions_refused += refused_rows
        if apply_slots:
            sl = np.asarray(apply_slots, dtype=np.int64)
            self._update_rows(sl, gsum[np.asarray(apply_idx, dtype=np.int64)])
            self._last[sl] = self._step
            self._freq[sl] += occ[np.asarray(apply_idx, dtype=np.int64)]
            for i in apply_idx:
                self._order.move_to_end(ukeys[i])
        # Newly admitted rows (count threshold) are recent too: they were just pushed.
        evicted = self._evict()
        return {"applied": len(apply_slots), "refused": refused_rows, "inserted": inserted, "evicted": evicted}

    def _update_rows(self, sl: np.ndarray, g: np.ndarray) -> None:
        opt = self.config.optimizer
        w = self._values[sl].astype(np.float32)
        lr = np.float32(opt.learning_rate)
        if opt.name == "sgd":
            w = w - lr * g
        elif opt.name == "adagrad":
            acc = self._slots["acc"][sl] + g * g
            self._slots["acc"][sl] = acc
            w = w - lr * g / np.sqrt(acc + np.float32(opt.eps))
        else:
            b1, b2 = np.float32(opt.b1), np.float32(opt.b2)
            t = self._t[sl] + 1
            self._t[sl] = t
            m = b1 * self._slots["m"][sl] + (1 - b1) * g
            v = b2 * self._slots["v"][sl] + (1 - b2) * g * g
            self._slots["m"][sl] = m
            self._slots["v"][sl] = v
            shape = (-1,) + (1,) * len(self.config.row_shape)
            c1 = (1 - b1 ** t.astype(np.float32)).reshape(shape)
            c2 = (1 - b2 ** t.astype(np.float32)).reshape(shape)
            w = w - lr * (m / c1) / (np.sqrt(v / c2) + np.float32(opt.eps))
        self._values[sl] = w.astype(self.config.dtype)

    def _evict(self) -> int:
        ev = self.config.eviction
        n = 0
        if ev.ttl_steps is not None:
            horizon = self._step - ev.ttl_steps
            while self._order:
                k = next(iter(self._order))
                if self._last[self._slot[k]] >= horizon:
                    break
                self._remove(k)
                self.counters.evictions_ttl += 1
                n += 1
        if ev.capacity is not None and len(self._slot) > ev.capacity:
            over = len(self._slot) - ev.capacity
            if ev.policy == "lru":
                victims = [k for k, _ in zip(self._order, range(over))]
            else:
                ks = list(self._slot)
                sl = np.asarray([self._slot[k] for k in ks], dtype=np.int64)
                order = np.lexsort((self._hash[sl], self._last[sl], self._freq[sl]))[:over]
                victims = [ks[i] for i in order]
            for k in victims:
                self._remove(k)
            self.counters.evictions_capacity += over
            n += over
        return n

    # ----------------------------------------------------------------- state
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
        int_keys = self.config.key_dtype == "int64"
        with self._lock:
            if step < self._log_floor:
                raise ConfigurationError(
                    f"dynamic table {self.config.name!r} shard {self.shard}: evictions since step {step} are no longer "
                    f"logged (the log starts at step {self._log_floor}); export the table in full")
            keys = list(self._slot)
            sl = np.asarray([self._slot[k] for k in keys], dtype=np.int64)
            mask = self._last[sl] > step if len(sl) else np.zeros(0, dtype=bool)
            changed = [k for k, m in zip(keys, mask.tolist()) if m]
            rows = self._values[sl[mask]].copy()
            gone: dict[Any, None] = {}
            for at, k in reversed(self._evicted_log):
                if at <= step:
                    break
                if k not in self._slot:
                    gone[k] = None
        evicted = list(gone)
        if int_keys:
            return np.asarray(changed, dtype=np.int64), rows, np.asarray(evicted, dtype=np.int64)
        return changed, rows, evicted

    def stats(self) -> dict[str, int]:
        """Rows, bytes and the cumulative counters (for /metrics and ``jaxdist status``)."""
        with self._lock:
            c = self.counters
            return {
                "rows": len(self._slot), "bytes": len(self._slot) * self.config.row_bytes(),
                "pending_keys": len(self._pending), "step": self._step, "inserts": c.inserts,
                "admissions_refused": c.admissions_refused, "evictions": c.evictions_ttl + c.evictions_capacity,
                "evictions_ttl": c.evictions_ttl, "evictions_capacity": c.evictions_capacity,
                "pending_forgotten": c.pending_forgotten, "pushes": c.pushes,
            }

    def export(self) -> dict[str, Any]:
        """The shard's whole state as numpy arrays (keys in recency order, least recent first).

        String keys are exported as an object array of ``str``. Used by checkpoints, by a backup's
        initial sync and by :meth:`digest`.
        """
        with self._lock:
            keys = list(self._order)
            sl = np.asarray([self._slot[k] for k in keys], dtype=np.int64)
            out: dict[str, Any] = {
                "keys": np.asarray(keys, dtype=np.int64 if self.config.key_dtype == "int64" else object),
                "values": self._values[sl].copy(),
                "t": self._t[sl].copy(), "last": self._last[sl].copy(), "freq": self._freq[sl].copy(),
                "pending_keys": np.asarray(
                    list(self._pending), dtype=np.int64 if self.config.key_dtype == "int64" else object
                ),
                "pending_counts": np.asarray(list(self._pending.values()), dtype=np.int64),
                "step": np.int64(self._step),
                "counters": np.asarray(list(asdict(self.counters).values()), dtype=np.int64),
            }
            for s, a in self._slots.items():
                out["slot_" + s] = a[sl].copy()
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
        """
        new = cls(config, shard, num_shards)
        rows: list[tuple[int, int, int, Any, dict[str, Any]]] = []
        pend: list[tuple[Any, int]] = []
        total = np.zeros(len(asdict(new.counters)), dtype=np.int64)
        for e_i, e in enumerate(exports):
            keys = e["keys"]
            ks = validate_keys(keys.astype(np.int64) if config.key_dtype == "int64" else keys.tolist(), config.key_dtype)
            mine = shard_of(hash_keys(ks), num_shards) == shard if len(keys) else np.zeros(0, dtype=bool)
            for j in np.flatnonzero(mine):
                rows.append((int(e["last"][j]), e_i, int(j), keys[j].item() if config.key_dtype == "int64" else keys[j], e))
            pk = e["pending_keys"]
            if len(pk):
                pks = validate_keys(pk.astype(np.int64) if config.key_dtype == "int64" else pk.tolist(), config.key_dtype)
                pm = shard_of(hash_keys(pks), num_shards) == shard
                for j in np.flatnonzero(pm):
                    pend.append((pk[j].item() if config.key_dtype == "int64" else pk[j], int(e["pending_counts"][j])))
            total += e["counters"]
            new._step = max(new._step, int(e["step"]))
        rows.sort(key=lambda r: (r[0], r[1], r[2]))
        new._grow(len(rows))
        for slot, (_, _, row, key, e) in enumerate(rows):
            new._slot[key] = slot
            new._order[key] = None
            new._keys[slot] = key
            new._values[slot] = e["values"][row]
            new._t[slot] = e["t"][row]
            new._last[slot] = e["last"][row]
            new._freq[slot] = e["freq"][row]
            for s in new._slots:
                new._slots[s][slot] = e["slot_" + s][row]
        if rows:
            new._hash[: len(rows)] = hash_keys(
                np.asarray([r[3] for r in rows], dtype=np.int64) if config.key_dtype == "int64" else [r[3] for r in rows]
            )
        for k, c in pend:
            new._pending[k] = c
        new._log_floor = new._step  # evictions before the restore are not known here
        if shard == 0:
            new.counters = _Counters(*(int(x) for x in total))
        return new
