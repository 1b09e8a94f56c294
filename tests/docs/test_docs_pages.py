"""What the documentation pages say stays true of the code: every ``JAXDIST_*`` variable the code
names is on the operating page, every path the layout page cites exists, and the README keeps CI's
test command and stays a front page."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
#: Where jaxdist's code and deployment files live (tests/ and bench/ name their own constants).
CODE_DIRS = ("coordinator", "sync", "keras_integration", "base", "transport", "ps_server", "worker", "tools", "proto",
             "deploy")
_ENV_NAME = re.compile(r"JAXDIST_[A-Z0-9_]+")


def code_variables() -> set[str]:
    """Every ``JAXDIST_*`` name in the code (a pattern such as ``$JAXDIST_TLS_*`` in a help text left out)."""
    found: set[str] = set()
    for folder in CODE_DIRS:
        for path in (ROOT / folder).rglob("*"):
            if path.is_file() and path.suffix in ("", ".py", ".sh", ".sbatch", ".yaml", ".yml", ".md"):
                text = path.read_text(errors="replace")
                found.update(m.group() for m in _ENV_NAME.finditer(text) if text[m.end():m.end() + 1] != "*")
    return found


def test_every_jaxdist_variable_is_on_the_operating_page() -> None:
    names = code_variables()
    assert {"JAXDIST_TOKEN", "JAXDIST_SHM", "JAXDIST_MALLOC_TUNING", "JAXDIST_SLURM_JOBS"} <= names
    page = (DOCS / "operating.md").read_text()
    missing = sorted(n for n in names if not re.search(rf"`{n}`", page))
    assert not missing, f"JAXDIST_* variables the code names but docs/operating.md does not: {missing}"


def layout_rows() -> list[list[str]]:
    """The cells of docs/layout.md's table: layer, folder, installed as, holds, may import."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in (DOCS / "layout.md").read_text().splitlines() if line.startswith("| ")]
    return [r for r in rows[1:] if len(r) == 5]


def test_every_folder_the_layout_page_maps_exists_under_its_import_name() -> None:
    import importlib.util

    rows = layout_rows()
    folders = {p for r in rows for p in re.findall(r"`([\w./-]+)`", r[1])}
    assert {"base/errors.py", "sync/", "keras_integration/", "coordinator/cluster_coordinator/", "docs/"} <= folders
    assert not sorted(p for p in folders if not (ROOT / p).exists()), "docs/layout.md maps paths that do not exist"
    for row in rows:
        for name in re.findall(r"`([\w.]+)`", row[2]):
            spec = importlib.util.find_spec(name)  # where it would load from (parents imported, not it)
            (folder,) = re.findall(r"`([\w./-]+)`", row[1])
            assert spec is not None and spec.origin is not None, name
            assert Path(spec.origin).resolve().is_relative_to((ROOT / folder).resolve()), (name, folder)


def test_every_top_level_folder_is_on_the_layout_page() -> None:
    mapped = {p.split("/")[0] for r in layout_rows() for p in re.findall(r"`([\w./-]+)`", r[1])}
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and not p.name.startswith((".", "_")) and p.name not in
               ("build", "dist") and not p.name.endswith(".egg-info") and any(p.iterdir())}
    assert not sorted(folders - mapped), "top-level folders docs/layout.md does not map"


def test_readme_is_a_front_page_that_keeps_ci_s_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    quick_start = readme.split("## Quick start", 1)[1]
    blocks = re.findall(r"```bash\n(.*?)\n```", quick_start, re.S)
    assert blocks[0] == "python3 -m venv .venv && . .venv/bin/activate && pip install -e '.[demo]' && jaxdist demo"
    ci = (ROOT / ".ci" / "run").read_text()
    assert blocks[1] == "python3 -m venv .venv && . .venv/bin/activate && pip install -q -e '.[test]' && pytest"
    assert blocks[1] in ci, ".ci/run runs the README's test command"
    for link in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / link).is_file(), link
