"""The ``--staleness`` option of the PS benchmarks, shared by ``jaxdist_workloads.py`` and ``netbench.py``.

No imports beyond the standard library and no side effects: ``netbench.py`` (the driver, which
starts no jaxdist task itself) imports it without pulling in jaxdist, JAX or cloudpickle.
"""

from __future__ import annotations


def parse_staleness(text: str) -> int | None:
    """``--staleness``: "async" (None, asynchronous updates) or an int >= 0 (``ParameterServerStrategy(staleness=)``)."""
    if text == "async":
        return None
    try:
        s = int(text)
    except ValueError:
        s = -1
    if s < 0:
        raise ValueError(f"staleness {text!r}: give async or an int >= 0 (0 is synchronous)")
    return s


def staleness_label(s: int | None) -> str:
    """The label records carry for a staleness mode: "async" or the int."""
    return "async" if s is None else str(s)
