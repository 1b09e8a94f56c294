"""The PS's row steps (jaxdist.ps_server.optimizer): padding to the row bucket changes no result, and the
lazy mode's state is created writable (its row merge updates it in place)."""

from __future__ import annotations

import numpy as np
import optax

from jaxdist.ps_server.optimizer import MIN_ROW_BUCKET, Optimizer, _bucket, lazy_rows


def test_row_buckets_have_a_floor_and_are_powers_of_two() -> None:
    assert _bucket(1) == _bucket(3) == _bucket(MIN_ROW_BUCKET) == MIN_ROW_BUCKET
    assert _bucket(MIN_ROW_BUCKET + 1) == 2 * MIN_ROW_BUCKET
    assert _bucket(5000) == 8192


def test_exact_rows_padded_past_a_small_table_equal_the_dense_rule() -> None:
    # a 3-row table: its pushes are padded to MIN_ROW_BUCKET rows pointing at row 0 with zero gradient
    rng = np.random.default_rng(0)
    param = rng.normal(size=(3, 4)).astype(np.float32)
    tx = optax.adam(0.1)
    opt = Optimizer(tx)
    state = opt.init(param)
    idx = np.array([2, 0, 2], np.int64)
    rows = rng.normal(size=(3, 4)).astype(np.float32)
    got, _, got_state = opt.apply_rows(param, state, idx, rows)
    dense = np.zeros_like(param)
    np.add.at(dense, idx, rows)
    want, _, want_state = opt.apply(param, opt.init(param), dense)  # the dense rule, compiled as the row step is
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(got_state[0].mu), np.asarray(want_state[0].mu))


def test_lazy_state_is_writable_and_rows_equal_the_rule_on_those_rows() -> None:
    rng = np.random.default_rng(1)
    param = rng.normal(size=(10, 4)).astype(np.float32)
    tx = optax.adagrad(0.5)
    opt = Optimizer(lazy_rows(tx))
    state = opt.init(param)
    leaves = [leaf for leaf in __import__("jax").tree.leaves(state) if np.ndim(leaf) == 2]
    assert leaves and all(isinstance(leaf, np.ndarray) and leaf.flags.writeable for leaf in leaves)
    uniq = np.array([1, 7], np.int64)
    rows = rng.normal(size=(2, 4)).astype(np.float32)
    new_rows, _, _ = opt.apply_sparse(param, state, uniq, rows)

    def rule(p: np.ndarray, g: np.ndarray) -> np.ndarray:
        upd, _ = tx.update(g, tx.init(p), p)
        return optax.apply_updates(p, upd)

    # The rule on those rows, compiled as the lazy step is: run op by op instead, XLA rounds some last bits
    # differently at the tests' optimisation level (tests/conftest.py).
    want = __import__("jax").jit(rule)(param[uniq], rows)
    np.testing.assert_array_equal(new_rows, np.asarray(want))
