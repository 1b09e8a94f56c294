"""The synchronous strategies' checks' shared model: a 2-layer MLP on 100 rows, its loss, its global batches
and its training on one device with no strategy (the reference every check compares with). Imported by pytest
and by the fake-device subprocesses alike (each runs a module of this folder as a script)."""

from __future__ import annotations

from typing import Any


def mlp_data(n: int = 100, d: int = 12, classes: int = 4, seed: int = 0) -> tuple[Any, Any, Any]:
    """``(params, x, y)``: the MLP's initial parameters (16 hidden units) and ``n`` random rows with labels in
    ``range(classes)``. Same arguments, same arrays."""
    import jax
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype(np.float32)
    y = rng.integers(0, classes, size=(n,)).astype(np.int32)
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    params = {
        "w1": np.asarray(jax.random.normal(k1, (d, 16)) * 0.3),
        "b1": np.zeros((16,), np.float32),
        "w2": np.asarray(jax.random.normal(k2, (16, classes)) * 0.3),
        "b2": np.zeros((classes,), np.float32),
    }
    return params, x, y


def per_example_loss(p: Any, x: Any, y: Any) -> Any:
    """The MLP's softmax cross-entropy, one value per row."""
    import jax
    import optax

    logits = jax.nn.relu(x @ p["w1"] + p["b1"]) @ p["w2"] + p["b2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y)


def global_batches(x: Any, y: Any, gbs: int) -> list[tuple[Any, Any]]:
    """``(x, y)`` in batches of ``gbs`` rows, in order; the last one short when ``gbs`` does not divide them."""
    return [(x[i : i + gbs], y[i : i + gbs]) for i in range(0, len(x), gbs)]


def reference_training(params: Any, batches: list[tuple[Any, Any]], tx: Any, gbs: int, epochs: int) -> Any:
    """The same training on one device, no strategy at all: ``epochs`` passes of ``tx`` steps over ``batches``,
    the loss of a batch its per-example losses summed over the global batch size ``gbs``."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    @jax.jit
    def step(p: Any, o: Any, x: Any, y: Any) -> Any:
        g = jax.grad(lambda p: jnp.sum(per_example_loss(p, x, y)) / gbs)(p)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o

    p = jax.tree.map(jnp.asarray, params)
    o = tx.init(p)
    for _ in range(epochs):
        for x, y in batches:
            p, o = step(p, o, x, y)
    return jax.tree.map(np.asarray, p)
