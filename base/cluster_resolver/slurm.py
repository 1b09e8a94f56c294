"""Slurm resolver: the cluster of a Slurm job step, as TF's ``SlurmClusterResolver``.

Every task of an ``srun`` step runs the same command; each one works out the
whole cluster from the step's environment and picks its own role by rank::

    SLURM_PROCID=3  SLURM_STEP_NUM_TASKS=5
    SLURM_STEP_NODELIST=n[1-2]  SLURM_STEP_TASKS_PER_NODE=3,2
    jobs={"chief": 1, "ps": 2, "worker": 2}

    rank -> (node, local task):  0 n1/0, 1 n1/1, 2 n1/2, 3 n2/0, 4 n2/1
    addresses: host:port_base+local  ->  n1:8888 n1:8889 n1:8890 n2:8888 n2:8889
    jobs in sorted name order take consecutive ranks:
        chief  = [n1:8888]                 (rank 0)
        ps     = [n1:8889, n1:8890]        (ranks 1-2)
        worker = [n2:8888, n2:8889]        (ranks 3-4)  -> rank 3 is worker:0

Differences from TensorFlow's resolver, all where TF is wrong or crashes:

* Nodes are laid out in the step's node-list order (the order Slurm itself
  places ranks in), not in sorted host-name order: TF's string sort puts
  ``n10`` before ``n9`` and then hands rank 0's address to another node. When
  Slurm exports ``SLURMD_NODENAME``/``SLURM_LOCALID`` the computed placement
  of this rank is checked against them, so a mismatch fails loudly.
* ``SLURM_DISTRIBUTION=cyclic`` is honoured (TF assumes block placement).
* Host lists keep zero padding (``node[001-003]``) and may hold several
  bracket groups (``rack[1-2]-n[01-02]``).
* Nodes without GPUs work: with no GPU found nothing is assigned and
  ``CUDA_VISIBLE_DEVICES`` is left alone (TF calls ``nvidia-smi`` and fails).
  GPU ids are taken from the node's own ``CUDA_VISIBLE_DEVICES`` list when
  Slurm set one, and the node's list is remembered in
  ``JAXDIST_SLURM_NODE_GPUS`` so a second resolver in the same (or a child)
  process does not re-split the already narrowed list.
* The task layout and the task type/id are resolved in ``__init__``, so
  ``task_type``/``task_id`` are valid before ``cluster_spec()`` is called.

Environment read: ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` (under
``mpirun``; these win because ``SLURM_PROCID`` is then the batch step's 0),
``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, ``SLURM_STEP_NODELIST``,
``SLURM_STEP_TASKS_PER_NODE``, ``SLURM_DISTRIBUTION``, ``SLURMD_NODENAME``,
``SLURM_LOCALID``, and jaxdist's own ``JAXDIST_SLURM_JOBS`` (the ``jobs``
argument, as JSON ``{"chief": 1, "ps": 2, "worker": 2}`` or
``chief=1,ps=2,worker=2``) and ``JAXDIST_SLURM_PORT_BASE``.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Any

from jaxdist.base.cluster_resolver.base import ClusterResolver, ClusterSpec, check_jobs
from jaxdist.base.errors import ConfigurationError

__all__ = [
    "ENV_NODE_GPUS",
    "ENV_SLURM_JOBS",
    "ENV_SLURM_PORT_BASE",
    "SlurmClusterResolver",
    "expand_hostlist",
    "expand_tasks_per_node",
    "parse_jobs",
    "task_layout",
]

#: The ``jobs`` argument when it is not given: JSON object or ``name=count,...``.
ENV_SLURM_JOBS = "JAXDIST_SLURM_JOBS"
#: The ``port_base`` argument when it is not given (default 8888, as TF).
ENV_SLURM_PORT_BASE = "JAXDIST_SLURM_PORT_BASE"
#: The node's GPU ids before the resolver narrowed ``CUDA_VISIBLE_DEVICES``.
ENV_NODE_GPUS = "JAXDIST_SLURM_NODE_GPUS"

DEFAULT_PORT_BASE = 8888

#: Refuse host lists that would expand to more names than this (a typo guard).
_MAX_HOSTS = 1_000_000

_RANGE_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


# --------------------------------------------------------------------------- parsers


def _split_top_level(hostlist: str) -> list[str]:
    """Split a host list at the commas that are outside ``[...]`` groups."""
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in hostlist:
        if ch == "[":
            if depth:
                raise ValueError("nested '[' inside a range group")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError("']' without a matching '['")
            depth = 0
        elif ch == "," and not depth:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    if depth:
        raise ValueError("'[' without a matching ']'")
    parts.append("".join(cur))
    return parts


def _expand_range_group(group: str) -> list[str]:
    """Expand the inside of one ``[...]`` group, e.g. ``'1-3,7'`` or ``'001-003'``.

    The width of the low bound is kept, so ``08-10`` gives ``08, 09, 10`` and
    ``8-10`` gives ``8, 9, 10`` (Slurm's rule).
    """
    if not group.strip():
        raise ValueError("empty range group '[]'")
    out: list[str] = []
    for item in group.split(","):
        item = item.strip()
        m = _RANGE_ITEM.match(item)
        if m is None:
            raise ValueError(f"bad range {item!r}; expected N or LO-HI with decimal numbers")
        lo_s, hi_s = m.group(1), m.group(2)
        lo = int(lo_s)
        hi = int(hi_s) if hi_s is not None else lo
        if hi < lo:
            raise ValueError(f"range {item!r} runs backwards")
        if hi - lo + 1 > _MAX_HOSTS:
            raise ValueError(f"range {item!r} is too large")
        width = len(lo_s)
        out.extend(f"{i:0{width}d}" for i in range(lo, hi + 1))
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list into host names, keeping Slurm's order.

    Supports everything ``scontrol show hostnames`` prints for node lists:
    comma-separated names, ``[...]`` groups with numbers and ranges
    (``n[1-3,7]``), zero padding (``node[001-003]``), text after a group
    (``n[1-2]-ib``) and several groups in one name (``rack[1-2]-n[01-02]``,
    expanded with the leftmost group varying slowest). No deduplication.

    >>> expand_hostlist("n[1-2],m5,o[3-4,6]")
    ['n1', 'n2', 'm5', 'o3', 'o4', 'o6']

    Raises:
        ConfigurationError: the string is not a valid host list.
    """
    if not isinstance(hostlist, str):
        raise ConfigurationError(f"a Slurm host list must be a string, got {type(hostlist).__name__}")
    text = hostlist.strip()
    try:
        if not text:
            raise ValueError("it is empty")
        hosts: list[str] = []
        for part in _split_top_level(text):
            part = part.strip()
            if not part:
                raise ValueError("empty host name (stray comma?)")
            if any(c.isspace() for c in part):
                raise ValueError(f"host name {part!r} contains whitespace")
            # Alternate literal text and [group] pieces; product over the groups.
            pieces = re.split(r"(\[[^\]]*\])", part)
            choices: list[list[str]] = []
            size = 1
            for piece in pieces:
                if piece.startswith("[") and piece.endswith("]"):
                    values = _expand_range_group(piece[1:-1])
                    size *= len(values)
                    choices.append(values)
                elif piece:
                    choices.append([piece])
            if size + len(hosts) > _MAX_HOSTS:
                raise ValueError("it expands to too many hosts")
            hosts.extend("".join(combo) for combo in itertools.product(*choices))
    except ValueError as e:
        raise ConfigurationError(
            f"invalid Slurm host list {hostlist!r}: {e}; expected the form Slurm prints, "
            "e.g. 'n[1-3,7],m5' or 'node[001-004]'"
        ) from None
    return hosts


def expand_tasks_per_node(tasks_per_node: str) -> list[int]:
    """Expand Slurm's tasks-per-node string, keeping the order of the nodes.

    >>> expand_tasks_per_node("3(x2),2,1")
    [3, 3, 2, 1]

    Raises:
        ConfigurationError: the string is not in Slurm's ``N`` / ``N(xR)`` form.
    """
    if not isinstance(tasks_per_node, str):
        raise ConfigurationError(
            f"a Slurm tasks-per-node list must be a string, got {type(tasks_per_node).__name__}"
        )
    result: list[int] = []
    try:
        if not tasks_per_node.strip():
            raise ValueError("it is empty")
        for part in tasks_per_node.split(","):
            m = _TASKS_ITEM.match(part.strip())
            if m is None:
                raise ValueError(f"bad item {part!r}; expected N or N(xR)")
            count = int(m.group(1))
            reps = int(m.group(2)) if m.group(2) is not None else 1
            if reps < 1:
                raise ValueError(f"repeat count in {part!r} must be at least 1")
            if len(result) + reps > _MAX_HOSTS:
                raise ValueError("it expands to too many nodes")
            result.extend([count] * reps)
    except ValueError as e:
        raise ConfigurationError(
            f"invalid Slurm tasks-per-node list {tasks_per_node!r}: {e}; "
            "expected the form Slurm prints, e.g. '3(x2),2,1'"
        ) from None
    return result


def parse_jobs(jobs: Mapping[str, Any] | str, source: str = "jobs") -> dict[str, int]:
    """Validate a ``job name -> task count`` mapping (or its JSON / ``a=1,b=2`` text).

    Job names must be ones jaxdist runs (chief, worker, ps, evaluator); there
    is at most one chief and one evaluator. Jobs with count 0 are kept, as TF
    keeps them (they appear in the spec with no tasks).
    """
    example = '{"chief": 1, "ps": 2, "worker": 2}'
    if isinstance(jobs, str):
        text = jobs.strip()
        if text.startswith(("{", "[")):
            try:
                loaded = json.loads(text)
            except json.JSONDecodeError as e:
                raise ConfigurationError(f"{source} is not valid JSON ({e}); expected e.g. {example}") from None
        else:
            loaded = {}
            for item in filter(None, (p.strip() for p in text.split(","))):
                name, sep, count = item.replace(":", "=", 1).partition("=")
                if not sep:
                    raise ConfigurationError(
                        f"{source}: item {item!r} is not name=count; expected e.g. {example} or chief=1,ps=2,worker=2"
                    )
                loaded[name.strip()] = count.strip()
        jobs = loaded
    if not isinstance(jobs, Mapping) or not jobs:
        raise ConfigurationError(f"{source} must be a non-empty mapping job -> task count, e.g. {example}")
    out: dict[str, int] = {}
    check_jobs({name: 0 for name in jobs}, source)  # the names first; the counts once they are read
    for name, count in jobs.items():
        bad = ConfigurationError(f"{source}: task count for {name!r} must be an integer, got {count!r}")
        if isinstance(count, bool) or not isinstance(count, (int, float, str)):
            raise bad
        try:
            n = int(count)
        except ValueError:
            raise bad from None
        if isinstance(count, float) and count != n:
            raise bad
        if n < 0:
            raise ConfigurationError(f"{source}: task count for {name!r} is negative ({n})")
        out[name] = n
    check_jobs(out, source)
    return out


def task_layout(nodes: list[tuple[str, int]], distribution: str = "block") -> list[tuple[str, int]]:
    """Place ranks on nodes as Slurm does: ``rank -> (host, local task id)``.

    ``nodes`` is ``[(host, tasks on it), ...]`` in the step's node order.
    ``block`` fills each node before the next (Slurm's default and TF's
    assumption); ``cyclic`` deals ranks round-robin over the nodes that still
    have room, which reproduces Slurm's cyclic layout for the final counts.
    """
    if distribution == "cyclic":
        layout: list[tuple[str, int]] = []
        placed = [0] * len(nodes)
        remaining = sum(n for _, n in nodes)
        while remaining:
            for i, (host, count) in enumerate(nodes):
                if placed[i] < count:
                    layout.append((host, placed[i]))
                    placed[i] += 1
                    remaining -= 1
        return layout
    return [(host, local) for host, count in nodes for local in range(count)]


# --------------------------------------------------------------------------- environment


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _env_int(name: str, fix: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigurationError(f"{name}={raw!r} is not an integer; {fix}") from None


def _resolve_rank() -> tuple[int, str]:
    """This process's rank and the variable it came from."""
    for var in ("OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        rank = _env_int(var, "it should be set by srun/mpirun, do not set it by hand")
        if rank is not None:
            return rank, var
    raise ConfigurationError(
        "SLURM_PROCID is not set: not running inside a Slurm job step. Start every task with "
        "`srun` (e.g. `srun --ntasks=5 jaxdist task -- python train.py`), or use another resolver"
    )


def _resolve_num_tasks(rank_source: str) -> int | None:
    """Task count of the step (or of the MPI world under mpirun), if exported."""
    var = "OMPI_COMM_WORLD_SIZE" if rank_source == "OMPI_COMM_WORLD_RANK" else "SLURM_STEP_NUM_TASKS"
    return _env_int(var, "it should be set by srun/mpirun, do not set it by hand")


def _step_hosts() -> list[str]:
    raw = os.environ.get("SLURM_STEP_NODELIST", "")
    if not raw.strip():
        raise ConfigurationError(
            "SLURM_STEP_NODELIST is not set: run inside a Slurm job step (srun ...), "
            "or pass tasks_per_node={'host': count, ...}"
        )
    return expand_hostlist(raw)


def _step_task_configuration() -> list[tuple[str, int]]:
    hosts = _step_hosts()
    raw = os.environ.get("SLURM_STEP_TASKS_PER_NODE", "")
    if not raw.strip():
        raise ConfigurationError(
            "SLURM_STEP_TASKS_PER_NODE is not set: run inside a Slurm job step (srun ...), "
            "or pass tasks_per_node (an int, or a dict host -> count)"
        )
    counts = expand_tasks_per_node(raw)
    if len(counts) != len(hosts):
        raise ConfigurationError(
            f"SLURM_STEP_NODELIST names {len(hosts)} node(s) but SLURM_STEP_TASKS_PER_NODE={raw!r} "
            f"gives counts for {len(counts)}; these come from the same srun step and must agree. "
            "Do not set them by hand, or pass tasks_per_node explicitly"
        )
    return list(zip(hosts, counts, strict=True))


def _gpu_ids_from_env() -> list[str] | None:
    """The node's GPU ids as recorded by an earlier resolver or by Slurm, if known."""
    if ENV_NODE_GPUS in os.environ:
        return [g for g in (s.strip() for s in os.environ[ENV_NODE_GPUS].split(",")) if g]
    if "CUDA_VISIBLE_DEVICES" in os.environ:
        ids = [g for g in (s.strip() for s in os.environ["CUDA_VISIBLE_DEVICES"].split(",")) if g]
        # Slurm writes 'NoDevFiles' when the job has no GPUs; '-1' hides all devices.
        if ids in (["NoDevFiles"], ["-1"]):
            return []
        return ids
    return None


def _count_nvidia_gpus() -> int:
    """GPUs listed by ``nvidia-smi --list-gpus``; 0 when it is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run(
            [exe, "--list-gpus"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


# --------------------------------------------------------------------------- resolver


class SlurmClusterResolver(ClusterResolver):
    """The cluster of the current Slurm job step (``tf.distribute.cluster_resolver.SlurmClusterResolver``).

    Args:
        jobs: ``job name -> number of tasks``, e.g. ``{"chief": 1, "ps": 2,
            "worker": 2}``. Jobs take consecutive ranks in sorted name order
            (chief, evaluator, ps, worker). Defaults to ``JAXDIST_SLURM_JOBS``
            when set, else every task of the step is a ``worker``.
        port_base: Port of the first task on each node; the n-th task on a
            node listens on ``port_base + n``. Defaults to
            ``JAXDIST_SLURM_PORT_BASE`` when set, else 8888 (as TF).
        gpus_per_node: GPUs on each node. Defaults to the node's
            ``CUDA_VISIBLE_DEVICES`` list, else ``nvidia-smi --list-gpus``,
            else 0.
        gpus_per_task: GPUs given to each task. Defaults to
            ``gpus_per_node // max tasks on a node``.
        tasks_per_node: Overrides the step's layout: an int (same count on
            every node of ``SLURM_STEP_NODELIST``) or a dict ``host -> count``
            in node order.
        auto_set_gpu: Make ``cluster_spec()`` set ``CUDA_VISIBLE_DEVICES`` to
            this task's GPUs (only when there are GPUs to hand out).
        rpc_layer: Protocol name reported to callers (``"grpc"``).
        token: The cluster's auth token; defaults to ``JAXDIST_TOKEN``.

    Raises:
        ConfigurationError: the Slurm environment is missing or inconsistent,
            or ``jobs`` does not fit the step; the message says what to change.
    """

    env_name = "slurm"
    detection_priority = 30

    def __init__(
        self,
        jobs: Mapping[str, int] | None = None,
        port_base: int | None = None,
        gpus_per_node: int | None = None,
        gpus_per_task: int | None = None,
        tasks_per_node: int | Mapping[str, int] | None = None,
        auto_set_gpu: bool = True,
        rpc_layer: str | None = "grpc",
        token: str | None = None,
    ) -> None:
        self.rpc_layer = rpc_layer
        self._token = token
        self._auto_set_gpu = auto_set_gpu
        self._rank, self._rank_source = _resolve_rank()

        # Nodes of the step and the number of tasks on each, in Slurm's order.
        from_env = tasks_per_node is None
        if tasks_per_node is None:
            nodes = _step_task_configuration()
        elif isinstance(tasks_per_node, Mapping):
            nodes = [(str(h), self._check_count(c, f"tasks_per_node[{h!r}]")) for h, c in tasks_per_node.items()]
        else:
            per = self._check_count(tasks_per_node, "tasks_per_node")
            nodes = [(h, per) for h in _step_hosts()]
        if not nodes:
            raise ConfigurationError("the Slurm step has no nodes; pass a non-empty tasks_per_node")
        seen: set[str] = set()
        for host, _ in nodes:
            if host in seen:
                raise ConfigurationError(
                    f"node {host!r} appears twice in the node list; each node must be listed once"
                )
            seen.add(host)
        self._nodes = nodes
        num_tasks = sum(n for _, n in nodes)
        if num_tasks == 0:
            raise ConfigurationError("the Slurm step layout has no tasks; run srun with --ntasks=N")

        step_tasks = _resolve_num_tasks(self._rank_source)
        if step_tasks is not None and step_tasks != num_tasks:
            var = "OMPI_COMM_WORLD_SIZE" if self._rank_source == "OMPI_COMM_WORLD_RANK" else "SLURM_STEP_NUM_TASKS"
            where = (
                "SLURM_STEP_TASKS_PER_NODE"
                if from_env
                else f"tasks_per_node={tasks_per_node!r}"
            )
            raise ConfigurationError(
                f"{where} places {num_tasks} task(s) but {var}={step_tasks}; "
                + (
                    "the step's variables disagree, do not set them by hand"
                    if from_env
                    else "make tasks_per_node add up to the number of tasks the step was started with"
                )
            )

        # Jobs -> consecutive rank ranges, in sorted job-name order (as TF).
        if jobs is None:
            env_jobs = os.environ.get(ENV_SLURM_JOBS, "").strip()
            jobs = parse_jobs(env_jobs, ENV_SLURM_JOBS) if env_jobs else {"worker": num_tasks}
            source = ENV_SLURM_JOBS if env_jobs else "jobs"
        else:
            jobs = parse_jobs(jobs)
            source = "jobs"
        self._jobs = dict(sorted(jobs.items()))
        wanted = sum(self._jobs.values())
        if wanted != num_tasks:
            raise ConfigurationError(
                f"{source} ask for {_plural(wanted, 'task')} but the Slurm step has {num_tasks}; "
                f"run srun with --ntasks={wanted} or change {source} (now {self._jobs})"
            )
        if not 0 <= self._rank < num_tasks:
            raise ConfigurationError(
                f"{self._rank_source}={self._rank} is outside the step's {num_tasks} task(s) (0..{num_tasks - 1}); "
                "do not set it by hand"
            )

        # Ranks -> (node, local task id).
        distribution = "block"
        if self._rank_source == "SLURM_PROCID":
            dist = os.environ.get("SLURM_DISTRIBUTION", "").split(",")[0].split(":")[0].strip().lower()
            if dist == "cyclic":
                distribution = "cyclic"
        self._distribution = distribution
        self._layout = task_layout(nodes, distribution)
        self._check_own_placement()

        # Ports.
        if port_base is None:
            port_base = _env_int(ENV_SLURM_PORT_BASE, "set it to a port number such as 8888")
            if port_base is None:
                port_base = DEFAULT_PORT_BASE
        if isinstance(port_base, bool) or not isinstance(port_base, int):
            raise ConfigurationError(f"port_base must be an integer, got {port_base!r}")
        max_tasks = max(n for _, n in nodes)
        if port_base < 1 or port_base + max_tasks - 1 > 65535:
            raise ConfigurationError(
                f"port_base={port_base} with up to {max_tasks} task(s) per node needs ports "
                f"{port_base}..{port_base + max_tasks - 1}, outside 1..65535; choose another port_base "
                f"(or {ENV_SLURM_PORT_BASE})"
            )
        self._port_base = port_base

        # GPUs.
        env_ids = _gpu_ids_from_env()
        if gpus_per_node is None:
            if env_ids is None:
                env_ids = [str(i) for i in range(_count_nvidia_gpus())]
            gpus_per_node = len(env_ids)
        gpus_per_node = self._check_count(gpus_per_node, "gpus_per_node")
        if gpus_per_task is None:
            gpus_per_task = gpus_per_node // max_tasks
        gpus_per_task = self._check_count(gpus_per_task, "gpus_per_task")
        if max_tasks * gpus_per_task > gpus_per_node:
            raise ConfigurationError(
                f"{max_tasks} task(s) per node x {gpus_per_task} GPU(s) per task needs "
                f"{max_tasks * gpus_per_task} GPU(s) but a node has {gpus_per_node}; lower gpus_per_task, "
                "run fewer tasks per node (srun --ntasks-per-node=N) or raise gpus_per_node"
            )
        self._gpus_per_node = gpus_per_node
        self._gpus_per_task = gpus_per_task
        self._node_gpu_ids = (
            env_ids if env_ids is not None and len(env_ids) >= gpus_per_node else [str(i) for i in range(gpus_per_node)]
        )[:gpus_per_node]

        # The spec and this task's identity.
        task_list = [f"{host}:{port_base + local}" for host, local in self._layout]
        allocation: dict[str, list[str]] = {}
        start = 0
        self.task_type = None
        self.task_id = None
        for job, count in self._jobs.items():
            allocation[job] = task_list[start : start + count]
            if start <= self._rank < start + count:
                self.task_type = job
                self.task_id = self._rank - start
            start += count
        self._spec = ClusterSpec(allocation)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _check_count(value: Any, name: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigurationError(f"{name} must be a non-negative integer, got {value!r}")
        return value

    def _check_own_placement(self) -> None:
        """Compare the computed (node, local id) of this rank with what Slurm says."""
        if self._rank_source != "SLURM_PROCID":
            return
        node = os.environ.get("SLURMD_NODENAME", "").strip()
        local = _env_int("SLURM_LOCALID", "it should be set by srun, do not set it by hand")
        if not node or local is None or node not in {h for h, _ in self._nodes}:
            return
        want_host, want_local = self._layout[self._rank]
        if (want_host, want_local) != (node, local):
            raise ConfigurationError(
                f"Slurm placed rank {self._rank} on node {node!r} as local task {local}, but the "
                f"{self._distribution} layout of SLURM_STEP_NODELIST/SLURM_STEP_TASKS_PER_NODE puts it on "
                f"{want_host!r} as local task {want_local}; run srun with --distribution=block (the default) "
                "or --distribution=cyclic"
            )

    def _gpu_allocation(self, local: int) -> list[str]:
        g = self._gpus_per_task
        return self._node_gpu_ids[local * g : (local + 1) * g]

    # ------------------------------------------------------------------ API

    @classmethod
    def is_env_present(cls) -> bool:
        """True inside a Slurm job step (``SLURM_PROCID`` and ``SLURM_STEP_NODELIST`` set)."""
        return bool(os.environ.get("SLURM_PROCID", "").strip()) and bool(
            os.environ.get("SLURM_STEP_NODELIST", "").strip()
        )

    def cluster_spec(self) -> ClusterSpec:
        """The step's cluster; also sets ``CUDA_VISIBLE_DEVICES`` when ``auto_set_gpu``.

        The GPU ids the node had are kept in ``JAXDIST_SLURM_NODE_GPUS`` so
        resolving again (in this process or a child) gives the same answer.
        """
        if self._auto_set_gpu and self._gpus_per_task > 0:
            os.environ.setdefault(ENV_NODE_GPUS, ",".join(self._node_gpu_ids))
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self._gpu_allocation(self._layout[self._rank][1]))
        return self._spec

    def get_task_info(self) -> tuple[str | None, int | None]:
        """``(task_type, task_id)`` of this process, as TF's method of that name."""
        return self.task_type, self.task_id

    @property
    def rank(self) -> int:
        """This process's rank in the step."""
        return self._rank

    @property
    def jobs(self) -> dict[str, int]:
        """``job -> task count`` in rank order (sorted by job name)."""
        return dict(self._jobs)

    @property
    def port_base(self) -> int:
        return self._port_base

    @property
    def environment(self) -> str:
        """Always ``""`` under Slurm, as in TF."""
        return ""

    @property
    def visible_gpus(self) -> list[str]:
        """The GPU ids this task gets (``[]`` when the node has none to hand out)."""
        return self._gpu_allocation(self._layout[self._rank][1])

    def num_accelerators(self) -> dict[str, int]:
        """``{"GPU": gpus_per_task}``, or ``{}`` without GPUs."""
        return {"GPU": self._gpus_per_task} if self._gpus_per_task else {}

    def __repr__(self) -> str:
        return (
            f"SlurmClusterResolver({self._spec!r}, task_type={self.task_type!r}, "
            f"task_id={self.task_id!r}, rank={self._rank})"
        )
