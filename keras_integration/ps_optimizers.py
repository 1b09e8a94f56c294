"""A Keras optimizer as the optax transformation the parameter servers apply (Keras's update rules, exactly).

Under ``ParameterServerStrategy`` the optimizer runs on the PS, one variable
(shard) at a time (:mod:`jaxdist.ps_server.optimizer`). :func:`to_optax`
turns the optimizer given to ``model.compile`` into an optax
``GradientTransformation`` computing Keras 3.15's own update of that
optimizer (not optax's similarly named one: Keras's Adam adds ``epsilon`` to
``sqrt(v)`` before bias correction, its RMSprop and Adagrad add it inside the
square root), so a PS run with one worker follows Keras's single-device run.

Supported: ``SGD`` (``momentum``, ``nesterov``), ``Adam`` (``amsgrad``),
``AdamW``, ``Adamax``, ``Nadam``, ``RMSprop`` (``rho``, ``momentum``,
``centered``), ``Adagrad`` (``initial_accumulator_value``) and ``Ftrl``
(every setting), each with a constant float learning rate and any
``weight_decay`` (Keras's decoupled decay, applied before the update to the
variables Keras would decay: :meth:`keras.optimizers.Optimizer.exclude_from_weight_decay`
is honoured); ``clipnorm``, ``global_clipnorm`` and ``clipvalue`` are
applied by the workers (:func:`clipping_of`). Every rule is element-wise, so
:func:`to_optax` marks it :func:`jaxdist.row_separable` (the exact mode's
row pushes then cost less on the PS, with the same results). Anything else (another
optimizer class, a learning-rate schedule, EMA, loss scaling, gradient
accumulation) raises :class:`UnsupportedOptimizerError`: the PS would
otherwise silently apply another rule.

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
from jaxdist.ps_server.optimizer import row_separable

logger = logging.getLogger(__name__)

__all__ = ["UnsupportedOptimizerError", "clipping_of", "dynamic_row_rule", "learning_rate_of", "row_local", "to_optax"]


class UnsupportedOptimizerError(ConfigurationError):
    """The Keras optimizer (or one of its settings) has no PS-side equivalent in jaxdist."""


#: Base-optimizer settings that must keep their defaults (what the PS does not implement).
_MUST_BE_UNSET = ("loss_scale_factor", "gradient_accumulation_steps")


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


def to_optax(optimizer: Any, variable: Any = None) -> optax.GradientTransformation:
    """The optax transformation applying ``optimizer``'s Keras update rule to ``variable`` (see the module docstring).

    ``variable`` (a Keras variable) decides whether ``weight_decay`` applies
    to it (Keras's ``exclude_from_weight_decay``); None: it applies. The
    result is marked :func:`jaxdist.row_separable` (every rule here is element-wise).

    Raises:
        UnsupportedOptimizerError: an optimizer class or setting the PS does not implement.
    """
    import keras

    _check_base(optimizer)
    lr = learning_rate_of(optimizer)
    name = type(optimizer).__name__
    kind = type(optimizer)
    o = keras.optimizers
    if kind is o.SGD:
        rule = _sgd(lr, float(optimizer.momentum), bool(optimizer.nesterov))
    elif kind is o.Adam or kind is o.AdamW:  # AdamW is Adam with a (default) weight_decay
        rule = _adam(lr, float(optimizer.beta_1), float(optimizer.beta_2), float(optimizer.epsilon), bool(optimizer.amsgrad))
    elif kind is o.Adamax:
        rule = _adamax(lr, float(optimizer.beta_1), float(optimizer.beta_2), float(optimizer.epsilon))
    elif kind is o.Nadam:
        rule = _nadam(lr, float(optimizer.beta_1), float(optimizer.beta_2), float(optimizer.epsilon))
    elif kind is o.RMSprop:
        rule = _rmsprop(lr, float(optimizer.rho), float(optimizer.momentum), float(optimizer.epsilon), bool(optimizer.centered))
    elif kind is o.Adagrad:
        rule = _adagrad(lr, float(optimizer.initial_accumulator_value), float(optimizer.epsilon))
    elif kind is o.Ftrl:
        rule = _ftrl(lr, float(optimizer.learning_rate_power), float(optimizer.initial_accumulator_value),
                     float(optimizer.l1_regularization_strength), float(optimizer.l2_regularization_strength),
                     float(optimizer.l2_shrinkage_regularization_strength), float(optimizer.beta))
    else:
        raise UnsupportedOptimizerError(
            f"Keras optimizer {name} is not supported under ParameterServerStrategy; use SGD, Adam, AdamW, Adamax, "
            "Nadam, RMSprop, Adagrad or Ftrl"
        )
    wd = optimizer.weight_decay
    if wd is not None and float(wd) != 0.0 and (variable is None or compat.uses_weight_decay(optimizer, variable)):
        rule = _with_weight_decay(rule, lr, float(wd))
    # Every rule here is element-wise (clipping runs on the workers, weight decay is decoupled): the
    # exact mode's row pushes may skip the table-sized gradient (same results).
    return row_separable(rule)


def row_local(optimizer: Any) -> bool:
    """Whether ``optimizer``'s update of a row with zero gradient changes nothing (neither the row nor its slots).

    Then a row gradient applied lazily (only the pushed rows) equals Keras's
    dense update bit for bit, at O(rows) cost on the PS: ``SGD`` without
    momentum and ``Adagrad``, without weight decay.
    """
    import keras

    if optimizer.weight_decay is not None and float(optimizer.weight_decay) != 0.0:
        return False
    if type(optimizer) is keras.optimizers.SGD:
        return float(optimizer.momentum) == 0.0
    return type(optimizer) is keras.optimizers.Adagrad


#: What a DynamicEmbedding layer's table can apply, named by every refusal.
_DYNAMIC_SUPPORTED = ("SGD (without momentum or nesterov), Adagrad, and Adam (without amsgrad) in the lazy mode "
                      "(jaxdist.keras.lazy_embeddings(model)), each with a constant learning rate and no weight decay")


def dynamic_row_rule(optimizer: Any, lazy: bool) -> tuple[str, float, dict[str, float]]:
    """The per-row rule of a dynamic table trained by ``optimizer``: ``(name, learning rate, options)`` for
    :class:`~jaxdist.ps_server.dynamic_table.RowOptimizer`.

    A dynamic table keeps optimizer state for its rows only and updates the rows a push names only, so the
    rules are the row-local ones: ``SGD`` without momentum -> ``"sgd"`` and ``Adagrad`` -> ``"adagrad"``
    (Keras's own results: a row with zero gradient would not move), and ``Adam`` -> ``"lazy_adam"`` (per-row
    moments and step count, TF's LazyAdam) only in the lazy mode (``lazy``: :func:`jaxdist.keras.lazy_embeddings`),
    since it is not Keras's dense Adam.

    Raises:
        UnsupportedOptimizerError: any other optimizer or setting (momentum, nesterov, amsgrad, weight decay,
            a schedule, EMA, loss scaling, gradient accumulation), or Adam outside the lazy mode.
    """
    import keras

    _check_base(optimizer)
    name = type(optimizer).__name__
    lr = learning_rate_of(optimizer)
    wd = optimizer.weight_decay
    o = keras.optimizers
    kind = type(optimizer)
    refused = None
    if wd is not None and float(wd) != 0.0:
        refused = f"{name}(weight_decay={float(wd)})"
    elif kind is o.SGD:
        if float(optimizer.momentum) != 0.0 or bool(optimizer.nesterov):
            refused = f"SGD(momentum={float(optimizer.momentum)}, nesterov={bool(optimizer.nesterov)})"
        else:
            return "sgd", lr, {}
    elif kind is o.Adagrad:
        return "adagrad", lr, {"initial_accumulator": float(optimizer.initial_accumulator_value),
                               "eps": float(optimizer.epsilon)}
    elif kind is o.Adam:
        if bool(optimizer.amsgrad):
            refused = "Adam(amsgrad=True)"
        elif not lazy:
            raise UnsupportedOptimizerError(
                "a jaxdist.keras.layers.DynamicEmbedding table has no rows (and no optimizer state) for the keys a "
                "step does not look up, so Adam can only be applied to it lazily (per-row moments and step count, "
                "TF's LazyAdam), which is not Keras's Adam: choose that with jaxdist.keras.lazy_embeddings(model) "
                "before the first fit (the model's other embedding tables are then lazy too), or use SGD or Adagrad")
        else:
            return "lazy_adam", lr, {"b1": float(optimizer.beta_1), "b2": float(optimizer.beta_2),
                                     "eps": float(optimizer.epsilon)}
    else:
        refused = name
    raise UnsupportedOptimizerError(
        f"a jaxdist.keras.layers.DynamicEmbedding table cannot be trained with {refused}: its rows are updated per "
        f"row on the parameter servers, with {_DYNAMIC_SUPPORTED}")


def _with_weight_decay(rule: optax.GradientTransformation, lr: float, wd: float) -> optax.GradientTransformation:
    """Keras's decoupled weight decay (``variable -= variable * wd * lr``) applied before ``rule``'s update."""

    def update(grads: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        if params is None:
            raise ValueError("weight decay needs the parameters")
        decayed = params - params * jnp.asarray(wd, params.dtype) * jnp.asarray(lr, params.dtype)
        upd, new_state = rule.update(grads, state, decayed)
        return (decayed - params) + upd, new_state

    return optax.GradientTransformation(rule.init, update)


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


def _adamax(lr: float, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    def init(params: Any) -> tuple[Any, ...]:
        return (jnp.zeros((), jnp.int32), jnp.zeros_like(params), jnp.zeros_like(params), None)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, tuple[Any, ...]]:
        dt = state[1].dtype
        g = grads.astype(dt)
        t = (state[0] + 1).astype(dt)
        b1_power = jnp.power(jnp.asarray(b1, dt), t)
        m = state[1] + (g - state[1]) * (1 - b1)
        u = jnp.maximum(b2 * state[2], jnp.abs(g))
        return -((lr * m) / ((1 - b1_power) * (u + eps))), (state[0] + 1, m, u, None)

    return optax.GradientTransformation(init, update)


def _nadam(lr: float, b1: float, b2: float, eps: float) -> optax.GradientTransformation:
    # Keras keeps one ``u_product`` per optimizer, advanced once per step before the updates; each
    # variable here keeps its own copy, advanced with its own step count (the same while every
    # variable is updated every step, as in fit).
    def init(params: Any) -> tuple[Any, ...]:
        return (jnp.zeros((), jnp.int32), jnp.zeros_like(params), jnp.zeros_like(params), jnp.ones((), params.dtype))

    def update(grads: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, tuple[Any, ...]]:
        dt = state[1].dtype
        g = grads.astype(dt)
        local_step = (state[0] + 1).astype(dt)
        next_step = (state[0] + 2).astype(dt)
        decay = jnp.asarray(0.96, dt)
        beta_1 = jnp.asarray(b1, dt)
        beta_2 = jnp.asarray(b2, dt)
        u_product_t = state[3] * b1 * (1.0 - 0.5 * jnp.power(jnp.asarray(0.96, state[3].dtype), local_step.astype(state[3].dtype)))
        u_t = beta_1 * (1.0 - 0.5 * jnp.power(decay, local_step))
        u_t_1 = beta_1 * (1.0 - 0.5 * jnp.power(decay, next_step))
        u_product_t_1 = u_product_t.astype(dt) * u_t_1
        beta_2_power = jnp.power(beta_2, local_step)
        m = state[1] + (g - state[1]) * (1 - beta_1)
        v = state[2] + (jnp.square(g) - state[2]) * (1 - beta_2)
        m_hat = (u_t_1 * m) / (1 - u_product_t_1) + ((1 - u_t) * g) / (1 - u_product_t.astype(dt))
        v_hat = v / (1 - beta_2_power)
        return -((m_hat * lr) / (jnp.sqrt(v_hat) + eps)), (state[0] + 1, m, v, u_product_t)

    return optax.GradientTransformation(init, update)


def _ftrl(lr: float, lr_power: float, initial: float, l1: float, l2: float, l2_shrinkage: float,
          beta: float) -> optax.GradientTransformation:
    # Keras's Ftrl assigns the variable (a function of its ``linear`` and ``accumulator`` slots):
    # the update is that value minus the current one.
    def init(params: Any) -> tuple[Any, ...]:
        return (jnp.zeros((), jnp.int32), jnp.full_like(params, initial), jnp.zeros_like(params), None)

    def update(grads: Any, state: tuple[Any, ...], params: Any = None) -> tuple[Any, tuple[Any, ...]]:
        if params is None:
            raise ValueError("Ftrl needs the parameters")
        g = grads.astype(params.dtype)
        accum, linear = state[1], state[2]
        l2_reg = l2 + beta / (2.0 * lr)
        grad_to_use = g + 2 * l2_shrinkage * params
        new_accum = accum + jnp.square(g)
        linear = linear + (grad_to_use - ((jnp.power(new_accum, -lr_power) - jnp.power(accum, -lr_power)) / lr) * params)
        quadratic = jnp.power(new_accum, -lr_power) / lr + 2 * l2_reg
        linear_clipped = jnp.clip(linear, -l1, l1)
        new_value = (linear_clipped - linear) / quadratic
        return new_value - params, (state[0] + 1, new_accum, linear, None)

    return optax.GradientTransformation(init, update)
