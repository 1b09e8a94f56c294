"""jaxdist's side of the TF comparison: the same workloads, CLI and JSON schema as ``tf_workloads.py``.

Workloads (a LocalCluster of real processes on loopback: --workers workers, --ps PS; the
64 MB variable is split in --ps shards, one per PS):
  noop   no-op closures per second through schedule/join         -> noop_closures_per_s
  pull   MB/s for one 64 MB float32 variable read by every worker
         at once, 3 pulls per closure after one warm pull, timed
         inside the closures (MB moved / slowest closure); one
         untimed warm-up run first                                 -> pull_64MB_MBps
  push   the same with assign_add of a 64 MB delta made on the
         worker (one warm push in each closure)                    -> push_64MB_MBps
  mlp    MLP 784-1024-1024-10, batch 256, SGD applied on the PS,
         one step = pull params, grad on the worker, push grads   -> mlp_steps_per_s
  all    the four above in one cluster ("system": "jaxdist")
  mlp_phases  profiling only (not in "all"): the MLP step timed phase by phase inside the
         closures (pull, gradient, push; median ms per step)     -> mlp_phase_ms
and the references, measured by ``bench_ps.py``'s own code ("system": "reference"):
  raw        a plain gRPC server process: 64 MB streamed in 4 MB chunks down/up, tiny unary
             calls sequential / 16 concurrent (raw_grpc_*)
  plain_jax  the same MLP in this one process with jax + optax (plain_jax_mlp_steps_per_s)
  references both of them

--size-mb N makes the pull/push variable N MB instead of 64 (workloads pull_<N>MB_MBps, push_<N>MB_MBps).

--bulk-dtype bfloat16 moves the pull/push variable's bytes as bfloat16 (half the bytes on the wire;
the variable stays float32 on the PS): the pull is ``jaxdist.pull(var, dtype=bfloat16)``, rounded
once per version on the PS; the push is a bfloat16 gradient, ``var.apply_gradient(delta)``, applied
by the PS in float32 with ``optax.sgd(1.0)`` (v -= delta), since only gradients may travel narrower
than their variable. MB/s still count the float32 variable's MB; the records say
``"wire_dtype": "bfloat16"`` and the push's op.

Given cluster: with --given-cluster no LocalCluster is started; this script is the coordinator of
the cluster that ``jaxdist.cluster_resolver.detect()`` finds (``JAXDIST_CLUSTER`` and
``JAXDIST_TOKEN`` as ``jaxdist launch`` exports them, or TF_CONFIG, or Slurm), e.g. ``jaxdist ps``
and ``jaxdist worker`` processes on other hosts (``bench/netbench.py`` starts them in network
namespaces). --workers and --ps are then the cluster's, and after the pull/push workloads one
``"kind": "transport"`` line says how each worker and this coordinator really reached each PS
(data plane or gRPC, shared memory or socket). Leaving the script ends the job
(``coordinator.shutdown()``): the tasks exit.

Every figure is the median of --repeats runs; ``runs`` lists them. The first line is an info line.
Usage: python bench/jaxdist_workloads.py --workload all [--repeats 3] [--workers 2] [--mlp-steps 200]
       [--grad-dtype float32|bfloat16] [--size-mb 64] [--given-cluster]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import io
import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cloudpickle  # noqa: E402
import numpy as np  # noqa: E402

import bench_ps  # noqa: E402
from bench_ps import MB, mlp_init, mlp_loss  # noqa: E402
from staleness_option import parse_staleness, staleness_label  # noqa: E402

# Closures built here reference bench_ps / this module by name; workers cannot import either
# (bench/ is not on their path), so both travel by value inside the pickled closures.
cloudpickle.register_pickle_by_value(bench_ps)
if __name__ != "__main__":
    cloudpickle.register_pickle_by_value(sys.modules[__name__])

JAXDIST_WORKLOADS = ("noop", "pull", "push", "mlp")
PROFILE_WORKLOADS = ("mlp_phases",)  # not part of "all"
REFERENCE_WORKLOADS = ("raw", "plain_jax")
WORKLOAD_CHOICES = (*JAXDIST_WORKLOADS, "all", *PROFILE_WORKLOADS, *REFERENCE_WORKLOADS, "references")
BATCH = 256


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def tensor_transport() -> str:
    """How this run's PS clients move tensors (the cluster's processes inherit this environment):
    "shm" (data plane, same-host shared memory), "tcp" (data plane socket) or "grpc"."""
    from jaxdist.transport import dataplane

    if not dataplane.enabled():
        return "grpc"
    return "shm" if dataplane.shm_enabled() else "tcp"


def transfer_dtype_supported() -> bool:
    """Whether ``jaxdist.apply_gradients`` takes ``transfer_dtype=`` (gradients sent in a narrower dtype)."""
    import jaxdist

    try:
        return "transfer_dtype" in inspect.signature(jaxdist.apply_gradients).parameters
    except (TypeError, ValueError):
        return False


def _transfer_dtype(grad_dtype: str) -> Any:
    """The value passed as ``transfer_dtype``, or None to leave the keyword out (float32 = no conversion)."""
    if grad_dtype == "float32":
        return None
    if grad_dtype != "bfloat16":
        raise ValueError(f"unknown grad dtype {grad_dtype!r}")
    if not transfer_dtype_supported():
        raise SystemExit(
            "error: --grad-dtype bfloat16 needs jaxdist.apply_gradients(variables, grads, transfer_dtype=...), "
            "which this jaxdist does not have (signature: "
            f"{_signature_text()}); run with --grad-dtype float32"
        )
    import jax.numpy as jnp

    return jnp.bfloat16


def _signature_text() -> str:
    import jaxdist

    try:
        return f"apply_gradients{inspect.signature(jaxdist.apply_gradients)}"
    except (TypeError, ValueError):
        return "unknown"


# ------------------------------------------------------------ closures
# Module-level factories: each closure captures only what it needs (never the cluster object).
def _noop() -> None:
    return None


def _make_pull_closure(var: Any, pulls: int, per_pull_times: bool = False, dtype: Any = None) -> Any:
    """``pulls`` timed pulls of ``var`` (values in ``dtype``: ``jaxdist.pull(var, dtype=)``, None = its own)."""
    def pull_closure() -> Any:
        import time as _t

        import jaxdist as _jd

        _jd.pull(var, dtype=dtype)  # warm: connections, buffers
        times = []
        t0 = _t.perf_counter()
        for _ in range(pulls):
            t = _t.perf_counter()
            _jd.pull(var, dtype=dtype)
            times.append(_t.perf_counter() - t)
        return times if per_pull_times else _t.perf_counter() - t0

    return pull_closure


def _make_push_closure(var: Any, n: int, pushes: int, gradient_dtype: Any = None) -> Any:
    """``pushes`` timed pushes of a delta of ``n`` elements: ``assign_add`` of a float32 delta, or with
    ``gradient_dtype`` an ``apply_gradient`` of a delta in that dtype (a narrower gradient travels as it is)."""
    def push_closure() -> float:
        import time as _t

        import numpy as _np

        # Made on the worker: closures ship code, not data.
        delta = _np.ones(n, _np.float32 if gradient_dtype is None else gradient_dtype)
        push = var.assign_add if gradient_dtype is None else var.apply_gradient
        push(delta)  # warm
        t0 = _t.perf_counter()
        for _ in range(pushes):
            push(delta)
        return _t.perf_counter() - t0

    return push_closure


def _mlp_dataset_fn(ctx: Any) -> Any:
    rng = np.random.default_rng(ctx.input_pipeline_id)
    x = rng.standard_normal((BATCH, 784)).astype(np.float32)
    y = rng.integers(0, 10, BATCH).astype(np.int32)
    while True:
        yield x, y


class _Pipeline:
    """The part of an input context ``_mlp_dataset_fn`` reads."""

    def __init__(self, input_pipeline_id: int) -> None:
        self.input_pipeline_id = input_pipeline_id


#: How the MLP step reads and updates the parameters (--mlp-mode):
#: pull_push  pull, gradient, apply_gradients (the default; what TF's step does);
#: prefetch   pull(prefetch_next=True): the next step's pull runs while this one computes and pushes
#:            (full-duplex link: up and down at once); a step may miss its own previous gradients;
#: fused      pull(prefetch_next=True) served by the last push_pull(prefetch_next=True): one round
#:            trip per step (push up, then updated values down), no staleness of its own.
MLP_MODES = ("pull_push", "prefetch", "fused")


def _make_train_step(params: Any, transfer_dtype: Any, pull_dtype: Any = None, mode: str = "pull_push") -> Any:
    import jax
    import jax.numpy as jnp

    import jaxdist

    def grads(p: Any, x: Any, y: Any) -> Any:
        if pull_dtype is not None:  # mixed precision: bf16 values on the wire, the model computes in float32
            p = jax.tree.map(lambda a: a.astype(jnp.float32), p)
        g = jax.grad(mlp_loss)(p, x, y)
        # A bf16 gradient cast runs here, fused into the jitted function, and apply_gradients
        # sends bf16 gradients as they are: the cheapest way (see its docstring).
        return g if transfer_dtype is None else jax.tree.map(lambda a: a.astype(transfer_dtype), g)

    grad_fn = jax.jit(grads)

    if mode not in MLP_MODES:
        raise ValueError(f"mlp mode {mode!r} is not one of {MLP_MODES}")

    def train_step(it: Any) -> None:
        x, y = next(it)
        if mode == "pull_push":
            jaxdist.apply_gradients(params, grad_fn(jaxdist.pull(params, dtype=pull_dtype), x, y))
        elif mode == "prefetch":
            jaxdist.apply_gradients(params, grad_fn(jaxdist.pull(params, dtype=pull_dtype, prefetch_next=True), x, y))
        else:
            g = grad_fn(jaxdist.pull(params, dtype=pull_dtype, prefetch_next=True), x, y)
            jaxdist.push_pull(params, g, dtype=pull_dtype, prefetch_next=True)

    return train_step


def _make_phased_train_step(params: Any, mode: str = "pull_push") -> Any:
    """``_make_train_step`` (float32) timed phase by phase on the worker: (pull, grad, push) seconds
    (with ``mode`` fused, "push" is the push_pull round trip; with prefetch, "pull" is the wait for
    the prefetched values)."""
    import jax

    import jaxdist

    grad_fn = jax.jit(lambda p, x, y: jax.grad(mlp_loss)(p, x, y))

    def train_step(it: Any) -> tuple[float, float, float]:
        import time as _t

        x, y = next(it)
        t0 = _t.perf_counter()
        p = jaxdist.pull(params, prefetch_next=mode != "pull_push")
        t1 = _t.perf_counter()
        g = jax.block_until_ready(grad_fn(p, x, y))
        t2 = _t.perf_counter()
        if mode == "fused":
            jaxdist.push_pull(params, g, prefetch_next=True)
        else:
            jaxdist.apply_gradients(params, g)
        return t1 - t0, t2 - t1, _t.perf_counter() - t2

    return train_step


def _transport_probe() -> dict[str, Any]:
    """On a worker: how its PS clients move tensors (after they were used)."""
    import jaxdist
    from jaxdist.worker.context import current_ps

    return {"worker": jaxdist.current_worker_index(), "ps": _client_transports(current_ps())}


def _client_transports(conns: Any) -> list[str]:
    """Per PS: "shm" (data plane through shared memory), "tcp" (data plane socket), "grpc" or "unused"."""
    out = []
    for c in conns.clients:
        dp = c.uses_data_plane
        out.append("unused" if dp is None else "grpc" if not dp else "shm" if c.uses_shared_memory else "tcp")
    return out


# ------------------------------------------------------------ the cluster
class JaxdistBench:
    """A LocalCluster + ParameterServerStrategy + ClusterCoordinator with one method per workload.

    ``given=True``: no LocalCluster; the cluster is the running one that
    ``jaxdist.cluster_resolver.detect()`` finds, and ``workers``/``ps`` are read from it.
    A context manager: leaving it shuts the coordinator down (ending the job) and stops every task
    process it started.
    """

    def __init__(self, workers: int = 2, ps: int = 2, shards: int | None = None, given: bool = False,
                 staleness: int | None = None) -> None:
        self.workers = workers
        self.ps = ps
        self.shards = shards
        self.given = given
        self.staleness = staleness
        self._stack = contextlib.ExitStack()
        self._n = 0

    def __enter__(self) -> JaxdistBench:
        import jaxdist

        try:
            if self.given:
                from jaxdist.cluster_resolver import detect

                resolver = detect()
                spec = resolver.cluster_spec().as_dict()
                self.workers, self.ps = len(spec.get("worker", [])), len(spec.get("ps", []))
            else:
                self.cluster = self._stack.enter_context(jaxdist.LocalCluster(num_workers=self.workers, num_ps=self.ps))
                resolver = self.cluster.cluster_resolver()
            self.shards = self.shards or self.ps
            self.strategy = jaxdist.ParameterServerStrategy(
                resolver, variable_partitioner=jaxdist.FixedShardsPartitioner(self.shards), staleness=self.staleness
            )
            self._stack.callback(self.strategy.close)
            self.coord = jaxdist.ClusterCoordinator(self.strategy)
            self._stack.callback(self.coord.shutdown)
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def _name(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n}"

    def variable(self, mb: float, optimizer: Any = None) -> Any:
        """A zero float32 variable of ``mb`` MiB, in ``shards`` shards (with ``optimizer`` on the PS)."""
        import jaxdist

        with self.strategy.scope():
            return jaxdist.create_variable(np.zeros(int(mb * MB) // 4, np.float32), name=self._name("big"),
                                           optimizer=optimizer)

    # -- (a) no-op closures
    def noop_rate(self, n: int) -> float:
        """Closures per second for ``n`` no-op closures scheduled then joined."""
        t = time.perf_counter()
        for _ in range(n):
            self.coord.schedule(_noop)
        self.coord.join()
        return n / (time.perf_counter() - t)

    # -- (b) bulk transfer: every worker at once
    def transfer_rate(self, kind: str, var: Any, mb: float, per_closure: int = 3, wire_dtype: Any = None) -> float:
        """MB/s (of the float32 variable) moved by one closure per worker, each doing ``per_closure``
        pulls or pushes of ``var``; ``wire_dtype`` (bfloat16): the bytes travel narrower (module docstring)."""
        if kind == "pull":
            fn = _make_pull_closure(var, per_closure, dtype=wire_dtype)
        elif kind == "push":
            fn = _make_push_closure(var, int(mb * MB) // 4, per_closure, wire_dtype)
        else:
            raise ValueError(kind)
        rvs = [self.coord.schedule(fn) for _ in range(self.workers)]
        self.coord.join()
        return self.workers * per_closure * mb / max(rv.fetch() for rv in rvs)

    def pull_times(self, var: Any, pulls: int) -> list[float]:
        """Seconds of each of ``pulls`` pulls of ``var`` by one closure on one worker (after one warm pull)."""
        rv = self.coord.schedule(_make_pull_closure(var, pulls, per_pull_times=True))
        self.coord.join()
        return list(rv.fetch())

    # -- (c) MLP
    def mlp_setup(self, grad_dtype: str = "float32", pull_dtype: str = "float32", mode: str = "pull_push") -> None:
        import optax

        import jaxdist

        transfer_dtype = _transfer_dtype(grad_dtype)
        with self.strategy.scope():
            params = jaxdist.create_variables(mlp_init(), name=self._name("mlp"), optimizer=optax.sgd(0.01))
        self._params = params
        self._mode = mode
        self._train_step = _make_train_step(params, transfer_dtype, _transfer_dtype(pull_dtype), mode)
        self._it = iter(self.coord.create_per_worker_dataset(_mlp_dataset_fn))
        for _ in range(2 * self.workers):  # warm: jit on every worker
            self.coord.schedule(self._train_step, args=(self._it,))
        self.coord.join()

    def mlp_rate(self, steps: int) -> float:
        t = time.perf_counter()
        for _ in range(steps):
            self.coord.schedule(self._train_step, args=(self._it,))
        self.coord.join()
        return steps / (time.perf_counter() - t)

    def mlp_loss_now(self) -> float:
        """The MLP's loss on worker 0's batch (``_mlp_dataset_fn``) with the PS's current float32
        values, computed here on the coordinator: a check that the timed steps trained the model
        (as tf_workloads.py's ``loss_before``/``loss_after``), whatever dtype they moved values in."""
        import jax

        values = jax.tree.map(lambda v: v.numpy(), self._params)
        x, y = next(_mlp_dataset_fn(_Pipeline(0)))
        return float(mlp_loss(values, x, y))

    def applied_steps(self) -> int | None:
        """Optimizer steps the first PS applied under a step barrier (``staleness`` set); None without one."""
        barrier = self.coord.step_barrier
        return None if barrier is None else int(barrier.reports()[0].applied)

    def mlp_phases(self, steps: int) -> dict[str, Any]:
        """``steps`` phase-timed MLP steps (after ``mlp_setup``): steps/s and median ms per phase."""
        step = _make_phased_train_step(self._params, self._mode)
        for _ in range(2 * self.workers):  # warm: jit of the phased function on every worker
            self.coord.schedule(step, args=(self._it,))
        self.coord.join()
        t = time.perf_counter()
        rvs = [self.coord.schedule(step, args=(self._it,)) for _ in range(steps)]
        self.coord.join()
        rate = steps / (time.perf_counter() - t)
        phases = np.array([rv.fetch() for rv in rvs]) * 1e3
        med = np.median(phases, axis=0)
        return {"steps_per_s": round(rate, 2), "pull_ms": round(float(med[0]), 2), "grad_ms": round(float(med[1]), 2),
                "push_ms": round(float(med[2]), 2), "step_ms": round(float(np.median(phases.sum(axis=1))), 2),
                "pull_ms_p90": round(float(np.percentile(phases[:, 0], 90)), 2),
                "push_ms_p90": round(float(np.percentile(phases[:, 2], 90)), 2)}

    def transports(self) -> dict[str, Any]:
        """How each worker (one probe closure per worker and then some) and this coordinator reach each PS."""
        rvs = [self.coord.schedule(_transport_probe) for _ in range(4 * self.workers)]
        self.coord.join()
        seen = {}
        for rv in rvs:
            r = rv.fetch()
            seen[f"worker:{r['worker']}"] = r["ps"]
        coordinator = _client_transports(self.strategy.connections)
        used = sorted({t for ts in [*seen.values(), coordinator] for t in ts} - {"unused"})
        return {"workers": dict(sorted(seen.items())), "coordinator": coordinator, "used": used}


def _runs(fn: Any, repeats: int, ndigits: int = 1) -> dict[str, Any]:
    vals = [fn() for _ in range(repeats)]
    return {"median": round(statistics.median(vals), ndigits), "runs": [round(v, ndigits) for v in vals]}


def run_jaxdist(workloads: list[str], repeats: int, workers: int, ps: int, mlp_steps: int, noop_closures: int,
                grad_dtype: str, pull_dtype: str = "float32", size_mb: int = 64, given: bool = False,
                mlp_mode: str = "pull_push", staleness_mode: str | None = None, bulk_dtype: str = "float32") -> None:
    """Run ``workloads`` on one cluster, printing a JSON line per figure. ``staleness_mode``: None (not
    asked: asynchronous, records as before) or ``--staleness``'s text ("async" or an int >= 0); when
    given, the MLP records carry ``"staleness"`` (its label), so side-by-side modes are told apart."""
    staleness = None if staleness_mode is None else parse_staleness(staleness_mode)
    wire = _transfer_dtype(bulk_dtype)  # fail before starting any process
    if "mlp" in workloads:
        _transfer_dtype(grad_dtype)
    if staleness_mode is not None and set(workloads) != {"mlp"}:
        raise SystemExit("--staleness measures the MLP only: give --workload mlp")
    if staleness is not None and mlp_mode != "pull_push":
        raise SystemExit(f"--mlp-mode {mlp_mode} moves values outside the step barrier; staleness {staleness} "
                         "runs need --mlp-mode pull_push")
    with JaxdistBench(workers=workers, ps=ps, given=given, staleness=staleness) as b:
        common = {"system": "jaxdist", "workers": b.workers, "ps": b.ps, "transport": tensor_transport()}
        if given:
            common["cluster"] = "given"
        if "noop" in workloads:
            b.noop_rate(max(1, noop_closures // 5))  # warm
            emit(**common, workload="noop_closures_per_s", closures=noop_closures,
                 **_runs(lambda: b.noop_rate(noop_closures), repeats))
        if "pull" in workloads or "push" in workloads:
            import optax

            # A narrower push is a gradient: the PS applies it with SGD(1.0), v -= delta.
            var = b.variable(size_mb, None if wire is None else optax.sgd(1.0))
            wire_info = {} if wire is None else {"wire_dtype": bulk_dtype}
            for kind in ("pull", "push"):
                if kind in workloads:
                    b.transfer_rate(kind, var, size_mb, wire_dtype=wire)  # one untimed warm-up run, as tf_workloads.py does
                    op = {"push_op": "assign_add" if wire is None else "apply_gradient(sgd 1.0)"} if kind == "push" else {}
                    emit(**common, workload=f"{kind}_{size_mb}MB_MBps", shards=b.shards, **wire_info, **op,
                         **_runs(lambda kind=kind: b.transfer_rate(kind, var, size_mb, wire_dtype=wire), repeats))
            if given:
                emit(system="jaxdist", kind="transport", **b.transports())
        if "mlp" in workloads or "mlp_phases" in workloads:
            b.mlp_setup(grad_dtype, pull_dtype, mlp_mode)
        if "mlp" in workloads:
            extra = {} if pull_dtype == "float32" else {"pull_dtype": pull_dtype}
            if mlp_mode != "pull_push":
                extra["mlp_mode"] = mlp_mode
            if staleness_mode is not None:
                extra["staleness"] = staleness_label(staleness)
            before, loss0 = b.applied_steps(), b.mlp_loss_now()
            figures = _runs(lambda: b.mlp_rate(mlp_steps), repeats, 2)
            after = b.applied_steps()
            extra.update(loss_before=round(loss0, 4), loss_after=round(b.mlp_loss_now(), 4))
            if before is not None and after is not None:
                # Under staleness=0 an optimizer step is the mean of one step from every worker.
                extra["applied_steps"] = after - before
            emit(**common, workload="mlp_steps_per_s", batch=BATCH, steps=mlp_steps, grad_dtype=grad_dtype, **extra,
                 **figures)
            if given and staleness_mode is not None:  # a staleness run is MLP only: say how its tensors moved
                emit(system="jaxdist", kind="transport", **b.transports())
        if "mlp_phases" in workloads:
            runs = [b.mlp_phases(mlp_steps) for _ in range(repeats)]
            best = sorted(runs, key=lambda r: r["steps_per_s"])[len(runs) // 2]  # the median run by steps/s
            emit(**common, workload="mlp_phase_ms", batch=BATCH, steps=mlp_steps, mlp_mode=mlp_mode, **best, runs=runs)
            if given and "pull" not in workloads and "push" not in workloads:
                emit(system="jaxdist", kind="transport", **b.transports())


def _capture(fn: Any, *args: Any) -> tuple[Any, list[dict[str, Any]]]:
    """Call a bench_ps function, capturing the JSON lines it prints (re-emitted in this script's schema)."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        result = fn(*args)
    lines = [json.loads(line) for line in buf.getvalue().splitlines() if line.startswith("{")]
    return result, lines


def run_references(workloads: list[str], repeats: int, mlp_steps: int) -> None:
    if "raw" in workloads:
        _, lines = _capture(bench_ps.bench_raw_grpc, repeats)
        _, tcp_lines = _capture(bench_ps.bench_raw_tcp, repeats)
        for rec in lines + tcp_lines:
            emit(system="reference", workload=rec.pop("workload"), **rec)
    if "plain_jax" in workloads:
        _, lines = _capture(bench_ps.bench_plain_jax, repeats, mlp_steps)
        for rec in lines:
            emit(system="reference", workload=rec.pop("workload"), batch=BATCH, steps=mlp_steps, **rec)


def expand(workload: str) -> list[str]:
    if workload == "all":
        return list(JAXDIST_WORKLOADS)
    if workload == "references":
        return list(REFERENCE_WORKLOADS)
    return [workload]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=WORKLOAD_CHOICES, default="all")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=None, help="worker tasks (default 2; not with --given-cluster)")
    ap.add_argument("--ps", type=int, default=None,
                    help="PS tasks, the 64 MB variable has one shard per PS (default 2; not with --given-cluster)")
    ap.add_argument("--mlp-steps", type=int, default=200)
    ap.add_argument("--noop-closures", type=int, default=5000, help="closures per no-op run")
    ap.add_argument("--grad-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype the MLP's gradients travel in (bfloat16 needs apply_gradients(transfer_dtype=))")
    ap.add_argument("--pull-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype the MLP's parameters are pulled in (bfloat16: mixed precision, jaxdist.pull(dtype=))")
    ap.add_argument("--mlp-mode", choices=MLP_MODES, default="pull_push",
                    help="how the MLP step moves parameters: pull_push (default), prefetch (the next pull overlaps "
                         "this step: jaxdist.pull(prefetch_next=True), values up to one own step stale) or fused "
                         "(one push-then-pull round trip per step: jaxdist.push_pull)")
    ap.add_argument("--staleness", default=None,
                    help="ParameterServerStrategy(staleness=): async or an int >= 0 (0: synchronous steps, each the "
                         "mean of every worker's gradient); MLP only (--workload mlp, --mlp-mode pull_push); the MLP "
                         "record then carries it (and the optimizer steps applied)")
    ap.add_argument("--size-mb", type=int, default=64, help="MB of the pull/push variable (workload names follow)")
    ap.add_argument("--bulk-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype the pull/push variable's bytes travel in (bfloat16: pull(dtype=), a bfloat16 gradient "
                         "push; see the module docstring)")
    ap.add_argument("--given-cluster", action="store_true",
                    help="coordinate the running cluster jaxdist.cluster_resolver.detect() finds (JAXDIST_CLUSTER + "
                         "JAXDIST_TOKEN, TF_CONFIG, Slurm) instead of starting a LocalCluster; its task counts are "
                         "the cluster's, so --workers/--ps are refused")
    args = ap.parse_args(argv)
    if args.given_cluster and (args.workers is not None or args.ps is not None):
        ap.error("--workers/--ps size a LocalCluster; with --given-cluster the counts are the given cluster's")
    workers = 2 if args.workers is None else args.workers
    ps = 2 if args.ps is None else args.ps
    if args.staleness is not None:
        try:
            parse_staleness(args.staleness)
        except ValueError as e:
            ap.error(str(e))

    import jax

    import jaxdist

    workloads = expand(args.workload)
    emit(system="jaxdist", jaxdist_version=jaxdist.__version__, jax_version=jax.__version__,
         python=sys.version.split()[0], cpus=os.cpu_count(), machine=os.uname().nodename,
         transfer_dtype_supported=transfer_dtype_supported())
    try:
        jd = [w for w in workloads if w in JAXDIST_WORKLOADS or w in PROFILE_WORKLOADS]
        if jd:
            run_jaxdist(jd, args.repeats, workers, ps, args.mlp_steps, args.noop_closures, args.grad_dtype,
                        args.pull_dtype, size_mb=args.size_mb, given=args.given_cluster, mlp_mode=args.mlp_mode,
                        staleness_mode=args.staleness, bulk_dtype=args.bulk_dtype)
        refs = [w for w in workloads if w in REFERENCE_WORKLOADS]
        if refs:
            run_references(refs, args.repeats, args.mlp_steps)
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
            return 2
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
