"""TF's custom-training-loop guide with its Keras parts under MultiWorkerMirroredStrategy: 2 processes x 4 devices.

Each process is ``python tests/multiprocess/test_keras_custom_loop_multiprocess.py <mode> <out>`` with its
own ``TF_CONFIG``; it runs the guide's program of ``tests/integration/test_keras_custom_loop.py`` (Keras
model, Adam (built in the scope), ``reduction=None`` loss with ``compute_average_loss``, three metrics; ``train_step`` and
``test_step`` under ``strategy.run`` in ``jaxdist.function``). The reference, in a third process, is
Keras's own JAX recipe under ``jax.jit`` on one device. The pytest process never imports Keras.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
from mwms_util import run_reference_and_two_workers

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

INTEGRATION = Path(__file__).resolve().parents[1] / "integration"


def _child(mode: str, out: str) -> None:
    import jaxdist.keras  # noqa: F401  (KERAS_BACKEND=jax)

    import jaxdist

    strategy = jaxdist.MultiWorkerMirroredStrategy(init_timeout_s=60, peer_timeout_s=60) if mode == "worker" else None
    import numpy as np

    sys.path.insert(0, str(INTEGRATION))
    import test_keras_custom_loop as guide  # the guide's program, shared with the 8-device checks

    # The optimizer is built in the scope: creating Keras variables inside the step is refused across processes.
    result = guide._guide(strategy, build_optimizer=True) if strategy is not None else guide._keras_recipe(None)
    lazy_build_refused = strategy is not None and _lazy_optimizer_is_refused(strategy)
    np.savez(
        out,
        lazy_build_refused=lazy_build_refused,
        replicas=strategy.num_replicas_in_sync if strategy is not None else 1,
        weights=np.concatenate([np.ravel(w) for w in result["weights"]]),
        losses=np.asarray(result["losses"]),
        metrics=json.dumps(result["metrics"]),
        iterations=result["iterations"],
    )
    print("GUIDE_DONE", flush=True)
    if strategy is not None:
        strategy.shutdown()


def _lazy_optimizer_is_refused(strategy: Any) -> bool:
    """An optimizer first built by apply_gradients inside run raises, naming optimizer.build (every process)."""
    import jax.numpy as jnp
    import keras
    import numpy as np

    from jaxdist.errors import ConfigurationError

    keras.utils.set_random_seed(3)  # the same initial weights on both processes
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        optimizer = keras.optimizers.SGD(0.1)
    batch = next(iter(strategy.experimental_distribute_dataset([np.ones((8, 4), np.float32)])))

    def step(x: Any) -> Any:
        grads = [jnp.ones_like(v.value) for v in model.trainable_variables]
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return jnp.sum(x)

    try:
        strategy.run(step, args=(batch,))
    except ConfigurationError as e:
        return "optimizer.build(model.trainable_variables)" in str(e)
    return False


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_guide_on_two_processes_matches_one_device_keras(tmp_path: Path) -> None:
    """2 processes x 4 devices (8 replicas): the guide's weights, per-step losses and metrics equal Keras's own
    JAX recipe on one device (1e-5) on both processes."""
    import numpy as np

    run_reference_and_two_workers(__file__, tmp_path, "GUIDE_DONE", timeout=540)
    ref = np.load(tmp_path / "ref.npz")
    for i in range(2):
        got = np.load(tmp_path / f"w{i}.npz")
        assert int(got["replicas"]) == 8, i
        assert bool(got["lazy_build_refused"]), i
        np.testing.assert_allclose(got["weights"], ref["weights"], atol=1e-5, rtol=1e-5, err_msg=f"worker {i} weights")
        np.testing.assert_allclose(got["losses"], ref["losses"], atol=1e-5, rtol=1e-5, err_msg=f"worker {i} losses")
        m_got, m_ref = json.loads(str(got["metrics"])), json.loads(str(ref["metrics"]))
        assert len(m_got) == len(m_ref)
        for e, (g, r) in enumerate(zip(m_got, m_ref)):
            assert g.keys() == r.keys(), (i, e, g, r)
            for k in r:
                assert abs(g[k] - r[k]) <= 1e-5, (i, e, k, g, r)
        assert int(got["iterations"]) == int(ref["iterations"]), i


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
