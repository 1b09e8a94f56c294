"""jaxdist.keras.BackupAndRestore: SIGKILL a Keras fit mid-epoch, run the same script again, end with the weights
of an uninterrupted run (tf.keras's mid-epoch resume, which Keras 3's own callback does not do)."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

if importlib.util.find_spec("keras") is None:
    pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'", allow_module_level=True)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from device_checks import fake_devices_env  # noqa: E402
from mwms_util import finish, free_port  # noqa: E402

SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    import numpy as np
    import jaxdist.keras
    import keras, jaxdist

    backup_dir, strategy_name, spe, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    save_freq = int(sys.argv[5])
    cluster = None
    if strategy_name == "ps":
        # One worker: its closures run in order, so the asynchronous run is deterministic. The cluster is this
        # script's, in its process (real gRPC services): SIGKILLed, its tasks die with it, and the re-run starts
        # fresh parameter servers. (A LocalCluster of task processes would do the same at the cost of starting
        # three more processes per run.)
        from jaxdist.testing import InProcessCluster
        cluster = InProcessCluster(num_workers=1, num_ps=2).start()
    # One strategy for both runs (a multi-process one is made once, before any other JAX call).
    strategy = {"mirrored": jaxdist.MirroredStrategy, "default": jaxdist.get_strategy,
                "multi_worker": lambda: jaxdist.MultiWorkerMirroredStrategy(init_timeout_s=60, peer_timeout_s=20),
                "ps": lambda: jaxdist.ParameterServerStrategy(cluster.cluster_resolver()),
                }[strategy_name]()
    EPOCHS, GBS = 3, 16          # 100 rows: 7 batches an epoch, the last one short
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)

    def train(callbacks):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)])
            model.compile(optimizer=keras.optimizers.Adam(0.01), steps_per_execution=spe, metrics=["accuracy"],
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        history = model.fit(x, y, batch_size=GBS, epochs=EPOCHS, shuffle=False, callbacks=callbacks, verbose=0)
        return model, history.history

    class Kill(keras.callbacks.Callback):
        def __init__(self, epoch, batch, process=0):
            super().__init__()
            self.at, self.epoch = (epoch, batch), 0
            self.armed = __import__("jax").process_index() == process
        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch
        def on_train_batch_end(self, batch, logs=None):
            if self.armed and (self.epoch, batch) == self.at:
                print("KILLING", self.epoch, batch, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)

    callbacks = [jaxdist.keras.BackupAndRestore(backup_dir, save_freq=save_freq)]
    if kill_at != "none":
        callbacks.append(Kill(*map(int, kill_at.split(","))))
    model, history = train(callbacks)
    resumed = {"weights": [w.tolist() for w in model.get_weights()], "history": history,
               "iterations": int(model.optimizer.iterations.numpy()), "backup_left": os.path.exists(backup_dir)}
    ref_model, ref_history = train([])
    print("RESULT " + json.dumps({"resumed": resumed, "reference": {
        "weights": [w.tolist() for w in ref_model.get_weights()], "history": ref_history,
        "iterations": int(ref_model.optimizer.iterations.numpy())}}), flush=True)
    if cluster is not None:
        strategy.coordinator.shutdown(exit_tasks=False)
        strategy.close()
        cluster.stop()
    """
)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("strategy", "spe", "save_freq", "kill_at", "resumed_batch"), [
    ("mirrored", 1, 2, "1,4", 4),   # backups after 2 and 4 batches of epoch 1; killed after its 5th batch
    ("mirrored", 2, 2, "1,5", 6),   # steps_per_execution=2: callbacks at batches 1, 3, 5; the backup of 6 comes first
    ("default", 1, 2, "2,2", 2),    # killed after the 3rd batch of the last epoch; backup of 2
    ("mirrored", 1, 2, "1,0", 0),   # killed before epoch 1's first backup: resumes from epoch 0's end (fresh metrics)
    # ParameterServerStrategy: the coordinator script (and its cluster) SIGKILLed with closures in flight;
    # the backups were taken at quiet points, the re-run restores fresh parameter servers from the last one.
    ("ps", 1, 2, "1,4", 4),
    ("ps", 2, 2, "1,5", 6),
    ("ps", 1, 2, "2,0", 0),
    # Killed after the last step's backup, before the epoch's end: the re-run trains no step of that epoch (every
    # one was in the backup) and ends it.
    ("ps", 1, 1, "1,6", 7),
])
def test_sigkill_mid_epoch_and_rerun_ends_with_the_uninterrupted_weights(
    tmp_path: Path, strategy: str, spe: int, save_freq: int, kill_at: str, resumed_batch: int
) -> None:
    import numpy as np

    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    backup = tmp_path / "backup"
    env = fake_devices_env(8)
    killed = subprocess.run([sys.executable, str(script), str(backup), strategy, str(spe), kill_at, str(save_freq)], env=env,
                            capture_output=True, text=True, timeout=280)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "KILLING" in killed.stdout
    latest = json.loads((backup / "latest.json").read_text())
    assert (latest["epoch"], latest["batch"]) == (int(kill_at.split(",")[0]), resumed_batch)
    again = subprocess.run([sys.executable, str(script), str(backup), strategy, str(spe), "none", str(save_freq)], env=env,
                           capture_output=True, text=True, timeout=280)
    assert again.returncode == 0, again.stderr[-3000:]
    out = json.loads(again.stdout.strip().splitlines()[-1].removeprefix("RESULT "))
    resumed, reference = out["resumed"], out["reference"]
    # Every step trained exactly once: the optimizer's iteration count is the uninterrupted run's.
    assert resumed["iterations"] == reference["iterations"] == 3 * 7
    for got, want in zip(resumed["weights"], reference["weights"], strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
    # The resumed run's History covers the epochs it ran; the interrupted epoch's metrics cover the whole epoch
    # (its partial sums were in the backup).
    epoch = int(kill_at.split(",")[0])
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose(resumed["history"][key], reference["history"][key][epoch:], rtol=1e-5)
    assert not resumed["backup_left"]  # delete_checkpoint: the finished run removed it


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_multi_worker_sigkill_of_one_process_and_rerun_ends_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    """2 processes x 4 devices: process 0 SIGKILLs itself mid-epoch, its peer exits (a dead peer is fatal to a
    synchronous job); both scripts run again and resume from process 0's backup in the shared directory."""
    import numpy as np

    script = tmp_path / "fit.py"
    script.write_text(SCRIPT)
    backup = tmp_path / "backup"

    def run(kill_at: str, dirs: tuple[Path, Path] = (backup, backup)) -> list[subprocess.CompletedProcess[str]]:
        cluster = {"worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
        procs = []
        for i in range(2):
            env = dict(fake_devices_env(4), TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}}))
            procs.append(subprocess.Popen([sys.executable, str(script), str(dirs[i]), "multi_worker", "1", kill_at, "2"],
                                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return [subprocess.CompletedProcess(p.args, rc, out, err) for p, (rc, out, err) in zip(procs, finish(procs, 560))]

    killed = run("1,4")
    assert killed[0].returncode == -signal.SIGKILL and "KILLING" in killed[0].stdout, killed[0].stderr[-3000:]
    assert killed[1].returncode != 0  # its peer died mid-step
    assert json.loads((backup / "latest.json").read_text())["batch"] == 4
    # A backup_dir that is not shared (process 1 sees no backup) is refused on every process, not a hang.
    unshared = run("none", (backup, tmp_path / "elsewhere"))
    for r in unshared:
        assert r.returncode != 0 and "must be one directory every process reads" in r.stderr, r.stderr[-3000:]
    again = run("none")
    outs = []
    for i, r in enumerate(again):
        assert r.returncode == 0, (i, r.stderr[-3000:])
        outs.append(json.loads(r.stdout.strip().splitlines()[-1].removeprefix("RESULT ")))
    for out in outs:
        resumed, reference = out["resumed"], out["reference"]
        assert resumed["iterations"] == reference["iterations"] == 3 * 7
        for got, want in zip(resumed["weights"], reference["weights"], strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=1e-6)
        np.testing.assert_allclose(resumed["history"]["loss"], reference["history"]["loss"][1:], rtol=1e-5)
    assert not outs[0]["resumed"]["backup_left"]  # process 0 removed it when fit finished
