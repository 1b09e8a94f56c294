"""The docs' local Sphinx extensions (docs/_ext/jaxdist_sphinx) are importable by these tests."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXT = ROOT / "docs" / "_ext"
if str(EXT) not in sys.path:
    sys.path.insert(0, str(EXT))
