"""``ReduceOp``: how values from several replicas are combined."""

from __future__ import annotations

import enum

__all__ = ["ReduceOp"]


class ReduceOp(enum.Enum):
    """Reduction across replicas, as ``tf.distribute.ReduceOp``.

    ``SUM`` adds the replicas' values; ``MEAN`` adds them and divides by the
    number of values reduced.
    """

    SUM = "SUM"
    MEAN = "MEAN"

    @classmethod
    def coerce(cls, op: ReduceOp | str) -> ReduceOp:
        """``op`` as a ReduceOp; strings are accepted case-insensitively ("sum", "MEAN")."""
        if isinstance(op, ReduceOp):
            return op
        if isinstance(op, str):
            try:
                return cls(op.upper())
            except ValueError:
                pass
        raise ValueError(f"unknown reduce op {op!r}; use ReduceOp.SUM or ReduceOp.MEAN")
