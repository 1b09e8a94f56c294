"""Docstring text that reST reads differently from what its author meant, mended before autodoc parses it.

The package's docstrings are Google style (``Args:``/``Returns:``, read by napoleon) with reST
inline markup. One habit is not valid reST: a plural ``s`` glued to an inline literal
(````jax.Array``s``), whose end-string must be followed by a space or punctuation. It is
rewritten as an escaped space (````jax.Array``\\ s``), which renders as the author wrote it.
"""

from __future__ import annotations

import re
from typing import Any

_GLUED_SUFFIX = re.compile(r"(``[^`\s](?:[^`]*[^`\s])?``)(?=[A-Za-z])")


def mend(line: str) -> str:
    """``line`` with every inline literal directly followed by a letter separated by an escaped space."""
    return _GLUED_SUFFIX.sub(lambda m: m.group(1) + "\\ ", line)


def setup(app: Any) -> None:
    def process(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
        lines[:] = [mend(line) for line in lines]

    app.connect("autodoc-process-docstring", process)
