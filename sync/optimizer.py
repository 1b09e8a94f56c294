"""``jaxdist.Optimizer``: any optax transformation, applied to variables as TF's optimizers do.

Inside ``strategy.run`` (replica context), :meth:`Optimizer.apply_gradients`
first **sums the replicas' gradients** with an all-reduce (TF's
``experimental_aggregate_gradients=True``: with losses scaled by
:func:`jaxdist.compute_average_loss`, the sum is the gradient of the
global-batch mean), then runs ``tx.update`` and assigns the new parameters
and optimizer state, which are mirrored variables of the strategy. The
all-reduce follows the strategy's ``cross_device_ops`` /
``communication_options``. Outside any strategy (or on OneDevice) there is
nothing to aggregate.

The optimizer's state is built on first use (or by :meth:`Optimizer.build`)
from ``tx.init(params)`` and kept as variables of the parameters'
strategy. For checkpoints it is also described *per variable*: for
element-wise transformations (SGD, momentum, Adam, RMSProp, ...) the state of
parameter ``w`` is exactly ``tx.init(w)``'s, which is how the
parameter-server strategy stores optimizer state, so checkpoints move between
strategies with their optimizer state.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxdist.base.errors import ConfigurationError
from jaxdist.sync import context as ctx_lib
from jaxdist.sync.reduce_op import ReduceOp
from jaxdist.sync.strategy import Strategy
from jaxdist.sync.variables import SyncVariable, create_variable

logger = logging.getLogger(__name__)

__all__ = ["Optimizer"]


def per_variable_layout(tx: optax.GradientTransformation, params: Any, state: Any) -> list[list[int]] | None:
    """For each parameter leaf, the indices of ``state``'s leaves that make up ``tx.init(leaf)``.

    Sub-trees of ``state`` shaped like ``params`` (moments, traces) hold one
    leaf per parameter; every other leaf (step counts) is shared. Returns
    None when the transformation's state is not per-parameter (then it is
    checkpointed as whole-state variables).
    """
    ptree = jax.tree.structure(params)
    p_leaves = jax.tree.leaves(params)
    s_leaves, sdef = jax.tree.flatten(state)
    idx_tree = jax.tree.unflatten(sdef, list(range(len(s_leaves))))

    def is_ptree(x: Any) -> bool:
        try:
            return jax.tree.structure(x) == ptree
        except Exception:  # noqa: BLE001 - exotic nodes: not a params-shaped subtree
            return False

    groups, gdef = jax.tree.flatten(idx_tree, is_leaf=is_ptree)
    layout = []
    for i, p in enumerate(p_leaves):
        idx = [jax.tree.leaves(g)[i] if is_ptree(g) else g for g in groups]
        try:
            single = jax.eval_shape(tx.init, jax.ShapeDtypeStruct(jnp.shape(p), jnp.asarray(p).dtype))
        except Exception:  # noqa: BLE001 - e.g. multi_transform's labels need the whole tree: not per variable
            return None
        sl, sd = jax.tree.flatten(single)
        if sd != gdef or len(sl) != len(idx):
            return None
        for leaf, j in zip(sl, idx):
            ref = s_leaves[j]
            if tuple(leaf.shape) != tuple(jnp.shape(ref)) or leaf.dtype != jnp.asarray(ref).dtype:
                return None
        layout.append(idx)
    return layout


class Optimizer:
    """An optax ``GradientTransformation`` that updates jaxdist variables (TF's ``optimizer.apply_gradients``).

    Args:
        tx: any optax transformation (``optax.adam(1e-3)``, a chain, ...).
        name: prefix of its state variables' names (``optimizer/iterations``...).

    Attributes:
        iterations: how many times gradients were applied (an int32 variable, as TF's).
    """

    def __init__(self, tx: optax.GradientTransformation, *, name: str = "optimizer") -> None:
        if not hasattr(tx, "init") or not hasattr(tx, "update"):
            raise TypeError(f"Optimizer wants an optax GradientTransformation, got {type(tx).__name__}")
        self.tx = tx
        self.name = name
        self.strategy: Strategy | None = None
        self.iterations: SyncVariable | None = None
        self._vars: list[SyncVariable] | None = None
        self._vdef: Any = None
        self._state_vars: list[SyncVariable] = []
        self._sdef: Any = None
        self._layout: list[list[int]] | None = None
        #: Optimizer state restored from a checkpoint before the optimizer was built (applied by build).
        self._pending_restore: dict[str, list[Any]] | None = None
        self._pending_variables: dict[str, Any] = {}
        current = ctx_lib.get_strategy()
        if isinstance(current, Strategy):
            current.engine.add_optimizer(self)  # so Checkpoint.restore can hand it state before it is built

    @property
    def built(self) -> bool:
        return self._vars is not None

    @property
    def parameters(self) -> list[SyncVariable] | None:
        """The variables it updates, in its order (None until it is built)."""
        return None if self._vars is None else list(self._vars)

    @property
    def per_variable(self) -> bool:
        """Whether its state is kept per parameter (checkpoints then store ``opt/<param>/<i>``, as a PS does).

        False until built, and for transformations whose state is not per
        parameter (those are checkpointed as whole-state variables).
        """
        return self._layout is not None

    @property
    def variables(self) -> list[SyncVariable]:
        """The optimizer's own variables (state leaves, then ``iterations``)."""
        return [*self._state_vars, *([self.iterations] if self.iterations is not None else [])]

    def build(self, variables: Any) -> None:
        """Create the optimizer state for ``variables`` (a tree of variables of one strategy).

        Called by the first :meth:`apply`; call it yourself to create the
        state before compiling (e.g. in ``strategy.scope()`` next to the model).
        """
        leaves, vdef = jax.tree.flatten(variables)
        if not leaves or not all(isinstance(v, SyncVariable) for v in leaves):
            raise TypeError("Optimizer.build wants a tree of variables made with jaxdist.create_variables")
        strategies = {v.distribute_strategy for v in leaves}
        if len(strategies) != 1:
            raise ConfigurationError("Optimizer: the variables belong to different strategies")
        if self._vars is not None:
            if vdef != self._vdef or any(a is not b for a, b in zip(leaves, self._vars)):
                raise ConfigurationError(
                    f"Optimizer {self.name!r} was built for other variables; use one optimizer per set of variables"
                )
            return
        strategy = strategies.pop()
        values = jax.tree.unflatten(vdef, [v.value() for v in leaves])
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(values)):
            raise ConfigurationError(
                f"Optimizer {self.name!r} is first used inside compiled code whose variable values are not known "
                "yet; call optimizer.build(variables) in strategy.scope() before the training loop"
            )
        with jax.ensure_compile_time_eval():
            state = self.tx.init(values)
        s_leaves, sdef = jax.tree.flatten(state)
        layout = per_variable_layout(self.tx, values, state)
        if layout is None:
            logger.info(
                "optimizer %r: its optax state is not per parameter; checkpoints store it as whole-state variables "
                "(they restore into the same optimizer, not into another strategy's per-variable layout)",
                self.name,
            )
        pending = self._pending_restore
        if pending and layout is not None:
            for var, idx in zip(leaves, layout):
                saved = pending.get(var.name)
                if saved:
                    if len(saved) != len(idx):
                        raise ConfigurationError(
                            f"optimizer state of {var.name!r} in the checkpoint has {len(saved)} leaves, {self.name!r} "
                            f"has {len(idx)}; restore with the same optax transformation"
                        )
                    for j, leaf in zip(idx, saved):
                        ref = s_leaves[j]
                        s_leaves[j] = np.asarray(leaf).reshape(np.shape(ref)).astype(np.asarray(ref).dtype)
            self._pending_restore = None
        saved_vars, self._pending_variables = self._pending_variables, {}
        if layout is None:
            for i in range(len(s_leaves)):
                saved = saved_vars.get(f"{self.name}/state/{i}")
                if saved is not None:
                    s_leaves[i] = np.asarray(saved).reshape(np.shape(s_leaves[i])).astype(np.asarray(s_leaves[i]).dtype)
        iterations = np.asarray(saved_vars.get(f"{self.name}/iterations", 0), np.int32).reshape(())
        with jax.ensure_compile_time_eval():
            self._state_vars = [
                create_variable(
                    leaf, name=f"{self.name}/state/{i}", trainable=False, checkpoint=layout is None, strategy=strategy
                )
                for i, leaf in enumerate(s_leaves)
            ]
            self.iterations = create_variable(
                iterations, name=f"{self.name}/iterations", trainable=False, strategy=strategy
            )
        self._sdef, self._layout = sdef, layout
        self._vars, self._vdef, self.strategy = list(leaves), vdef, strategy
        strategy.engine.add_optimizer(self)

    def apply_gradients(
        self,
        grads_and_vars: Iterable[tuple[Any, SyncVariable]],
        name: str | None = None,
        skip_gradients_aggregation: bool = False,
        experimental_aggregate_gradients: bool = True,
    ) -> Any:
        """Apply ``(gradient, variable)`` pairs (TF/Keras's signature); see :meth:`apply`.

        ``skip_gradients_aggregation=True`` or
        ``experimental_aggregate_gradients=False``: the gradients are already
        summed across replicas (a value that still differs between replicas
        then makes ``run`` raise, instead of letting the copies drift).
        """
        del name  # TF's op name: nothing to name in JAX
        pairs = list(grads_and_vars)
        if not pairs:
            raise ValueError("apply_gradients got no (gradient, variable) pairs")
        grads = [g for g, _ in pairs]
        variables = [v for _, v in pairs]
        aggregate = experimental_aggregate_gradients and not skip_gradients_aggregation
        return self.apply(grads, variables, aggregate=aggregate)

    def apply(self, grads: Any, variables: Any = None, *, aggregate: bool = True) -> Any:
        """Update ``variables`` (a tree of variables) with ``grads`` (the same tree of arrays).

        Inside ``strategy.run`` the gradients are first summed across the
        replicas (unless ``aggregate=False``). Returns the new ``iterations``.

        Raises:
            RuntimeError: called in cross-replica context of a multi-replica
                strategy (call it inside ``strategy.run``), as Keras does.
        """
        if variables is None:
            if self._vars is None:
                raise ConfigurationError("Optimizer.apply needs the variables the first time (or call build)")
            variables = jax.tree.unflatten(self._vdef, self._vars)
        given, gdef = jax.tree.flatten(variables)
        g_given = gdef.flatten_up_to(grads)
        if self._vars is None:
            self.build(variables)
        assert self._vars is not None and self.iterations is not None
        if len(given) != len(self._vars) or any(a is not b for a, b in zip(given, self._vars)):
            # The same variables in another order or structure (e.g. zip(grads, vars) lists): match by identity.
            pos = {id(v): i for i, v in enumerate(self._vars)}
            if len(given) != len(self._vars) or {id(v) for v in given} != set(pos):
                raise ConfigurationError(
                    f"Optimizer {self.name!r} was built for {len(self._vars)} variables and got gradients for a "
                    "different set; use one optimizer per set of variables (and pass all of them every step)"
                )
            ordered: list[Any] = [None] * len(given)
            for v, g in zip(given, g_given):
                ordered[pos[id(v)]] = g
            g_given = ordered
        rep = ctx_lib.get_replica_context()
        if rep is None:
            raise RuntimeError(
                "`apply_gradients()` cannot be called in cross-replica context. Use `strategy.run` to enter "
                "replica context (as with TF's optimizers)"
            )
        g_leaves = list(g_given)
        if aggregate and rep.axis_name is not None:
            g_leaves = rep.all_reduce(ReduceOp.SUM, list(g_leaves))
        g_tree = jax.tree.unflatten(self._vdef, list(g_leaves))
        params = jax.tree.unflatten(self._vdef, [v.value() for v in self._vars])
        state = jax.tree.unflatten(self._sdef, [v.value() for v in self._state_vars])
        updates, new_state = self.tx.update(g_tree, state, params)
        new_params = optax.apply_updates(params, updates)
        for v, x in zip(self._vars, jax.tree.leaves(new_params)):
            v.assign(jnp.asarray(x).astype(v.dtype), read_value=False)
        for v, x in zip(self._state_vars, jax.tree.leaves(new_state)):
            v.assign(x, read_value=False)
        return self.iterations.assign_add(jnp.ones((), jnp.int32))

    # -- checkpoints -----------------------------------------------------------------------

    def defer_restore(self, optimizer_state: dict[str, list[Any]], variables: dict[str, Any]) -> None:
        """Keep state restored from a checkpoint before the optimizer is built; :meth:`build` applies it (TF's deferred restoration).

        Args:
            optimizer_state: ``{parameter name: [state leaves]}`` (per-variable state).
            variables: the checkpoint's whole-state variables of this optimizer
                (``<name>/state/<i>``, ``<name>/iterations``), by name.
        """
        if self._vars is not None:
            raise ConfigurationError(f"optimizer {self.name!r} is already built: restore its state directly")
        self._pending_restore = optimizer_state
        self._pending_variables = variables

    def per_variable_state(self) -> dict[str, list[Any]] | None:
        """``{variable name: [state leaves of tx.init(variable)]}`` (cross-replica values), or None."""
        if self._layout is None or self._vars is None:
            return None
        values = [v.value() for v in self._state_vars]
        return {var.name: [values[j] for j in idx] for var, idx in zip(self._vars, self._layout)}

    def restore_per_variable_state(self, per_var: dict[str, list[np.ndarray]]) -> None:
        """Set the state from ``{variable name: [leaves]}`` (shared leaves, e.g. counts, from the first variable)."""
        if self._layout is None or self._vars is None:
            raise ConfigurationError(f"optimizer {self.name!r} does not keep per-variable state")
        new: dict[int, Any] = {}
        for var, idx in zip(self._vars, self._layout):
            leaves = per_var.get(var.name)
            if leaves is None:
                raise ConfigurationError(f"checkpoint has no optimizer state for {var.name!r}")
            if len(leaves) != len(idx):
                raise ConfigurationError(
                    f"optimizer state of {var.name!r}: the checkpoint has {len(leaves)} leaves, "
                    f"{self.name!r} ({self.tx}) has {len(idx)}; restore with the same optax transformation"
                )
            for j, leaf in zip(idx, leaves):
                new.setdefault(j, leaf)
        for j, v in enumerate(self._state_vars):
            v.assign(np.asarray(new[j]).reshape(v.shape).astype(v.dtype), read_value=False)

    def __repr__(self) -> str:
        return f"Optimizer({self.name!r}, built={self.built})"
