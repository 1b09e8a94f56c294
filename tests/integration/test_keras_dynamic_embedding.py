"""``jaxdist.keras.layers.DynamicEmbedding`` in Keras ``fit``/``evaluate`` under ParameterServerStrategy, on
in-process clusters (real gRPC PS and workers), in the pytest process (``import jaxdist.keras`` first selects
Keras's JAX backend).

The reference of every comparison is computed here by hand: the dense layer's update by Keras's rule in
float64, and the table by :class:`~jaxdist.ps_server.dynamic_table.DynamicTableShard` objects (what the PS
tasks hold, and what ``jaxdist.DynamicEmbedding`` in a custom loop pushes to) fed the same batches' gradient
rows, one per key occurrence. One worker: the steps reach the PS in order, so the table's rows, its
counters (inserts, admissions refused, evictions, pushes) and the dense weights must equal the reference's.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402  (before keras: selects the JAX backend)
import keras  # noqa: E402
from jaxdist.base.errors import ConfigurationError  # noqa: E402
from jaxdist.ps_server.dynamic_table import DynamicTableShard, hash_keys, shard_of  # noqa: E402
from jaxdist.testing import InProcessCluster  # noqa: E402

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
    # int64 keys on Keras's JAX backend without x64: Keras's own warning when it builds the int64 input.
    pytest.mark.filterwarnings("ignore:.*Explicitly requested dtype int64.*:UserWarning"),
]

DIM, WIDTH, BATCH = 3, 2, 8


class Batches:
    """The per-worker dataset: fixed batches in order (module-level: it pickles to the workers by value)."""

    def __init__(self, keys: Any, y: np.ndarray) -> None:
        self.items = [(keys[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(y), BATCH)]

    def __call__(self, input_context: Any) -> Any:
        return self.items


def _close(strategy: Any) -> None:
    coord = strategy.coordinator
    if coord is not None:
        coord.shutdown(exit_tasks=False)
    strategy.close()


def _keys(kind: str, n: int, seed: int) -> Any:
    """``n x WIDTH`` keys from a small Zipf-like population (keys repeat within and across batches)."""
    rng = np.random.default_rng(seed)
    ids = (rng.zipf(1.5, size=(n, WIDTH)) % 23).astype(np.int64)
    if kind == "int64":
        return ids * 1_000_003 + (1 << 40)  # far past int32: never truncated on the way
    return np.array([[f"user-{i}" for i in row] for row in ids], dtype=object)


def _model(layer_options: dict[str, Any], optimizer: Any, key_dtype: str, spe: int = 1) -> Any:
    model = keras.Sequential([
        keras.Input((WIDTH,), dtype="int64" if key_dtype == "int64" else "string"),
        jaxdist.keras.layers.DynamicEmbedding(DIM, key_dtype=key_dtype, name="items", **layer_options),
        keras.layers.Flatten(), keras.layers.Dense(1, name="out")], name="dyn")  # fixed names: a backup's variables
    model.compile(optimizer, "mse", steps_per_execution=spe)
    return model


class _Dense:
    """Keras's rule for the dense layer's kernel and bias, by hand in float64."""

    def __init__(self, rule: str, lr: float, weights: list[np.ndarray]) -> None:
        self.rule, self.lr, self.t = rule, lr, 0
        self.w = [w.astype(np.float64) for w in weights]
        self.s = [[np.full_like(w, 0.1) if rule == "adagrad" else np.zeros_like(w), np.zeros_like(w)] for w in self.w]

    def apply(self, grads: list[np.ndarray]) -> None:
        self.t += 1
        for w, g, s in zip(self.w, grads, self.s):
            if self.rule == "sgd":
                w -= self.lr * g
            elif self.rule == "adagrad":
                s[0] += g * g
                w -= self.lr * g / np.sqrt(s[0] + 1e-7)
            else:  # Keras's Adam
                b1, b2 = 0.9, 0.999
                s[0] += (g - s[0]) * (1 - b1)
                s[1] += (g * g - s[1]) * (1 - b2)
                w -= s[0] * (self.lr * np.sqrt(1 - b2 ** self.t) / (1 - b1 ** self.t)) / (np.sqrt(s[1]) + 1e-7)


class _Table:
    """The reference table: one DynamicTableShard per PS task, as the PS tasks hold them."""

    def __init__(self, table: Any) -> None:
        self.shards = [DynamicTableShard(table.config, i, table.num_shards) for i in range(table.num_shards)]
        self.key_dtype = table.config.key_dtype

    def _split(self, keys: Any) -> tuple[Any, list[np.ndarray]]:
        flat = np.asarray(keys).reshape(-1)
        ks = flat.astype(np.int64) if self.key_dtype == "int64" else flat.tolist()
        where = shard_of(hash_keys(ks), len(self.shards))
        return ks, [np.flatnonzero(where == s) for s in range(len(self.shards))]

    def _pick(self, ks: Any, at: np.ndarray) -> Any:
        return ks[at] if isinstance(ks, np.ndarray) else [ks[int(i)] for i in at]

    def lookup(self, keys: Any) -> np.ndarray:
        ks, parts = self._split(keys)
        out = np.empty((len(ks), DIM), np.float32)
        for sh, at in zip(self.shards, parts):
            if len(at):
                out[at] = sh.lookup(self._pick(ks, at))[0]
        return out.reshape(np.shape(keys) + (DIM,))

    def push(self, keys: Any, grads: np.ndarray) -> None:
        ks, parts = self._split(keys)
        g = grads.reshape(-1, DIM).astype(np.float32)
        for sh, at in zip(self.shards, parts):
            if len(at):
                sh.apply(self._pick(ks, at), g[at])

    def stats(self) -> dict[str, int]:
        got = [sh.stats() for sh in self.shards]
        return {k: sum(s[k] for s in got) for k in got[0]}


def _reference(table: Any, rule: str, lr: float, initial: list[np.ndarray], keys: Any, y: np.ndarray,
               steps: int) -> tuple[_Table, _Dense]:
    """``steps`` steps of the model by hand: rows looked up, mse's gradient, Keras's dense rule, and one gradient
    row per key occurrence pushed to the reference table (what a custom loop with jaxdist.DynamicEmbedding does)."""
    ref, dense = _Table(table), _Dense(rule, lr, initial)
    for t in range(steps):
        kb, yb = keys[t * BATCH:(t + 1) * BATCH], y[t * BATCH:(t + 1) * BATCH].astype(np.float64)
        emb = ref.lookup(kb).astype(np.float64).reshape(len(yb), WIDTH * DIM)
        kernel, bias = dense.w
        d = 2 * (emb @ kernel + bias - yb) / len(yb)  # mse: d loss / d prediction
        g_rows = (d @ kernel.T).reshape(len(yb), WIDTH, DIM)
        dense.apply([emb.T @ d, d.sum(0)])
        ref.push(kb, g_rows)
    return ref, dense


CASES: dict[str, dict[str, Any]] = {
    # 1 PS, int64 keys past int32, admission at the 2nd sighting, 2 steps per closure.
    "sgd-1ps-int64": dict(num_ps=1, key_dtype="int64", rule="sgd", lr=0.5, spe=2, lazy=False,
                          layer=dict(min_count=2, seed=7)),
    # 2 PS, string keys, Adagrad, eviction by capacity (LFU) and time-to-live.
    "adagrad-2ps-string": dict(num_ps=2, key_dtype="string", rule="adagrad", lr=0.3, spe=1, lazy=False,
                               layer=dict(capacity=6, eviction_policy="lfu", ttl_steps=5, initializer="uniform")),
    # 2 PS, lazy Adam (chosen with lazy_embeddings), admission by probability, LRU.
    "lazy_adam-2ps-int64": dict(num_ps=2, key_dtype="int64", rule="adam", lr=0.05, spe=3, lazy=True,
                                layer=dict(admit_probability=0.7, capacity=4, seed=3)),
}


@pytest.mark.parametrize("case", [
    "sgd-1ps-int64",
    pytest.param("adagrad-2ps-string", marks=pytest.mark.slow),
    pytest.param("lazy_adam-2ps-int64", marks=pytest.mark.slow),
])
def test_fit_equals_the_custom_loop_reference(case: str) -> None:
    """fit with one worker: the table's rows and counters equal the reference shards' exactly (admission and
    eviction counts included), the dense weights Keras's rule by hand; evaluate's loss and predict's outputs
    are the hand-computed ones (and change nothing in the table)."""
    c = CASES[case]
    steps, epochs = 6, 2
    keys = _keys(c["key_dtype"], steps * BATCH, seed=len(case))
    y = np.random.default_rng(1).normal(size=(steps * BATCH, 1)).astype(np.float32)
    optimizer = {"sgd": keras.optimizers.SGD, "adagrad": keras.optimizers.Adagrad, "adam": keras.optimizers.Adam}
    with InProcessCluster(num_workers=1, num_ps=c["num_ps"]) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            with strategy.scope():
                model = _model(c["layer"], optimizer[c["rule"]](c["lr"]), c["key_dtype"], c["spe"])
            if c["lazy"]:
                jaxdist.keras.lazy_embeddings(model)
            initial = model.get_weights()  # the dense layer's only: the table has no Keras weights
            assert len(initial) == 2
            hist = model.fit(jaxdist.keras.DatasetCreator(Batches(keys, y)), epochs=epochs, steps_per_epoch=steps,
                             verbose=0)
            table = jaxdist.keras.dynamic_tables(model)["items"]
            assert isinstance(table, jaxdist.DynamicEmbedding) and table.num_shards == c["num_ps"]
            kernel, bias = model.get_weights()
            stats = table.stats()
            probe = _keys(c["key_dtype"], 200, seed=99)  # every key of the population (and a few never seen)
            got_rows = table.lookup(probe)
            evaluated = model.evaluate(keys, y, batch_size=BATCH, return_dict=True, verbose=0)
            predicted = model.predict(keys[:BATCH + 3], batch_size=BATCH, verbose=0)  # a short last batch
            assert int(model.optimizer.iterations.numpy()) == steps * epochs
            stats_after_eval = table.stats()
        finally:
            _close(strategy)
    ref, dense = _reference(table, c["rule"], c["lr"], initial, np.concatenate([keys] * epochs),
                            np.concatenate([y] * epochs), steps * epochs)
    want = ref.stats()
    assert stats == {k: want[k] for k in stats}, (stats, want)
    assert stats_after_eval == stats  # evaluate and predict read rows, change nothing
    if c["layer"].get("min_count", 1) > 1 or c["layer"].get("admit_probability", 1.0) < 1.0:
        assert stats["admissions_refused"] > 0, stats
    if c["layer"].get("capacity"):
        assert stats["evictions"] > 0, stats
    np.testing.assert_allclose(got_rows, ref.lookup(probe), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(kernel, dense.w[0], rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(bias, dense.w[1], rtol=2e-4, atol=2e-5)
    assert len(hist.history["loss"]) == epochs
    emb = ref.lookup(keys).astype(np.float64).reshape(len(y), WIDTH * DIM)
    want_loss = float(np.mean((emb @ dense.w[0] + dense.w[1] - y) ** 2))
    np.testing.assert_allclose(evaluated["loss"], want_loss, rtol=2e-4)
    assert predicted.shape == (BATCH + 3, 1)
    np.testing.assert_allclose(predicted, (emb @ dense.w[0] + dense.w[1])[:BATCH + 3], rtol=2e-4, atol=2e-5)


def _raises(exc: type[BaseException], fn: Callable[[], Any], *texts: str) -> None:
    with pytest.raises(exc) as info:
        fn()
    for text in texts:
        assert text in str(info.value), (text, str(info.value))


def test_refusals_name_what_to_use_instead() -> None:
    """Outside ParameterServerStrategy (no scope, a synchronous strategy), optimizers a dynamic table cannot apply,
    Keras's save, predict's callbacks, and a layer not fed by a model input: each a clear error, nothing trained."""
    keys = _keys("int64", 16, seed=0)
    y = np.zeros((16, 1), np.float32)
    data = jaxdist.keras.DatasetCreator(Batches(keys, y))
    _raises(ConfigurationError, lambda: jaxdist.keras.layers.DynamicEmbedding(4), "outside any strategy scope",
            "ParameterServerStrategy", "keras.layers.Embedding")
    with jaxdist.sync.OneDeviceStrategy("cpu:0").scope():
        _raises(ConfigurationError, lambda: jaxdist.keras.layers.DynamicEmbedding(4), "under OneDeviceStrategy",
                "jaxdist.DynamicEmbedding")
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            with strategy.scope():
                _raises(ConfigurationError, lambda: jaxdist.keras.layers.DynamicEmbedding(4, eviction_policy="fifo"),
                        "eviction policy")
                momentum = _model({}, keras.optimizers.SGD(0.1, momentum=0.9), "int64")
            _raises(jaxdist.keras.UnsupportedOptimizerError, lambda: momentum.fit(data, steps_per_epoch=1, verbose=0),
                    "momentum=0.9", "Adagrad", "lazy_embeddings")
            with strategy.scope():
                adam = _model({"table_name": "adam_items"}, keras.optimizers.Adam(0.01), "int64")
                rms = _model({"table_name": "rms_items"}, keras.optimizers.RMSprop(0.01), "int64")
            _raises(jaxdist.keras.UnsupportedOptimizerError, lambda: adam.fit(data, steps_per_epoch=1, verbose=0),
                    "lazily", "jaxdist.keras.lazy_embeddings(model)")
            _raises(jaxdist.keras.UnsupportedOptimizerError, lambda: rms.fit(data, steps_per_epoch=1, verbose=0),
                    "RMSprop", "SGD (without momentum")
            assert not strategy.dynamic_tables  # refused before any table was made
            with strategy.scope():
                model = _model({}, keras.optimizers.SGD(0.1), "int64")
                clash = _model({}, keras.optimizers.SGD(0.1), "int64")  # the same layer name: the same table name
                inp = keras.Input((WIDTH,))
                hidden = keras.layers.Dense(WIDTH)(inp)
                fed_by_a_layer = keras.Model(inp, jaxdist.keras.layers.DynamicEmbedding(4)(hidden))
                fed_by_a_layer.compile(keras.optimizers.SGD(0.1), "mse")
            model.fit(data, steps_per_epoch=2, verbose=0)
            assert set(strategy.dynamic_tables) == {"items"}
            on_ps = jaxdist.keras.ps_model.ps_model(model)
            assert on_ps is not None and on_ps.steps_applied() == 2
            for saver in (keras.callbacks.ModelCheckpoint(os.devnull + ".keras"),
                          jaxdist.keras.ModelCheckpoint(os.devnull + ".weights.h5", save_weights_only=True)):
                _raises(ConfigurationError, lambda: model.fit(data, steps_per_epoch=1, verbose=0, callbacks=[saver]),
                        "jaxdist.keras.BackupAndRestore")
            assert on_ps.steps_applied() == 2  # the PS step counter: refused before any step
            _raises(ConfigurationError, lambda: clash.fit(data, steps_per_epoch=1, verbose=0), "table_name")
            with strategy.scope():
                a_in, b_in = keras.Input((WIDTH,), dtype="int64"), keras.Input((WIDTH,), dtype="int64")
                twice = keras.Model([a_in, b_in], keras.layers.Concatenate()([
                    jaxdist.keras.layers.DynamicEmbedding(2, table_name="shared")(a_in),
                    jaxdist.keras.layers.DynamicEmbedding(2, table_name="shared")(b_in)]))
                twice.compile(keras.optimizers.SGD(0.1), "mse")
            _raises(ConfigurationError, lambda: twice.fit([keys, keys], np.zeros((16, WIDTH, 4), np.float32),
                                                          verbose=0), "'shared'")
            assert set(strategy.dynamic_tables) == {"items"}  # neither of the two was made
            _raises(ConfigurationError, lambda: fed_by_a_layer.fit(np.zeros((8, WIDTH), np.float32),
                                                                   np.zeros((8, WIDTH, 4), np.float32), verbose=0),
                    "directly on a model input")
            _raises(ValueError, lambda: model.predict(keys, verbose=0, callbacks=[keras.callbacks.History()]),
                    "callbacks")
            _raises(ConfigurationError, lambda: model.save_weights(os.devnull + ".weights.h5"), "jaxdist.Checkpoint")
            _raises(ConfigurationError, lambda: model(keys[:2]), "outside jaxdist's fit")

            def custom_loop_step() -> Any:
                return model(keys[:2])

            _raises(ConfigurationError, lambda: strategy.coordinator.schedule(custom_loop_step).fetch(),
                    "jaxdist.DynamicEmbedding (lookup, apply_gradients)")
        finally:
            _close(strategy)


@pytest.mark.slow
def test_backup_and_restore_saves_and_restores_the_table(tmp_path: Path) -> None:
    """jaxdist.keras.BackupAndRestore's backup holds the table (keys, rows, optimizer state, counters): a re-run
    against fresh parameter servers restores it, and the resumed fit ends where an uninterrupted one does."""
    keys = _keys("string", 4 * BATCH, seed=5)
    y = np.random.default_rng(2).normal(size=(4 * BATCH, 1)).astype(np.float32)
    layer = dict(min_count=2, capacity=10)

    def run(epochs: int, backup: bool) -> tuple[dict[str, int], np.ndarray, list[np.ndarray]]:
        with InProcessCluster(num_workers=1, num_ps=2) as cluster:
            strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
            try:
                with strategy.scope():
                    keras.utils.set_random_seed(4)
                    model = _model(layer, keras.optimizers.Adagrad(0.2), "string")
                callbacks = [jaxdist.keras.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False)] \
                    if backup else []
                model.fit(jaxdist.keras.DatasetCreator(Batches(keys, y)), epochs=epochs, steps_per_epoch=4,
                          callbacks=callbacks, verbose=0)
                table = jaxdist.keras.dynamic_tables(model)["items"]
                probe = _keys("string", 100, seed=99)
                return table.stats(), table.lookup(probe), model.get_weights()
            finally:
                _close(strategy)

    first = run(1, backup=True)
    assert first[0]["rows"] > 0 and first[0]["admissions_refused"] > 0, first[0]
    resumed = run(2, backup=True)  # restores epoch 1's backup (fresh PS tasks), trains epoch 2
    straight = run(2, backup=False)
    assert resumed[0] == straight[0], (resumed[0], straight[0])
    np.testing.assert_array_equal(resumed[1], straight[1])
    for a, b in zip(resumed[2], straight[2]):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_a_row_sparse_embedding_and_a_dynamic_one_in_one_model() -> None:
    """A functional model with two inputs: a Keras Embedding partitioned over 2 PS (rows on the wire) and a
    DynamicEmbedding, concatenated into a Dense layer. The worker's copy holds the compact dynamic table between
    the Keras table and the kernel among its trainable variables: every gradient must reach its own variable.
    Reference by hand: SGD on both tables (the looked-up rows), the DynamicTableShards, the dense layer."""
    vocab, steps, lr = 50, 5, 0.5
    rng = np.random.default_rng(8)
    ids = rng.integers(0, vocab, size=(steps * BATCH, WIDTH)).astype(np.int32)
    keys = _keys("int64", steps * BATCH, seed=21)
    y = rng.normal(size=(steps * BATCH, 1)).astype(np.float32)
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(
            cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            with strategy.scope():
                id_in = keras.Input((WIDTH,), dtype="int32", name="ids")
                key_in = keras.Input((WIDTH,), dtype="int64", name="keys")
                static = keras.layers.Flatten()(keras.layers.Embedding(vocab, DIM, name="static")(id_in))
                dynamic = keras.layers.Flatten()(
                    jaxdist.keras.layers.DynamicEmbedding(DIM, name="dynamic", seed=5, min_count=2)(key_in))
                out = keras.layers.Dense(1, name="out")(keras.layers.Concatenate()([static, dynamic]))
                model = keras.Model([id_in, key_in], out)
                model.compile(keras.optimizers.SGD(lr), "mse")
            table0, kernel0, bias0 = model.get_weights()
            items = [([ids[i:i + BATCH], keys[i:i + BATCH]], y[i:i + BATCH]) for i in range(0, len(y), BATCH)]
            model.fit(jaxdist.keras.DatasetCreator(lambda ctx: items), epochs=1, steps_per_epoch=steps, verbose=0)
            assert isinstance(jaxdist.keras.ps_variables(model)[0], jaxdist.ShardedVariable)
            table_got, kernel_got, bias_got = model.get_weights()
            dyn = jaxdist.keras.dynamic_tables(model)["dynamic"]
            stats = dyn.stats()
            rows_got = dyn.lookup(keys)
        finally:
            _close(strategy)
    ref = _Table(dyn)
    table, kernel, bias = table0.astype(np.float64), kernel0.astype(np.float64), bias0.astype(np.float64)
    for t in range(steps):
        sl = slice(t * BATCH, (t + 1) * BATCH)
        emb_s = table[ids[sl]].reshape(BATCH, WIDTH * DIM)
        emb_d = ref.lookup(keys[sl]).astype(np.float64).reshape(BATCH, WIDTH * DIM)
        feats = np.concatenate([emb_s, emb_d], axis=1)
        d = 2 * (feats @ kernel + bias - y[sl]) / BATCH
        g_feats = d @ kernel.T
        g_table = np.zeros_like(table)
        np.add.at(g_table, ids[sl], g_feats[:, :WIDTH * DIM].reshape(BATCH, WIDTH, DIM))
        kernel, bias = kernel - lr * feats.T @ d, bias - lr * d.sum(0)
        table -= lr * g_table
        ref.push(keys[sl], g_feats[:, WIDTH * DIM:].reshape(BATCH, WIDTH, DIM))
    want = ref.stats()
    assert stats == {k: want[k] for k in stats}, (stats, want)
    assert stats["admissions_refused"] > 0 and stats["rows"] > 0, stats
    np.testing.assert_allclose(rows_got, ref.lookup(keys), rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(table_got, table, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(kernel_got, kernel, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(bias_got, bias, rtol=2e-4, atol=2e-5)
