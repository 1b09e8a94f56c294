"""Task processes import only what they need; ``import jaxdist`` imports its public names when first used.

``jaxdist/__init__`` runs first in every process that imports anything of jaxdist: a PS
(``python -m jaxdist.ps_server``), a worker (``python -m jaxdist.worker``), a worker host. When it imported
the whole public API (the sync wing, optax, the metrics, the coordinator) every task process paid for
modules it never uses. Each check runs in a fresh interpreter (a subprocess): this test process has
imported everything already.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from jaxdist.base.task_process import MALLOC_ENV

#: Modules a PS or worker task must not import just by starting: the sync wing, the Keras integration and
#: Keras (with the scikit-learn Keras's wrappers import), the coordinator side of the public API.
NOT_IN_A_TASK = (
    "jaxdist.sync",
    "jaxdist.keras",
    "keras",
    "sklearn",
    "jaxdist.metrics",
    "jaxdist.strategy",
    "jaxdist.cluster_coordinator",
    "jaxdist.local_cluster",
)


def _modules_after(code: str) -> tuple[set[str], str]:
    """The names in ``sys.modules`` of a fresh interpreter after ``code`` ran (or exited), and its stdout."""
    program = textwrap.dedent("""
        import atexit, json, os, sys
        def _report():
            with open(os.environ["MODULES_OUT"], "w") as f:
                json.dump(sorted(sys.modules), f)
        atexit.register(_report)
    """) + textwrap.dedent(code)
    out = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"jaxdist-modules-{os.getpid()}-{abs(hash(code))}.json")
    # The task environment up front, as LocalCluster starts tasks: no re-exec, which would lose the atexit hook.
    env = {**os.environ, **MALLOC_ENV, "MODULES_OUT": out, "JAX_PLATFORMS": "cpu"}
    env.pop("KERAS_BACKEND", None)
    try:
        res = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
        assert res.returncode == 0, res.stderr
        with open(out) as f:
            return set(json.load(f)), res.stdout
    finally:
        if os.path.exists(out):
            os.remove(out)


def _loaded(modules: set[str], name: str) -> bool:
    return any(m == name or m.startswith(name + ".") for m in modules)


#: ... and a worker (which applies no optimizer: the PS does) neither the PS's store nor optax, unless a closure
#: it runs refers to them.
NOT_IN_A_WORKER = ("jaxdist.ps_server.store", "jaxdist.ps_server.optimizer", "optax")


@pytest.mark.parametrize(("entry", "not_imported"), [
    ("jaxdist.ps_server", NOT_IN_A_TASK),
    ("jaxdist.worker", NOT_IN_A_TASK + NOT_IN_A_WORKER),
    ("jaxdist.worker.host", NOT_IN_A_TASK + NOT_IN_A_WORKER),
])
def test_a_task_process_imports_no_sync_wing_keras_or_coordinator(entry: str, not_imported: tuple[str, ...]) -> None:
    # The entry module exactly as `python -m <entry>` runs it, stopped at its flag parsing (--help exits 0).
    modules, stdout = _modules_after(f"""
        import runpy
        sys.argv = [{entry!r}, "--help"]
        try:
            runpy.run_module({entry!r}, run_name="__main__", alter_sys=True)
        except SystemExit as e:
            assert e.code in (0, None), e.code
    """)
    assert stdout.startswith("usage:"), stdout  # the entry really ran, up to its flags
    loaded = [name for name in not_imported if _loaded(modules, name)]
    assert not loaded, f"python -m {entry} imports {loaded}: a task process imports only what it needs"


def test_import_jaxdist_imports_no_public_module_until_a_name_is_used() -> None:
    modules, _ = _modules_after("import jaxdist\n")
    heavy = [m for m in ("jax", "optax", "grpc", "numpy", "jaxdist.sync", "jaxdist.strategy", "jaxdist.metrics")
             if _loaded(modules, m)]
    assert not heavy, f"import jaxdist imported {heavy}"
    modules, _ = _modules_after("from jaxdist import MirroredStrategy\n")
    assert "jaxdist.sync" in modules and "jaxdist.cluster_coordinator" not in modules


def test_every_public_name_resolves_and_is_listed() -> None:
    # A fresh interpreter, so that each name is found through the package's __getattr__, not a module some
    # other test imported.
    program = textwrap.dedent("""
        import json, sys
        import jaxdist
        listed = set(dir(jaxdist))
        missing = [n for n in jaxdist.__all__ if n not in listed]
        values = {n: getattr(jaxdist, n) for n in jaxdist.__all__}
        ns = {}
        exec("from jaxdist import *", ns)
        star = sorted(set(jaxdist.__all__) - set(ns))
        origin = {n: getattr(v, "__module__", getattr(v, "__name__", "")) for n, v in values.items()}
        try:
            jaxdist.no_such_name
            bad = "no AttributeError"
        except AttributeError as e:
            bad = str(e)
        print(json.dumps({"missing": missing, "star": star, "origin": origin, "bad": bad,
                          "strategy": jaxdist.strategy.__name__, "keras": "jaxdist.keras" in sys.modules}))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["missing"] == [] and got["star"] == []
    assert got["origin"]["MirroredStrategy"].startswith("jaxdist.sync")
    assert got["origin"]["ClusterCoordinator"].startswith("jaxdist.cluster_coordinator")
    assert got["origin"]["metrics"] == "jaxdist.metrics"
    assert got["bad"] == "module 'jaxdist' has no attribute 'no_such_name'"
    assert got["strategy"] == "jaxdist.strategy"  # a submodule `import jaxdist` used to import is still an attribute
    assert not got["keras"]  # resolving every public name does not import the Keras integration


def test_the_keras_scope_hook_is_registered_without_the_sync_wing() -> None:
    program = textwrap.dedent("""
        import json, sys
        import jaxdist
        from jaxdist.base import hooks
        before = sorted(hooks.scope_hooks())
        sync_loaded = "jaxdist.sync" in sys.modules
        import jaxdist.sync.hooks as sync_hooks
        print(json.dumps({"before": before, "sync_loaded": sync_loaded,
                          "one_registry": sync_hooks.scope_hooks is hooks.scope_hooks,
                          "after": sorted(sync_hooks.scope_hooks())}))
    """)
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    res = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"before": ["keras"], "sync_loaded": False, "one_registry": True, "after": ["keras"]}
