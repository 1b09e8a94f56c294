"""``python -m jaxdist.keras``: check the installed Keras against what jaxdist relies on (:mod:`jaxdist.keras.compat`).

Prints one line per Keras internal that is missing or changed and exits 1 if any; ``--table`` prints
the registry as the table of ``docs/keras-internals.md`` instead.
"""

from __future__ import annotations

import sys

from jaxdist.keras.compat import main

if __name__ == "__main__":
    sys.exit(main())
