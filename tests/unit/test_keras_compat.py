"""Keras behind one fence: every Keras internal jaxdist touches is in jaxdist.keras.compat, listed, and still there.

- Against the installed Keras (in a subprocess: the pytest process stays Keras-free), each entry of
  ``jaxdist.keras.compat.INTERNALS`` exists with the signature it lists, so a Keras upgrade fails in
  ONE test naming every change; the check itself is shown to report a wrong signature and a missing
  attribute.
- By reading the sources (no Keras needed): no library module but compat.py imports ``keras.src``,
  only the Keras integration imports ``keras``, and no module of the integration other than compat.py
  touches a private attribute of another object, a listed private or replaced name, or patches
  anything with ``setattr``; each rule is shown to catch a violation.
- ``docs/keras-internals.md`` names every entry and its table is the registry's.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPAT = ROOT / "keras_integration" / "compat.py"
DOC = ROOT / "docs" / "keras-internals.md"
HAS_KERAS = importlib.util.find_spec("keras") is not None

#: The folders installed as jaxdist's packages (pyproject's package-dir): the library code.
FOLDERS: dict[str, str] = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


# ---------------------------------------------------------------------------------------
# The registry, read from compat.py's source (importing it would import Keras)
# ---------------------------------------------------------------------------------------


def registry_entries(source: str) -> list[dict[str, Any]]:
    """The keyword arguments of every ``Internal(...)`` in compat.py's ``INTERNALS`` (they must be literals)."""
    for node in ast.parse(source).body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == "INTERNALS":
            assert isinstance(node.value, ast.Tuple), "INTERNALS must be a literal tuple of Internal(...)"
            entries = []
            for call in node.value.elts:
                assert isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "Internal", \
                    f"line {call.lineno}: INTERNALS holds Internal(...) records only"
                assert not call.args, f"line {call.lineno}: give Internal(...) keyword arguments"
                entries.append({kw.arg: ast.literal_eval(kw.value) for kw in call.keywords})
            return entries
    raise AssertionError("compat.py has no INTERNALS")


ENTRIES = registry_entries(COMPAT.read_text())
KINDS = ("import", "private", "replaced", "subclassed", "backend")


def _name(path: str) -> str:
    return path.rpartition(".")[2]


#: Private (underscore) attribute names of Keras that jaxdist touches, and the attribute names it replaces.
PRIVATE_NAMES = frozenset(_name(e["path"]) for e in ENTRIES if _name(e["path"]).startswith("_"))
REPLACED_NAMES = frozenset(_name(e["path"]) for e in ENTRIES if e["kind"] == "replaced")


def test_the_registry_is_well_formed() -> None:
    paths = [e["path"] for e in ENTRIES]
    assert len(paths) == len(set(paths)), "a path is listed twice"
    for e in ENTRIES:
        assert e["kind"] in KINDS, e
        assert e["path"].startswith("keras."), e
        assert e.get("use") and e.get("used_by"), f"{e['path']}: say what jaxdist uses it for and where"
        assert all(m.startswith("jaxdist.keras") for m in e["used_by"]), e
        if e.get("on_instance"):
            assert e.get("signature") is None, f"{e['path']}: an instance attribute is not called here"


def test_every_keras_src_import_in_compat_is_registered() -> None:
    """compat.py imports from keras.src only what the registry lists (a module imported whole: its used names)."""
    paths = {e["path"] for e in ENTRIES}
    tree = ast.parse(COMPAT.read_text())
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("keras.src"):
            imported.extend(f"{node.module}.{a.name}" for a in node.names)
    assert imported, "compat.py imports nothing from keras.src?"
    for name in imported:
        assert name in paths or any(p.startswith(name + ".") for p in paths), f"{name} is imported but not registered"


def test_every_private_name_compat_touches_is_registered() -> None:
    """Every ``obj._x`` (and getattr/setattr of a literal ``"_x"``) in compat.py is a registered private name."""
    touched = set()
    for node in ast.walk(ast.parse(COMPAT.read_text())):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            touched.add(node.attr)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "setattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value):
            touched.add(node.args[1].value)
    assert touched, "compat.py touches no private name?"
    assert touched <= PRIVATE_NAMES, f"unregistered private names in compat.py: {sorted(touched - PRIVATE_NAMES)}"


def _imports_compat(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and (node.module == "jaxdist.keras.compat" or (
                node.module == "jaxdist.keras" and any(a.name == "compat" for a in node.names))):
            return True
        if isinstance(node, ast.Import) and any(a.name == "jaxdist.keras.compat" for a in node.names):
            return True
    return False


def test_used_by_names_the_modules_that_use_compat() -> None:
    """Every module an entry names imports jaxdist.keras.compat, and every module importing it is named."""
    named = {m for e in ENTRIES for m in e["used_by"]}
    importers = {module for module, path in library_modules()
                 if module not in ("jaxdist.keras.compat", "jaxdist.keras.__main__")  # the check's command line
                 and _imports_compat(path.read_text())}
    assert named == importers, f"named but not importing compat: {sorted(named - importers)}; " \
                               f"importing compat but named by no entry: {sorted(importers - named)}"


# ---------------------------------------------------------------------------------------
# The fence: the rules, checked on every library module
# ---------------------------------------------------------------------------------------


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _literal_import(node: ast.Call) -> str | None:
    """The module name of ``importlib.import_module("m")`` / ``__import__("m")`` with a literal name."""
    f = node.func
    is_import = (isinstance(f, ast.Name) and f.id in ("__import__", "import_module")) or (
        isinstance(f, ast.Attribute) and f.attr == "import_module")
    if is_import and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return node.args[0].value
    return None


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.append((node.lineno, node.module or ""))
        elif isinstance(node, ast.Call) and (name := _literal_import(node)) is not None:
            out.append((node.lineno, name))
    return out


def fence_violations(module: str, source: str) -> list[str]:
    """Where ``source`` (jaxdist module ``module``) reaches a Keras internal outside jaxdist.keras.compat."""
    if module == "jaxdist.keras.compat":
        return []
    tree = ast.parse(source)
    found = []
    in_keras_wing = module == "jaxdist.keras" or module.startswith("jaxdist.keras.")
    for line, name in _imported_modules(tree):
        if name == "keras.src" or name.startswith("keras.src."):
            found.append(f"{module}:{line}: imports {name} (Keras internals come from jaxdist.keras.compat)")
        elif (name == "keras" or name.startswith("keras.")) and not in_keras_wing:
            found.append(f"{module}:{line}: imports {name} (only jaxdist.keras imports Keras)")
    if not in_keras_wing:
        return found
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            owner_is_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if node.attr in PRIVATE_NAMES:
                found.append(f"{module}:{node.lineno}: .{node.attr} is a Keras internal (use jaxdist.keras.compat)")
            elif _private(node.attr) and not owner_is_self and not node.attr.startswith("_jaxdist"):
                found.append(f"{module}:{node.lineno}: .{node.attr} reads another object's private attribute "
                             "(a Keras one belongs in jaxdist.keras.compat, registered)")
            elif node.attr in REPLACED_NAMES and isinstance(node.ctx, (ast.Store, ast.Del)):
                found.append(f"{module}:{node.lineno}: assigns .{node.attr}, an attribute jaxdist replaces in Keras "
                             "(only jaxdist.keras.compat replaces)")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id in ("setattr", "delattr"):
                found.append(f"{module}:{node.lineno}: {node.func.id}() (patching goes through jaxdist.keras.compat)")
            elif node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value in PRIVATE_NAMES:
                found.append(f"{module}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r}) is a Keras internal")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in PRIVATE_NAMES:
            found.append(f"{module}:{node.lineno}: def {node.name} overrides a Keras internal (subclass compat's class)")
    return found


def library_modules() -> list[tuple[str, Path]]:
    out = []
    for package, folder in FOLDERS.items():
        base = ROOT / folder
        for path in sorted(base.glob("*.py")):
            if "_pb2" in path.name:
                continue
            out.append((package if path.stem == "__init__" else f"{package}.{path.stem}", path))
        for sub in sorted(p for p in base.iterdir() if p.is_dir() and (p / "__init__.py").exists()):
            if f"{package}.{sub.name}" in FOLDERS:
                continue  # its own package-dir entry
            for path in sorted(sub.rglob("*.py")):
                rel = path.relative_to(base).with_suffix("").parts
                out.append((".".join([package, *[p for p in rel if p != "__init__"]]), path))
    return out


def test_library_modules_are_found() -> None:
    names = {m for m, _ in library_modules()}
    assert {"jaxdist", "jaxdist.keras.compat", "jaxdist.keras.distribution", "jaxdist.sync.context",
            "jaxdist.cluster_coordinator.coordinator", "jaxdist.base.cluster_resolver.base"} <= names


def test_keras_internals_are_touched_only_in_compat() -> None:
    problems = []
    for module, path in library_modules():
        problems.extend(fence_violations(module, path.read_text()))
    assert not problems, "Keras internals outside jaxdist.keras.compat:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("jaxdist.keras.data", "from keras.src.trainers.data_adapters.data_adapter import DataAdapter\n"),
        ("jaxdist.keras.ps_worker", "def f():\n    import keras.src.backend.jax.trainer\n"),
        ("jaxdist.sync.context", "import importlib\nimportlib.import_module('keras.src.utils')\n"),
        ("jaxdist.sync.context", "def f():\n    import keras\n"),
        ("jaxdist.strategy", "from keras import distribution\n"),
        ("jaxdist.keras.ps_fit", "def f(model, batch):\n    model._symbolic_build(data_batch=batch)\n"),
        ("jaxdist.keras.ps_fit", "def f(model):\n    return model._some_new_private\n"),
        ("jaxdist.keras.backup", "def f(self):\n    self.model._initial_epoch = None\n"),
        ("jaxdist.keras.distribution", "def f(cls, g):\n    cls.fit = g\n"),
        ("jaxdist.keras.distribution", "def f(model, g):\n    model.train_function = g\n"),
        ("jaxdist.keras.distribution", "def f(owner, g):\n    setattr(owner, 'fit', g)\n"),
        ("jaxdist.keras.ps_optimizers", "def f(opt):\n    return getattr(opt, '_learning_rate', None)\n"),
        ("jaxdist.keras.checkpoint", "class C:\n    def _save_model(self, epoch, batch, logs):\n        pass\n"),
        ("jaxdist.keras.checkpoint", "class C(B):\n    def save(self):\n        super()._save_model(1, 2, 3)\n"),
    ],
)
def test_the_fence_catches_a_violation(module: str, source: str) -> None:
    assert fence_violations(module, source), f"not caught in {module}:\n{source}"


def test_the_fence_lets_compat_users_through() -> None:
    source = (
        "import keras\n"
        "from jaxdist.keras import compat\n"
        "from jaxdist.keras.compat import DataAdapter\n"
        "class Batches(DataAdapter):\n"
        "    def __init__(self):\n"
        "        self._len = None\n"
        "def f(model, fn):\n"
        "    compat.symbolic_build(model, None)\n"
        "    fn._jaxdist_bounded = True\n"
        "    return model.fit, getattr(model, '_is_default', False)\n"
    )
    assert not fence_violations("jaxdist.keras.data", source)
    assert not fence_violations("jaxdist.keras.compat", "from keras.src.utils import rng_utils\nx = m._symbolic_build\n")


# ---------------------------------------------------------------------------------------
# The page that lists them
# ---------------------------------------------------------------------------------------

TABLE_BEGIN = "<!-- BEGIN generated: python -m jaxdist.keras --table -->"
TABLE_END = "<!-- END generated -->"


def doc_table() -> str:
    text = DOC.read_text()
    assert TABLE_BEGIN in text and TABLE_END in text, f"{DOC.relative_to(ROOT)} has no generated table markers"
    return text.split(TABLE_BEGIN, 1)[1].split(TABLE_END, 1)[0].strip("\n") + "\n"


def test_the_page_names_every_internal() -> None:
    text = DOC.read_text()
    assert text.startswith("# Keras internals jaxdist relies on\n")
    missing = [e["path"] for e in ENTRIES if f"`{e['path']}`" not in text]
    assert not missing, f"docs/keras-internals.md does not name: {missing} (regenerate its table: python -m jaxdist.keras --table)"


def test_the_page_counts_the_registry() -> None:
    """The summary table's counts per kind (and the total) are the registry's."""
    text = DOC.read_text()
    stated = {}
    for line in text.split(TABLE_BEGIN, 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 2 and cells[0].strip("`") in KINDS and cells[1].isdigit():
            stated[cells[0].strip("`")] = int(cells[1])
    counts = {k: sum(e["kind"] == k for e in ENTRIES) for k in KINDS}
    assert stated == counts, f"docs/keras-internals.md states {stated}, the registry has {counts}"
    assert f"The registry holds {len(ENTRIES)} entries" in text


def test_the_page_names_nothing_unregistered() -> None:
    paths = {e["path"] for e in ENTRIES}
    rows = [line for line in doc_table().splitlines() if line.startswith("| `")]
    listed = {row.split("`")[1] for row in rows}
    assert listed == paths, f"table vs registry: extra {sorted(listed - paths)}, missing {sorted(paths - listed)}"


# ---------------------------------------------------------------------------------------
# Against the installed Keras (one subprocess)
# ---------------------------------------------------------------------------------------

_CHECK = r"""
import dataclasses, json, sys
from jaxdist.keras import compat

entries = {e.path: e for e in compat.INTERNALS}
fit = entries["keras.src.backend.jax.trainer.JAXTrainer.fit"]
wrong = (
    dataclasses.replace(fit, signature="(self, x=None, y=None, batch_size=32)"),
    dataclasses.replace(entries["keras.Model._symbolic_build"], path="keras.Model._no_such_method"),
    dataclasses.replace(entries["keras.Model._initial_epoch"], path="keras.Model._no_such_attribute"),
    dataclasses.replace(entries["keras.src.utils.rng_utils.get_random_seed"], path="keras.src.no_such_module.get_random_seed"),
    entries["keras.src.utils.rng_utils.get_random_seed"],
)
print("RESULT " + json.dumps({
    "problems": compat.check_internals(),
    "wrong": compat.check_internals(wrong),
    "table": compat.markdown_table(),
}))
"""


@pytest.fixture(scope="module")
def installed() -> dict[str, Any]:
    if not HAS_KERAS:
        pytest.skip("needs the keras extra: pip install 'jaxdist[keras]'")
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env.pop("KERAS_BACKEND", None)
    proc = subprocess.run([sys.executable, "-c", _CHECK], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    result: dict[str, Any] = json.loads(line.removeprefix("RESULT "))
    return result


@pytest.mark.timeout(300)
def test_every_internal_is_there_with_its_signature(installed: dict[str, Any]) -> None:
    """THE test a Keras upgrade fails: each line names an internal that moved or changed (docs/keras-internals.md)."""
    assert not installed["problems"], "the installed Keras differs from what jaxdist relies on:\n" + "\n".join(installed["problems"])


@pytest.mark.timeout(300)
def test_the_check_reports_changes(installed: dict[str, Any]) -> None:
    """The comparison can fail: a wrong signature, a missing method, instance attribute and module are each reported."""
    wrong = installed["wrong"]
    assert len(wrong) == 4, wrong
    assert wrong[0].startswith("keras.src.backend.jax.trainer.JAXTrainer.fit: signature changed: expected "
                               "(self, x=None, y=None, batch_size=32), found (self, x=None"), wrong[0]
    assert wrong[1].startswith("keras.Model._no_such_method: missing"), wrong[1]
    assert wrong[2].startswith("keras.Model._no_such_attribute: missing"), wrong[2]
    assert wrong[3].startswith("keras.src.no_such_module.get_random_seed: missing"), wrong[3]


@pytest.mark.timeout(300)
def test_the_page_shows_the_registry(installed: dict[str, Any]) -> None:
    assert doc_table() == installed["table"], (
        "docs/keras-internals.md's table differs from the registry: paste `python -m jaxdist.keras --table` between its markers")
