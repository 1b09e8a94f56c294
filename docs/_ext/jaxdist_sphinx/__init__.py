"""Local Sphinx extensions of jaxdist's documentation (docs/conf.py loads them).

- :mod:`jaxdist_sphinx.cliref`: the ``jaxdist-cli`` directive, the CLI reference rendered from
  the argparse parsers of ``jaxdist.tools.cli``.
- :mod:`jaxdist_sphinx.apicheck`: fails the build when a public name (an ``__all__`` entry of
  the public modules, the error classes included) is missing from the API reference.
- :mod:`jaxdist_sphinx.benchtables`: the ``bench-table`` directive, tables read from
  ``bench/results/*.jsonl`` when the docs are built.
- :mod:`jaxdist_sphinx.docstrings`: mends one reST slip common in the docstrings before autodoc reads them.

The directives emit reStructuredText: in a MyST page, use them inside an ``{eval-rst}`` block.
"""

from __future__ import annotations

from typing import Any

from jaxdist_sphinx import apicheck, benchtables, cliref, docstrings


def setup(app: Any) -> dict[str, Any]:
    cliref.setup(app)
    apicheck.setup(app)
    benchtables.setup(app)
    docstrings.setup(app)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
