"""TensorFlow side of the TF-vs-jaxdist parameter-server benchmark; prints one JSON line per figure.

Run it with an interpreter that has ``tensorflow-cpu`` installed (not needed by jaxdist itself):

    python bench/tf_workloads.py --workload {noop,pull,push,mlp,all} [--repeats 3] [--workers 2] [--mlp-steps 200]

Cluster: TF 2.x ``tf.distribute.ParameterServerStrategy`` + ``ClusterCoordinator``, as in the
tensorflow.org tutorial "Parameter server training with ParameterServerStrategy", except that every
worker and PS is a real, separate OS process: a ``tf.distribute.Server`` started in a subprocess
with its own ``TF_CONFIG`` (2 PS and ``--workers`` workers, default 2). The coordinator (the
"chief" task) is this process. Every address in the cluster spec is 127.0.0.1 with a free port
picked by binding port 0 and closing, so all traffic stays on loopback (TF's gRPC server itself
binds its port on the wildcard address; TF hardcodes that and offers no option). The server processes are shut down on every exit path (normal end, exception,
Ctrl-C, SIGTERM), and additionally die with this process (stdin EOF + PR_SET_PDEATHSIG).

Workloads (they mirror bench/bench_ps.py, the jaxdist side). Every figure is the median of
``--repeats`` timed runs made after one untimed warm-up run; each run is timed with
``time.perf_counter()`` around ``coordinator.schedule(...)`` of the whole batch plus
``coordinator.join()``, on the coordinator:

  noop_closures_per_s  ``--noop-closures`` (default 5000) no-op ``tf.function`` closures (each
                       returns a scalar constant) scheduled then joined; closures / elapsed.
  pull_64MB_MBps       one float32 variable of 16M elements (64 MB) created under
                       ``strategy.scope()`` with ``FixedShardsPartitioner(2)`` (a 32 MB shard on
                       each PS). One closure per worker is scheduled at once; each reads the whole
                       variable ``--k`` (default 3) times: the ``ReadVariableOp`` of each shard runs
                       on its PS, the ``concat`` of the shards and the ``reduce_sum`` to a scalar
                       run on the worker, so the 64 MB really travels PS -> worker on each read
                       (the reads are chained with control dependencies so that none is merged).
                       MB/s = workers * k * 64 / elapsed.
  push_64MB_MBps       same variable; each worker's closure does ``v.assign_add(delta)`` k times with
                       a 64 MB delta made on the worker (``tf.fill`` from a runtime scalar, a fresh
                       tensor per call so TF cannot send one tensor once and reuse it). As
                       ``ShardedVariable.assign_add`` does, the delta is sliced per shard on the
                       worker and each shard's ``AssignAddVariableOp`` runs on its PS (written out
                       per shard here only to chain the k calls with control dependencies), so
                       64 MB travels worker -> PS per call. MB/s as for pull.
  mlp_steps_per_s      MLP 784-1024-1024-10 (relu, softmax cross entropy; he-normal weights, zero
                       biases, like ``mlp_init`` in bench_ps.py), batch 256, plain SGD lr 0.01.
                       Variables are created under the strategy with ``FixedShardsPartitioner(2)``;
                       the input is a per-worker dataset (``coordinator.create_per_worker_dataset``
                       of a repeated random 256x784 float32 batch + int32 labels, made on the
                       worker). The train step (a ``tf.function``, run through ``strategy.run`` as
                       in the tutorial) pulls the variables, computes gradients on the worker and
                       applies ``assign_sub(lr * g)`` on the PS that owns each shard.
                       ``--mlp-steps`` steps (default 200) are scheduled then joined after a
                       warm-up; steps/s = steps / elapsed, examples_per_s = steps/s * 256.

For pull/push each closure also measures its own duration on the worker (``tf.timestamp`` before
the first and after the last transfer), the way bench_ps.py times jaxdist's pull/push; that
figure is reported as ``median_in_closure`` (MB/s = workers * k * 64 / slowest closure).

``--size-mb N`` makes the pull/push variable N MB instead of 64 (workloads ``pull_<N>MB_MBps``,
``push_<N>MB_MBps``).

Given cluster: ``--cluster-json JSON`` (or ``@file``), a cluster spec ``{"chief": [addr], "worker":
[...], "ps": [2 addrs]}``, makes this process the chief of ``tf.distribute.Server`` tasks that already
run at those addresses (e.g. on other hosts: ``bench/netbench.py`` starts them in network namespaces
with :func:`server_command` / :func:`server_env`) instead of starting its own on loopback; the chief
address is this process's own (TF's coordinator serves on it). --workers is then the spec's.

``--check`` additionally prints sanity figures showing that the bytes really move: pull MB/s for a
4x smaller variable (same MB/s: time scales with bytes), pull with each shard reduced on its own
PS (only scalars travel: many times faster), push with each shard's delta made on its own PS
(nothing big travels: many times faster), and that every element of the variable holds exactly the
sum of all the deltas pushed (the pushes were all applied).

First line: ``{"system": "tf", "tf_version": ..., "cpus": ...}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import select
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable
from typing import Any

MB = 1 << 20
NUM_PS = 2
SERVER_START_TIMEOUT_S = 120.0

# Code run by each server subprocess: a tf.distribute.Server for the task named in its TF_CONFIG.
# It prints READY once listening and serves until its stdin reaches EOF (the parent closed it or
# died), then exits hard (a TF server has no clean shutdown). PR_SET_PDEATHSIG makes the kernel
# kill it if the parent dies without closing the pipe first.
_SERVER_CODE = textwrap.dedent(
    """
    import ctypes, os, signal, sys
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - report any failure, then still stop the servers
        pass
    if os.getppid() != int(os.environ["TF_BENCH_PARENT_PID"]):
        os._exit(1)  # the parent died before prctl took effect
    import tensorflow as tf
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=resolver.task_type,
                                  task_index=resolver.task_id, protocol="grpc", start=True)
    print("READY", flush=True)
    sys.stdin.read()
    os._exit(0)
    """
)


def server_command(python: str) -> list[str]:
    """argv of one ``tf.distribute.Server`` process (see ``_SERVER_CODE``): it prints READY once
    listening and exits when its stdin reaches EOF; give it :func:`server_env`."""
    return [python, "-c", _SERVER_CODE]


def server_env(base: dict[str, str], cluster: dict[str, list[str]], job: str, index: int, parent_pid: int) -> dict[str, str]:
    """Environment of the server for task ``job:index`` of ``cluster``, started by process ``parent_pid``."""
    env = dict(base)
    env["TF_CONFIG"] = json.dumps({"cluster": cluster, "task": {"type": job, "index": index}})
    env["TF_BENCH_PARENT_PID"] = str(parent_pid)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports: bind port 0 (all sockets open at once), read, close."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalTFCluster:
    """2 PS + N worker tf.distribute.Server processes on loopback, plus a chief slot for us."""

    def __init__(self, num_workers: int, num_ps: int = NUM_PS) -> None:
        ports = free_ports(num_workers + num_ps + 1)
        addr = [f"127.0.0.1:{p}" for p in ports]
        self.cluster = {
            "chief": addr[:1],
            "worker": addr[1 : 1 + num_workers],
            "ps": addr[1 + num_workers :],
        }
        self.procs: list[tuple[str, subprocess.Popen[str]]] = []  # ("ps0", proc), ...
        self._logdir = tempfile.TemporaryDirectory(prefix="tf_bench_")

    def start(self) -> None:
        tasks = [("ps", i) for i in range(len(self.cluster["ps"]))]
        tasks += [("worker", i) for i in range(len(self.cluster["worker"]))]
        for job, idx in tasks:
            env = server_env(dict(os.environ), self.cluster, job, idx, os.getpid())
            name = f"{job}{idx}"
            with open(self._log_path(name), "w") as log:  # the child keeps its own copy of the fd
                proc = subprocess.Popen(server_command(sys.executable), env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
            self.procs.append((name, proc))
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        for name, proc in self.procs:  # wait for every READY line (the servers start in parallel)
            assert proc.stdout is not None
            line = ""
            while not line:
                left = deadline - time.monotonic()
                if proc.poll() is not None or left <= 0:
                    raise RuntimeError(f"TF server {name} did not start:\n{self._log_tail(name)}")
                ready, _, _ = select.select([proc.stdout], [], [], min(left, 1.0))
                if ready:
                    line = proc.stdout.readline().strip()
                    if line != "READY":
                        raise RuntimeError(f"TF server {name} said {line!r}:\n{self._log_tail(name)}")

    def _log_path(self, name: str) -> str:
        return os.path.join(self._logdir.name, f"{name}.log")

    def _log_tail(self, name: str) -> str:
        try:
            with open(self._log_path(name)) as f:
                return "".join(f.readlines()[-20:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Close every server's stdin (it exits), then SIGTERM / SIGKILL whatever is left."""
        for _, proc in self.procs:
            try:
                if proc.stdin:
                    proc.stdin.close()
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for _, proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
        for _, proc in self.procs:
            try:
                proc.wait(3)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        self.procs = []
        self._logdir.cleanup()


def median_runs(fn: Callable[[], float], repeats: int, digits: int = 1) -> dict[str, Any]:
    """One untimed warm-up call of fn, then `repeats` calls; their median and values."""
    fn()
    vals = [fn() for _ in range(repeats)]
    return {"median": round(statistics.median(vals), digits), "runs": [round(v, digits) for v in vals]}


# --------------------------------------------------------------------------- workloads
def bench_noop(tf: Any, coord: Any, n: int, repeats: int) -> dict[str, Any]:
    @tf.function
    def noop() -> Any:
        return tf.constant(0)

    def run() -> float:
        t = time.perf_counter()
        for _ in range(n):
            coord.schedule(noop)
        coord.join()
        return n / (time.perf_counter() - t)

    return {"closures": n, **median_runs(run, repeats)}


def make_big_variable(tf: Any, strategy: Any, n_elems: int, name: str) -> Any:
    """A float32 zeros variable of n_elems, sharded over the 2 PS by the strategy's partitioner."""
    with strategy.scope():
        var = tf.Variable(tf.zeros([n_elems], tf.float32), name=name)
    devices = sorted({s.device for s in var.variables})
    assert len(var.variables) == NUM_PS and all("/job:ps/" in d for d in devices), devices
    return var


def make_pull_fn(tf: Any, var: Any, k: int, on_ps: bool = False) -> Any:
    """Closure reading all of `var` k times; returns (seconds measured on the worker, checksum).

    Each shard's ReadVariableOp is colocated with the shard on its PS; the concat and the
    reduction carry no device, so they run on the worker executing the closure and the 64 MB
    crosses the network on every read. on_ps=True (sanity check only) pins each shard's reduction
    to its own PS instead, so only scalars cross.
    """

    @tf.function
    def pull() -> Any:
        t0 = tf.timestamp()
        acc = tf.constant(0.0, tf.float32)
        for _ in range(k):
            # chaining on the previous result keeps every read a distinct, ordered op
            with tf.control_dependencies([t0, acc]):
                if on_ps:
                    parts = []
                    for shard in var.variables:
                        with tf.device(shard.device):
                            parts.append(tf.reduce_sum(shard.read_value()))
                    acc = acc + tf.add_n(parts)
                else:
                    full = tf.concat([shard.read_value() for shard in var.variables], axis=0)
                    acc = acc + tf.reduce_sum(full)
        with tf.control_dependencies([acc]):
            t1 = tf.timestamp()
        return t1 - t0, acc

    return pull


def make_push_fn(tf: Any, var: Any, k: int, on_ps: bool = False) -> Any:
    """Closure doing var.assign_add(delta) k times with a 64 MB delta made on the worker.

    The delta is a tf.fill from the runtime argument `x` (nothing to constant-fold) and is a new
    tensor for each call: the graph partitioner sends a given tensor to a given device only once,
    so reusing one delta for k assign_adds would move it once. The delta is sliced per shard on
    the worker exactly as ShardedVariable.assign_add does (slices at the shard offsets), and each
    shard's AssignAddVariableOp runs on its PS. on_ps=True (sanity check only) makes each shard's
    slice of the delta on that shard's PS instead, so nothing big crosses.
    """
    n = int(var.shape[0])

    @tf.function
    def push(x: Any) -> Any:
        t0 = tf.timestamp()
        done: list[Any] = [t0]
        for i in range(k):
            with tf.control_dependencies(done):
                if on_ps:
                    parts = []
                    for s in var.variables:
                        with tf.device(s.device):
                            parts.append(tf.fill(s.shape, x + float(i)))
                else:
                    parts = _split_like(tf, tf.fill([n], x + float(i)), var)
            with tf.control_dependencies(parts):
                done = [s.assign_add(d, read_value=False) for s, d in zip(var.variables, parts, strict=True)]
        with tf.control_dependencies(done):
            t1 = tf.timestamp()
        return t1 - t0

    return push


def _split_like(tf: Any, value: Any, var: Any) -> list[Any]:
    """Slices of `value` matching the shards of `var` (what ShardedVariable.assign_add does)."""
    out, offset = [], 0
    for s in var.variables:
        size = int(s.shape[0])
        out.append(value[offset : offset + size])
        offset += size
    return out


def bench_transfer(tf: Any, coord: Any, fn: Any, args: tuple[Any, ...], workers: int, k: int, mb: float,
                   repeats: int) -> dict[str, Any]:
    """One closure per worker at once; MB/s around schedule+join and from the in-closure timers."""
    in_closure: list[float] = []

    def run() -> float:
        t = time.perf_counter()
        rvs = [coord.schedule(fn, args=args) for _ in range(workers)]
        coord.join()
        elapsed = time.perf_counter() - t
        outs = [rv.fetch() for rv in rvs]
        secs = [float(o[0] if isinstance(o, tuple) else o) for o in outs]
        in_closure.append(workers * k * mb / max(secs))
        return workers * k * mb / elapsed

    res = median_runs(run, repeats)
    timed = in_closure[1:]  # drop the warm-up run
    res["median_in_closure"] = round(statistics.median(timed), 1)
    res["runs_in_closure"] = [round(v, 1) for v in timed]
    return res


def bench_pull_push(tf: Any, strategy: Any, coord: Any, which: list[str], workers: int, k: int, repeats: int,
                    check: bool, size_mb: int = 64) -> None:
    n = size_mb * MB // 4  # float32 elements: 16M = 64 MB
    mb = float(size_mb)
    var = make_big_variable(tf, strategy, n, "big")
    common = {"workers": workers, "ps": NUM_PS, "k_per_closure": k,
              "timing": "schedule(1 closure per worker)+join, after 1 warm-up"}
    if "pull" in which:
        res = bench_transfer(tf, coord, make_pull_fn(tf, var, k), (), workers, k, mb, repeats)
        emit(system="tf", workload=f"pull_{size_mb}MB_MBps", **common, **res)
        if check:
            small = make_big_variable(tf, strategy, n // 4, "small")
            res_s = bench_transfer(tf, coord, make_pull_fn(tf, small, k), (), workers, k, 16, repeats)
            res_ps = bench_transfer(tf, coord, make_pull_fn(tf, var, k, on_ps=True), (), workers, k, 64, repeats)
            emit(system="tf", workload="check_pull_16MB_MBps", **common, **res_s,
                 note="4x smaller variable: similar MB/s means time scales with bytes")
            emit(system="tf", workload="check_pull_reduce_on_ps_equiv_MBps", **common, **res_ps,
                 note="each shard summed on its own PS (only scalars move): should be much higher")
    if "push" in which:
        x = tf.constant(1.0)
        res = bench_transfer(tf, coord, make_push_fn(tf, var, k), (x,), workers, k, mb, repeats)
        emit(system="tf", workload=f"push_{size_mb}MB_MBps", **common, **res)
        if check:
            # every push call adds sum(1 + i for i < k) to each element, one call per worker per run
            calls = workers * (repeats + 1)
            expected = float(calls * sum(1 + i for i in range(k)))
            got = [float(tf.reduce_min(s).numpy()) for s in var.variables] + \
                  [float(tf.reduce_max(s).numpy()) for s in var.variables]
            emit(system="tf", workload="check_push_applied", expected_each_element=expected,
                 shard_min_max=got, ok=all(abs(g - expected) < 1e-3 for g in got))
            res_ps = bench_transfer(tf, coord, make_push_fn(tf, var, k, on_ps=True), (x,), workers, k, 64, repeats)
            emit(system="tf", workload="check_push_delta_on_ps_equiv_MBps", **common, **res_ps,
                 note="delta made on the PS itself (nothing big moves): should be much higher")


def he_normal_mlp(tf: Any, seed: int = 0) -> list[tuple[Any, Any]]:
    """Initial (w, b) per layer, as mlp_init in bench_ps.py: N(0, 2/fan_in) weights, zero biases."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sizes = [784, 1024, 1024, 10]
    return [((rng.standard_normal((m, n)) * np.sqrt(2 / m)).astype(np.float32), np.zeros(n, np.float32))
            for m, n in itertools.pairwise(sizes)]


def bench_mlp(tf: Any, strategy: Any, coord: Any, workers: int, steps: int, repeats: int) -> None:
    batch, lr = 256, 0.01
    with strategy.scope():  # FixedShardsPartitioner(2): every weight and bias is split over the 2 PS
        layers = [(tf.Variable(w, name=f"w{i}"), tf.Variable(b, name=f"b{i}"))
                  for i, (w, b) in enumerate(he_normal_mlp(tf))]
    shards = [s for w, b in layers for v in (w, b) for s in v.variables]

    def dataset_fn(ctx: Any) -> Any:
        # built on each worker: one random batch, repeated (as the jaxdist side does)
        seed = [ctx.input_pipeline_id, 0]
        x = tf.random.stateless_normal([batch, 784], seed=seed)
        y = tf.random.stateless_uniform([batch], seed=seed, minval=0, maxval=10, dtype=tf.int32)
        return tf.data.Dataset.from_tensors((x, y)).repeat().prefetch(2)

    @tf.function
    def per_worker_dataset_fn() -> Any:
        return strategy.distribute_datasets_from_function(dataset_fn)

    it = iter(coord.create_per_worker_dataset(per_worker_dataset_fn))

    @tf.function
    def train_step(iterator: Any) -> Any:
        def replica_fn(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                h = x
                for i, (w, b) in enumerate(layers):
                    h = tf.matmul(h, w) + b  # ShardedVariable -> concat of the shard reads
                    if i < len(layers) - 1:
                        h = tf.nn.relu(h)
                loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=h))
            grads = tape.gradient(loss, shards)
            for s, g in zip(shards, grads, strict=True):
                with tf.device(s.device):  # the SGD update runs on the PS that owns the shard
                    s.assign_sub(lr * g, read_value=False)
            return loss

        x, y = next(iterator)
        return strategy.run(replica_fn, args=(x, y))

    def run() -> float:
        t = time.perf_counter()
        for _ in range(steps):
            coord.schedule(train_step, args=(it,))
        coord.join()
        return steps / (time.perf_counter() - t)

    for _ in range(2 * workers):  # trace + first steps, like bench_ps.py
        coord.schedule(train_step, args=(it,))
    coord.join()
    loss0 = float(coord.schedule(train_step, args=(it,)).fetch())
    res = median_runs(run, repeats, digits=2)
    loss1 = float(coord.schedule(train_step, args=(it,)).fetch())
    emit(system="tf", workload="mlp_steps_per_s", workers=workers, ps=NUM_PS, batch=batch, steps=steps, **res,
         examples_per_s=round(res["median"] * batch), loss_before=round(loss0, 4), loss_after=round(loss1, 4),
         timing="schedule(steps)+join, after 1 warm-up run")


# --------------------------------------------------------------------------- main
def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=["noop", "pull", "push", "mlp", "all"], default="all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--mlp-steps", type=int, default=200)
    ap.add_argument("--noop-closures", type=int, default=5000)
    ap.add_argument("--k", type=int, default=3, help="64 MB reads / assign_adds per pull / push closure")
    ap.add_argument("--check", action="store_true", help="also print the data-movement sanity figures")
    ap.add_argument("--size-mb", type=int, default=64, help="MB of the pull/push variable (workload names follow)")
    ap.add_argument("--cluster-json", default=None, metavar="JSON|@FILE",
                    help='use running servers: {"chief": [this process], "worker": [...], "ps": [2 addresses]} '
                         "instead of starting a loopback cluster (--workers is then the spec's)")
    args = ap.parse_args()
    given = None
    if args.cluster_json is not None:
        text = args.cluster_json
        if text.startswith("@"):
            with open(text[1:]) as f:
                text = f.read()
        given = json.loads(text)
        if len(given.get("chief", [])) != 1 or not given.get("worker") or len(given.get("ps", [])) != NUM_PS:
            ap.error(f"--cluster-json needs one chief, at least one worker and {NUM_PS} ps addresses: {given}")
        args.workers = len(given["worker"])
    which = ["noop", "pull", "push", "mlp"] if args.workload == "all" else [args.workload]

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Ctrl-C -> KeyboardInterrupt even when started in the background (where SIGINT may be
    # ignored); SIGTERM -> SystemExit. Both end in the cleanup below.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_on_sigterm)
    import tensorflow as tf

    emit(system="tf", tf_version=tf.__version__, cpus=os.cpu_count(), python=sys.version.split()[0])
    cluster = LocalTFCluster(args.workers) if given is None else None
    rc = 1
    try:
        if cluster is not None:
            cluster.start()
        resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
            tf.train.ClusterSpec(given or cluster.cluster), task_type="chief", task_id=0, rpc_layer="grpc")
        strategy = tf.distribute.ParameterServerStrategy(
            resolver, variable_partitioner=tf.distribute.experimental.partitioners.FixedShardsPartitioner(NUM_PS))
        coord = tf.distribute.coordinator.ClusterCoordinator(strategy)

        if "noop" in which:
            res = bench_noop(tf, coord, args.noop_closures, args.repeats)
            emit(system="tf", workload="noop_closures_per_s", workers=args.workers, ps=NUM_PS, **res,
                 timing="schedule(closures)+join, after 1 warm-up run")
        if "pull" in which or "push" in which:
            bench_pull_push(tf, strategy, coord, which, args.workers, args.k, args.repeats, args.check, args.size_mb)
        if "mlp" in which:
            bench_mlp(tf, strategy, coord, args.workers, args.mlp_steps, args.repeats)
        coord.join()
        rc = 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        rc = 130
    except SystemExit as e:  # SIGTERM (see _raise_on_sigterm)
        rc = e.code if isinstance(e.code, int) else 1
    except Exception:  # noqa: BLE001 - report any failure, then still stop the servers
        traceback.print_exc()
        rc = 1
    finally:
        if cluster is not None:
            cluster.stop()
        # The coordinator's background threads keep retrying once the servers are gone and can
        # block the interpreter's teardown, so leave without it (the servers are already stopped).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


if __name__ == "__main__":
    main()
