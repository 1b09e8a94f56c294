"""The optimizers a PS task has been sent, cached by the sha256 of their pickle.

Clients send an optimizer (a cloudpickled optax ``GradientTransformation``)
with its digest; once a PS has it, a digest alone names it (every shard of a
model shares one optimizer, so it is unpickled and jit-compiled once per PS).
The pickled bytes are kept too: a primary forwards them to its backup.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Any

import cloudpickle

from jaxdist.base.errors import InvalidRequestError
from jaxdist.proto import pickling
from jaxdist.ps_server.optimizer import Optimizer

__all__ = ["OptimizerCache", "unpickle"]


def unpickle(blob: bytes, what: str) -> Any:
    """``cloudpickle.loads(blob)``; anything it raises becomes InvalidRequestError (garbage from the wire)."""
    try:
        return cloudpickle.loads(blob)
    except Exception as e:  # noqa: BLE001 - garbage from the wire must not crash the server
        raise InvalidRequestError(f"{what} could not be unpickled: {type(e).__name__}: {e}") from None


class OptimizerCache:
    """Optimizers by digest. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._optimizers: dict[str, Optimizer] = {}
        self._blobs: dict[str, bytes] = {}

    def get(self, blob: bytes, digest: str) -> Optimizer | None:
        """The optimizer of ``blob`` (pickled) / ``digest``; None when both are empty (no optimizer).

        Raises:
            InvalidRequestError: only a digest that is not cached here, a digest that
                does not match its blob, or a blob that is not an optax transformation.
        """
        if not blob and not digest:
            return None
        with self._lock:
            if digest and digest in self._optimizers:
                return self._optimizers[digest]
        if not blob:
            raise InvalidRequestError(f"optimizer {digest[:12]} is not cached here; send its payload")
        real = hashlib.sha256(blob).hexdigest()
        if digest and digest != real:
            raise InvalidRequestError("optimizer digest does not match its payload")
        try:
            opt = Optimizer(unpickle(blob, "optimizer"), real)
        except TypeError as e:
            raise InvalidRequestError(str(e)) from None
        with self._lock:
            self._blobs.setdefault(real, blob)
            return self._optimizers.setdefault(real, opt)

    def blob(self, opt: Optimizer) -> bytes:
        """``opt`` pickled: the bytes it arrived as (same digest on the backup), else a fresh pickle."""
        with self._lock:
            blob = self._blobs.get(opt.digest)
        return blob if blob is not None else pickling.dumps(opt.tx)
