"""VariableStore without sockets: versions, atomicity, dedupe, concurrency, optimizers."""

import threading

import jax
import numpy as np
import optax
import pytest

from jaxdist.errors import (
    DTypeMismatchError,
    InvalidRequestError,
    PayloadTooLargeError,
    ShapeMismatchError,
    UpdateMismatchError,
    VariableExistsError,
    VariableNotFoundError,
)
from jaxdist.ps_server.optimizer import Optimizer, lazy_rows
from jaxdist.proto.ps_wire import IfExists, Op, Update
from jaxdist.ps_server.store import VariableStore

pytestmark = pytest.mark.timeout(120)


def f32(*a: float) -> np.ndarray:
    return np.array(a, dtype=np.float32)


def test_create_read_versions() -> None:
    s = VariableStore()
    assert s.create("a", value=f32(1, 2)) == 1
    assert np.array_equal(s.read("a"), f32(1, 2))
    versions, dup = s.apply([Update("a", Op.ASSIGN_ADD, f32(1, 1))])
    assert versions == [2] and not dup
    assert np.array_equal(s.read("a"), f32(2, 3))
    with pytest.raises(VariableExistsError):
        s.create("a", value=f32(0, 0))
    assert s.create("a", value=f32(9, 9), if_exists=IfExists.KEEP) == 2
    assert np.array_equal(s.read("a"), f32(2, 3))
    s.create("a", value=f32(9, 9), if_exists=IfExists.REPLACE)
    assert np.array_equal(s.read("a"), f32(9, 9))


def test_initializer_gets_shape_dtype_offset() -> None:
    s = VariableStore()
    seen = []

    def init(shape: tuple, dtype: np.dtype, offset: tuple) -> np.ndarray:
        seen.append((shape, dtype, offset))
        return np.full(shape, offset[0], dtype)

    s.create("t", shape=(3, 2), dtype=np.float32, initializer=init, offset=(5, 0))
    assert seen == [((3, 2), np.dtype(np.float32), (5, 0))]
    assert np.all(s.read("t") == 5)
    with pytest.raises(ShapeMismatchError):
        s.create("u", shape=(3,), dtype=np.float32, initializer=lambda sh, dt, off: np.zeros(4, dt))
    with pytest.raises(InvalidRequestError):
        s.create("v", shape=(3,), dtype=np.float32, initializer=lambda sh, dt, off: 1 / 0)


def test_bad_updates_change_nothing() -> None:
    s = VariableStore()
    s.create("a", value=f32(1, 2))
    s.create("b", value=f32(3))
    bad = [
        ([Update("a", Op.ASSIGN_ADD, f32(1, 1)), Update("b", Op.ASSIGN, f32(1, 2))], ShapeMismatchError),
        ([Update("a", Op.ASSIGN_ADD, f32(1, 1)), Update("b", Op.ASSIGN, np.array([1.0]))], DTypeMismatchError),
        ([Update("a", Op.ASSIGN_ADD, f32(1, 1)), Update("zz", Op.ASSIGN, f32(1))], VariableNotFoundError),
        ([Update("a", Op.SCATTER_ADD, f32(1), np.array([5]))], InvalidRequestError),
        ([Update("a", Op.APPLY_GRADIENT, f32(1, 1))], InvalidRequestError),  # no optimizer
    ]
    for updates, exc in bad:
        with pytest.raises(exc):
            s.apply(updates)
    assert np.array_equal(s.read("a"), f32(1, 2)) and np.array_equal(s.read("b"), f32(3))
    assert s.info()[0].version == 1


def test_size_limit() -> None:
    s = VariableStore(max_variable_bytes=100)
    with pytest.raises(PayloadTooLargeError):
        s.create("big", value=np.zeros(100, np.float32))


def test_update_id_applies_at_most_once() -> None:
    s = VariableStore(dedupe_capacity=2)
    s.create("c", value=f32(0))
    assert s.apply([Update("c", Op.ASSIGN_ADD, f32(1))], "x/1") == ([2], False)
    assert s.apply([Update("c", Op.ASSIGN_ADD, f32(1))], "x/1") == ([2], True)
    s.apply([Update("c", Op.ASSIGN_ADD, f32(1))], "x/2")
    assert s.read("c")[0] == 2
    # A failed push does not consume its id.
    with pytest.raises(DTypeMismatchError):
        s.apply([Update("c", Op.ASSIGN_ADD, np.array([1.0]))], "x/3")
    assert s.apply([Update("c", Op.ASSIGN_ADD, f32(1))], "x/3") == ([4], False)


def test_a_repeated_update_id_naming_other_variables_or_ops_is_refused_not_dropped() -> None:
    """A push that repeats an applied identity with another variable or op (two different pushes given one
    identity): the PS refuses it (typed) instead of dropping it as a duplicate, and changes nothing."""
    s = VariableStore()
    s.create("x", value=f32(0))
    s.create("y", value=f32(0))
    assert s.apply([Update("x", Op.ASSIGN_ADD, f32(1))], update_id="run/7/1") == ([2], False)
    for other in ([Update("y", Op.ASSIGN_ADD, f32(1))], [Update("x", Op.ASSIGN_SUB, f32(1))],
                  [Update("x", Op.ASSIGN_ADD, f32(1)), Update("y", Op.ASSIGN_ADD, f32(1))]):
        with pytest.raises(UpdateMismatchError) as e:
            s.apply(other, update_id="run/7/1")
        assert e.value.code.name == "FAILED_PRECONDITION"
    assert s.read("x")[0] == 1 and s.read("y")[0] == 0 and s.duplicates_dropped == 0
    # The same variables and ops (other values: a re-run computes on fresh parameters) are the duplicate.
    assert s.apply([Update("x", Op.ASSIGN_ADD, f32(5))], update_id="run/7/1") == ([2], True)
    assert s.read("x")[0] == 1
    # A backup's full sync carries what each id named.
    b = VariableStore()
    b.replace_all([("x", f32(1), None, None, 2), ("y", f32(0), None, None, 1)], s.applied_ids())
    with pytest.raises(UpdateMismatchError):
        b.apply([Update("y", Op.ASSIGN_ADD, f32(1))], update_id="run/7/1")
    assert b.apply([Update("x", Op.ASSIGN_ADD, f32(1))], update_id="run/7/1")[1] is True


def test_concurrent_pushes_lose_nothing() -> None:
    s = VariableStore()
    s.create("c", value=np.zeros(1000, np.float32))
    n_threads, n_each = 8, 200

    def work(t: int) -> None:
        for i in range(n_each):
            s.apply([Update("c", Op.ASSIGN_ADD, np.ones(1000, np.float32))], f"t{t}/{i}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(n_threads)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert np.all(s.read("c") == n_threads * n_each)
    assert s.info()[0].version == 1 + n_threads * n_each


def test_concurrent_duplicates_apply_once() -> None:
    s = VariableStore()
    s.create("c", value=f32(0))
    barrier = threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        for i in range(100):
            s.apply([Update("c", Op.ASSIGN_ADD, f32(1))], f"same/{i}")

    threads = [threading.Thread(target=work) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert s.read("c")[0] == 100


def test_snapshot_is_not_modified_by_in_place_updates() -> None:
    s = VariableStore()
    s.create("e", value=np.zeros((4, 2), np.float32))
    with s.reading("e") as r:
        s.apply([Update("e", Op.SCATTER_ADD, np.ones((1, 2), np.float32), np.array([1]))])
        assert np.all(r.value == 0)
    assert s.read("e")[1].tolist() == [1, 1]


@pytest.mark.parametrize(
    "make",
    [lambda: optax.sgd(0.1), lambda: optax.sgd(0.1, momentum=0.9), lambda: optax.adam(0.01), lambda: optax.adagrad(0.1),
     lambda: optax.chain(optax.add_decayed_weights(1e-3), optax.rmsprop(0.01))],
    ids=["sgd", "momentum", "adam", "adagrad", "wd+rmsprop"],
)
def test_dense_optimizer_matches_optax(make: object) -> None:
    rng = np.random.default_rng(0)
    w0 = rng.standard_normal((5, 3)).astype(np.float32)
    grads = [rng.standard_normal((5, 3)).astype(np.float32) for _ in range(5)]
    s = VariableStore()
    s.create("w", value=w0, optimizer=Optimizer(make()))
    for g in grads:
        s.apply([Update("w", Op.APPLY_GRADIENT, g)])
    tx = make()
    w, st = w0, tx.init(w0)
    for g in grads:
        u, st = tx.update(g, st, w)
        w = optax.apply_updates(w, u)
    np.testing.assert_allclose(s.read("w"), np.asarray(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "make",
    [lambda: optax.sgd(0.1), lambda: optax.sgd(0.1, momentum=0.9, nesterov=True), lambda: optax.adam(0.05),
     lambda: optax.adagrad(0.1), lambda: optax.chain(optax.add_decayed_weights(1e-2), optax.rmsprop(0.01))],
    ids=["sgd", "nesterov", "adam", "adagrad", "wd+rmsprop"],
)
def test_sparse_gradient_exact_by_default(make: object) -> None:
    """Rows travel; the PS applies the dense rule with zero gradient elsewhere (repeated ids add up)."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((10, 4)).astype(np.float32)
    steps = [(np.array(ids, np.int64), rng.standard_normal((len(ids), 4)).astype(np.float32))
             for ids in ([1, 3, 3, 7], [0, 9], [], [3, 4, 5, 6, 7])]
    s = VariableStore()
    s.create("t", value=table, optimizer=Optimizer(make()))
    for idx, rows in steps:
        s.apply([Update("t", Op.SPARSE_APPLY_GRADIENT, rows, idx)])
    tx = make()
    w, st = table, tx.init(table)
    for idx, rows in steps:
        g = np.zeros_like(table)
        np.add.at(g, idx, rows)
        u, st = tx.update(g, st, w)
        w = optax.apply_updates(w, u)
    np.testing.assert_allclose(s.read("t"), np.asarray(w), rtol=1e-5, atol=1e-6)
    # The optimizer state is the dense run's too (a checkpoint of it resumes the same run).
    with s.frozen(["t"]) as [(_, _, got_state, _)]:
        got_leaves = jax.tree.leaves(got_state)
    want_leaves = jax.tree.leaves(st)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_sparse_gradient_lazy_rows() -> None:
    """lazy_rows(adam): only the pushed rows and their moments change; the step count advances once per push."""
    rng = np.random.default_rng(1)
    table = rng.standard_normal((10, 4)).astype(np.float32)
    steps = [(np.array([1, 3, 3, 7]), rng.standard_normal((4, 4)).astype(np.float32)),
             (np.array([3]), rng.standard_normal((1, 4)).astype(np.float32))]
    s = VariableStore()
    s.create("t", value=table, optimizer=Optimizer(lazy_rows(optax.adam(0.05))))
    for idx, rows in steps:
        s.apply([Update("t", Op.SPARSE_APPLY_GRADIENT, rows, idx)])
    got = s.read("t")
    # By hand (optax's Adam: b1=0.9, b2=0.999, eps=1e-8, bias correction by the push count).
    lr, b1, b2, eps = 0.05, 0.9, 0.999, 1e-8
    want = table.astype(np.float64).copy()
    m = np.zeros_like(want)
    v = np.zeros_like(want)
    for t, (idx, rows) in enumerate(steps, start=1):
        g = np.zeros_like(want)
        np.add.at(g, idx, rows)
        touched = np.unique(idx)
        m[touched] = b1 * m[touched] + (1 - b1) * g[touched]
        v[touched] = b2 * v[touched] + (1 - b2) * g[touched] ** 2
        mh, vh = m[touched] / (1 - b1 ** t), v[touched] / (1 - b2 ** t)
        want[touched] -= lr * mh / (np.sqrt(vh) + eps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    untouched = np.array([0, 2, 4, 5, 6, 8, 9])
    assert np.array_equal(got[untouched], table[untouched])
    # The exact mode moves untouched rows of the same run (their moments are not zero after step 1).
    e = VariableStore()
    e.create("t", value=table, optimizer=Optimizer(optax.adam(0.05)))
    for idx, rows in steps:
        e.apply([Update("t", Op.SPARSE_APPLY_GRADIENT, rows, idx)])
    assert not np.allclose(e.read("t")[[1, 7]], got[[1, 7]])


def test_lazy_rows_refuses_what_is_not_a_transformation() -> None:
    with pytest.raises(TypeError, match="GradientTransformation"):
        lazy_rows(object())  # type: ignore[arg-type]


def test_scatter_ops() -> None:
    s = VariableStore()
    s.create("v", value=np.zeros((4, 2), np.float32))
    idx = np.array([0, 2, 2])
    rows = np.array([[1, 1], [2, 2], [3, 3]], np.float32)
    s.apply([Update("v", Op.SCATTER_ADD, rows, idx)])
    assert s.read("v").tolist() == [[1, 1], [0, 0], [5, 5], [0, 0]]
    s.apply([Update("v", Op.SCATTER_SUB, rows[:1], idx[:1])])
    s.apply([Update("v", Op.SCATTER_MAX, np.full((1, 2), 7, np.float32), np.array([3]))])
    s.apply([Update("v", Op.SCATTER_MIN, np.full((1, 2), 4, np.float32), np.array([2]))])
    s.apply([Update("v", Op.SCATTER_UPDATE, np.full((1, 2), 9, np.float32), np.array([1]))])
    assert s.read("v").tolist() == [[0, 0], [9, 9], [4, 4], [7, 7]]
    assert s.read("v", np.array([3, 1])).tolist() == [[7, 7], [9, 9]]
    jax.block_until_ready(jax.numpy.zeros(1))


def test_create_many_is_all_or_none() -> None:
    """A batch with one bad entry (taken name, failing initializer, empty or repeated name)
    creates none of its entries; KEEP and REPLACE behave as in a single create."""
    from jaxdist.ps_server.store import NewVariable

    s = VariableStore()
    s.create("taken", value=f32(1))
    bad = [
        ([NewVariable("a", value=f32(1)), NewVariable("taken", value=f32(2))], VariableExistsError),
        ([NewVariable("a", value=f32(1)), NewVariable("b", shape=(2,), dtype=np.float32, initializer=lambda *a: 1 / 0)],
         InvalidRequestError),
        ([NewVariable("a", value=f32(1)), NewVariable("", value=f32(1))], InvalidRequestError),
        ([NewVariable("a", value=f32(1)), NewVariable("a", value=f32(2))], InvalidRequestError),
        ([NewVariable("a", value=f32(1)), NewVariable("b")], InvalidRequestError),
    ]
    for news, exc in bad:
        with pytest.raises(exc):
            s.create_many(news)
        assert [i.name for i in s.info()] == ["taken"]
    versions = s.create_many([NewVariable("a", value=f32(5)), NewVariable("taken", value=f32(9), if_exists=IfExists.KEEP)])
    assert versions == [1, 1] and np.array_equal(s.read("taken"), f32(1))
    s.create_many([NewVariable("taken", value=f32(9), if_exists=IfExists.REPLACE)])
    assert np.array_equal(s.read("taken"), f32(9))


def test_bfloat16_variables_restore_from_their_checkpoint(tmp_path: object) -> None:
    """``.npy`` stores bfloat16 as raw ``|V2``; Restore reads it back as bfloat16 (it failed to cast)."""
    import ml_dtypes

    from jaxdist.proto import codec, ps_pb2
    from jaxdist.ps_server import save_restore

    bf16 = np.dtype(ml_dtypes.bfloat16)
    s = VariableStore()
    s.create("w", value=np.arange(6, dtype=np.float32).reshape(3, 2).astype(bf16))
    s.create("c", value=np.array(1.5, bf16))
    save_restore.save(s, ps_pb2.SaveRequest(directory=str(tmp_path), file_name="ps-0.npz"))
    req = ps_pb2.RestoreRequest(directory=str(tmp_path))
    for name, shape, pieces in (("w", (3, 2), [(2, 3, 2), (0, 2, 0)]), ("c", (), [(0, 0, 0)])):
        e = req.entries.add(name=name)
        codec.spec_to_proto(shape, bf16, e.spec)
        for start, stop, dst in pieces:
            e.pieces.add(file="ps-0.npz", source=name, src_start=start, src_stop=stop, dst_start=dst)
    staged = {name: value for name, value, _, _ in save_restore.read_restore(req, 1 << 20, lambda blob, digest: None)}
    assert staged["w"].dtype == bf16 and np.array_equal(staged["w"], s.read("w"))
    assert staged["c"].dtype == bf16 and staged["c"] == s.read("c")


@pytest.mark.parametrize("op", [Op.APPLY_GRADIENT, Op.SPARSE_APPLY_GRADIENT], ids=["dense", "rows-exact"])
def test_optimizer_steps_update_in_place_and_open_reads_keep_their_snapshot(op: Op) -> None:
    """Adam's steps write into the table's own buffers (donated to XLA, no table-sized allocation
    per push) while nobody streams the value; a read snapshot open across a step keeps the value
    it started with, and every step equals plain optax's."""
    rng = np.random.default_rng(2)
    table = rng.standard_normal((64, 4)).astype(np.float32)
    idx = np.array([1, 5, 5, 63], np.int64)
    grads = [rng.standard_normal((len(idx), 4)).astype(np.float32) for _ in range(6)]

    def update(g: np.ndarray) -> Update:
        if op is Op.SPARSE_APPLY_GRADIENT:
            return Update("t", op, g, idx)
        dense = np.zeros_like(table)
        np.add.at(dense, idx, g)
        return Update("t", op, dense)

    def address() -> int:
        with s.frozen(["t"]) as [(_, value, _, _)]:
            return int(value.ctypes.data)

    s = VariableStore()
    s.create("t", value=table, optimizer=Optimizer(optax.adam(0.05)))
    tx = optax.adam(0.05)
    w, st = table, tx.init(table)

    def step(g: np.ndarray) -> None:
        nonlocal w, st
        s.apply([update(g)])
        dense = np.zeros_like(table)
        np.add.at(dense, idx, g)
        u, st = tx.update(dense, st, w)
        w = optax.apply_updates(w, u)

    step(grads[0])  # from the numpy value: XLA copies it in once
    step(grads[1])
    first = address()
    step(grads[2])
    assert address() == first, "the step allocated a new table instead of updating the donated one"
    with s.reading("t") as snap:
        assert snap.value is not None
        held = np.array(snap.value)
        step(grads[3])  # a pull streams the snapshot meanwhile: the step must not write into it
        np.testing.assert_array_equal(snap.value, held)
    step(grads[4])
    step(grads[5])
    np.testing.assert_allclose(s.read("t"), np.asarray(w), rtol=1e-5, atol=1e-6)
    with s.frozen(["t"]) as [(_, _, got_state, _)]:
        for a, b in zip(jax.tree.leaves(got_state), jax.tree.leaves(st)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
