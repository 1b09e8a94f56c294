"""Cluster resolvers: where the tasks are and which one this process is.

Detection order (:func:`detect`), first match wins:

1. ``JAXDIST_CLUSTER_RESOLVER=<name>`` forces one resolver (``local``, ``tfconfig``, ``slurm``).
2. ``JAXDIST_CLUSTER`` set (by ``jaxdist launch``) -> :class:`LocalLauncherClusterResolver`.
3. ``TF_CONFIG`` set (Kubeflow TFJob, hand-written) -> :class:`TFConfigClusterResolver`.
4. Slurm step variables set -> ``SlurmClusterResolver`` (when available).
5. Cloud TPU VM variables set (``TPU_WORKER_HOSTNAMES``) -> :class:`TPUClusterResolver`.
"""

from __future__ import annotations

import os

from jaxdist.base.cluster_resolver.base import ClusterResolver, ClusterSpec, SimpleClusterResolver
from jaxdist.base.cluster_resolver.tfconfig import LocalLauncherClusterResolver, TFConfigClusterResolver
from jaxdist.base.errors import ConfigurationError

ENV_FORCE = "JAXDIST_CLUSTER_RESOLVER"

__all__ = [
    "ClusterResolver",
    "ClusterSpec",
    "SimpleClusterResolver",
    "TFConfigClusterResolver",
    "LocalLauncherClusterResolver",
    "detect",
]

# Imported for their registration with detect() and as re-exports.
from jaxdist.base.cluster_resolver.slurm import SlurmClusterResolver  # noqa: E402
from jaxdist.base.cluster_resolver.tpu import TPUClusterResolver  # noqa: E402

__all__ += ["SlurmClusterResolver", "TPUClusterResolver"]


def detect() -> ClusterResolver:
    """Return the resolver for this environment (see the module docstring for the order)."""
    registry = sorted(
        (c for c in ClusterResolver._registry if c.detection_priority is not None),
        key=lambda c: c.detection_priority,  # type: ignore[arg-type,return-value]
    )
    forced = os.environ.get(ENV_FORCE, "").strip()
    if forced:
        for cls in registry:
            if cls.env_name == forced:
                return cls()
        raise ConfigurationError(
            f"{ENV_FORCE}={forced!r} names no resolver; choose one of "
            f"{', '.join(str(c.env_name) for c in registry)}"
        )
    for cls in registry:
        if cls.is_env_present():
            return cls()
    raise ConfigurationError(
        "no cluster found in the environment: set TF_CONFIG, run under Slurm (srun) or on a Cloud TPU VM, "
        "run the script through `jaxdist launch --workers N --ps M -- python script.py`, "
        "or pass a SimpleClusterResolver explicitly"
    )
