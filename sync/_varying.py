"""Which outputs of a per-replica function differ between replicas.

``strategy.run`` traces ``fn`` once per input signature and must decide, for
each output, whether it is *replicated* (the same on every replica: returned
as one replicated ``jax.Array``, TF's "mirrored" value) or *per-replica*
(returned as a :class:`~jaxdist.sync.values.PerReplica`). This module answers
that by a forward data-flow pass over the traced jaxpr:

- an input is varying iff it was a per-replica argument;
- ``axis_index``, ``ppermute``, ``all_to_all`` and ``reduce_scatter`` over the
  replica axis produce varying values;
- ``psum``/``pmax``/``pmin``/``all_gather`` over the replica axis (without
  ``axis_index_groups``) produce replicated values;
- any other equation's outputs are varying iff one of its inputs is; ``jit``,
  ``remat``, custom-derivative calls, ``cond``, ``while`` and ``scan`` are
  analysed through their bodies (loops to a fixed point); higher-order
  primitives the pass does not know are treated conservatively: all outputs
  vary if any input varies or if the body contains a varying source.

The analysis is sound in one direction: a value marked replicated is the same
on every replica. (A value that happens to be equal everywhere but is not
provably so is returned per-replica, which is safe.) It runs on a jaxpr
traced with ``check_vma=False`` semantics, i.e. gradients with respect to
replicated inputs are per-replica until the user all-reduces them, as in TF.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import jax.extend.core as jcore

__all__ = ["varying_outputs"]

_REPLICATING = frozenset({"psum", "pmax", "pmin", "all_gather", "psum_invariant"})
_VARYING_SOURCES = frozenset({"axis_index", "ppermute", "all_to_all", "reduce_scatter", "psum_scatter"})


def varying_outputs(closed: jcore.ClosedJaxpr, in_varying: Sequence[bool], axis_name: str) -> list[bool]:
    """For each output of ``closed``, whether it may differ between replicas.

    Args:
        closed: the traced per-replica function.
        in_varying: for each jaxpr input, whether it is per-replica.
        axis_name: the replica mesh axis.
    """
    return _analyse(closed.jaxpr, [False] * len(closed.jaxpr.constvars), list(in_varying), axis_name)


def _analyse(jaxpr: jcore.Jaxpr, const_varying: list[bool], in_varying: list[bool], axis: str) -> list[bool]:
    if len(in_varying) != len(jaxpr.invars):
        raise AssertionError(f"jaxpr has {len(jaxpr.invars)} inputs, got {len(in_varying)} flags")
    env: dict[jcore.Var, bool] = {}
    for v, f in zip(jaxpr.constvars, const_varying):
        env[v] = f
    for v, f in zip(jaxpr.invars, in_varying):
        env[v] = f

    def read(atom: object) -> bool:
        if isinstance(atom, jcore.Var):
            return env.get(atom, False)
        return False  # a literal

    for eqn in jaxpr.eqns:
        ins = [read(a) for a in eqn.invars]
        outs = _eqn_rule(eqn, ins, axis)
        for v, f in zip(eqn.outvars, outs):
            env[v] = f
    return [read(v) for v in jaxpr.outvars]


def _names(params: dict, key: str) -> tuple:
    val = params.get(key, ())
    return tuple(val) if isinstance(val, (tuple, list)) else (val,)


def _eqn_rule(eqn: jcore.JaxprEqn, ins: list[bool], axis: str) -> list[bool]:
    name = eqn.primitive.name
    n_out = len(eqn.outvars)
    p = eqn.params
    if name in _REPLICATING:
        axes = _names(p, "axes") if "axes" in p else _names(p, "axis_name")
        if axis in axes and p.get("axis_index_groups") is None:
            return [False] * n_out
        return [any(ins)] * n_out
    if name in _VARYING_SOURCES:
        axes = _names(p, "axes") + _names(p, "axis_name")
        if axis in axes or not axes:
            return [True] * n_out
        return [any(ins)] * n_out
    if name == "cond":
        pred, ops = ins[0], ins[1:]
        if pred:
            return [True] * n_out
        out = [False] * n_out
        for br in p["branches"]:
            bj = _open(br)
            out = [a or b for a, b in zip(out, _analyse(bj, [False] * len(bj.constvars), ops, axis))]
        return out
    if name == "while":
        cn, bn = p["cond_nconsts"], p["body_nconsts"]
        cconst, bconst, carry = ins[:cn], ins[cn : cn + bn], ins[cn + bn :]
        cj, bj = p["cond_jaxpr"], p["body_jaxpr"]
        while True:
            new = _analyse(_open(bj), [False] * len(_open(bj).constvars), bconst + carry, axis)
            merged = [a or b for a, b in zip(carry, new)]
            if merged == carry:
                break
            carry = merged
        (pred,) = _analyse(_open(cj), [False] * len(_open(cj).constvars), cconst + carry, axis)
        # A replica-dependent trip count makes every carried value replica-dependent.
        return [True] * n_out if pred else carry
    if name == "scan":
        counts = _scan_counts(p)
        if counts is not None:
            nc, ncarry = counts
            consts, carry, xs = ins[:nc], ins[nc : nc + ncarry], ins[nc + ncarry :]
            body = _open(p["jaxpr"])
            while True:
                out = _analyse(body, [False] * len(body.constvars), consts + carry + xs, axis)
                merged = [a or b for a, b in zip(carry, out[:ncarry])]
                if merged == carry:
                    return merged + out[ncarry:]
                carry = merged
        # A loop whose layout this JAX version does not tell: conservative (sound) answer.
        body = _open(p["jaxpr"])
        return [any(ins) or _has_varying_source(body)] * n_out
    subs = list(jcore.jaxprs_in_params(p))
    if not subs:
        return [any(ins)] * n_out
    if len(subs) == 1 and len(subs[0].invars) == len(ins) and len(subs[0].outvars) == n_out:
        # jit, remat, custom_jvp/vjp calls, closed_call: inputs and outputs map one to one.
        sub = subs[0]
        return _analyse(sub, [False] * len(sub.constvars), ins, axis)
    if any(ins) or any(_has_varying_source(s) for s in subs):
        return [True] * n_out
    return [False] * n_out


def _open(j: object) -> jcore.Jaxpr:
    """The open jaxpr of a ClosedJaxpr, or the jaxpr itself (newer JAX hands scan bodies over open)."""
    return cast("jcore.Jaxpr", getattr(j, "jaxpr", j))


def _count_leaves(t: object) -> int:
    return sum(_count_leaves(x) for x in t) if isinstance(t, (tuple, list)) else 1


def _scan_counts(p: dict) -> tuple[int, int] | None:
    """(consts, carry) counts of a scan equation, across JAX versions; None when unknown."""
    if "num_consts" in p and "num_carry" in p:
        return int(p["num_consts"]), int(p["num_carry"])
    ft = p.get("ft_in")  # JAX >= 0.11: a flat tree of (consts, carry, xs); len() of a part counts its leaves
    parts = getattr(ft, "elts", ft)
    if isinstance(parts, (tuple, list)) and len(parts) == 3:
        try:
            return len(parts[0]), len(parts[1])
        except TypeError:
            return _count_leaves(parts[0]), _count_leaves(parts[1])
    return None


def _has_varying_source(jaxpr: jcore.Jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in _VARYING_SOURCES:
            return True
        if any(_has_varying_source(s) for s in jcore.jaxprs_in_params(eqn.params)):
            return True
    return False
