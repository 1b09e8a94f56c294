"""Which library modules the fast lane never executes: ``python tests/fast_lane_coverage.py [pytest args]``.

Runs the fast lane (``pytest -m "not slow"``, see tests/tiers.py) under coverage.py, measuring the pytest
processes (pytest-xdist's included) and every Python subprocess they start (coverage's ``patch =
subprocess``: a cluster's tasks, a fake-device check process, a script run by a test), then prints, per
library module, the share of its statements the lane executed, and lists the modules of which it executed
not one line. Exit status: 0 when every module is executed except those in :data:`NOT_IN_THE_FAST_LANE`
(each with its reason), 1 when another module is never executed (or the lane failed: its exit status is
printed and the report is still made).

Needs coverage.py 7.10 or later (``pip install 'coverage>=7.10'``; it is in the ``test`` extra). The run
takes longer than the lane alone (coverage's tracing); its data stays in ``--data-dir`` (default: a
temporary folder, removed) so that ``--report-only`` can print the report again.

A module counts as executed when any of its lines ran, its import included: the list answers "which code
does no fast test reach at all", and the per-module percentages show how far the rest is exercised.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Library modules the fast lane is not expected to execute, with the reason.
NOT_IN_THE_FAST_LANE: dict[str, str] = {
    # protoc's gRPC stubs: jaxdist registers its services and calls its methods through grpc's generic
    # handlers and channels with the message classes of *_pb2 (transport/), so nothing imports these.
    "jaxdist.proto.common_pb2_grpc": "generated gRPC stubs jaxdist does not use (generic handlers)",
    "jaxdist.proto.coordinator_pb2_grpc": "generated gRPC stubs jaxdist does not use (generic handlers)",
    "jaxdist.proto.ps_pb2_grpc": "generated gRPC stubs jaxdist does not use (generic handlers)",
    "jaxdist.proto.worker_pb2_grpc": "generated gRPC stubs jaxdist does not use (generic handlers)",
}


def package_dirs() -> dict[str, Path]:
    """jaxdist's import names and the folders that hold them (pyproject's ``package-dir``)."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items()}


def modules() -> dict[Path, str]:
    """Every library module file and its import name (a package's subfolders included)."""
    found: dict[Path, str] = {}
    dirs = package_dirs()
    # The longest folder first, so that jaxdist.sync's files are not named under jaxdist's folder.
    for name, folder in sorted(dirs.items(), key=lambda item: -len(item[0])):
        for path in sorted(folder.rglob("*.py")):
            if path in found or any(part.startswith(".") or part == "__pycache__" for part in path.parts):
                continue
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[path] = ".".join([name, *parts])
    return found


def _rcfile(data_dir: Path) -> Path:
    rc = data_dir / "coveragerc"
    sources = ", ".join(str(d) for d in package_dirs().values())
    rc.write_text(
        "[run]\n"
        f"source = {sources}\n"
        "parallel = true\n"
        "patch = subprocess\n"
        f"data_file = {data_dir / '.coverage'}\n"
        # A test that SIGKILLs or os._exit()s a subprocess loses that process's data: what it ran before
        # is saved only if coverage saved it first. The fast lane kills few processes; they are not the
        # only runners of any module.
        "sigterm = true\n"
    )
    return rc


def run_lane(data_dir: Path, pytest_args: list[str]) -> int:
    """Run the fast lane under coverage, data into ``data_dir``; the lane's exit status."""
    rc = _rcfile(data_dir)
    env = dict(os.environ)
    env["COVERAGE_RCFILE"] = str(rc)
    cmd = [sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-m", "not slow and not lint",
           "-q", "-p", "no:cacheprovider", *pytest_args]
    print("running:", " ".join(cmd), flush=True)
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def measure(data_dir: Path) -> dict[str, tuple[int, int]]:
    """``{module: (statements, executed)}`` from the combined data in ``data_dir``."""
    import coverage

    rc = data_dir / "coveragerc"
    cov = coverage.Coverage(config_file=str(rc), data_file=str(data_dir / ".coverage"))
    cov.combine(keep=True, data_paths=[str(data_dir)])
    cov.load()
    data = cov.get_data()
    measured = {Path(f).resolve() for f in data.measured_files()}
    result: dict[str, tuple[int, int]] = {}
    for path, name in modules().items():
        _, statements, _, missing, _ = cov.analysis2(str(path))
        executed = len(statements) - len(missing) if path in measured else 0
        result[name] = (len(statements), executed)
    return result


def report(result: dict[str, tuple[int, int]], show_all: bool) -> int:
    never = sorted(name for name, (statements, executed) in result.items() if statements and executed == 0)
    if show_all:
        width = max(len(n) for n in result)
        print(f"{'module':<{width}}  statements  executed")
        for name in sorted(result):
            statements, executed = result[name]
            share = f"{100 * executed / statements:5.1f}%" if statements else "   -  "
            print(f"{name:<{width}}  {statements:10d}  {share}")
    total = sum(s for s, _ in result.values())
    done = sum(e for _, e in result.values())
    print(f"\n{len(result)} modules, {done}/{total} statements executed ({100 * done / max(total, 1):.1f}%)")
    expected = [n for n in never if n in NOT_IN_THE_FAST_LANE]
    unexpected = [n for n in never if n not in NOT_IN_THE_FAST_LANE]
    for name in expected:
        print(f"not executed (expected): {name}: {NOT_IN_THE_FAST_LANE[name]}")
    for name in unexpected:
        print(f"NOT EXECUTED by the fast lane: {name}")
    if not unexpected:
        print("every other module is executed by the fast lane")
    return 1 if unexpected else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--data-dir", type=Path, help="keep the coverage data here (default: a temporary folder)")
    parser.add_argument("--report-only", action="store_true", help="report on --data-dir's data without running")
    parser.add_argument("--all", action="store_true", help="print every module's share of executed statements")
    args, pytest_args = parser.parse_known_args(argv)
    if args.report_only and args.data_dir is None:
        parser.error("--report-only needs --data-dir")
    data_dir = args.data_dir.resolve() if args.data_dir else Path(tempfile.mkdtemp(prefix="fast-lane-coverage-"))
    try:
        lane = 0
        if not args.report_only:
            data_dir.mkdir(parents=True, exist_ok=True)
            lane = run_lane(data_dir, pytest_args)
        status = report(measure(data_dir), args.all)
        if lane != 0:
            print(f"the fast lane itself failed (pytest exit status {lane})")
        return status or (1 if lane else 0)
    finally:
        if args.data_dir is None:
            shutil.rmtree(data_dir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
