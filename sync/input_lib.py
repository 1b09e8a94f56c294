"""Distributed input: split host batches across replicas, as TF does.

Two sources, as in TF (see :meth:`Strategy.experimental_distribute_dataset`
and :meth:`Strategy.distribute_datasets_from_function` for the contracts):

- *global batches* (``experimental_distribute_dataset``): every process
  iterates the same global batches; a batch of ``n`` rows gives replica
  ``r`` rows ``[r*b, min((r+1)*b, n))`` with ``b = ceil(n / R)`` (TF's split
  for input without a static batch size, ``_LegacyRebatchDataset``: 20 rows
  over 8 replicas give ``[3, 3, 3, 3, 3, 3, 2, 0]``).
- *per-replica batches* (``distribute_datasets_from_function``): one pipeline
  per process (or per replica) yields per-replica batches; each step takes one
  per local replica.

XLA needs one static shape per compiled step, so every replica's slice is
zero-padded to the dataset's per-replica row capacity and the real row counts
travel with the batch (:attr:`PerReplica.row_counts`).

Batches are pytrees of arrays sharing their leading dimension. Splitting is
host-side numpy work; the result is placed with one transfer per leaf, and
``InputOptions.experimental_per_replica_buffer_size`` batches are kept
transferred ahead (JAX transfers are asynchronous, so the next batch moves
while the current step runs).
"""

from __future__ import annotations

import collections
import enum
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import InputContext

if TYPE_CHECKING:
    from jaxdist.sync.engine import SyncEngine
    from jaxdist.sync.strategy import Strategy

logger = logging.getLogger(__name__)

__all__ = ["DistributedDataset", "DistributedIterator", "InputOptions", "InputReplicationMode"]


class InputReplicationMode(enum.Enum):
    """How input pipelines map to replicas (``tf.distribute.InputReplicationMode``).

    ``PER_WORKER``: one pipeline per process (worker), split among its
    replicas. ``PER_REPLICA``: ``distribute_datasets_from_function`` calls
    ``dataset_fn`` once per replica.
    """

    PER_WORKER = "PER_WORKER"
    PER_REPLICA = "PER_REPLICA"


@dataclass(frozen=True)
class InputOptions:
    """Options for distributed input (``tf.distribute.InputOptions``).

    Args:
        experimental_fetch_to_device: True (the default, None): batches are
            placed on the replicas' devices by the iterator. False: they stay
            numpy arrays on the host (``PerReplica`` over numpy) and move when
            ``strategy.run`` uses them.
        experimental_replication_mode: ``PER_WORKER`` (default) or
            ``PER_REPLICA`` (``distribute_datasets_from_function`` only, as TF).
        experimental_place_dataset_on_device: with ``PER_REPLICA`` and
            ``experimental_fetch_to_device=False`` (TF's rules): ``dataset_fn``
            runs with its replica's device as JAX's default device
            (``jax.default_device``), so arrays it makes with ``jax.numpy``
            are born on that device and are used without a copy.
        experimental_per_replica_buffer_size: how many batches are kept
            transferred ahead of the one being used (default 1, as TF).
    """

    experimental_fetch_to_device: bool | None = None
    experimental_replication_mode: InputReplicationMode = InputReplicationMode.PER_WORKER
    experimental_place_dataset_on_device: bool = False
    experimental_per_replica_buffer_size: int = 1

    def __post_init__(self) -> None:
        mode = self.experimental_replication_mode
        if isinstance(mode, str):
            mode = InputReplicationMode(mode.upper())
            object.__setattr__(self, "experimental_replication_mode", mode)
        if not isinstance(mode, InputReplicationMode):
            raise ValueError(f"experimental_replication_mode must be an InputReplicationMode, got {mode!r}")
        n = self.experimental_per_replica_buffer_size
        if not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"experimental_per_replica_buffer_size must be an integer >= 0, got {n!r}")
        if self.experimental_place_dataset_on_device:
            if mode is not InputReplicationMode.PER_REPLICA:
                raise ValueError(
                    "When `experimental_place_dataset_on_device` is set, `experimental_replication_mode` must be "
                    "InputReplicationMode.PER_REPLICA (as in TF)"
                )
            if self.experimental_fetch_to_device:
                raise ValueError(
                    "`experimental_place_dataset_on_device` and `experimental_fetch_to_device` cannot both be True "
                    "(as in TF): the data is already on the device"
                )

    @property
    def fetch_to_device(self) -> bool:
        if self.experimental_fetch_to_device is None:
            return not self.experimental_place_dataset_on_device
        return bool(self.experimental_fetch_to_device)


def _check_options(options: Any) -> InputOptions:
    if options is None:
        return InputOptions()
    if not isinstance(options, InputOptions):
        raise TypeError(
            f"options must be a jaxdist.InputOptions (TF's tf.distribute.InputOptions), got {type(options).__name__}"
        )
    return options


def _flatten_batch(element: Any, what: str) -> tuple[list[Any], Any, int]:
    leaves, tree = jax.tree.flatten(element)
    if not leaves:
        raise ConfigurationError(f"{what}: a batch must hold at least one array")
    arrays = [x if isinstance(x, jax.Array) else np.asarray(x) for x in leaves]
    sizes = {a.shape[0] for a in arrays if a.ndim}
    if len(sizes) != 1 or any(a.ndim == 0 for a in arrays):
        raise ConfigurationError(
            f"{what}: every array in a batch must have the same leading (batch) dimension, got shapes "
            f"{[a.shape for a in arrays]}"
        )
    return arrays, tree, int(sizes.pop())


def _pad_rows(a: Any, rows: int) -> Any:
    if a.shape[0] == rows:
        return a
    if isinstance(a, jax.Array):
        return jnp.pad(a, [(0, rows - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
    pad = np.zeros((rows - a.shape[0], *a.shape[1:]), dtype=a.dtype)
    return np.concatenate([a, pad], axis=0)


def tf_split(n: int, r: int) -> np.ndarray:
    """Rows per replica for a batch of ``n`` rows over ``r`` replicas (TF's legacy rebatch split)."""
    b = math.ceil(n / r) if n else 0
    return np.clip(n - np.arange(r) * b, 0, b).astype(np.int32)


def _is_one_shot(source: object) -> bool:
    try:
        return iter(source) is source  # type: ignore[call-overload]
    except TypeError:
        return False


class DistributedDataset:
    """An iterable of distributed batches; every pass iterates the source again.

    Built by the strategy's ``experimental_distribute_dataset`` and
    ``distribute_datasets_from_function``; not meant to be built directly.
    """

    def __init__(
        self,
        strategy: Strategy,
        source: Iterable[Any] | Callable[[InputContext], Iterable[Any]],
        *,
        with_mask: bool = False,
        drop_remainder: bool = False,
        per_replica_fn: bool = False,
        options: Any = None,
    ) -> None:
        self._options = _check_options(options)
        if per_replica_fn and not callable(source):
            raise TypeError("distribute_datasets_from_function wants a function input_context -> iterable of batches")
        if not per_replica_fn:
            if not isinstance(source, Iterable):
                raise TypeError(f"experimental_distribute_dataset wants an iterable of batches, got {type(source).__name__}")
            if self._options.experimental_replication_mode is InputReplicationMode.PER_REPLICA:
                raise ValueError(
                    "InputReplicationMode.PER_REPLICA is only supported in distribute_datasets_from_function (as in TF)"
                )
        self._strategy = strategy
        self._source = source
        self._with_mask = with_mask
        self._drop_remainder = drop_remainder
        self._per_replica_fn = per_replica_fn
        self._one_shot = not per_replica_fn and _is_one_shot(source)
        self._passes = 0

    def __iter__(self) -> DistributedIterator:
        self._passes += 1
        if self._one_shot and self._passes > 1:
            raise ConfigurationError(
                "experimental_distribute_dataset was given a one-shot iterator (e.g. a generator), which was used "
                "up by the previous pass: a second epoch would get no data. Pass a re-iterable (a list, or an object "
                "whose __iter__ starts a new pass), or use "
                "strategy.distribute_datasets_from_function(lambda ctx: make_generator()), which calls the "
                "function again for every pass"
            )
        it: DistributedIterator
        if self._per_replica_fn:
            it = _PerReplicaIterator(self._strategy, self._source, self._options, with_mask=self._with_mask)  # type: ignore[arg-type]
        else:
            it = _GlobalIterator(
                self._strategy,
                iter(self._source),  # type: ignore[arg-type]
                self._options,
                with_mask=self._with_mask,
                drop_remainder=self._drop_remainder,
            )
        return _Prefetch(it, self._options.experimental_per_replica_buffer_size)


class DistributedIterator:
    """Iterator over distributed batches (``next(it)`` or ``it.get_next()``)."""

    def __iter__(self) -> DistributedIterator:
        return self

    def __next__(self) -> Any:
        raise NotImplementedError

    def get_next(self) -> Any:
        """The next distributed batch; raises StopIteration at the end, as ``next``."""
        return next(self)


class _Prefetch(DistributedIterator):
    """Keeps ``depth`` batches produced (and their device transfers started) ahead of the consumer."""

    def __init__(self, it: DistributedIterator, depth: int) -> None:
        self._it = it
        self._depth = depth
        self._buf: collections.deque[Any] = collections.deque()
        self._done = False

    def _fill(self, n: int) -> None:
        while not self._done and len(self._buf) < n:
            try:
                self._buf.append(next(self._it))
            except StopIteration:
                self._done = True

    def __next__(self) -> Any:
        self._fill(1)
        if not self._buf:
            raise StopIteration
        out = self._buf.popleft()
        self._fill(self._depth)
        return out


class _GlobalIterator(DistributedIterator):
    def __init__(
        self, strategy: Strategy, it: Iterator[Any], options: InputOptions, *, with_mask: bool, drop_remainder: bool
    ) -> None:
        self._it = it
        self._with_mask = with_mask
        self._drop = drop_remainder
        self._nominal: int | None = None
        self._r = strategy.num_replicas_in_sync
        self._engine = strategy.engine
        self._local = self._engine.local_replica_ids()
        self._to_device = options.fetch_to_device

    def __next__(self) -> Any:
        what = "experimental_distribute_dataset"
        while True:
            arrays, tree, n = _flatten_batch(next(self._it), what)
            arrays = [np.asarray(a) for a in arrays]
            if self._nominal is None:
                self._nominal = n
            if n > self._nominal:
                raise ConfigurationError(
                    f"{what}: a batch of {n} rows follows batches of {self._nominal}; batch sizes must not grow"
                )
            if n < self._nominal and self._drop:
                logger.debug("%s: dropping a short batch of %d rows (drop_remainder=True)", what, n)
                continue
            break
        r = self._r
        cap = math.ceil(self._nominal / r)
        rows = tf_split(n, r)
        b = math.ceil(n / r) if n else 0
        starts = np.arange(r) * b
        out = [self._split(a, starts, rows, cap) for a in arrays]
        mask = (np.arange(cap)[None, :] < rows[:, None]).astype(np.float32)
        batch = jax.tree.unflatten(tree, [self._wrap(x, rows) for x in out])
        if not self._with_mask:
            return batch
        return batch, self._wrap(mask, None)

    def _split(self, a: np.ndarray, starts: np.ndarray, rows: np.ndarray, cap: int) -> np.ndarray:
        out = np.zeros((self._r, cap, *a.shape[1:]), dtype=a.dtype)
        for k in range(self._r):
            if rows[k]:
                out[k, : rows[k]] = a[starts[k] : starts[k] + rows[k]]
        return out

    def _wrap(self, stacked: np.ndarray, rows: np.ndarray | None) -> Any:
        local = stacked[self._local] if len(self._local) != self._r else stacked
        if self._to_device:
            return self._engine.distribute_local(local, rows, guard=not self._with_mask)
        return _host_value(self._engine, stacked, rows, guard=not self._with_mask)


def _host_value(engine: SyncEngine, stacked: np.ndarray, rows: np.ndarray | None, guard: bool) -> Any:
    """``experimental_fetch_to_device=False``: a PerReplica over host numpy (placed when run uses it)."""
    from jaxdist.sync.values import PerReplica

    if engine.yields_plain_arrays:
        x = stacked[0]
        return x if rows is None else x[: int(rows[0])]
    if rows is None:
        return PerReplica(stacked)
    return PerReplica(stacked, rows.astype(np.int32), host_row_counts=rows.astype(np.int32), guard=guard)


class _PerReplicaIterator(DistributedIterator):
    def __init__(self, strategy: Strategy, dataset_fn: Callable[[InputContext], Iterable[Any]], options: InputOptions, *, with_mask: bool) -> None:
        self._engine = strategy.engine
        self._with_mask = with_mask
        self._options = options
        self._local = self._engine.local_replica_ids()
        self._n_local = len(self._local)
        self._r = strategy.num_replicas_in_sync
        self._nominal: int | None = None
        self._tree: Any = None
        self._templates: list[np.ndarray] | None = None
        self._per_replica_mode = options.experimental_replication_mode is InputReplicationMode.PER_REPLICA
        self._on_device = options.experimental_place_dataset_on_device
        self._devices = self._engine.replica_devices()
        # Only strategies with replica devices (Mirrored, TPU, ...) have one.
        self._per_replica_sharding = self._engine.per_replica_sharding
        if self._on_device and self._per_replica_sharding is None:
            raise ConfigurationError(
                "experimental_place_dataset_on_device needs a strategy with replica devices (Mirrored, TPU, ...)"
            )
        self._its: list[Iterator[Any] | None]
        if self._per_replica_mode:
            its: list[Iterator[Any] | None] = []
            for i, rid in enumerate(self._local):
                ctx = InputContext(self._r, rid, self._r)
                with self._device_ctx(i):
                    its.append(iter(dataset_fn(ctx)))
            self._its = its
        else:
            self._its = [iter(dataset_fn(self._engine.input_context()))]

    def _device_ctx(self, i: int) -> Any:
        if self._on_device:
            return jax.default_device(self._devices[i])
        import contextlib

        return contextlib.nullcontext()

    def _next_of(self, k: int, i: int) -> Any:
        it = self._its[k]
        if it is None:
            return None
        try:
            with self._device_ctx(i):
                return next(it)
        except StopIteration:
            self._its[k] = None
            return None

    def _take(self) -> list[tuple[list[Any], int] | None]:
        got: list[tuple[list[Any], int] | None] = []
        for i in range(self._n_local):
            element = self._next_of(i if self._per_replica_mode else 0, i)
            if element is None:
                got.append(None)
                continue
            arrays, tree, n = _flatten_batch(element, "distribute_datasets_from_function")
            if not self._on_device:
                arrays = [np.asarray(a) for a in arrays]
            if self._tree is None:
                self._tree, self._nominal = tree, n
                self._templates = [np.zeros((0, *a.shape[1:]), a.dtype) for a in arrays]
            elif tree != self._tree:
                raise ConfigurationError(
                    f"distribute_datasets_from_function: batch structure changed from {self._tree} to {tree}"
                )
            got.append((arrays, n))
        return got

    def __next__(self) -> Any:
        got = self._take()
        counts = np.array([g[1] if g is not None else 0 for g in got], np.int32)
        k = sum(g is not None for g in got)
        nominal = self._nominal or 0
        if self._engine.multi_process:
            # Pipelines differ between processes: agree on whether this step runs and on its row capacity.
            from jax.experimental import multihost_utils

            stats = np.asarray(multihost_utils.process_allgather(np.array([k, nominal], np.int64))).reshape(-1, 2)
            if int(stats[:, 0].max()) == 0:
                raise StopIteration
            nominal = int(stats[:, 1].max())
            all_counts = np.asarray(multihost_utils.process_allgather(counts)).reshape(-1)
        else:
            if k == 0:
                raise StopIteration
            all_counts = counts
        if self._templates is None:
            raise ConfigurationError(
                "distribute_datasets_from_function: this process's pipeline is empty while others yield batches"
            )
        if int(counts.max(initial=0)) > nominal:
            raise ConfigurationError(
                f"distribute_datasets_from_function: a batch of {int(counts.max())} rows exceeds the per-replica "
                f"batch size {nominal} fixed by the first batch"
            )
        # Global row counts in replica order (processes own contiguous replica ranges, in process order).
        if len(all_counts) == self._r:
            rows = all_counts.astype(np.int32)
        else:
            rows = np.zeros((self._r,), np.int32)
            rows[self._local] = counts
        per_leaf: list[list[Any]] = [[] for _ in self._templates]
        for i in range(self._n_local):
            g = got[i]
            arrays = g[0] if g is not None else self._templates
            for j, a in enumerate(arrays):
                if self._on_device and not isinstance(a, jax.Array):
                    a = jax.device_put(a, self._devices[i])
                per_leaf[j].append(_pad_rows(a, nominal))
        mask = (np.arange(nominal)[None, :] < rows[:, None]).astype(np.float32)
        guard = not self._with_mask
        if self._on_device:
            out = [self._assemble_on_device(col) for col in per_leaf]
            batch = jax.tree.unflatten(self._tree, [self._engine.distribute_local(x, rows, guard) for x in out])
        elif self._options.fetch_to_device:
            batch = jax.tree.unflatten(
                self._tree, [self._engine.distribute_local(np.stack(col), rows, guard) for col in per_leaf]
            )
        else:
            full = [self._full(np.stack(col)) for col in per_leaf]
            batch = jax.tree.unflatten(self._tree, [_host_value(self._engine, x, rows, guard) for x in full])
        if not self._with_mask:
            return batch
        if self._options.fetch_to_device or self._on_device:
            return batch, self._engine.distribute_local(mask[self._local])
        return batch, _host_value(self._engine, mask, None, False)

    def _full(self, local_stacked: np.ndarray) -> np.ndarray:
        if self._n_local == self._r:
            return local_stacked
        full = np.zeros((self._r, *local_stacked.shape[1:]), local_stacked.dtype)
        full[self._local] = local_stacked
        return full

    def _assemble_on_device(self, col: list[Any]) -> Any:
        """Per-replica arrays already on their devices -> one global (R, ...) array, no copy."""
        shape = (self._r, *col[0].shape)
        # Arrays made under jax.default_device are uncommitted: commit them where they are (no copy)
        # before reshaping, or the reshape would run on JAX's global default device.
        parts = [jnp.expand_dims(jax.device_put(c, d), 0) for c, d in zip(col, self._devices)]
        assert self._per_replica_sharding is not None  # checked in __init__ for on-device input
        return jax.make_array_from_single_device_arrays(shape, self._per_replica_sharding, parts)
