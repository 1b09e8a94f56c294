"""Keras 3 fit/evaluate/predict under ParameterServerStrategy, on in-process clusters (real gRPC PS and workers).

Keras picks its backend at import and the pytest process stays Keras-free, so
every check runs in ONE fresh subprocess (``python tests/integration/test_keras_ps.py``)
that prints one JSON line ``{check: null | traceback}``; each test asserts on
one check's result. The reference of every comparison is Keras's own
single-device run of the same program (same initial weights, same batches
in the same order).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import pytest
from keras_util import classification_data

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

RESULT_PREFIX = "KERAS_PS_RESULTS="
CHECKS: dict[str, Callable[[], None]] = {}

# float32: the PS applies the update in its own jit, Keras in its fused train step (1-ulp differences).
RTOL, ATOL = 2e-5, 2e-6


def check(fn: Callable[[], None]) -> Callable[[], None]:
    CHECKS[fn.__name__] = fn
    return fn


# ---------------------------------------------------------------------------------------
# Helpers (inside the subprocess)
# ---------------------------------------------------------------------------------------


_data = functools.partial(classification_data, n=192, d=8, classes=3, noise=0.3)


class Batches:
    """The per-worker dataset: fixed batches in order (module-level: it pickles to the workers)."""

    def __init__(self, x: Any, y: Any, batch: int) -> None:
        self.items = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]

    def __call__(self, input_context: Any) -> Any:
        return self.items


def _mlp(optimizer: Any, steps_per_execution: int = 1) -> Any:
    import keras

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
    return model


def _cluster(num_workers: int, num_ps: int) -> Any:
    from jaxdist.testing import InProcessCluster

    return InProcessCluster(num_workers=num_workers, num_ps=num_ps)


def _close(strategy: Any) -> None:
    coord = strategy.coordinator
    if coord is not None:
        coord.shutdown(exit_tasks=False)
    strategy.close()


def _assert_weights(got: list[Any], want: list[Any], what: str) -> None:
    import numpy as np

    assert len(got) == len(want), what
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"{what}: weight {i}")


def _bn_dropout(optimizer: Any, steps_per_execution: int = 1) -> Any:
    import keras

    # No bias before BatchNormalization: its gradient is float noise, which Adam would amplify into the result.
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, use_bias=False), keras.layers.BatchNormalization(),
                              keras.layers.Activation("relu"), keras.layers.Dropout(0.3, seed=7), keras.layers.Dense(3)])
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"],
                  steps_per_execution=steps_per_execution)
    return model


def _parity(make_optimizer: Callable[[], Any], spe: int = 1, make_model: Callable[..., Any] = _mlp) -> None:
    """1 worker (steps in order), 2 PS, every variable partitioned in 2: the same weights, logs and step count as Keras."""
    import numpy as np

    import jaxdist
    import jaxdist.keras

    x, y = _data()
    epochs, steps = 2, 6  # 6 batches of 32 = one pass per epoch
    with _cluster(1, 2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(),
                                                   variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            with strategy.scope():
                model = make_model(make_optimizer(), spe)
            initial = [v.numpy() for v in model.variables]  # with the seed and BatchNormalization state
            hist = model.fit(jaxdist.keras.DatasetCreator(Batches(x, y, 32)), epochs=epochs, steps_per_epoch=steps,
                             verbose=0)
            got = [v.numpy() for v in model.variables]
            kernel = jaxdist.keras.ps_variables(model)[0]
            assert isinstance(kernel, jaxdist.ShardedVariable) and len(kernel.variables) == 2, kernel
            assert int(model.optimizer.iterations.numpy()) == epochs * steps
        finally:
            _close(strategy)
    ref = make_model(make_optimizer(), spe)
    for v, value in zip(ref.variables, initial):
        v.assign(value)
    ref_hist = ref.fit(x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0)
    _assert_weights(got, [v.numpy() for v in ref.variables], "PS fit vs Keras fit")
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(hist.history[key], ref_hist.history[key], rtol=1e-5, err_msg=key)


# ---------------------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------------------


@check
def parity_sgd() -> None:
    import keras

    _parity(lambda: keras.optimizers.SGD(0.1))


@check
def parity_sgd_momentum_steps_per_execution() -> None:
    import keras

    _parity(lambda: keras.optimizers.SGD(0.05, momentum=0.9), spe=4)  # 6 steps: closures of 4 then 2


@check
def parity_sgd_nesterov() -> None:
    import keras

    _parity(lambda: keras.optimizers.SGD(0.05, momentum=0.8, nesterov=True))


@check
def parity_adam() -> None:
    import keras

    _parity(lambda: keras.optimizers.Adam(0.01))


@check
def parity_adam_amsgrad_clipnorm() -> None:
    import keras

    _parity(lambda: keras.optimizers.Adam(0.01, amsgrad=True, clipnorm=0.5))


@check
def parity_rmsprop_centered_momentum() -> None:
    import keras

    _parity(lambda: keras.optimizers.RMSprop(0.005, momentum=0.5, centered=True))


@check
def parity_rmsprop() -> None:
    import keras

    _parity(lambda: keras.optimizers.RMSprop(0.01, clipvalue=0.1))


@check
def parity_sgd_global_clipnorm() -> None:
    import keras

    _parity(lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.3))


@check
def parity_adagrad() -> None:
    import keras

    _parity(lambda: keras.optimizers.Adagrad(0.1))


@check
def parity_batchnorm_dropout() -> None:
    """Non-trainable state (BatchNormalization statistics, Dropout's seed) lives on the PS and follows Keras's."""
    import keras

    _parity(lambda: keras.optimizers.Adam(0.01), spe=2, make_model=_bn_dropout)


@check
def two_workers_exact_steps_and_metrics() -> None:
    """2 workers, steps_per_execution 3 over 7 steps: the PS applies exactly 7 steps per epoch, metrics count every row."""
    import keras

    import jaxdist
    import jaxdist.keras

    x, y = _data()
    with _cluster(2, 2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            with strategy.scope():
                model = _mlp(keras.optimizers.Adam(0.01), steps_per_execution=3)
            counts = []

            class Counts(keras.callbacks.Callback):
                def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                    counts.append([float(v.numpy()) for v in self.model.metrics_variables if v.path.endswith("count")])

            hist = model.fit(jaxdist.keras.DatasetCreator(Batches(x, y, 32)), epochs=3, steps_per_epoch=7, verbose=0,
                             callbacks=[Counts()])
            assert int(model.optimizer.iterations.numpy()) == 21
            assert strategy.coordinator.closure_counts.finished >= 9  # 3 closures (3+3+1 steps) per epoch
            assert counts and all(c == [7 * 32.0] * len(c) for c in counts), counts  # loss and accuracy: 224 rows each
            assert len(hist.history["loss"]) == 3 and hist.history["loss"][-1] < hist.history["loss"][0], hist.history
        finally:
            _close(strategy)


@check
def fit_on_arrays_shards_rows_over_workers() -> None:
    """fit(x, y, batch_size=) as tf.keras: each worker its shard of the rows; an epoch is one pass of steps by default."""
    import keras

    import jaxdist

    x, y = _data(n=200)
    with _cluster(2, 1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            with strategy.scope():
                model = _mlp(keras.optimizers.Adam(0.02), steps_per_execution=2)
            hist = model.fit(x, y, batch_size=32, epochs=4, verbose=0)
            assert int(model.optimizer.iterations.numpy()) == 4 * 7  # ceil(200 / 32) steps per epoch
            # How far the model gets depends on the order the workers' pushes land
            # (asynchronous training), so only the direction of the loss is checked, not an
            # accuracy bar (CI stop 22 saw 0.73 after 4 epochs where quiet runs reach 0.85).
            assert hist.history["loss"][-1] < hist.history["loss"][0], hist.history
        finally:
            _close(strategy)


@check
def evaluate_exactly_once_matches_keras() -> None:
    """evaluate visits each row once (arrays with a short last batch, and a DatasetCreator sequence); same as Keras."""
    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras

    x, y = _data(n=250, seed=1)
    with _cluster(2, 2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            with strategy.scope():
                model = _mlp(keras.optimizers.SGD(0.1), steps_per_execution=3)
            model.fit(jaxdist.keras.DatasetCreator(Batches(x, y, 25)), epochs=1, steps_per_epoch=5, verbose=0)
            got = model.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
            count = [float(v.numpy()) for v in model.metrics_variables if v.path.endswith("count")]
            assert count == [250.0] * len(count), count
            seq = Batches(x, y, 50)
            got_seq = model.evaluate(jaxdist.keras.DatasetCreator(seq), steps=5, return_dict=True, verbose=0)
            as_list = model.evaluate(x, y, batch_size=32, verbose=0)
            preds = model.predict(x[:10], verbose=0)
            weights = model.get_weights()
        finally:
            _close(strategy)
    ref = _mlp(keras.optimizers.SGD(0.1))
    ref.set_weights(weights)
    want = ref.evaluate(x, y, batch_size=32, return_dict=True, verbose=0)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, err_msg=key)
        np.testing.assert_allclose(got_seq[key], want[key], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose(as_list, [want["loss"], want["accuracy"]], rtol=1e-5)
    np.testing.assert_allclose(preds, ref.predict(x[:10], verbose=0), rtol=1e-5, atol=1e-6)


@check
def validation_data_is_evaluated_each_epoch() -> None:
    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras

    x, y = _data()
    xv, yv = _data(n=70, seed=3)
    with _cluster(1, 1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            with strategy.scope():
                model = _mlp(keras.optimizers.SGD(0.1))
            hist = model.fit(jaxdist.keras.DatasetCreator(Batches(x, y, 32)), epochs=3, steps_per_epoch=6,
                             validation_data=(xv, yv), validation_batch_size=16, verbose=0)
            # The last validation (one exactly-once dataset serves the 3 of them) counted each of the 70 rows once.
            counts = [float(v.numpy()) for v in model.metrics_variables if v.path.endswith("count")]
            assert counts == [70.0] * len(counts), counts
            last = model.evaluate(xv, yv, return_dict=True, verbose=0)
            # Keras's positional order (x, y, batch_size, verbose, sample_weight): 16 is the batch size; it was
            # taken as sample_weight (an indexing error).
            positional = model.evaluate(xv, yv, 16, 0, None, return_dict=True)
        finally:
            _close(strategy)
    assert set(hist.history) == {"loss", "accuracy", "val_loss", "val_accuracy"}, hist.history
    assert len(hist.history["val_loss"]) == 3, hist.history
    np.testing.assert_allclose(hist.history["val_loss"][-1], last["loss"], rtol=1e-6)
    np.testing.assert_allclose(positional["loss"], last["loss"], rtol=1e-6)


class _CoordinatorValidation:
    """A callback: at each epoch's end, the validation loss computed on the coordinator at the weights
    the validation ran with (Keras's own predict, which reads the PS's weights), beside fit's val_loss."""

    def __init__(self, xv: Any, yv: Any) -> None:
        import keras

        class Callback(keras.callbacks.Callback):
            def on_epoch_end(cb, epoch: int, logs: Any = None) -> None:  # noqa: N805 - the outer object is self
                import numpy as np

                logits = cb.model.predict(xv, verbose=0)
                z = logits - logits.max(axis=1, keepdims=True)
                losses = np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(yv)), yv]
                self.rows.append((float(logs["val_loss"]), float(losses.mean())))

        self.rows: list[tuple[float, float]] = []
        self.callback = Callback()


@check
def validation_is_exact_for_every_steps_per_execution() -> None:
    """fit's val_loss under ParameterServerStrategy equals the coordinator's own evaluation at the same
    weights, every epoch, for steps_per_execution 1, 2, 4, 10 with 3 and 7 validation batches, on 1 and 2
    workers. Each validation's last closure took steps_per_execution batches even past the end of the pass,
    eating into the next epoch's validation (wrong val_loss, then 0.0)."""
    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras

    x, y = _data(n=96)
    failures = []
    for workers in (1, 2):
        with _cluster(workers, 1) as cluster:
            for spe in (1, 2, 4, 10):
                for val_batches in (3, 7):
                    xv, yv = _data(n=val_batches * 8 - 3, seed=3)  # the last batch short: 5 rows
                    strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
                    try:
                        with strategy.scope():
                            model = _mlp(keras.optimizers.SGD(0.1), steps_per_execution=spe)
                        seen = _CoordinatorValidation(xv, yv)
                        model.fit(jaxdist.keras.DatasetCreator(Batches(x, y, 32)), epochs=4, steps_per_epoch=3,
                                  validation_data=(xv, yv), validation_batch_size=8, callbacks=[seen.callback],
                                  verbose=0)
                    finally:
                        _close(strategy)
                    got = np.array(seen.rows)
                    if len(got) != 4 or not np.allclose(got[:, 0], got[:, 1], rtol=1e-5, atol=1e-6):
                        failures.append(f"workers={workers} spe={spe} val_batches={val_batches}: "
                                        f"(val_loss, coordinator's) per epoch {seen.rows}")
    assert not failures, "\n".join(failures)


def _embedding_optimizer(name: str) -> Any:
    """Every Keras optimizer the PS implements, by name, with settings that use each of its slots."""
    import keras

    o = keras.optimizers
    return {
        "sgd": lambda: o.SGD(1.0),
        "sgd_momentum": lambda: o.SGD(0.5, momentum=0.9),
        "sgd_nesterov": lambda: o.SGD(0.5, momentum=0.8, nesterov=True),
        "adam": lambda: o.Adam(0.01),
        "adam_amsgrad": lambda: o.Adam(0.01, amsgrad=True),
        "adamw": lambda: o.AdamW(0.01, weight_decay=0.05),
        "rmsprop": lambda: o.RMSprop(0.005, momentum=0.5, centered=True),
        "adagrad": lambda: o.Adagrad(0.5),
        "adamax": lambda: o.Adamax(0.01),
        "nadam": lambda: o.Nadam(0.01),
        "ftrl": lambda: o.Ftrl(0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.01, beta=0.1),
    }[name]()


def _embedding_parity(names: list[str], vocab: int = 20_000, dim: int = 16) -> None:
    """An Embedding partitioned over 3 PS tasks (a ShardedVariable), each optimizer in the exact mode: the same
    weights and evaluation as Keras's single-device fit, and each step pulls and pushes only the looked-up rows."""
    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras

    n, batch, epochs, steps = 192, 32, 2, 6
    rng = np.random.default_rng(5)
    ids = rng.integers(0, vocab, size=(n, 4)).astype(np.int32)
    y = (ids[:, 0] % 2).astype(np.int32)

    def make(make_optimizer: Callable[[], Any]) -> Any:
        model = keras.Sequential([keras.Input((4,), dtype="int32"), keras.layers.Embedding(vocab, dim),
                                  keras.layers.Flatten(), keras.layers.Dense(2)])
        model.compile(make_optimizer(), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    def moved(strategy: Any) -> tuple[int, int]:
        counters = [c.status().counters for c in strategy.connections.clients]
        return sum(c["bytes_pulled"] for c in counters), sum(c["bytes_pushed"] for c in counters)

    table_bytes = vocab * dim * 4
    # The distinct ids of each step's batch: their rows are what moves (values both ways, int64 ids pushed).
    distinct = epochs * sum(len(np.unique(ids[i:i + batch])) for i in range(0, n, batch))
    failures = []
    with _cluster(1, 3) as cluster:
        strategy = jaxdist.ParameterServerStrategy(
            cluster.cluster_resolver(), variable_partitioner=jaxdist.MinSizePartitioner(min_shard_bytes=1024, max_shards=3))
        try:
            for name in names:
                with strategy.scope():
                    model = make(lambda: _embedding_optimizer(name))
                initial = model.get_weights()
                model_bytes = sum(w.nbytes for w in initial)
                dense_rest = model_bytes - table_bytes
                pulled0, pushed0 = moved(strategy)
                model.fit(jaxdist.keras.DatasetCreator(Batches(ids, y, batch)), epochs=epochs, steps_per_epoch=steps,
                          verbose=0)
                pulled1, pushed1 = moved(strategy)
                table = jaxdist.keras.ps_variables(model)[0]
                assert isinstance(table, jaxdist.ShardedVariable) and len(table.variables) == 3, table
                got = model.get_weights()
                got_eval = model.evaluate(ids, y, batch_size=batch, return_dict=True, verbose=0)
                # Each epoch end syncs the whole model to the coordinator: that pull is not a step's.
                pulled = pulled1 - pulled0 - epochs * model_bytes
                pushed = pushed1 - pushed0 - model_bytes  # the first fit creates the PS variables with their values
                total = epochs * steps
                # Per step: the distinct ids' rows and the small dense layer whole, plus a few bytes (the step
                # counter); never the table (1.28 MB, 20x a step's bytes).
                want_pulled = distinct * dim * 4 + total * dense_rest
                want_pushed = distinct * (dim * 4 + 8) + total * dense_rest
                if not want_pulled <= pulled <= want_pulled + total * 64:
                    failures.append(f"{name}: pulled {pulled} bytes in {total} steps, rows+dense {want_pulled}")
                if not want_pushed <= pushed <= want_pushed + total * 64:
                    failures.append(f"{name}: pushed {pushed} bytes in {total} steps, rows+ids+dense {want_pushed}")
                ref = make(lambda: _embedding_optimizer(name))
                ref.set_weights(initial)
                ref.fit(ids, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
                want = ref.get_weights()
                for i, (g, w) in enumerate(zip(got, want)):
                    if not np.allclose(g, w, rtol=1e-5, atol=1e-5):
                        failures.append(f"{name}: weight {i} differs from Keras's by {np.max(np.abs(g - w))}")
                want_eval = ref.evaluate(ids, y, batch_size=batch, return_dict=True, verbose=0)
                for key in ("loss", "accuracy"):
                    if not np.allclose(got_eval[key], want_eval[key], rtol=1e-5):
                        failures.append(f"{name}: {key} {got_eval[key]} vs Keras's {want_eval[key]}")
        finally:
            _close(strategy)
    assert not failures, "\n".join(failures)


@check
def embedding_rows_only_exact_sgd_family() -> None:
    """SGD (plain, momentum, nesterov) and Adagrad: rows on the wire, Keras's weights."""
    _embedding_parity(["sgd", "sgd_momentum", "sgd_nesterov", "adagrad"])


@check
def embedding_rows_only_exact_adam_family() -> None:
    """Adam (and amsgrad), AdamW, Adamax, Nadam: rows on the wire, Keras's dense rule on the PS."""
    _embedding_parity(["adam", "adam_amsgrad", "adamw", "adamax", "nadam"])


@check
def embedding_rows_only_exact_rmsprop_ftrl() -> None:
    """RMSprop (centered, momentum) and Ftrl (l1, l2, beta): rows on the wire, Keras's weights."""
    _embedding_parity(["rmsprop", "ftrl"])


@check
def embedding_lazy_mode_matches_a_hand_computation() -> None:
    """jaxdist.keras.lazy_embeddings(model): Adam changes only the looked-up rows and their moments (TF's LazyAdam),
    computed here by hand; the dense layer follows Keras's dense rule; rows only on the wire."""
    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras
    from jaxdist.base.errors import ConfigurationError

    vocab, dim, batch, steps = 5_000, 4, 8, 5
    rng = np.random.default_rng(11)
    ids = rng.integers(0, 40, size=(batch * steps, 2)).astype(np.int32)  # few ids: rows repeat across steps
    y = rng.normal(size=(batch * steps, 1)).astype(np.float32)
    lr, b1, b2, eps = 0.01, 0.9, 0.999, 1e-7
    with _cluster(1, 2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(
            cluster.cluster_resolver(), variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            with strategy.scope():
                model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(vocab, dim),
                                          keras.layers.Flatten(), keras.layers.Dense(1)])
                model.compile(keras.optimizers.Adam(lr, beta_1=b1, beta_2=b2, epsilon=eps), "mse")
            assert jaxdist.keras.lazy_embeddings(model) is model
            table0, kernel0, bias0 = [w.astype(np.float64) for w in model.get_weights()]
            model.fit(jaxdist.keras.DatasetCreator(Batches(ids, y, batch)), epochs=1, steps_per_epoch=steps, verbose=0)
            got = model.get_weights()
            try:
                jaxdist.keras.lazy_embeddings(model, lazy=False)
            except ConfigurationError as e:
                assert "already" in str(e), e
            else:
                raise AssertionError("switching modes after the first fit was accepted")
            jaxdist.keras.lazy_embeddings(model, lazy=True)  # the same mode again: fine
        finally:
            _close(strategy)
    # By hand (float64): Keras's Adam on the dense layer; on the table, the same rule restricted to each step's rows.
    table, kernel, bias = table0.copy(), kernel0.copy(), bias0.copy()
    state = {k: (np.zeros_like(v), np.zeros_like(v)) for k, v in (("t", table), ("k", kernel), ("b", bias))}

    def adam(key: str, value: np.ndarray, g: np.ndarray, t: int, rows: Any = slice(None)) -> None:
        m, v = state[key]
        m[rows] += (g[rows] - m[rows]) * (1 - b1)
        v[rows] += (g[rows] ** 2 - v[rows]) * (1 - b2)
        alpha = lr * np.sqrt(1 - b2 ** t) / (1 - b1 ** t)
        value[rows] -= m[rows] * alpha / (np.sqrt(v[rows]) + eps)

    for t in range(1, steps + 1):
        xb, yb = ids[(t - 1) * batch:t * batch], y[(t - 1) * batch:t * batch].astype(np.float64)
        emb = table[xb].reshape(batch, 2 * dim)
        err = emb @ kernel + bias - yb  # mse: d/dpred = 2 * err / batch
        d = 2 * err / batch
        g_kernel, g_bias = emb.T @ d, d.sum(0)
        g_emb = (d @ kernel.T).reshape(batch, 2, dim)
        g_table = np.zeros_like(table)
        np.add.at(g_table, xb, g_emb)
        looked_up = np.unique(xb)
        adam("k", kernel, g_kernel, t)
        adam("b", bias, g_bias, t)
        adam("t", table, g_table, t, looked_up)
    untouched = np.setdiff1d(np.arange(vocab), np.unique(ids))
    assert np.array_equal(got[0][untouched], table0[untouched].astype(np.float32))  # never looked up: unchanged
    np.testing.assert_allclose(got[0], table, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[1], kernel, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], bias, rtol=1e-5, atol=1e-5)


@check
def refusals_are_clear() -> None:
    import keras
    import numpy as np

    import jaxdist
    import jaxdist.keras
    from jaxdist.base.errors import ConfigurationError

    x, y = _data()
    data = jaxdist.keras.DatasetCreator(Batches(x, y, 32))

    def raises(exc: type, fn: Callable[[], Any], text: str) -> None:
        try:
            fn()
        except exc as e:
            assert text in str(e), (text, e)
        else:
            raise AssertionError(f"no {exc.__name__} ({text})")

    with _cluster(1, 1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            with strategy.scope():
                model = _mlp(keras.optimizers.SGD(0.1))
                lion = _mlp(keras.optimizers.Lion(0.1))
                ema = _mlp(keras.optimizers.SGD(0.1, use_ema=True))
                scheduled = _mlp(keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.9)))
            raises(ValueError, lambda: model.fit(data, epochs=1, verbose=0), "steps_per_epoch")
            raises(ConfigurationError, lambda: model.fit((b for b in [(x, y)]), steps_per_epoch=2, verbose=0),
                   "DatasetCreator")
            raises(ValueError, lambda: model.fit(data, y, steps_per_epoch=2, verbose=0), "y=")
            raises(ValueError, lambda: model.fit(x, y, class_weight={0: 1.0}, verbose=0), "class_weight")
            raises(ValueError, lambda: model.evaluate(data, verbose=0), "steps=")
            raises(jaxdist.keras.UnsupportedOptimizerError, lambda: lion.fit(data, steps_per_epoch=1, verbose=0),
                   "Lion")
            raises(jaxdist.keras.UnsupportedOptimizerError, lambda: ema.fit(data, steps_per_epoch=1, verbose=0),
                   "use_ema")
            raises(ConfigurationError, lambda: jaxdist.keras.lazy_embeddings(_mlp(keras.optimizers.SGD(0.1))),
                   "not built in a ParameterServerStrategy")
            raises(jaxdist.keras.UnsupportedOptimizerError, lambda: scheduled.fit(data, steps_per_epoch=1, verbose=0),
                   "schedule")
            raises(NotImplementedError, lambda: model.train_on_batch(x[:4], y[:4]), "train_on_batch")
            with tempfile.TemporaryDirectory() as backup_dir:  # Keras's own would restore the coordinator's copy only
                raises(ConfigurationError, lambda: model.fit(data, steps_per_epoch=1, verbose=0, callbacks=[
                    keras.callbacks.BackupAndRestore(backup_dir)]), "jaxdist.keras.BackupAndRestore")

            class ChangeLR(keras.callbacks.Callback):
                def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                    self.model.optimizer.learning_rate.assign(0.5)

            raises(ConfigurationError, lambda: model.fit(data, steps_per_epoch=2, verbose=0, callbacks=[ChangeLR()]),
                   "learning rate changed")
            outside = _mlp(keras.optimizers.SGD(0.1))
            with strategy.scope():
                raises(ConfigurationError, lambda: outside.fit(x, y, epochs=1, verbose=0), "not built in")
            # Outside any scope a plain model still trains with Keras alone.
            outside.fit(x, y, epochs=1, verbose=0)
            assert np.isfinite(outside.get_weights()[0]).all()
        finally:
            _close(strategy)


def _run_checks(names: list[str]) -> dict[str, str | None]:
    import jaxdist.keras  # noqa: F401  (selects the JAX backend before keras is imported)

    results: dict[str, str | None] = {}
    for name in names:
        try:
            CHECKS[name]()
            results[name] = None
        except BaseException:  # noqa: BLE001 - report every failure to the parent
            results[name] = traceback.format_exc()
    return results


# ---------------------------------------------------------------------------------------
# Tests (run in pytest; each asserts on one check of the shared subprocess)
# ---------------------------------------------------------------------------------------


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    for k in ("JAXDIST_TPU_FAKE_DEVICES", "TF_CONFIG", "JAXDIST_CLUSTER", "SLURM_JOB_ID", "KERAS_BACKEND"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="module")
def check_results() -> dict[str, str | None]:
    proc = subprocess.run([sys.executable, __file__, *CHECKS], env=subprocess_env(), capture_output=True, text=True,
                          timeout=540)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX):])
    raise AssertionError(f"check subprocess failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(CHECKS))
def test_keras_on_parameter_servers(name: str, check_results: dict[str, str | None]) -> None:
    assert name in check_results, f"check {name} did not run"
    err = check_results[name]
    if err is not None:
        pytest.fail(f"{name} failed in the subprocess:\n{err}", pytrace=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_keras_fit_example_on_parameter_servers() -> None:
    """examples/keras_fit.py --strategy parameter_server (1 PS + 2 worker processes): digits to >= 90% accuracy."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "examples" / "keras_fit.py"), "--strategy", "parameter_server", "--epochs", "4",
         "--verbose", "0"],
        env=subprocess_env(), capture_output=True, text=True, timeout=280, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    assert result["strategy"] == "parameter_server" and result["replicas"] == 1, result
    assert result["test_accuracy"] >= 0.9, result
    assert abs(result["test_accuracy"] - result["predict_accuracy"]) < 1e-6, result


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_keras_ps_prints_its_figures() -> None:
    """bench/bench_keras_ps.py (one tiny round): both contenders' medians, the ratio, the embedding figure.
    The smallest run that makes every figure: one worker (a process and its compiles fewer), one closure of
    4 steps per epoch, 2 epochs (the first is not timed), 4 embedding steps per epoch over 2 PS."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(root / "bench" / "bench_keras_ps.py"), "--rounds", "1", "--epochs", "2", "--steps", "4",
         "--spe", "4", "--batch", "32", "--hidden", "32", "--vocab", "20000", "--dim", "8", "--emb-examples", "128",
         "--workers", "1", "--ps", "2"],
        env=subprocess_env(), capture_output=True, text=True, timeout=380, cwd=root)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    medians = {r["contender"]: r["median_steps_per_s"] for r in rows if "median_steps_per_s" in r}
    assert set(medians) == {"keras_fit", "custom_loop"} and min(medians.values()) > 0, rows
    (ratio,) = [r for r in rows if r["figure"] == "keras_ps_fit_ratio"]
    assert ratio["keras_fit_over_custom_loop"] > 0
    (emb,) = [r for r in rows if r["figure"] == "keras_ps_embedding"]
    assert emb["shards"] == 2 and emb["steps_per_s"] > 0, emb
    # Only looked-up rows move: 32 rows x 8 ids x 8 floats per step at most, plus the small dense layer.
    assert 0 < emb["bytes_pulled_per_step"] < emb["table_bytes"] / 10, emb
    assert 0 <= emb["accuracy"] <= 1 and 0 <= emb["keras_single_process_accuracy"] <= 1, emb


if __name__ == "__main__":
    print(RESULT_PREFIX + json.dumps(_run_checks(sys.argv[1:] or list(CHECKS))), flush=True)
