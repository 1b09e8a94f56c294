"""Unit tests of the docs' local Sphinx extensions (docs/_ext/jaxdist_sphinx), without a build.

The public-name check (a pure function of the public names and the documented ones), the CLI
reference renderer, the benchmark tables and the docstring mend.
"""

from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from jaxdist_sphinx import apicheck, benchtables, cliref, docstrings

ROOT = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------ the public-name check
def exported() -> None:
    """A function some fake public modules export."""


@pytest.fixture
def fake_modules() -> Iterator[None]:
    """``fake_a`` exports ``exported`` under its name and under an alias, and a plain value;
    ``fake_b`` exports the same function."""
    a = types.ModuleType("fake_a")
    a.exported, a.Alias, a.VALUE = exported, exported, 3  # type: ignore[attr-defined]
    a.__all__ = ["exported", "Alias", "VALUE"]  # type: ignore[attr-defined]
    b = types.ModuleType("fake_b")
    b.exported = exported  # type: ignore[attr-defined]
    b.__all__ = ["exported"]  # type: ignore[attr-defined]
    sys.modules.update(fake_a=a, fake_b=b)
    try:
        yield
    finally:
        del sys.modules["fake_a"], sys.modules["fake_b"]


def test_public_names_count_a_re_export_under_the_same_name_as_covered(fake_modules: None) -> None:
    names = apicheck.public_names(["fake_a", "fake_b"])
    here = f"{__name__}.exported"
    assert names == {
        "fake_a.exported": {"fake_a.exported", "fake_b.exported", here},
        "fake_a.Alias": {"fake_a.Alias"},  # an alias under another name needs its own entry
        "fake_a.VALUE": {"fake_a.VALUE"},  # a plain value has no identity to share
        "fake_b.exported": {"fake_a.exported", "fake_b.exported", here},
    }


def test_missing_names_passes_when_every_name_is_documented_and_fails_when_one_is_removed(fake_modules: None) -> None:
    required = apicheck.public_names(["fake_a", "fake_b"])
    documented = {"fake_a.exported", "fake_a.Alias", "fake_a.VALUE", "fake_a.unrelated"}
    assert apicheck.missing_names(required, documented) == []
    # fake_b.exported is covered by fake_a.exported (the same object, the same name): one entry.
    assert apicheck.missing_names(required, documented - {"fake_a.VALUE"}) == ["fake_a.VALUE"]
    assert apicheck.missing_names(required, documented - {"fake_a.exported"}) == ["fake_a.exported", "fake_b.exported"]
    # The defining module's name covers it too (what autodoc registers as the canonical name).
    assert apicheck.missing_names(required, documented - {"fake_a.exported"} | {f"{__name__}.exported"}) == []
    assert apicheck.missing_names(required, set()) == sorted(required)


def test_the_checked_modules_are_the_public_ones() -> None:
    assert set(apicheck.PUBLIC_MODULES) >= {"jaxdist", "jaxdist.sync", "jaxdist.keras", "jaxdist.base.errors",
                                             "jaxdist.cluster_resolver"}


# ------------------------------------------------------------------ the CLI reference
def _sample_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdist sample", description="Do a sample thing.")
    p.add_argument("--count", type=int, required=True, help="how many")
    p.add_argument("--rate", type=float, default=2.5, help="per second (default %(default)s)")
    p.add_argument("--mode", choices=["a", "b"], default="a", help="which mode")
    p.add_argument("--dry-run", action="store_true", help="change nothing")
    g = p.add_argument_group("TLS (default: $JAXDIST_TLS_*)")
    g.add_argument("--tls-cert", metavar="PEM", help="certificate (default: $JAXDIST_TLS_CERT)")
    p.add_argument("--hidden", help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, help="command, after --")
    return p


def test_render_parser_documents_every_flag_with_its_help_and_default() -> None:
    lines = cliref.render_parser(_sample_parser())
    text = "\n".join(lines)
    assert lines[0] == ".. program:: jaxdist sample"
    assert "Do a sample thing." in text
    assert ".. code-block:: text" in text and "   usage: jaxdist sample [-h] --count COUNT" in text
    assert ".. option:: --count COUNT" in text and "how many. Required." in text
    assert ".. option:: --rate RATE" in text and "per second (default 2.5)." in text
    assert "Default: ``2.5``" not in text  # the help already says it
    assert ".. option:: --mode {a,b}" in text and "One of ``a``, ``b``. Default: ``a``." in text
    assert ".. option:: --dry-run" in text and "change nothing." in text
    assert ".. rubric:: TLS (default: $JAXDIST\\_TLS\\_\\*)" in text
    assert ".. option:: --tls-cert PEM" in text and "$JAXDIST\\_TLS\\_CERT" in text
    assert ".. option:: command" in text and "Takes every argument that follows." in text
    assert "--hidden" not in text.split(".. option::", 1)[1]  # suppressed flags stay out (the usage line has them too)
    assert "-h, --help" not in text


def test_rst_escape_leaves_no_markup() -> None:
    assert cliref.rst_escape("$JAXDIST_TLS_* `x` |y| <z> [w] a\\b") == \
        "$JAXDIST\\_TLS\\_\\* \\`x\\` \\|y\\| \\<z\\> \\[w\\] a\\\\b"


def test_capture_parser_takes_the_parser_main_builds_and_runs_nothing_after() -> None:
    ran: list[str] = []

    def main(argv: list[str]) -> int:
        p = argparse.ArgumentParser(prog="x")
        p.add_argument("--y", default=1)
        p.parse_args(argv)
        ran.append("past parse_args")
        return 0

    parser = cliref.capture_parser(main)
    assert parser.prog == "x" and [a.dest for a in parser._actions] == ["help", "y"]
    assert ran == []
    assert argparse.ArgumentParser.parse_args.__name__ == "parse_args"  # restored
    assert argparse.ArgumentParser(prog="z").parse_args([]) == argparse.Namespace()


def test_every_jaxdist_subcommand_renders_with_all_its_flags() -> None:
    from jaxdist.tools.cli import build_parser, subcommands

    top, subs, summaries = cliref.collect_parsers()
    assert list(summaries) == list(subcommands())
    assert set(subs) == set(summaries) == {"ps", "worker", "workers", "launch", "task", "demo", "status", "certs"}
    for name, parser in subs.items():
        assert parser.prog == f"jaxdist {name}"
        text = "\n".join(cliref.render_parser(parser))
        for action in parser._actions:
            if action.help is not argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
                for option in action.option_strings or [action.dest]:
                    assert f".. option:: {option}" in text or f", {option}" in text, (name, option)
    # build_parser's sub-parsers parse as the subcommands do.
    args = build_parser().parse_args(["ps", "--port", "5", "--no-data-plane"])
    assert (args.command, args.port, args.no_data_plane) == ("ps", 5, True)
    assert build_parser().parse_args(["launch", "--workers", "3", "--", "python", "x.py"]).command == ["--", "python", "x.py"]


# ------------------------------------------------------------------ benchmark tables
def test_format_value_prints_values_as_recorded() -> None:
    f = benchtables.format_value
    assert (f(34888.3), f(1406.9), f(24.798), f(20.566130058703855), f(7)) == ("34,888.3", "1,406.9", "24.798", "20.566", "7")
    assert (f(12345), f(None), f(True), f(False), f([1.5, 2]), f("x")) == ("12,345", "-", "yes", "no", "1.5, 2", "x")
    assert f(6.5536e+06) == "6,553,600.0" and f(1e-07) == "1e-07"


def test_select_filters_and_keeps_the_last_record_per_key() -> None:
    rows = [{"kind": "summary", "w": "a", "v": 1}, {"kind": "config"}, {"kind": "summary", "w": "b", "v": 2},
            {"kind": "summary", "w": "a", "v": 3}, {"kind": "summary", "w": None, "v": 4}]
    where = benchtables.parse_where("kind=summary")
    assert [r["v"] for r in benchtables.select(rows, where)] == [1, 2, 3, 4]
    assert [r["v"] for r in benchtables.select(rows, where, ["w"])] == [3, 2, 4]  # first-seen order, last value
    assert benchtables.select(rows, benchtables.parse_where("v=2")) == [rows[2]]  # JSON text of the field
    with pytest.raises(ValueError, match="key=value"):
        benchtables.parse_where("kind")


def test_load_records_carries_run_markers_forward(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"figure": "f", "v": 1}\n{"run": "second"}\n{"figure": "f", "v": 2}\n\n')
    rows = benchtables.load_records(path, carry=["run"])
    assert [(r.get("run"), r.get("v"), r["_file"]) for r in rows] == [(None, 1, "r.jsonl"), ("second", None, "r.jsonl"),
                                                                       ("second", 2, "r.jsonl")]
    doc = tmp_path / "d.json"
    doc.write_text('{"a": {"b": [{"x": 1}, {"x": 2}]}, "c": 3}')
    assert [r["x"] for r in benchtables.load_records(doc, "a.b")] == [1, 2]
    with pytest.raises(ValueError, match="not a list"):
        benchtables.load_records(doc, "c")


def test_render_table_is_a_list_table_of_the_chosen_columns() -> None:
    lines = benchtables.render_table([{"w": "pull_64MB", "x": 8178.3}, {"w": "push", "x": None}],
                                     benchtables.parse_columns(["w: workload", "x: MB/s"]), caption="Run *1*")
    assert lines == [".. list-table:: Run \\*1\\*", "   :header-rows: 1", "",
                     "   * - workload", "     - MB/s",
                     "   * - pull\\_64MB", "     - 8,178.3",
                     "   * - push", "     - -", ""]
    with pytest.raises(ValueError, match="no records"):
        benchtables.render_table([], [("w", "w")])


def test_the_recorded_results_give_the_tables_the_benchmarks_page_shows() -> None:
    (path,) = benchtables.resolve("bench/results/compare_tf_sealed_quiet.jsonl")
    rows = benchtables.select(benchtables.load_records(path), {"kind": "summary"}, ["workload"])
    assert [r["workload"] for r in rows] == ["noop_closures_per_s", "pull_64MB_MBps", "push_64MB_MBps", "mlp_steps_per_s"]
    assert len(benchtables.resolve("bench/results/compare_tf*.jsonl")) >= 9
    with pytest.raises(ValueError, match="no results file"):
        benchtables.resolve("bench/results/no_such_file*.jsonl")


# ------------------------------------------------------------------ docstrings
def test_mend_separates_a_suffix_glued_to_an_inline_literal() -> None:
    assert docstrings.mend("replicated ``jax.Array``s readable") == "replicated ``jax.Array``\\ s readable"
    assert docstrings.mend("the ``TypedDict``s below, ``x``.") == "the ``TypedDict``\\ s below, ``x``."
    for unchanged in ("``a`` and ``b``", "``x``.", "plain text", "``a``\\ s"):
        assert docstrings.mend(unchanged) == unchanged
