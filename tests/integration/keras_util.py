"""Helpers of the Keras test modules (imported by pytest and by their fake-device subprocesses alike: each
runs as a script from this folder, which is then the first entry of ``sys.path``)."""

from __future__ import annotations

from typing import Any


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
