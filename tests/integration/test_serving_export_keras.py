"""Incremental exports of a Keras model fitted under ParameterServerStrategy (in-process PS): an
embedding table with lazy Adam travels as its looked-up rows, the dense layer whole, and the deltas
applied to the first full export equal the PS's weights after each fit."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

import jaxdist  # noqa: E402
import jaxdist.keras  # noqa: E402  (before keras: selects the JAX backend)
import keras  # noqa: E402
from jaxdist import serving_export as se  # noqa: E402
from jaxdist.testing import InProcessCluster  # noqa: E402

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]

VOCAB, DIM, BATCH = 2_000, 4, 8


class _Batches:
    """The per-worker dataset: the batches in order (module level: it pickles to the worker)."""

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.items = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, len(x), BATCH)]

    def __call__(self, input_context: Any) -> Any:
        return self.items


def test_keras_fit_exports_embedding_rows_and_deltas_apply_exactly(tmp_path) -> None:  # type: ignore[no-untyped-def]
    rng = np.random.default_rng(5)
    with InProcessCluster(num_workers=1, num_ps=2) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver(),
                                                   variable_partitioner=jaxdist.FixedShardsPartitioner(2))
        try:
            with strategy.scope():
                model = keras.Sequential([keras.Input((2,), dtype="int32"), keras.layers.Embedding(VOCAB, DIM),
                                          keras.layers.Flatten(), keras.layers.Dense(1)])
                model.compile(keras.optimizers.Adam(0.01), "mse")
            jaxdist.keras.lazy_embeddings(model)
            ex = se.IncrementalExporter(strategy, str(tmp_path / "exports"))
            state = None
            for k in range(3):
                ids = rng.integers(0, VOCAB, size=(BATCH * 3, 2)).astype(np.int32)
                y = rng.normal(size=(BATCH * 3, 1)).astype(np.float32)
                model.fit(jaxdist.keras.DatasetCreator(_Batches(ids, y)), epochs=1, steps_per_epoch=3, verbose=0)
                info = ex.export(step=k)
                if state is None:
                    assert info.kind == "full"
                    state = se.load_export(info.path)
                else:
                    assert info.kind == "delta"
                    se.apply_delta(state, info.path)
                    # The table's delta: at most the ids this fit looked up, as rows; the kernel whole.
                    table = next(n for n, v in state.variables.items() if v.shape == (VOCAB, DIM))
                    assert 0 < info.changed_rows[table] <= len(np.unique(ids))
                pulled = {n: np.asarray(v.numpy()) for n, v in strategy.variables.items()}
                assert sorted(state.variables) == sorted(pulled)
                for n in pulled:
                    np.testing.assert_array_equal(state.variables[n], pulled[n], err_msg=n)
            # The weights are Keras's: the table and the dense layer's, by shape.
            shapes = sorted(w.shape for w in model.get_weights())
            assert sorted(v.shape for v in state.variables.values() if v.shape in shapes) == shapes
        finally:
            coord = strategy.coordinator
            if coord is not None:
                coord.shutdown(exit_tasks=False)
            strategy.close()
