"""Keras 3 must run on its JAX backend for jaxdist to distribute it: select it, or say why it cannot.

Keras reads ``KERAS_BACKEND`` once, when ``keras`` is first imported; after
that the backend cannot change in the process. So:

- ``keras`` not imported yet: ``KERAS_BACKEND`` is set to ``jax`` (an explicit
  other value is an error: the user asked for something jaxdist cannot serve);
- ``keras`` already imported: its backend must be ``jax``, otherwise
  :class:`~jaxdist.base.errors.ConfigurationError` says how to fix it.
"""

from __future__ import annotations

import logging
import os
import sys

from jaxdist.base.errors import ConfigurationError

logger = logging.getLogger(__name__)

__all__ = ["keras_backend_name", "require_jax_backend"]

ENV = "KERAS_BACKEND"


def keras_backend_name() -> str | None:
    """The backend of the ``keras`` already imported in this process, or None when it is not imported."""
    keras = sys.modules.get("keras")
    if keras is None:
        return None
    try:
        return str(keras.config.backend())
    except AttributeError:  # a partially imported keras (import in progress) or Keras 2
        return getattr(getattr(keras, "backend", None), "backend", lambda: None)()


def require_jax_backend() -> None:
    """Make sure Keras runs (or will run) on JAX; raise ConfigurationError when it cannot.

    Raises:
        ConfigurationError: Keras was imported with another backend, or
            ``KERAS_BACKEND`` names another backend before Keras was imported.
    """
    current = keras_backend_name()
    if current is not None:
        if current != "jax":
            raise ConfigurationError(
                f"Keras was imported with the {current!r} backend; jaxdist distributes Keras only on the JAX backend. "
                f"Set {ENV}=jax in the environment (or `import jaxdist.keras` before the first `import keras`)"
            )
        return
    requested = os.environ.get(ENV)
    if requested is not None and requested.strip().lower() != "jax":
        raise ConfigurationError(
            f"{ENV}={requested!r}, but jaxdist distributes Keras only on the JAX backend: set {ENV}=jax or unset it"
        )
    if requested is None:
        logger.debug("setting %s=jax before Keras is imported", ENV)
    os.environ[ENV] = "jax"
