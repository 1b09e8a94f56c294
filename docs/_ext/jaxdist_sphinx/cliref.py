"""The CLI reference, rendered from the argparse parsers the ``jaxdist`` command runs.

``.. jaxdist-cli::`` (no argument) renders the table of subcommands; ``.. jaxdist-cli:: ps``
renders one subcommand: its description, usage line and every flag (Sphinx ``option``
entries under ``.. program:: jaxdist ps``, so pages can link them with ``:option:``), in the
parser's argument groups. After reading every page, the build fails when a subcommand of
``jaxdist.tools.cli.subcommands()`` was rendered nowhere: a new subcommand cannot stay
undocumented.

Where the parsers come from: :func:`jaxdist.tools.cli.build_parser` has a sub-parser per
subcommand. ``jaxdist demo`` and ``jaxdist certs`` build their parsers inside their ``main``
(``jaxdist.tools.demo``, ``jaxdist.tools.certs``), so :func:`capture_parser` calls that
``main`` with ``ArgumentParser.parse_args`` replaced by a function that raises the parser
back: both build the parser first thing, before any work, so nothing else runs.
"""

from __future__ import annotations

import argparse
import functools
from collections.abc import Callable, Iterable
from typing import Any

#: Subcommands whose parser is built inside their ``main`` (module, attribute).
_BUILT_IN_MAIN = {"demo": ("jaxdist.tools.demo", "main"), "certs": ("jaxdist.tools.certs", "main")}
#: argparse's titles of its two default groups: rendered without a heading.
_DEFAULT_GROUPS = {"positional arguments", "optional arguments", "options"}
_USAGE_WIDTH = 96


class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__(parser.prog)
        self.parser = parser


def capture_parser(main: Callable[[list[str]], Any]) -> argparse.ArgumentParser:
    """The parser ``main(argv)`` builds, taken at its ``parse_args`` call (which never returns)."""

    def grab(self: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> Any:
        raise _Captured(self)

    original = argparse.ArgumentParser.parse_args
    argparse.ArgumentParser.parse_args = grab  # type: ignore[assignment,method-assign]
    try:
        main([])
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args = original  # type: ignore[method-assign]
    raise RuntimeError(f"{main!r} returned without parsing its arguments")


@functools.cache
def collect_parsers() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser], dict[str, str]]:
    """``(top-level parser, {subcommand: its parser}, {subcommand: one-line summary})``."""
    import importlib

    from jaxdist.tools import cli

    top = cli.build_parser()
    summaries = cli.subcommands()
    subs: dict[str, argparse.ArgumentParser] = {}
    for action in top._actions:
        if isinstance(action, argparse._SubParsersAction):
            subs.update(action.choices)
    for name, (module, attr) in _BUILT_IN_MAIN.items():
        if name in summaries:
            subs[name] = capture_parser(getattr(importlib.import_module(module), attr))
    missing = sorted(set(summaries) - set(subs))
    if missing:
        raise RuntimeError(f"no parser found for jaxdist subcommand(s) {', '.join(missing)}")
    return top, subs, summaries


def rst_escape(text: str) -> str:
    """``text`` as literal reST inline text (help strings hold ``$JAXDIST_TLS_*``, ``--x``, ...)."""
    out = text.replace("\\", "\\\\")
    for ch in "*`|_[]<>":
        out = out.replace(ch, "\\" + ch)
    return out


def _signature(action: argparse.Action) -> str:
    if not action.option_strings:
        return str(action.metavar or action.dest)
    if action.nargs == 0:
        return ", ".join(action.option_strings)
    if action.metavar is not None:
        metavar = action.metavar if isinstance(action.metavar, str) else " ".join(action.metavar)
    elif action.choices is not None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}"
    else:
        metavar = action.dest.upper()
    return ", ".join(f"{o} {metavar}" for o in action.option_strings)


def _help_text(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if action.help is None:
        return ""
    params: dict[str, Any] = {k: v for k, v in vars(action).items() if v is not argparse.SUPPRESS}
    params["prog"] = parser.prog
    if params.get("choices") is not None:
        params["choices"] = ", ".join(map(str, params["choices"]))
    return str(action.help) % params


def _notes(action: argparse.Action, help_text: str) -> list[str]:
    notes = []
    if action.required and action.option_strings:
        notes.append("Required.")
    if action.choices is not None:
        notes.append("One of " + ", ".join(f"``{c}``" for c in action.choices) + ".")
    default = action.default
    shows_default = "default" in help_text.lower()
    if action.nargs != 0 and not shows_default and default not in (None, argparse.SUPPRESS) and default != []:
        notes.append(f"Default: ``{default}``.")
    if action.nargs == argparse.REMAINDER:
        notes.append("Takes every argument that follows.")
    return notes


def usage(parser: argparse.ArgumentParser) -> str:
    """The usage line at a fixed width (argparse's own wraps at the terminal's)."""
    formatter = parser.formatter_class(prog=parser.prog, width=_USAGE_WIDTH)  # type: ignore[call-arg]
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def render_parser(parser: argparse.ArgumentParser) -> list[str]:
    """reST lines documenting ``parser``: program, description, usage, one ``option`` per flag."""
    lines = [f".. program:: {parser.prog}", ""]
    if parser.description:
        lines += [rst_escape(parser.description), ""]
    lines += [".. code-block:: text", ""]
    lines += ["   " + line for line in usage(parser).splitlines()]
    lines.append("")
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if not isinstance(a, argparse._HelpAction) and a.help is not argparse.SUPPRESS]
        if not actions:
            continue
        if group.title and group.title not in _DEFAULT_GROUPS:
            lines += [f".. rubric:: {rst_escape(group.title)}", ""]
            if group.description:
                lines += [rst_escape(group.description), ""]
        for action in actions:
            text = _help_text(parser, action)
            body = " ".join(filter(None, [rst_escape(text) + ("." if text and not text.endswith(".") else "")]
                                   + _notes(action, text)))
            lines += [f".. option:: {_signature(action)}", ""]
            lines += ["   " + (body or "(no description)"), ""]
    return lines


def render_overview(top: argparse.ArgumentParser, summaries: dict[str, str], link: Callable[[str], str]) -> list[str]:
    """reST lines: the top-level usage and a table of the subcommands (``link(name)`` makes each cell)."""
    lines = [rst_escape(top.description or ""), "", ".. list-table::", "   :header-rows: 1", "", "   * - command",
             "     - what it does"]
    for name, summary in summaries.items():
        lines += [f"   * - {link(name)}", f"     - {rst_escape(summary)}"]
    lines.append("")
    return lines


def _names(items: Iterable[str]) -> str:
    return ", ".join(sorted(items))


def setup(app: Any) -> None:
    from docutils.parsers.rst import directives
    from docutils.statemachine import StringList
    from sphinx.errors import SphinxError
    from sphinx.util.docutils import SphinxDirective
    from sphinx.util.nodes import nested_parse_with_titles

    class CLIReferenceError(SphinxError):
        category = "jaxdist CLI reference"

    class JaxdistCLI(SphinxDirective):
        """``.. jaxdist-cli::`` (overview table) or ``.. jaxdist-cli:: NAME`` (one subcommand)."""

        optional_arguments = 1
        option_spec = {"anchor-prefix": directives.unchanged}

        def run(self) -> list[Any]:
            from docutils import nodes

            top, subs, summaries = collect_parsers()
            if not self.arguments:
                lines = render_overview(top, summaries, lambda n: f":ref:`jaxdist {n} <cli-{n}>`")
            else:
                name = self.arguments[0]
                if name not in subs:
                    raise self.error(f"jaxdist has no subcommand {name!r} (it has {_names(subs)})")
                per_doc = self.env.__dict__.setdefault("jaxdist_cli_rendered", {})
                per_doc.setdefault(self.env.docname, set()).add(name)
                lines = render_parser(subs[name])
            node = nodes.container()
            nested_parse_with_titles(self.state, StringList(lines, source="jaxdist-cli"), node)
            return node.children

    def purge(app: Any, env: Any, docname: str) -> None:
        getattr(env, "jaxdist_cli_rendered", {}).pop(docname, None)

    def merge(app: Any, env: Any, docnames: set[str], other: Any) -> None:
        mine = env.__dict__.setdefault("jaxdist_cli_rendered", {})
        for docname, names in getattr(other, "jaxdist_cli_rendered", {}).items():
            if docname in docnames:
                mine[docname] = names

    def check(app: Any, env: Any) -> None:
        rendered = set().union(*getattr(env, "jaxdist_cli_rendered", {}).values())
        missing = set(collect_parsers()[2]) - rendered
        if missing:
            raise CLIReferenceError(f"jaxdist subcommand(s) missing from the CLI reference: {_names(missing)} "
                                    "(add `.. jaxdist-cli:: NAME` to docs/cli.md)")

    app.add_directive("jaxdist-cli", JaxdistCLI)
    app.connect("env-purge-doc", purge)
    app.connect("env-merge-info", merge)
    app.connect("env-check-consistency", check)
