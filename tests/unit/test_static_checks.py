"""The code passes the project's static checks: ruff (lint) and mypy (types), as configured in pyproject.toml.

mypy cannot check the installed names directly: the package-dir mapping puts ``jaxdist`` in
``coordinator/`` and its subpackages in sibling folders, and the editable install is an import
hook mypy does not follow. So the test lays out a ``jaxdist/`` tree of symlinks that mirrors the
mapping in pyproject.toml and checks ``-p jaxdist`` there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=timeout, check=False)


@pytest.mark.timeout(120)
def test_ruff_is_clean() -> None:
    res = _run([sys.executable, "-m", "ruff", "check", "--no-cache", "--output-format", "concise", "."], ROOT, 110)
    assert res.returncode == 0, f"ruff check found problems (fix them or justify an ignore in pyproject):\n{res.stdout}{res.stderr}"


def _package_tree(dst: Path) -> Path:
    """A ``jaxdist/`` tree of symlinks laid out as setuptools' package-dir mapping installs it."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    top = dst / "jaxdist"
    top.mkdir()
    for entry in (ROOT / mapping["jaxdist"]).iterdir():
        if entry.name != "__pycache__":
            os.symlink(entry, top / entry.name)
    for name, folder in mapping.items():
        if name == "jaxdist":
            continue
        parts = name.split(".")[1:]
        assert len(parts) == 1, f"nested package-dir entry {name}: teach this test to lay it out"
        assert not (top / parts[0]).exists(), f"{name} clashes with coordinator/{parts[0]}"
        os.symlink(ROOT / folder, top / parts[0])
    return dst


@pytest.mark.timeout(300)
def test_mypy_is_clean(tmp_path: Path) -> None:
    tree = _package_tree(tmp_path)
    res = _run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(tmp_path / ".mypy_cache"), "-p", "jaxdist"],
        tree, 290,
    )
    assert res.returncode == 0, f"mypy found problems:\n{res.stdout}{res.stderr}"
