"""The PS's exact-mode row push, per push, in one process: prints JSON lines.

What one PS task does for a row push of ``--push`` distinct ids into its
``--rows`` x ``--dim`` float32 shard when the optimizer is applied in the
exact mode (:meth:`jaxdist.ps_server.optimizer.Optimizer.apply_rows`, with
the parameter and state buffers donated, as the store does once the first
push made them XLA arrays), for each rule of ``--rules``:

- ``keras_adam``: Keras's Adam as the PS applies it
  (``jaxdist.keras.ps_optimizers.to_optax(keras.optimizers.Adam(1e-3))``),
- ``optax_adam``: ``optax.adam(1e-3)``,
- ``keras_sgd_momentum``: Keras's ``SGD(0.01, momentum=0.9)``,

and each variant of ``--variants``:

- ``dense``: the rule unmarked: the rows scattered into a zero gradient of the
  whole shard inside one jitted step, then the dense rule (the path every
  exact-mode push took before :func:`jaxdist.ps_server.optimizer.row_separable`),
- ``separable``: the rule marked :func:`~jaxdist.ps_server.optimizer.row_separable`
  (at every table size): where XLA's zero-gradient step needs no table-sized
  temporary (Keras's Adam, AdamW, Nadam), three steps: the rule on the pushed
  rows, the dense rule with a zero gradient broadcast inside the step (no
  table-sized gradient), the rows written over it; elsewhere (``three_steps``
  false in the result line: optax's Adam, SGD with momentum) the one-step path.

Variants alternate push by push (each keeps its own table and state), after
``--warmup`` untimed pushes each (compilation). Every push's wall time and
process CPU time (all threads) are recorded; one ``kind=result`` line per
(rule, rows, variant) gives the medians, one ``kind=check`` line whether the
variants' tables and states are bit-identical after the run (same pushes),
and each result line carries the load average at its end.

With ``--per-pass K`` each timed call applies K pushes: the separable variant in
one pass over the table (``Optimizer.apply_rows_many``, as the store does for
the row pushes it defers, up to 8 per pass), the dense variant one by one; the
times reported are per push.

Usage: KERAS_BACKEND=jax python bench/exact_rows.py [--rows 5000000] [--dim 16] [--push 4096]
       [--pushes 15] [--per-pass 1] [--rules keras_adam,optax_adam] [--variants dense,separable]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def emit(**kv: Any) -> None:
    print(json.dumps(kv), flush=True)


def make_rule(name: str) -> Any:
    import optax

    if name == "optax_adam":
        return optax.adam(1e-3)
    import keras

    from jaxdist.keras.ps_optimizers import to_optax

    opt = {"keras_adam": lambda: keras.optimizers.Adam(1e-3),
           "keras_sgd_momentum": lambda: keras.optimizers.SGD(0.01, momentum=0.9)}[name]()
    return to_optax(opt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="5000000", help="shard rows; a comma-separated list runs each size")
    ap.add_argument("--dim", type=int, default=16)
    ap.add_argument("--push", type=int, default=4096, help="distinct ids per push")
    ap.add_argument("--dup", type=float, default=0.0, help="fraction of the push's ids that repeat another (0: distinct)")
    ap.add_argument("--pushes", type=int, default=15, help="timed pushes per variant")
    ap.add_argument("--warmup", type=int, default=2, help="untimed pushes per variant first")
    ap.add_argument("--per-pass", type=int, default=1,
                    help="pushes per call: the separable variant applies them in one pass (apply_rows_many), the "
                         "dense one by one; times are per push")
    ap.add_argument("--rules", default="keras_adam,optax_adam")
    ap.add_argument("--variants", default="dense,separable")
    args = ap.parse_args()

    import jax
    import numpy as np
    import optax

    from jaxdist.ps_server.optimizer import Optimizer, row_separable

    emit(kind="setup", jax=jax.__version__, cpus=os.cpu_count(), xla_flags=os.environ.get("XLA_FLAGS", ""),
         dim=args.dim, push=args.push, dup=args.dup, pushes=args.pushes)
    variants = args.variants.split(",")
    for rule_name in args.rules.split(","):
        rule = make_rule(rule_name)
        plain = optax.GradientTransformation(rule.init, rule.update)  # unmarked, whatever make_rule returned
        for rows in (int(r) for r in args.rows.split(",")):
            rng = np.random.default_rng(0)
            table = rng.normal(scale=0.05, size=(rows, args.dim)).astype(np.float32)
            # separable_min_size=0: the three-step path at every size (the default picks by size)
            opts = {"dense": Optimizer(plain), "separable": Optimizer(row_separable(plain), separable_min_size=0)}
            live: dict[str, Any] = {}
            for v in variants:
                opt = opts[v]
                live[v] = [table.copy(), opt.init(table)]
            del table
            times: dict[str, list[float]] = {v: [] for v in variants}
            cpus: dict[str, list[float]] = {v: [] for v in variants}
            in_place: dict[str, list[bool]] = {v: [] for v in variants}
            k = args.per_pass
            for i in range(args.warmup + args.pushes):
                group = []
                for _ in range(k):
                    n_unique = args.push - int(args.push * args.dup)
                    ids = rng.choice(rows, size=n_unique, replace=False).astype(np.int64)
                    if n_unique < args.push:
                        ids = np.concatenate([ids, rng.choice(ids, size=args.push - n_unique)])
                        rng.shuffle(ids)
                    group.append((ids, rng.normal(scale=0.1, size=(args.push, args.dim)).astype(np.float32)))
                for v in variants:
                    param, state = live[v]
                    donate = isinstance(param, jax.Array)  # the store donates once the value is an XLA array
                    before = param.unsafe_buffer_pointer() if donate else None
                    if donate:
                        live[v][0] = None  # no reference left but the call's (as the store drops its view)
                    w0, c0 = time.perf_counter(), time.process_time()
                    # No numpy view of a result is kept: XLA copies a donated buffer that one still points at.
                    if v == "separable":
                        new_param, new_state = opts[v].apply_rows_many(param, state, group, donate=donate)[1:]
                    else:
                        for ids, grad in group:
                            param, state = opts[v].apply_rows(param, state, ids, grad, donate=donate)[1:]
                        new_param, new_state = param, state
                    jax.block_until_ready((new_param, new_state))
                    w1, c1 = time.perf_counter(), time.process_time()
                    del param
                    live[v] = [new_param, new_state]
                    if i >= args.warmup:
                        times[v].append((w1 - w0) * 1e3 / k)
                        cpus[v].append((c1 - c0) * 1e3 / k)
                        in_place[v].append(before == new_param.unsafe_buffer_pointer())
            for v in variants:
                emit(kind="result", rule=rule_name, rows=rows, dim=args.dim, push=args.push, variant=v, per_pass=k,
                     median_ms=round(statistics.median(times[v]), 2), min_ms=round(min(times[v]), 2),
                     max_ms=round(max(times[v]), 2), median_cpu_ms=round(statistics.median(cpus[v]), 2),
                     param_in_place=all(in_place[v]), three_steps=opts[v]._row_step._cache_size() == 0,
                     pushes=len(times[v]), load_average=round(os.getloadavg()[0], 2))
            if len(variants) > 1:
                ref = variants[0]
                leaves = {v: [np.asarray(x) for x in jax.tree.leaves(live[v])] for v in variants}
                for v in variants[1:]:
                    same = all(np.array_equal(a, b) for a, b in zip(leaves[ref], leaves[v]))
                    emit(kind="check", rule=rule_name, rows=rows, variants=[ref, v], bit_identical=same)
            del live, leaves


if __name__ == "__main__":
    main()
