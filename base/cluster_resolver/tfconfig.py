"""``TF_CONFIG`` (and jaxdist's own ``JAXDIST_CLUSTER``) resolvers."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from jaxdist.base.cluster_resolver.base import ClusterResolver, ClusterSpec, check_jobs, check_task
from jaxdist.base.errors import ConfigurationError

ENV_TF_CONFIG = "TF_CONFIG"
ENV_JAXDIST_CLUSTER = "JAXDIST_CLUSTER"


def parse_config(text_or_dict: str | Mapping[str, Any], source: str) -> dict[str, Any]:
    """Parse and validate a TF_CONFIG-shaped document with TF's rules.

    Rules (``multi_worker_util`` in TF): task types are chief/worker/ps/evaluator;
    at most one chief and one evaluator; the task index is below its job's task
    count; an evaluator may be absent from ``cluster``.
    """
    if isinstance(text_or_dict, Mapping):
        cfg = dict(text_or_dict)
    else:
        try:
            cfg = json.loads(text_or_dict) if text_or_dict.strip() else {}
        except json.JSONDecodeError as e:
            raise ConfigurationError(
                f"{source} is not valid JSON ({e}); expected e.g. "
                '{"cluster": {"worker": ["h1:2222"], "ps": ["h2:2222"]}, "task": {"type": "worker", "index": 0}}'
            ) from None
    if not isinstance(cfg, dict):
        raise ConfigurationError(f"{source} must be a JSON object, got {type(cfg).__name__}")
    cluster = cfg.get("cluster", {}) or {}
    if not isinstance(cluster, dict):
        raise ConfigurationError(f"{source}: 'cluster' must be an object mapping job names to address lists")
    counts = {job: len(tasks or []) for job, tasks in cluster.items()}
    check_jobs(counts, source)
    task = cfg.get("task", {}) or {}
    if not isinstance(task, dict):
        raise ConfigurationError(f"{source}: 'task' must be an object like {{\"type\": \"worker\", \"index\": 0}}")
    ttype = task.get("type")
    if ttype is not None:
        try:
            index = int(task.get("index", 0))
        except (TypeError, ValueError):
            raise ConfigurationError(f"{source}: task index {task.get('index')!r} is not an integer") from None
        check_task(counts, ttype, index, source)
        task = {"type": ttype, "index": index}
    cfg["cluster"] = cluster
    cfg["task"] = task
    return cfg


class TFConfigClusterResolver(ClusterResolver):
    """Reads the cluster from ``TF_CONFIG``, as TF's resolver of that name.

    Kubeflow's TFJob operator injects this variable into every pod, so jaxdist
    runs under TFJob unchanged.
    """

    env_name = "tfconfig"
    detection_priority = 20
    _env_var = ENV_TF_CONFIG

    def __init__(
        self,
        task_type: str | None = None,
        task_id: int | None = None,
        rpc_layer: str | None = None,
        environment: str | None = None,
        token: str | None = None,
        config: str | Mapping[str, Any] | None = None,
    ) -> None:
        raw = config if config is not None else os.environ.get(self._env_var, "")
        cfg = parse_config(raw, self._env_var if config is None else "config")
        self._cfg = cfg
        self._spec = ClusterSpec(cfg["cluster"])
        self.task_type = task_type if task_type is not None else cfg["task"].get("type")
        self.task_id = task_id if task_id is not None else cfg["task"].get("index")
        self.rpc_layer = rpc_layer if rpc_layer is not None else cfg.get("rpc_layer", "grpc")
        self.environment = environment if environment is not None else cfg.get("environment")
        self._token = token

    @classmethod
    def is_env_present(cls) -> bool:
        return bool(os.environ.get(cls._env_var, "").strip())

    def cluster_spec(self) -> ClusterSpec:
        return self._spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._spec!r}, task_type={self.task_type!r}, task_id={self.task_id!r})"


class LocalLauncherClusterResolver(TFConfigClusterResolver):
    """Reads ``JAXDIST_CLUSTER``, set by ``jaxdist launch`` for the script it runs.

    Same JSON as TF_CONFIG; the token comes in ``JAXDIST_TOKEN``.
    """

    env_name = "local"
    detection_priority = 10
    _env_var = ENV_JAXDIST_CLUSTER
