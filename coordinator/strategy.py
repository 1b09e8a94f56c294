"""ParameterServerStrategy: where variables live, and how they are created.

Variables created inside ``strategy.scope()`` (with :func:`create_variable` or
:func:`create_variables`) live on the PS tasks: placed round-robin by one
global counter, as TF does, and, when a ``variable_partitioner`` asks for
more than one shard, split along dim 0 into a :class:`ShardedVariable`.
Each variable may carry an optax optimizer, applied on its PS to pushed
gradients; the optimizer state lives next to the variable (and is sharded
with it).
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
import logging
import operator
import re
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from jaxdist import variables as jv
from jaxdist.base.cluster_resolver import ClusterResolver
from jaxdist.base.cluster_resolver.base import check_jobs, check_task
from jaxdist.base.errors import ConfigurationError, JaxdistError
from jaxdist.partitioners import Partitioner, shard_offsets
from jaxdist.transport.channel import wait_healthy
from jaxdist.proto.ps_wire import IfExists
from jaxdist.ps_server.client import CreateSpec
from jaxdist.ps_server.connections import PSConnections
from jaxdist.transport.credentials import Credentials
from jaxdist.cluster_coordinator.ps_failover import ReplicaSet
from jaxdist.ps_methods import PSStrategyMethods
from jaxdist.sharded_variable import ShardedVariable
from jaxdist.sync import context as sync_context
from jaxdist.worker import prefetch

if TYPE_CHECKING:
    from jaxdist.cluster_coordinator.coordinator import ClusterCoordinator

logger = logging.getLogger(__name__)

__all__ = ["ParameterServerStrategy", "create_variable", "create_variables", "get_ps_strategy"]

#: The ParameterServerStrategy scopes open in this context (innermost last).
_scopes: contextvars.ContextVar[tuple[ParameterServerStrategy, ...]] = contextvars.ContextVar("jaxdist_ps_scopes", default=())


def get_ps_strategy() -> ParameterServerStrategy:
    """The ParameterServerStrategy whose ``scope()`` is open here (innermost)."""
    stack = _scopes.get()
    if not stack:
        raise ConfigurationError(
            "no strategy scope is open here: create variables inside `with strategy.scope():` of the strategy "
            "that trains them: a ParameterServerStrategy (variables on the parameter servers) or a synchronous "
            "strategy (MirroredStrategy, OneDeviceStrategy, ...; `jaxdist.get_strategy().scope()` for the default "
            "strategy on one device)")
    return stack[-1]


def _adapt_initializer(init: Callable[..., Any]) -> Callable[[tuple[int, ...], np.dtype, tuple[int, ...]], Any]:
    """Accept ``init(shape, dtype)`` or ``init(shape, dtype, offset)``; always call with three."""
    try:
        params = inspect.signature(init).parameters.values()
        positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        takes_offset = len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)
    except (TypeError, ValueError):
        takes_offset = True
    if takes_offset:
        return init

    def call(shape: tuple[int, ...], dtype: np.dtype, offset: tuple[int, ...]) -> Any:
        return init(shape, dtype)

    return call


class ParameterServerStrategy(PSStrategyMethods):
    """Parameter-server training: variables on PS tasks, closures on workers.

    TF's strategy methods (``run`` inside closures on the worker's devices,
    ``reduce``, ``gather``, ``distribute_datasets_from_function``,
    ``extended``...) come from :class:`jaxdist.ps_methods.PSStrategyMethods`.

    Args:
        cluster_resolver: where the ``ps`` and ``worker`` tasks are (and the
            auth token); see :mod:`jaxdist.base.cluster_resolver`. A ``ps_backup``
            job (one task per ``ps`` task) turns on primary/backup
            replication: every acknowledged update is on two processes, and
            the coordinator fails a dead PS over to its backup (see
            :mod:`jaxdist.cluster_coordinator.ps_failover`).
        variable_partitioner: a :class:`jaxdist.partitioners.Partitioner`;
            variables it splits into k > 1 shards become ShardedVariables.
        connect_timeout: seconds to wait for every PS task to be healthy.
        staleness: None (default): asynchronous training, TF's behaviour:
            every push is applied when it arrives. An int ``s >= 0``:
            bounded-stale training: the gradients of each worker's closures
            are aggregated on the PS per step (the mean of the step's
            gradients, applied once per step) and a worker runs at most
            ``s`` steps ahead of the slowest; ``staleness=0`` is synchronous
            SGD. See the README, "Bounded staleness and synchronous training".
    """

    def __init__(
        self,
        cluster_resolver: ClusterResolver,
        variable_partitioner: Partitioner | Callable[..., Any] | None = None,
        connect_timeout: float = 60.0,
        staleness: int | None = None,
    ) -> None:
        if staleness is not None and (isinstance(staleness, bool) or not isinstance(staleness, int) or staleness < 0):
            raise ValueError(f"staleness must be None (asynchronous) or an int >= 0, got {staleness!r}")
        #: Steps a worker may run ahead of the slowest (0: synchronous); None: asynchronous.
        self.staleness = staleness
        self.cluster_resolver = cluster_resolver
        spec = cluster_resolver.cluster_spec()
        # TF's rules (its ParameterServerStrategy checks them too): known job names, one chief at
        # most, this process's task in the cluster; else the strategy would only fail connecting.
        counts = {job: spec.num_tasks(job) for job in spec.jobs}
        check_jobs(counts, "ParameterServerStrategy's cluster spec")
        check_task(counts, cluster_resolver.task_type, cluster_resolver.task_id, "ParameterServerStrategy's cluster resolver")
        ps = spec.job_tasks("ps")
        if not ps:
            raise ConfigurationError("ParameterServerStrategy needs at least one 'ps' task in the cluster spec")
        if not spec.job_tasks("worker"):
            raise ConfigurationError("ParameterServerStrategy needs at least one 'worker' task in the cluster spec")
        #: Token and TLS material of every call to the cluster (from the resolver).
        self.credentials: Credentials = cluster_resolver.credentials
        self._partitioner = variable_partitioner
        backups = spec.job_tasks("ps_backup")
        if backups and staleness is not None:
            raise ConfigurationError(
                "staleness= (synchronous steps) does not combine with PS replication (a 'ps_backup' job) yet: "
                "a promoted backup would not hold the staged gradients of the step being formed")
        for addr in ps + backups:
            wait_healthy(addr, connect_timeout, self.credentials)
        self._conns = PSConnections(ps, self.credentials)
        #: Primary/backup pairs when the cluster has a ``ps_backup`` job (replication on), else None.
        self.replicas: ReplicaSet | None = None
        if backups:
            self.replicas = ReplicaSet(ps, backups, self.credentials, self._conns)
            self.replicas.attach_all()
        self._counter = 0  # TF's global round-robin placement counter
        # extended.colocate_vars_with's target PS; context-local so threads creating variables
        # at the same time don't see each other's colocation.
        self._colocate_ps: contextvars.ContextVar[int | None] = contextvars.ContextVar("jaxdist_colocate_ps", default=None)
        self._names: dict[str, int] = {}
        self._lock = threading.Lock()
        self._coordinator: ClusterCoordinator | None = None
        self._closed = False
        #: Every variable created through this strategy, by name (checkpoints walk it).
        self.variables: dict[str, jv.Variable | ShardedVariable] = {}
        #: Every jaxdist.DynamicEmbedding created through this strategy, by table name (checkpoints walk it).
        self.dynamic_tables: dict[str, Any] = {}
        #: The optax transformation of every PS-side variable (shard), by shard name.
        self.optimizers: dict[str, Any] = {}

    # ------------------------------------------------------------------ basics
    @property
    def num_ps(self) -> int:
        return len(self._conns.clients)

    @property
    def connections(self) -> PSConnections:
        """This strategy's clients of every PS task (what its variables use)."""
        return self._conns

    @property
    def coordinator(self) -> ClusterCoordinator | None:
        """The live ClusterCoordinator of this strategy (None: none, or it was shut down)."""
        c = self._coordinator
        return c if c is not None and not c.closed else None

    def bind_coordinator(self, coordinator: ClusterCoordinator) -> None:
        """Make ``coordinator`` this strategy's (ClusterCoordinator's constructor calls it).

        Raises:
            ValueError: the strategy already has a live coordinator.
        """
        with self._lock:
            if self.coordinator is not None:
                raise ValueError("this strategy already has a ClusterCoordinator; use strategy's existing one")
            self._coordinator = coordinator

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called (its PS connections are closed)."""
        return self._closed

    @property
    def num_replicas_in_sync(self) -> int:
        """Replicas that take one step together on this process: 1 (a closure is one replica; under
        ``staleness`` the PS averages the workers' gradients per step)."""
        return 1

    @property
    def variable_partitioner(self) -> Any:
        return self._partitioner

    @contextlib.contextmanager
    def scope(self) -> Iterator[ParameterServerStrategy]:
        """Inside, :func:`create_variable`/:func:`create_variables` place variables on the PS tasks."""
        token = _scopes.set(_scopes.get() + (self,))
        try:
            with sync_context.enter_scope(self):  # jaxdist.get_strategy() returns this strategy, as TF
                yield self
        finally:
            _scopes.reset(token)

    def _unique_name(self, name: str | None) -> str:
        base = name or "Variable"
        with self._lock:
            n = self._names.get(base, 0)
            self._names[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    @contextlib.contextmanager
    def colocated_on(self, ps_index: int) -> Iterator[None]:
        """Variables created inside (in this thread/context) go to PS task ``ps_index``, unsharded.

        What ``extended.colocate_vars_with`` uses; TF's round-robin counter does not step for them.
        """
        if not 0 <= int(ps_index) < self.num_ps:
            raise ValueError(f"colocated_on: ps_index {ps_index} is not a PS task of this strategy (0..{self.num_ps - 1})")
        token = self._colocate_ps.set(int(ps_index))
        try:
            yield
        finally:
            self._colocate_ps.reset(token)

    def _place(self) -> int:
        colocated = self._colocate_ps.get()
        if colocated is not None:  # extended.colocate_vars_with: same PS, no counter step
            return colocated
        with self._lock:
            ps = self._counter % self.num_ps
            self._counter += 1
        return ps

    # --------------------------------------------------------------- creation
    def _plan(
        self,
        name: str,
        value: np.ndarray | None,
        shape: tuple[int, ...],
        dtype: np.dtype,
        initializer: Callable[..., Any] | None,
        optimizer: Any,
        trainable: bool,
        if_exists: IfExists | str,
    ) -> tuple[Any, list[tuple[int, CreateSpec]]]:
        if_exists = IfExists(if_exists)
        k = 1
        if self._partitioner is not None and len(shape) > 0 and self._colocate_ps.get() is None:
            returned = self._partitioner(shape, dtype)
            try:
                parts = [operator.index(p) for p in returned]
            except TypeError:  # None, a number, a list of floats or strings: not a list of ints
                raise ConfigurationError(
                    f"partitioner returned {returned!r} for shape {shape}; a partitioner returns a list of ints, "
                    "one per dimension: [k, 1, ...] with k >= 1 shards along dim 0"
                ) from None
            if len(parts) != len(shape) or any(p != 1 for p in parts[1:]) or parts[0] < 1:
                raise ConfigurationError(
                    f"partitioner returned {parts} for shape {shape}; jaxdist partitions along dim 0 only and "
                    "needs [k, 1, ...] with k >= 1"
                )
            k = min(parts[0], shape[0])
        if k <= 1:
            ps = self._place()
            self.optimizers[name] = optimizer
            return (
                jv.Variable(name, shape, dtype, ps, trainable, self._conns),
                [(ps, CreateSpec(name, value=value, shape=shape, dtype=dtype, initializer=initializer, optimizer=optimizer, if_exists=if_exists))],
            )
        offsets = shard_offsets(shape[0], k)
        shards, specs = [], []
        for i in range(k):
            sname = f"{name}/part_{i}"
            sshape = (offsets[i + 1] - offsets[i],) + shape[1:]
            ps = self._place()
            shards.append(jv.Variable(sname, sshape, dtype, ps, trainable, self._conns))
            self.optimizers[sname] = optimizer
            part = None if value is None else value[offsets[i] : offsets[i + 1]]
            off = (offsets[i],) + (0,) * (len(shape) - 1)
            specs.append((ps, CreateSpec(sname, value=part, shape=sshape, dtype=dtype, initializer=initializer, offset=off, optimizer=optimizer, if_exists=if_exists)))
        return ShardedVariable(name, shards), specs

    def create_variables(
        self,
        tree: Any,
        *,
        name: str | None = None,
        optimizer: Any = None,
        trainable: bool = True,
        if_exists: str = "fail",
    ) -> Any:
        """Create one variable per array leaf of ``tree``; returns the same tree of variables.

        Leaf names are ``{name}/{path}`` (e.g. ``params/layers/0/w``). All
        creations go out batched, one call per PS task, in parallel.
        ``if_exists`` ("fail", "keep", "replace") says what to do with a name
        the PS already holds ("keep" lets a restarted coordinator reattach).
        """
        leaves_with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
        prefix = name or "params"
        out, specs = [], []
        for path, leaf in leaves_with_path:
            value = np.asarray(leaf)
            suffix = "/".join(_path_name(p) for p in path)
            vname = self._unique_name(f"{prefix}/{suffix}" if suffix else prefix)
            var, s = self._plan(vname, value, value.shape, value.dtype, None, optimizer, trainable, if_exists)
            self.variables[vname] = var
            out.append(var)
            specs.extend(s)
        jv.create_on_ps(specs, self._conns)
        return jax.tree_util.tree_unflatten(treedef, out)

    def create_variable(
        self,
        initial_value: Any = None,
        *,
        name: str | None = None,
        shape: Any = None,
        dtype: Any = None,
        initializer: Callable[..., Any] | None = None,
        optimizer: Any = None,
        trainable: bool = True,
        if_exists: str = "fail",
    ) -> jv.Variable | ShardedVariable:
        """Create a variable from ``initial_value`` (array, or a no-argument callable returning one),
        or from ``initializer(shape, dtype[, offset])`` run on the PS, shard by shard, so the full
        value never exists on the coordinator.
        """
        if initial_value is None and initializer is None:
            raise ValueError("create_variable needs initial_value or initializer (with shape and dtype)")
        vname = self._unique_name(name)
        if initial_value is not None:
            if callable(initial_value):
                initial_value = initial_value()
            value = np.asarray(initial_value, dtype=None if dtype is None else np.dtype(dtype))
            var, specs = self._plan(vname, value, value.shape, value.dtype, None, optimizer, trainable, if_exists)
        else:
            if shape is None or dtype is None:
                raise ValueError("an initializer needs shape and dtype")
            assert initializer is not None
            shp = tuple(int(d) for d in shape)
            var, specs = self._plan(vname, None, shp, jv.variable_dtype(dtype), _adapt_initializer(initializer), optimizer, trainable, if_exists)
        jv.create_on_ps(specs, self._conns)
        self.variables[vname] = var
        return var

    # -------------------------------------------------------------- lifecycle
    def shutdown_ps(self, reason: str, exit_code: int) -> None:
        """Tell every PS task (and backup) to exit with ``exit_code`` (the job is over); unreachable
        ones are skipped. :meth:`ClusterCoordinator.shutdown` calls it."""
        for c in self._conns.clients:
            try:
                c.shutdown(reason, exit_code, timeout=2.0)
            except JaxdistError:
                pass
        if self.replicas is not None:
            self.replicas.shutdown_backups(reason, exit_code)

    def close(self) -> None:
        """Close connections to the PS tasks (does not stop them)."""
        if not self._closed:
            self._closed = True
            prefetch.forget(self._conns)  # reads prefetched through these connections (pull(prefetch_next=True))
            self._conns.close()
            if self.replicas is not None:
                self.replicas.close()


def _path_name(entry: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return re.sub(r"[^A-Za-z0-9_.\-]", "_", str(getattr(entry, attr)))
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", str(entry))


def create_variable(initial_value: Any = None, **kwargs: Any) -> Any:
    """Create a variable in the current strategy's scope: on the PS tasks (see
    :meth:`ParameterServerStrategy.create_variable`), or, inside a synchronous strategy's scope, a
    mirrored variable (see :func:`jaxdist.sync.create_variable`)."""
    from jaxdist.sync_dispatch import sync_strategy_in_scope

    sync = sync_strategy_in_scope(kwargs)
    if sync is not None:
        return sync.create_variable(initial_value, **kwargs)
    return get_ps_strategy().create_variable(initial_value, **kwargs)


def create_variables(tree: Any, **kwargs: Any) -> Any:
    """Create a tree of variables in the current strategy's scope: on the PS tasks (see
    :meth:`ParameterServerStrategy.create_variables`), or mirrored variables of a synchronous strategy."""
    from jaxdist.sync_dispatch import sync_strategy_in_scope

    sync = sync_strategy_in_scope(kwargs)
    if sync is not None:
        return sync.create_variables(tree, **kwargs)
    return get_ps_strategy().create_variables(tree, **kwargs)
