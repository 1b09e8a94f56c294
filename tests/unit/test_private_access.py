"""Private names stay where they are defined: a count of reaches into other objects' and modules' privates.

A leading underscore says "internal to this class or module". A module that
reads another object's ``_state`` or imports another module's ``_helper``
depends on details its owner may change at any time, and such reaches are
how one class ends up spread over several files. This test counts them in
the library's folders and keeps them down: the sync wing (``sync/``, the
package ``jaxdist.sync``) below :data:`SYNC_LIMIT`, the whole library within
:data:`LIBRARY_BUDGET`.

What counts (one per occurrence):

(a) *cross-object private access*: ``x._name`` (one or more leading
    underscores, not a ``__dunder__``), and ``getattr``/``hasattr``/
    ``setattr``/``delattr`` of ``x`` with a literal private name, where ``x`` is
    not the object's own:

    - ``self``, ``cls``, ``super()`` and ``type(self)`` are its own;
    - so is the name of a class whose body encloses the access (a class
      reaching its own class attributes, e.g. ``_Packed._one`` inside ``_Packed``);
    - so is a name bound to the module itself (``import jaxdist.sync.context
      as ctx_lib`` inside ``sync/context.py``);
    - the standard library's documented underscore APIs are public:
      ``os._exit``, ``sys._getframe``, and a namedtuple's ``_replace``,
      ``_asdict``, ``_fields``, ``_make``.

    - a private attribute that the same module defines (a class of the
      module sets ``self._name``, assigns or defines ``_name`` in its body or
      lists it in ``__slots__``) is the module's own: the underscore means
      "internal to this module", so a pytree flatten function or a sibling
      class of the same file may use it. (Matched by name: a foreign object's
      attribute of the same name in that module is not seen.)

    Everything else counts, third-party privates too (Keras's, JAX's): a
    reach into a library's internals is the same kind of dependency.

(b) *cross-module import of an underscore name*: ``from jaxdist.x import _y``
    in any module but ``jaxdist.x`` itself. Importing a module whose name
    starts with an underscore (``from jaxdist.sync._varying import f``) does
    not count: that is how a package keeps a module to itself.

Figures (``python tests/unit/test_private_access.py [-v]`` prints them):
at the start of this rule (commit 13dc916, the sync wing just moved to
``sync/``) the library had 196 reaches, 168 in the sync wing (``loops.py``
alone 64); counting ``x._name`` alone gave 159 and 132. Once the strategies
had their engine (:mod:`jaxdist.sync.engine`): 25 and 1 (JAX's
``Tracer._trace``, which has no public equivalent). Once the Keras wing's
reaches into Keras moved behind :mod:`jaxdist.keras.compat` (13 of them are
there, the one module allowed to touch Keras internals): 21 and 1.
"""

from __future__ import annotations

import ast
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: Library folder -> the package it is installed as: the layer test's map (pyproject's package-dir).
from test_layers import FOLDERS  # noqa: E402

#: The sync wing's reaches must stay below this.
SYNC_LIMIT = 10

#: The whole library's reaches may not exceed this (the count once the sync engine and the Keras
#: fence landed). Lower it when you remove reaches; never raise it to let a new one in.
LIBRARY_BUDGET = 17

#: ``module.name`` pairs of the standard library that are public despite the underscore.
_STDLIB_PUBLIC = {("os", "_exit"), ("sys", "_getframe")}
#: namedtuple's public methods and attributes (underscored so they cannot clash with field names).
_NAMEDTUPLE_API = {"_replace", "_asdict", "_fields", "_make", "_field_defaults"}
_ATTR_FUNCTIONS = {"getattr", "hasattr", "setattr", "delattr"}


@dataclass(frozen=True)
class Reach:
    """One private reach: where, and what."""

    path: str
    line: int
    kind: str  # "access" or "import"
    text: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.kind} {self.text}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_private_attributes(tree: ast.Module) -> set[str]:
    """The private attribute names the module's own classes define (see the module docstring)."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(item.name)
                targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []
                for t in targets:
                    if isinstance(t, ast.Name):
                        out.add(t.id)
                        if t.id == "__slots__" and isinstance(item.value, (ast.Tuple, ast.List)):
                            out.update(e.value for e in item.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.ctx, ast.Store)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("self", "cls")
        ):
            out.add(node.attr)
    return {n for n in out if is_private(n)}


def _own_module_aliases(tree: ast.Module, module: str) -> set[str]:
    """Names bound to the module itself by its own imports (``import jaxdist.sync.context as ctx_lib``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.asname for a in node.names if a.name == module and a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.update(a.asname or a.name for a in node.names if f"{node.module}.{a.name}" == module)
    return out


class _Counter(ast.NodeVisitor):
    def __init__(self, path: str, module: str, own_aliases: set[str], module_privates: set[str]) -> None:
        self.path = path
        self.module = module
        self.own = {"self", "cls"} | own_aliases
        self.module_privates = module_privates
        self.classes: list[str] = []
        self.found: list[Reach] = []

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.classes.append(node.name)
        self.generic_visit(node)
        self.classes.pop()

    def _is_own(self, value: ast.expr) -> bool:
        if isinstance(value, ast.Name):
            return value.id in self.own or value.id in self.classes
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
            if value.func.id == "super":
                return True
            if value.func.id == "type" and len(value.args) == 1 and isinstance(value.args[0], ast.Name):
                return value.args[0].id in ("self", "cls")
        return False

    def _reach(self, node: ast.AST, value: ast.expr, name: str) -> None:
        if not is_private(name) or name in self.module_privates or self._is_own(value) or name in _NAMEDTUPLE_API:
            return
        if isinstance(value, ast.Name) and (value.id, name) in _STDLIB_PUBLIC:
            return
        self.found.append(Reach(self.path, getattr(node, "lineno", 0), "access", f"{ast.unparse(value)}.{name}"))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        self._reach(node, node.value, node.attr)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if (
            isinstance(node.func, ast.Name)
            and node.func.id in _ATTR_FUNCTIONS
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            self._reach(node, node.args[0], node.args[1].value)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if not node.level and base.split(".")[0] == "jaxdist" and base != self.module:
            for a in node.names:
                if is_private(a.name):
                    self.found.append(Reach(self.path, node.lineno, "import", f"from {base} import {a.name}"))
        self.generic_visit(node)


def count_source(source: str, path: str = "<source>", module: str = "jaxdist.example") -> list[Reach]:
    """Every private reach in one module's ``source`` (see the module docstring for what counts)."""
    tree = ast.parse(source)
    counter = _Counter(path, module, _own_module_aliases(tree, module), _module_private_attributes(tree))
    counter.visit(tree)
    return counter.found


def module_name(rel: Path) -> str:
    parts = list(rel.with_suffix("").parts)
    rest = [p for p in parts[1:] if p != "__init__"]
    return ".".join([FOLDERS[parts[0]], *rest])


def library_reaches() -> list[Reach]:
    out: list[Reach] = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "_pb2" in path.name or "__pycache__" in path.parts:
                continue
            rel = path.relative_to(ROOT)
            out.extend(count_source(path.read_text(), str(rel), module_name(rel)))
    return out


def _listing(reaches: list[Reach]) -> str:
    return "\n".join(f"  {r}" for r in reaches)


# ---------------------------------------------------------------------------------------
# The counter itself
# ---------------------------------------------------------------------------------------


def test_counter_counts_reaches_into_other_objects_and_modules() -> None:
    source = '''
import os
import sys
import jaxdist.sync.context as ctx_lib
from jaxdist.sync.strategy import _reduce_stacked, AXIS
from jaxdist.sync._varying import varying_outputs

def f(strategy, v):
    strategy._programs.clear()           # counted
    v.distribute_strategy._store(1)      # counted
    getattr(strategy, "_pace", False)    # counted
    ctx_lib._state                       # counted: another module's private
    os._exit(1)
    sys._getframe(1)
    return v._replace(a=1)

class A:
    _shared = 0
    def g(self, other):
        self._x = other._y               # counted once: other's _y (no class here defines it)
        super()._h()
        type(self)._shared
        A._shared
        hasattr(self, "_y")
        getattr(other, "__name__")
'''
    found = count_source(source)
    assert sorted(r.text for r in found) == sorted([
        "from jaxdist.sync.strategy import _reduce_stacked",
        "strategy._programs",
        "v.distribute_strategy._store",
        "strategy._pace",
        "ctx_lib._state",
        "other._y",
    ]), _listing(found)


def test_counter_lets_a_module_use_its_own_privates() -> None:
    source = "import jaxdist.sync.context as ctx_lib\nfrom jaxdist.sync.context import _helper\nctx_lib._state\n"
    assert count_source(source, module="jaxdist.sync.context") == []
    assert len(count_source(source, module="jaxdist.sync.loops")) == 2
    # A class's private attributes are its module's: a flatten function beside it may read them...
    owner = "class P:\n    __slots__ = ('_rows',)\n    def __init__(self):\n        self._stacked = 1\n"
    user = "def flatten(p):\n    return p._stacked, p._rows\n"
    assert count_source(owner + user) == []
    # ...another module may not.
    assert sorted(r.text for r in count_source(user)) == ["p._rows", "p._stacked"]


# ---------------------------------------------------------------------------------------
# The library
# ---------------------------------------------------------------------------------------


def test_the_sync_wing_keeps_to_its_own_privates() -> None:
    sync = [r for r in library_reaches() if r.path.startswith("sync/")]
    assert len(sync) < SYNC_LIMIT, (
        f"the sync wing reaches into private names {len(sync)} times (limit: under {SYNC_LIMIT}); give the owner "
        f"a public method or property (jaxdist.sync.engine.SyncEngine is the strategies' interface) instead:\n"
        f"{_listing(sync)}"
    )


def test_the_library_stays_within_its_budget() -> None:
    found = library_reaches()
    assert len(found) <= LIBRARY_BUDGET, (
        f"the library reaches into private names {len(found)} times, over its budget of {LIBRARY_BUDGET}: "
        f"use the owner's public interface (or add one) instead of the new reach. All of them:\n{_listing(found)}"
    )


if __name__ == "__main__":
    everything = library_reaches()
    per_file = Counter(r.path for r in everything)
    if "-v" in sys.argv:
        print(_listing(everything))
    for path, n in per_file.most_common():
        print(f"{n:4d} {path}")
    sync_total = sum(n for p, n in per_file.items() if p.startswith("sync/"))
    kinds = Counter(r.kind for r in everything)
    print(f"library: {len(everything)} ({kinds['access']} accesses, {kinds['import']} imports); sync wing: {sync_total}")
