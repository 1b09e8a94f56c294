"""Benchmark tables read from ``bench/results/`` when the docs are built (never copied by hand).

::

    .. bench-table:: bench/results/compare_tf_sealed_quiet.jsonl
       :where: kind=summary
       :last-by: workload
       :caption: Same host, 5 rounds

       workload: workload
       tf_median: TF 2.21
       jaxdist_median: jaxdist

The argument is a file relative to the repository root, or a glob of files (``bench/results/
compare_tf*.jsonl``, read in name order): JSON lines (one record per line) or a JSON document with
``:records: a.b`` naming the list of records inside it. Every record gets the field ``_file``
(the file's name). ``:carry: run`` copies the last value a field had in an earlier record of the
same file into the records that lack it (a results file that appends runs may mark each with a
``{"run": "..."}`` line before it). ``:where:`` keeps
the records whose fields equal the given values (``key=value,key2=value2``; a value is compared
with the field's JSON text, strings unquoted). ``:last-by:`` keeps, for each value of those
fields, the last record (a results file appends every run; summaries may repeat). Each content
line is ``field: column header``. A value is printed as recorded (:func:`format_value`): whole
numbers get thousands separators, a float keeps its recorded digits up to 3 decimals (longer
floats, such as a median computed in Python, are rounded to 3), lists are joined with commas,
``true``/``false`` are "yes"/"no", a missing field is "-".
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: The repository root: results paths are relative to it.
ROOT = Path(__file__).resolve().parents[3]


def load_records(path: Path, records: str | None = None, carry: Sequence[str] = ()) -> list[dict[str, Any]]:
    """The records of a results file (its JSON lines, or the list at dotted path ``records``), each
    with ``_file`` set and the ``carry`` fields carried forward (see the module docstring)."""
    text = path.read_text()
    if records is None:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        doc: Any = json.loads(text)
        for key in records.split("."):
            doc = doc[key]
        if not isinstance(doc, list):
            raise ValueError(f"{path.name}: {records} is not a list of records")
        rows = list(doc)
    last: dict[str, Any] = {}
    out = []
    for row in rows:
        row = {**row, "_file": path.name}
        for field in carry:
            if field in row:
                last[field] = row[field]
            elif field in last:
                row[field] = last[field]
        out.append(row)
    return out


def resolve(pattern: str, root: Path = ROOT) -> list[Path]:
    """The files ``pattern`` (relative to ``root``, globs allowed) names, in name order."""
    paths = sorted(p for p in root.glob(pattern) if p.is_file())
    if not paths:
        raise ValueError(f"no results file matches {pattern} (relative to the repository root)")
    return paths


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def parse_where(spec: str | None) -> dict[str, str]:
    """``"kind=summary,rate=1gbit"`` -> ``{"kind": "summary", "rate": "1gbit"}``."""
    out = {}
    for part in filter(None, (p.strip() for p in (spec or "").split(","))):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"where clause {part!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


def select(records: Iterable[dict[str, Any]], where: dict[str, str], last_by: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Records matching ``where``; with ``last_by``, the last one per value of those fields, in first-seen order."""
    kept = [r for r in records if all(k in r and _json_text(r[k]) == v for k, v in where.items())]
    if not last_by:
        return kept
    last: dict[tuple[str, ...], dict[str, Any]] = {}  # insertion order: each key's first occurrence
    for r in kept:
        last[tuple(_json_text(r.get(f)) for f in last_by)] = r
    return list(last.values())


def format_value(value: Any) -> str:
    """A recorded value as table text (see the module docstring)."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        text = repr(value)
        if "e" in text or "inf" in text or "nan" in text:
            return text
        decimals = len(text.partition(".")[2])
        return f"{value:,.{min(decimals, 3)}f}"
    if isinstance(value, (list, tuple)):
        return ", ".join(format_value(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k}={format_value(v)}" for k, v in value.items())
    return str(value)


def parse_columns(lines: Iterable[str]) -> list[tuple[str, str]]:
    """Content lines ``field: header`` -> ``[(field, header)]``."""
    out = []
    for line in lines:
        if not line.strip():
            continue
        field, sep, header = line.partition(":")
        if not sep or not field.strip():
            raise ValueError(f"column line {line!r} is not 'field: header'")
        out.append((field.strip(), header.strip() or field.strip()))
    return out


def _cell(text: str) -> str:
    from jaxdist_sphinx.cliref import rst_escape

    return rst_escape(text) if text else "\\ "


def render_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]], caption: str = "") -> list[str]:
    """reST ``list-table`` lines: a header row of the column headers, one row per record."""
    if not rows:
        raise ValueError("no records selected")
    lines = [f".. list-table:: {_cell(caption).strip()}" if caption else ".. list-table::", "   :header-rows: 1", ""]
    for i, (_, header) in enumerate(columns):
        lines.append(("   * - " if i == 0 else "     - ") + _cell(header))
    for row in rows:
        for i, (field, _) in enumerate(columns):
            lines.append(("   * - " if i == 0 else "     - ") + _cell(format_value(row.get(field))))
    lines.append("")
    return lines


def setup(app: Any) -> None:
    from docutils import nodes
    from docutils.parsers.rst import directives
    from docutils.statemachine import StringList
    from sphinx.util.docutils import SphinxDirective

    class BenchTable(SphinxDirective):
        required_arguments = 1
        has_content = True
        option_spec = {
            "carry": directives.unchanged,
            "where": directives.unchanged,
            "last-by": directives.unchanged,
            "records": directives.unchanged,
            "caption": directives.unchanged,
        }

        def run(self) -> list[Any]:
            def fields(option: str) -> list[str]:
                return [f.strip() for f in self.options.get(option, "").split(",") if f.strip()]

            try:
                records = []
                for path in resolve(self.arguments[0]):
                    self.env.note_dependency(str(path))
                    records += load_records(path, self.options.get("records"), fields("carry"))
                rows = select(records, parse_where(self.options.get("where")), fields("last-by"))
                lines = render_table(rows, parse_columns(self.content), self.options.get("caption", ""))
            except (ValueError, KeyError) as e:
                raise self.error(f"bench-table {self.arguments[0]}: {e}") from None
            node = nodes.container(classes=["bench-table"])
            self.state.nested_parse(StringList(lines, source=self.arguments[0]), self.content_offset, node)
            return [node]

    app.add_directive("bench-table", BenchTable)
