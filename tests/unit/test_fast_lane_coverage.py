"""tests/fast_lane_coverage.py names each library module by its import name (the package-dir mapping puts
``jaxdist.sync`` outside ``jaxdist``'s folder), so its list of modules the fast lane never executes is right."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import fast_lane_coverage  # tests/ is on the path (tests/conftest.py's folder)


def test_every_library_module_is_listed_under_its_import_name() -> None:
    found = fast_lane_coverage.modules()
    assert len(found) > 100
    for path, name in found.items():
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.origin is not None, name
        assert Path(spec.origin).resolve() == path, (name, spec.origin, path)
    assert {"jaxdist", "jaxdist.sync", "jaxdist.keras.__main__", "jaxdist.proto.generate"} <= set(found.values())


def test_the_expected_exceptions_are_library_modules() -> None:
    """An entry of NOT_IN_THE_FAST_LANE that names no module (a module renamed or removed) is stale."""
    names = set(fast_lane_coverage.modules().values())
    assert set(fast_lane_coverage.NOT_IN_THE_FAST_LANE) <= names
