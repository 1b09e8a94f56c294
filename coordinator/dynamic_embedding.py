"""DynamicEmbedding: a hash-keyed embedding table on the parameter servers, for custom loops.

A :class:`DynamicEmbedding` has no vocabulary fixed in advance: its keys are int64 ids or strings,
and it grows as training pushes gradients for new keys, bounded by admission and eviction. It is
spread over every PS task of the strategy that creates it: a key lives on the shard
``shard_of(hash(key), num_ps)`` (a stable hash, independent of the table's seed). Each shard is a
:class:`~jaxdist.ps_server.dynamic_table.DynamicTableShard`; this module's handle only routes keys
and moves rows (see docs/dynamic-embeddings.md for the rules a shard applies).

Like a :class:`~jaxdist.variables.Variable`, the handle pickles as its description (name, config,
number of shards): inside a closure on a worker it uses the worker's connections, and a push carries
the closure's identity (one per push to the table, counted per table), so a re-run closure's pushes
are applied exactly once.
"""

from __future__ import annotations

import functools
import logging
from operator import methodcaller
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxdist.base.errors import ConfigurationError, DTypeMismatchError, InvalidRequestError
from jaxdist.ps_server.connections import PSConnections
from jaxdist.ps_server.dynamic_table import (
    AdmissionConfig,
    DynamicTableConfig,
    EvictionConfig,
    ReducedPush,
    RowOptimizer,
    first_occurrences,
    hash_keys,
    reduce_push,
    shard_of,
    sum_rows,
    validate_counts,
    validate_keys,
)
from jaxdist.ps_server.dynamic_tables import STAT_NAMES, dynamic_push_digest
from jaxdist.strategy import get_ps_strategy
from jaxdist.variables import refuse_in_compiled_code
from jaxdist.worker.context import current_ps, next_update_id

__all__ = ["DynamicEmbedding"]

logger = logging.getLogger(__name__)


class DynamicEmbedding:
    """A dynamic (hash-keyed) embedding table sharded over the strategy's PS tasks.

    Create it inside ``ParameterServerStrategy.scope()``; read rows with :meth:`lookup` and push
    gradient rows with :meth:`apply_gradients`, on the coordinator or inside closures on workers.

    Args:
        dim: the row shape (an int for vectors, or a tuple).
        name: the table's name (unique among the strategy's dynamic tables).
        key_dtype: ``"int64"`` or ``"string"``.
        dtype: the rows' float dtype.
        initializer: ``"normal"``, ``"uniform"`` or ``"zeros"``; a new row is a pure function of
            ``(seed, key)`` (scaled by ``init_scale``).
        default_value: what a key not (yet) admitted reads (every element).
        optimizer: the per-row rule: ``"sgd"``, ``"adagrad"`` or ``"lazy_adam"``.
        learning_rate: the rule's learning rate.
        optimizer_options: other :class:`~jaxdist.ps_server.dynamic_table.RowOptimizer` fields
            (``b1``, ``b2``, ``eps``, ``initial_accumulator``).
        min_count: a key gets a row at the push that brings its occurrences to ``min_count``.
        admit_probability: a key is admitted iff a uniform number derived from its hash is below it.
        max_pending: keys waiting for admission held per shard (the oldest are forgotten).
        capacity: rows kept per shard (evicting by ``eviction_policy``, ``"lru"`` or ``"lfu"``).
        ttl_steps: a row not pushed for more than this many pushes to its shard is evicted.
        max_bytes_per_shard: bound on one shard's rows and optimizer state; a push that would pass
            it is refused (:class:`~jaxdist.errors.PayloadTooLargeError`) and changes nothing.

    Creating it is idempotent on every PS task (not a transaction across them): a PS that refuses
    or cannot be reached makes the constructor raise that PS's error (with a note naming the PS
    tasks that hold their shard); those shards stay, empty, and the same constructor again completes
    the table, keeping them as they are.

    Raises:
        ConfigurationError: no ParameterServerStrategy scope is open, or an invalid setting.
        VariableExistsError: a PS holds a table of that name with another config or placement.
    """

    def __init__(
        self,
        dim: int | Sequence[int],
        *,
        name: str = "dynamic_embedding",
        key_dtype: str = "int64",
        dtype: str = "float32",
        initializer: str = "normal",
        init_scale: float = 0.05,
        seed: int = 0,
        default_value: float = 0.0,
        optimizer: str = "sgd",
        learning_rate: float = 0.01,
        optimizer_options: dict[str, float] | None = None,
        min_count: int = 1,
        admit_probability: float = 1.0,
        max_pending: int = 1 << 20,
        capacity: int | None = None,
        eviction_policy: str = "lru",
        ttl_steps: int | None = None,
        max_bytes_per_shard: int = 8 << 30,
    ) -> None:
        strategy = get_ps_strategy()
        row_shape = (int(dim),) if isinstance(dim, (int, np.integer)) else tuple(int(d) for d in dim)
        self.config = DynamicTableConfig(
            name=name, row_shape=row_shape, dtype=str(np.dtype(dtype)), key_dtype=key_dtype, seed=seed,
            initializer=initializer, init_scale=init_scale, default_value=default_value,
            optimizer=RowOptimizer(optimizer, learning_rate, **(optimizer_options or {})),
            admission=AdmissionConfig(min_count, admit_probability, max_pending),
            eviction=EvictionConfig(capacity, eviction_policy, ttl_steps),
            max_bytes=max_bytes_per_shard,
        )
        self.num_shards = strategy.num_ps
        self._conns: PSConnections | None = strategy.connections
        self._create_shards()
        strategy.dynamic_tables[name] = self
        logger.info("dynamic table %r created on %d PS tasks", name, self.num_shards)

    def _create_shards(self) -> None:
        """Create the table's shard on every PS task (in parallel).

        Not a transaction across PS tasks: creation is *idempotent* instead. A PS keeps a shard that
        exists with the same config and placement as it is (rows and all), so when one PS refuses or
        cannot be reached, the shards the others created stay, empty and unregistered (the handle
        is not made), and the same ``DynamicEmbedding(...)`` again completes the table. The error
        raised is the first PS's, with a note naming which PS tasks hold their shard.
        """
        cfg = self.config

        def create(i: int, client: Any) -> tuple[bool, BaseException | None]:
            try:
                return client.create_dynamic_table(cfg, i, self.num_shards), None
            except Exception as e:  # collected: every PS's outcome is known before raising
                return False, e

        assert self._conns is not None
        outcomes = self._conns.fan_out({i: functools.partial(create, i) for i in range(self.num_shards)})
        failed = {i: e for i, (_, e) in sorted(outcomes.items()) if e is not None}
        if failed:
            held = [i for i in sorted(outcomes) if i not in failed]
            first = next(iter(failed.values()))
            first.add_note(
                f"dynamic table {cfg.name!r} was not created on ps:{', ps:'.join(map(str, failed))}; "
                + (f"ps:{', ps:'.join(map(str, held))} hold their (empty) shard, kept: " if held else "")
                + "creating a table is idempotent, the same DynamicEmbedding(...) again completes it")
            logger.warning("dynamic table %r: creation failed on ps:%s (%s)", cfg.name, sorted(failed), first)
            raise first
        logger.debug("dynamic table %r: shards created on %s (others existed identically)", cfg.name,
                     [i for i, (created, _) in sorted(outcomes.items()) if created])

    # ------------------------------------------------------------ identity
    @property
    def name(self) -> str:
        return self.config.name

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.config.row_shape

    def __repr__(self) -> str:
        return (f"<jaxdist.DynamicEmbedding {self.name!r} rows={self.row_shape} keys={self.config.key_dtype} "
                f"shards={self.num_shards}>")

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.config.to_json(), self.num_shards)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        cfg, self.num_shards = state
        self.config = DynamicTableConfig.from_json(cfg)
        self._conns = None  # on a worker: the worker's connections

    def connections(self) -> PSConnections:
        return self._conns if self._conns is not None else current_ps()

    # ------------------------------------------------------------- routing
    def _flat_keys(self, keys: Any) -> tuple[np.ndarray | list[str], tuple[int, ...]]:
        """``(the keys flattened, checked against the table's key type, the keys' shape)``."""
        if self.config.key_dtype == "int64":
            arr = np.asarray(keys)
            flat = validate_keys(arr.reshape(-1), "int64")
            return flat, arr.shape
        if isinstance(keys, str):
            raise ConfigurationError("string keys come as a list (or array) of str, not one str")
        arr = np.asarray(keys, dtype=object)
        return validate_keys(arr.reshape(-1).tolist(), "string"), arr.shape

    def _route(self, keys: Any) -> tuple[np.ndarray | list[str], tuple[int, ...], np.ndarray, np.ndarray]:
        """``(flat keys, keys' shape, distinct-key index of each key, shard of each distinct key)``
        with the distinct keys in first-occurrence order (checked against the table's key type)."""
        flat, shape = self._flat_keys(keys)
        if isinstance(flat, np.ndarray):
            distinct: np.ndarray | list[str]
            distinct, _, inv = first_occurrences(flat)
        else:
            at: dict[str, int] = {}
            inv = np.fromiter((at.setdefault(k, len(at)) for k in flat), dtype=np.int64, count=len(flat))
            distinct = list(at)
        shards = shard_of(hash_keys(distinct), self.num_shards)
        return distinct, shape, inv, shards

    @staticmethod
    def _pick(distinct: np.ndarray | list[str], idx: np.ndarray) -> np.ndarray | list[str]:
        if isinstance(distinct, np.ndarray):
            return distinct[idx]
        return [distinct[int(i)] for i in idx]

    # ----------------------------------------------------------- reading
    def lookup(self, keys: Any) -> np.ndarray:
        """Rows of ``keys`` (any shape): an array of shape ``keys.shape + row_shape``.

        A pure read: a key with a row reads it, an admitted key without one reads its initializer
        row, a key not admitted reads the default vector. Each distinct key travels once, to its shard.
        """
        refuse_in_compiled_code("read", [self.name])
        distinct, shape, inv, shards = self._route(keys)
        cfg = self.config
        rows = np.empty((len(distinct), *cfg.row_shape), dtype=cfg.dtype)
        where = {int(s): np.flatnonzero(shards == s) for s in np.unique(shards)}
        if where:
            got = self.connections().fan_out(
                {s: methodcaller("dynamic_lookup", self.name, self._pick(distinct, idx)) for s, idx in where.items()})
            for s, idx in where.items():
                rows[idx] = got[s][0]
        return rows[inv].reshape(shape + cfg.row_shape)

    # ----------------------------------------------------------- writing
    def apply_gradients(self, keys: Any, grads: Any, counts: Any = None) -> dict[str, int]:
        """Push gradient rows of ``keys`` (``grads`` shaped ``keys.shape + row_shape``); each shard
        applies its rows with the table's per-row rule, at most once (the push's identity).

        Duplicate keys are summed here, before sending (in occurrence order from +0.0, in float32,
        exactly as a shard sums them), and each distinct key travels once to its shard with its
        summed row and its occurrence count (a *counted* push): each occurrence counts for admission
        and LFU frequency as if every row had travelled. ``counts`` (shaped like ``keys``): the push
        is counted already: ``keys`` distinct, ``grads`` their summed rows, ``counts`` their
        occurrences (each >= 1), as a caller that deduplicated the batch itself has them (the Keras
        layer). Everything is checked before any shard is sent anything.

        Returns the push's counts over every shard: ``applied`` (rows), ``refused`` (gradient rows,
        i.e. occurrences, dropped by admission), ``inserted``, ``evicted`` (all zero for a push a PS
        had already applied: a re-run closure's).

        Raises:
            ConfigurationError: ``grads`` or ``counts`` not shaped like ``keys``.
            InvalidRequestError: (with ``counts``) a count below 1, too many in all, or a key given
                twice; a gradient row or sum that is not finite.
            DTypeMismatchError: keys of the wrong type, gradient rows not floating point.
        """
        refuse_in_compiled_code("updated", [self.name])
        flat_keys, shape = self._flat_keys(keys)
        cfg = self.config
        g = np.asarray(grads)
        if g.shape != shape + cfg.row_shape:
            raise ConfigurationError(
                f"gradient rows of shape {g.shape} for keys of shape {shape} and rows {cfg.row_shape} of {self.name!r}")
        flat = g.reshape((-1, *cfg.row_shape))
        if counts is None:
            pushed = reduce_push(flat_keys, flat)
        else:
            pushed = self._counted(flat_keys, flat, counts, shape)
        if not np.isfinite(pushed.grads).all():
            raise InvalidRequestError(f"gradient rows for {self.name!r} contain NaN or infinity, or sum past float32's range")
        shards = shard_of(pushed.hashes, self.num_shards)
        conns = self.connections()
        update_id = next_update_id(own_connections=self._conns is not None, signature=dynamic_push_digest(self.name))
        calls = {}
        for s in np.unique(shards):
            at = np.flatnonzero(shards == s)
            calls[int(s)] = methodcaller("dynamic_push", self.name, self._pick(pushed.keys, at),
                                         pushed.grads[at], update_id, counts=pushed.counts[at])
        out = {"applied": 0, "refused": 0, "inserted": 0, "evicted": 0}
        for resp in conns.fan_out(calls).values():
            for k in out:
                out[k] += int(getattr(resp, k))
        return out

    @staticmethod
    def _counted(keys: np.ndarray | list[str], grads: np.ndarray, counts: Any, shape: tuple[int, ...]) -> ReducedPush:
        """A push given counted (each key once, its summed row, its count), checked, as a :class:`ReducedPush`.
        Two string keys of one 64-bit hash (one row to a shard) are merged as a shard would merge them."""
        c = np.asarray(counts)
        if c.shape != shape:
            raise ConfigurationError(f"push counts of shape {c.shape} for keys of shape {shape}: one count per key")
        occ = validate_counts(c.reshape(-1), len(keys))
        if grads.dtype.kind != "f":
            raise DTypeMismatchError(f"gradient rows must be floating point, got {grads.dtype}")
        hashes = hash_keys(keys)
        with np.errstate(over="ignore"):  # a row past float32's range: infinite, refused by the caller
            rows = grads.astype(np.float32, copy=False)
        if isinstance(keys, np.ndarray):
            ordered = np.sort(keys)
            if (ordered[1:] == ordered[:-1]).any():
                raise InvalidRequestError("a key is given twice in a push with counts (each key once, its rows summed)")
            return ReducedPush(keys, rows, occ, hashes)
        if len(set(keys)) != len(keys):
            raise InvalidRequestError("a key is given twice in a push with counts (each key once, its rows summed)")
        ident = hashes.view(np.int64)
        if np.unique(ident).shape[0] == ident.shape[0]:
            return ReducedPush(keys, rows, occ, hashes)
        _, first, inv = first_occurrences(ident)
        merged = np.zeros(first.shape[0], dtype=np.int64)
        np.add.at(merged, inv, occ)
        return ReducedPush([keys[int(j)] for j in first], sum_rows(grads, inv, int(first.shape[0])), merged,
                           hashes[first])

    # ------------------------------------------------------------- status
    def stats(self) -> dict[str, int]:
        """The table's counters summed over its shards: rows, bytes, inserts, admissions refused,
        evictions, pushes (applied, per shard) and keys pending admission."""
        conns = self.connections()
        statuses = conns.fan_out({i: methodcaller("status") for i in range(self.num_shards)})
        prefix = f"dynamic/{self.name}/"
        return {k: int(sum(st.counters.get(prefix + k, 0.0) for st in statuses.values())) for k in STAT_NAMES}
