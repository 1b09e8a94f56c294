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
        ("jaxdist.transport.rpc", "from jaxdist.base.monitoring import MetricsExporter\n"),
        ("jaxdist.proto.codec", "from jaxdist.transport import rpc\n"),
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
