"""Sphinx configuration of jaxdist's documentation.

Build (warnings are errors, as tests/docs/test_docs_build.py builds it):
``pip install -e '.[docs]' && python -m sphinx -W -b html docs docs/_build/html``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# jaxdist.keras (in the API reference) selects Keras's JAX backend when imported; set it before
# anything imports Keras, so the reference is built the same whatever the shell exports.
os.environ["KERAS_BACKEND"] = "jax"
# JAX on the CPU: building the docs needs no accelerator, and importing jaxdist must not grab one.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "_ext"))

project = "jaxdist"
author = "the jaxdist authors"
copyright = "the jaxdist authors, Apache-2.0"
release = version = "0.1.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.viewcode",
    "jaxdist_sphinx",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "**/.ipynb_checkpoints"]

# MyST: ::: fences for containers, "{attribute}" lists off, headings get anchors down to ### so
# pages can link [text](page.md#a-heading).
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: members in source order, signatures with their type hints, no stub files written
# (the build writes nothing into docs/).
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"show-inheritance": True}
autosummary_generate = False
add_module_names = False

# Technical text: "--flag" must stay two hyphens, quotes stay straight.
smartquotes = False

html_theme = "furo"
html_title = "jaxdist"
html_static_path = ["_static"]
html_css_files = ["jaxdist.css"]
