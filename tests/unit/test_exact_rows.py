"""The exact mode's row pushes for a rule marked row-separable (jaxdist.row_separable): the same values, bit for
bit, as the unmarked path (the rows scattered into a zero gradient of the whole table, then the dense rule), for
every Keras rule the PS implements (in a subprocess: the pytest process stays Keras-free) and for optax's element-wise
ones; in place when the buffers are donated."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax
import pytest

import jaxdist
from jaxdist.proto.ps_wire import Op, Update
from jaxdist.ps_server.optimizer import MIN_ROW_BUCKET, Optimizer, is_lazy, is_row_separable, lazy_rows, row_separable
from jaxdist.ps_server.store import VariableStore

pytestmark = pytest.mark.timeout(120)


#: Every Keras rule the PS implements, with settings that use each of its slots (built in the subprocess).
KERAS_RULES: dict[str, Callable[[Any], Any]] = {
    "sgd": lambda o: o.SGD(0.5),
    "sgd_momentum": lambda o: o.SGD(0.5, momentum=0.9),
    "sgd_nesterov": lambda o: o.SGD(0.5, momentum=0.8, nesterov=True),
    "adam": lambda o: o.Adam(0.01),
    "adam_amsgrad": lambda o: o.Adam(0.01, amsgrad=True),
    "adamw": lambda o: o.AdamW(0.01, weight_decay=0.05),
    "rmsprop": lambda o: o.RMSprop(0.005),
    "rmsprop_centered_momentum": lambda o: o.RMSprop(0.005, momentum=0.5, centered=True),
    "adagrad": lambda o: o.Adagrad(0.5),
    "adamax": lambda o: o.Adamax(0.01),
    "nadam": lambda o: o.Nadam(0.01),
    "ftrl": lambda o: o.Ftrl(0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.01,
                             l2_shrinkage_regularization_strength=0.01, beta=0.1),
}

#: Some of optax's element-wise rules (checked in the pytest process).
OPTAX_RULES: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adam": lambda: optax.adam(0.01),
    "adamw": lambda: optax.adamw(0.01, weight_decay=0.1),
    "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True),
    "wd_rmsprop": lambda: optax.chain(optax.add_decayed_weights(1e-2), optax.rmsprop(0.01)),
}

def _unmarked(tx: optax.GradientTransformation) -> optax.GradientTransformation:
    return optax.GradientTransformation(tx.init, tx.update)


def _pushes(rng: np.random.Generator, rows: int, dim: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Pushes with repeated ids (a quarter of each push repeats one id), an empty one, and one past a bucket."""
    out = []
    for n in (37, 0, 300, 1, 120, 64):
        idx = rng.integers(0, rows, size=n).astype(np.int64)
        idx[: n // 4] = idx[n - 1] if n else 0
        out.append((idx, rng.normal(size=(n, dim)).astype(np.float32)))
    return out


def _assert_same(a: tuple[Any, Any], b: tuple[Any, Any], what: str) -> None:
    la = [np.asarray(x) for x in jax.tree.leaves(a)]
    lb = [np.asarray(x) for x in jax.tree.leaves(b)]
    assert len(la) == len(lb), what
    for i, (x, y) in enumerate(zip(la, lb)):
        assert x.dtype == y.dtype and x.shape == y.shape, (what, i)
        assert np.array_equal(x, y), f"{what}: leaf {i} differs by up to {np.max(np.abs(x.astype(np.float64) - y))}"


def _mismatches(name: str, tx: optax.GradientTransformation) -> list[str]:
    """Twelve pushes (repeated ids, empty ones, some past a bucket) through both paths: where they differ. The
    marked rule's pushes go through ``apply_rows_many`` in groups of 3, 1, 2, 4 and 2 (several pushes per pass
    where the rule takes the three-step path), the unmarked rule's one by one; compared after each group."""
    rng = np.random.default_rng(3)
    table = rng.normal(size=(700, 8)).astype(np.float32)
    dense, separable = Optimizer(_unmarked(tx)), Optimizer(row_separable(tx), separable_min_size=0)
    assert separable.row_separable and not dense.row_separable
    got = (table, separable.init(table))
    want = (table, dense.init(table))
    pushes = _pushes(rng, len(table), table.shape[1]) + _pushes(rng, len(table), table.shape[1])
    done = 0
    for size in (3, 1, 2, 4, 2):
        group = pushes[done:done + size]
        got = separable.apply_rows_many(got[0], got[1], group, donate=done > 0)[1:]  # the store donates once they are XLA arrays
        for idx, rows in group:
            want = dense.apply_rows(want[0], want[1], idx, rows, donate=done > 0)[1:]
        done += size
        try:
            _assert_same(got, want, f"{name}, pushes {done - size}..{done - 1}")
        except AssertionError as e:
            return [str(e)]
    return []


@pytest.mark.parametrize("name", sorted(OPTAX_RULES))
def test_separable_rows_equal_the_dense_scatter_bit_for_bit(name: str) -> None:
    assert _mismatches(name, OPTAX_RULES[name]()) == []


def _keras_check() -> None:
    """(In the subprocess.) Every Keras rule: marked by to_optax, and both paths equal bit for bit."""
    import jaxdist.keras  # noqa: F401 - before Keras: its JAX backend
    import keras
    from jaxdist.keras.ps_optimizers import to_optax

    failures = []
    for name, make in KERAS_RULES.items():
        tx = to_optax(make(keras.optimizers))
        if not is_row_separable(tx):
            failures.append(f"{name}: to_optax did not mark it row-separable")
        failures += _mismatches(name, tx)
    # The three-step path (several pushes per pass) on a 1M x 16 table for every rule whose state's zero step
    # never reads the parameter (compiled only, nothing allocated); centered RMSprop and Ftrl read it.
    for name, make in KERAS_RULES.items():
        tx = to_optax(make(keras.optimizers))
        table = jax.ShapeDtypeStruct((1 << 20, 16), np.float32)
        want = name not in ("rmsprop_centered_momentum", "ftrl")
        if Optimizer(tx)._zero_plan(table, jax.eval_shape(tx.init, table)) != want:
            failures.append(f"{name}: the three-step path {'not ' if want else ''}taken on a 1M x 16 table")
    print(json.dumps(failures))


@pytest.mark.slow
def test_keras_rules_separable_rows_equal_the_dense_scatter_bit_for_bit() -> None:
    env = dict(os.environ, KERAS_BACKEND="jax")
    out = subprocess.run([sys.executable, __file__, "keras"], capture_output=True, text=True, timeout=240, check=False,
                         env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    failures = json.loads(out.stdout.strip().splitlines()[-1])
    assert failures == [], "\n".join(failures)


def test_bf16_rows_and_a_table_smaller_than_the_bucket() -> None:
    # bf16 gradient rows (the narrow transfer) add up in float32 as the dense scatter does; a 3-row table's
    # pushes are padded to MIN_ROW_BUCKET rows, which point past it and are never written.
    import ml_dtypes

    tx = optax.adam(0.1)
    rng = np.random.default_rng(4)
    for shape in ((3, 4), (2 * MIN_ROW_BUCKET, 4), (50,)):
        table = rng.normal(size=shape).astype(np.float32)
        dense, separable = Optimizer(tx), Optimizer(row_separable(tx), separable_min_size=0)
        got, want = (table, separable.init(table)), (table, dense.init(table))
        for _ in range(3):
            idx = np.array([2, 0, 2, 1], np.int64)
            rows = rng.normal(size=(4,) + shape[1:]).astype(ml_dtypes.bfloat16)
            got = separable._apply_rows_separable(*got, [(idx, rows)], donate=False)[1:]
            want = dense.apply_rows(*want, idx, rows)[1:]
            _assert_same(got, want, f"shape {shape}")


def test_donated_buffers_are_updated_in_place() -> None:
    # The O(table) pass writes into the donated parameter and state (no table-sized allocation per push).
    opt = Optimizer(row_separable(OPTAX_RULES["nesterov"]()), separable_min_size=0)
    rng = np.random.default_rng(5)
    table = rng.normal(size=(4096, 16)).astype(np.float32)
    view, param, state = opt.apply_rows(table, opt.init(table), np.array([1, 5], np.int64), np.ones((2, 16), np.float32))
    for _ in range(3):
        del view  # as the store drops its view: XLA copies a donated buffer that a numpy view still points at
        before = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((param, state)) if x.shape == table.shape]
        idx = rng.integers(0, 4096, 300).astype(np.int64)
        view, param, state = opt.apply_rows(param, state, idx, rng.normal(size=(300, 16)).astype(np.float32), donate=True)
        after = [x.unsafe_buffer_pointer() for x in jax.tree.leaves((param, state)) if x.shape == table.shape]
        assert len(after) == 2 and after == before
        del view
        pushes = [(rng.integers(0, 4096, 50).astype(np.int64), rng.normal(size=(50, 16)).astype(np.float32))] * 3
        view, param, state = opt.apply_rows_many(param, state, pushes, donate=True)
        assert [x.unsafe_buffer_pointer() for x in jax.tree.leaves((param, state)) if x.shape == table.shape] == before
    # The three-step path ran: the parameter's pass compiled for one push and for three per pass.
    assert opt._zero_param._cache_size() == 2 and opt._row_step._cache_size() == 0


def test_the_store_applies_marked_rules_as_before() -> None:
    # Through the store (its donation and its views), several pushes with repeated and empty ids: the
    # three-step path (see test_the_path_taken), bit for bit.
    rng = np.random.default_rng(6)
    table = rng.normal(size=(300, 4)).astype(np.float32)
    tx = OPTAX_RULES["adamw"]()
    stores, opts = {}, {}
    for label, t in (("separable", row_separable(tx)), ("dense", _unmarked(tx))):
        s = VariableStore()
        opts[label] = Optimizer(t, separable_min_size=0)
        s.create("t", value=table, optimizer=opts[label])
        stores[label] = s
    for idx, rows in _pushes(rng, len(table), table.shape[1]):
        for s in stores.values():
            s.apply([Update("t", Op.SPARSE_APPLY_GRADIENT, rows, idx)])
    assert opts["separable"]._row_step._cache_size() == 0 and opts["dense"]._zero_param._cache_size() == 0
    values = {}
    for label, s in stores.items():
        with s.frozen(["t"]) as [(_, value, state, _)]:
            values[label] = (np.array(value), [np.array(x) for x in jax.tree.leaves(state)])
    _assert_same(values["separable"], values["dense"], "store")


def test_the_path_taken() -> None:
    # The three-step path runs where the state's zero step never reads the parameter (the parameter's
    # pass reads the old state, then the state's pass overwrites it) and neither pass needs a
    # table-sized temporary (XLA's fusion choices, jax 0.10: a change here is a change in the PS's cost
    # per push). Weight decay added to the gradient feeds the parameter into RMSprop's accumulator:
    # the one-step path.
    table = np.ones((64, 4), np.float32)
    idx, rows = np.array([1, 1, 3], np.int64), np.ones((3, 4), np.float32)
    for make, three_steps in ((OPTAX_RULES["adam"], True), (OPTAX_RULES["wd_rmsprop"], False)):
        opt = Optimizer(row_separable(make()), separable_min_size=0)
        view, param, state = opt.apply_rows(table, opt.init(table), idx, rows)
        del view
        view, param, state = opt.apply_rows(param, state, idx, rows, donate=True)
        assert opt._zero_plan(param, state) == three_steps
        assert opt._row_step._cache_size() == (0 if three_steps else 1)
        assert opt._zero_param._cache_size() == (1 if three_steps else 0)


def test_small_variables_keep_the_one_step_path() -> None:
    # Below separable_min_size elements the three steps' fixed cost is not worth it: the one-step path runs.
    opt = Optimizer(row_separable(OPTAX_RULES["adam"]()), separable_min_size=100)
    idx, rows = np.array([1, 1, 3], np.int64), np.ones((3, 4), np.float32)
    small = np.ones((24, 4), np.float32)  # 96 elements
    opt.apply_rows(small, opt.init(small), idx, rows)
    assert opt._row_step._cache_size() == 1 and opt._zero_param_copy._cache_size() == 0
    large = np.ones((25, 4), np.float32)  # 100 elements
    opt.apply_rows(large, opt.init(large), idx, rows)  # numpy buffers, not donated: the copying pass
    assert opt._row_step._cache_size() == 1 and opt._zero_param_copy._cache_size() == 1


def test_the_mark() -> None:
    tx = optax.adam(0.1)
    marked = row_separable(tx)
    assert is_row_separable(marked) and not is_row_separable(tx) and not is_lazy(marked)
    assert row_separable(marked) is marked
    assert jaxdist.row_separable is row_separable
    # The lazy mode touches only the pushed rows already: a lazy transformation stays as it is, and a
    # marked one made lazy is lazy.
    lazy = lazy_rows(tx)
    assert row_separable(lazy) is lazy
    assert is_lazy(lazy_rows(marked)) and not is_row_separable(lazy_rows(marked))
    # Wrapping a marked transformation again gives an unmarked one (the exact mode's general path).
    assert not is_row_separable(optax.chain(marked, optax.scale(1.0)))
    with pytest.raises(TypeError, match="GradientTransformation"):
        row_separable(object())


if __name__ == "__main__" and sys.argv[1:] == ["keras"]:
    _keras_check()
