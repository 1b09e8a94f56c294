"""Which kind of strategy ``jaxdist.create_variable(s)`` creates variables for.

``jaxdist.create_variables(tree)`` is one call for every strategy: inside a
``ParameterServerStrategy.scope()`` it places variables on the PS tasks;
inside a synchronous strategy's scope (Mirrored, TPU, OneDevice,
CentralStorage, MultiWorkerMirrored, or ``jaxdist.get_strategy().scope()``
for the default strategy) it makes that strategy's mirrored variables.
Outside any scope it keeps the PS behaviour (an error that says to open a
scope), so a PS script that forgot its scope is not silently trained locally.
"""

from __future__ import annotations

from typing import Any

from jaxdist.base.errors import ConfigurationError

__all__ = ["sync_strategy_in_scope"]

#: Arguments only the parameter-server strategy understands.
_PS_ONLY = ("optimizer", "if_exists", "initializer", "shape")


def sync_strategy_in_scope(kwargs: dict[str, Any]) -> Any:
    """The synchronous strategy whose scope is innermost, or None (then the PS path applies)."""
    from jaxdist.sync import context as ctx_lib
    from jaxdist.sync.strategy import Strategy

    top = ctx_lib.innermost_scope()
    if not isinstance(top, Strategy):
        return None
    bad = [k for k in _PS_ONLY if kwargs.get(k) is not None]
    if bad:
        raise ConfigurationError(
            f"create_variable(s)({', '.join(bad)}=...) configures ParameterServerStrategy variables; inside "
            f"{type(top).__name__}.scope() variables are mirrored: apply optimizers with jaxdist.Optimizer and "
            "pass initial values"
        )
    for k in _PS_ONLY:
        kwargs.pop(k, None)
    return top
