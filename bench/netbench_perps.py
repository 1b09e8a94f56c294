"""Per-PS links in parallel, on the emulated cluster of ``bench/netbench.py`` (root only).

Each PS task's link is limited to RATE (default 1gbit) and both workers' links to 4x RATE, so a
worker's own link is not the limit. One worker (one closure) then pulls and pushes (``assign_add``)
a 64 MB float32 variable (a) in 2 shards, one per PS, and (b) whole on PS 0: 3 timed transfers each
after a warm one, twice, alternating. If a worker's calls to the 2 PS run at once, (a) moves at
about twice one PS link and (b) at one; if they ran one after the other, both would run at one.

Output: JSON lines (``"kind": "per_ps"``) on stdout: MB/s of each pull and push, the bare-stream
rate of one PS link (ps0 -> w0 and back, from netbench's ``measure_link``) and the ratio of (a) to
(b). Usage: sudo python bench/netbench_perps.py [--rate 1gbit] [--tag TAG]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import netbench as nb  # noqa: E402


def coordinator() -> None:
    """The coordinator script, run in the co namespace against the started cluster."""
    import numpy as np

    import jaxdist
    from jaxdist_workloads import MB, JaxdistBench, _make_push_closure

    with JaxdistBench(given=True) as b:
        two = b.variable(64)  # 2 shards, one per PS
        with b.strategy.colocated_on(0), b.strategy.scope():
            one = jaxdist.create_variable(np.zeros(64 * MB // 4, np.float32), name="one_ps")
        for rnd in (1, 2):
            for name, var in (("two_ps", two), ("one_ps", one)):
                pull_s = float(np.median(b.pull_times(var, 3)))
                rv = b.coord.schedule(_make_push_closure(var, 64 * MB // 4, 3))
                b.coord.join()
                push_s = rv.fetch() / 3
                print(json.dumps({"round": rnd, "variable": name, "pull_MBps": round(64 / pull_s, 1),
                                  "push_MBps": round(64 / push_s, 1)}), flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", default="1gbit", help="each PS task's link (the workers' links get 4x)")
    ap.add_argument("--tag", default=None)
    ap.add_argument("--coordinator", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.coordinator:
        coordinator()
        return 0
    why = nb.unavailable()
    if why:
        print(json.dumps({"kind": "skipped", "reason": why}), flush=True)
        return 0
    bits = nb.parse_rate(args.rate)
    fast = int(4 * bits)
    lab = nb.Lab(bits, tag=args.tag).build()
    logdir = tempfile.mkdtemp(prefix="netbench_perps_")
    try:
        link = nb.measure_link(lab, sys.executable, 64, 47000, logdir)  # before the workers' links are widened
        for w in nb.WORKER_HOSTS:
            for ns, dev in ((lab.ns(w), lab.dev(w)), (lab.ns("sw"), lab.dev(w)[:-1])):
                subprocess.run(["tc", "-n", ns, "qdisc", "change", "dev", dev, "root", "tbf", "rate", f"{fast}bit",
                                "burst", str(nb.default_burst(fast)), "latency", lab.latency], check=True)
        cluster = nb.Cluster(lab, "jaxdist", sys.executable, logdir, 48000).start()
        try:
            res = nb.run_coordinator(lab, [sys.executable, os.path.abspath(__file__), "--coordinator"],
                                     cluster.coordinator_env, 600)
        finally:
            cluster.stop()
        recs: list[dict[str, Any]] = res["records"]
        for r in recs:
            print(json.dumps({"kind": "per_ps", "ps_link": args.rate, "worker_link_bits": fast, **r}), flush=True)
        if res["rc"]:
            print(res["stderr_tail"][-3000:], file=sys.stderr)
            return 1

        def med(name: str, key: str) -> float:
            return round(statistics.median(r[key] for r in recs if r.get("variable") == name), 1)

        print(json.dumps({"kind": "per_ps_summary", "ps_link": args.rate, "ps_link_down_MBps": link["down_MBps"],
                          "ps_link_up_MBps": link["up_MBps"],
                          **{f"{n}_{k}": med(n, k) for n in ("two_ps", "one_ps") for k in ("pull_MBps", "push_MBps")},
                          "pull_two_over_one": round(med("two_ps", "pull_MBps") / med("one_ps", "pull_MBps"), 2),
                          "push_two_over_one": round(med("two_ps", "push_MBps") / med("one_ps", "push_MBps"), 2),
                          "when": time.strftime("%Y-%m-%dT%H:%M:%S")}), flush=True)
    finally:
        lab.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
