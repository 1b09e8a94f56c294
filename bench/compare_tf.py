"""TF ParameterServerStrategy vs jaxdist, side by side in one run, against the targets below (TARGETS).

For each round r = 1..--rounds this runs, each in its own subprocess with a timeout:
  bench/tf_workloads.py --workload all         under the TF interpreter      ("system": "tf")
  bench/jaxdist_workloads.py --workload all    under this interpreter        ("system": "jaxdist")
  bench/jaxdist_workloads.py --workload references  (raw gRPC + plain JAX)   ("system": "reference")
TF goes first in odd rounds and jaxdist first in even rounds (the references always last), so
slow drift of the shared machine hits both systems. Each subprocess does --repeats-per-run timed
runs (default 1) after its own warm-up; the figure of a round is that subprocess's median.

Then, per workload, one JSON line on stdout with the median over rounds for TF and jaxdist, the
jaxdist/TF ratio, the jaxdist/reference ratio and whether the targets are met:
  noop_closures_per_s  >= 5x TF              (reference: raw gRPC tiny calls, 16 concurrent)
  pull_64MB_MBps       >= 1.5x TF and >= 0.80x raw gRPC 4 MB-chunk stream, down
  push_64MB_MBps       >= 1.5x TF and >= 0.80x raw gRPC 4 MB-chunk stream, up
  mlp_steps_per_s      >= 1.5x TF and >= 0.60x plain JAX in one process
Pull/push are timed inside the closures on both sides (TF's ``median_in_closure``).
Every raw line, tagged with its round, plus the summary lines go to --out (JSON lines); a short
table goes to stderr. Without a TF interpreter (current one, else /work/main/.venv-tf/bin/python,
or --tf-python) only jaxdist and the references run, a line says TF is missing, and it exits 0.

Usage: python bench/compare_tf.py [--rounds 3] [--workers 2] [--grad-dtype float32|bfloat16]
       [--pull-dtype float32|bfloat16] [--mlp-mode pull_push|prefetch|fused]
       [--tf-python PATH] [--out bench/results/compare_tf.jsonl]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TF_SCRIPT = os.path.join(HERE, "tf_workloads.py")
JAXDIST_SCRIPT = os.path.join(HERE, "jaxdist_workloads.py")
DEFAULT_TF_VENV_PYTHON = os.path.join(REPO, ".venv-tf", "bin", "python")
DEFAULT_OUT = os.path.join(HERE, "results", "compare_tf.jsonl")

#: workload -> (min jaxdist/TF, reference workload, min jaxdist/reference or None)
TARGETS: dict[str, tuple[float, str, float | None]] = {
    "noop_closures_per_s": (5.0, "raw_grpc_tiny_concurrent_calls_per_s", None),
    "pull_64MB_MBps": (1.5, "raw_grpc_stream_down_MBps", 0.80),
    "push_64MB_MBps": (1.5, "raw_grpc_stream_up_MBps", 0.80),
    "mlp_steps_per_s": (1.5, "plain_jax_mlp_steps_per_s", 0.60),
}
IN_CLOSURE_WORKLOADS = ("pull_64MB_MBps", "push_64MB_MBps")
#: workload -> the bare transport under jaxdist's data plane (no target: shows how close it gets).
TRANSPORT_REFERENCES = {"pull_64MB_MBps": "raw_tcp_stream_down_MBps", "push_64MB_MBps": "raw_tcp_stream_up_MBps"}


# ------------------------------------------------------------------ pure logic
def figure(rec: dict[str, Any]) -> float | None:
    """The number a record contributes: its median; for TF pull/push the in-closure timing, like jaxdist's."""
    if rec.get("system") == "tf" and rec.get("workload") in IN_CLOSURE_WORKLOADS and "median_in_closure" in rec:
        return float(rec["median_in_closure"])
    m = rec.get("median")
    return None if m is None else float(m)


def _values(records: list[dict[str, Any]], system: str, workload: str) -> list[float]:
    vals = [figure(r) for r in records if r.get("system") == system and r.get("workload") == workload]
    return [v for v in vals if v is not None]


def _med(vals: list[float]) -> float | None:
    return statistics.median(vals) if vals else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None else round(x, nd)


def summarize(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary row per workload of TARGETS from the raw records of all rounds.

    A record is a parsed JSON line with ``system`` ("tf", "jaxdist" or "reference"), ``workload``
    and ``median`` (TF pull/push: ``median_in_closure`` preferred). Medians are taken over the
    records (rounds) of each system; ratios are jaxdist / TF and jaxdist / reference. ``met`` is
    True when every target that could be checked holds and all could be checked, False when any
    checked one fails, None when some could not be checked (a system missing) and none failed.
    """
    rows = []
    transports = sorted({r["transport"] for r in records if r.get("system") == "jaxdist" and r.get("transport")})
    for workload, (min_vs_tf, ref_name, min_vs_ref) in TARGETS.items():
        tf_vals = _values(records, "tf", workload)
        jd_vals = _values(records, "jaxdist", workload)
        ref_vals = _values(records, "reference", ref_name)
        tf_med, jd_med, ref_med = _med(tf_vals), _med(jd_vals), _med(ref_vals)
        vs_tf, vs_ref = _ratio(jd_med, tf_med), _ratio(jd_med, ref_med)
        met_vs_tf = None if vs_tf is None else vs_tf >= min_vs_tf
        met_vs_ref = None if min_vs_ref is None or vs_ref is None else vs_ref >= min_vs_ref
        checks = [met_vs_tf] + ([met_vs_ref] if min_vs_ref is not None else [])
        met = False if False in checks else (None if None in checks else True)
        target = f"jaxdist >= {min_vs_tf:g}x TF" + (f" and >= {min_vs_ref:.2f}x {ref_name}" if min_vs_ref is not None else "")
        rows.append({
            "kind": "summary",
            "workload": workload,
            "tf_median": _r(tf_med, 2),
            "jaxdist_median": _r(jd_med, 2),
            "ratio_jaxdist_to_tf": _r(vs_tf),
            "reference": ref_name,
            "reference_median": _r(ref_med, 2),
            "ratio_jaxdist_to_reference": _r(vs_ref),
            "target": target,
            "target_vs_tf": min_vs_tf,
            "target_vs_reference": min_vs_ref,
            "met_vs_tf": met_vs_tf,
            "met_vs_reference": met_vs_ref,
            "met": met,
            "tf_rounds": [round(v, 2) for v in tf_vals],
            "jaxdist_rounds": [round(v, 2) for v in jd_vals],
            "reference_rounds": [round(v, 2) for v in ref_vals],
            "jaxdist_transport": ",".join(transports) or None,
        })
        transport = TRANSPORT_REFERENCES.get(workload)
        if transport is not None:
            t_vals = _values(records, "reference", transport)
            rows[-1].update(transport_reference=transport, transport_reference_median=_r(_med(t_vals), 2),
                            ratio_jaxdist_to_transport=_r(_ratio(jd_med, _med(t_vals))),
                            transport_reference_rounds=[round(v, 2) for v in t_vals])
    return rows


def round_order(r: int) -> list[str]:
    """The subprocesses of round ``r`` (1-based): TF first in odd rounds, jaxdist first in even ones."""
    return ["tf", "jaxdist", "references"] if r % 2 == 1 else ["jaxdist", "tf", "references"]


def format_table(rows: list[dict[str, Any]]) -> str:
    def f(x: Any, nd: int = 1) -> str:
        if x is None:
            return "-"
        if isinstance(x, bool):
            return "yes" if x else "NO"
        return f"{x:,.{nd}f}"

    head = ["workload", "TF", "jaxdist", "jd/TF", "target", "reference", "ref", "jd/ref", "target", "met"]
    lines = [head]
    for r in rows:
        lines.append([
            r["workload"], f(r["tf_median"]), f(r["jaxdist_median"]), f(r["ratio_jaxdist_to_tf"], 2),
            f">={r['target_vs_tf']:g}", r["reference"], f(r["reference_median"]), f(r["ratio_jaxdist_to_reference"], 2),
            "-" if r["target_vs_reference"] is None else f">={r['target_vs_reference']:.2f}",
            {True: "yes", False: "NO", None: "?"}[r["met"]],
        ])
    widths = [max(len(str(row[i])) for row in lines) for i in range(len(head))]
    text = "\n".join("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip() for row in lines)
    for r in rows:
        if r.get("transport_reference_median") is not None:
            text += (f"\n{r['workload']}: {f(r['ratio_jaxdist_to_transport'], 2)}x {r['transport_reference']} "
                     f"({f(r['transport_reference_median'])}, one bare TCP stream; no target)")
    used = {r.get("jaxdist_transport") for r in rows} - {None}
    if used:
        text += (f"\njaxdist moved tensors over: {', '.join(sorted(used))} (shm: same-host shared memory; "
                 "JAXDIST_SHM=0 for the data plane's TCP socket, JAXDIST_DATA_PLANE=0 for gRPC)")
    return text


# ------------------------------------------------------------------ running
def _imports_tensorflow(python: str, timeout: float = 300) -> tuple[bool, str]:
    try:
        p = subprocess.run([python, "-c", "import tensorflow as tf; print(tf.__version__)"], capture_output=True,
                           text=True, timeout=timeout, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{python}: {e}"
    if p.returncode != 0:
        tail = (p.stderr.strip().splitlines() or ["?"])[-1]
        return False, f"{python}: import tensorflow failed: {tail}"
    return True, p.stdout.strip()


def find_tf_python(explicit: str | None) -> tuple[str | None, str]:
    """(interpreter, TF version) or (None, why not)."""
    if explicit:
        ok, info = _imports_tensorflow(explicit)
        return (explicit, info) if ok else (None, info)
    reasons = []
    if importlib.util.find_spec("tensorflow") is not None:
        ok, info = _imports_tensorflow(sys.executable)
        if ok:
            return sys.executable, info
        reasons.append(info)
    else:
        reasons.append(f"{sys.executable}: no tensorflow")
    if os.path.exists(DEFAULT_TF_VENV_PYTHON):
        ok, info = _imports_tensorflow(DEFAULT_TF_VENV_PYTHON)
        if ok:
            return DEFAULT_TF_VENV_PYTHON, info
        reasons.append(info)
    else:
        reasons.append(f"{DEFAULT_TF_VENV_PYTHON}: not found")
    return None, "; ".join(reasons)


def run_script(cmd: list[str], timeout: float, env: dict[str, str]) -> tuple[list[dict[str, Any]], int, str]:
    """Run one benchmark subprocess in its own process group; (JSON records, return code, stderr tail).

    On timeout the whole group (the script and any task processes it started) gets SIGTERM, then SIGKILL.
    """
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                out, err = proc.communicate(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        else:
            out, err = "", ""
        rc = 124
        err = (err or "") + f"\n[compare_tf] timed out after {timeout:.0f}s"
    records = []
    for line in (out or "").splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    tail = "\n".join((err or "").strip().splitlines()[-25:])
    return records, rc, tail


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tf-python", default=None, help="interpreter with tensorflow (default: this one if it has it, "
                                                      f"else {DEFAULT_TF_VENV_PYTHON})")
    ap.add_argument("--jaxdist-python", default=sys.executable)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--grad-dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--pull-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype jaxdist's MLP parameters are pulled in (bfloat16: mixed precision; TF's stay float32)")
    ap.add_argument("--mlp-mode", choices=("pull_push", "prefetch", "fused"), default="pull_push",
                    help="jaxdist's MLP step (jaxdist_workloads.py --mlp-mode): pull_push (default, the same step as "
                         "TF's), prefetch (the next pull overlaps this step; up to one own step stale) or fused "
                         "(push_pull); TF's step is always pull, gradient, push")
    ap.add_argument("--bulk-dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype jaxdist's pull/push workloads move the 64 MB float32 variable in (bfloat16: half the "
                         "bytes; see jaxdist_workloads.py); TF's stay float32")
    ap.add_argument("--repeats-per-run", type=int, default=1, help="timed runs inside each subprocess")
    ap.add_argument("--mlp-steps", type=int, default=200)
    ap.add_argument("--noop-closures", type=int, default=5000)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per subprocess")
    ap.add_argument("--out", default=DEFAULT_OUT)
    args = ap.parse_args(argv)

    tf_python, tf_info = find_tf_python(args.tf_python)
    if args.tf_python and tf_python is None:
        log(f"error: --tf-python {args.tf_python} cannot import tensorflow: {tf_info}")
        return 2
    config = {"kind": "config", "rounds": args.rounds, "workers": args.workers, "grad_dtype": args.grad_dtype,
              "jaxdist_mlp_mode": args.mlp_mode, "jaxdist_pull_dtype": args.pull_dtype,
              "jaxdist_bulk_dtype": args.bulk_dtype, "repeats_per_run": args.repeats_per_run, "mlp_steps": args.mlp_steps, "noop_closures": args.noop_closures,
              "tf_python": tf_python, "tf_version": tf_info if tf_python else None, "jaxdist_python": args.jaxdist_python,
              "cpus": os.cpu_count(), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    out_lines: list[dict[str, Any]] = [config]
    print(json.dumps(config), flush=True)
    if tf_python is None:
        missing = {"kind": "tf_missing", "system": "tf", "status": "missing", "reason": tf_info,
                   "note": "TensorFlow not found: running jaxdist and the references only; ratios to TF are null"}
        out_lines.append(missing)
        print(json.dumps(missing), flush=True)
        log(f"TF MISSING: {tf_info} -- running jaxdist + references only")

    common = ["--repeats", str(args.repeats_per_run), "--mlp-steps", str(args.mlp_steps)]
    scale = ["--workers", str(args.workers), "--noop-closures", str(args.noop_closures)]
    commands = {
        "tf": [tf_python or "", TF_SCRIPT, "--workload", "all", *common, *scale],
        "jaxdist": [args.jaxdist_python, JAXDIST_SCRIPT, "--workload", "all", *common, *scale,
                    "--grad-dtype", args.grad_dtype, "--mlp-mode", args.mlp_mode,
                    "--pull-dtype", args.pull_dtype, "--bulk-dtype", args.bulk_dtype],
        "references": [args.jaxdist_python, JAXDIST_SCRIPT, "--workload", "references", *common],
    }
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"), "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONUNBUFFERED": "1"}
    records: list[dict[str, Any]] = []
    failures = 0
    for r in range(1, args.rounds + 1):
        for pos, which in enumerate(round_order(r)):
            if which == "tf" and tf_python is None:
                continue
            t = time.monotonic()
            recs, rc, err = run_script(commands[which], args.timeout, env)
            log(f"[round {r}/{args.rounds}] {which}: rc={rc}, {len(recs)} lines, {time.monotonic() - t:.1f}s")
            for rec in recs:
                rec.update(round=r, position=pos, run=which)
            records.extend(recs)
            out_lines.extend(recs)
            if rc != 0:
                failures += 1
                fail = {"kind": "failure", "run": which, "round": r, "rc": rc, "stderr_tail": err}
                out_lines.append(fail)
                print(json.dumps(fail), flush=True)
                log(f"  {which} failed (rc={rc}):\n" + "\n".join("    " + ln for ln in err.splitlines()))
                if which == "jaxdist" and rc == 2:  # a usage error (e.g. bfloat16 unsupported): same every round
                    log("  jaxdist refused its arguments; stopping")
                    return 2

    rows = summarize(records)
    for row in rows:
        row.update(workers=args.workers, grad_dtype=args.grad_dtype, bulk_dtype=args.bulk_dtype, rounds=args.rounds,
                   tf_available=tf_python is not None)
        print(json.dumps(row), flush=True)
    out_lines.extend(rows)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            for line in out_lines:
                f.write(json.dumps(line) + "\n")
    log("")
    log(f"median over {args.rounds} round(s), {args.workers} workers, 2 PS, grad dtype {args.grad_dtype}"
        + ("" if tf_python else "  [TF MISSING]"))
    log(format_table(rows))
    if args.out:
        log(f"all lines: {args.out}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
