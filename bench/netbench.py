"""TF ParameterServerStrategy vs jaxdist on an emulated cluster: every task on its own host behind a rate-limited link.

Root only (network namespaces, veth links, tc); without root or without ``ip netns`` / tbf it prints
one ``{"kind": "skipped", "reason": ...}`` line and exits 0.

Topology, built once per rate and removed afterwards (names carry a random tag, ``nb<6 hex>``, so
runs never collide; the root namespace gets no address and sends nothing):

    ns <tag>-sw: bridge br0 -- veth --> ns <tag>-co  (10.77.X.10)  coordinator script (TF chief / jaxdist coordinator)
                            -- veth --> ns <tag>-ps0 (10.77.X.2)   TF ps:0 server     / jaxdist ps --task-index 0
                            -- veth --> ns <tag>-ps1 (10.77.X.3)   TF ps:1 server     / jaxdist ps --task-index 1
                            -- veth --> ns <tag>-w0  (10.77.X.4)   TF worker:0 server / jaxdist worker --task-index 0
                            -- veth --> ns <tag>-w1  (10.77.X.5)   TF worker:1 server / jaxdist worker --task-index 1

Each host's link is its veth pair; both ends get ``tc qdisc add dev ... root tbf rate R burst B
latency L`` (the host end limits what the host sends, the switch end what it receives), so each
host has a full-duplex link of rate R, like a NIC on a switch: a worker pulling from 2 PS at once
shares its one downlink, a PS serving 2 workers shares its one uplink. MTU stays 1500.

tbf parameters (defaults; --burst / --latency override them):
  burst = max(64 KiB, R x 1 ms). At least 64 KiB so that a whole TSO/GSO super-packet (veth hands
          tbf up to 64 KiB at once) fits the bucket and tbf never has to segment it (segmenting
          costs CPU on this 2-core machine); R x 1 ms so that at 5 Gbit/s every timer wake-up can
          release a useful amount (a small bucket at a high rate caps the rate at bucket / wake-up
          interval: 256 KiB at 5 Gbit/s gave 4.51 Gbit/s, 640 KiB 4.79). The overshoot a burst
          allows is at most 1 ms of traffic. (1 Gbit/s: 125,000 B; 5 Gbit/s: 625,000 B.)
  latency = 20 ms: tbf queues up to R x 20 ms + burst bytes (2.5 MB at 1 Gbit/s). With 5 ms the
          fan-in of two senders into one downlink (a worker pulling from 2 PS at once) overflowed
          the queue: hundreds of drops per run and a pull between 0.75 and 0.96 of the link from run
          to run; with 20 ms no drop at 1 or 5 Gbit/s (each run records the qdiscs' drop count), and
          a single TCP stream needs no deeper queue (no propagation delay is added: netem is not
          available here). The cost: a small RPC queued behind bulk data in a full queue waits up
          to 20 ms, as behind a deep-buffered switch port.
Measured on this machine with one Python TCP stream (64 MB, 4 MB socket buffers): 1 Gbit/s -> 0.957
Gbit/s, 5 Gbit/s -> 4.69-4.79 Gbit/s, i.e. ~95.6% of the configured rate: exactly the share of
payload in a 1514-byte frame (1448 TCP payload bytes), since tbf counts whole Ethernet frames.

Per rate and round r = 1..--rounds:
  link   the link's own rate: one bare TCP stream between the ps0 and w0 namespaces (a Python
         ``sendall`` / ``recv_into`` pair with 4 MB socket buffers, as jaxdist's data plane asks),
         --link-mb MB (default --size-mb) down (ps0 -> w0) and up (w0 -> ps0), 3 transfers each
         after a warm one                              -> down_MBps, up_MBps
         then two such streams at once (ps0 <-> w0 and ps1 <-> w1, timed parts started together):
         what the emulation carries on 2 lanes at a time, since this machine's CPUs forward every
         byte                                          -> pair_down_MBps, pair_up_MBps
  tf     4 ``tf.distribute.Server`` processes (one per ps/worker namespace, real TF_CONFIG) and
         ``bench/tf_workloads.py --cluster-json`` as the chief in the co namespace
  jaxdist  ``jaxdist ps`` x2 / ``jaxdist worker`` x2 started with ``ip netns exec``, and
         ``bench/jaxdist_workloads.py --given-cluster`` in the co namespace with JAXDIST_CLUSTER /
         JAXDIST_TOKEN (as ``jaxdist launch`` exports them; the script finds them with
         ``jaxdist.cluster_resolver.detect()``)
TF goes first in odd rounds and jaxdist in even ones; every run starts fresh task processes. The
four workloads are compare_tf.py's (no-op closures/s, 64 MB pull and push MB/s, MLP steps/s).

Same-host shared memory is off: namespaces split the network, not the file system, so a PS in
another namespace can still open a client's /dev/shm region and jaxdist would move tensors through
memory instead of the link (measured with --allow-shm at 1 Gbit/s: the workers' and the coordinator's
clients all reported "shm" and a 16 MB pull ran at 6,469 MB/s, 28x what the links can carry).
Every jaxdist process runs with JAXDIST_SHM=0, and the coordinator script reports (one
``"kind": "transport"`` line per run, asked from the workers' own PS clients) what each worker and
the coordinator really used; a run that used anything but the data plane's TCP socket is flagged.

Output: JSON lines on stdout and in --out (default bench/results/netbench.jsonl): a config line, per
round and rate the link and workload records, per rate one ``"kind": "link"`` and four
``"kind": "summary"`` lines (medians over rounds, jaxdist/TF, each as a fraction of the link:
pull/push MB/s over min(workers, ps) x the bare stream, since 2 workers pulling from 2 PS use two
downlinks at once (the link rate measured in the same run), and over the two-stream figure; MLP steps/s over the link-bound steps/s: min(workers, ps) x stream / MLP
parameter MB, the rate at which the links could carry one pull and one push of the parameters per
step if they overlapped perfectly; and the targets (TARGETS): at 1 Gbit/s MLP >= 2x TF and pull/push
>= 0.9 of the link, at 5 Gbit/s MLP, pull and push >= 1.5x TF); a short table on stderr.

--profile [RATE] (default 1gbit) instead runs, on that rate, each of pull, push and MLP alone per
system twice, with --repeats-per-run 1 and 2, and reports the difference, i.e. one timed run:
bytes each host sent and received on its link (the veth counters: they count GSO super-packets, so
headers once per up to 64 KiB, a little less than the frames tbf meters), CPU seconds of every task
process (from /proc/<pid>/stat), of the coordinator (its rusage) and of the whole machine (/proc/stat,
which includes the kernel's forwarding and other users' jobs), normalised per MB of payload
(pull/push) or per step (MLP); wall ms per unit is 1 / the run's figure (all workers together). Plus
jaxdist's MLP step timed phase by phase inside the closures (``jaxdist_workloads.py --workload
mlp_phases``). Lines ``"kind": "profile"``; CPU differences of small runs are within the 10 ms tick.

--mlp-mode prefetch|fused (default pull_push, the same step as TF's) runs jaxdist's MLP with
``jaxdist.pull(prefetch_next=True)`` (the next step's pull overlaps this step's compute and push on
the full-duplex links; a step may miss its own previous gradients) or ``jaxdist.push_pull`` (one
round trip per step); --grad-dtype/--pull-dtype bfloat16 send jaxdist's MLP gradients/parameters in
bfloat16 (TF's stay float32); --bulk-dtype bfloat16 moves jaxdist's 64 MB pull/push variable in
bfloat16 (a pull with ``dtype=``, a bfloat16 gradient push; MB/s count the float32 variable; TF's stay
float32). The config line records them.

--staleness-modes async,0[,s...] adds, per round and after the systems' runs, one MLP-only jaxdist
run per mode (``ParameterServerStrategy(staleness=)``; each step a pull and a push, as TF's; the
order alternates by round), and per rate one ``"kind": "staleness_summary"`` line per mode: median
worker steps/s, its ratio to the async mode's runs and to TF's MLP. ``--systems ''`` runs only these.

Every namespace, process and temporary file is removed on exit, Ctrl-C and SIGTERM; after a SIGKILL,
``--cleanup TAG`` removes what is left (the tag is in the ``"kind": "lab"`` line and on stderr).

Usage: python bench/netbench.py [--rounds 3] [--rates 1gbit,5gbit] [--size-mb 64] [--mlp-steps 200]
       [--noop-closures 5000] [--tf-python PATH] [--out bench/results/netbench.jsonl] [--profile [RATE]]
       [--mlp-mode pull_push|prefetch|fused] [--grad-dtype float32|bfloat16] [--pull-dtype float32|bfloat16]
       [--bulk-dtype float32|bfloat16] [--staleness-modes async,0]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import queue
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import compare_tf  # noqa: E402  (find_tf_python, the same TF interpreter lookup)
import tf_workloads  # noqa: E402  (server_command / server_env: the TF server processes; no TF import)
from staleness_option import parse_staleness, staleness_label  # noqa: E402  (no jaxdist import)

TF_SCRIPT = os.path.join(HERE, "tf_workloads.py")
JAXDIST_SCRIPT = os.path.join(HERE, "jaxdist_workloads.py")
DEFAULT_OUT = os.path.join(HERE, "results", "netbench.jsonl")
MB = 1 << 20
#: MLP 784-1024-1024-10 float32 parameters (weights + biases), the bytes one pull or one push moves.
MLP_PARAM_BYTES = 4 * (784 * 1024 + 1024 + 1024 * 1024 + 1024 + 1024 * 10 + 10)
HOSTS = {"co": 10, "ps0": 2, "ps1": 3, "w0": 4, "w1": 5}
PS_HOSTS, WORKER_HOSTS = ("ps0", "ps1"), ("w0", "w1")
START_TIMEOUT_S = 180.0
#: rate (bit/s) -> workload -> (min jaxdist/TF or None, min jaxdist fraction of the link or None): the targets
TARGETS: dict[float, dict[str, tuple[float | None, float | None]]] = {
    1e9: {"pull": (None, 0.9), "push": (None, 0.9), "mlp": (2.0, None)},
    5e9: {"pull": (1.5, None), "push": (1.5, None), "mlp": (1.5, None)},
}
_RATE_UNITS = {"bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


# ------------------------------------------------------------------ small pure helpers
def parse_rate(text: str) -> float:
    """tc's rate syntax in bits: ``1gbit`` -> 1e9 (decimal units, as tc reads them)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(bit|kbit|mbit|gbit|tbit)?\s*", text.lower())
    if not m or float(m.group(1)) <= 0:
        raise ValueError(f"rate {text!r}: give a number and one of {', '.join(_RATE_UNITS)} (e.g. 1gbit, 500mbit)")
    return float(m.group(1)) * _RATE_UNITS[m.group(2) or "bit"]


def default_burst(rate_bits: float) -> int:
    """tbf bucket in bytes: max(64 KiB, 1 ms of the rate) (see the module docstring)."""
    return max(64 * 1024, int(rate_bits / 8 * 1e-3))


def mbps(rate_bits: float) -> float:
    """The configured rate in MB/s (MB = 2**20 bytes, as every figure here)."""
    return rate_bits / 8 / MB


def workload_names(size_mb: int) -> dict[str, str]:
    return {"noop": "noop_closures_per_s", "pull": f"pull_{size_mb}MB_MBps", "push": f"push_{size_mb}MB_MBps",
            "mlp": "mlp_steps_per_s"}


def figure(rec: dict[str, Any]) -> float | None:
    """A record's number, as compare_tf.figure: its median; TF pull/push (any size) the in-closure timing."""
    w = str(rec.get("workload", ""))
    if rec.get("system") == "tf" and w.startswith(("pull_", "push_")) and "median_in_closure" in rec:
        return float(rec["median_in_closure"])
    m = rec.get("median")
    return None if m is None else float(m)


def _med(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def summarize(records: list[dict[str, Any]], rate: str, rate_bits: float, size_mb: int, workers: int,
              ps: int) -> list[dict[str, Any]]:
    """Per rate: one "link" row and one "summary" row per workload, from that rate's raw records."""
    recs = [r for r in records if r.get("rate") == rate]
    down = [float(r["down_MBps"]) for r in recs if r.get("kind") == "link_run" and r.get("down_MBps")]
    up = [float(r["up_MBps"]) for r in recs if r.get("kind") == "link_run" and r.get("up_MBps")]
    pair = {d: [float(r[f"pair_{d}_MBps"]) for r in recs if r.get("kind") == "link_run" and r.get(f"pair_{d}_MBps")]
            for d in ("down", "up")}
    pair_med = {d: _med(v) for d, v in pair.items()}
    down_med, up_med, conf = _med(down), _med(up), mbps(rate_bits)
    lanes = min(workers, ps)
    link = {"kind": "link", "rate": rate, "rate_bits": rate_bits, "configured_MBps": _r(conf, 2),
            "down_MBps": _r(down_med, 2), "up_MBps": _r(up_med, 2), "down_rounds": [round(v, 2) for v in down],
            "up_rounds": [round(v, 2) for v in up], "down_fraction_of_configured": _r(_ratio(down_med, conf)),
            "up_fraction_of_configured": _r(_ratio(up_med, conf)),
            "what": "one bare TCP stream ps0 -> w0 (down) and w0 -> ps0 (up) through two rate-limited links",
            "pair_down_MBps": _r(pair_med["down"], 2), "pair_up_MBps": _r(pair_med["up"], 2),
            "pair_down_rounds": [round(v, 2) for v in pair["down"]], "pair_up_rounds": [round(v, 2) for v in pair["up"]],
            "pair_what": "two bare streams at once (ps0 <-> w0, ps1 <-> w1), together: what the emulation carries on "
                         "2 lanes at a time (this machine's CPUs forward every byte)"}
    transports = sorted({t for r in recs if r.get("kind") == "transport" for t in r.get("used", [])})
    rows: list[dict[str, Any]] = [link]
    for short, name in workload_names(size_mb).items():
        def vals(system: str, name: str = name) -> list[float]:
            out = []
            for r in recs:
                if r.get("system") == system and r.get("workload") == name and "staleness" not in r:
                    v = figure(r)
                    if v is not None:
                        out.append(v)
            return out

        tf_vals, jd_vals = vals("tf"), vals("jaxdist")
        tf_med, jd_med = _med(tf_vals), _med(jd_vals)
        row: dict[str, Any] = {
            "kind": "summary", "rate": rate, "rate_bits": rate_bits, "workload": name,
            "tf_median": _r(tf_med, 2), "jaxdist_median": _r(jd_med, 2), "ratio_jaxdist_to_tf": _r(_ratio(jd_med, tf_med)),
            "tf_rounds": [round(v, 2) for v in tf_vals], "jaxdist_rounds": [round(v, 2) for v in jd_vals],
            "link_MBps": None, "link_bound": None, "tf_fraction_of_link": None, "jaxdist_fraction_of_link": None,
            "jaxdist_transport": ",".join(transports) or None,
        }
        stream = {"pull": down_med, "push": up_med, "mlp": _med([v for v in (down_med, up_med) if v is not None])}.get(short)
        if stream is not None:
            bound = lanes * stream if short != "mlp" else lanes * stream * MB / MLP_PARAM_BYTES
            row.update(link_MBps=_r(stream, 2), link_bound=_r(bound, 2),
                       link_bound_what=(f"{lanes} x the bare stream ({'down' if short == 'pull' else 'up'}): "
                                        f"{lanes} links carry this at once" if short != "mlp" else
                                        f"{lanes} x stream / {MLP_PARAM_BYTES / MB:.2f} MB of parameters: steps/s if "
                                        "each worker's pull and push overlapped perfectly on its full-duplex link"),
                       tf_fraction_of_link=_r(_ratio(tf_med, bound)), jaxdist_fraction_of_link=_r(_ratio(jd_med, bound)))
        if short in ("pull", "push"):
            two = pair_med["down" if short == "pull" else "up"]
            row.update(link_pair_MBps=_r(two, 2), tf_fraction_of_pair=_r(_ratio(tf_med, two)),
                       jaxdist_fraction_of_pair=_r(_ratio(jd_med, two)))
        min_tf, min_link = TARGETS.get(rate_bits, {}).get(short, (None, None))
        checks = []
        if min_tf is not None:
            checks.append(None if row["ratio_jaxdist_to_tf"] is None else row["ratio_jaxdist_to_tf"] >= min_tf)
        if min_link is not None:
            checks.append(None if row["jaxdist_fraction_of_link"] is None else row["jaxdist_fraction_of_link"] >= min_link)
        target = " and ".join(([f"jaxdist >= {min_tf:g}x TF"] if min_tf is not None else [])
                              + ([f"jaxdist >= {min_link:g} of the link"] if min_link is not None else []))
        row.update(target=target or None, target_vs_tf=min_tf, target_fraction_of_link=min_link,
                   met=None if not checks else False if False in checks else None if None in checks else True)
        rows.append(row)
    return rows


def summarize_staleness(records: list[dict[str, Any]], rate: str, modes: list[str]) -> list[dict[str, Any]]:
    """Per rate and ``--staleness-modes`` mode: one "staleness_summary" row, the median MLP steps/s of
    that mode's runs, next to the mode "async" of the same rounds and to TF's MLP (from the main runs)."""
    recs = [r for r in records if r.get("rate") == rate and r.get("workload") == "mlp_steps_per_s"]
    tf = _med([v for r in recs if r.get("system") == "tf" and (v := figure(r)) is not None])
    by_mode = {m: [v for r in recs if r.get("system") == "jaxdist" and r.get("staleness") == m
                   and (v := figure(r)) is not None] for m in modes}
    base = _med(by_mode.get("async", []))
    rows = []
    for m in modes:
        med = _med(by_mode[m])
        applied = [r["applied_steps"] for r in recs if r.get("staleness") == m and "applied_steps" in r]
        rows.append({"kind": "staleness_summary", "rate": rate, "workload": "mlp_steps_per_s", "staleness": m,
                     "mlp_mode": "pull_push", "jaxdist_median": _r(med, 2),
                     "jaxdist_rounds": [round(v, 2) for v in by_mode[m]],
                     "ratio_to_async": _r(_ratio(med, base)), "tf_median": _r(tf, 2), "ratio_to_tf": _r(_ratio(med, tf)),
                     "applied_steps": applied,
                     "what": "worker steps (closures) per second, both workers together; under staleness=0 an "
                             "optimizer step is the mean of one step from each worker"})
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    def f(x: Any, nd: int = 1) -> str:
        return "-" if x is None else f"{x:,.{nd}f}"

    out = []
    for link in (r for r in rows if r["kind"] == "link"):
        rate = link["rate"]
        out.append(f"rate {rate}: configured {f(link['configured_MBps'])} MB/s; bare TCP stream down "
                   f"{f(link['down_MBps'])} MB/s ({f(link['down_fraction_of_configured'], 3)}), up {f(link['up_MBps'])} "
                   f"MB/s ({f(link['up_fraction_of_configured'], 3)}); two streams at once: down "
                   f"{f(link.get('pair_down_MBps'))}, up {f(link.get('pair_up_MBps'))} MB/s")
        head = ["workload", "TF", "jaxdist", "jd/TF", "link bound", "TF/link", "jd/link", "jd/2 streams", "target", "met"]
        lines = [head]
        for r in rows:
            if r["kind"] != "summary" or r["rate"] != rate:
                continue
            lines.append([r["workload"], f(r["tf_median"]), f(r["jaxdist_median"]), f(r["ratio_jaxdist_to_tf"], 2),
                          f(r["link_bound"]), f(r["tf_fraction_of_link"], 2), f(r["jaxdist_fraction_of_link"], 2),
                          f(r.get("jaxdist_fraction_of_pair"), 2),
                          r["target"] or "-", {True: "yes", False: "NO", None: "?" if r["target"] else "-"}[r["met"]]])
        widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
        out += ["  " + "  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines]
        used = {r.get("jaxdist_transport") for r in rows if r["kind"] == "summary" and r["rate"] == rate} - {None}
        if used:
            out.append(f"  jaxdist moved tensors over: {', '.join(sorted(used))}")
        for r in rows:
            if r["kind"] == "staleness_summary" and r["rate"] == rate:
                out.append(f"  jaxdist MLP staleness={r['staleness']}: {f(r['jaxdist_median'], 2)} steps/s "
                           f"({f(r['ratio_to_async'], 2)}x async, {f(r['ratio_to_tf'], 2)}x TF)")
    return "\n".join(out)


# ------------------------------------------------------------------ environment checks
def _run(argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def unavailable() -> str | None:
    """Why this machine cannot build the emulated cluster, or None when it can (probed for real)."""
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "the `ip` and `tc` commands (iproute2) are needed and not installed"
    if os.geteuid() != 0:
        return "network namespaces, veth links and tc need root (CAP_SYS_ADMIN/CAP_NET_ADMIN); run as root"
    probe = f"nbprobe{secrets.token_hex(3)}"
    r = _run(["ip", "netns", "add", probe])
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()!r} (exit {r.returncode})"
    try:
        r = _run(["ip", "-n", probe, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        if r.returncode != 0:
            return f"veth pairs are not permitted here: {r.stderr.strip()!r} (exit {r.returncode})"
        r = _run(["tc", "-n", probe, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1gbit", "burst", "125000",
                  "latency", "5ms"])
        if r.returncode != 0:
            return f"the tbf qdisc is not available: {r.stderr.strip()!r} (exit {r.returncode})"
    finally:
        _run(["ip", "netns", "del", probe])
    return None


def _die_with_parent() -> None:  # preexec_fn: the kernel SIGKILLs the child when this process dies
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; the tasks also watch their parent pid
        pass


# ------------------------------------------------------------------ the emulated cluster
class Lab:
    """Namespaces, a bridge and one rate-limited veth link per host; :meth:`close` removes it all
    (and kills whatever still runs in its namespaces)."""

    def __init__(self, rate_bits: float, burst: int | str | None = None, latency: str = "20ms",
                 tag: str | None = None) -> None:
        self.tag = tag or f"nb{secrets.token_hex(3)}"
        if not re.fullmatch(r"[a-z0-9]{1,9}", self.tag):
            raise ValueError(f"tag {self.tag!r}: 1-9 lowercase letters/digits (interface names are <= 15 characters)")
        self.subnet = secrets.randbelow(250) + 1
        self.rate_bits = rate_bits
        self.burst = default_burst(rate_bits) if burst is None else burst
        self.latency = latency
        self.namespaces: list[str] = []
        self.links: list[str] = []

    def ns(self, short: str) -> str:
        return f"{self.tag}-{short}"

    def ip(self, short: str) -> str:
        return f"10.77.{self.subnet}.{HOSTS[short]}"

    def dev(self, short: str) -> str:
        """The host-side end of ``short``'s link (in its namespace); ``dev(short)[:-1]`` is the switch side."""
        return f"{self.tag}{short}p"

    @staticmethod
    def _ip(*args: str) -> None:
        r = _run(["ip", *args])
        if r.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")

    def _tbf(self, ns: str, dev: str) -> None:
        argv = ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{int(self.rate_bits)}bit",
                "burst", str(self.burst), "latency", self.latency]
        r = _run(argv)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")

    def _add_ns(self, short: str) -> str:
        name = self.ns(short)
        self._ip("netns", "add", name)
        self.namespaces.append(name)
        self._ip("-n", name, "link", "set", "lo", "up")
        return name

    def build(self) -> Lab:
        try:
            sw = self._add_ns("sw")
            self._ip("-n", sw, "link", "add", "br0", "type", "bridge")
            self._ip("-n", sw, "link", "set", "br0", "up")
            for short in HOSTS:
                node = self._add_ns(short)
                host_end = self.dev(short)
                sw_end = host_end[:-1]
                self._ip("link", "add", sw_end, "type", "veth", "peer", "name", host_end)
                self.links += [sw_end, host_end]
                self._ip("link", "set", sw_end, "netns", sw)
                self._ip("link", "set", host_end, "netns", node)
                self._ip("-n", sw, "link", "set", sw_end, "master", "br0")
                self._ip("-n", sw, "link", "set", sw_end, "up")
                self._ip("-n", node, "addr", "add", f"{self.ip(short)}/24", "dev", host_end)
                self._ip("-n", node, "link", "set", host_end, "up")
                self._tbf(node, host_end)  # what the host sends
                self._tbf(sw, sw_end)  # what the host receives
        except BaseException:
            self.close()
            raise
        return self

    def exec_argv(self, short: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns(short), *argv]

    def link_bytes(self) -> dict[str, dict[str, int]]:
        """Per host: bytes its link carried so far, ``tx`` (sent by the host) and ``rx`` (received)."""
        out = {}
        for short in HOSTS:
            r = _run(["ip", "-n", self.ns(short), "-s", "-j", "link", "show", "dev", self.dev(short)])
            st = json.loads(r.stdout)[0]["stats64"]
            out[short] = {"tx": int(st["tx"]["bytes"]), "rx": int(st["rx"]["bytes"])}
        return out

    def qdisc_drops(self) -> int:
        total = 0
        for short in HOSTS:
            for ns, dev in ((self.ns(short), self.dev(short)), (self.ns("sw"), self.dev(short)[:-1])):
                r = _run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev])
                with contextlib.suppress(ValueError, KeyError, IndexError):
                    total += sum(int(q.get("drops", 0)) for q in json.loads(r.stdout))
        return total

    def close(self) -> None:
        for name in reversed(self.namespaces):
            kill_namespace_processes(name)
            _run(["ip", "netns", "del", name])
        for link in self.links:  # only still in the root namespace if moving it failed
            _run(["ip", "link", "del", link])
        self.namespaces, self.links = [], []


def kill_namespace_processes(ns: str) -> None:
    """SIGKILL every process still in namespace ``ns`` (only processes this run put there)."""
    r = _run(["ip", "netns", "pids", ns])
    for pid in r.stdout.split():
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)


def remove_tagged(tag: str) -> list[str]:
    """Remove every namespace named ``<tag>-*`` (and kill what runs in it): the cleanup after a run was killed."""
    gone = []
    for line in _run(["ip", "netns", "list"]).stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if name.startswith(f"{tag}-"):
            kill_namespace_processes(name)
            _run(["ip", "netns", "del", name])
            gone.append(name)
    return gone


class Task:
    """A process in a namespace; its stdout lines arrive on a queue (read by a thread, never blocking)."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: str, stdin: bool = False) -> None:
        self.name, self.log_path = name, log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=self._log, text=True, env=env,
                                     stdin=subprocess.PIPE if stdin else subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def wait_line(self, pred: Any, deadline: float) -> str:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name} did not start in time; log:\n{self.tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"{self.name} exited ({self.proc.wait()}) during start-up; log:\n{self.tail()}")
            if pred(line):
                return line

    def cpu_seconds(self) -> float | None:
        """utime + stime of the process (all its threads), from /proc/<pid>/stat."""
        try:
            with open(f"/proc/{self.proc.pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None

    def tail(self, n: int = 3000) -> str:
        if not self._log.closed:  # after stop() the file is closed (and complete)
            self._log.flush()
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> int | None:
        """Close stdin (a TF server exits on EOF), wait ``grace`` s (a jaxdist task exits when the job ends),
        then SIGTERM, then SIGKILL."""
        if self.proc.stdin:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        for action, wait in ((None, grace), (self.proc.terminate, 5.0), (self.proc.kill, 5.0)):
            if action is not None:
                with contextlib.suppress(ProcessLookupError):
                    action()
            try:
                self.proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        self._log.close()
        return self.proc.returncode


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAXDIST_", "TF_CONFIG"))}
    env.update(JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
    return env


class Cluster:
    """The 4 task processes of one system on the lab's hosts, started fresh for one coordinator run."""

    def __init__(self, lab: Lab, system: str, python: str, logdir: str, port: int, shm: bool = False) -> None:
        self.lab, self.system, self.python, self.logdir, self.port = lab, system, python, logdir, port
        self.shm = shm
        self.tasks: dict[str, Task] = {}
        self.coordinator_env: dict[str, str] = {}
        self.coordinator_args: list[str] = []

    def start(self) -> Cluster:
        try:
            self._start_tf() if self.system == "tf" else self._start_jaxdist()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_tf(self) -> None:
        lab, port = self.lab, self.port
        cluster = {"chief": [f"{lab.ip('co')}:{port}"], "worker": [f"{lab.ip(h)}:{port}" for h in WORKER_HOSTS],
                   "ps": [f"{lab.ip(h)}:{port}" for h in PS_HOSTS]}
        base = _clean_env()
        for job, hosts in (("ps", PS_HOSTS), ("worker", WORKER_HOSTS)):
            for i, short in enumerate(hosts):
                env = tf_workloads.server_env(base, cluster, job, i, os.getpid())
                self.tasks[short] = Task(f"tf {job}:{i}", lab.exec_argv(short, tf_workloads.server_command(self.python)),
                                         env, os.path.join(self.logdir, f"tf-{short}-{port}.log"), stdin=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        for t in self.tasks.values():
            t.wait_line(lambda line: line.strip() == "READY", deadline)
        self.coordinator_env = base
        self.coordinator_args = ["--cluster-json", json.dumps(cluster)]

    def _start_jaxdist(self) -> None:
        lab = self.lab
        token = secrets.token_hex(16)
        exe = os.path.join(os.path.dirname(self.python), "jaxdist")
        cli = [exe] if os.path.exists(exe) else [self.python, "-m", "jaxdist.cli"]
        env = _clean_env()
        env.update(JAXDIST_TOKEN=token, JAXDIST_PARENT_PID=str(os.getpid()))
        if not self.shm:
            env["JAXDIST_SHM"] = "0"
        for role, hosts in (("ps", PS_HOSTS), ("worker", WORKER_HOSTS)):
            for i, short in enumerate(hosts):
                argv = [*cli, role, "--host", lab.ip(short), "--port", "0", "--task-index", str(i)]
                self.tasks[short] = Task(f"jaxdist {role}:{i}", lab.exec_argv(short, argv), env,
                                         os.path.join(self.logdir, f"jaxdist-{short}-{self.port}.log"))
        deadline = time.monotonic() + START_TIMEOUT_S
        addr = {}
        for short, t in self.tasks.items():
            line = t.wait_line(lambda line: line.startswith("JAXDIST_READY"), deadline)
            port = re.search(r"\bport=(\d+)", line)
            assert port is not None, line
            addr[short] = f"{lab.ip(short)}:{port.group(1)}"
        cluster = {"ps": [addr[h] for h in PS_HOSTS], "worker": [addr[h] for h in WORKER_HOSTS]}
        self.coordinator_env = {k: v for k, v in env.items() if k != "JAXDIST_PARENT_PID"}
        self.coordinator_env.update(JAXDIST_CLUSTER=json.dumps({"cluster": cluster, "task": {}}))
        self.coordinator_args = ["--given-cluster"]

    def cpu(self) -> dict[str, float | None]:
        return {short: t.cpu_seconds() for short, t in self.tasks.items()}

    def stop(self) -> dict[str, int | None]:
        # jaxdist tasks end with the job (the coordinator's shutdown); TF servers when their stdin closes
        return {short: t.stop(grace=10.0 if self.system == "jaxdist" else 3.0) for short, t in self.tasks.items()}


def system_cpu() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine so far, from /proc/stat."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    tick = os.sysconf("SC_CLK_TCK")
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    return (sum(vals[:8]) - idle) / tick, sum(vals[:8]) / tick


def run_coordinator(lab: Lab, argv: list[str], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run a coordinator script in the co namespace; its JSON records, exit code, stderr tail, wall and CPU seconds."""
    proc = subprocess.Popen(lab.exec_argv("co", argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=REPO, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
    out: list[str] = []
    err: list[str] = []
    readers = [threading.Thread(target=lambda s=s, b=b: b.extend(s), daemon=True)
               for s, b in ((proc.stdout, out), (proc.stderr, err))]
    for t in readers:
        t.start()
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        time.sleep(10)
        with contextlib.suppress(ProcessLookupError):
            proc.kill()

    timer = threading.Timer(timeout, kill)
    timer.daemon = True
    timer.start()
    t0 = time.monotonic()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - t0
    timer.cancel()
    proc.returncode = os.waitstatus_to_exitcode(status)
    for t in readers:
        t.join(10)
    records = []
    for line in out:
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                records.append(json.loads(line))
    tail = "".join(err).strip().splitlines()[-25:]
    rc = 124 if timed_out.is_set() else proc.returncode
    if timed_out.is_set():
        tail.append(f"[netbench] timed out after {timeout:.0f}s")
    return {"records": records, "rc": rc, "stderr_tail": "\n".join(tail), "wall_s": wall,
            "cpu_s": usage.ru_utime + usage.ru_stime}


# ------------------------------------------------------------------ the link's own rate
_LINK_SERVER = textwrap.dedent(
    """
    import socket, sys
    host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    BUF = 4 << 20
    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    for o in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        ls.setsockopt(socket.SOL_SOCKET, o, BUF)
    ls.bind((host, port)); ls.listen()
    print("READY", flush=True)
    ls.settimeout(120)
    c, _ = ls.accept()
    c.settimeout(300)
    c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, mv = b"\\0" * n, memoryview(bytearray(n))
    while True:
        cmd = c.recv(1)
        if not cmd:
            break
        if cmd == b"d":
            c.sendall(payload)
        else:
            got = 0
            while got < n:
                got += c.recv_into(mv[got:], n - got)
            c.sendall(b"k")
    """
)

_LINK_CLIENT = textwrap.dedent(
    """
    import json, socket, sys, time
    host, port, n, transfers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    modes, start_at = sys.argv[5].split(","), float(sys.argv[6])  # start_at: time.time() to begin the timed part
    s = socket.socket()
    for o in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        s.setsockopt(socket.SOL_SOCKET, o, 4 << 20)
    s.settimeout(300)
    s.connect((host, port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, mv = b"\\0" * n, memoryview(bytearray(n))
    def down():
        s.sendall(b"d")
        got = 0
        while got < n:
            got += s.recv_into(mv[got:], n - got)
    def up():
        s.sendall(b"u"); s.sendall(payload); s.recv(1)
    fns = {"down": down, "up": up}
    for m in modes:
        fns[m]()  # warm
    time.sleep(max(0.0, start_at - time.time()))  # clients run in pairs start their timed transfers together
    out = {}
    for m in modes:
        t, w = time.perf_counter(), time.time()
        for _ in range(transfers):
            fns[m]()
        out[m] = {"MBps": transfers * n / (1 << 20) / (time.perf_counter() - t), "start": w, "end": time.time()}
    s.close()
    print(json.dumps(out), flush=True)
    """
)


def _streams(lab: Lab, python: str, pairs: list[tuple[str, str]], n: int, port: int, logdir: str, transfers: int,
             modes: list[str], start_delay: float) -> list[dict[str, Any]]:
    """Bare TCP streams, one per (server host, client host) pair, all starting each direction at the same moment."""
    servers = [Task(f"link server {srv}", lab.exec_argv(srv, [python, "-c", _LINK_SERVER, lab.ip(srv), str(port), str(n)]),
                    _clean_env(), os.path.join(logdir, f"link-server-{srv}-{port}.log")) for srv, _ in pairs]
    try:
        for t in servers:
            t.wait_line(lambda line: line.strip() == "READY", time.monotonic() + 60)
        start_at = str(time.time() + start_delay)
        clients = [subprocess.Popen(lab.exec_argv(cli, [python, "-c", _LINK_CLIENT, lab.ip(srv), str(port), str(n),
                                                        str(transfers), ",".join(modes), start_at]),
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_clean_env(),
                                    preexec_fn=_die_with_parent) for srv, cli in pairs]
        results = []
        for c in clients:
            try:
                out, err = c.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                c.kill()
                out, err = c.communicate()
            if c.returncode != 0:
                raise RuntimeError(f"link client failed ({c.returncode}): {err.strip()[-2000:]}")
            results.append(json.loads(out.strip().splitlines()[-1]))
        return results
    finally:
        for t in servers:
            t.stop(grace=10)


def measure_link(lab: Lab, python: str, size_mb: int, port: int, logdir: str, transfers: int = 3) -> dict[str, Any]:
    """The links' own rate, bare TCP: one stream ps0 -> w0 (down) and w0 -> ps0 (up) through the two hosts' links;
    then two at once (ps0 <-> w0 and ps1 <-> w1, started together): what the emulation carries on 2 lanes at a time."""
    n = size_mb * MB
    one = _streams(lab, python, [("ps0", "w0")], n, port, logdir, transfers, ["down", "up"], 0.0)[0]
    out: dict[str, Any] = {"down_MBps": round(one["down"]["MBps"], 2), "up_MBps": round(one["up"]["MBps"], 2),
                           "size_mb": size_mb, "transfers": transfers}
    delay = 2.0 + 3 * n / (lab.rate_bits / 8)  # past both clients' start-up and warm transfer
    for i, m in enumerate(("down", "up")):
        two = _streams(lab, python, [("ps0", "w0"), ("ps1", "w1")], n, port + 1000 * (i + 1), logdir, transfers, [m], delay)
        span = max(r[m]["end"] for r in two) - min(r[m]["start"] for r in two)
        out[f"pair_{m}_MBps"] = round(len(two) * transfers * n / MB / span, 2)
    return out


# ------------------------------------------------------------------ running
def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Runner:
    """Runs coordinator scripts against fresh clusters on one lab, recording every line."""

    def __init__(self, args: argparse.Namespace, tf_python: str | None, logdir: str) -> None:
        self.args, self.tf_python, self.logdir = args, tf_python, logdir
        self.port = 2200
        self.out: list[dict[str, Any]] = []

    def emit(self, rec: dict[str, Any]) -> None:
        self.out.append(rec)
        print(json.dumps(rec), flush=True)

    def next_port(self) -> int:
        self.port += 1
        return self.port

    def coordinator_argv(self, system: str, workload: str, repeats: int, staleness: str | None = None) -> list[str]:
        """The coordinator script's command line; ``staleness``: a --staleness-modes run (jaxdist's MLP
        with that ``staleness``, each step a pull and a push as TF's, whatever --mlp-mode says)."""
        a = self.args
        common = ["--workload", workload, "--repeats", str(repeats), "--mlp-steps", str(a.mlp_steps),
                  "--noop-closures", str(a.noop_closures), "--size-mb", str(a.size_mb)]
        if system == "tf":
            return [self.tf_python or "", TF_SCRIPT, *common]
        mode = ["--mlp-mode", a.mlp_mode] if staleness is None else ["--mlp-mode", "pull_push", "--staleness", staleness]
        return [a.jaxdist_python, JAXDIST_SCRIPT, *common, *mode, "--grad-dtype", a.grad_dtype, "--pull-dtype", a.pull_dtype,
                "--bulk-dtype", a.bulk_dtype]

    def run_system(self, lab: Lab, system: str, workload: str, repeats: int, tags: dict[str, Any],
                   measure: bool = False, staleness: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
        """Fresh cluster, one coordinator run; (records, counters) with counters when ``measure``."""
        python = self.tf_python if system == "tf" else self.args.jaxdist_python
        assert python is not None
        t = time.monotonic()
        cluster = Cluster(lab, system, python, self.logdir, self.next_port(), shm=self.args.allow_shm)
        try:
            cluster.start()
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            fail = {"kind": "failure", "system": system, **tags, "stage": "cluster start", "error": str(e)[-3000:]}
            self.emit(fail)
            log(f"  {system}: cluster did not start: {str(e)[-1500:]}")
            return [], None
        counters = None
        try:
            before = (lab.link_bytes(), cluster.cpu(), system_cpu(), lab.qdisc_drops()) if measure else None
            res = run_coordinator(lab, self.coordinator_argv(system, workload, repeats, staleness) + cluster.coordinator_args,
                                  cluster.coordinator_env, self.args.timeout)
            if measure and before is not None:
                after = (lab.link_bytes(), cluster.cpu(), system_cpu(), lab.qdisc_drops())
                counters = {
                    "wall_s": res["wall_s"], "coordinator_cpu_s": res["cpu_s"],
                    "link_bytes": {h: {d: after[0][h][d] - before[0][h][d] for d in ("tx", "rx")} for h in HOSTS},
                    "task_cpu_s": {h: (None if after[1][h] is None or before[1][h] is None else after[1][h] - before[1][h])
                                   for h in cluster.tasks},
                    "machine_busy_cpu_s": after[2][0] - before[2][0], "machine_cpu_s": after[2][1] - before[2][1],
                    "qdisc_drops": after[3] - before[3],
                }
        finally:
            exits = cluster.stop()
        recs = res["records"]
        for rec in recs:
            rec.update(tags, run=system)
            if rec.get("kind") == "transport" and rec.get("used") != ["tcp"]:
                rec["warning"] = "jaxdist did not move every tensor over the data plane's TCP socket"
        log(f"  {system}: rc={res['rc']}, {len(recs)} lines, {time.monotonic() - t:.1f}s"
            + (f", task exits {exits}" if system == "jaxdist" and any(v not in (0, None) for v in exits.values()) else ""))
        if res["rc"] != 0:
            self.emit({"kind": "failure", "system": system, **tags, "stage": "coordinator", "rc": res["rc"],
                       "stderr_tail": res["stderr_tail"], "task_logs": {h: t.tail(1500) for h, t in cluster.tasks.items()}})
            log(f"  {system} failed (rc={res['rc']}):\n" + "\n".join("    " + ln for ln in res["stderr_tail"].splitlines()))
        for rec in recs:
            self.emit(rec)
        return recs, counters


def bench_rate(runner: Runner, rate: str, rate_bits: float, args: argparse.Namespace, tag: str | None) -> list[dict[str, Any]]:
    lab = Lab(rate_bits, burst=args.burst, latency=args.latency, tag=tag).build()
    runner.emit({"kind": "lab", "rate": rate, "rate_bits": rate_bits, "tag": lab.tag, "burst_bytes": lab.burst,
                 "latency": lab.latency, "hosts": {h: lab.ip(h) for h in HOSTS}, "mtu": 1500})
    log(f"rate {rate}: namespaces {lab.tag}-*, tbf rate {int(rate_bits)}bit burst {lab.burst} latency {lab.latency}")
    records: list[dict[str, Any]] = []
    try:
        for r in range(1, args.rounds + 1):
            tags = {"rate": rate, "round": r}
            try:
                link = measure_link(lab, args.jaxdist_python, args.link_mb or args.size_mb, runner.next_port(), runner.logdir)
                rec = {"kind": "link_run", **tags, **link}
                records.append(rec)
                runner.emit(rec)
                log(f"[{rate} round {r}/{args.rounds}] link: down {link['down_MBps']:.1f} MB/s, up {link['up_MBps']:.1f} "
                    f"MB/s; two streams at once {link['pair_down_MBps']:.1f} / {link['pair_up_MBps']:.1f} MB/s")
            except Exception as e:  # noqa: BLE001
                runner.emit({"kind": "failure", "system": "link", **tags, "error": str(e)[-2000:]})
                log(f"[{rate} round {r}] link measurement failed: {e}")
            order = ["tf", "jaxdist"] if r % 2 == 1 else ["jaxdist", "tf"]
            for pos, system in enumerate(order):
                if system == "tf" and runner.tf_python is None or system not in args.systems:
                    continue
                log(f"[{rate} round {r}/{args.rounds}] {system}")
                recs, _ = runner.run_system(lab, system, "all", args.repeats_per_run, {**tags, "position": pos})
                records.extend(recs)
            modes = args.staleness_modes if r % 2 == 1 else args.staleness_modes[::-1]
            for pos, mode in enumerate(modes):
                log(f"[{rate} round {r}/{args.rounds}] jaxdist MLP, staleness {mode}")
                recs, _ = runner.run_system(lab, "jaxdist", "mlp", args.repeats_per_run,
                                            {**tags, "position": pos, "staleness_run": mode}, staleness=mode)
                records.extend(recs)
        drops = lab.qdisc_drops()
        runner.emit({"kind": "qdisc", "rate": rate, "drops": drops})
    finally:
        lab.close()
    rows = summarize(records, rate, rate_bits, args.size_mb, workers=len(WORKER_HOSTS), ps=len(PS_HOSTS))
    if args.staleness_modes:
        rows += summarize_staleness(records, rate, args.staleness_modes)
    for row in rows:
        row.update(rounds=args.rounds, tf_available=runner.tf_python is not None, burst_bytes=lab.burst, latency=lab.latency)
        runner.emit(row)
    return rows


# --------------------------------------------------------------- --profile
def _diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Counters of run b minus run a (b made one more timed run than a)."""
    out: dict[str, Any] = {
        "wall_s": round(b["wall_s"] - a["wall_s"], 3),
        "coordinator_cpu_s": round(b["coordinator_cpu_s"] - a["coordinator_cpu_s"], 3),
        "machine_busy_cpu_s": round(b["machine_busy_cpu_s"] - a["machine_busy_cpu_s"], 3),
        "link_bytes": {h: {d: b["link_bytes"][h][d] - a["link_bytes"][h][d] for d in ("tx", "rx")} for h in HOSTS},
        "task_cpu_s": {h: None if b["task_cpu_s"].get(h) is None or a["task_cpu_s"].get(h) is None
                       else round(b["task_cpu_s"][h] - a["task_cpu_s"][h], 3) for h in b["task_cpu_s"]},
        "qdisc_drops": b["qdisc_drops"] - a["qdisc_drops"],
    }
    return out


def profile(runner: Runner, rate: str, rate_bits: float, args: argparse.Namespace, tag: str | None) -> None:
    """Per system and workload: what one timed run costs (run with 2 timed runs minus run with 1)."""
    lab = Lab(rate_bits, burst=args.burst, latency=args.latency, tag=tag).build()
    names = workload_names(args.size_mb)
    try:
        link = measure_link(lab, args.jaxdist_python, args.link_mb or args.size_mb, runner.next_port(), runner.logdir)
        runner.emit({"kind": "link_run", "rate": rate, "profile": True, **link})
        lanes = min(len(WORKER_HOSTS), len(PS_HOSTS))
        bounds = {"pull": lanes * link["down_MBps"], "push": lanes * link["up_MBps"],
                  "mlp": lanes * min(link["down_MBps"], link["up_MBps"]) * MB / MLP_PARAM_BYTES}
        log(f"profile at {rate}: link down {link['down_MBps']:.1f} MB/s, up {link['up_MBps']:.1f} MB/s; two streams "
            f"{link['pair_down_MBps']:.1f} / {link['pair_up_MBps']:.1f} MB/s")
        systems = [s for s in ("jaxdist", "tf") if s in args.systems and (s != "tf" or runner.tf_python)]
        for system in systems:
            for workload in ("pull", "push", "mlp"):
                counters, recs = [], []
                for repeats in (1, 2):
                    log(f"[profile {rate}] {system} {workload}, {repeats} timed run(s)")
                    rs, c = runner.run_system(lab, system, workload, repeats,
                                              {"rate": rate, "profile": True, "repeats": repeats}, measure=True)
                    counters.append(c)
                    recs.append(next((r for r in rs if r.get("workload") == names[workload]), None))
                if None in counters or None in recs:
                    continue
                d = _diff(counters[0], counters[1])
                rec = recs[1]
                if workload == "mlp":
                    units, unit = float(args.mlp_steps), "step"
                    payload = None
                else:
                    # bytes of tensor payload in one timed run: jaxdist's closures make one untimed warm
                    # transfer before their k=3 timed ones, TF's closures only the k=3
                    per_closure = 4 if system == "jaxdist" else 3
                    units, unit = float(len(WORKER_HOSTS) * per_closure * args.size_mb), "MB of payload"
                    payload = units * MB
                wire = {h: d["link_bytes"][h] for h in HOSTS}
                workers_rx = sum(wire[h]["rx"] for h in WORKER_HOSTS)
                workers_tx = sum(wire[h]["tx"] for h in WORKER_HOSTS)
                value = figure(rec)
                out = {
                    "kind": "profile", "rate": rate, "system": system, "workload": names[workload], "figure": value,
                    "unit": unit, "units_per_run": units, "run": d,
                    "fraction_of_link_bound": _r(_ratio(value, bounds[workload])),
                    "per_unit": {
                        "wall_ms": _r(_ratio(1e3, value), 3),  # from the figure (the run's wall difference is in "run")
                        "workers_rx_MB": _r(workers_rx / units / MB, 4), "workers_tx_MB": _r(workers_tx / units / MB, 4),
                        "ps_tx_MB": _r(sum(wire[h]["tx"] for h in PS_HOSTS) / units / MB, 4),
                        "ps_rx_MB": _r(sum(wire[h]["rx"] for h in PS_HOSTS) / units / MB, 4),
                        "co_tx_rx_MB": _r((wire["co"]["tx"] + wire["co"]["rx"]) / units / MB, 4),
                        "cpu_ms": {h: None if v is None else _r(1e3 * v / units, 3) for h, v in d["task_cpu_s"].items()},
                        "coordinator_cpu_ms": _r(1e3 * d["coordinator_cpu_s"] / units, 3),
                        "machine_busy_cpu_ms": _r(1e3 * d["machine_busy_cpu_s"] / units, 3),
                    },
                }
                if payload:
                    moved = workers_rx if workload == "pull" else workers_tx
                    out["wire_bytes_per_payload_byte"] = _r(moved / payload, 4)
                else:
                    out["wire_bytes_per_param_byte"] = {"pull": _r(workers_rx / units / MLP_PARAM_BYTES, 4),
                                                        "push": _r(workers_tx / units / MLP_PARAM_BYTES, 4)}
                runner.emit(out)
        if "jaxdist" in systems:
            log(f"[profile {rate}] jaxdist mlp_phases")
            runner.run_system(lab, "jaxdist", "mlp_phases", args.repeats_per_run, {"rate": rate, "profile": True})
    finally:
        lab.close()


# ------------------------------------------------------------------ main
def _raise_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rates", default=None, help="comma-separated tc rates, each run in turn (default 1gbit,5gbit)")
    ap.add_argument("--rate", action="append", default=[], help="one rate (repeatable); added to --rates")
    ap.add_argument("--burst", default=None, help="tbf burst (default: max(64 KiB, 1 ms of the rate) in bytes)")
    ap.add_argument("--latency", default="20ms", help="tbf latency (default 20ms)")
    ap.add_argument("--systems", default="tf,jaxdist", help="which systems to run (default tf,jaxdist)")
    ap.add_argument("--tf-python", default=None, help="interpreter with tensorflow (default as compare_tf.py: this "
                                                      f"one if it has it, else {compare_tf.DEFAULT_TF_VENV_PYTHON})")
    ap.add_argument("--jaxdist-python", default=sys.executable)
    ap.add_argument("--repeats-per-run", type=int, default=1, help="timed runs inside each coordinator run")
    ap.add_argument("--mlp-steps", type=int, default=200)
    ap.add_argument("--noop-closures", type=int, default=5000)
    ap.add_argument("--size-mb", type=int, default=64, help="MB of the pull/push variable (default 64)")
    ap.add_argument("--link-mb", type=int, default=None, help="MB per bare-stream transfer (default --size-mb)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per coordinator run")
    ap.add_argument("--mlp-mode", choices=("pull_push", "prefetch", "fused"), default="pull_push",
                    help="jaxdist's MLP step (jaxdist_workloads.py --mlp-mode): pull_push (default, as TF's), prefetch "
                         "(the next pull overlaps this step; up to one own step stale) or fused (push_pull)")
    ap.add_argument("--grad-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype jaxdist's MLP gradients travel in (TF's stay float32)")
    ap.add_argument("--pull-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype jaxdist's MLP parameters are pulled in (TF's stay float32)")
    ap.add_argument("--bulk-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype jaxdist's pull/push workloads move the float32 variable in (bfloat16: half the bytes on "
                         "the links; see jaxdist_workloads.py); TF's stay float32")
    ap.add_argument("--staleness-modes", default="",
                    help="comma-separated ParameterServerStrategy(staleness=) modes (async or an int >= 0, e.g. "
                         "async,0,2): per round, after the systems, one jaxdist MLP-only run per mode (pull_push "
                         "steps), summarised side by side (\"kind\": \"staleness_summary\"); --systems '' runs only these")
    ap.add_argument("--tag", default=None, help="namespace name prefix (1-9 of [a-z0-9]; default nb<random hex>)")
    ap.add_argument("--cleanup", default=None, metavar="TAG",
                    help="only remove the namespaces <TAG>-* (and kill what runs in them) left by a run killed with SIGKILL")
    ap.add_argument("--profile", nargs="?", const="1gbit", default=None, metavar="RATE",
                    help="profile one rate (default 1gbit) instead of the side-by-side run")
    ap.add_argument("--allow-shm", action="store_true",
                    help="demonstration only: leave jaxdist's same-host shared memory on (the namespaces share "
                         "/dev/shm, so tensors then bypass the links and the figures are not a network's)")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    try:
        rates = [r for r in (args.rates.split(",") if args.rates else []) + args.rate if r.strip()] or ["1gbit", "5gbit"]
        rate_bits = [parse_rate(r) for r in rates]
        if args.profile:
            rates, rate_bits = [args.profile], [parse_rate(args.profile)]
    except ValueError as e:
        ap.error(str(e))
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if set(args.systems) - {"tf", "jaxdist"}:
        ap.error(f"--systems: tf and/or jaxdist, not {args.systems}")
    args.staleness_modes = [m.strip() for m in args.staleness_modes.split(",") if m.strip()]
    try:  # each as jaxdist_workloads.py --staleness takes it, written as its records label it
        args.staleness_modes = [staleness_label(parse_staleness(m)) for m in args.staleness_modes]
    except ValueError as e:
        ap.error(f"--staleness-modes: {e}")
    if len(set(args.staleness_modes)) != len(args.staleness_modes):
        ap.error(f"--staleness-modes: each mode once, not {args.staleness_modes}")
    if args.profile and args.staleness_modes:
        ap.error("--staleness-modes runs in the side-by-side run, not with --profile")
    if not args.systems and not args.staleness_modes:
        ap.error("nothing to run: --systems is empty and no --staleness-modes")

    signal.signal(signal.SIGTERM, _raise_on_sigterm)  # SIGTERM unwinds through every cleanup below
    if args.cleanup:
        print(json.dumps({"kind": "cleanup", "removed": remove_tagged(args.cleanup)}), flush=True)
        return 0
    why = unavailable()
    if why:
        print(json.dumps({"kind": "skipped", "reason": why}), flush=True)
        log(f"netbench skipped: {why}")
        return 0

    tf_python, tf_info = (None, "not requested") if "tf" not in args.systems else compare_tf.find_tf_python(args.tf_python)
    if args.tf_python and tf_python is None:
        log(f"error: --tf-python {args.tf_python} cannot import tensorflow: {tf_info}")
        return 2
    logdir = tempfile.mkdtemp(prefix="netbench_")
    runner = Runner(args, tf_python, logdir)
    runner.emit({"kind": "config", "rounds": args.rounds, "rates": rates, "rate_bits": rate_bits, "systems": args.systems,
                 "tf_python": tf_python, "tf_version": tf_info if tf_python else None,
                 "jaxdist_python": args.jaxdist_python, "size_mb": args.size_mb, "mlp_steps": args.mlp_steps,
                 "noop_closures": args.noop_closures, "repeats_per_run": args.repeats_per_run,
                 "jaxdist_mlp_mode": args.mlp_mode, "jaxdist_grad_dtype": args.grad_dtype,
                 "jaxdist_pull_dtype": args.pull_dtype, "jaxdist_bulk_dtype": args.bulk_dtype, "staleness_modes": args.staleness_modes,
                 "latency": args.latency, "burst": args.burst,
                 "jaxdist_env": {} if args.allow_shm else {"JAXDIST_SHM": "0"},
                 "profile": args.profile, "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
    if "tf" in args.systems and tf_python is None:
        runner.emit({"kind": "tf_missing", "system": "tf", "status": "missing", "reason": tf_info,
                     "note": "TensorFlow not found: running jaxdist and the link reference only; ratios to TF are null"})
        log(f"TF MISSING: {tf_info} -- running jaxdist + the link reference only")
    rows: list[dict[str, Any]] = []
    rc = 0
    try:
        for rate, bits in zip(rates, rate_bits):
            if args.profile:
                profile(runner, rate, bits, args, args.tag)
            else:
                rows += bench_rate(runner, rate, bits, args, args.tag)
    except (KeyboardInterrupt, SystemExit) as e:
        log(f"interrupted ({e!r}); namespaces removed")
        rc = 130
    finally:
        if args.tag:
            remove_tagged(args.tag)
        shutil.rmtree(logdir, ignore_errors=True)
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                for line in runner.out:
                    f.write(json.dumps(line) + "\n")
    if rows:
        log("")
        log(f"median over {args.rounds} round(s), 2 workers, 2 PS, each task on its own rate-limited link"
            + ("" if tf_python or "tf" not in args.systems else "  [TF MISSING]"))
        log(format_table(rows))
    if args.out:
        log(f"all lines: {args.out}")
    failures = sum(1 for r in runner.out if r.get("kind") == "failure")
    return rc or (1 if failures else 0)


if __name__ == "__main__":
    sys.exit(main())
