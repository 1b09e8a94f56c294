"""The layer rule of the README's Layout, enforced: a lower layer never imports a higher one.

Every ``import`` of a jaxdist module anywhere in a module counts (function-level
and ``TYPE_CHECKING`` imports included: a hidden import is still a dependency).

Layers, bottom to top (a module may import its own layer and the ones below,
except where a row says otherwise):

0. ``jaxdist.base.errors``                   imports nothing of jaxdist
1. ``jaxdist.proto``                          schema, stubs, codec, status mapping, PS wire protocol
2. ``jaxdist.transport``                      gRPC, credentials, data plane
3. ``jaxdist.base``                           task process, monitoring, resolvers, input context
4. ``jaxdist.ps_server``                      the PS role (and its client)
5. ``jaxdist.worker``                         the worker role (uses the PS client)
6. ``jaxdist`` (the public API, ``jaxdist.cluster_coordinator``, ``jaxdist.sync``, ``jaxdist.testing``)
   and ``jaxdist.tools`` (operator tools), which may import each other.

Within layer 6, the Keras integration (``jaxdist.keras``) is imported only by itself and by the
public API's lazy bridge (``jaxdist.keras_bridge``), and never by the sync core (``jaxdist.sync``).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: Folder -> the package it is installed as (pyproject's package-dir).
FOLDERS = {
    "coordinator": "jaxdist",
    "base": "jaxdist.base",
    "transport": "jaxdist.transport",
    "proto": "jaxdist.proto",
    "ps_server": "jaxdist.ps_server",
    "worker": "jaxdist.worker",
    "tools": "jaxdist.tools",
    "sync": "jaxdist.sync",
    "keras_integration": "jaxdist.keras",
}

#: (module prefix, layer, name), most specific prefix first.
LAYERS = [
    ("jaxdist.base.errors", 0, "errors"),
    ("jaxdist.proto", 1, "proto"),
    ("jaxdist.transport", 2, "transport"),
    ("jaxdist.base", 3, "shared base"),
    ("jaxdist.ps_server", 4, "ps_server"),
    ("jaxdist.worker", 5, "worker"),
    ("jaxdist.tools", 6, "tools"),
    ("jaxdist", 6, "public API"),
]


def layer_of(module: str) -> tuple[int, str]:
    for prefix, layer, name in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer, name
    raise ValueError(f"{module} is not a jaxdist module")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    parts = list(rel.with_suffix("").parts)
    pkg = FOLDERS[parts[0]]
    rest = [p for p in parts[1:] if p != "__init__"]
    return ".".join([pkg, *rest])


def jaxdist_imports(source: str, module: str) -> list[tuple[int, str]]:
    """``(line, imported module)`` for every import of a jaxdist module in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "jaxdist")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{module}:{node.lineno}: relative import; write `from jaxdist... import` instead")
            base = node.module or ""
            if base.split(".")[0] != "jaxdist":
                continue
            for a in node.names:
                # `from jaxdist import sync` imports the module jaxdist.sync; `from jaxdist.x import Y` the module jaxdist.x.
                candidate = f"{base}.{a.name}"
                out.append((node.lineno, candidate if _is_module(candidate) else base))
    return out


def _is_module(name: str) -> bool:
    parts = name.split(".")
    for folder, pkg in FOLDERS.items():
        pkg_parts = pkg.split(".")
        if parts[: len(pkg_parts)] == pkg_parts:
            rest = parts[len(pkg_parts):]
            if not rest:
                return True
            p = ROOT / folder / Path(*rest)
            if p.with_suffix(".py").exists() or (p / "__init__.py").exists():
                # A deeper package mapping (e.g. jaxdist.base inside jaxdist) wins when it matches.
                return True
    return False


def violations(module: str, source: str) -> list[str]:
    mine, my_name = layer_of(module)
    found = []
    for line, imported in jaxdist_imports(source, module):
        theirs, their_name = layer_of(imported)
        if theirs > mine:
            found.append(f"{module}:{line} ({my_name}, layer {mine}) imports {imported} ({their_name}, layer {theirs})")
    return found


def package_modules() -> list[Path]:
    files = []
    for folder in FOLDERS:
        files.extend(p for p in (ROOT / folder).rglob("*.py") if "_pb2" not in p.name)
    return sorted(files)


def test_no_layer_imports_a_higher_one() -> None:
    problems = []
    for path in package_modules():
        problems.extend(violations(module_name(path), path.read_text()))
    assert not problems, "layer rule broken (see the README's Layout):\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("jaxdist.ps_server.servicer", "from jaxdist import variables\n"),
        ("jaxdist.worker.servicer", "def f():\n    from jaxdist.strategy import ParameterServerStrategy\n"),
        ("jaxdist.worker.context", "import jaxdist.cluster_coordinator\n"),
        ("jaxdist.ps_server.store", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from jaxdist.sync import MirroredStrategy\n"),
        ("jaxdist.ps_server.client", "from jaxdist.worker.client import WorkerClient\n"),
        ("jaxdist.transport.server", "from jaxdist.base.monitoring import MetricsExporter\n"),
        ("jaxdist.proto.codec", "from jaxdist.transport import channel\n"),
        ("jaxdist.base.errors", "from jaxdist.proto import status\n"),
    ],
)
def test_the_rule_catches_an_upward_import(module: str, source: str) -> None:
    assert violations(module, source), f"{module} importing upward was not caught"


def test_allowed_imports_pass() -> None:
    assert not violations("jaxdist.worker.servicer", "from jaxdist.ps_server.connections import PSConnections\n")
    assert not violations("jaxdist.strategy", "from jaxdist.tools import certs\nfrom jaxdist.worker.context import use\n")
    assert not violations("jaxdist.proto.status", "from jaxdist.base import errors as E\n")


def test_no_bare_folder_imports() -> None:
    """Folders are installed under ``jaxdist``; ``import proto`` would load a second copy of a module."""
    bare = set(FOLDERS) | {"tests"}
    problems = []
    for path in package_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            problems.extend(f"{path.relative_to(ROOT)}:{node.lineno}: {n}" for n in names if n.split(".")[0] in bare)
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------
# The Keras integration is reached through one door
# ---------------------------------------------------------------------------------------

#: The Keras integration (needs the keras extra, selects Keras's backend when imported).
KERAS_WING = "jaxdist.keras"
#: The public API's one lazy bridge to it (a scope hook and jaxdist.SidecarEvaluator).
KERAS_BRIDGE = "jaxdist.keras_bridge"


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _literal_imports(source: str) -> list[tuple[int, str]]:
    """``(line, module)`` of ``importlib.import_module("m")`` / ``__import__("m")`` calls with a literal name."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            if (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
                    isinstance(f, ast.Attribute) and f.attr == "import_module"):
                out.append((node.lineno, node.args[0].value))
    return out


def keras_wing_violations(module: str, source: str) -> list[str]:
    """Imports of the Keras integration that the rule forbids (function-level ones included).

    - the sync core (``jaxdist.sync``) imports neither ``jaxdist.keras`` nor the bridge: Keras reaches
      ``strategy.scope()`` through a scope hook registered in ``jaxdist.sync.hooks``;
    - elsewhere only ``jaxdist.keras`` itself and the bridge (``jaxdist.keras_bridge``) import it.
    """
    if _within(module, KERAS_WING):
        return []
    imports = jaxdist_imports(source, module) + _literal_imports(source)
    found = []
    for line, imported in imports:
        if _within(module, "jaxdist.sync") and (_within(imported, KERAS_WING) or _within(imported, KERAS_BRIDGE)):
            found.append(f"{module}:{line} imports {imported}: the sync core never imports the Keras integration "
                         "(register a scope hook in jaxdist.sync.hooks instead)")
        elif _within(imported, KERAS_WING) and module != KERAS_BRIDGE:
            found.append(f"{module}:{line} imports {imported}: only {KERAS_BRIDGE} reaches into {KERAS_WING}")
    return found


def test_the_keras_integration_is_imported_only_through_the_bridge() -> None:
    problems = []
    for path in package_modules():
        problems.extend(keras_wing_violations(module_name(path), path.read_text()))
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("jaxdist.sync.context", "def _keras_scope(s):\n    from jaxdist.keras.scope import keras_scope\n    return keras_scope(s)\n"),
        ("jaxdist.sync.strategies", "import jaxdist.keras\n"),
        ("jaxdist.sync.loops", "from jaxdist import keras\n"),
        ("jaxdist.sync.context", "import importlib\ndef f():\n    return importlib.import_module('jaxdist.keras.scope')\n"),
        ("jaxdist.sync.context", "def f():\n    from jaxdist.keras_bridge import scope_hook\n"),
        ("jaxdist.strategy", "def f():\n    from jaxdist.keras.sidecar import SidecarEvaluator\n"),
        ("jaxdist", "def __getattr__(name):\n    from jaxdist.keras.sidecar import SidecarEvaluator\n"),
    ],
)
def test_the_rule_catches_an_import_of_the_keras_integration(module: str, source: str) -> None:
    assert keras_wing_violations(module, source), f"{module} importing the Keras integration was not caught"


def test_the_bridge_and_the_integration_may_import_it() -> None:
    assert not keras_wing_violations("jaxdist.keras_bridge", "def f():\n    from jaxdist.keras.scope import keras_scope\n")
    assert not keras_wing_violations("jaxdist.keras.ps_fit", "from jaxdist.keras.data import Batches\n")
    assert not keras_wing_violations("jaxdist.sync.context", "from jaxdist.sync.hooks import entered_scope_hooks\n")
    assert not keras_wing_violations("jaxdist", "from jaxdist import keras_bridge\n")


def test_the_tests_have_one_conftest() -> None:
    """Test modules say ``from conftest import poll_for``: with pytest's default import mode a second
    conftest.py (in a subfolder of tests/) is imported under the same name, and those imports read it
    instead (every hostile, integration and multiprocess module failed to collect)."""
    found = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").rglob("conftest.py"))
    assert found == ["tests/conftest.py"], found
