"""A Keras optimizer as the optax transformation the parameter servers apply (Keras's update rules, exactly).

Under ``ParameterServerStrategy`` the optimizer runs on the PS, one variable
(shard) at a time (:mod:`jaxdist.ps_server.optimizer`). :func:`to_optax`
turns the optimizer given to ``model.compile`` into an optax
``GradientTransformation`` computing Keras 3.15's own update of that
optimizer (not optax's similarly named one: Keras's Adam adds ``epsilon`` to
``sqrt(v)`` before bias correction, its RMSprop and Adagrad add it inside the
square root), so a PS run with one worker follows Keras's single-device run.

Supported: ``SGD`` (``momentum``, ``nesterov``), ``Adam`` (``amsgrad``),
``RMSprop`` (``rho``, ``momentum``, ``centered``), ``Adagrad``
(``initial_accumulator_value``), each with a constant float learning rate;
``clipnorm``, ``global_clipnorm`` and ``clipvalue`` are applied by the
workers (:func:`clipping_of`). Anything else (another optimizer class, a
learning-rate schedule, ``weight_decay``, EMA, loss scaling, gradient
accumulation) raises
:class:`UnsupportedOptimizerError`: the PS would otherwise silently apply
another rule.

The update functions are made inside :func:`to_optax` (closures), so
cloudpickle ships them by value: a PS unpickles them without importing Keras.
"""

from __future__ import annotations

import logging
from typing import Any

import jax.numpy as jnp
import optax

from jaxdist.base.errors import ConfigurationError
from jaxdist.keras import compat

logger = logging.getLogger(__name__)

__all__ = ["UnsupportedOptimizerError", "clipping_of", "learning_rate_of", "to_optax"]


class UnsupportedOptimizerError(ConfigurationError):
    """The Keras optimizer (or one of its settings) has no PS-side equivalent in jaxdist."""


#: Base-optimizer settings that must keep their defaults (what the PS does not implement).
_MUST_BE_UNSET = ("weight_decay", "loss_scale_factor", "gradient_accumulation_steps")


def learning_rate_of(optimizer: Any) -> float:
    """The optimizer's constant learning rate (a schedule or callable raises UnsupportedOptimizerError)."""
    lr = compat.raw_learning_rate(optimizer)
    from keras.optimizers.schedules import LearningRateSchedule

    if isinstance(lr, LearningRateSchedule) or (callable(lr) and not hasattr(lr, "numpy")):
        raise UnsupportedOptimizerError(
            f"{type(optimizer).__name__} with a learning-rate schedule: under ParameterServerStrategy the PS applies "
            "a constant learning rate; pass a float"
        )
    return float(optimizer.learning_rate.numpy() if hasattr(optimizer.learning_rate, "numpy") else optimizer.learning_rate)


def _check_base(optimizer: Any) -> None:
    cfg = optimizer.get_config()
    for key in _MUST_BE_UNSET:
        if cfg.get(key) not in (None, 0, 0.0):
            raise UnsupportedOptimizerError(
                f"{type(optimizer).__name__}({key}={cfg[key]!r}) is not supported under ParameterServerStrategy "
                "(the PS applies the optimizer one variable at a time)"
            )
    if cfg.get("use_ema"):
        raise UnsupportedOptimizerError("use_ema=True is not supported under ParameterServerStrategy")


def clipping_of(optimizer: Any) -> dict[str, float]:
    """The optimizer's gradient clipping (``clipnorm``, ``global_clipnorm``, ``clipvalue``; unset ones left out).

    Clipping runs on the worker, which has every variable's whole gradient
    (a partitioned variable's shards reach their PS tasks separately), with
    Keras's own code (:class:`jaxdist.keras.ps_worker.TrainSteps`).
    """
    cfg = optimizer.get_config()
    return {k: float(cfg[k]) for k in ("clipnorm", "global_clipnorm", "clipvalue") if cfg.get(k) is not None}


def to_optax(optimizer: Any) -> optax.GradientTransformation:
    """The optax transformation applying ``optimizer``'s Keras update rule (see the module docstring).

    Raises:
        UnsupportedOptimizerError: an optimizer class or setting the PS does not implement.
    """
    import keras

    _check_base(optimizer)
    lr = learning_rate_of(optimizer)
    name = type(optimizer).__name__
    if type(optimizer) is keras.optimizers.SGD:
        rule = _sgd(lr, float(optimizer.momentum), bool(optimizer.nesterov))
    elif type(optimizer) is keras.optimizers.Adam:
        rule = _adam(lr, float(optimizer.beta_1), float(optimizer.beta_2), float(optimizer.epsilon), bool(optimizer.amsgrad))
    elif type(optimizer) is keras.optimizers.RMSprop:
        rule = _rmsprop(lr, float(optimizer.rho), float(optimizer.momentum), float(optimizer.epsilon), bool(optimizer.centered))
    elif type(optimizer) is keras.optimizers.Adagrad:
        rule = _adagrad(lr, float(optimizer.initial_accumulator_value), float(optimizer.epsilon))
    else:
        raise UnsupportedOptimizerError(
            f"Keras optimizer {name} is not supported under ParameterServerStrategy; use SGD, Adam, RMSprop or Adagrad"
        )
    return rule


def _sgd(lr: float, momentum: float, nesterov: bool) -> optax.GradientTransformation:
    def init(params: Any) -> tuple[Any, ...]:
        return (jnp.zeros((), jnp.int32), jnp.zeros_like(params) if momentum != 0 else None, None, None)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, tuple[Any, ...]]:
        g = grads if params is None else grads.astype(params.dtype)
        if momentum == 0:
            return -lr * g, (state[0] + 1, None, None, None)
        m = state[1] * momentum - g * lr
        upd = m * momentum - g * lr if nesterov else m
        return upd, (state[0] + 1, m, None, None)

    return optax.GradientTransformation(init, update)


def _adam(lr: float, b1: float, b2: float, eps: float, amsgrad: bool) -> optax.GradientTransformation:
    def init(params: Any) -> tuple[Any, ...]:
        return (jnp.zeros((), jnp.int32), jnp.zeros_like(params), jnp.zeros_like(params), jnp.zeros_like(params) if amsgrad else None)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, tuple[Any, ...]]:
        dt = state[1].dtype
        g = grads.astype(dt)
        t = (state[0] + 1).astype(dt)
        alpha = lr * jnp.sqrt(1 - jnp.power(jnp.asarray(b2, dt), t)) / (1 - jnp.power(jnp.asarray(b1, dt), t))
        m = state[1] + (g - state[1]) * (1 - b1)
        v = state[2] + (jnp.square(g) - state[2]) * (1 - b2)
        vh = state[3]
        if amsgrad:
            vh = jnp.maximum(state[3], v)
        upd = -(m * alpha) / (jnp.sqrt(vh if amsgrad else v) + eps)
        return upd, (state[0] + 1, m, v, vh)

    return optax.GradientTransformation(init, update)


def _rmsprop(lr: float, rho: float, momentum: float, eps: float, centered: bool) -> optax.GradientTransformation:
    def init(params: Any) -> tuple[Any, ...]:
        return (jnp.zeros((), jnp.int32), jnp.zeros_like(params), jnp.zeros_like(params) if momentum > 0 else None,
                          jnp.zeros_like(params) if centered else None)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, tuple[Any, ...]]:
        g = grads.astype(state[1].dtype)
        velocity = rho * state[1] + (1 - rho) * jnp.square(g)
        avg = state[3]
        if centered:
            avg = rho * state[3] + (1 - rho) * g
            denominator = velocity - jnp.square(avg) + eps
        else:
            denominator = velocity + eps
        increment = lr * g / jnp.sqrt(denominator)
        mom = state[2]
        if momentum > 0:
            mom = momentum * state[2] + increment
            return -mom, (state[0] + 1, velocity, mom, avg)
        return -increment, (state[0] + 1, velocity, mom, avg)

    return optax.GradientTransformation(init, update)


def _adagrad(lr: float, initial: float, eps: float) -> optax.GradientTransformation:
    def init(params: Any) -> tuple[Any, ...]:
        return (jnp.zeros((), jnp.int32), jnp.full_like(params, initial), None, None)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, tuple[Any, ...]]:
        g = grads.astype(state[1].dtype)
        acc = state[1] + jnp.square(g)
        return -(lr * g) / jnp.sqrt(acc + eps), (state[0] + 1, acc, None, None)

    return optax.GradientTransformation(init, update)
