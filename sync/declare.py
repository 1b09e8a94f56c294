"""``jaxdist.replicated``: declare that values must be the same on every replica.

In the functional style the state goes in and out of ``strategy.run``::

    params = strategy.replicate(params)

    def train_step(params, batch):
        grads = jax.grad(loss_fn)(params, batch)
        grads = jaxdist.get_replica_context().all_reduce("sum", grads)   # forget this...
        return jaxdist.replicated(optax.apply_updates(params, -0.1 * grads))

    params = strategy.run(train_step, args=(params, batch))

Without the all-reduce each replica's gradient is its own, so each replica's
new params are too: ``run`` returns them as ``PerReplica`` and, fed back in,
every replica trains its own copy (TF's optimizers aggregate for you, so a TF
user does not expect this). ``jaxdist.replicated(tree)`` states the intent:
when ``run`` compiles ``fn`` the replication analysis
(:mod:`jaxdist.sync._varying`) must prove every declared leaf the same on
every replica, or ``run`` raises :class:`~jaxdist.base.errors.ConfigurationError`
naming the leaf (its output path when ``fn`` returns it) and the fix. Declared
leaves that ``fn`` returns come back as replicated ``jax.Array``s.

Where it may be called:

- inside ``fn`` given to ``strategy.run`` / ``run_steps`` / ``run_epoch``
  (also under :func:`jaxdist.function` or ``jax.jit``), on values ``fn``
  computes at its own level (not inside a ``jax.lax.scan`` body, ``vmap`` or
  ``grad`` that ``fn`` runs: those values cannot leave the inner trace; declare
  the inner loop's result instead);
- with one replica (the default strategy, ``OneDeviceStrategy``) every value
  is trivially the same everywhere: nothing can fail, the value is returned
  (with ``OneDeviceStrategy`` declared outputs come back replicated, not as
  one-replica ``PerReplica``);
- in cross-replica context (inside ``scope()``, outside ``run``) it asserts:
  a ``PerReplica`` leaf raises, anything else is returned unchanged.

It returns its argument, so ``return jaxdist.replicated(new_params), loss``
reads naturally. The check runs once per compiled program, at trace time:
it costs nothing per step.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import jax

from jaxdist.base.errors import ConfigurationError
from jaxdist.sync import context as ctx_lib
from jaxdist.sync.values import PerReplica
from jaxdist.sync.variables import SyncVariable

logger = logging.getLogger(__name__)

__all__ = ["replicated", "FIX_HINT"]

#: How to make per-replica values replicated; part of every error this declaration raises.
FIX_HINT = (
    "All-reduce the gradients before applying them: jaxdist.get_replica_context().all_reduce('sum', grads) "
    "inside fn (or jax.lax.psum(grads, jaxdist.sync.AXIS)), or let jaxdist.Optimizer apply them (it all-reduces as "
    "TF's optimizers do); outside run, combine per-replica values with strategy.reduce"
)


def _call_site() -> str:
    """``file:line`` of the code that called :func:`replicated` (for the error message)."""
    frame = sys._getframe(2)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def replicated(value: Any) -> Any:
    """Declare every leaf of ``value`` the same on every replica; return ``value`` unchanged.

    See the module docstring. Inside ``strategy.run``'s ``fn`` the check runs
    when ``run`` compiles ``fn``: a declared leaf the replication analysis
    cannot prove replicated (e.g. params updated with gradients that were not
    all-reduced) makes ``run`` raise ConfigurationError, and nothing runs.

    Raises:
        ConfigurationError: in cross-replica context, for a ``PerReplica``
            leaf; anywhere, for a sync-on-read variable (its parts are
            per-replica by design: read it in cross-replica context instead).
    """
    site = _call_site()
    leaves = jax.tree_util.tree_flatten_with_path(value, is_leaf=lambda x: isinstance(x, (PerReplica, SyncVariable)))[0]
    for _path, leaf in leaves:
        if isinstance(leaf, SyncVariable) and leaf.on_read:
            raise ConfigurationError(
                f"jaxdist.replicated() at {site}: {leaf.name!r} is a sync-on-read variable, one part per replica "
                "by design; read it in cross-replica context (var.value() combines the parts)"
            )
    rctx = ctx_lib.get_replica_context()
    if rctx is None:  # cross-replica context (scope, merge_fn): an assertion on the values at hand
        bad = [jax.tree_util.keystr(path) or "(the value)" for path, leaf in leaves if isinstance(leaf, PerReplica)]
        if bad:
            raise ConfigurationError(
                f"jaxdist.replicated() at {site}: {', '.join(bad)} is a PerReplica value: it differs between "
                f"replicas (did a strategy.run forget an all-reduce?). {FIX_HINT}"
            )
        return value
    if rctx.axis_name is None:
        return value  # the default strategy: one replica, trivially the same everywhere
    # Recorded for run to check when it compiles fn (with one mesh replica, run only returns them replicated).
    for path, leaf in leaves:
        if isinstance(leaf, jax.core.Tracer):
            rctx.declared.append((leaf, f"jaxdist.replicated() at {site}, leaf {jax.tree_util.keystr(path) or '(the value)'}"))
    return value

