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
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(mode: str, out: Path, devices: int, tf_config: dict[str, Any] | None) -> subprocess.Popen[str]:
    env = dict(os.environ)
    for k in ("TF_CONFIG", "JAXDIST_CLUSTER", "JAXDIST_CLUSTER_RESOLVER", "SLURM_JOB_ID", "SLURM_PROCID", "KERAS_BACKEND",
              "JAXDIST_TPU_FAKE_DEVICES"):
        env.pop(k, None)
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"
    env["JAX_PLATFORMS"] = "cpu"
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return subprocess.Popen([sys.executable, __file__, mode, str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_guide_on_two_processes_matches_one_device_keras(tmp_path: Path) -> None:
    """2 processes x 4 devices (8 replicas): the guide's weights, per-step losses and metrics equal Keras's own
    JAX recipe on one device (1e-5) on both processes."""
    import numpy as np

    cluster = {"worker": [f"127.0.0.1:{_free_port()}", f"127.0.0.1:{_free_port()}"]}
    procs = [
        _spawn("reference", tmp_path / "ref.npz", 1, None),
        *(_spawn("worker", tmp_path / f"w{i}.npz", 4, {"cluster": cluster, "task": {"type": "worker", "index": i}})
          for i in range(2)),
    ]
    deadline = time.monotonic() + 540
    outs = []
    try:
        for p in procs:
            so, se = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outs.append((p.returncode, so, se))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for name, (rc, so, se) in zip(("reference", "worker:0", "worker:1"), outs):
        assert rc == 0 and "GUIDE_DONE" in so, f"{name} failed (rc={rc}):\n{so[-2000:]}\n{se[-5000:]}"
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
