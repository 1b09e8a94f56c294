"""Exact row pushes deferred and applied several per pass over a table (VariableStore's pending pushes): every
read, whole or of rows, narrow or not, every snapshot and export, and every other change sees bit for bit the
values of applying the pushes one after the other; versions, dedupe records and replication are per push, at
the push."""

from __future__ import annotations

from typing import Any

import jax
import ml_dtypes
import numpy as np
import optax
import pytest

from jaxdist.proto.ps_wire import Op, Update
from jaxdist.ps_server.optimizer import MAX_PUSHES_PER_PASS, Optimizer, row_separable
from jaxdist.ps_server.store import VariableStore

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 500, 8
RULES = {"adam": lambda: optax.adam(0.01), "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True)}


def _store(tx: optax.GradientTransformation, table: np.ndarray, bias: np.ndarray) -> VariableStore:
    s = VariableStore()
    s.create("emb", value=table, optimizer=Optimizer(tx, separable_min_size=0))
    s.create("bias", value=bias, optimizer=Optimizer(tx, separable_min_size=0))
    return s


def _pair(rule: str, seed: int) -> tuple[VariableStore, VariableStore, np.random.Generator]:
    """A store whose rule is marked row-separable (its row pushes deferred) and one with the same rule unmarked
    (every push applied at once, one step each: the reference)."""
    rng = np.random.default_rng(seed)
    table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    bias = rng.normal(size=(DIM,)).astype(np.float32)
    tx = RULES[rule]()
    return _store(row_separable(tx), table, bias), _store(optax.GradientTransformation(tx.init, tx.update), table, bias), rng


def _push(rng: np.random.Generator, n: int) -> list[Update]:
    idx = rng.integers(0, ROWS, size=n).astype(np.int64)
    if n:
        idx[: n // 3] = idx[-1]  # repeated ids add up
    return [Update("emb", Op.SPARSE_APPLY_GRADIENT, rng.normal(size=(n, DIM)).astype(np.float32), idx),
            Update("bias", Op.APPLY_GRADIENT, rng.normal(size=(DIM,)).astype(np.float32))]


def _snapshot(s: VariableStore) -> list[np.ndarray]:
    with s.frozen() as snap:
        return [np.array(x) for _, value, state, _ in snap for x in [value, *jax.tree.leaves(state)]]


def _same(a: Any, b: Any, what: str) -> None:
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape, what
    assert a.tobytes() == b.tobytes(), what  # bit for bit (NaN, -0.0 included)


@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_read_sees_the_pushes_one_after_the_other(rule: str) -> None:
    deferred, plain, rng = _pair(rule, 7)
    stores = (deferred, plain)
    step = 0

    def push(n: int) -> None:
        nonlocal step
        updates = _push(rng, n)
        got = [s.apply(updates, f"p{step}") for s in stores]
        assert got[0] == got[1]  # the same versions, at the push
        step += 1

    def rows(ids: np.ndarray, dtype: Any = None) -> None:
        reads = []
        for s in stores:
            with s.reading("emb", ids, as_dtype=dtype) as r:
                reads.append((np.array(r.value), r.version))
        assert reads[0][1] == reads[1][1]
        _same(reads[0][0], reads[1][0], f"rows after push {step}")

    for n in (40, 0, 7):
        push(n)
        rows(rng.integers(0, ROWS, 64).astype(np.int64))
    assert deferred.shared_pass_pushes == 0  # nothing read the whole table yet: all three pending
    # Rows a pending push named, repeated, and a narrow (bf16) read of them.
    last = _push(rng, 30)
    for s in stores:
        s.apply(last, "named")
    ids = np.concatenate([last[0].indices[:10], last[0].indices[:3], np.arange(5, dtype=np.int64)])
    rows(ids)
    rows(ids, ml_dtypes.bfloat16)
    # A whole read applies the pending pushes (4 in one pass).
    whole = [s.read("emb") for s in stores]
    _same(whole[0], whole[1], "whole read")
    assert deferred.shared_pass_pushes == 4
    for n in (300, 64):
        push(n)
    with deferred.reading("emb", as_dtype=ml_dtypes.bfloat16) as a, plain.reading("emb", as_dtype=ml_dtypes.bfloat16) as b:
        _same(a.value, b.value, "narrow whole read")
    push(12)
    # Another change of the table (an assign-add) applies the pending push first, then itself.
    add = [Update("emb", Op.ASSIGN_ADD, np.full((ROWS, DIM), 0.5, np.float32))]
    for s in stores:
        s.apply(add, "add")
    push(9)
    push(5)
    with deferred.export_cut(["emb"], "", 0, False) as (_, [a], _), plain.export_cut(["emb"], "", 0, False) as (_, [b], _):
        _same(a.value, b.value, "export")
        assert a.version == b.version
    push(3)
    for got, want in zip(_snapshot(deferred), _snapshot(plain), strict=True):
        _same(got, want, "snapshot")
    assert deferred.shared_pass_pushes == 4 + 2 + 2  # the whole read's 4, the narrow read's 2, the export's 2
    assert deferred.updates_applied == plain.updates_applied


def test_at_most_max_pushes_wait() -> None:
    deferred, plain, rng = _pair("adam", 8)
    n = MAX_PUSHES_PER_PASS + 3
    for i in range(n):
        updates = _push(rng, 20)
        for s in (deferred, plain):
            s.apply(updates, f"q{i}")
    assert deferred.shared_pass_pushes == MAX_PUSHES_PER_PASS  # one pass once MAX were pending
    for got, want in zip(_snapshot(deferred), _snapshot(plain), strict=True):
        _same(got, want, "snapshot")
    assert deferred.shared_pass_pushes == n  # the snapshot applied the other 3


def test_pushes_are_replicated_and_recorded_at_the_push() -> None:
    deferred, plain, rng = _pair("adam", 9)
    backup, _, _ = _pair("adam", 9)  # the same start; fed what the primary replicates, in its order
    order: list[str] = []

    def replicate(updates: Any, update_id: str) -> None:
        order.append(update_id)
        backup.apply(updates, update_id)

    deferred.replicate = replicate
    pushes = {f"r{i}": _push(rng, 16) for i in range(5)}
    for uid, updates in pushes.items():
        assert deferred.apply(updates, uid)[1] is False
        plain.apply(updates, uid)
        assert order[-1] == uid and deferred.was_applied(uid)
    assert deferred.apply(pushes["r2"], "r2")[1] is True  # a re-sent push: a duplicate, nothing pending added
    for got, want, other in zip(_snapshot(deferred), _snapshot(plain), _snapshot(backup), strict=True):
        _same(got, want, "primary")
        _same(other, want, "backup")


def test_lazy_and_unmarked_pushes_are_applied_at_once() -> None:
    rng = np.random.default_rng(10)
    table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    for tx in (optax.adam(0.01), row_separable(optax.chain(optax.add_decayed_weights(1e-2), optax.rmsprop(0.01)))):
        s = VariableStore()
        s.create("emb", value=table, optimizer=Optimizer(tx, separable_min_size=0))
        for i in range(3):
            s.apply([_push(rng, 5)[0]], f"a{i}")
        s.read("emb")
        assert s.shared_pass_pushes == 0


def test_a_failed_pass_leaves_the_push_unacknowledged_and_its_retry_applies_it_once() -> None:
    deferred, plain, rng = _pair("adam", 11)
    opt = deferred.optimizer_of("emb")
    assert opt is not None
    real = opt.apply_rows_many
    calls = {"n": 0}

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise MemoryError("XLA could not allocate")
        return real(*args, **kwargs)

    opt.apply_rows_many = fail_once  # type: ignore[method-assign]
    pushes = [_push(rng, 10) for _ in range(MAX_PUSHES_PER_PASS)]
    for i, updates in enumerate(pushes[:-1]):
        for s in (deferred, plain):
            s.apply(updates, f"f{i}")
    last = f"f{MAX_PUSHES_PER_PASS - 1}"
    with pytest.raises(MemoryError):
        deferred.apply(pushes[-1], last)  # the pass its arrival starts fails: not acknowledged, not recorded
    assert not deferred.was_applied(last)
    assert deferred.apply(pushes[-1], last)[1] is False  # the client's retry: applied, once
    plain.apply(pushes[-1], last)
    for got, want in zip(_snapshot(deferred), _snapshot(plain), strict=True):
        _same(got, want, "snapshot")
