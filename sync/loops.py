"""How ``strategy.run`` / ``run_steps`` compile and call a replica function.

One compiled program per (function, argument structure and signature):

1. *Discovery* (when variables exist): ``fn`` is traced once with a
   discovering frame, which records the variables it reads and assigns
   (reads return their current values; an optimizer may build its state here).
2. *Trace*: ``fn`` is traced again with those variables as extra inputs
   (local views: the mirrored value, or this replica's part of a
   sync-on-read variable) and the assigned ones as extra outputs. The
   replication analysis (:mod:`jaxdist.sync._varying`) decides which outputs
   are per-replica and refuses a mirrored variable assigned a value that
   differs between replicas, or a value declared with :func:`jaxdist.replicated`
   that may (declared values ``fn`` does not return are extra outputs of the
   traced jaxpr, seen by the analysis and dropped from the compiled program).
3. The jaxpr is wrapped in ``jax.shard_map`` over the strategy's mesh (in
   ``steps`` mode inside a ``lax.scan`` that carries the assigned variables
   from one step to the next) and ``jax.jit``.

Calling it passes the variables' current values (or, nested in
:func:`jaxdist.function`, the enclosing frame's traced values) and writes the
assigned ones back.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxdist.base.errors import ConfigurationError
from jaxdist.sync import context as ctx_lib
from jaxdist.sync._varying import varying_outputs
from jaxdist.sync.declare import FIX_HINT
from jaxdist.sync.engine import AXIS, MeshEngine, SyncEngine
from jaxdist.sync.hooks import entered_trace_hooks, trace_hooks
from jaxdist.sync.programs import RETRACE_WARN_AFTER, Program, captures, changed_capture, fn_key
from jaxdist.sync.values import PerReplica, is_array_like, is_per_replica, is_tracer
from jaxdist.sync.variables import GlobalFrame, ReplicaFrame, SyncVariable, under_foreign_trace

logger = logging.getLogger(__name__)

__all__ = ["run_program", "stack_batches", "default_run_stacked"]

#: How ``run`` passes each leaf of its arguments into the compiled step (part of the program's cache key).
_PER_REPLICA, _REPLICATED, _STATIC, _ROWS = "per_replica", "replicated", "static", "rows"


#: What the error for a mirrored variable assigned per-replica values tells to do (a variable class may say
#: something more precise: :attr:`SyncVariable.varying_assign_hint`).
_VARYING_ASSIGN_HINT = (
    "All-reduce the update first (jaxdist.get_replica_context().all_reduce('sum', grads)), let "
    "jaxdist.Optimizer apply the gradients (it all-reduces them as TF's optimizers do), or create the "
    "variable with aggregation='sum'/'mean'"
)


@dataclass
class _RowsInfo:
    rows: Any  # the per-replica row counts (global array (R,) or (R, steps)), or a tracer
    host: np.ndarray | None
    padded: int
    guard: bool


def _leaf_kind(x: Any) -> bool:
    return isinstance(x, (PerReplica, SyncVariable))


def _aval_key(a: Any) -> tuple[Any, ...]:
    aval = getattr(a, "aval", a)
    return (tuple(a.shape), str(a.dtype), bool(getattr(aval, "weak_type", False)))


def _find_rows(leaves: list[Any], scanned: list[bool], steps: int | None) -> _RowsInfo | None:
    """The row counts of the (first) uneven batch among the inputs, checked against the others."""
    info: _RowsInfo | None = None
    for x, sc in zip(leaves, scanned):
        if not isinstance(x, PerReplica) or x.row_counts is None:
            continue
        if steps is not None and not sc:
            continue
        padded = int(x.stacked.shape[2] if steps is not None else x.stacked.shape[1])
        host = None if is_tracer(x.row_counts) else x.known_host_row_counts
        if info is None:
            info = _RowsInfo(x.row_counts, host, padded, x.guard)
            continue
        if padded != info.padded:
            raise ConfigurationError(
                "strategy.run got two uneven batches with different padded row counts "
                f"({info.padded} and {padded}); pass one distributed batch per step"
            )
        if host is not None and info.host is not None and not np.array_equal(host, info.host):
            raise ConfigurationError(
                "strategy.run got per-replica batches with different row counts; pass one distributed batch per step"
            )
        info.guard = info.guard or x.guard
    return info


def run_program(engine: MeshEngine, fn: Callable[..., Any], args: tuple, kwargs: dict, steps: int | None) -> Any:
    """``strategy.run`` (and ``run_steps`` when ``steps`` is set) of a mesh strategy."""
    parent = ctx_lib.current_frame()
    if isinstance(parent, ReplicaFrame):
        raise RuntimeError("strategy.run cannot be called inside another strategy.run (or its merge_call)")
    if parent is not None:
        parent.strategies.add(engine.strategy)
    leaves, in_tree = jax.tree.flatten((args, kwargs), is_leaf=_leaf_kind)
    n_batch = len(jax.tree.flatten(args[0], is_leaf=_leaf_kind)[0]) if steps is not None and args else 0
    scanned = [i < n_batch for i in range(len(leaves))]
    rows = _find_rows(leaves, scanned, steps)

    kinds: list[str] = []
    dyn: list[Any] = []
    dyn_scanned: list[bool] = []
    statics: list[Any] = []
    for leaf, sc in zip(leaves, scanned):
        if isinstance(leaf, PerReplica):
            kinds.append(_PER_REPLICA)
            dyn.append(engine.place_per_replica(leaf.stacked))
            dyn_scanned.append(sc)
        elif is_array_like(leaf):
            if sc:
                raise ConfigurationError(
                    "run_steps/run_epoch: every array of a batch must be distributed (PerReplica): iterate a "
                    "distributed dataset (strategy.experimental_distribute_dataset)"
                )
            kinds.append(_REPLICATED)
            dyn.append(engine.to_replicated(leaf))
            dyn_scanned.append(False)
        else:
            kinds.append(_STATIC)
            statics.append(leaf)
    if rows is not None:
        kinds.append(_ROWS)
        dyn.append(engine.place_per_replica(rows.rows))
        dyn_scanned.append(steps is not None)
    signature = tuple(_aval_key(a) for a in dyn)
    key = (fn_key(fn), in_tree, tuple(kinds), signature, tuple(statics), steps, tuple(dyn_scanned), parent is not None)
    try:
        hash(key)
    except TypeError:
        raise TypeError(
            "strategy.run: non-array arguments are static and must be hashable; got "
            f"{[type(s).__name__ for s in statics]}"
        ) from None

    program = engine.programs.get(key)
    retraces = 0
    if program is not None:
        if program.owner is not None and program.owner() is not getattr(fn, "__self__", None):
            program = None
        else:
            changed = changed_capture(program.captures)
            if changed is not None:
                retraces = program.retraces + 1
                (logger.warning if retraces == RETRACE_WARN_AFTER else logger.info)(
                    "strategy.run(%s): %r, which the function reads, is no longer the object it was traced with; "
                    "tracing again so the new value is used%s",
                    getattr(fn, "__name__", fn),
                    changed,
                    " (it changes on every call: pass it as an argument to run instead, to compile once)"
                    if retraces >= RETRACE_WARN_AFTER
                    else "",
                )
                program = None
    if program is None:
        if retraces == 0:
            _warn_if_fed_back(engine, fn, key, leaves, kinds, (args, kwargs))
        program = _build(engine, fn, in_tree, kinds, dyn, dyn_scanned, statics, steps, rows, parent)
        program.retraces = retraces
        engine.programs.put(key, program)

    if rows is not None and rows.guard and not program.rows_used and rows.host is not None and (rows.host < rows.padded).any():
        counts = rows.host.tolist()
        raise ConfigurationError(
            f"strategy.run({getattr(fn, '__name__', fn)}): this batch gives the replicas {counts} real rows, "
            f"padded to {rows.padded} (TF's split of a short batch), but fn never asks which rows are real, so the "
            "zero padding would count as data. Compute the loss with jaxdist.compute_average_loss and metrics with "
            "jaxdist.metrics (both skip padding), or use jaxdist.get_replica_context().row_mask(); or distribute "
            "with with_mask=True (and weight by the mask yourself) or drop_remainder=True"
        )

    if parent is None and program.variables and (
        any(is_tracer(a) for a in dyn) or under_foreign_trace()
    ):
        raise ConfigurationError(
            f"strategy.run({getattr(fn, '__name__', fn)}) uses variables ({program.variables[0].name!r}...) inside "
            "jax.jit (or another JAX transformation): jax.jit would capture their values as constants and lose the "
            "updates. Decorate the compiled function with jaxdist.function instead of jax.jit (it threads variable "
            "state through the compiled function, as TF's tf.function does)"
        )
    var_inputs = []
    for v in program.variables:
        g = parent.global_value(v) if parent is not None else v.storage
        if is_tracer(g):
            var_inputs.append(g)
        else:
            var_inputs.append(engine.place_per_replica(g) if v.on_read else engine.to_replicated(g))
    outs = engine.dispatch(program.jitted, *dyn, *var_inputs)
    n_user = len(program.out_varying)
    for v, nv in zip(program.assigned, outs[n_user:]):
        if parent is not None:
            parent.values[v] = nv
            parent.touched[v] = None
            parent.assigned[v] = None
        else:
            engine.write_variable(v, nv)
    wrapped = [
        _returned_per_replica(o, fn, program.out_tree, i) if varying else engine.mirrored.add(engine.finish_replicated(o))
        for i, (o, varying) in enumerate(zip(outs[:n_user], program.out_varying))
    ]
    return jax.tree.unflatten(program.out_tree, wrapped)


def _returned_per_replica(stacked: Any, fn: Callable[..., Any], out_tree: Any, i: int) -> PerReplica:
    """A per-replica output of ``run``, remembering where it came from (for :func:`_warn_if_fed_back`)."""
    return PerReplica(stacked, origin=(getattr(fn, "__name__", repr(fn)), out_tree, i))  # formatted only if warned


def _origin_text(origin: tuple[str, Any, int]) -> str:
    name, out_tree, i = origin
    paths = jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(out_tree, range(out_tree.num_leaves)))[0]
    return f"output {jax.tree_util.keystr(paths[i][0]) or '(the value)'} of strategy.run({name})"


def _arg_text(path: tuple) -> str:
    """``args[0]['w']`` / ``kwargs['w']`` for a path into ``(args, kwargs)``."""
    head = "args" if getattr(path[0], "idx", 0) == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(path[1:]))


def _warn_if_fed_back(
    engine: MeshEngine, fn: Callable[..., Any], key: tuple, leaves: list[Any], kinds: list[str], tree: Any
) -> None:
    """Warn when a per-replica output of ``run`` comes back where this function took a replicated value before.

    That is the functional style's silent trap: params returned per-replica
    (the gradient all-reduce was forgotten) and fed into the next step make
    every replica train its own copy. It is only a warning: per-replica state
    (per-replica RNG keys, local statistics) is legitimate, and ``run`` cannot
    tell which was meant; :func:`jaxdist.replicated` makes it an error.
    Called only when ``run`` compiles a new program, so it costs nothing per step.
    """
    fed = [i for i, x in enumerate(leaves) if isinstance(x, PerReplica) and x.origin is not None]
    if not fed:
        return
    before = [k[2] for k in engine.programs.keys() if k[0] == key[0] and k[1] == key[1] and k[5] == key[5]]
    hits = [i for i in fed if any(len(kd) > i and kd[i] == _REPLICATED for kd in before)]
    if not hits:
        return
    paths = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_leaf_kind)[0]
    names = ", ".join(f"{_arg_text(paths[i][0])} ({_origin_text(leaves[i].origin)})" for i in hits)
    logger.warning(
        "strategy.run(%s): %s is a per-replica value where an earlier call passed a replicated one: each replica now "
        "goes on from its own copy and they drift apart. If it must be the same on every replica (params, optimizer "
        "state), all-reduce the gradients in fn (get_replica_context().all_reduce('sum', grads) or "
        "jaxdist.Optimizer) and return it through jaxdist.replicated(...), which makes a forgotten all-reduce an "
        "error; if per-replica state is meant, ignore this warning",
        getattr(fn, "__name__", fn),
        names,
    )


@dataclass
class _Declared:
    """A value ``fn`` declared with :func:`jaxdist.replicated`, located among the traced function's outputs."""

    positions: list[int]  # where it is in the traced outputs (fn's own outputs first; else one extra output)
    where: str  # the declaration's call site and leaf path
    returned: bool  # whether fn returns it (then positions index fn's flat outputs)


def _declared_outputs(fn: Callable[..., Any], rctx: ctx_lib.ReplicaContext, flat: list[Any], outs: list[Any]) -> list[_Declared]:
    """Locate fn's declared values among its outputs; append the ones it does not return to ``outs``.

    Called while ``fn``'s trace is current: a declared value from an inner
    transformation (a scan body, vmap, grad inside ``fn``) cannot become an
    output of this trace, and is refused with a message saying where to declare.
    """
    if not rctx.declared:
        return []
    with jcore.take_current_trace() as current:
        pass
    positions: dict[int, list[int]] = {}
    for i, leaf in enumerate(flat):
        positions.setdefault(id(leaf), []).append(i)
    found: list[_Declared] = []
    for leaf, where in rctx.declared:
        if getattr(leaf, "_trace", current) is not current:
            raise ConfigurationError(
                f"strategy.run({getattr(fn, '__name__', fn)}): {where}: the value belongs to a JAX transformation "
                "inside fn (a lax.scan/while/cond body, vmap or grad) and cannot be checked from there; declare the "
                "transformation's result in fn itself instead"
            )
        pos = positions.get(id(leaf))
        if pos is not None:
            found.append(_Declared(pos, where, True))
        else:
            found.append(_Declared([len(outs)], where, False))
            outs.append(leaf)
    return found


def _check_declared(
    fn: Callable[..., Any], r: int, declared: list[_Declared], out_varying: list[bool], out_tree: Any, n_user: int
) -> list[bool]:
    """fn's output kinds after the declarations: raise if a declared value may vary, else force them replicated."""
    user_varying = list(out_varying[:n_user])
    if not declared:
        return user_varying
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(jax.tree.unflatten(out_tree, range(n_user)))[0]]
    bad = []
    for d in declared:
        if r > 1 and out_varying[d.positions[0]]:
            what = f"output {paths[d.positions[0]] or '(the value)'} ({d.where})" if d.returned else d.where
            bad.append(what)
        elif d.returned:
            for i in d.positions:  # with one replica a "varying" value is still the same everywhere
                user_varying[i] = False
    if bad:
        name = getattr(fn, "__name__", fn)
        listed = "".join(f"\n  - {b}" for b in bad)
        raise ConfigurationError(
            f"strategy.run({name}): {len(bad)} value(s) declared replicated may differ between replicas, so their {r} "
            f"copies would drift apart (nothing ran):{listed}\nThey depend on per-replica values (the batch, "
            f"gradients, replica_id) that were never all-reduced. {FIX_HINT}"
        )
    return user_varying


def _local_aval(a: Any, kind: str, scanned: bool, steps: int | None) -> jax.ShapeDtypeStruct:
    """What one replica sees of a dyn input in ONE step."""
    aval = getattr(a, "aval", a)
    weak = bool(getattr(aval, "weak_type", False))
    if kind in (_PER_REPLICA, _ROWS):
        shape = a.shape[2:] if (steps is not None and scanned) else a.shape[1:]
    else:
        shape = a.shape
    return jax.ShapeDtypeStruct(tuple(shape), a.dtype, weak_type=weak)


def _build(
    engine: MeshEngine,
    fn: Callable[..., Any],
    in_tree: Any,
    kinds: list[str],
    dyn: list[Any],
    dyn_scanned: list[bool],
    statics: list[Any],
    steps: int | None,
    rows: Any,
    parent: Any,
) -> Program:
    engine.count_trace()
    strategy = engine.strategy
    r = engine.num_replicas
    dyn_kinds = [k for k in kinds if k != _STATIC]
    local_avals = [_local_aval(a, k, sc, steps) for a, k, sc in zip(dyn, dyn_kinds, dyn_scanned)]
    has_rows = rows is not None
    padded = rows.padded if has_rows else None
    n_args = len(local_avals) - (1 if has_rows else 0)
    out_tree_box: list[Any] = []

    def call(local: Sequence[Any], frame: Any) -> tuple[list[Any], ctx_lib.ReplicaContext]:
        it_dyn, it_static = iter(local[:n_args]), iter(statics)
        full = [next(it_static) if k == _STATIC else next(it_dyn) for k in kinds if k != _ROWS]
        args, kwargs = jax.tree.unflatten(in_tree, full)
        rctx = ctx_lib.ReplicaContext(strategy, AXIS, local[n_args] if has_rows else None, padded)
        with ctx_lib.enter_frame(frame), ctx_lib.enter_replica(rctx), entered_trace_hooks(strategy):
            out = fn(*args, **kwargs)
        flat, tree = jax.tree.flatten(out, is_leaf=is_per_replica)
        if any(isinstance(leaf, PerReplica) for leaf in flat):
            raise TypeError("fn passed to strategy.run must return arrays, not PerReplica values")
        if any(isinstance(leaf, SyncVariable) for leaf in flat):
            raise TypeError("fn passed to strategy.run returned a variable: return its value (var.value())")
        out_tree_box[:] = [tree]
        return flat, rctx

    touched: list[SyncVariable] = []
    # A trace hook's objects (Keras variables, once jaxdist.keras is imported) may be variables of the frame
    # even when the strategy has none of its own: discover them too.
    if parent is not None or len(engine.variables) or trace_hooks():
        dframe = ReplicaFrame(strategy, AXIS, discover=True, parent=parent)
        jax.make_jaxpr(lambda *xs: call(xs, dframe)[0], axis_env=[(AXIS, r)])(*local_avals)
        touched = list(dframe.touched)
    var_avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in touched]
    assigned_box: list[list[SyncVariable]] = []
    rctx_box: list[ctx_lib.ReplicaContext] = []
    n_user_box: list[int] = []
    declared_box: list[list[_Declared]] = []

    def traced(*xs: Any) -> list[Any]:
        tframe = ReplicaFrame(strategy, AXIS, discover=False, parent=parent)
        tframe.values = dict(zip(touched, xs[len(local_avals) :]))
        flat, rctx = call(xs[: len(local_avals)], tframe)
        assigned = list(tframe.assigned)
        assigned_box[:] = [assigned]
        rctx_box[:] = [rctx]
        n_user_box[:] = [len(flat)]
        outs = list(flat) + [tframe.values[v] for v in assigned]
        declared_box[:] = [_declared_outputs(fn, rctx, flat, outs)]
        return outs

    closed = jax.make_jaxpr(traced, axis_env=[(AXIS, r)])(*local_avals, *var_avals)
    assigned = assigned_box[0]
    n_user = n_user_box[0]
    n_kept = n_user + len(assigned)  # outputs past these only carry declared values to the analysis
    in_varying = [k in (_PER_REPLICA, _ROWS) for k in dyn_kinds] + [v.on_read for v in touched]
    out_varying = varying_outputs(closed, in_varying, AXIS)
    for v, varies in zip(assigned, out_varying[n_user:]):
        if varies and not v.on_read:
            raise ConfigurationError(
                f"strategy.run({getattr(fn, '__name__', fn)}) assigns the mirrored variable {v.name!r} a value that "
                f"differs between replicas (aggregation={v.aggregation.name}): its {r} copies would drift apart. "
                + (v.varying_assign_hint or _VARYING_ASSIGN_HINT)
            )
    user_varying = _check_declared(fn, r, declared_box[0], out_varying, out_tree_box[0], n_user)
    out_var_spec = [v.on_read for v in assigned]

    in_specs = tuple(P(AXIS) if k in (_PER_REPLICA, _ROWS) else P() for k in dyn_kinds) + tuple(
        P(AXIS) if v.on_read else P() for v in touched
    )
    in_local_per_replica = [s == P(AXIS) for s in in_specs]
    out_per_replica = list(user_varying) + out_var_spec
    out_specs = tuple(P(AXIS) if pr else P() for pr in out_per_replica)
    n_dyn = len(local_avals)
    fun = jcore.jaxpr_as_fun(closed)
    assigned_pos = [touched.index(v) for v in assigned]
    scan_idx = [i for i, sc in enumerate(dyn_scanned) if sc]

    def body(*blocks: Any) -> tuple[Any, ...]:
        local = [b[0] if pr else b for b, pr in zip(blocks, in_local_per_replica)]
        if steps is None:
            outs = list(fun(*local))[:n_kept]
        else:
            dyn_local, var_local = local[:n_dyn], local[n_dyn:]

            def step(carry: tuple[Any, ...], xs: tuple[Any, ...]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
                vals = list(var_local)
                for p, c in zip(assigned_pos, carry):
                    vals[p] = c
                step_dyn = list(dyn_local)
                for i, x in zip(scan_idx, xs):
                    step_dyn[i] = x
                o = fun(*step_dyn, *vals)
                return tuple(o[n_user:n_kept]), tuple(o[:n_user])

            carry0 = tuple(var_local[p] for p in assigned_pos)
            final, ys = jax.lax.scan(step, carry0, tuple(dyn_local[i] for i in scan_idx))
            outs = list(ys) + list(final)
        return tuple(o[None] if pr else o for o, pr in zip(outs, out_per_replica))

    smapped = jax.shard_map(body, mesh=engine.mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    rep, per = engine.replicated_sharding, engine.per_replica_sharding
    jitted = jax.jit(
        smapped,
        in_shardings=tuple(per if s == P(AXIS) else rep for s in in_specs),
        out_shardings=tuple(per if pr else rep for pr in out_per_replica),
    )
    logger.debug(
        "run(%s): traced; %d outputs (%d per-replica), %d variables (%d assigned)%s",
        getattr(fn, "__name__", fn),
        n_user,
        sum(user_varying),
        len(touched),
        len(assigned),
        f", {steps} steps" if steps is not None else "",
    )
    owner = weakref.ref(fn.__self__) if hasattr(fn, "__self__") and hasattr(fn, "__func__") else None
    return Program(
        jitted=jitted,
        out_tree=out_tree_box[0],
        out_varying=user_varying,
        variables=touched,
        assigned=assigned,
        rows_used=rctx_box[0].rows_used,
        captures=captures(fn),
        owner=owner,
    )


# ---------------------------------------------------------------------------------------
# Stacking batches for run_steps / run_epoch
# ---------------------------------------------------------------------------------------


def _stack_leaves(xs: list[Any], axis: int, engine: SyncEngine, per_replica: bool) -> Any:
    if all(isinstance(x, np.ndarray) for x in xs):
        return np.stack(xs, axis=axis)

    def build() -> Callable[..., Any]:
        sharding = engine.per_replica_sharding if per_replica else None
        if sharding is None:
            return jax.jit(lambda *a: jnp.stack(a, axis=axis))
        return jax.jit(lambda *a: jnp.stack(a, axis=axis), out_shardings=sharding)

    fn = engine.cached(("stack", axis, per_replica), build)
    args = [engine.place_per_replica(x) for x in xs] if per_replica else xs
    return fn(*args)


def stack_batches(engine: SyncEngine, batches: list[Any]) -> Any:
    """One batch whose per-replica leaves carry a leading steps axis: ``(R, steps, ...)``.

    Plain-array batches (OneDeviceStrategy yields them) are padded to the
    longest batch and become one-replica ``PerReplica`` values with row counts.
    """
    flat = [jax.tree.flatten(b, is_leaf=is_per_replica) for b in batches]
    tree0 = flat[0][1]
    for _, t in flat[1:]:
        if t != tree0:
            raise ConfigurationError(f"run_steps: the batches have different structures ({tree0} and {t})")
    out = []
    for col in zip(*(leaves for leaves, _ in flat)):
        if all(isinstance(x, PerReplica) for x in col):
            shapes = {tuple(x.stacked.shape) for x in col}
            if len(shapes) != 1:
                raise ConfigurationError(
                    f"run_steps: per-replica batches of different shapes {sorted(shapes)} cannot run in one "
                    "compiled loop; distribute the data with experimental_distribute_dataset (it pads short batches)"
                )
            stacked = _stack_leaves([x.stacked for x in col], 1, engine, True)
            if any(x.row_counts is not None for x in col):
                if not all(x.row_counts is not None for x in col):
                    raise ConfigurationError("run_steps: some batches carry row counts and others do not")
                rows = _stack_leaves([x.row_counts for x in col], 1, engine, True)
                hosts = [x.known_host_row_counts for x in col]
                pr = PerReplica(
                    stacked,
                    rows,
                    host_row_counts=np.stack(hosts, axis=1) if all(h is not None for h in hosts) else None,
                    guard=any(x.guard for x in col),
                )
            else:
                pr = PerReplica(stacked)
            out.append(pr)
        elif all(is_array_like(x) for x in col):
            arrs = [x if isinstance(x, jax.Array) else np.asarray(x) for x in col]
            if any(a.ndim == 0 for a in arrs):
                out.append(PerReplica(_stack_leaves([jnp.asarray(a) for a in arrs], 0, engine, False)[None]))
                continue
            n = [int(a.shape[0]) for a in arrs]
            cap = max(n)
            padded = [a if a.shape[0] == cap else jnp.pad(jnp.asarray(a), [(0, cap - a.shape[0])] + [(0, 0)] * (a.ndim - 1)) for a in arrs]
            stacked = _stack_leaves([jnp.asarray(p) for p in padded], 0, engine, False)[None]
            host = np.asarray(n, np.int32)[None]
            out.append(PerReplica(stacked, jnp.asarray(host), host_row_counts=host, guard=cap != min(n)))
        else:
            raise ConfigurationError(
                "run_steps: batch leaves must all be distributed values (or all arrays), got "
                f"{sorted({type(x).__name__ for x in col})}"
            )
    return jax.tree.unflatten(tree0, out)


# ---------------------------------------------------------------------------------------
# The default strategy's compiled loop
# ---------------------------------------------------------------------------------------


def default_run_stacked(
    engine: SyncEngine, fn: Callable[..., Any], batches: list[Any], args: Sequence[Any], kwargs: Any
) -> Any:
    """``run_steps`` on the default strategy: one jitted ``lax.scan`` (variables threaded as its carry)."""
    kwargs = dict(kwargs or {})
    stacked = stack_batches(engine, batches)
    leaves, tree = jax.tree.flatten(stacked, is_leaf=is_per_replica)
    rows = _find_rows(leaves, [True] * len(leaves), steps=len(batches))
    batch = jax.tree.unflatten(tree, [x.stacked[0] for x in leaves])  # (steps, rows, ...) per leaf
    rows_k = jnp.asarray(rows.rows)[0] if rows is not None else None
    padded = rows.padded if rows is not None else None
    flat_args, args_tree = jax.tree.flatten((tuple(args), kwargs))
    dyn_mask = [is_array_like(x) for x in flat_args]
    statics = tuple(x for x, d in zip(flat_args, dyn_mask) if not d)
    dyn_args = [jnp.asarray(x) for x, d in zip(flat_args, dyn_mask) if d]

    def one_step(frame: Any, b: Any, n: Any, dargs: Sequence[Any]) -> Any:
        it_d, it_s = iter(dargs), iter(statics)
        a, kw = jax.tree.unflatten(args_tree, [next(it_d) if d else next(it_s) for d in dyn_mask])
        rctx = ctx_lib.ReplicaContext(engine.strategy, None, n, padded)
        with ctx_lib.enter_frame(frame), ctx_lib.enter_replica(rctx), entered_trace_hooks(engine.strategy):
            out = fn(b, *a, **kw)
        return out, rctx

    key = ("default_steps", fn_key(fn), tree, args_tree, statics, padded, tuple(_aval_key(a) for a in dyn_args))

    def build() -> tuple[Callable[..., Any], list[SyncVariable], bool]:
        b0 = jax.tree.map(lambda x: x[0], batch)
        n0 = rows_k[0] if rows_k is not None else None
        dframe = GlobalFrame(discover=True, parent=None)
        jax.make_jaxpr(lambda b, n, d: one_step(dframe, b, n, d)[0])(b0, n0, dyn_args)
        touched = list(dframe.touched)
        rows_used: list[bool] = [False]

        def program(var_vals: list[Any], batch: Any, rows_k: Any, dargs: list[Any]) -> Any:
            def step(carry: list[Any], xs: Any) -> Any:
                b, n = xs
                frame = GlobalFrame(discover=False, parent=None)
                frame.values = dict(zip(touched, carry))
                out, rctx = one_step(frame, b, n, dargs)
                rows_used[0] = rows_used[0] or rctx.rows_used
                return [frame.values[v] for v in touched], out

            return jax.lax.scan(step, list(var_vals), (batch, rows_k))

        jax.make_jaxpr(program)([v.storage for v in touched], batch, rows_k, dyn_args)  # learns rows_used
        return jax.jit(program), touched, rows_used[0]

    jitted, touched, used = engine.cached(key, build)
    if rows is not None and rows.guard and not used and rows.host is not None and (rows.host < padded).any():
        raise ConfigurationError(
            f"run_steps({getattr(fn, '__name__', fn)}): the batches were padded to {padded} rows but fn never asks "
            "which rows are real; use jaxdist.compute_average_loss / jaxdist.metrics or "
            "get_replica_context().row_mask()"
        )
    final, outs = jitted([v.storage for v in touched], batch, rows_k, dyn_args)
    for v, nv in zip(touched, final):
        v.storage = nv
    return outs
