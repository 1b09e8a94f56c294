"""``jaxdist.keras.epoch_end_sync``: fit's epoch-end pull of the whole model to the coordinator, on or off.

In the pytest process (an in-process cluster), as tests/integration/test_keras_fast.py: with the pull off, a
callback sees the last pull's weights at epoch ends and the model holds the trained weights (Keras's, from the
same initial weights) once fit returns; the callbacks that read weights at epoch ends are refused before any
step; with it on again, a callback sees each epoch's weights.
"""

from __future__ import annotations

import importlib.util
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
from jaxdist.keras.ps_model import syncs_each_epoch  # noqa: E402
from jaxdist.testing import InProcessCluster  # noqa: E402
from keras_util import SMALL_BATCH, BatchList, small_classification, small_mlp  # noqa: E402

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword:DeprecationWarning"),
]


class _SeenAtEpochEnd(keras.callbacks.Callback):
    """The coordinator's weights as each ``on_epoch_end`` sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[np.ndarray]] = []

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.seen.append([np.array(w) for w in self.model.get_weights()])


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return all(np.array_equal(u, v) for u, v in zip(a, b, strict=True))


def test_epoch_end_sync_off_pulls_once_at_the_end_and_refuses_weight_readers(tmp_path: Path) -> None:
    x, y = small_classification(seed=5)
    data = jaxdist.keras.DatasetCreator(BatchList(x, y))
    with pytest.raises(ConfigurationError, match="ParameterServerStrategy's scope"):
        jaxdist.keras.epoch_end_sync(small_mlp(), False)
    with InProcessCluster(num_workers=1, num_ps=1) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        try:
            with strategy.scope():
                model = small_mlp()
            with pytest.raises(TypeError, match="True or False"):
                jaxdist.keras.epoch_end_sync(model, "no")  # type: ignore[arg-type]
            assert syncs_each_epoch(model)  # the default, and unchanged by the refused call
            assert jaxdist.keras.epoch_end_sync(model, False) is model and not syncs_each_epoch(model)
            initial = model.get_weights()
            seen = _SeenAtEpochEnd()
            model.fit(data, epochs=2, steps_per_epoch=4, verbose=0, callbacks=[seen])
            trained = model.get_weights()
            # No pull at the epoch ends: the callback saw the weights of before fit, both times.
            assert len(seen.seen) == 2 and all(_same(s, initial) for s in seen.seen)
            assert not _same(trained, initial)
            assert int(model.optimizer.iterations.numpy()) == 8

            # The callbacks that read the weights at epoch ends are refused before any step.
            refused = [keras.callbacks.ModelCheckpoint(str(tmp_path / "w.weights.h5"), save_weights_only=True),
                       jaxdist.keras.ModelCheckpoint(str(tmp_path / "m.keras")),
                       keras.callbacks.EarlyStopping(monitor="loss", restore_best_weights=True),
                       jaxdist.keras.TensorBoard(str(tmp_path / "tb"), histogram_freq=1)]
            for cb in refused:
                with pytest.raises(ConfigurationError, match="epoch_end_sync"):
                    model.fit(data, epochs=1, steps_per_epoch=4, verbose=0, callbacks=[cb])
            # ... and trained nothing: the PS step counter and the weights are where they were.
            assert jaxdist.keras.sync_from_ps(model)
            assert int(model.optimizer.iterations.numpy()) == 8 and _same(model.get_weights(), trained)
            # Those that do not read the weights are fine (EarlyStopping without restore_best_weights).
            model.fit(data, epochs=1, steps_per_epoch=4, verbose=0,
                      callbacks=[keras.callbacks.EarlyStopping(monitor="loss")])
            assert int(model.optimizer.iterations.numpy()) == 12
            after_three = model.get_weights()

            # On again: each epoch end sees that epoch's weights; the last one is what fit leaves.
            jaxdist.keras.epoch_end_sync(model, True)
            assert syncs_each_epoch(model)
            seen = _SeenAtEpochEnd()
            model.fit(data, epochs=2, steps_per_epoch=4, verbose=0, callbacks=[seen])
            assert not _same(seen.seen[0], after_three) and not _same(seen.seen[0], seen.seen[1])
            assert _same(seen.seen[1], model.get_weights())
            assert int(model.optimizer.iterations.numpy()) == 20
        finally:
            coord = strategy.coordinator
            if coord is not None:
                coord.shutdown(exit_tasks=False)
            strategy.close()

    # The trained weights are Keras's own: the same fit steps from the same initial weights, in one process.
    ref = small_mlp()
    ref.set_weights(initial)
    ref.fit(x, y, batch_size=SMALL_BATCH, epochs=2, shuffle=False, verbose=0)
    for got, want in zip(trained, ref.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
