"""Helpers of the Keras test modules (imported by pytest and by their fake-device subprocesses alike: each
runs as a script from this folder, which is then the first entry of ``sys.path``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: Examples per batch of :func:`small_classification`'s data in the in-process Keras checks.
SMALL_BATCH = 16


def import_jaxdist_keras() -> None:
    """A :class:`device_checks.DeviceChecks` ``setup``: import ``jaxdist.keras`` first, which selects Keras's JAX
    backend before Keras is imported."""
    import jaxdist.keras  # noqa: F401


def classification_data(n: int, d: int, classes: int, seed: int = 0, noise: float = 0.5) -> tuple[Any, Any]:
    """``n`` rows of ``d`` float32 features and int32 labels in ``range(classes)``: the argmax of a random linear
    map of the features plus ``noise`` times Gaussian noise (learnable, not separable). Same arguments, same
    arrays."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    w = rng.normal(size=(d, classes)).astype(np.float32)
    y = np.argmax(x @ w + noise * rng.normal(size=(n, classes)), axis=1).astype(np.int32)
    return x, y


def guide_images(global_batch: int) -> tuple[list[Any], list[Any]]:
    """The custom-training-loop guide's data: 96 training and 64 test 8x8x1 images with 10 classes, in batches
    of ``global_batch`` (the guide's pipeline): ``(train, test)``."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(160, 8, 8, 1)).astype(np.float32)
    y = rng.integers(0, 10, size=(160,)).astype(np.int32)
    train = [(x[i : i + global_batch], y[i : i + global_batch]) for i in range(0, 96, global_batch)]
    test = [(x[i : i + global_batch], y[i : i + global_batch]) for i in range(96, 160, global_batch)]
    return train, test


def small_classification(seed: int) -> tuple[Any, Any]:
    """64 rows of 6 float32 features and int32 labels in ``range(3)``, the argmax of a random linear map of the
    features (no noise): the in-process Keras checks' data. Same seed, same arrays."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = (x @ rng.normal(size=(6, 3))).argmax(axis=1).astype(np.int32)
    return x, y


def small_mlp(metrics: Sequence[str] = ()) -> Any:
    """The in-process Keras checks' model for :func:`small_classification`: Dense(8, relu) -> Dense(3) logits,
    ``SGD(0.1)``, sparse categorical cross-entropy, compiled with ``metrics`` (none: no ``metrics`` argument)."""
    import keras

    model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)])
    extra = {"metrics": list(metrics)} if metrics else {}
    model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True), **extra)
    return model


class BatchList:
    """A per-worker dataset function: ``(x, y)`` cut into batches of ``batch`` rows, in order, on every worker
    (module level, so that it pickles to the worker)."""

    def __init__(self, x: Any, y: Any, batch: int = SMALL_BATCH) -> None:
        self.items = [(x[i:i + batch], y[i:i + batch]) for i in range(0, len(x), batch)]

    def __call__(self, input_context: Any) -> Any:
        return self.items
