"""Keras 3 fit under MultiWorkerMirroredStrategy across 2 real processes x 4 fake CPU devices.

Each process is ``python tests/multiprocess/test_keras_multiprocess.py <mode> <out>``
with its own ``TF_CONFIG``; the reference is plain single-device Keras in a
third process. The pytest process never imports Keras.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from mwms_util import run_reference_and_two_workers

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

GLOBAL_BATCH = 32
NUM_EXAMPLES = 100  # 3 full global batches, then 4 rows (not divisible by 8 replicas)


# ---------------------------------------------------------------------------------------
# Child process
# ---------------------------------------------------------------------------------------


def _child(mode: str, out: str) -> None:
    import jaxdist.keras  # noqa: F401  (KERAS_BACKEND=jax)

    import jaxdist

    strategy = jaxdist.MultiWorkerMirroredStrategy(init_timeout_s=60, peer_timeout_s=30) if mode == "worker" else None
    import contextlib

    import jax
    import keras
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, 12)).astype(np.float32)
    y = rng.integers(0, 4, size=NUM_EXAMPLES).astype(np.int32)

    def build() -> Any:
        model = keras.Sequential([keras.Input((12,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4)])
        model.compile(keras.optimizers.SGD(0.1, momentum=0.9), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], steps_per_execution=2)
        return model

    scope = strategy.scope if strategy is not None else contextlib.nullcontext
    result: dict[str, Any] = {}
    # 1. No seed set: the processes must still start from the same weights (they agree on a seed).
    if strategy is not None:
        with scope():
            unseeded = build()
        result["unseeded"] = [np.asarray(w) for w in unseeded.get_weights()]
    # 2. The deterministic fit, compared with single-device Keras.
    keras.utils.set_random_seed(7)
    with scope():
        model = build()
        history = model.fit(x, y, batch_size=GLOBAL_BATCH, epochs=3, validation_data=(x[:50], y[:50]), verbose=0)
        ev = model.evaluate(x, y, batch_size=24, return_dict=True, verbose=0)
        pred = model.predict(x, batch_size=GLOBAL_BATCH, verbose=0)
    # 3. TF's FILE policy: each process feeds only its half of every global batch (Batches(per_process=True));
    # the reference feeds the whole global batches. The last global batch of 4 rows is 2 per process (not
    # divisible by a process's 4 replicas): gathered and computed whole.
    global_batches = [(x[i:i + GLOBAL_BATCH], y[i:i + GLOBAL_BATCH]) for i in range(0, NUM_EXAMPLES, GLOBAL_BATCH)]
    if strategy is not None:
        me = jax.process_index()
        feed = [tuple(a[me * (len(a) // 2):(me + 1) * (len(a) // 2)] for a in b) for b in global_batches]
    else:
        feed = global_batches
    keras.utils.set_random_seed(11)
    ckpt_dir = os.path.join(os.path.dirname(out), "ckpt")
    with scope():
        per_process_model = build()
        if strategy is not None:
            # Keras's own ModelCheckpoint would write from both processes at once: refused, naming jaxdist's.
            try:
                per_process_model.fit(jaxdist.keras.Batches(feed, per_process=True), epochs=1, verbose=0,
                                      callbacks=[keras.callbacks.ModelCheckpoint(os.path.join(ckpt_dir, "x.weights.h5"),
                                                                                 save_weights_only=True)])
            except jaxdist.errors.ConfigurationError as e:
                result["keras_checkpoint_refused"] = "jaxdist.keras.ModelCheckpoint" in str(e)
        checkpoint = jaxdist.keras.ModelCheckpoint(os.path.join(ckpt_dir, f"{mode}-{{epoch}}.weights.h5"),
                                                   save_weights_only=True)
        per_process_model.fit(jaxdist.keras.Batches(feed, per_process=strategy is not None), epochs=2, verbose=0,
                              callbacks=[checkpoint])
        per_process_eval = per_process_model.evaluate(jaxdist.keras.Batches(feed, per_process=strategy is not None),
                                                      return_dict=True, verbose=0)
    # evaluate is a collective: process 0 has written the last checkpoint by now. It holds the final weights.
    with scope():
        reloaded = build()
    reloaded.load_weights(os.path.join(ckpt_dir, f"{mode}-2.weights.h5"))
    result["checkpoint_is_final"] = all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in
                                        zip(reloaded.get_weights(), per_process_model.get_weights(), strict=True))
    # 4. DatasetCreator (TF's distribute_datasets_from_function input): one pipeline per process, per-replica
    # batches; each process's pipeline holds its half of every global batch, so the steps see the reference's
    # global batches. Then the trained model is exported from every process (process 0 writes).
    contexts: list[Any] = []

    def dataset_fn(ctx: Any) -> Any:
        contexts.append((ctx.num_input_pipelines, ctx.input_pipeline_id, ctx.num_replicas_in_sync))
        part = GLOBAL_BATCH // ctx.num_input_pipelines
        rows = np.concatenate([np.arange(g + part * ctx.input_pipeline_id, g + part * (ctx.input_pipeline_id + 1))
                               for g in range(0, 96, GLOBAL_BATCH)])
        b = ctx.get_per_replica_batch_size(GLOBAL_BATCH)
        return [(x[rows[i:i + b]], y[rows[i:i + b]]) for i in range(0, len(rows), b)]

    keras.utils.set_random_seed(13)
    with scope():
        creator_model = build()
    creator_model.fit(jaxdist.keras.DatasetCreator(dataset_fn), steps_per_epoch=3, epochs=2, verbose=0)
    export_dir = os.path.join(os.path.dirname(out), f"export-{mode}")
    artifact = jaxdist.keras.export_model(creator_model, export_dir, format="jax")
    if strategy is not None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("exported")  # process 0 has written the artifact
    manifest = json.loads((artifact / "manifest.json").read_text())
    exported = jax.export.deserialize(bytearray((artifact / manifest["exported_file"]).read_bytes()))
    with np.load(artifact / manifest["weights_file"]) as npz:
        export_pred = np.asarray(exported.call([npz[w["key"]] for w in manifest["weights"]], x))
    if strategy is not None:
        try:
            model.train_on_batch(x[:32], y[:32])
        except NotImplementedError as e:
            result["on_batch_refused"] = "fit/evaluate/predict" in str(e)
    np.savez(
        out,
        on_batch_refused=result.get("on_batch_refused", False),
        keras_checkpoint_refused=result.get("keras_checkpoint_refused", False),
        checkpoint_is_final=result["checkpoint_is_final"],
        processes=jax.process_count(),
        replicas=strategy.num_replicas_in_sync if strategy is not None else 1,
        weights=np.concatenate([np.ravel(w) for w in model.get_weights()]),
        unseeded=np.concatenate([np.ravel(w) for w in result.get("unseeded", [np.zeros(1)])]),
        history=json.dumps(history.history),
        evaluate=json.dumps({k: float(v) for k, v in ev.items()}),
        predict=np.asarray(pred),
        per_process_weights=np.concatenate([np.ravel(w) for w in per_process_model.get_weights()]),
        per_process_evaluate=json.dumps({k: float(v) for k, v in per_process_eval.items()}),
        creator_weights=np.concatenate([np.ravel(w) for w in creator_model.get_weights()]),
        creator_contexts=np.array(contexts),
        export_pred=export_pred,
    )
    print("KERAS_DONE", flush=True)
    if strategy is not None:
        strategy.shutdown()


# ---------------------------------------------------------------------------------------
# Parent
# ---------------------------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_keras_fit_on_two_processes_matches_single_device_keras(tmp_path: Path) -> None:
    """2 processes x 4 devices: the same weights, history, evaluate and predict as Keras on one device
    (float32 tolerance), every process feeding the same arrays (TF's DATA policy), short last batches included;
    without a seed the processes still start from the same weights; each process feeding only its part of each
    global batch (TF's FILE policy, Batches(per_process=True)) trains and evaluates as the global batches do; a
    DatasetCreator gets TF's InputContext (2 pipelines, the process's index, 8 replicas), its per-replica batches
    train as the global batches do, and the model exported from both processes (process 0 writes) predicts as the
    reference's export does."""
    import numpy as np

    run_reference_and_two_workers(__file__, tmp_path, "KERAS_DONE", timeout=360)
    ref = np.load(tmp_path / "ref.npz")
    w = [np.load(tmp_path / f"w{i}.npz") for i in range(2)]
    for i, got in enumerate(w):
        assert int(got["processes"]) == 2 and int(got["replicas"]) == 8, i
        assert bool(got["on_batch_refused"]), i  # *_on_batch would read each process's input as its part: refused
        assert bool(got["keras_checkpoint_refused"]), i
        assert bool(got["checkpoint_is_final"]), i  # jaxdist.keras.ModelCheckpoint: process 0's file, read by both
        np.testing.assert_allclose(got["weights"], ref["weights"], atol=2e-5, rtol=1e-5, err_msg=f"worker {i} weights")
        np.testing.assert_allclose(got["predict"], ref["predict"], atol=2e-5, rtol=1e-5, err_msg=f"worker {i} predict")
        h_ref, h_got = json.loads(str(ref["history"])), json.loads(str(got["history"]))
        assert h_got.keys() == h_ref.keys()
        for k in h_ref:
            np.testing.assert_allclose(h_got[k], h_ref[k], atol=2e-5, rtol=1e-5, err_msg=f"worker {i} history {k}")
        e_ref, e_got = json.loads(str(ref["evaluate"])), json.loads(str(got["evaluate"]))
        for k in e_ref:
            assert abs(e_got[k] - e_ref[k]) < 2e-5, (i, k, e_got, e_ref)
        np.testing.assert_allclose(got["per_process_weights"], ref["per_process_weights"], atol=2e-5, rtol=1e-5,
                                   err_msg=f"worker {i} weights, per-process input")
        e_ref, e_got = json.loads(str(ref["per_process_evaluate"])), json.loads(str(got["per_process_evaluate"]))
        for k in e_ref:
            assert abs(e_got[k] - e_ref[k]) < 2e-5, (i, k, e_got, e_ref)
    assert ref["creator_contexts"].tolist() == [[1, 0, 1]]
    for i, got in enumerate(w):
        assert got["creator_contexts"].tolist() == [[2, i, 8]], (i, got["creator_contexts"])  # TF's InputContext
        np.testing.assert_allclose(got["creator_weights"], ref["creator_weights"], atol=2e-5, rtol=1e-5,
                                   err_msg=f"worker {i} weights, DatasetCreator input")
        np.testing.assert_allclose(got["export_pred"], ref["export_pred"], atol=2e-5, rtol=1e-5,
                                   err_msg=f"worker {i}: the exported artifact's predictions")
    assert sorted(p.name for p in (tmp_path / "export-worker").iterdir()) == [
        "manifest.json", "model.jaxexport", "weights.npz"]
    np.testing.assert_array_equal(w[0]["unseeded"], w[1]["unseeded"])
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "reference-1.weights.h5", "reference-2.weights.h5", "worker-1.weights.h5", "worker-2.weights.h5"]


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
