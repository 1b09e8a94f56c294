"""The documentation builds with warnings as errors, and its public-name check holds on what was built.

The build runs as CI's and a user's would (``python -m sphinx -W --keep-going -b html docs OUT``)
in a subprocess, into a temporary folder: nothing is written into docs/. Then the inventory the
build wrote (``objects.inv``, every object the reference documents) is read back, and the
extension's public-name check is shown to pass on it and to fail, naming the name, when one
public name is taken out of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
BUILD_TIMEOUT_S = 540


def _source_tree() -> dict[str, int]:
    """docs/'s files and their modification times (compiled Python caches left out)."""
    return {str(p.relative_to(DOCS)): p.stat().st_mtime_ns for p in DOCS.rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and "_build" not in p.parts}


def read_inventory(path: Path) -> set[str]:
    """The object names of a Sphinx ``objects.inv`` (format version 2: four header lines, then zlib)."""
    data = path.read_bytes()
    header_end = 0
    for _ in range(4):
        header_end = data.index(b"\n", header_end) + 1
    assert data.startswith(b"# Sphinx inventory version 2"), data[:40]
    names = set()
    for line in zlib.decompress(data[header_end:]).decode().splitlines():
        name, _, rest = line.partition(" ")
        if rest.startswith("py:"):
            names.add(name)
    return names


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("html")
    before = _source_tree()
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    res = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False,
    )
    assert res.returncode == 0, f"the docs do not build with -W:\n{res.stdout[-6000:]}\n{res.stderr[-6000:]}"
    assert _source_tree() == before, "the build wrote into docs/"
    return out


@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
def test_docs_build_with_warnings_as_errors(built: Path) -> None:
    for page in ("index", "getting-started", "cli", "api/index", "api/sync", "benchmarks", "changelog", "layout"):
        assert (built / f"{page}.html").is_file(), page
    cli = (built / "cli.html").read_text()
    assert "--register-with" in cli and "--tls-dir" in cli and "--count" in cli  # worker, launch, workers flags
    bench = (built / "benchmarks.html").read_text()
    assert "34,888.3" in bench  # compare_tf_sealed_quiet.jsonl's jaxdist no-op closures/s, read at build time


@pytest.mark.slow
@pytest.mark.timeout(BUILD_TIMEOUT_S + 60)
def test_public_name_check_passes_and_fails_when_a_name_is_removed(built: Path) -> None:
    os.environ.setdefault("KERAS_BACKEND", "jax")  # as docs/conf.py: jaxdist.keras is among the public modules
    from jaxdist_sphinx.apicheck import missing_names, public_names

    required = public_names()
    documented = read_inventory(built / "objects.inv")
    assert missing_names(required, documented) == []
    assert "jaxdist.ParameterServerStrategy" in documented and "jaxdist.errors.StepMembershipError" in documented

    # Take one entry out of the reference: its name and the canonical name autodoc registers with it
    # (jaxdist.errors.X is defined in jaxdist.base.errors).
    without = {n for n in documented if n.rpartition(".")[2] != "StepMembershipError"}
    assert len(documented) - len(without) == 2
    assert missing_names(required, without) == ["jaxdist.base.errors.StepMembershipError",
                                                "jaxdist.errors.StepMembershipError"]
    assert missing_names(required, documented - {"jaxdist.sync.AXIS"}) == ["jaxdist.sync.AXIS"]
