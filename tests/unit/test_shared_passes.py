"""Several exact row pushes in one pass over a table (VariableStore's group apply): the values of applying them
one after the other in the order the store applied (and replicated) them, bit for bit; each push its own
versions, its own dedupe record and its own error."""

from __future__ import annotations

import threading
from typing import Any

import jax
import numpy as np
import optax
import pytest

from jaxdist.proto.ps_wire import Op, Update
from jaxdist.ps_server.optimizer import MAX_PUSHES_PER_PASS, Optimizer, row_separable
from jaxdist.ps_server.store import VariableStore
from jaxdist.testing import poll_for

pytestmark = pytest.mark.timeout(120)

ROWS, DIM = 500, 8


def _store(tx: optax.GradientTransformation, table: np.ndarray, bias: np.ndarray) -> VariableStore:
    s = VariableStore()
    s.create("emb", value=table, optimizer=Optimizer(tx, separable_min_size=0))
    s.create("bias", value=bias, optimizer=Optimizer(tx, separable_min_size=0))
    return s


def _push(rng: np.random.Generator, n: int) -> list[Update]:
    idx = rng.integers(0, ROWS, size=n).astype(np.int64)
    if n:
        idx[: n // 3] = idx[-1]  # repeated ids add up
    return [Update("emb", Op.SPARSE_APPLY_GRADIENT, rng.normal(size=(n, DIM)).astype(np.float32), idx),
            Update("bias", Op.APPLY_GRADIENT, rng.normal(size=(DIM,)).astype(np.float32))]


def _values(s: VariableStore) -> list[np.ndarray]:
    with s.frozen() as snap:
        return [np.array(x) for _, value, state, _ in snap for x in [value, *jax.tree.leaves(state)]]


def _held_pushes(s: VariableStore, pushes: dict[str, list[Update]]) -> tuple[dict[str, Any], list[str]]:
    """Send ``pushes`` from one thread each while the test holds every lock; release once all are queued.
    Returns each push's result (versions or the exception) and the order the store replicated them in."""
    order: list[str] = []
    s.replicate = lambda updates, update_id: order.append(update_id)
    results: dict[str, Any] = {}

    def send(uid: str) -> None:
        try:
            results[uid] = s.apply(pushes[uid], uid)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[uid] = e

    threads = [threading.Thread(target=send, args=(uid,)) for uid in pushes]
    with s.frozen():
        for t in threads:
            t.start()
        poll_for(lambda: s.pushes_waiting == len(pushes), timeout=60, what="every push to queue for the locks")
    for t in threads:
        t.join(timeout=60)
    return results, order


@pytest.mark.parametrize("rule", ["adam", "nesterov"])
def test_queued_pushes_share_a_pass_and_equal_the_sequence(rule: str) -> None:
    tx = {"adam": lambda: optax.adam(0.01), "nesterov": lambda: optax.sgd(0.1, momentum=0.9, nesterov=True)}[rule]()
    rng = np.random.default_rng(7)
    table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    bias = rng.normal(size=(DIM,)).astype(np.float32)
    shared, plain = _store(row_separable(tx), table, bias), _store(tx, table, bias)  # unmarked: one push at a time
    first = _push(rng, 40)
    shared.apply(first, "p0")
    plain.apply(first, "p0")
    pushes = {f"p{i}": _push(rng, n) for i, n in enumerate((30, 0, 300, 7, 64), start=1)}
    results, order = _held_pushes(shared, pushes)
    assert shared.shared_pass_pushes == len(pushes)  # the first to get the locks applied all five in one pass
    assert sorted(order) == sorted(pushes)
    for uid in order:  # the sequence the store applied, replayed one push at a time on the unmarked rule
        plain.apply(pushes[uid], uid)
    for got, want in zip(_values(shared), _values(plain), strict=True):
        assert np.array_equal(got, want)
    # Each push its own versions (in the applied order: 3..7 for both variables) and its own dedupe record.
    assert [results[uid] for uid in order] == [([v, v], False) for v in range(3, 3 + len(pushes))]
    assert all(shared.apply(pushes[uid], uid)[1] for uid in pushes)
    assert shared.updates_applied == 1 + len(pushes)


def test_more_pushes_than_one_pass_takes() -> None:
    rng = np.random.default_rng(8)
    table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    bias = np.zeros(DIM, np.float32)
    shared, plain = _store(row_separable(optax.adam(0.01)), table, bias), _store(optax.adam(0.01), table, bias)
    pushes = {f"q{i}": _push(rng, 20) for i in range(MAX_PUSHES_PER_PASS + 3)}
    _, order = _held_pushes(shared, pushes)
    assert len(order) == len(pushes)
    assert shared.shared_pass_pushes >= MAX_PUSHES_PER_PASS
    for uid in order:
        plain.apply(pushes[uid], uid)
    for got, want in zip(_values(shared), _values(plain), strict=True):
        assert np.array_equal(got, want)


def test_a_refused_replication_fails_its_push_only() -> None:
    rng = np.random.default_rng(9)
    table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    s = _store(row_separable(optax.adam(0.01)), table, np.zeros(DIM, np.float32))
    pushes = {f"r{i}": _push(rng, 10) for i in range(3)}
    order: list[str] = []

    def replicate(updates: Any, update_id: str) -> None:
        order.append(update_id)
        if update_id == "r1":
            raise ConnectionError("the backup refused r1")

    results: dict[str, Any] = {}

    def send(uid: str) -> None:
        try:
            results[uid] = s.apply(pushes[uid], uid)
        except Exception as e:  # noqa: BLE001 - the test inspects it
            results[uid] = e

    s.replicate = replicate
    threads = [threading.Thread(target=send, args=(uid,)) for uid in pushes]
    with s.frozen():
        for t in threads:
            t.start()
        poll_for(lambda: s.pushes_waiting == 3, timeout=60, what="every push to queue for the locks")
    for t in threads:
        t.join(timeout=60)
    assert s.shared_pass_pushes == 3 and sorted(order) == ["r0", "r1", "r2"]
    assert isinstance(results["r1"], ConnectionError)
    assert all(isinstance(results[u], tuple) for u in ("r0", "r2"))
    # Applied here all the same: recorded, so the client's retry is a duplicate (as for one push).
    assert s.was_applied("r1") and s.apply(pushes["r1"], "r1")[1]


def test_lazy_and_unmarked_pushes_do_not_queue() -> None:
    rng = np.random.default_rng(10)
    table = rng.normal(size=(ROWS, DIM)).astype(np.float32)
    for tx in (optax.adam(0.01), row_separable(optax.chain(optax.add_decayed_weights(1e-2), optax.rmsprop(0.01)))):
        s = VariableStore()
        s.create("emb", value=table, optimizer=Optimizer(tx, separable_min_size=0))
        s.apply([_push(rng, 5)[0]], "a")
        assert s.pushes_waiting == 0 and s.shared_pass_pushes == 0
