"""Shared fixtures: real gRPC servers on 127.0.0.1 port 0 and real subprocess clusters."""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")

#: Fake CPU devices of one process meet in XLA's in-process collectives, which abort the process when
#: a device's thread is 40 s late (XLA's default): on 2 cores shared with another CPU-heavy job an
#: 8-device step can be that late. Every subprocess inherits these; tests add their device count.
#: ``--xla_backend_optimization_level=0``: XLA:CPU generates its machine code without LLVM's
#: optimisation passes. The tests' programs are tiny and each is run a few times, so compiling them is
#: most of the CPU a Keras or sync check spends (the Keras PS parity subprocess: 100 -> 75 CPU-seconds).
#: Results differ from the default level's in the last bits (no fused multiply-adds, other
#: polynomial evaluations, another dot kernel): every process of a run inherits these flags, so the
#: suite's comparisons stay like for like; a test that compares with a process started without them
#: must not expect equal bits. Benchmarks (bench/) and users keep XLA's default level.
XLA_TEST_FLAGS = ("--xla_cpu_collective_call_terminate_timeout_seconds=900 --xla_cpu_collective_timeout_seconds=900 "
                  "--xla_backend_optimization_level=0")
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {XLA_TEST_FLAGS}".strip()

#: This run's own temporary directory (inherited by every subprocess through TMPDIR): what a test
#: leaves in it is found by the module check below without seeing a concurrent run's files, and it
#: is removed when the run passes (kept, and named, when it fails).
RUN_TMP = tempfile.mkdtemp(prefix="jaxdist-tests-")
os.environ["TMPDIR"] = RUN_TMP
tempfile.tempdir = RUN_TMP

#: One persistent XLA compilation cache per run, shared by every subprocess the tests start (inherited
#: through the environment): a Keras fit script, a fake-device check process, a re-run after a SIGKILL,
#: a cluster's tasks compile the same programs over and over, and compiling is most of their CPU time.
#: JAX keys an entry by the program, its compile options, the devices, the XLA flags and the JAX
#: version, so a hit is the executable the process would have compiled. Every entry is kept (no
#: minimum compile time). The pytest process itself does not use it (turned off below, once JAX is
#: imported): JAX writes an entry in place, and a read that met another process's half-written entry
#: would warn (an error in this process, fallback to compiling elsewhere).
#: Under pytest-xdist (pyproject's addopts) every test process imports this file: the first one (the
#: controller, which runs no test) names the cache, and the worker processes, started with its
#: environment, keep that name, so that the subprocesses of both workers share one cache, inside the
#: controller's run directory (each worker's own run directory is made inside it, through TMPDIR).
if "PYTEST_XDIST_WORKER" not in os.environ or "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = os.path.join(RUN_TMP, "jax-compilation-cache")
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

TOKEN = "test-token"

#: The docs' local Sphinx extensions (docs/_ext/jaxdist_sphinx), imported by tests/docs. Put on the path
#: here: a conftest.py of tests/docs would be imported as a second module named ``conftest``, which every
#: ``from conftest import ...`` of the other folders would then read.
_DOCS_EXT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "_ext")
if _DOCS_EXT not in sys.path:
    sys.path.insert(0, _DOCS_EXT)

import tiers  # noqa: E402  (tests/tiers.py: the fast lane and the lint step)
from jaxdist.transport.credentials import Credentials  # noqa: E402

#: What in-process servers and clients of the tests use.
CREDS = Credentials(TOKEN)


# One harness: tests that still do ``from conftest import poll_for`` get jaxdist.testing's.
from jaxdist.testing import Leftovers, poll_for  # noqa: E402,F401

import jax  # noqa: E402

jax.config.update("jax_enable_compilation_cache", False)  # the subprocesses' cache only (above)

#: Fixtures wider than one test (module or session scope) whose threads and processes outlive
#: each test that uses them: tests using one are checked when their module ends instead.
#: A new module-scoped fixture that starts threads or processes goes here.
SHARED_FIXTURES = frozenset({
    "cluster", "slurm", "netbench", "run", "trained", "compare_tf", "three_ps", "clusters", "env",
    "check_results", "validator", "pki",
})

#: Seconds a test's threads and child processes get to finish stopping after it returns.
_LEFTOVER_GRACE_S = 30.0


def _jaxdist_temp_entries() -> set[str]:
    return set(glob.glob(os.path.join(RUN_TMP, "jaxdist-*")))


#: Test files in which a test failed (or errored). A LocalCluster keeps its log directory when the
#: with-block around it raised, on purpose: those logs belong to the failure, which is already
#: reported, and the module's check below must not turn them into an error of whichever test of
#: the file happens to run last.
_FAILED_MODULES: set[str] = set()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.failed:
        _FAILED_MODULES.add(report.nodeid.split("::")[0])


@pytest.fixture(autouse=True, scope="module")
def _nothing_outlives_the_module(request: pytest.FixtureRequest) -> Iterator[None]:
    """No jaxdist-* thread or child process started in a module outlives it (its fixtures included),
    and it leaves no jaxdist-* entry (a cluster's log directory) in the temporary directory, unless
    a test of the module failed (then the entries are its kept logs, in this run's kept directory)."""
    before = Leftovers.now()
    entries = _jaxdist_temp_entries()
    yield
    left = before.wait_gone(_LEFTOVER_GRACE_S)
    assert not left, f"left running after the module: {left.describe()}"
    added = sorted(_jaxdist_temp_entries() - entries)
    if request.node.nodeid.split("::")[0] in _FAILED_MODULES:
        return
    assert not added, (
        f"left in the temporary directory after the module: {added} (a LocalCluster keeps its logs only "
        "when a task failed; a test that SIGKILLs the process owning a cluster gives it a log_dir in tmp_path)"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if exitstatus == 0:
        shutil.rmtree(RUN_TMP, ignore_errors=True)
    else:
        print(f"\njaxdist tests: temporary files of this run kept in {RUN_TMP}", file=sys.stderr)


def _slow_files_first(items: list[pytest.Item]) -> None:
    """Order the files with the most slow tests first, each file's tests in their own order.

    ``--dist loadfile`` hands whole files to the two test processes in this order, so the long files
    start first and the run ends on short files that fill both processes, not on one process still
    running a long file while the other has nothing left (the run's wall time was that file's).
    """
    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    slow = Counter(file_of(item) for item in items if item.get_closest_marker("slow") is not None)
    first_seen = {f: i for i, f in enumerate(dict.fromkeys(file_of(item) for item in items))}
    items.sort(key=lambda item: (-slow[file_of(item)], first_seen[file_of(item)]))


#: Test modules where some test uses a shared fixture: the servers and clients such a fixture
#: keeps may start threads lazily during any test of the module (a connection pool's first use,
#: a server's first call of a kind), so their tests are checked when the module ends.
_SHARED_MODULES: set[str] = set()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tiers.apply(items)
    _slow_files_first(items)
    for item in items:
        if SHARED_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            _SHARED_MODULES.add(item.nodeid.split("::")[0])


@pytest.fixture(autouse=True)
def _nothing_outlives_the_test(request: pytest.FixtureRequest) -> Iterator[None]:
    """No jaxdist-* thread or child process started by a test outlives it."""
    before = Leftovers.now()
    yield
    if request.node.nodeid.split("::")[0] in _SHARED_MODULES:
        return  # checked when the module ends
    left = before.wait_gone(_LEFTOVER_GRACE_S)
    assert not left, (
        f"left running after the test: {left.describe()} (stop what the test started; if a module-scoped "
        "fixture owns it, list the fixture in conftest.SHARED_FIXTURES)"
    )


@pytest.fixture
def ps_server() -> Iterator[object]:
    from jaxdist.ps_server.server import ParameterServer

    ps = ParameterServer(credentials=CREDS, max_variable_bytes=64 << 20)
    ps.start()
    yield ps
    ps.stop(grace=None)


@pytest.fixture(params=["data_plane", "data_plane_tcp", "grpc"])
def ps_client(ps_server: object, request: pytest.FixtureRequest) -> Iterator[object]:
    """A client of ``ps_server``, moving tensors over the data plane (through shared
    memory where this host has it, then over its socket only), and over gRPC."""
    from jaxdist.transport import dataplane
    from jaxdist.ps_server.client import PSClient

    over_data_plane = request.param != "grpc"
    shm = request.param == "data_plane"
    c = PSClient(ps_server.address, CREDS, task="ps:0", data_plane=over_data_plane, shared_memory=shm)  # type: ignore[attr-defined]
    yield c
    assert c.uses_data_plane in ((True, None) if over_data_plane else (False,))
    if c.uses_data_plane:
        assert c.uses_shared_memory == (shm and dataplane.shm_enabled())
    c.close()


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """A real 2-PS / 2-worker subprocess cluster shared by a test module."""
    from jaxdist import LocalCluster

    with LocalCluster(num_workers=2, num_ps=2) as c:
        yield c
