"""TF's Keras distribution example on jaxdist: the same Keras program on every strategy.

TF's guide: build and compile the model inside ``strategy.scope()``, then
``model.fit`` / ``evaluate``; nothing else changes between one device, all
the devices of a host, a TPU or many workers. Here the program is Keras 3 on
JAX and the strategy is jaxdist's; only ``make_strategy`` knows which.

Data: scikit-learn's bundled 8x8 digits (1,797 images, 10 classes; part of
scikit-learn, so no download; the same set as ``jaxdist demo``). Without
scikit-learn a deterministic synthetic set of the same shape is used (10
Gaussian blobs in 64 dimensions), so the example runs on a bare
``pip install 'jaxdist[keras]'``.

    python examples/keras_fit.py --strategy mirrored        # every local device
    XLA_FLAGS=--xla_force_host_platform_device_count=8 python examples/keras_fit.py --strategy mirrored
    python examples/keras_fit.py --strategy one_device | central_storage | multi_worker | default
    JAXDIST_TPU_FAKE_DEVICES=cpu python examples/keras_fit.py --strategy tpu   # TPU code path without TPUs
    # one process per host, each with its TF_CONFIG (every process reads the same data: TF's DATA policy):
    python examples/keras_fit.py --strategy multi_worker
    # parameter servers: 1 PS + 2 worker processes started here (or the cluster of TF_CONFIG); fit dispatches
    # steps as ClusterCoordinator closures, evaluate visits every test example exactly once:
    python examples/keras_fit.py --strategy parameter_server

The last line is ``RESULT {...}`` (JSON: strategy, replicas, test accuracy and loss).
"""

from __future__ import annotations

import argparse
import json
import os

import jaxdist.keras  # noqa: F401  (selects Keras's JAX backend before keras is imported)
import keras, numpy as np
import jaxdist


def parameter_server_strategy() -> jaxdist.ParameterServerStrategy:
    """PS training: the cluster of TF_CONFIG (a 'chief' running this script, 'ps' and 'worker' tasks running
    ``jaxdist ps`` / ``jaxdist worker``), or, without TF_CONFIG, 1 PS and 2 worker processes on this host."""
    if os.environ.get("TF_CONFIG"):
        resolver = jaxdist.TFConfigClusterResolver()
    else:
        cluster = jaxdist.LocalCluster(num_workers=2, num_ps=1).start()  # stopped at exit (LocalCluster's own atexit)
        resolver = cluster.cluster_resolver()
    return jaxdist.ParameterServerStrategy(resolver, variable_partitioner=jaxdist.MinSizePartitioner(max_shards=2))


def make_strategy(name: str) -> jaxdist.sync.Strategy | jaxdist.ParameterServerStrategy:
    # The one line that changes between runs (TF: tf.distribute.MirroredStrategy(), ...).
    return {
        "default": jaxdist.get_strategy,                        # no strategy: Keras as usual, one device
        "one_device": lambda: jaxdist.OneDeviceStrategy(0),
        "mirrored": jaxdist.MirroredStrategy,                   # all local devices
        "central_storage": jaxdist.CentralStorageStrategy,
        "tpu": jaxdist.TPUStrategy,
        "multi_worker": jaxdist.MultiWorkerMirroredStrategy,    # TF_CONFIG / Slurm / jaxdist launch; else one process
        "parameter_server": parameter_server_strategy,          # variables and optimizer on PS tasks, steps on workers
    }[name]()


def load_data(seed: int = 0) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    try:
        from sklearn.datasets import load_digits

        digits = load_digits()
        x, y = (digits.data / 16.0).astype(np.float32), digits.target.astype(np.int32)
    except ImportError:  # a bare install: 10 Gaussian blobs, deterministic
        rng = np.random.default_rng(seed)
        centers = rng.normal(size=(10, 64)).astype(np.float32)
        y = np.arange(1797, dtype=np.int32) % 10
        x = centers[y] + 0.8 * rng.normal(size=(1797, 64)).astype(np.float32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    n_test = len(x) // 5
    return (x[n_test:], y[n_test:]), (x[:n_test], y[:n_test])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="mirrored",
                        choices=["default", "one_device", "mirrored", "central_storage", "tpu", "multi_worker",
                                 "parameter_server"])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch (split over the replicas)")
    parser.add_argument("--verbose", type=int, default=2)
    args = parser.parse_args()

    strategy = make_strategy(args.strategy)
    print(f"strategy: {strategy!r}, replicas in sync: {strategy.num_replicas_in_sync}")
    (x_train, y_train), (x_test, y_test) = load_data()
    keras.utils.set_random_seed(0)

    with strategy.scope():  # the model's variables: mirrored on the replicas, or on the parameter servers
        model = keras.Sequential([
            keras.Input((64,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ])
        model.compile(
            optimizer=keras.optimizers.Adam(2e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
            steps_per_execution=4,
        )
    model.fit(x_train, y_train, batch_size=args.batch_size, epochs=args.epochs,
              validation_data=(x_test, y_test), verbose=args.verbose,
              callbacks=[keras.callbacks.EarlyStopping(monitor="val_loss", patience=3)])
    result = model.evaluate(x_test, y_test, batch_size=args.batch_size, return_dict=True, verbose=0)
    predictions = np.argmax(model.predict(x_test, batch_size=args.batch_size, verbose=0), axis=-1)
    print("RESULT " + json.dumps({
        "strategy": args.strategy,
        "replicas": strategy.num_replicas_in_sync,
        "test_accuracy": float(result["accuracy"]),
        "test_loss": float(result["loss"]),
        "predict_accuracy": float(np.mean(predictions == y_test)),
    }))
    if isinstance(strategy, jaxdist.ParameterServerStrategy):
        strategy.coordinator.shutdown()  # the job is over: the PS and worker tasks exit


if __name__ == "__main__":
    main()
