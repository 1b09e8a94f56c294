"""The engine of a synchronous strategy: its machinery, behind one typed interface.

A strategy object (``MirroredStrategy``, ...) is TF's API: ``scope``, ``run``,
``reduce``, ``gather``, the datasets. What jaxdist's own modules need of a
strategy lives in its engine, ``strategy.engine``:

- **registries**: the strategy's variables by checkpoint key
  (:class:`VariableRegistry`), the optimizers whose state lives in it, the
  replicated values it produced (:class:`~jaxdist.sync.values.MirroredRegistry`)
  and its cross-device ops;
- **topology**: replicas, processes, devices, the mesh and its shardings;
- **placement**: where a mirrored or sync-on-read variable's value lives, how
  a value becomes replicated or per-replica, what a dataset yields;
- **dispatch**: calling a compiled program (paced on CPU; watched for dead
  peers and step timeouts in a multi-process job, see :class:`DispatchGuard`)
  and the caches of compiled programs;
- **collectives**: which plan an all-reduce follows.

Its callers: :mod:`~jaxdist.sync.loops` (compiling ``run``),
:mod:`~jaxdist.sync.mesh` (the strategies' TF API), :mod:`~jaxdist.sync.variables`,
:mod:`~jaxdist.sync.function`, :mod:`~jaxdist.sync.extended`,
:mod:`~jaxdist.sync.checkpointing`, :mod:`~jaxdist.sync.input_lib`,
:mod:`~jaxdist.sync.optimizer`, :mod:`~jaxdist.sync.cross_device_ops` and the
:class:`~jaxdist.sync.context.ReplicaContext`. It is jaxdist's interface, not
a user API (user code calls the strategy).

:class:`SyncEngine` is the default strategy's engine (one replica, on JAX's
default device) and the base of :class:`MeshEngine`, every other strategy's
(replicas on a 1-D mesh). Strategies that place values differently subclass
:class:`MeshEngine` (``CentralStorageStrategy``, ``OneDeviceStrategy``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import InputContext
from jaxdist.sync import context as ctx_lib
from jaxdist.sync import cross_device_ops as cdo
from jaxdist.sync.programs import ProgramCache
from jaxdist.sync.reduce_op import ReduceOp
from jaxdist.sync.values import MirroredRegistry, PerReplica, is_tracer
from jaxdist.sync.variables import SyncVariable, VariableAggregation, VariableSynchronization, aggregate_stacked

if TYPE_CHECKING:
    from jaxdist.sync.optimizer import Optimizer
    from jaxdist.sync.strategy import Strategy

__all__ = ["AXIS", "DispatchGuard", "MeshEngine", "SyncEngine", "VariableRegistry"]

#: Name of the mesh axis the replicas are laid on (usable with ``jax.lax`` collectives in ``run``).
AXIS = "replica"

T = TypeVar("T")


class VariableRegistry:
    """A strategy's variables by name (their checkpoint keys), and the numbering of unnamed ones."""

    def __init__(self) -> None:
        self._by_name: dict[str, SyncVariable] = {}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def unique_name(self, name: str | None) -> str:
        """The checkpoint key of a new variable.

        An explicit name is kept as it is: a variable created again under a
        name in use takes its place in the registry (what
        :class:`jaxdist.Checkpoint` saves and restores), so "build a fresh
        model, then restore" works as in TF, where checkpoints follow the
        objects. Unnamed variables are numbered ``Variable``, ``Variable_1``...
        """
        if name:
            return name
        with self._lock:
            n = self._counts.get("Variable", 0)
            cand = "Variable" if n == 0 else f"Variable_{n}"
            while cand in self._by_name:
                n += 1
                cand = f"Variable_{n}"
            self._counts["Variable"] = n + 1
        return cand

    def add(self, var: SyncVariable) -> None:
        """Register ``var`` under its name (replacing a variable of the same name)."""
        self._by_name[var.name] = var

    def get(self, name: str) -> SyncVariable | None:
        return self._by_name.get(name)

    def items(self) -> list[tuple[str, SyncVariable]]:
        """``(name, variable)`` pairs, in creation order."""
        return list(self._by_name.items())

    def snapshot(self) -> dict[str, SyncVariable]:
        return dict(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


class DispatchGuard(Protocol):
    """What watches a multi-process strategy's programs for dead peers and slow collectives.

    :class:`MeshEngine` calls it around every program it dispatches;
    ``jaxdist.function`` calls :meth:`raise_if_failed` and :meth:`watch`
    around the compiled functions that use the strategy. Implemented by
    :class:`jaxdist.sync.peer_watch.PeerWatch`.
    """

    def raise_if_failed(self) -> None:
        """Raise the peer failure recorded so far, if any."""

    def before_dispatch(self, in_flight: Any, traced: bool) -> None:
        """About to call a program (``in_flight``: the previous program's outputs; ``traced``: inside a trace)."""

    def after_dispatch(self, outputs: Any) -> None:
        """A program was called (not traced) and returned ``outputs``, which may still be computing."""

    def watch(self, outputs: Any) -> None:
        """Watch ``outputs``, computing from now on, for the collective timeout."""


class SyncEngine:
    """The default strategy's engine (one replica on JAX's default device), and the base of every engine.

    Args:
        strategy: the strategy this engine works for (``engine.strategy``).
    """

    #: Whether datasets yield the batch itself (one replica) instead of PerReplica values.
    yields_plain_arrays = True

    def __init__(self, strategy: Strategy) -> None:
        self._strategy = strategy
        #: The strategy's variables (:class:`VariableRegistry`).
        self.variables = VariableRegistry()
        #: The replicated values the strategy produced (outputs of run/reduce/replicate).
        self.mirrored = MirroredRegistry()
        #: How in-replica all-reduces are done, unless a call's options ask for another plan.
        self.cross_device_ops: cdo.CrossDeviceOps = cdo.CrossDeviceOps()
        #: The CommunicationOptions the strategy was built with (MultiWorkerMirroredStrategy), if any.
        self.communication_options: cdo.CommunicationOptions | None = None
        self._optimizers: weakref.WeakSet[Optimizer] = weakref.WeakSet()
        self._cache: dict[Any, Any] = {}

    @property
    def strategy(self) -> Strategy:
        return self._strategy

    # -- registries ------------------------------------------------------------------

    def add_optimizer(self, optimizer: Optimizer) -> None:
        """Remember an optimizer whose state lives in this strategy (checkpoints save and restore it)."""
        self._optimizers.add(optimizer)

    def optimizers(self) -> list[Optimizer]:
        """The optimizers still alive whose state lives in this strategy."""
        return list(self._optimizers)

    def cached(self, key: Any, build: Callable[[], T]) -> T:
        """The object cached under ``key``, built by ``build()`` the first time (compiled helpers, loops)."""
        hit = self._cache.get(key)
        if hit is None:
            hit = build()
            self._cache[key] = hit
        return hit

    def create_variable(
        self,
        value: jax.Array,
        name: str | None,
        trainable: bool,
        sync: VariableSynchronization,
        agg: VariableAggregation,
        checkpoint: bool,
    ) -> SyncVariable:
        """A new variable of the strategy holding ``value`` (see :func:`jaxdist.sync.variables.create_variable`)."""
        frame = ctx_lib.current_frame()
        if frame is not None and not frame.discover:
            raise ConfigurationError(
                f"variable {name!r} is created inside compiled code (strategy.run / jaxdist.function) after its "
                "first trace. Create variables in strategy.scope() before the loop (as in TF, where tf.function "
                "supports only variables created on its first call); jaxdist.Optimizer and jaxdist.metrics "
                "create theirs when they are built"
            )
        vname = self.variables.unique_name(name)
        with ctx_lib.outside_frames(), jax.ensure_compile_time_eval():
            if sync is VariableSynchronization.ON_READ:
                stored = self.store_on_read(jnp.broadcast_to(value[None], (self.num_replicas, *value.shape)))
            else:
                stored = self.store_variable(value)
        var = SyncVariable(self._strategy, vname, stored, value.shape, value.dtype, trainable, sync, agg, checkpoint)
        self.variables.add(var)
        return var

    # -- topology ----------------------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        """Replicas in each synchronous step (all processes together)."""
        return 1

    @property
    def platform(self) -> str:
        return jax.devices()[0].platform

    @property
    def process_ids(self) -> list[int]:
        """The processes whose devices hold replicas, in order (the default strategy: [0], the writer)."""
        return [0]

    @property
    def multi_process(self) -> bool:
        return len(self.process_ids) > 1

    def local_replica_ids(self) -> list[int]:
        """The replicas on this process's devices, in replica order."""
        return list(range(self.num_replicas))

    def replica_devices(self) -> list[Any]:
        """The local replicas' devices, in local replica order."""
        return [jax.devices()[0]]

    def input_context(self) -> InputContext:
        """The input context of this process's pipeline (``distribute_datasets_from_function`` passes it)."""
        return InputContext(1, 0, self.num_replicas)

    @property
    def replicated_sharding(self) -> NamedSharding | None:
        """The sharding of replicated values (None: no mesh, values live on the default device)."""
        return None

    @property
    def per_replica_sharding(self) -> NamedSharding | None:
        """The sharding of stacked per-replica values (None: no mesh)."""
        return None

    # -- placement ---------------------------------------------------------------------

    def to_replicated(self, x: Any) -> Any:
        """``x`` as a replicated value of the strategy (here: an array on the default device)."""
        return jnp.asarray(x)

    def place_per_replica(self, x: Any) -> Any:
        """A stacked ``(R, ...)`` array laid out one row per replica (no layout without a mesh)."""
        return x

    def store_variable(self, x: Any) -> Any:
        """Where a mirrored variable's value lives (the default strategy: the default device)."""
        return jnp.asarray(x)

    def store_on_read(self, stacked: Any) -> Any:
        """Where a sync-on-read variable's per-replica parts live."""
        return jnp.asarray(stacked)

    def aggregate_on_read(self, stacked: Any, aggregation: VariableAggregation) -> Any:
        """Cross-replica read of a sync-on-read variable: its parts combined by ``aggregation``."""
        return aggregate_stacked(jnp.asarray(stacked), aggregation)

    def write_variable(self, var: SyncVariable, value: Any) -> None:
        """Store ``value`` (global: ON_READ stacked per replica) as ``var``'s new value, where the strategy keeps it."""
        var.storage = self.store_on_read(value) if var.on_read else self.store_variable(value)

    def finish_replicated(self, x: Any) -> Any:
        """Where a replicated output of ``run``/``reduce``/``gather`` ends up (CentralStorage: its parameter device)."""
        return x

    def distribute_local(self, stacked_local: Any, rows: np.ndarray | None = None, guard: bool = False) -> Any:
        """What a distributed dataset yields for ``stacked_local[i]``, local replica i's value.

        One replica gets the whole batch: as TF, it is yielded as it is
        (padded only when a mask is asked for, i.e. ``guard=False``).
        """
        x = stacked_local[0]
        return x[: int(rows[0])] if rows is not None and guard else x

    def adopt_replicated(self, outputs: Any) -> None:
        """Remember the leaves of ``outputs`` laid out replicated on the mesh as the strategy's replicated values.

        ``jaxdist.function`` calls it on what a compiled function returns, so
        that ``reduce`` treats them as the strategy's own (no mesh: nothing to adopt).
        """

    # -- dispatch ----------------------------------------------------------------------

    def dispatch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a compiled program of the strategy."""
        return fn(*args)

    def raise_if_failed(self) -> None:
        """Raise the peer failure a multi-process strategy recorded, if any (nothing to fail here)."""

    def wait_in_flight(self) -> None:
        """Wait for the strategy's program in flight, where dispatches are paced (see :meth:`MeshEngine.dispatch`)."""

    def note_in_flight(self, outputs: Any) -> None:
        """A compiled function that uses the strategy was called and returned ``outputs`` (still computing)."""

    # -- collectives -------------------------------------------------------------------

    def check_options(self, options: Any, what: str) -> cdo.CommunicationOptions | None:
        """``options`` as CommunicationOptions, refusing what cannot apply to one call (``timeout_seconds``)."""
        opts = cdo.check_options(options, what)
        if opts is not None and opts.timeout is not None:
            raise ConfigurationError(
                f"{what}: CommunicationOptions(timeout_seconds=...) per call is not supported: the collectives of a "
                "step run inside one compiled program. Set it for the whole job with "
                "MultiWorkerMirroredStrategy(communication_options=CommunicationOptions(timeout_seconds=...)) "
                "(it applies to collectives between processes only, as in TF)"
            )
        return opts

    def collective_plan(self, options: Any, what: str) -> cdo.CrossDeviceOps:
        """The cross-device ops a collective called with ``options`` uses: the plan the options ask for
        (``CommunicationOptions(implementation=..., bytes_per_pack=...)``) where they ask for one, else the
        strategy's own ``cross_device_ops``. ``what`` names the calling API in the errors for options that
        cannot apply per call (``timeout_seconds``)."""
        opts = self.check_options(options, what)
        if opts is not None:
            plan = cdo.plan_from_options(opts, self.platform)
            if plan is not None:
                return plan
        return self.cross_device_ops

    def all_reduce_in_replica(self, op: ReduceOp, value: Any, options: Any = None) -> Any:
        """``ReplicaContext.all_reduce``: an all-reduce over the replica axis of the step being traced."""
        rep = ctx_lib.current_replica()
        if rep is None or rep.axis_name is None:
            return jax.tree.map(jnp.asarray, value)
        plan = self.collective_plan(options, "all_reduce")
        return cdo.all_reduce(plan, op is ReduceOp.MEAN, value, rep.axis_name, self.num_replicas)


class MeshEngine(SyncEngine):
    """Replicas on a 1-D mesh of ``devices`` (axis :data:`AXIS`): the engine of every strategy but the default one.

    Args:
        strategy: the strategy this engine works for.
        devices: replica ``r`` runs on ``devices[r]``; in a multi-process job
            every process's devices, each process's contiguous.
        guard: watches dispatched programs for dead peers and slow
            collectives (MultiWorkerMirroredStrategy), or None.
    """

    yields_plain_arrays = False

    def __init__(self, strategy: Strategy, devices: Sequence[jax.Device], guard: DispatchGuard | None = None) -> None:
        super().__init__(strategy)
        devices = list(devices)
        what = type(strategy).__name__
        if not devices:
            raise ConfigurationError(f"{what} needs at least one device")
        if len(set(devices)) != len(devices):
            raise ConfigurationError(f"{what}: duplicate devices in {devices}")
        self._devices = tuple(devices)
        self._mesh = Mesh(np.array(devices, dtype=object), (AXIS,))
        self._replicated_sharding = NamedSharding(self._mesh, P())
        self._per_replica_sharding = NamedSharding(self._mesh, P(AXIS))
        me = jax.process_index()
        self._local_ids = [i for i, d in enumerate(devices) if d.process_index == me]
        if not self._local_ids:
            raise ConfigurationError(f"{what}: none of the devices {devices} belongs to this process")
        self._process_ids = sorted({d.process_index for d in devices})
        #: The compiled programs of ``run`` (:mod:`jaxdist.sync.loops`).
        self.programs = ProgramCache()
        self._trace_count = 0
        # See dispatch: XLA:CPU multi-device programs must not queue up behind each other.
        self._pace = devices[0].platform == "cpu" and len(devices) > 1
        self._in_flight: Any = None
        self._guard = guard

    # -- topology ------------------------------------------------------------------

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        """The replicas' devices, replica ``r`` on ``devices[r]``."""
        return self._devices

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def num_replicas(self) -> int:
        return len(self._devices)

    @property
    def platform(self) -> str:
        return self._devices[0].platform

    @property
    def process_ids(self) -> list[int]:
        return list(self._process_ids)

    @property
    def multi_process(self) -> bool:
        return len(self._process_ids) > 1

    @property
    def replicated_sharding(self) -> NamedSharding:
        return self._replicated_sharding

    @property
    def per_replica_sharding(self) -> NamedSharding:
        return self._per_replica_sharding

    def local_replica_ids(self) -> list[int]:
        return list(self._local_ids)

    def replica_devices(self) -> list[Any]:
        return [self._devices[i] for i in self._local_ids]

    def input_context(self) -> InputContext:
        me = jax.process_index()
        return InputContext(len(self._process_ids), self._process_ids.index(me), self.num_replicas)

    @property
    def trace_count(self) -> int:
        """How many times ``run`` traced a function (a new function or input signature)."""
        return self._trace_count

    def count_trace(self) -> None:
        """``run`` traces a function (see :attr:`trace_count`)."""
        self._trace_count += 1

    # -- placement -----------------------------------------------------------------

    def to_replicated(self, x: Any) -> jax.Array:
        """``x`` as an array replicated on the mesh (no copy if it already is)."""
        if is_tracer(x):
            return x
        if isinstance(x, jax.Array):
            if x.sharding.is_equivalent_to(self._replicated_sharding, x.ndim):
                return x
            if not x.is_fully_addressable:
                return self._jit_identity(self._replicated_sharding)(x)
            if not self.multi_process:
                return jax.device_put(x, self._replicated_sharding)
            x = np.asarray(x)
        if not self.multi_process:
            return jax.device_put(x, self._replicated_sharding)
        arr = np.asarray(x)
        arr = arr.astype(jax.dtypes.canonicalize_dtype(arr.dtype), copy=False)
        return jax.make_array_from_callback(arr.shape, self._replicated_sharding, lambda idx: arr[idx])

    def place_per_replica(self, x: Any) -> Any:
        """A stacked ``(R, ...)`` array laid out one row per replica (no copy if it already is)."""
        if is_tracer(x):
            return x
        r = self.num_replicas
        if x.shape[0] != r:
            raise ConfigurationError(
                f"a PerReplica value with {x.shape[0]} replicas was passed to a strategy with {r} replicas"
            )
        if isinstance(x, jax.Array):
            if x.sharding.is_equivalent_to(self._per_replica_sharding, x.ndim):
                return x
            if not x.is_fully_addressable:
                return self._jit_identity(self._per_replica_sharding)(x)
            if not self.multi_process:
                return jax.device_put(x, self._per_replica_sharding)
        arr = np.asarray(x)
        return self.stack_to_global(arr[self._local_ids])

    def stack_to_global(self, stacked_local: np.ndarray) -> jax.Array:
        """Global ``(R, ...)`` array from this process's rows (``stacked_local[i]`` -> local replica i)."""
        if not self.multi_process:
            return jax.device_put(stacked_local, self._per_replica_sharding)
        shape = (self.num_replicas, *stacked_local.shape[1:])
        arrays = [
            jax.device_put(stacked_local[i : i + 1], self._devices[rid]) for i, rid in enumerate(self._local_ids)
        ]
        return jax.make_array_from_single_device_arrays(shape, self._per_replica_sharding, arrays)

    def _jit_identity(self, sharding: NamedSharding) -> Callable[[Any], Any]:
        return self.cached(("identity", sharding.spec), lambda: jax.jit(lambda a: a, out_shardings=sharding))

    def store_variable(self, x: Any) -> Any:
        """Where a mirrored variable lives: replicated on the mesh.

        The stored array always carries the engine's own sharding object (an
        equivalent one, e.g. a one-device sharding an XLA output came back
        with, is relabelled without a copy), so compiled functions that take
        variables see the same input sharding every call and do not retrace.
        """
        x = self.to_replicated(x)
        if isinstance(x, jax.Array) and not is_tracer(x) and x.sharding != self._replicated_sharding:
            x = jax.device_put(x, self._replicated_sharding)
        return x

    def store_on_read(self, stacked: Any) -> Any:
        x = self.place_per_replica(stacked)
        if isinstance(x, jax.Array) and not is_tracer(x) and x.sharding != self._per_replica_sharding:
            x = jax.device_put(x, self._per_replica_sharding)
        return x

    def aggregate_on_read(self, stacked: Any, aggregation: VariableAggregation) -> Any:
        fn = self.jit_replicated(("on_read", aggregation), lambda: lambda s: aggregate_stacked(s, aggregation))
        return self.dispatch(fn, self.place_per_replica(stacked))

    def distribute_local(self, stacked_local: Any, rows: np.ndarray | None = None, guard: bool = False) -> Any:
        if isinstance(stacked_local, np.ndarray):
            stacked = self.stack_to_global(stacked_local)
        else:
            stacked = stacked_local  # already a global per-replica array (placed by input_lib)
        if rows is None:
            return PerReplica(stacked)
        counts = self.stack_to_global(rows[self._local_ids].astype(np.int32))
        return PerReplica(stacked, counts, host_row_counts=rows.astype(np.int32), guard=guard)

    def adopt_replicated(self, outputs: Any) -> None:
        for leaf in jax.tree.leaves(outputs):
            if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(self._replicated_sharding, leaf.ndim):
                self.mirrored.add(leaf)

    def jit_replicated(self, key: Any, make: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """``jax.jit(make())`` with a replicated output, compiled once per ``key``."""
        return self.cached(key, lambda: jax.jit(make(), out_shardings=self._replicated_sharding))

    # -- dispatch ------------------------------------------------------------------

    def dispatch(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a compiled multi-replica program, pacing dispatch on CPU.

        On the CPU platform, several in-flight programs whose replicas meet in
        collectives can deadlock XLA:CPU's thread pool when there are more
        devices than cores (seen with 8 fake devices on 2 cores; see
        jax-ml/jax#25861). So on CPU each dispatch first waits for the previous
        program of this strategy to finish: the host work of the next step
        (input splitting, argument checks) still overlaps the running step,
        only the launch waits. Other platforms dispatch asynchronously as
        usual. Inside a trace (``jaxdist.function``/``jax.jit``) nothing runs
        yet, so nothing waits. The guard, if any, sees every call.
        """
        traced = any(is_tracer(a) for a in jax.tree.leaves(args))
        if self._guard is not None:
            self._guard.before_dispatch(self._in_flight, traced)
        if traced:
            return fn(*args)
        if self._pace and self._in_flight is not None:
            jax.block_until_ready(self._in_flight)
            self._in_flight = None
        out = fn(*args)
        if self._pace:
            self._in_flight = out
        if self._guard is not None:
            self._guard.after_dispatch(out)
        return out

    def raise_if_failed(self) -> None:
        if self._guard is not None:
            self._guard.raise_if_failed()

    def wait_in_flight(self) -> None:
        if self._pace and self._in_flight is not None:
            jax.block_until_ready(self._in_flight)
            self._in_flight = None

    def note_in_flight(self, outputs: Any) -> None:
        if self._pace:
            self._in_flight = outputs
        if self._guard is not None:
            self._guard.watch(outputs)
