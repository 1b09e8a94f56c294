"""Variables that live on parameter servers, and the calls that read and update them.

A :class:`Variable` is a small handle (name, shape, dtype, PS task). It pickles
as that handle, so closures shipped to workers carry it; the same methods work
on the coordinator, through the connections of the strategy that created it,
and inside closures on workers, through the worker's connections (its
:class:`~jaxdist.worker.context.TaskContext`).

Inside a closure, pushes carry an identity (coordinator run, closure id, the
pushing thread's place among the threads the closure started, what the push
names and its count among that thread's pushes naming the same): a closure
re-executed after a worker failure gives its pushes the same identities, and
each PS applies each identity at most once (see docs/exactly-once.md). A push
on a worker that cannot carry an identity is refused
(:class:`~jaxdist.base.errors.UnidentifiedPushError`).
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import operator
import re
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Any, TypeVar

import jax
import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.proto import ps_wire, recycle
from jaxdist.proto.ps_wire import CreateSpec, Op, PullSpec, Update
from jaxdist.ps_server.client import deadline_for
from jaxdist.ps_server.connections import PSConnections
from jaxdist.ps_server.store import push_digest
from jaxdist.sync import context as sync_context
from jaxdist.worker import prefetch
from jaxdist.worker.context import current_contributor, current_ps, current_sync_step, next_update_id, note_sync_step

__all__ = [
    "Variable",
    "VariableOps",
    "SparseGradient",
    "pull",
    "pull_specs",
    "apply_gradients",
    "push_pull",
    "push_updates",
    "split_update",
]

#: One update of one shard: ``(shard, op, value, row indices or None)``.
ShardUpdate = tuple["Variable", Op, np.ndarray, "np.ndarray | None"]

_V = TypeVar("_V", bound="VariableOps")


# -------------------------------------------------------------------- Variable
class VariableOps(abc.ABC):
    """Reads and updates shared by :class:`Variable` and ``ShardedVariable``.

    Subclasses provide ``name``, ``shape``, ``dtype``, ``numpy()`` (the full value) and
    :meth:`shards`; every update is cut into per-shard pushes through that one
    view (:func:`split_update`), so a plain and a sharded variable send the
    same bytes for the same update. Updates return the variable, like TF's
    assign ops.
    """

    __slots__ = ()
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def size(self) -> int:
        return int(np.prod(self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @abc.abstractmethod
    def numpy(self) -> np.ndarray:
        """The full value, pulled from the PS."""

    @abc.abstractmethod
    def shards(self) -> list[tuple[Variable, int]]:
        """``(shard, first row)`` per shard, in row order; a plain variable is one shard at row 0.

        Shards are dim-0 row ranges of the full value: shard ``i`` holds rows
        ``[first_i, first_i + shard.shape[0])``.
        """

    def read_value(self) -> jax.Array:
        return jax.numpy.asarray(self.numpy())

    def value(self) -> jax.Array:
        return self.read_value()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        v = self.numpy()
        return v if dtype is None else v.astype(dtype)

    def __jax_array__(self) -> jax.Array:
        return self.read_value()

    def _update(self: _V, op: Op, value: Any, indices: Any = None) -> _V:
        refuse_in_compiled_code("updated", [self.name])  # before the value (a tracer there) is converted
        push_updates(split_update(self, op, value, indices))
        return self

    def assign(self: _V, value: Any) -> _V:
        return self._update(Op.ASSIGN, value)

    def assign_add(self: _V, delta: Any) -> _V:
        return self._update(Op.ASSIGN_ADD, delta)

    def assign_sub(self: _V, delta: Any) -> _V:
        return self._update(Op.ASSIGN_SUB, delta)

    def apply_gradient(self: _V, grad: Any) -> _V:
        """Push a dense gradient; the PS applies the variable's optimizer to it.

        The gradient travels in :func:`jaxdist.proto.ps_wire.transfer_dtype`'s
        dtype, exactly as with :func:`apply_gradients`: one already in
        bfloat16/float16 stays so for a wider float variable.
        """
        return self._update(Op.APPLY_GRADIENT, grad)

    def scatter_update(self: _V, indices: Any, rows: Any) -> _V:
        return self._update(Op.SCATTER_UPDATE, rows, indices)

    def scatter_add(self: _V, indices: Any, rows: Any) -> _V:
        return self._update(Op.SCATTER_ADD, rows, indices)

    def scatter_sub(self: _V, indices: Any, rows: Any) -> _V:
        return self._update(Op.SCATTER_SUB, rows, indices)

    def scatter_min(self: _V, indices: Any, rows: Any) -> _V:
        return self._update(Op.SCATTER_MIN, rows, indices)

    def scatter_max(self: _V, indices: Any, rows: Any) -> _V:
        return self._update(Op.SCATTER_MAX, rows, indices)

    def apply_sparse_gradient(self: _V, indices: Any, rows: Any) -> _V:
        """Push gradient rows for ``indices`` (only those rows travel).

        The PS applies the variable's optimizer as to the dense gradient with
        zeros elsewhere (exact, the default), or to those rows only when the
        optimizer was made with :func:`jaxdist.lazy_rows`.
        """
        return self._update(Op.SPARSE_APPLY_GRADIENT, rows, indices)


class Variable(VariableOps):
    """A variable held by one parameter-server task.

    Create variables inside ``ParameterServerStrategy.scope()`` (see
    :func:`jaxdist.create_variable`); do not construct handles directly.
    """

    __slots__ = ("name", "shape", "dtype", "ps_index", "trainable", "_conns")

    def __init__(
        self, name: str, shape: Sequence[int], dtype: Any, ps_index: int, trainable: bool = True, conns: PSConnections | None = None
    ) -> None:
        self.name = name
        self.shape = tuple(int(d) for d in shape)
        self.dtype = np.dtype(dtype)
        self.ps_index = ps_index
        self.trainable = trainable
        # The creating strategy's connections (coordinator side). Not pickled: on a
        # worker, the worker's own connections are used.
        self._conns = conns

    def connections(self) -> PSConnections:
        return self._conns if self._conns is not None else current_ps()

    def __getstate__(self) -> tuple[Any, ...]:
        return (self.name, self.shape, self.dtype.str if self.dtype.kind != "V" else self.dtype.name, self.ps_index, self.trainable)

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        name, shape, dtype, ps_index, trainable = state
        self.name, self.shape, self.ps_index, self.trainable = name, tuple(shape), ps_index, trainable
        self.dtype = variable_dtype(dtype)
        self._conns = None

    def __repr__(self) -> str:
        return f"<jaxdist.Variable {self.name!r} shape={self.shape} dtype={self.dtype} on ps:{self.ps_index}>"

    @property
    def device(self) -> str:
        return f"/job:ps/task:{self.ps_index}"

    def shards(self) -> list[tuple[Variable, int]]:
        return [(self, 0)]

    def numpy(self) -> np.ndarray:
        (value,) = pull_arrays([self])
        return value

    def sparse_read(self, indices: Any) -> np.ndarray:
        """Pull only rows ``indices`` of dim 0."""
        idx = np.asarray(indices, dtype=np.int64)
        ((value, _),) = pull_specs(self.connections(), {self.ps_index: [PullSpec(self.name, indices=idx.reshape(-1))]})[self.ps_index]
        assert value is not None, "a pull without a known version always returns the value"
        return value.reshape(idx.shape + self.shape[1:])


def variable_dtype(d: Any) -> np.dtype:
    """The numpy dtype a PS variable declared as ``d`` holds (``"bfloat16"`` names ml_dtypes' bfloat16)."""
    if isinstance(d, str) and d == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(d)


class SparseGradient:
    """Row-sparse gradient ``(indices, rows)``: pass it to :func:`apply_gradients` for an embedding.

    Only the rows travel. The PS applies the variable's optimizer exactly as
    to the dense gradient with these rows (repeated indices add up) and
    zeros elsewhere, or, for an optimizer made with :func:`jaxdist.lazy_rows`,
    to these rows and their optimizer state only.
    """

    __slots__ = ("indices", "rows")

    def __init__(self, indices: Any, rows: Any) -> None:
        self.indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        self.rows = np.asarray(rows)


# -------------------------------------------------------------- tree functions
def _leaves(tree: Any) -> tuple[list[Any], Any]:
    return jax.tree.flatten(tree, is_leaf=lambda x: isinstance(x, VariableOps))


def _connections_of(variables: Sequence[Variable]) -> PSConnections:
    """The connections of the strategy that made ``variables`` (this process's, on a worker)."""
    conns = {id(v._conns): v._conns for v in variables}
    if len(conns) > 1:
        raise ConfigurationError("one call mixes variables of different strategies (clusters); pull or push them separately")
    found = next(iter(conns.values()), None)
    return found if found is not None else current_ps()


def _pull_spec(var: Variable, dtype: np.dtype | None) -> PullSpec:
    """What to ask the PS for: ``var`` as stored, or rounded to ``dtype`` where the transfer rule allows it."""
    wanted = ps_wire.transfer_dtype(var.dtype, None, dtype)
    return PullSpec(var.name, as_dtype=None if wanted == var.dtype else wanted)


#: Set while a run hook pulls its run's inputs (:func:`pulls_for_run`).
_PULLS_FOR_RUN: contextvars.ContextVar[bool] = contextvars.ContextVar("jaxdist_pulls_for_run", default=False)


@contextlib.contextmanager
def pulls_for_run() -> Iterator[None]:
    """Within this block, reads of parameter-server variables during a trace are allowed.

    For a ``ParameterServerStrategy.run`` hook (``jaxdist.ps_methods.register_run_hook``) that pulls what
    its run reads and gives the value to the compiled step as an input, read again each call (the Keras
    custom loop's model variables): that read is neither compiled in as a constant nor repeated per trace,
    which is what :func:`refuse_in_compiled_code` guards against. Updates stay refused.
    """
    token = _PULLS_FOR_RUN.set(True)
    try:
        yield
    finally:
        _PULLS_FOR_RUN.reset(token)


def refuse_in_compiled_code(what: str, names: Sequence[str]) -> None:
    """Raise ConfigurationError when parameter-server variables are read or updated while compiled code
    (``strategy.run``, ``jaxdist.function``) is being traced.

    TF reads a variable each time its ``tf.function`` runs. A trace here would instead compile the
    value read once in as a constant (every later call returning the stale value, silently), and an
    update would be pushed once per trace, not once per call; so both are refused, saying what to write.
    """
    if sync_context.current_frame() is None or not names:
        return
    if what == "read" and _PULLS_FOR_RUN.get():
        return
    shown = ", ".join(repr(n) for n in sorted(set(names))[:3]) + (", ..." if len(set(names)) > 3 else "")
    raise ConfigurationError(
        f"parameter-server variable {shown} {what} inside compiled code (a function traced by strategy.run or "
        "jaxdist.function): its value would be compiled in once as a constant (later calls would not see its "
        "updates) and an update would be pushed once per trace, not per call. Read it in the scheduled function "
        "and pass the value in, e.g. strategy.run(fn, args=(x, v.read_value())), and update it there from what "
        "run returns (v.assign_add(strategy.reduce('SUM', delta, axis=None)))")


def pull_specs(
    conns: PSConnections,
    by_ps: dict[int, list[PullSpec]],
    timeouts: dict[int, float] | None = None,
    outs: dict[int, list[np.ndarray | None]] | None = None,
    pipelined: bool = False,
) -> dict[int, list[tuple[np.ndarray | None, int]]]:
    """Pull ``by_ps[ps]`` from each PS task, all in parallel; ``(value, version)`` per spec.

    ``pipelined``: the answers are small (rows of a lookup: they fit the data plane's buffers),
    so every request is sent from this thread before any answer is read, instead of one call per
    thread (:meth:`~jaxdist.ps_server.client.PSClient.start_pull`).

    Inside a worker's closure each PS first holds the pull at its step barrier (synchronous or
    bounded-stale training; nothing waits otherwise), and the step this worker's next gradients
    join is recorded (:func:`jaxdist.current_sync_step`). Every read of variables goes through
    here, whole or by rows, so no read inside a closure skips the barrier.
    """
    refuse_in_compiled_code("read", [spec.name for specs in by_ps.values() for spec in specs])
    contributor = current_contributor()
    if pipelined and len(by_ps) > 1:
        return _pull_pipelined(conns, by_ps, contributor, timeouts, outs)
    calls = {}
    for ps, specs in by_ps.items():
        kw: dict[str, Any] = {"timeout": None if timeouts is None else timeouts[ps], "out": None if outs is None else outs[ps]}
        if contributor >= 0:
            calls[ps] = operator.methodcaller("pull_at_barrier", specs, contributor, **kw)
        else:
            calls[ps] = operator.methodcaller("pull", specs, **kw)
    got = conns.fan_out(calls)
    if contributor < 0:
        return got
    note_sync_step(max(step for _, step in got.values()))
    return {ps: res for ps, (res, _) in got.items()}


def _pull_pipelined(
    conns: PSConnections, by_ps: dict[int, list[PullSpec]], contributor: int, timeouts: dict[int, float] | None,
    outs: dict[int, list[np.ndarray | None]] | None,
) -> dict[int, list[tuple[np.ndarray | None, int]]]:
    """:func:`pull_specs` with every request sent before any answer is read. A PS this process does not
    reach over the data plane now is pulled the usual way; every started pull is read, and the first
    error is raised after all of them were."""
    finishers = {}
    for ps, specs in by_ps.items():
        kw: dict[str, Any] = {"timeout": None if timeouts is None else timeouts[ps], "out": None if outs is None else outs[ps]}
        finishers[ps] = (conns.client(ps).start_pull(specs, contributor, **kw), specs, kw)
    got: dict[int, tuple[list[tuple[np.ndarray | None, int]], int]] = {}
    error: BaseException | None = None
    for ps, (finish, specs, kw) in finishers.items():
        try:
            if finish is not None:
                got[ps] = finish()
            elif contributor >= 0:
                got[ps] = conns.client(ps).pull_at_barrier(specs, contributor, **kw)
            else:
                got[ps] = (conns.client(ps).pull(specs, **kw), -1)
        except BaseException as e:  # raised once every started pull was read (its connection released)
            error = error or e
    if error is not None:
        raise error
    if contributor >= 0:
        note_sync_step(max(step for _, step in got.values()))
    return {ps: res for ps, (res, _) in got.items()}


def pull_arrays(
    variables: Sequence[Variable], out: Sequence[np.ndarray | None] | None = None, dtype: np.dtype | None = None
) -> list[np.ndarray]:
    """Pull several variables: one RPC per PS task, all PS tasks in parallel.

    ``out`` optionally gives, per variable, a preallocated array (e.g. a
    shard's rows of the full value) that receives the bytes in place.
    ``dtype`` (bfloat16/float16): wider float variables come rounded to it.
    """
    by_ps: dict[int, list[int]] = defaultdict(list)
    for i, v in enumerate(variables):
        by_ps[v.ps_index].append(i)
    conns = _connections_of(variables)
    results = pull_specs(
        conns,
        {ps: [_pull_spec(variables[i], dtype) for i in idxs] for ps, idxs in by_ps.items()},
        timeouts={ps: deadline_for(sum(variables[i].size * variables[i].dtype.itemsize for i in idxs)) for ps, idxs in by_ps.items()},
        outs=None if out is None else {ps: [out[i] for i in idxs] for ps, idxs in by_ps.items()},
    )
    values: list[Any] = [None] * len(variables)
    for ps, idxs in by_ps.items():
        for i, (value, _version) in zip(idxs, results[ps]):
            values[i] = value
    return values


def pull(tree: Any, dtype: Any = None, prefetch_next: bool = False) -> Any:
    """Read every variable in ``tree`` (any pytree); returns the same tree of numpy arrays.

    Non-variable leaves pass through. All PS tasks are read in parallel, one
    call per task.

    ``dtype`` (``jnp.bfloat16`` or ``float16``) is mixed precision: float
    variables wider than it arrive rounded to it, half the bytes for float32,
    while the PS keeps and updates them in their own dtype (pair it with
    ``apply_gradients``, whose gradients are applied in the variable's dtype).
    Each version is rounded once on the PS, for all workers. Other variables
    arrive as stored. Cast the values back up inside your jitted function if
    the model should compute in float32.

    ``prefetch_next`` (opt-in overlap, off by default): return the values
    prefetched for this call on this worker when there are some, and start
    reading ``tree`` in the background for the next such call, so that read
    runs while this step computes and pushes. The values may then miss this
    worker's previous step's gradients (a delay of at most one step; see
    :mod:`jaxdist.worker.prefetch` for the exact guarantee and its age bound). Not
    with synchronous or bounded-stale steps (ConfigurationError).
    """
    td = _pull_dtype(dtype)
    if not prefetch_next:
        return _gather(tree, td, lambda flat, outs: pull_arrays(flat, outs, td))
    return prefetch.take_and_refill(
        _prefetch_key(tree, td), lambda: _gather(tree, td, lambda flat, outs: pull_arrays(flat, outs, td)),
        _refuse_prefetch_in_sync_steps)


def _prefetch_key(tree: Any, td: np.dtype | None) -> tuple[Any, ...]:
    """What identifies a prefetch slot: this process's connections, the variables read, the pull dtype."""
    leaves, treedef = _leaves(tree)
    shards = [shard for v in leaves if isinstance(v, VariableOps) for shard, _ in v.shards()]
    conns = _connections_of(shards) if shards else None
    return (id(conns), treedef, tuple((s.name, s.shape) for s in shards), None if td is None else td.str)


def _refuse_prefetch_in_sync_steps() -> None:
    if current_sync_step() >= 0:
        raise ConfigurationError(
            "pull(prefetch_next=True) under synchronous or bounded-stale steps: the read is also the step "
            "barrier there, which a prefetch would skip; pull without prefetch_next")


def _pull_dtype(dtype: Any) -> np.dtype | None:
    td = None if dtype is None else np.dtype(dtype)
    if td is not None and td not in ps_wire.NARROW_FLOATS:
        raise ValueError(f"pull dtype must be bfloat16 or float16, got {td}")
    return td


def _gather(tree: Any, td: np.dtype | None, fetch: Any) -> Any:
    """``tree`` with each variable leaf replaced by its value, read by ``fetch(shards, outs)`` (one value
    per shard, in order; ``outs`` gives each shard's rows of its variable's preallocated full value)."""
    leaves, treedef = _leaves(tree)
    flat: list[Variable] = []
    outs: list[np.ndarray | None] = []
    fulls: list[np.ndarray | None] = []  # per variable leaf made of several shards: its full value
    for leaf in leaves:
        if not isinstance(leaf, VariableOps):
            continue
        parts = leaf.shards()
        if isinstance(leaf, Variable):
            fulls.append(None)
            flat.append(leaf)
            outs.append(None)
            continue
        # Shards are dim-0 row ranges: each is received straight into its rows
        # of one preallocated array, so no concatenation copy follows.
        full = recycle.take(leaf.shape, ps_wire.transfer_dtype(leaf.dtype, None, td))  # reused once dropped
        fulls.append(full)
        for shard, row in parts:
            flat.append(shard)
            outs.append(full[row:row + shard.shape[0]])
    values = iter(fetch(flat, outs))
    out: list[Any] = []
    full_of = iter(fulls)
    for leaf in leaves:
        if not isinstance(leaf, VariableOps):
            out.append(leaf)
            continue
        whole = next(full_of)
        if whole is None:
            out.append(next(values))
            continue
        for shard, row in leaf.shards():
            part = next(values)
            if not np.may_share_memory(part, whole):
                whole[row:row + shard.shape[0]] = part  # the PS sent another shape/dtype than expected: copy (rare)
        out.append(whole)
    return jax.tree.unflatten(treedef, out)


def split_update(
    var: VariableOps, op: Op, value: Any, indices: Any = None, transfer_dtype: Any = None, broadcast: bool = True
) -> list[ShardUpdate]:
    """``op`` with ``value`` on ``var`` as one update per shard it touches (via :meth:`VariableOps.shards`).

    The value is converted once to the dtype it travels in
    (:func:`jaxdist.proto.ps_wire.wire_value`, offered ``transfer_dtype``).
    A dense value is broadcast to the variable's shape (``broadcast``; else
    it must have that shape) and cut into each shard's rows; rows with
    ``indices`` go to the shards that own them, with shard-local indices.

    Raises:
        ValueError: a dense value of the wrong shape for a sharded variable (without ``broadcast``).
        IndexError: a row index outside a sharded variable.
    """
    op = Op(op)
    parts = var.shards()
    arr = ps_wire.wire_value(value, var.dtype, op, transfer_dtype)
    if indices is None:
        if broadcast:
            arr = np.broadcast_to(arr, var.shape)
        if len(parts) == 1:
            return [(parts[0][0], op, arr, None)]
        if arr.shape != var.shape:
            raise ValueError(f"{op.value} for {getattr(var, 'name', var)!r} has shape {arr.shape}, expected {var.shape}")
        return [(shard, op, arr[row:row + shard.shape[0]], None) for shard, row in parts]
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    rows = arr.reshape((len(idx),) + var.shape[1:])
    if len(parts) == 1:
        return [(parts[0][0], op, rows, idx)]
    shard_of, local = locate_rows(parts, var.shape[0], idx)
    out: list[ShardUpdate] = []
    if op is Op.SPARSE_APPLY_GRADIENT:
        # Every (non-empty) shard gets the gradient push, with no rows where the batch looked none
        # up: each shard's optimizer steps once per push, as the whole variable's would (the exact
        # mode's zero rows still decay moments; step counts stay equal across shards).
        for s, (shard, _) in enumerate(parts):
            sel = shard_of == s
            if shard.shape[0] or sel.any():
                out.append((shard, op, rows[sel], local[sel]))
        return out
    for s in np.unique(shard_of):
        sel = shard_of == s
        out.append((parts[int(s)][0], op, rows[sel], local[sel]))
    return out


def locate_rows(parts: Sequence[tuple[Variable, int]], dim0: int, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For rows ``idx`` of a variable of ``dim0`` rows cut into ``parts`` (:meth:`VariableOps.shards`):
    the position of the shard holding each row, and the row's index in that shard.

    Raises:
        IndexError: a row outside ``[0, dim0)``.
    """
    if idx.size and (idx.min() < 0 or idx.max() >= dim0):
        raise IndexError(f"row index out of range [0, {dim0})")
    firsts = np.array([row for _, row in parts], dtype=np.int64)
    # The last shard starting at or before each row; empty shards (dim0 < shards) start at dim0 and own nothing.
    shard_of = np.searchsorted(firsts, idx, side="right") - 1
    return shard_of, idx - firsts[shard_of]


#: push_digest of recent pushes, by their ``(name, op)`` pairs: a training loop pushes the same few
#: variable sets over and over, and digesting a large model's names costs more than looking them up.
_signatures: dict[tuple[tuple[str, Op], ...], str] = {}
_SIGNATURES_KEPT = 1024


#: A shard of a partitioned variable (``ShardedVariable``): ``{name}/part_{i}``.
_SHARD_SUFFIX = re.compile(r"/part_\d+$")
_NO_VALUE = np.zeros(0, np.float32)  # push_digest reads names and ops only


def _signature(updates: Sequence[Update]) -> str:
    """What a push names: :func:`~jaxdist.ps_server.store.push_digest` of its parts with each shard
    named by its partitioned variable. The closure identity counts pushes per signature
    (:meth:`jaxdist.worker.context.ClosureIdentity.next_update_id`).

    Shards are named by their variable because the shards a row-sparse push reaches depend on its rows
    (the batch): a re-run's sparse push to other shards is the same update as its first attempt's, and
    a dense gradient pushed with it must not become a second update because of the rows."""
    key = tuple([(u.name, u.op) for u in updates])
    sig = _signatures.get(key)
    if sig is None:
        if len(_signatures) >= _SIGNATURES_KEPT:
            _signatures.clear()
        logical = {(_SHARD_SUFFIX.sub("", u.name), u.op) for u in updates}
        sig = _signatures[key] = push_digest([Update(name, op, _NO_VALUE) for name, op in logical])
    return sig


def push_updates(updates: Sequence[tuple[Variable, Any, Any, np.ndarray | None]]) -> None:
    """Push ``(variable, op, value, indices)`` updates: one atomic push per PS task, in parallel.

    Each value travels in :func:`jaxdist.proto.ps_wire.transfer_dtype`'s dtype
    (the variable's, except bfloat16/float16 gradients of wider float
    variables, which the PS widens). ``op`` is an :class:`Op` (or its name).
    """
    refuse_in_compiled_code("updated", [u[0].name for u in updates])
    by_ps: dict[int, list[Update]] = defaultdict(list)
    for var, op, value, idx in updates:
        op = Op(op)
        by_ps[var.ps_index].append(Update(var.name, op, ps_wire.wire_value(value, var.dtype, op), idx))
    variables = [var for var, *_ in updates]
    conns = _connections_of(variables)
    # Handles without connections of their own push through the worker's: such a push must carry
    # the closure's identity (or is refused), a coordinator's push carries none.
    update_id = next_update_id(own_connections=any(v._conns is not None for v in variables),
                               signature=_signature([u for specs in by_ps.values() for u in specs]))
    contributor = current_contributor()
    if contributor < 0:
        conns.fan_out({ps: operator.methodcaller("push", specs, update_id=update_id) for ps, specs in by_ps.items()})
        return
    # A worker's closure. Under synchronous or bounded-stale training each PS stages the gradients
    # for this worker's step; the step is committed on *every* PS only once all pushes landed, so a
    # committed contribution is on every PS (a worker that dies between the two never half-commits).
    # With one PS task the push commits itself.
    single = len(conns.clients) == 1
    pulled_at = current_sync_step()  # the PS checks the worker is still at the step it computed on
    answers = conns.fan_out({ps: operator.methodcaller("push_step", specs, update_id, contributor, commit=single,
                                                       step=pulled_at)
                             for ps, specs in by_ps.items()})
    if not single and any(a.staged for a in answers.values()):
        conns.fan_out({ps: operator.methodcaller("sync_steps", ps_wire.SyncKind.COMMIT, contributor)
                       for ps in range(len(conns.clients))})


def gradient_updates(var: VariableOps, grad: Any, transfer_dtype: Any = None, broadcast: bool = True) -> list[ShardUpdate]:
    """The per-shard pushes of gradient ``grad`` (dense, or a :class:`SparseGradient`) for ``var``."""
    if isinstance(grad, SparseGradient):
        return split_update(var, Op.SPARSE_APPLY_GRADIENT, grad.rows, grad.indices, transfer_dtype)
    return split_update(var, Op.APPLY_GRADIENT, grad, None, transfer_dtype, broadcast)


def apply_gradients(variables: Any, grads: Any, transfer_dtype: Any = None) -> None:
    """Push ``grads`` (same tree structure as ``variables``) to the PS, which applies each variable's optimizer.

    One atomic push per PS task, all in parallel. Inside a closure the push
    carries the closure's identity, so a re-executed closure never applies
    it twice. ``None`` gradients (and non-trainable variables) are skipped.

    ``transfer_dtype`` (``jnp.bfloat16`` or ``float16``) sends dense and
    sparse gradients of wider float variables in that dtype, halving the
    bytes pushed; the PS widens them back and runs the optimizer in the
    variable's dtype, so only the gradient's rounding changes (bf16 keeps
    float32's range and ~3 significant digits). Gradients already in such a
    dtype travel as they are, with or without this option (and with
    ``v.apply_gradient``: both send the same bytes); casting inside the
    jitted gradient function is the cheapest way.
    """
    refuse_in_compiled_code("updated", [v.name for v in _leaves(variables)[0] if isinstance(v, VariableOps)])
    td = None if transfer_dtype is None else np.dtype(transfer_dtype)
    if td is not None and td not in ps_wire.NARROW_FLOATS:
        raise ValueError(f"transfer_dtype must be bfloat16 or float16, got {td}")
    vleaves, vdef = _leaves(variables)
    gleaves = vdef.flatten_up_to(grads)
    updates: list[ShardUpdate] = []
    for v, g in zip(vleaves, gleaves):
        if g is None:
            continue
        if not isinstance(v, VariableOps):
            raise TypeError(f"apply_gradients: leaf {v!r} is not a jaxdist Variable")
        if not getattr(v, "trainable", True):
            continue
        updates.extend(gradient_updates(v, g, td, broadcast=False))
    if updates:
        push_updates(updates)


def push_pull(variables: Any, grads: Any, transfer_dtype: Any = None, dtype: Any = None, prefetch_next: bool = False) -> Any:
    """Fused ``apply_gradients`` then ``pull``: one round trip per PS task (BytePS-style push-pull).

    Pushes ``grads`` exactly as :func:`apply_gradients` does (same identity inside a closure, so a
    re-run closure or a re-sent call never applies them twice: the PS answers a repeat with the
    values as they are then) and returns the values of every variable in ``variables`` read on
    each PS right after that PS applied its part (as :func:`pull` would return them; ``dtype``
    as there). The PS tasks are called in parallel; a PS that gets no gradient is pulled from.
    Values include the other workers' updates applied before the read, as a pull's do.

    ``prefetch_next``: also keep the returned values for the next ``pull(variables, dtype=dtype,
    prefetch_next=True)`` on this worker, which then returns them without a call (a training loop
    of ``pull(prefetch_next=True)`` then ``push_pull(prefetch_next=True)`` makes one round trip
    per step and computes on values that hold all of its own updates; see :mod:`jaxdist.worker.prefetch`).

    Raises:
        ConfigurationError: inside a closure while the PS runs synchronous or bounded-stale steps
            (gradients are staged there, not applied: use ``pull`` and ``apply_gradients``).
    """
    refuse_in_compiled_code("updated", [v.name for v in _leaves(variables)[0] if isinstance(v, VariableOps)])
    started = time.monotonic()
    td = None if transfer_dtype is None else np.dtype(transfer_dtype)
    if td is not None and td not in ps_wire.NARROW_FLOATS:
        raise ValueError(f"transfer_dtype must be bfloat16 or float16, got {td}")
    pd = _pull_dtype(dtype)
    vleaves, vdef = _leaves(variables)
    gleaves = vdef.flatten_up_to(grads)
    updates: list[ShardUpdate] = []
    for v, g in zip(vleaves, gleaves):
        if g is None or not isinstance(v, VariableOps) or not getattr(v, "trainable", True):
            if g is not None and not isinstance(v, VariableOps):
                raise TypeError(f"push_pull: leaf {v!r} is not a jaxdist Variable")
            continue
        updates.extend(gradient_updates(v, g, td, broadcast=False))
    values = _gather(variables, pd, lambda flat, outs: _push_pull_arrays(updates, flat, outs, pd))
    if prefetch_next:
        prefetch.store(_prefetch_key(variables, pd), values, started)
    return values


def _push_pull_arrays(
    updates: Sequence[ShardUpdate], flat: Sequence[Variable], outs: Sequence[np.ndarray | None], dtype: np.dtype | None
) -> list[np.ndarray]:
    """Push ``updates`` and read ``flat`` (shards), one PushPull per PS task that gets updates, a Pull
    for the others, all in parallel; the values of ``flat`` in order."""
    pushes: dict[int, list[Update]] = defaultdict(list)
    for var, op, value, idx in updates:
        pushes[var.ps_index].append(Update(var.name, Op(op), ps_wire.wire_value(value, var.dtype, op), idx))
    reads: dict[int, list[int]] = defaultdict(list)
    for i, v in enumerate(flat):
        reads[v.ps_index].append(i)
    if not set(pushes) <= set(reads):
        raise ValueError("push_pull: a gradient for a variable that is not in `variables`")
    everything = [var for var, *_ in updates] + list(flat)
    conns = _connections_of(everything)
    update_id = next_update_id(own_connections=any(v._conns is not None for v in everything),
                               signature=_signature([u for specs in pushes.values() for u in specs])) if pushes else ""
    contributor = current_contributor()
    calls = {}
    for ps, idxs in reads.items():
        specs = [_pull_spec(flat[i], dtype) for i in idxs]
        nbytes = sum(flat[i].size * flat[i].dtype.itemsize for i in idxs)
        ps_outs = [outs[i] for i in idxs]
        if ps in pushes:
            calls[ps] = operator.methodcaller("push_pull", pushes[ps], specs, update_id=update_id, contributor=contributor,
                                              timeout=2 * deadline_for(nbytes), out=ps_outs)
        elif contributor >= 0:
            calls[ps] = operator.methodcaller("pull_at_barrier", specs, contributor, timeout=deadline_for(nbytes), out=ps_outs)
        else:
            calls[ps] = operator.methodcaller("pull", specs, timeout=deadline_for(nbytes), out=ps_outs)
    got = conns.fan_out(calls)
    values: list[Any] = [None] * len(flat)
    for ps, idxs in reads.items():
        res = got[ps]
        if ps in pushes:
            res = res[1]
        elif contributor >= 0:
            res = res[0]
        for i, (value, _version) in zip(idxs, res):
            values[i] = value
    return values


def create_on_ps(specs: Sequence[tuple[int, CreateSpec]], conns: PSConnections) -> None:
    """Create variables, batched per PS task, in parallel."""
    by_ps: dict[int, list[CreateSpec]] = defaultdict(list)
    for ps, spec in specs:
        by_ps[ps].append(spec)
    conns.fan_out({ps: operator.methodcaller("create", s) for ps, s in by_ps.items()})
