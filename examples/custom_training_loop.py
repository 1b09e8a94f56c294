"""TF's tutorial "Custom training with tf.distribute.Strategy", ported to JAX with jaxdist.

Section by section as the tutorial (https://www.tensorflow.org/tutorials/distribute/custom_training),
with no hand-written all-reduce, metric or checkpoint code:

1. a strategy (``MirroredStrategy``: every local device; ``--strategy`` picks another);
2. the input pipeline, distributed with ``strategy.experimental_distribute_dataset``
   (the short last batch is split across replicas as TF splits it);
3. the model, optimizer, metrics and checkpoint created in ``strategy.scope()``;
4. the loss: per-example losses scaled with ``jaxdist.compute_average_loss``, plus
   the L2 term scaled with ``jaxdist.scale_regularization_loss``;
5. ``train_step`` / ``test_step`` run by ``strategy.run`` inside ``@jaxdist.function``
   (TF: ``@tf.function``); ``optimizer.apply_gradients`` all-reduces the gradients
   as TF's optimizers do; metrics aggregate across replicas themselves;
6. a checkpoint every ``--checkpoint-every`` epochs: ``checkpoint.save(checkpoint_prefix)`` numbers
   them ``ckpt-1``, ``ckpt-2``, ... as TF's ``Checkpoint.save`` does;
7. the latest checkpoint (``jaxdist.latest_checkpoint``) restored into a fresh model *without* a
   strategy and evaluated.

Data: scikit-learn's bundled 8x8 digits (1797 images, 10 classes; no download).

Run::

    python examples/custom_training_loop.py --devices 8                    # 8 fake CPU devices
    python examples/custom_training_loop.py --strategy one_device
    python examples/custom_training_loop.py --strategy default             # no strategy (one replica)
    TF_CONFIG=... python examples/custom_training_loop.py --strategy multi_worker --checkpoint-dir DIR

With ``multi_worker`` every process runs the script (one per host, each with its ``TF_CONFIG``) and
``--checkpoint-dir`` is required: a directory every process reads (a shared filesystem), since process 0
writes the checkpoints and every process restores the latest one at the end.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Iterator
from typing import Any


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", choices=["mirrored", "one_device", "default", "multi_worker"], default="mirrored")
    ap.add_argument("--devices", type=int, default=None, help="fake CPU devices (sets XLA_FLAGS); default: as JAX finds them")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch-size-per-replica", type=int, default=32)
    ap.add_argument("--global-batch-size", type=int, default=None,
                    help="default: batch size per replica x replicas (fix it to compare strategies)")
    ap.add_argument("--checkpoint-every", type=int, default=2, help="epochs between checkpoints")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="default: a fresh temporary folder; required with multi_worker (a folder every process reads)")
    ap.add_argument("--weights-out", default=None, help="write the final weights here (.npz)")
    ap.add_argument("--peer-timeout", type=float, default=3.0,
                    help="multi_worker: seconds without a heartbeat before a peer is declared dead")
    args = ap.parse_args()
    if args.strategy == "multi_worker" and args.checkpoint_dir is None:
        # Each process would make its own temporary folder: process 0 writes the checkpoints into its own, and the
        # others would find none to restore at the end.
        ap.error("--strategy multi_worker needs --checkpoint-dir DIR, a folder every process reads (a shared "
                 "filesystem): process 0 writes the checkpoints there and every process restores the latest")
    return args


ARGS = parse_args()
if ARGS.devices:
    # Must be set before JAX starts.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={ARGS.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jaxdist  # noqa: E402

# -- 1. strategy ----------------------------------------------------------------------------------
# MultiWorkerMirroredStrategy joins the other processes before JAX starts, so it comes first.

if ARGS.strategy == "multi_worker":
    strategy = jaxdist.MultiWorkerMirroredStrategy(peer_timeout_s=ARGS.peer_timeout)
elif ARGS.strategy == "mirrored":
    strategy = jaxdist.MirroredStrategy()
elif ARGS.strategy == "one_device":
    strategy = jaxdist.OneDeviceStrategy("cpu:0")
else:
    strategy = jaxdist.get_strategy()  # the default strategy: what TF code runs under without a scope

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

print(f"Number of devices: {strategy.num_replicas_in_sync}")

# -- 2. input pipeline ---------------------------------------------------------------------------

digits = load_digits()
images = (digits.images / 16.0).astype(np.float32)[..., None]  # (1797, 8, 8, 1), values in [0, 1]
labels = digits.target.astype(np.int32)
perm = np.random.default_rng(0).permutation(len(images))
train_images, train_labels = images[perm[:1500]], labels[perm[:1500]]
test_images, test_labels = images[perm[1500:]], labels[perm[1500:]]

BATCH_SIZE_PER_REPLICA = ARGS.batch_size_per_replica
GLOBAL_BATCH_SIZE = ARGS.global_batch_size or BATCH_SIZE_PER_REPLICA * strategy.num_replicas_in_sync
EPOCHS = ARGS.epochs


class Dataset:
    """The tf.data pipeline's role: shuffled (a new order every pass) and batched; re-iterable."""

    def __init__(self, x: np.ndarray, y: np.ndarray, batch: int, shuffle: bool) -> None:
        self.x, self.y, self.batch, self.shuffle = x, y, batch, shuffle
        self.passes = 0

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        order = np.random.default_rng(self.passes).permutation(len(self.x)) if self.shuffle else np.arange(len(self.x))
        self.passes += 1
        for i in range(0, len(order), self.batch):
            yield self.x[order[i : i + self.batch]], self.y[order[i : i + self.batch]]


train_dataset = Dataset(train_images, train_labels, GLOBAL_BATCH_SIZE, shuffle=True)
test_dataset = Dataset(test_images, test_labels, GLOBAL_BATCH_SIZE, shuffle=False)
train_dist_dataset = strategy.experimental_distribute_dataset(train_dataset)
test_dist_dataset = strategy.experimental_distribute_dataset(test_dataset)

# -- 3. model --------------------------------------------------------------------------------------


def create_model(key: jax.Array) -> dict[str, Any]:
    """Conv(32, 3x3) -> maxpool -> Conv(64, 3x3) -> maxpool -> Dense(64) -> Dense(10), as the tutorial."""
    k = jax.random.split(key, 4)

    def he(k: jax.Array, shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return jax.random.normal(k, shape) * (2.0 / fan_in) ** 0.5

    return {
        "conv1": {"w": he(k[0], (3, 3, 1, 32), 9), "b": jnp.zeros((32,))},
        "conv2": {"w": he(k[1], (3, 3, 32, 64), 9 * 32), "b": jnp.zeros((64,))},
        "dense1": {"w": he(k[2], (2 * 2 * 64, 64), 256), "b": jnp.zeros((64,))},
        "dense2": {"w": he(k[3], (64, 10), 64), "b": jnp.zeros((10,))},
    }


def apply(params: dict[str, Any], x: jax.Array) -> jax.Array:
    def conv(h: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
        h = jax.lax.conv_general_dilated(h, p["w"], (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
        return jax.nn.relu(h + p["b"])

    def maxpool(h: jax.Array) -> jax.Array:
        return jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")

    h = maxpool(conv(x, params["conv1"]))  # 8x8 -> 4x4
    h = maxpool(conv(h, params["conv2"]))  # 4x4 -> 2x2
    h = h.reshape(h.shape[0], -1)
    h = jax.nn.relu(h @ params["dense1"]["w"] + params["dense1"]["b"])
    return h @ params["dense2"]["w"] + params["dense2"]["b"]


def model_losses(params: dict[str, Any]) -> jax.Array:
    """The model's regularization losses (Keras's ``model.losses``): L2 on the kernels."""
    return 1e-4 * sum(jnp.sum(p["w"] ** 2) for p in params.values())


checkpoint_dir = ARGS.checkpoint_dir or tempfile.mkdtemp(prefix="jaxdist_ctl_")
checkpoint_prefix = os.path.join(checkpoint_dir, "ckpt")

with strategy.scope():
    model = jaxdist.create_variables(create_model(jax.random.PRNGKey(42)), name="model")  # mirrored variables
    optimizer = jaxdist.Optimizer(optax.adam(1e-3))
    optimizer.build(model)
    checkpoint = jaxdist.Checkpoint(strategy)  # the model and the optimizer's state

# -- 4. loss ---------------------------------------------------------------------------------------


def loss_object(labels: jax.Array, logits: jax.Array) -> jax.Array:
    """SparseCategoricalCrossentropy(from_logits=True, reduction=NONE): one loss per example."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def compute_loss(labels: jax.Array, logits: jax.Array, params: dict[str, Any]) -> jax.Array:
    per_example_loss = loss_object(labels, logits)
    loss = jaxdist.compute_average_loss(per_example_loss, global_batch_size=GLOBAL_BATCH_SIZE)
    return loss + jaxdist.scale_regularization_loss(model_losses(params))


# -- 5. metrics ------------------------------------------------------------------------------------

with strategy.scope():
    test_loss = jaxdist.metrics.Mean(name="test_loss")
    train_accuracy = jaxdist.metrics.SparseCategoricalAccuracy(name="train_accuracy")
    test_accuracy = jaxdist.metrics.SparseCategoricalAccuracy(name="test_accuracy")

# -- 6. training loop --------------------------------------------------------------------------------


def train_step(inputs: Any) -> jax.Array:
    images, labels = inputs

    def loss_fn(params: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
        logits = apply(params, images)
        return compute_loss(labels, logits, params), logits

    (loss, logits), gradients = jax.value_and_grad(loss_fn, has_aux=True)(jaxdist.read_variables(model))
    optimizer.apply_gradients(zip(jax.tree.leaves(gradients), jax.tree.leaves(model)))
    train_accuracy.update_state(labels, logits)
    return loss


def test_step(inputs: Any) -> None:
    images, labels = inputs
    logits = apply(jaxdist.read_variables(model), images)
    test_loss.update_state(loss_object(labels, logits))
    test_accuracy.update_state(labels, logits)


@jaxdist.function
def distributed_train_step(dataset_inputs: Any) -> jax.Array:
    per_replica_losses = strategy.run(train_step, args=(dataset_inputs,))
    return strategy.reduce(jaxdist.ReduceOp.SUM, per_replica_losses, axis=None)


@jaxdist.function
def distributed_test_step(dataset_inputs: Any) -> None:
    strategy.run(test_step, args=(dataset_inputs,))


for epoch in range(EPOCHS):
    t0 = time.perf_counter()
    total_loss = 0.0
    num_batches = 0
    for x in train_dist_dataset:
        total_loss += float(distributed_train_step(x))
        num_batches += 1
    train_loss = total_loss / num_batches

    for x in test_dist_dataset:
        distributed_test_step(x)

    if (epoch + 1) % ARGS.checkpoint_every == 0:
        checkpoint.step = epoch + 1  # recorded in the checkpoint (TF's has no step; printed after the restore)
        checkpoint.save(checkpoint_prefix)  # ckpt-1, ckpt-2, ...: numbered by checkpoint.save_counter

    print(
        f"Epoch {epoch + 1}, Loss: {train_loss:.4f}, Accuracy: {float(train_accuracy.result()) * 100:.2f}, "
        f"Test Loss: {float(test_loss.result()):.4f}, Test Accuracy: {float(test_accuracy.result()) * 100:.2f} "
        f"({time.perf_counter() - t0:.1f}s)"
    )
    test_loss.reset_state()
    train_accuracy.reset_state()
    test_accuracy.reset_state()

if ARGS.weights_out and jax.process_index() == 0:
    flat = {jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(model)}
    np.savez(ARGS.weights_out, **flat)

# -- 7. restore the latest checkpoint and test, without a strategy ------------------------------------
# A fresh model and optimizer of the default strategy (what exists outside any strategy.scope()).

with jaxdist.get_strategy().scope():  # outside any scope, get_strategy() is the default strategy
    new_model = jaxdist.create_variables(create_model(jax.random.PRNGKey(0)), name="model")
    new_optimizer = jaxdist.Optimizer(optax.adam(1e-3))
    eval_accuracy = jaxdist.metrics.SparseCategoricalAccuracy(name="eval_accuracy")

new_checkpoint = jaxdist.Checkpoint(None)  # no strategy
new_checkpoint.restore(jaxdist.latest_checkpoint(checkpoint_dir))  # restore(None), no checkpoint: does nothing


@jaxdist.function
def eval_step(images: jax.Array, labels: jax.Array) -> None:
    eval_accuracy.update_state(labels, apply(jaxdist.read_variables(new_model), images))


for images_batch, labels_batch in test_dataset:
    eval_step(images_batch, labels_batch)

print(
    f"Accuracy after restoring the saved model (epoch {new_checkpoint.step}) without strategy: "
    f"{float(eval_accuracy.result()) * 100:.2f}"
)
if ARGS.strategy == "multi_worker":
    strategy.shutdown()
