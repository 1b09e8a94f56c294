"""The build fails when a public name is missing from the API reference.

Public names are the ``__all__`` entries of :data:`PUBLIC_MODULES`. A name counts as documented
when the Python domain holds an object (class, function, data, module, exception, ...) under
that qualified name or under another module's name for the same object with the same last part:
``jaxdist.sync.MirroredStrategy`` is covered by ``jaxdist.MirroredStrategy`` (one object, one
entry in the reference), and by the place that defines it
(``jaxdist.sync.strategies.MirroredStrategy``). An alias under another name
(``CollectiveCommunication``) and plain values (``jaxdist.sync.AXIS``) need entries of their own.

:func:`missing_names` is the check itself, a pure function of the public names and the
documented ones, so a test can show that it fails when a name leaves the reference.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any

#: Modules whose ``__all__`` must be in the reference: the package, the synchronous strategies,
#: the Keras integration, the error classes and the cluster resolvers (and the metrics the
#: package exports as a module).
PUBLIC_MODULES = (
    "jaxdist",
    "jaxdist.sync",
    "jaxdist.keras",
    "jaxdist.base.errors",
    "jaxdist.errors",
    "jaxdist.cluster_resolver",
    "jaxdist.metrics",
)


def _has_identity(obj: Any) -> bool:
    return inspect.isclass(obj) or inspect.isroutine(obj) or inspect.ismodule(obj)


def public_names(modules: Iterable[str] = PUBLIC_MODULES) -> dict[str, set[str]]:
    """``{"module.name": qualified names whose documentation covers it}`` for every ``__all__`` entry."""
    entries: list[tuple[str, Any]] = []
    for modname in modules:
        module = importlib.import_module(modname)
        for name in module.__all__:
            entries.append((f"{modname}.{name}", getattr(module, name)))
    by_object: dict[int, set[str]] = {}
    for qualified, obj in entries:
        if _has_identity(obj):
            names = by_object.setdefault(id(obj), set())
            names.add(qualified)
            if inspect.ismodule(obj):
                names.add(obj.__name__)
            elif getattr(obj, "__module__", None) and getattr(obj, "__qualname__", None):
                names.add(f"{obj.__module__}.{obj.__qualname__}")
    out: dict[str, set[str]] = {}
    for qualified, obj in entries:
        if not _has_identity(obj):
            out[qualified] = {qualified}
            continue
        # Only names that end alike: an alias under another name (CollectiveCommunication for
        # CommunicationImplementation) is a public name of its own and needs its own entry.
        last = qualified.rpartition(".")[2]
        out[qualified] = {q for q in by_object[id(obj)] if q.rpartition(".")[2] == last}
    return out


def missing_names(required: Mapping[str, Iterable[str]], documented: Iterable[str]) -> list[str]:
    """The public names (sorted) none of whose names is among ``documented``."""
    have = set(documented)
    return sorted(name for name, covered_by in required.items() if not have.intersection({name, *covered_by}))


def documented_names(env: Any) -> set[str]:
    """Every qualified name the Python domain of a Sphinx build environment documents."""
    domain = env.get_domain("py")
    return set(domain.objects) | set(domain.modules)


def setup(app: Any) -> None:
    from sphinx.errors import SphinxError

    class MissingPublicNamesError(SphinxError):
        category = "jaxdist API reference"

    def check(app: Any, env: Any) -> None:
        missing = missing_names(public_names(), documented_names(env))
        if missing:
            raise MissingPublicNamesError(
                f"{len(missing)} public name(s) missing from the API reference (docs/api/*.md): " + ", ".join(missing)
            )

    app.connect("env-check-consistency", check)
