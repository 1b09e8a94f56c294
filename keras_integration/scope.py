"""What ``strategy.scope()`` makes current for Keras (called by :func:`jaxdist.sync.context.enter_scope`).

- the default strategy: nothing (Keras runs on one device, as without jaxdist);
- a synchronous strategy: its :class:`~jaxdist.keras.distribution.StrategyDistribution`
  (one per strategy, so Keras's compiled steps are reused across scopes);
- ``ParameterServerStrategy``: a :class:`~jaxdist.keras.ps_model.PSDistribution`, which notes the
  models built in the scope; their ``fit``/``evaluate`` dispatch closures (:mod:`jaxdist.keras.ps_fit`).

Only called when ``keras`` is already imported, so code that never uses Keras never imports it.
"""

from __future__ import annotations

import contextlib
import logging
import random
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from jaxdist.sync.context import is_default_strategy

logger = logging.getLogger(__name__)

__all__ = ["distribution_for", "keras_scope"]

_lock = threading.Lock()
_distributions: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

def distribution_for(strategy: Any) -> Any:
    """The Keras distribution ``strategy.scope()`` makes current, or None (the default strategy)."""
    if is_default_strategy(strategy):
        return None
    from jaxdist.strategy import ParameterServerStrategy

    with _lock:
        dist = _distributions.get(strategy)
        if dist is not None:
            return dist
        from jaxdist.keras.distribution import StrategyDistribution, install_data_placement

        install_data_placement()
        if isinstance(strategy, ParameterServerStrategy):
            from jaxdist.keras.ps_model import PSDistribution

            dist = PSDistribution(strategy)
        else:
            dist = StrategyDistribution(strategy)
            if dist.num_processes > 1:
                _agree_on_seed()
        _distributions[strategy] = dist
        return dist


def _agree_on_seed() -> None:
    """Every process must initialise the same weights: seed Keras with process 0's seed unless the user did.

    Keras's own ``keras.distribution.initialize`` does the same (its
    ``initialize_rng``); a seed set by the user is kept (then it must be the
    same on every process, as with Keras).
    """
    import keras

    from jaxdist.keras.compat import get_random_seed

    if get_random_seed() is not None:
        return
    from jax.experimental import multihost_utils
    import numpy as np

    seed = int(multihost_utils.broadcast_one_to_all(np.uint32(random.randrange(2**31))))
    logger.info("Keras random seed agreed across processes: %d", seed)
    keras.utils.set_random_seed(seed)


@contextlib.contextmanager
def keras_scope(strategy: Any) -> Iterator[None]:
    """Make ``strategy``'s Keras distribution current for the block (nothing for the default strategy)."""
    dist = distribution_for(strategy)
    if dist is None:
        yield
        return
    with dist.scope():
        yield
