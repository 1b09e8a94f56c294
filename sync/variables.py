"""Variables of the synchronous strategies: state that carries itself (TF's distributed variables).

Create them in ``strategy.scope()`` with :func:`create_variable` /
:func:`create_variables` (or ``strategy.create_variables``); read them anywhere
(``var.value()``, ``jaxdist.read_variables(tree)``, ``np.asarray(var)``) and
update them with ``assign``/``assign_add``/``assign_sub``, also *inside*
``strategy.run``: the strategy passes every variable that ``fn`` reads into
the compiled step and writes back the ones it assigned, so a TF-style
``train_step`` that reads the model and lets an optimizer update it needs no
hand-threaded state.

Two kinds, as TF (``synchronization=``):

- **ON_WRITE** (the default; TF's ``MirroredVariable``): one logical value,
  the same on every replica. In replica context an ``assign`` with
  ``aggregation=SUM``/``MEAN``/``ONLY_FIRST_REPLICA`` first combines the
  replicas' values (an all-reduce); with ``aggregation=NONE`` the value
  assigned must already be the same on every replica, and assigning a value
  that differs between replicas is a
  :class:`~jaxdist.base.errors.ConfigurationError` when ``run`` compiles the
  step (TF would let the copies drift apart).
- **ON_READ** (TF's ``SyncOnReadVariable``, what metrics use): each replica
  keeps its own value; reading in cross-replica context combines them with
  the variable's ``aggregation`` (e.g. SUM), exactly, across replicas and
  processes.

Variables are threaded through compiled code by *frames* (see
:mod:`jaxdist.sync.context`): ``strategy.run`` opens one while it traces
``fn`` and :func:`jaxdist.function` opens one around a whole compiled
function. Reading a variable inside plain ``jax.jit`` (no frame) raises an
error that names :func:`jaxdist.function`: a value captured by ``jax.jit``
would be a stale constant.
"""

from __future__ import annotations

import enum
import logging
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import jax
import jax.extend.core as jcore
import jax.numpy as jnp
import numpy as np

from jaxdist.base.errors import ConfigurationError
from jaxdist.sync import context as ctx_lib

if TYPE_CHECKING:
    from jaxdist.sync.strategy import Strategy

logger = logging.getLogger(__name__)

__all__ = [
    "SyncVariable",
    "VariableAggregation",
    "VariableSynchronization",
    "create_variable",
    "create_variables",
    "read_variables",
    "assign_variables",
]


class VariableSynchronization(enum.Enum):
    """When a distributed variable is aggregated (``tf.VariableSynchronization``)."""

    AUTO = "AUTO"
    NONE = "NONE"
    ON_WRITE = "ON_WRITE"
    ON_READ = "ON_READ"


class VariableAggregation(enum.Enum):
    """How replicas' values are combined (``tf.VariableAggregation``)."""

    NONE = "NONE"
    SUM = "SUM"
    MEAN = "MEAN"
    ONLY_FIRST_REPLICA = "ONLY_FIRST_REPLICA"


def _coerce(enum_cls: type[enum.Enum], value: Any, what: str) -> Any:
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str):
        try:
            return enum_cls(value.upper())
        except ValueError:
            pass
    raise ValueError(f"{what} must be one of {[m.name for m in enum_cls]}, got {value!r}")


def under_foreign_trace() -> bool:
    """Inside jax.jit / make_jaxpr / eval_shape that jaxdist did not open a frame for."""
    try:
        return bool(jcore.unsafe_am_i_under_a_jit_DO_NOT_USE())
    except Exception:  # noqa: BLE001 - API missing in some JAX: assume eager
        return False


_FOREIGN_JIT_HELP = (
    "Variable {name!r} is {what} inside jax.jit (or another JAX transformation) that jaxdist does not "
    "know about: jax.jit would capture its value as a constant and the update would be lost. Decorate the "
    "compiled function with jaxdist.function instead of jax.jit (it threads variable state through the "
    "compiled function), or pass jaxdist.read_variables(...) values into the jitted function explicitly"
)


class SyncVariable:
    """A variable of a synchronous strategy (mirrored or sync-on-read); see the module docstring.

    Not constructed directly: use :func:`create_variable` /
    :func:`create_variables` inside ``strategy.scope()``.

    Attributes:
        name: unique name within the strategy (checkpoint key), e.g. ``params/dense1/w``.
        shape, dtype: of the logical value.
        trainable: whether optimizers should treat it as a parameter (informative).
        synchronization: ``ON_WRITE`` or ``ON_READ``.
        aggregation: how replicas' values combine (see :class:`VariableAggregation`).
        distribute_strategy: the strategy it belongs to.
    """

    __slots__ = (
        "name",
        "shape",
        "dtype",
        "trainable",
        "synchronization",
        "aggregation",
        "distribute_strategy",
        "checkpointed",
        "_value",
        "__weakref__",
    )

    def __init__(
        self,
        strategy: Strategy,
        name: str,
        value: Any,
        shape: tuple[int, ...],
        dtype: np.dtype,
        trainable: bool,
        synchronization: VariableSynchronization,
        aggregation: VariableAggregation,
        checkpointed: bool,
    ) -> None:
        self.distribute_strategy = strategy
        self.name = name
        self.shape = tuple(shape)
        self.dtype = np.dtype(dtype)
        self.trainable = trainable
        self.synchronization = synchronization
        self.aggregation = aggregation
        self.checkpointed = checkpointed
        #: ON_WRITE: the replicated global value. ON_READ: (num_replicas, *shape), row r = replica r's value.
        self._value = value

    @property
    def on_read(self) -> bool:
        return self.synchronization is VariableSynchronization.ON_READ

    #: What the error for this variable assigned different values on different replicas inside
    #: ``strategy.run`` tells to do instead (None: the generic advice). A subclass standing for another
    #: library's variables says it in that library's terms.
    varying_assign_hint: ClassVar[str | None] = None

    @property
    def storage(self) -> Any:
        """The value as the strategy stores it (set by its engine and its compiled loops; read ``value()``).

        ON_WRITE: the replicated global value. ON_READ: ``(num_replicas, *shape)``,
        row ``r`` replica ``r``'s part. Setting it replaces the value as it
        is, with no check: use ``assign`` to update a variable. Every read and
        write of the value goes through this property, so a subclass may keep
        the value elsewhere (:mod:`jaxdist.keras.custom_loop` keeps it in a
        Keras variable).
        """
        return self._value

    @storage.setter
    def storage(self, value: Any) -> None:
        self._value = value

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    # -- reading -----------------------------------------------------------------------

    def value(self) -> Any:
        """The variable's value as seen from where it is read.

        Inside ``strategy.run`` (replica context): the replica's value (for
        ON_READ, this replica's own part). In cross-replica context
        (outside ``run``, or inside ``merge_call``): the logical value (for
        ON_READ, the replicas' parts combined by ``aggregation``).
        """
        frame = ctx_lib.current_frame()
        if frame is None:
            if under_foreign_trace():
                raise ConfigurationError(_FOREIGN_JIT_HELP.format(name=self.name, what="read"))
            return self._eager_read()
        return frame.read(self)

    read_value = value

    def numpy(self) -> np.ndarray:
        """The logical value on the host (cross-replica read)."""
        return np.asarray(self.value())

    def _eager_read(self) -> Any:
        rep = ctx_lib.current_replica()
        stored = self.storage
        if not self.on_read:
            return stored
        if rep is not None and rep.axis_name is None and not ctx_lib.in_merge():
            return stored[0]  # default strategy, replica context: the one replica's part
        return self.distribute_strategy.engine.aggregate_on_read(stored, self.aggregation)

    # -- writing -----------------------------------------------------------------------

    def assign(self, value: Any, read_value: bool = True) -> Any:
        """Set the variable (TF's ``assign``; see the module docstring for replica context).

        Returns:
            The new value when ``read_value`` (else None).
        """
        return self._update("assign", value, read_value)

    def assign_add(self, delta: Any, read_value: bool = True) -> Any:
        """Add ``delta`` (in replica context, ``aggregation`` first combines the replicas' deltas)."""
        return self._update("add", delta, read_value)

    def assign_sub(self, delta: Any, read_value: bool = True) -> Any:
        """Subtract ``delta`` (as :meth:`assign_add`)."""
        return self._update("sub", delta, read_value)

    def _checked(self, value: Any) -> Any:
        v = jnp.asarray(value)
        if v.shape != self.shape:
            raise ValueError(
                f"cannot assign a value of shape {v.shape} to variable {self.name!r} of shape {self.shape} "
                "(as in TF, assign does not broadcast: pass jnp.broadcast_to(value, var.shape))"
            )
        if v.dtype != self.dtype:
            if jnp.issubdtype(self.dtype, jnp.integer) and jnp.issubdtype(v.dtype, jnp.inexact):
                raise TypeError(f"cannot assign a {v.dtype} value to the {self.dtype} variable {self.name!r}")
            v = v.astype(self.dtype)
        return v

    def _update(self, op: str, value: Any, read_value: bool) -> Any:
        frame = ctx_lib.current_frame()
        if frame is None:
            if under_foreign_trace() or isinstance(value, jax.core.Tracer):
                raise ConfigurationError(_FOREIGN_JIT_HELP.format(name=self.name, what="assigned"))
            self._eager_update(op, value)
        else:
            frame.update(self, op, value)
        return self.value() if read_value else None

    def _eager_update(self, op: str, value: Any) -> None:
        s = self.distribute_strategy.engine
        rep = ctx_lib.current_replica()
        local = rep is not None and rep.axis_name is None and not ctx_lib.in_merge()
        v = self._checked(value)
        if not self.on_read:
            new = v if op == "assign" else _apply(op, self.storage, v)
            self.storage = s.store_variable(self._checked(new))
            return
        if local:  # default strategy, replica context: the one replica's part
            new = v if op == "assign" else _apply(op, self.storage[0], v)
            self.storage = s.store_on_read(jnp.asarray(new)[None])
            return
        # Cross-replica update of a sync-on-read variable: the logical value becomes the result.
        cur = self._eager_read()
        new = v if op == "assign" else _apply(op, cur, v)
        self.storage = s.store_on_read(_on_read_layout(jnp.asarray(new), self.aggregation, s.num_replicas))

    # -- conversions -------------------------------------------------------------------

    def __jax_array__(self) -> Any:
        return self.value()

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = np.asarray(self.value())
        return arr if dtype is None else arr.astype(dtype)

    def __float__(self) -> float:
        return float(self.value())

    def __int__(self) -> int:
        return int(self.value())

    def __bool__(self) -> bool:
        return bool(self.value())

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a scalar variable")
        return self.shape[0]

    def __getitem__(self, idx: Any) -> Any:
        return self.value()[idx]

    def __iter__(self) -> Any:
        return iter(self.value())

    def __repr__(self) -> str:
        kind = "SyncOnReadVariable" if self.on_read else "MirroredVariable"
        return f"<{kind} {self.name!r} shape={self.shape} dtype={self.dtype}>"

    # Arithmetic reads the value, as a TF variable converts to a tensor.
    def __neg__(self) -> Any:
        return -self.value()

    def __pos__(self) -> Any:
        return self.value()

    def __abs__(self) -> Any:
        return abs(self.value())


def _binop(name: str) -> Callable[..., Any]:
    def op(self: SyncVariable, other: Any) -> Any:
        other = other.value() if isinstance(other, SyncVariable) else other
        return getattr(self.value(), name)(other)

    op.__name__ = name
    return op


for _name in (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__pow__", "__rpow__", "__matmul__", "__rmatmul__",
    "__lt__", "__le__", "__gt__", "__ge__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__",
):
    setattr(SyncVariable, _name, _binop(_name))


def _apply(op: str, old: Any, delta: Any) -> Any:
    return old + delta if op == "add" else old - delta


def _on_read_layout(value: Any, aggregation: VariableAggregation, r: int) -> Any:
    """Per-replica parts whose ``aggregation`` is ``value`` (cross-replica assign of an ON_READ variable).

    SUM puts the whole value on replica 0 and zeros elsewhere, so the sum is
    exact even for integers (TF divides the value by the replica count); the
    other aggregations give every replica the value.
    """
    if aggregation is VariableAggregation.SUM:
        return jnp.concatenate([value[None], jnp.zeros((r - 1, *value.shape), value.dtype)]) if r > 1 else value[None]
    return jnp.broadcast_to(value[None], (r, *value.shape))


# ---------------------------------------------------------------------------------------
# Frames: variable state threaded through a trace
# ---------------------------------------------------------------------------------------


class VarFrame:
    """Variable values inside one trace (base class).

    ``touched`` lists every variable read or updated (in order); ``assigned``
    the updated ones. ``discover`` frames only record (reads return values
    from the enclosing frame, or the variables' current values); ``trace``
    frames map each variable to the traced input the compiled program gets.
    """

    def __init__(self, discover: bool, parent: VarFrame | None) -> None:
        self.discover = discover
        self.parent = parent
        self.values: dict[SyncVariable, Any] = {}
        self.touched: dict[SyncVariable, None] = {}
        self.assigned: dict[SyncVariable, None] = {}
        #: Strategies whose run/reduce ran inside this frame (their outputs are mirrored values).
        self.strategies: set[Strategy] = set()

    def source_global(self, var: SyncVariable) -> Any:
        """The variable's global value where this frame gets it from: the enclosing frame, or the variable."""
        if self.parent is not None:
            return self.parent.global_value(var)
        return var.storage

    def global_value(self, var: SyncVariable) -> Any:
        raise NotImplementedError

    def read(self, var: SyncVariable) -> Any:
        raise NotImplementedError

    def update(self, var: SyncVariable, op: str, value: Any) -> None:
        raise NotImplementedError


class GlobalFrame(VarFrame):
    """Frame of :func:`jaxdist.function`: global (cross-replica) values, one program for the whole function."""

    def global_value(self, var: SyncVariable) -> Any:
        self.touched[var] = None
        if var in self.values:
            return self.values[var]
        if not self.discover:
            raise ConfigurationError(
                f"variable {var.name!r} was not used when jaxdist.function first traced this function; its "
                "variables must not depend on data (use the same variables on every call)"
            )
        return self.source_global(var)

    def read(self, var: SyncVariable) -> Any:
        g = self.global_value(var)
        if not var.on_read:
            return g
        rep = ctx_lib.current_replica()
        if rep is not None and rep.axis_name is None and not ctx_lib.in_merge():
            return g[0]
        return aggregate_stacked(g, var.aggregation)

    def update(self, var: SyncVariable, op: str, value: Any) -> None:
        v = var._checked(value)
        rep = ctx_lib.current_replica()
        local = rep is not None and rep.axis_name is None and not ctx_lib.in_merge()
        if not var.on_read:
            new = v if op == "assign" else _apply(op, self.global_value(var), v)
        elif local:
            new = (v if op == "assign" else _apply(op, self.global_value(var)[0], v))[None]
        else:
            cur = self.read(var)
            logical = v if op == "assign" else _apply(op, cur, v)
            new = _on_read_layout(logical, var.aggregation, var.distribute_strategy.num_replicas_in_sync)
        self.values[var] = new.astype(var.dtype)
        self.touched[var] = None
        self.assigned[var] = None


def aggregate_stacked(stacked: Any, aggregation: VariableAggregation) -> Any:
    """Combine per-replica parts (leading axis) as an ON_READ variable's read does."""
    if aggregation is VariableAggregation.SUM:
        return jnp.sum(stacked, axis=0).astype(stacked.dtype)
    if aggregation is VariableAggregation.MEAN:
        return jnp.mean(stacked, axis=0).astype(stacked.dtype)
    return stacked[0]  # ONLY_FIRST_REPLICA; NONE reads replica 0, as TF's primary component


class ReplicaFrame(VarFrame):
    """Frame of ``strategy.run`` while it traces ``fn``: per-replica (local) views inside shard_map.

    Args:
        strategy: the strategy running ``fn``; variables of another strategy are refused.
        axis: the replica mesh axis.
    """

    def __init__(self, strategy: Strategy, axis: str, discover: bool, parent: VarFrame | None) -> None:
        super().__init__(discover, parent)
        self.strategy = strategy
        self.axis = axis

    def _check(self, var: SyncVariable) -> None:
        if var.distribute_strategy is not self.strategy:
            from jaxdist.sync.strategy import is_default_strategy

            owner = (
                "was created outside every strategy.scope()"
                if is_default_strategy(var.distribute_strategy)
                else f"belongs to {type(var.distribute_strategy).__name__}"
            )
            raise ConfigurationError(
                f"variable {var.name!r} {owner}, but it is used inside {type(self.strategy).__name__}.run; "
                "create it in this strategy's scope"
            )

    def local(self, var: SyncVariable) -> Any:
        self._check(var)
        self.touched[var] = None
        if var in self.values:
            return self.values[var]
        if not self.discover:
            raise ConfigurationError(
                f"variable {var.name!r} was not used when strategy.run first traced this function; the variables "
                "fn uses must not depend on data"
            )
        g = self.source_global(var)
        if var.on_read:
            # Replica 0's part stands for every replica's while the frame only discovers.
            return g[0]
        return g

    def global_value(self, var: SyncVariable) -> Any:
        raise ConfigurationError(
            f"variable {var.name!r}: a compiled function nested inside strategy.run cannot read variables "
            "globally; read it inside fn"
        )

    def read(self, var: SyncVariable) -> Any:
        loc = self.local(var)
        if var.on_read and ctx_lib.in_merge():
            return _aggregate_in_replica(loc, var.aggregation, self.axis)
        return loc

    def update(self, var: SyncVariable, op: str, value: Any) -> None:
        v = var._checked(value)
        merge = ctx_lib.in_merge()
        if var.on_read:
            if merge:  # cross-replica assign inside merge_fn: the logical value becomes `new`
                cur = _aggregate_in_replica(self.local(var), var.aggregation, self.axis)
                logical = v if op == "assign" else _apply(op, cur, v)
                if var.aggregation is VariableAggregation.SUM:
                    first = jax.lax.axis_index(self.axis) == 0
                    new = jnp.where(first, logical, jnp.zeros_like(logical))
                else:
                    new = logical
            else:
                new = v if op == "assign" else _apply(op, self.local(var), v)
        else:
            if not merge:
                v = _aggregate_update(v, var, self.axis)
            new = v if op == "assign" else _apply(op, self.local(var), v)
        self.values[var] = jnp.asarray(new).astype(var.dtype)
        self.touched[var] = None
        self.assigned[var] = None


def _aggregate_in_replica(local: Any, aggregation: VariableAggregation, axis: str) -> Any:
    if aggregation is VariableAggregation.SUM:
        return jax.lax.psum(local, axis)
    if aggregation is VariableAggregation.MEAN:
        return jax.lax.pmean(local, axis)
    return _first_replica(local, axis)


def _first_replica(x: Any, axis: str) -> Any:
    first = jax.lax.axis_index(axis) == 0
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_:
        return jax.lax.psum(jnp.where(first, x, False).astype(jnp.int32), axis).astype(jnp.bool_)
    return jax.lax.psum(jnp.where(first, x, jnp.zeros_like(x)), axis)


def _aggregate_update(v: Any, var: SyncVariable, axis: str) -> Any:
    """Combine the replicas' update values of a mirrored variable by its aggregation (TF's merge_call)."""
    agg = var.aggregation
    if agg is VariableAggregation.NONE:
        return v  # must already be the same on every replica: checked when run compiles
    if agg is VariableAggregation.MEAN:
        if not jnp.issubdtype(var.dtype, jnp.floating):
            raise ValueError(
                f"Cannot update non-float variable {var.name!r} with VariableAggregation.MEAN in replica context. "
                "Either change the variable dtype to float or update it in cross-replica context."
            )
        return jax.lax.pmean(v, axis)
    if agg is VariableAggregation.SUM:
        return jax.lax.psum(v, axis)
    return _first_replica(v, axis)


# ---------------------------------------------------------------------------------------
# Creation
# ---------------------------------------------------------------------------------------


def _path_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return re.sub(r"[^A-Za-z0-9_.\-]", "_", str(getattr(entry, attr)))
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", str(entry))


def create_variable(
    initial_value: Any,
    *,
    name: str | None = None,
    trainable: bool | None = None,
    synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
    aggregation: VariableAggregation | str = VariableAggregation.NONE,
    dtype: Any = None,
    checkpoint: bool = True,
    strategy: Strategy | None = None,
) -> SyncVariable:
    """Create a variable of the current strategy (TF: ``tf.Variable(...)`` inside ``strategy.scope()``).

    Args:
        initial_value: an array, or a no-argument callable returning one.
        name: unique name (default ``"Variable"``, numbered on collision as TF does).
        trainable: default True, False for ON_READ variables (as TF).
        synchronization: ``AUTO``/``ON_WRITE`` (mirrored) or ``ON_READ``; ``NONE`` is refused as in TF.
        aggregation: how replicas' values combine (see the module docstring).
        dtype: convert the initial value to this dtype.
        checkpoint: whether :class:`jaxdist.Checkpoint` saves it (metrics pass False).
        strategy: default ``jaxdist.get_strategy()``.

    Returns:
        The :class:`SyncVariable`. An ON_READ variable starts with the
        initial value on every replica, as TF.
    """
    from jaxdist.sync.strategy import Strategy

    s = strategy if strategy is not None else ctx_lib.get_strategy()
    if not isinstance(s, Strategy):
        raise ConfigurationError(
            f"{type(s).__name__} does not hold synchronous variables; inside ParameterServerStrategy.scope() use "
            "jaxdist.create_variable(s), which places variables on the parameter servers"
        )
    sync = _coerce(VariableSynchronization, synchronization, "synchronization")
    agg = _coerce(VariableAggregation, aggregation, "aggregation")
    if sync is VariableSynchronization.NONE:
        raise ValueError(
            "`NONE` variable synchronization mode is not supported with a tf.distribute-style strategy. Please "
            f"change the `synchronization` for variable {name!r} to AUTO, ON_WRITE or ON_READ"
        )
    if sync is VariableSynchronization.AUTO:
        sync = VariableSynchronization.ON_WRITE
    if trainable is None:
        trainable = sync is not VariableSynchronization.ON_READ
    elif trainable and sync is VariableSynchronization.ON_READ:
        raise ValueError(
            f"variable {name!r}: synchronization=ON_READ cannot be trainable (as in TF); pass trainable=False"
        )
    if callable(initial_value):
        initial_value = initial_value()
    with jax.ensure_compile_time_eval():
        value = jnp.asarray(initial_value) if dtype is None else jnp.asarray(initial_value, dtype)
    if isinstance(value, jax.core.Tracer):
        raise ConfigurationError(
            f"variable {name!r}: the initial value is a traced value. Create variables in strategy.scope() "
            "outside compiled code (TF: tf.function supports only variables created on its first call)"
        )
    return s.engine.create_variable(value, name, trainable, sync, agg, checkpoint)


def create_variables(
    tree: Any,
    *,
    name: str | None = None,
    trainable: bool = True,
    synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
    aggregation: VariableAggregation | str = VariableAggregation.NONE,
    checkpoint: bool = True,
    strategy: Strategy | None = None,
) -> Any:
    """One variable per array leaf of ``tree``; returns the same tree of :class:`SyncVariable` s.

    Names are ``{name}/{path}`` (default prefix ``params``), as
    ``jaxdist.create_variables`` names PS variables, so checkpoints move
    between strategies.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    prefix = name or "params"
    out = []
    for path, leaf in leaves:
        suffix = "/".join(_path_name(p) for p in path)
        out.append(
            create_variable(
                leaf,
                name=f"{prefix}/{suffix}" if suffix else prefix,
                trainable=trainable,
                synchronization=synchronization,
                aggregation=aggregation,
                checkpoint=checkpoint,
                strategy=strategy,
            )
        )
    return jax.tree_util.tree_unflatten(treedef, out)


def is_variable(x: object) -> bool:
    return isinstance(x, SyncVariable)


def read_variables(tree: Any) -> Any:
    """The values of every :class:`SyncVariable` in ``tree`` (other leaves unchanged).

    Use it to hand a model's parameters to ``jax.grad``: inside
    ``strategy.run`` the values are the replica's view.
    """
    return jax.tree.map(lambda v: v.value() if isinstance(v, SyncVariable) else v, tree)


def assign_variables(variables: Any, values: Any) -> None:
    """``var.assign(value)`` for matching leaves of two trees of the same structure."""
    vs, vdef = jax.tree.flatten(variables)
    xs = vdef.flatten_up_to(values)
    for v, x in zip(vs, xs):
        if not isinstance(v, SyncVariable):
            raise TypeError(f"assign_variables: {v!r} is not a variable")
        v.assign(x, read_value=False)


def variables_in(tree: Any) -> Iterable[SyncVariable]:
    return [v for v in jax.tree.leaves(tree) if isinstance(v, SyncVariable)]
