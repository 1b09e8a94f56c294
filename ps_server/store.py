"""VariableStore: the parameter server's state, free of gRPC (tested without sockets).

Contract:

- Every variable has a version, 1 at creation, +1 per applied update.
- Updates to one variable are serialised by its lock: concurrent pushes from
  many workers never lose an update.
- A push (:meth:`VariableStore.apply`) naming several variables is atomic: it
  takes their locks in name order, so a reader holding all locks (a
  checkpoint) never sees half of it.
- A push with an ``update_id`` is applied at most once per store: a re-sent or
  re-executed push with the same id is acknowledged as a duplicate and does
  nothing. The store remembers the last ``dedupe_capacity`` ids, each with
  the digest of the variables and ops it named (:func:`push_digest`): a
  push that repeats an id with other variables or ops (two different pushes
  given one identity) is refused with :class:`UpdateMismatchError`, never
  dropped silently. Closure identities include that digest (see
  :class:`jaxdist.worker.context.ClosureIdentity`), so a re-run closure that
  takes another path never meets this refusal.
- Values handed out by :meth:`read` are snapshots: later updates never change
  an array a reader already holds (dense updates build new arrays; in-place
  row updates copy first while a reader holds the array).
- Exact row pushes into a variable whose rule takes the three-step path
  (:meth:`Optimizer.batches_rows`) are deferred: acknowledged, counted in the
  version, recorded and replicated at the push, applied up to
  ``MAX_PUSHES_PER_PASS`` at a time in one pass over the variable. A row read
  computes their effect on its rows; a whole read, a snapshot, an export cut
  or any other change of the variable applies them first. Every read sees
  the pushes applied one after the other, bit for bit.
- Every change is tracked for incremental exports (:attr:`VariableStore.changes`,
  :mod:`jaxdist.ps_server.export_rows`): a push marks the rows it changes (or the
  whole variable) under the variable's lock, while it applies them;
  :meth:`VariableStore.export_cut` takes the marks under every lock.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import jax
import numpy as np

from jaxdist.base.errors import (
    DTypeMismatchError,
    InvalidRequestError,
    PayloadTooLargeError,
    ShapeMismatchError,
    UpdateMismatchError,
    VariableExistsError,
    VariableNotFoundError,
)
from jaxdist.proto.ps_wire import SPARSE_OPS, IfExists, Op, Update, transfer_dtype
from jaxdist.ps_server.export_rows import ALL, ChangeTracker, CutParticipant, CutResult, RowChanges, bitmap_ids
from jaxdist.ps_server.optimizer import MAX_PUSHES_PER_PASS, Optimizer

__all__ = [
    "DEFAULT_MAX_VARIABLE_BYTES", "ExportPart", "IfExists", "NewVariable", "Op", "ReadResult", "Update", "VariableInfo",
    "VariableStore", "push_digest",
]

_T = TypeVar("_T")

#: Default limit on one variable (shard); bigger ones get RESOURCE_EXHAUSTED.
DEFAULT_MAX_VARIABLE_BYTES = 8 << 30


#: Hex characters of a push digest; an entry of :meth:`VariableStore.applied_ids` is ``<digest>:<update id>``.
_DIGEST_CHARS = 16


def push_digest(updates: Sequence[Update]) -> str:
    """What a push touches, as a short digest: its (variable name, op) pairs, in any order.

    Values and row indices are left out on purpose: a re-run closure computes
    on fresh parameters, so its update differs in value but not in what it names.
    """
    h = hashlib.blake2b(digest_size=_DIGEST_CHARS // 2)
    for name, op in sorted((u.name, u.op.value) for u in updates):
        h.update(f"{len(name)}:{name}:{op};".encode())
    return h.hexdigest()


def _split_applied(entry: str) -> tuple[str, str]:
    """``(update id, digest)`` of an :meth:`VariableStore.applied_ids` entry ("" digest: unknown)."""
    if len(entry) > _DIGEST_CHARS and entry[_DIGEST_CHARS] == ":":
        return entry[_DIGEST_CHARS + 1:], entry[:_DIGEST_CHARS]
    return entry, ""


_SCATTER_UFUNC: dict[Op, Callable[..., Any]] = {
    Op.SCATTER_ADD: np.add.at,
    Op.SCATTER_SUB: np.subtract.at,
    Op.SCATTER_MIN: np.minimum.at,
    Op.SCATTER_MAX: np.maximum.at,
}


@dataclass
class VariableInfo:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    version: int
    has_optimizer: bool


#: Placeholder for a value handed to a donating optimizer step (never read: the step replaces it).
_NO_VALUE = np.empty(0)

_cast = jax.jit(lambda x, dtype: x.astype(dtype), static_argnums=1)


@dataclass
class _Variable:
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    value: np.ndarray
    optimizer: Optimizer | None = None
    opt_state: Any = None
    version: int = 1
    readers: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    #: The XLA array ``value`` is a read-only view of, after an optimizer step: the
    #: next step starts from it without copying the value into XLA again. None
    #: after any other write.
    device_value: Any = None
    #: ``(version, dtype, array)``: the value cast to a narrower float for narrow pulls
    #: (mixed precision), made once per version and shared by every worker pulling it.
    narrow: tuple[int, np.dtype, np.ndarray] | None = None
    #: The rows changed per export segment (set when the variable enters a store).
    changes: RowChanges | None = None
    #: Exact row pushes ``(indices, rows)`` acknowledged (versions counted) but not yet in ``value`` and
    #: ``opt_state``: applied in order, several per pass, by VariableStore._flush before anything reads
    #: the whole variable or changes it otherwise; row reads compute the rows they would give.
    pending: list[tuple[np.ndarray, np.ndarray]] = field(default_factory=list)

    def narrow_value(self, dtype: np.dtype) -> np.ndarray:
        """The value in ``dtype`` (call with the lock held); a new array per version, never written."""
        cached = self.narrow
        if cached is not None and cached[0] == self.version and cached[1] == dtype:
            return cached[2]
        if self.device_value is not None:  # after an optimizer step: one XLA pass, no copy in
            arr = np.asarray(_cast(self.device_value, dtype))
        else:
            arr = self.value.astype(dtype)
        self.narrow = (self.version, dtype, arr)
        return arr

    def writable_value(self) -> np.ndarray:
        """The value, made safe to modify in place (copied if shared or read-only)."""
        self.device_value = None
        if self.readers or not self.value.flags.writeable:
            self.value = np.array(self.value)
            self.readers = 0
        return self.value


@dataclass
class NewVariable:
    """A variable to create (:meth:`VariableStore.create_many`): from ``value``, or from
    ``initializer(shape, dtype, offset)``; ``if_exists`` when the name is taken."""

    name: str
    value: np.ndarray | None = None
    shape: Sequence[int] | None = None
    dtype: Any = None
    initializer: Callable[..., Any] | None = None
    offset: tuple[int, ...] = ()
    optimizer: Optimizer | None = None
    if_exists: IfExists = IfExists.FAIL


@dataclass
class ExportPart:
    """One variable as an export cut gives it (:meth:`VariableStore.export_cut`): ``value`` (the
    whole variable, a read snapshot) or ``ids`` (changed local rows, int64 ascending) and ``rows``
    (their values, copies)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    version: int
    value: np.ndarray | None = None
    ids: np.ndarray | None = None
    rows: np.ndarray | None = None


@dataclass
class ReadResult:
    value: np.ndarray | None  # None when not modified
    version: int
    shape: tuple[int, ...]
    dtype: np.dtype


class VariableStore:
    """Variables (or shards) with versions and optimizer state. Thread-safe."""

    def __init__(self, max_variable_bytes: int = DEFAULT_MAX_VARIABLE_BYTES, dedupe_capacity: int = 1 << 20) -> None:
        self.max_variable_bytes = max_variable_bytes
        self._vars: dict[str, _Variable] = {}
        self._lock = threading.Lock()  # guards _vars membership and the dedupe tables
        self._applied: OrderedDict[str, str] = OrderedDict()  # update id -> push_digest of what it named
        self._in_progress: dict[str, threading.Event] = {}
        #: Exact row pushes (per variable: a push into two tables counts two) applied in a pass over their
        #: table shared with other pushes (deferred; a counter for tests and metrics).
        self.shared_pass_pushes = 0
        self._dedupe_capacity = dedupe_capacity
        self.updates_applied = 0
        self.duplicates_dropped = 0
        #: Called with ``(updates, update_id)`` after a push is applied, while its
        #: variables' locks are still held (so pushes to one variable reach it in
        #: the order they were applied here). Replication forwards the push to the
        #: backup from here; if it raises, the push is not acknowledged.
        self.replicate: Callable[[Sequence[Update], str], None] | None = None
        #: Export cuts and the changes between them (:mod:`jaxdist.ps_server.export_rows`).
        self.changes = ChangeTracker()

    # ------------------------------------------------------------------ create
    def create(
        self,
        name: str,
        *,
        value: np.ndarray | None = None,
        shape: Sequence[int] | None = None,
        dtype: Any = None,
        initializer: Callable[..., Any] | None = None,
        offset: Sequence[int] = (),
        optimizer: Optimizer | None = None,
        if_exists: IfExists = IfExists.FAIL,
    ) -> int:
        """Create a variable from ``value`` or from ``initializer(shape, dtype, offset)``.

        Returns the variable's version. ``if_exists`` decides what happens when
        the name is taken: FAIL raises VariableExistsError, KEEP returns the
        existing version untouched, REPLACE overwrites value and optimizer state.
        """
        return self.create_many([NewVariable(name, value, shape, dtype, initializer, tuple(offset), optimizer, if_exists)])[0]

    def create_many(self, news: Sequence[NewVariable]) -> list[int]:
        """Create several variables, all or none (see :meth:`create`); their versions, in order.

        Every entry is checked and built (initializers run, optimizer states made)
        before any is inserted, so a batch with one bad entry changes nothing.

        Raises:
            InvalidRequestError: an empty name, a name twice, no value and no initializer,
                or an initializer that raised.
            VariableExistsError: a name is taken and its ``if_exists`` is FAIL.
            ShapeMismatchError, PayloadTooLargeError: a value of the wrong shape, or too large.
        """
        names = [n.name for n in news]
        if not all(names):
            raise InvalidRequestError("variable name must not be empty")
        if len(set(names)) != len(names):
            raise InvalidRequestError("a variable is created twice in one batch")
        while True:
            with self._lock:
                kept = {n.name for n in news if n.if_exists is IfExists.KEEP and n.name in self._vars}
                self._refuse_taken(news)
            built = {n.name: self._build(n) for n in news if n.name not in kept}
            with self._lock:
                self._refuse_taken(news)  # again: a concurrent create may have taken a name meanwhile
                if any(n not in self._vars for n in kept):
                    continue  # a kept variable was deleted meanwhile: build it after all
                versions = []
                for n in news:
                    if n.name in kept:
                        versions.append(self._vars[n.name].version)
                    else:
                        self._vars[n.name] = self._tracked(built[n.name])
                        versions.append(built[n.name].version)
                return versions

    def _tracked(self, var: _Variable) -> _Variable:
        """``var`` with its change record (wholly changed: it is new to every earlier export cut)."""
        var.changes = self.changes.new_rows(var.shape[0] if var.shape else 0)
        return var

    def _refuse_taken(self, news: Sequence[NewVariable]) -> None:
        """(With ``_lock`` held.) VariableExistsError for the first FAIL entry whose name is taken."""
        for n in news:
            if n.if_exists is IfExists.FAIL and n.name in self._vars:
                raise VariableExistsError(f"variable {n.name!r} already exists")

    def _build(self, n: NewVariable) -> _Variable:
        """The variable ``n`` describes, checked and initialised (not inserted)."""
        value = n.value
        if value is None:
            if n.initializer is None or n.shape is None or n.dtype is None:
                raise InvalidRequestError(f"variable {n.name!r}: give a value, or an initializer with shape and dtype")
            shape = tuple(int(d) for d in n.shape)
            dt = np.dtype(n.dtype)
            self._check_size(n.name, shape, dt)
            try:
                value = n.initializer(shape, dt, tuple(n.offset))
            except Exception as e:  # the user's initializer: report it, don't crash
                raise InvalidRequestError(f"variable {n.name!r}: initializer raised {type(e).__name__}: {e}") from e
            value = np.asarray(value)
            if value.shape != shape:
                raise ShapeMismatchError(f"variable {n.name!r}: initializer returned shape {value.shape}, expected {shape}")
            if value.dtype != dt:
                value = value.astype(dt)
        value = np.asarray(value)
        self._check_size(n.name, value.shape, value.dtype)
        value = np.array(value, copy=True, order="C")
        var = _Variable(name=n.name, shape=tuple(value.shape), dtype=value.dtype, value=value, optimizer=n.optimizer)
        if n.optimizer is not None:
            var.opt_state = n.optimizer.init(value)
        return var

    def _check_size(self, name: str, shape: Sequence[int], dtype: np.dtype) -> None:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes > self.max_variable_bytes:
            raise PayloadTooLargeError(
                f"variable {name!r} of shape {tuple(shape)} ({dtype}) needs {nbytes} bytes; "
                f"this PS allows {self.max_variable_bytes} per variable (partition it across shards)"
            )

    # -------------------------------------------------------------------- read
    def _get(self, name: str) -> _Variable:
        var = self._vars.get(name)
        if var is None:
            raise VariableNotFoundError(f"no variable named {name!r} on this parameter server")
        return var

    def spec(self, name: str) -> tuple[tuple[int, ...], np.dtype]:
        var = self._get(name)
        return var.shape, var.dtype

    @staticmethod
    def _read_dtype(var: _Variable, name: str, as_dtype: Any) -> np.dtype:
        """The dtype a read of ``var`` as ``as_dtype`` returns: its own, or a narrower float than its own."""
        out_dtype = var.dtype if as_dtype is None else np.dtype(as_dtype)
        if transfer_dtype(var.dtype, None, out_dtype) != out_dtype:
            raise InvalidRequestError(
                f"variable {name!r} is {var.dtype}; it can be read as bfloat16 or float16 only when it is a wider float, "
                f"not as {out_dtype}")
        return out_dtype

    def check_readable(self, name: str, indices: np.ndarray | None = None, as_dtype: np.dtype | None = None) -> None:
        """Raise what :meth:`reading` of the same arguments would raise, reading nothing (a fused
        push-then-pull checks its reads before its push changes anything).

        Raises:
            VariableNotFoundError: no variable ``name``.
            InvalidRequestError: malformed or out-of-range ``indices``; ``as_dtype`` not a narrower float.
        """
        var = self._get(name)
        self._read_dtype(var, name, as_dtype)
        if indices is not None:
            self._check_indices(var, indices)

    @contextmanager
    def frozen(self, names: Sequence[str] | None = None) -> Iterator[list[tuple[str, np.ndarray, Any, int]]]:
        """Hold every variable's lock (or those of ``names``): a consistent snapshot
        ``(name, value, opt_state, version)``.

        No push is half in it: pushes take their locks atomically.
        """
        with self._lock:
            if names is None:
                vars_ = sorted(self._vars.values(), key=lambda v: v.name)
            else:
                vars_ = sorted({n: self._get(n) for n in names}.values(), key=lambda v: v.name)
        with ExitStack() as stack:
            for v in vars_:
                stack.enter_context(v.lock)
                self._flush(v)
            yield [(v.name, v.value, v.opt_state, v.version) for v in vars_]

    @contextmanager
    def export_cut(
        self, names: Sequence[str], base_generation: str, base_cut: int, delta: bool,
        participants: Sequence[CutParticipant] = (),
    ) -> Iterator[tuple[CutResult, list[ExportPart], list[tuple[np.ndarray, np.ndarray, Any]]]]:
        """Make an export cut (:meth:`ChangeTracker.cut`) with every variable lock and every
        participant's lock held, and give ``names`` as they are at the cut.

        Yields ``(result, parts, keyed)``: per name an :class:`ExportPart`: whole (a full export,
        or a variable changed as a whole since the base) or its changed rows (a delta); per
        participant ``(keys, values, evicted keys)``: its rows (all, or those updated since the
        base) and the keys evicted since the base. The locks are released before the yield; whole
        values are read snapshots until the context closes (updates meanwhile copy). When the
        delta cannot be answered (``result.available`` False) nothing changed and ``parts`` is empty.

        Raises:
            VariableNotFoundError: a name is not here (nothing changes).
        """
        while True:
            with self._lock:
                vars_ = sorted(self._vars.values(), key=lambda v: v.name)
                wanted = [self._get(n) for n in names]
            with ExitStack() as stack:
                for v in vars_:
                    stack.enter_context(v.lock)
                for p in participants:
                    stack.enter_context(p.lock)
                with self._lock:
                    if len(self._vars) != len(vars_) or any(self._vars.get(v.name) is not v for v in vars_):
                        continue  # a create, install or delete came between: cut again
                    changes: list[Any] = [v.changes for v in vars_] + [p.changes for p in participants]
                    result, unions = self.changes.cut(base_generation, base_cut, delta, changes)
                if not result.available:
                    parts: list[ExportPart] = []
                    keyed: list[tuple[np.ndarray, np.ndarray, Any]] = []
                else:
                    union_of = {v.name: unions[i] for i, v in enumerate(vars_)} if unions is not None else {}
                    parts = [self._export_part(v, union_of.get(v.name, ALL)) for v in wanted]
                    keyed = []
                    for j, p in enumerate(participants):
                        u: Any = unions[len(vars_) + j] if unions is not None else ALL
                        if u is ALL:
                            keys, values = p.gather(None)
                            keyed.append((keys, values, None))
                        else:
                            keys, values = p.gather(set(u.updated) if u is not None else set())
                            keyed.append((keys, values, sorted(u.evicted) if u is not None else []))
            break
        try:
            yield result, parts, keyed
        finally:
            for v, part in zip(wanted, parts):
                if part.value is not None:
                    with v.lock:
                        if v.value is part.value and v.readers:
                            v.readers -= 1

    def _export_part(self, var: _Variable, union: Any) -> ExportPart:
        """(Under ``var``'s lock.) ``var`` whole (a read snapshot: readers + 1) or its changed rows."""
        self._flush(var)
        part = ExportPart(var.name, var.shape, var.dtype, var.version)
        ids = bitmap_ids(union, var.shape[0] if var.shape else 0) if var.shape else None
        if ids is None:
            part.value = var.value
            var.readers += 1
        else:
            part.ids, part.rows = ids, var.value[ids]
        return part

    def install(self, name: str, value: np.ndarray, optimizer: Optimizer | None, opt_state: Any = None, version: int = 1) -> None:
        """Create or replace ``name`` with the given value and optimizer state (checkpoint restore)."""
        value = np.array(value, copy=True, order="C")
        self._check_size(name, value.shape, value.dtype)
        var = _Variable(name=name, shape=tuple(value.shape), dtype=value.dtype, value=value, optimizer=optimizer, version=version)
        if optimizer is not None:
            var.opt_state = opt_state if opt_state is not None else optimizer.init(value)
        with self._lock:
            self._vars[name] = self._tracked(var)

    def applied_ids(self) -> list[str]:
        """Update ids applied here (oldest first), for a backup's dedupe table: each entry is
        ``<digest>:<update id>`` (the digest of what the push named, :func:`push_digest`)."""
        with self._lock:
            return [f"{digest}:{uid}" for uid, digest in self._applied.items()]

    def replace_all(self, variables: Sequence[tuple[str, np.ndarray, Optimizer | None, Any, int]], applied_ids: Sequence[str]) -> None:
        """Become exactly ``variables`` ``(name, value, optimizer, opt_state, version)``
        with ``applied_ids`` as the dedupe table (a backup's full sync)."""
        fresh = {}
        for name, value, optimizer, opt_state, version in variables:
            value = np.array(value, copy=True, order="C")
            fresh[name] = _Variable(name=name, shape=tuple(value.shape), dtype=value.dtype, value=value,
                                    optimizer=optimizer, opt_state=opt_state, version=version)
        with self._lock:
            # A new tracking generation: this store's history is another's now, so no delta
            # relative to an earlier cut can be answered (the next export is a full one).
            self.changes.restart()
            self._vars = {name: self._tracked(var) for name, var in fresh.items()}
            self._applied = OrderedDict(_split_applied(i) for i in applied_ids)

    def optimizer_of(self, name: str) -> Optimizer | None:
        return self._get(name).optimizer

    @contextmanager
    def reading(
        self, name: str, indices: np.ndarray | None = None, known_version: int = -1, as_dtype: np.dtype | None = None
    ) -> Iterator[ReadResult]:
        """Context manager giving a snapshot of ``name`` (rows ``indices`` if given).

        While the context is open, in-place updates copy instead of writing
        into the returned array, so it may be streamed without holding a lock.
        ``as_dtype`` (bfloat16/float16, for a wider float variable) reads the
        value rounded to that dtype (mixed precision: the variable and its
        optimizer stay in their own dtype).

        Raises:
            InvalidRequestError: ``as_dtype`` is not a narrower float than the variable.
        """
        var = self._get(name)
        out_dtype = self._read_dtype(var, name, as_dtype)
        narrow = out_dtype != var.dtype
        # Never yield while holding the lock: the caller streams for a while and may
        # open several reads at once (lock order would then be the caller's).
        with var.lock:
            version = var.version
            if known_version >= 0 and known_version == version and indices is None:
                early: ReadResult | None = ReadResult(None, version, var.shape, out_dtype)
            elif indices is not None:
                idx = self._check_indices(var, indices)
                if var.pending:
                    # The rows the pending pushes give them, computed on those rows alone (the table
                    # waits for its shared pass).
                    assert var.optimizer is not None
                    rows = var.optimizer.rows_after(var.value, var.opt_state, idx, var.pending)
                else:
                    # A copy. np.take, not var.value[idx]: the same rows in about half the time (no
                    # general fancy-indexing machinery; measured on 4,096 rows of a 1M x 64 table).
                    rows = np.take(var.value, idx, axis=0)
                if narrow:
                    rows = rows.astype(out_dtype)
                early = ReadResult(rows, version, (len(idx),) + var.shape[1:], out_dtype)
            elif narrow:
                self._flush(var)
                early = ReadResult(var.narrow_value(out_dtype), version, var.shape, out_dtype)  # never written
            else:
                self._flush(var)
                early = None
                value = var.value
                var.readers += 1
        if early is not None:
            yield early
            return
        try:
            yield ReadResult(value, version, var.shape, var.dtype)
        finally:
            with var.lock:
                if var.value is value and var.readers:
                    var.readers -= 1

    def read(self, name: str, indices: np.ndarray | None = None) -> np.ndarray:
        """A copy of the variable (or of rows ``indices``)."""
        with self.reading(name, indices) as r:
            assert r.value is not None
            return np.array(r.value)

    def info(self) -> list[VariableInfo]:
        with self._lock:
            vs = list(self._vars.values())
        return [VariableInfo(v.name, v.shape, v.dtype, v.version, v.optimizer is not None) for v in vs]

    def delete(self, names: Sequence[str]) -> None:
        with self._lock:
            missing = [n for n in names if n not in self._vars]
            if missing:
                raise VariableNotFoundError(f"no variable named {missing[0]!r} on this parameter server")
            for n in names:
                del self._vars[n]

    # ------------------------------------------------------------------- apply
    def apply(self, updates: Sequence[Update], update_id: str = "") -> tuple[list[int], bool]:
        """Apply a push atomically; returns ``(new versions, duplicate)``.

        Validation (names, shapes, dtypes, indices) happens for every entry
        before anything changes, so a bad push changes nothing.

        Raises:
            UpdateMismatchError: ``update_id`` was applied, but naming other
                variables or ops (nothing changes).
        """
        digest = push_digest(updates) if update_id else ""
        if update_id and self._claim(update_id, digest, lambda: (
                f"update {update_id!r} was applied naming other variables or ops than this push "
                f"({', '.join(sorted({u.name for u in updates}))}): an update identity names one push, "
                "give each different push an identity of its own")):
            with self._lock:
                return [self._vars[u.name].version if u.name in self._vars else 0 for u in updates], True
        try:
            versions = self._apply_locked(updates, update_id, digest)
        finally:
            if update_id:
                with self._lock:
                    self._in_progress.pop(update_id).set()
        return versions, False

    def apply_once(self, update_id: str, digest: str, change: Callable[[], _T]) -> tuple[_T | None, bool]:
        """Run ``change`` (a change outside the variables: a dynamic table's push) at most once per
        ``update_id``, with the same dedupe table as :meth:`apply`: a re-sent id is a duplicate
        (``(None, True)``), a second call with an id in progress waits for the first, and an id
        applied with another ``digest`` (another table) raises :class:`UpdateMismatchError`.
        ``change`` raising records nothing (a refused push changes nothing, so its retry applies).
        Without an ``update_id`` ``change`` just runs. Returns ``(change's result, False)``.
        """
        if not update_id:
            return change(), False
        if self._claim(update_id, digest, lambda: (
                f"update {update_id!r} was applied naming other variables or tables than this push: "
                "an update identity names one push, give each different push an identity of its own")):
            return None, True
        try:
            result = change()
            with self._lock:
                self.updates_applied += 1
                self._remember(update_id, digest)
        finally:
            with self._lock:
                self._in_progress.pop(update_id).set()
        return result, False

    def _claim(self, update_id: str, digest: str, mismatch: Callable[[], str]) -> bool:
        """Take ``update_id`` for this call: True if it was applied already (a duplicate, counted);
        else False, with the id marked in progress (the caller pops it when done). A second call
        with an id in progress waits for the first. An id applied with another ``digest`` raises
        :class:`UpdateMismatchError` with ``mismatch()`` as its text."""
        while True:
            with self._lock:
                seen = self._applied.get(update_id)
                if seen is not None:
                    if seen and seen != digest:
                        raise UpdateMismatchError(mismatch())
                    self.duplicates_dropped += 1
                    return True
                pending = self._in_progress.get(update_id)
                if pending is None:
                    self._in_progress[update_id] = threading.Event()
                    return False
            pending.wait()

    def _remember(self, update_id: str, digest: str) -> None:
        """(With ``_lock`` held.) Put ``update_id`` in the dedupe table, dropping the oldest past capacity."""
        self._applied[update_id] = digest
        while len(self._applied) > self._dedupe_capacity:
            self._applied.popitem(last=False)

    def validate(self, updates: Sequence[Update]) -> None:
        """Check a push (names, shapes, dtypes, indices, optimizers) without applying it.

        Raises:
            VariableNotFoundError, ShapeMismatchError, DTypeMismatchError, InvalidRequestError.
        """
        with self._lock:
            vars_ = [self._get(u.name) for u in updates]
        for v, u in zip(vars_, updates):
            self._validate(v, u)

    def was_applied(self, update_id: str) -> bool:
        """Whether ``update_id`` is in the dedupe table (applied here)."""
        with self._lock:
            return update_id in self._applied or update_id in self._in_progress

    def apply_step(self, updates: Sequence[Update], update_ids: Sequence[str], step: int) -> list[int]:
        """Apply one synchronous step's mean gradients atomically, as push ``sync-step/<step>``, and
        record ``update_ids`` (the step's contributions) as applied: a re-sent contribution is a duplicate."""
        versions, _ = self.apply(updates, f"sync-step/{step}")
        with self._lock:
            for i in update_ids:
                self._applied[i] = ""  # a step's contributions: their digests are not kept ("": unknown)
            while len(self._applied) > self._dedupe_capacity:
                self._applied.popitem(last=False)
        return versions

    def _apply_locked(self, updates: Sequence[Update], update_id: str, digest: str) -> list[int]:
        with self._lock:
            vars_ = [self._get(u.name) for u in updates]
        prepared = [self._validate(v, u) for v, u in zip(vars_, updates)]
        unique = sorted({id(v): v for v in vars_}.values(), key=lambda v: v.name)
        with ExitStack() as stack:
            for v in unique:
                stack.enter_context(v.lock)
            versions = []
            for var, upd, idx in zip(vars_, updates, prepared):
                self._apply_entry(var, upd, idx)
                var.version += 1
                versions.append(var.version)
            try:
                if self.replicate is not None:
                    self.replicate(updates, update_id)
            finally:
                # Recorded before the locks are released: a snapshot (checkpoint, backup
                # sync) that contains this push's effect also contains its id. Recorded
                # also when replication refused the push (this task stepped down, or
                # became a backup meanwhile): the values here changed all the same, and
                # the client's retry must find it applied if this task serves it again
                # (the coordinator may keep it as the primary), not apply it twice.
                self._record(unique, update_id, digest)
        return versions

    @staticmethod
    def _defers(var: _Variable, upd: Update) -> bool:
        """Whether ``upd`` is an exact-mode row push into a variable whose row pushes are deferred and
        applied several per pass (:meth:`Optimizer.batches_rows`). Depends on the layout only."""
        opt = var.optimizer
        return (upd.op is Op.SPARSE_APPLY_GRADIENT and opt is not None
                and opt.batches_rows(jax.ShapeDtypeStruct(var.shape, var.dtype), var.opt_state))

    def _apply_entry(self, var: _Variable, upd: Update, idx: np.ndarray | None) -> None:
        """(With ``var``'s lock held.) One entry of a push. An exact row push into a variable that defers
        them joins its pending pushes (applied, several in one pass over the table, once
        ``MAX_PUSHES_PER_PASS`` are pending or before anything reads more than rows of it); any other
        change applies the pending pushes first, then itself."""
        if idx is not None and self._defers(var, upd):
            assert var.changes is not None
            var.changes.mark_all()  # the dense rule moves every row
            # Copies (rows, not tables): the caller's arrays are its own again once the push returns.
            var.pending.append((np.array(idx, copy=True), np.array(upd.value, copy=True)))
            if len(var.pending) >= MAX_PUSHES_PER_PASS:
                try:
                    self._flush(var)
                except BaseException:
                    var.pending.pop()  # this push is not acknowledged: its retry must not find it pending
                    raise
            return
        self._flush(var)
        self._apply_one(var, upd, idx)

    def _flush(self, var: _Variable) -> None:
        """(With ``var``'s lock held.) Apply ``var``'s pending row pushes, in order, in one pass over it.
        If that raises (XLA out of memory), they stay pending and the caller that needed them gets the
        error; the value may be half written, as after any step that fails on the PS."""
        if not var.pending:
            return
        n = len(var.pending)
        self._apply_rows_many(var, var.pending)
        var.pending = []
        if n > 1:
            with self._lock:  # flushes of different variables run at once
                self.shared_pass_pushes += n

    def _apply_rows_many(self, var: _Variable, pushes: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """(With ``var``'s lock held.) Several exact-mode row pushes into ``var`` in one pass (see
        :meth:`Optimizer.apply_rows_many`), in place where :meth:`_apply_one`'s dense steps would be."""
        assert var.optimizer is not None
        donate = var.device_value is not None and not var.readers
        start = var.device_value if var.device_value is not None else var.value
        if donate:
            var.value, var.device_value = _NO_VALUE, None  # see _apply_one
        try:
            var.value, var.device_value, var.opt_state = var.optimizer.apply_rows_many(
                start, var.opt_state, pushes, donate=donate)
        except BaseException:
            device: Any = start
            if var.value is _NO_VALUE and not device.is_deleted():
                var.value, var.device_value = np.asarray(device), device
            raise

    def _record(self, touched: Sequence[_Variable], update_id: str, digest: str) -> None:
        """Count a push whose values changed ``touched`` and put its id in the dedupe table,
        unless a full sync or restore replaced those variables meanwhile (the change is gone
        with them, and the table is the replacement's)."""
        with self._lock:
            if any(self._vars.get(v.name) is not v for v in touched):
                return
            self.updates_applied += 1
            if update_id:
                self._remember(update_id, digest)

    def _check_indices(self, var: _Variable, indices: np.ndarray) -> np.ndarray:
        idx = np.asarray(indices)
        if idx.ndim != 1 or idx.dtype.kind not in "iu":
            raise InvalidRequestError(f"variable {var.name!r}: indices must be a rank-1 integer array, got {idx.dtype}{list(idx.shape)}")
        if not var.shape:
            raise InvalidRequestError(f"variable {var.name!r} is a scalar; it has no rows to index")
        if idx.size and (idx.min() < 0 or idx.max() >= var.shape[0]):
            raise InvalidRequestError(f"variable {var.name!r}: row index out of range [0, {var.shape[0]})")
        return idx.astype(np.int64, copy=False)

    def _validate(self, var: _Variable, upd: Update) -> np.ndarray | None:
        value = upd.value
        if transfer_dtype(var.dtype, upd.op, value.dtype) != value.dtype:  # the client's rule, checked
            raise DTypeMismatchError(f"variable {var.name!r} is {var.dtype}; the pushed value is {value.dtype}")
        if upd.op in SPARSE_OPS:
            if upd.indices is None:
                raise InvalidRequestError(f"{upd.op.value} on {var.name!r} needs indices")
            idx = self._check_indices(var, upd.indices)
            want = (len(idx),) + var.shape[1:]
            if value.shape != want:
                raise ShapeMismatchError(f"{upd.op.value} on {var.name!r}: rows have shape {value.shape}, expected {want}")
            if upd.op is Op.SPARSE_APPLY_GRADIENT and var.optimizer is None:
                raise InvalidRequestError(f"variable {var.name!r} has no optimizer; create it with one to push gradients")
            return idx
        if upd.indices is not None:
            raise InvalidRequestError(f"{upd.op.value} on {var.name!r} takes no indices")
        if value.shape != var.shape:
            raise ShapeMismatchError(f"variable {var.name!r} has shape {var.shape}; the pushed value has shape {value.shape}")
        if upd.op is Op.APPLY_GRADIENT and var.optimizer is None:
            raise InvalidRequestError(f"variable {var.name!r} has no optimizer; create it with one to push gradients")
        return None

    def _apply_one(self, var: _Variable, upd: Update, idx: np.ndarray | None) -> None:
        op, value = upd.op, upd.value
        # Marked before the change (a push that fails half way marks what it may have changed).
        # Rows: scatters and the lazy row rule; everything else (a dense rule, the exact row mode,
        # whose dense rule may move any row, an assign) changes the whole variable.
        assert var.changes is not None
        if idx is not None and (op is not Op.SPARSE_APPLY_GRADIENT or (var.optimizer is not None and var.optimizer.lazy)):
            var.changes.mark_rows(idx)
        else:
            var.changes.mark_all()
        if op is Op.APPLY_GRADIENT or (op is Op.SPARSE_APPLY_GRADIENT and var.optimizer is not None and not var.optimizer.lazy):
            # A dense step, or the exact mode (rows travelled, the dense rule runs here; duplicate
            # ids add up inside it).
            assert var.optimizer is not None
            donate = var.device_value is not None and not var.readers
            start = var.device_value if var.device_value is not None else var.value
            if donate:
                # Nobody streams the current value (no open read snapshot; row reads copy under
                # this lock, checkpoints and replica syncs hold it): the step may update the XLA
                # buffers in place. Drop the store's own numpy view first: XLA does not reuse a
                # buffer a live numpy view still points at (it would copy instead).
                var.value, var.device_value = _NO_VALUE, None
            try:
                if op is Op.APPLY_GRADIENT:
                    var.value, var.device_value, var.opt_state = var.optimizer.apply(start, var.opt_state, value, donate=donate)
                else:
                    assert idx is not None
                    var.value, var.device_value, var.opt_state = var.optimizer.apply_rows(
                        start, var.opt_state, idx, value, donate=donate)
            except BaseException:
                device: Any = start  # an XLA array whenever the step was to donate it
                if var.value is _NO_VALUE and not device.is_deleted():
                    var.value, var.device_value = np.asarray(device), device
                raise
            return
        var.device_value = None
        # In place when nobody streams the current array (no open read snapshot), else a new
        # array, so a pull in flight keeps sending the value it started with.
        in_place = not var.readers and var.value.flags.writeable
        if op is Op.ASSIGN:
            if in_place:
                np.copyto(var.value, value)
            else:
                var.value = np.array(value, copy=True)
        elif op is Op.ASSIGN_ADD or op is Op.ASSIGN_SUB:
            ufunc = np.add if op is Op.ASSIGN_ADD else np.subtract
            if in_place:
                ufunc(var.value, value, out=var.value)
            else:
                var.value = ufunc(var.value, value)
        elif op is Op.SCATTER_UPDATE:
            assert idx is not None
            var.writable_value()[idx] = value  # last write wins for duplicate indices, as TF
        elif op in _SCATTER_UFUNC:
            assert idx is not None
            _SCATTER_UFUNC[op](var.writable_value(), idx, value)
        elif op is Op.SPARSE_APPLY_GRADIENT:
            assert idx is not None and var.optimizer is not None
            uniq, inverse = np.unique(idx, return_inverse=True)
            value = value.astype(var.dtype, copy=False)  # duplicate ids add up in the variable's precision
            rows = np.zeros((len(uniq),) + var.shape[1:], value.dtype)
            np.add.at(rows, inverse, value)  # duplicate ids: their gradients add up
            new_rows, new_state, is_row = var.optimizer.apply_sparse(var.value, var.opt_state, uniq, rows)
            var.writable_value()[uniq] = new_rows

            def merge(old: Any, new: Any, row: bool) -> Any:
                if not row:
                    return new
                out = np.array(old) if not np.asarray(old).flags.writeable else old
                out[uniq] = new
                return out

            var.opt_state = jax.tree.map(merge, var.opt_state, new_state, is_row)
        else:  # pragma: no cover - Op is exhaustive
            raise InvalidRequestError(f"unsupported op {op}")
