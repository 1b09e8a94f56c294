"""Checkpoint save / restore throughput; prints JSON lines.

A 1 GiB model (4 float32 variables of 256 MiB, SGD, so no optimizer state) on
2 PS processes: ``Checkpoint.save`` (every PS writes its own .npz, fsynced)
and ``Checkpoint.restore`` (every PS reads its pieces back), MB/s over the
whole model. Usage: python bench/bench_checkpoint.py [--dir /tmp/x] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time

import numpy as np

import jaxdist


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--mib", type=int, default=1024)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="jaxdist-ckpt-bench-")
    per_var = args.mib // 4 * (1 << 20) // 4  # float32 elements per variable
    with jaxdist.LocalCluster(num_workers=1, num_ps=2, ps_args=["--max-variable-mb", str(args.mib)]) as cluster:
        strategy = jaxdist.ParameterServerStrategy(cluster.cluster_resolver())
        with strategy.scope():
            for i in range(4):
                jaxdist.create_variable(initializer=lambda s, d, o: np.ones(s, d), shape=(per_var,), dtype="float32", name=f"v{i}")
        ckpt = jaxdist.Checkpoint(strategy)
        mb = 4 * per_var * 4 / 2**20
        saves, restores = [], []
        for r in range(args.repeats):
            path = f"{root}/ckpt-{r}"
            t = time.perf_counter()
            ckpt.write(path)
            saves.append(mb / (time.perf_counter() - t))
            t = time.perf_counter()
            ckpt.restore(path)
            restores.append(mb / (time.perf_counter() - t))
            shutil.rmtree(path)
        for name, vals in (("checkpoint_save_MBps", saves), ("checkpoint_restore_MBps", restores)):
            print(json.dumps({"workload": name, "model_MiB": round(mb), "ps": 2, "median": round(statistics.median(vals), 1),
                              "runs": [round(v, 1) for v in vals]}), flush=True)
        strategy.close()
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
