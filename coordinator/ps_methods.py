"""TF's remaining strategy methods on ``ParameterServerStrategy`` (mixed into it).

As in TF's ``ParameterServerStrategyV2``:

- ``strategy.run(fn, args)`` runs ``fn`` on the local devices of the process
  it is called in: inside a closure scheduled with
  ``ClusterCoordinator.schedule`` that is the worker's devices (its GPUs, or
  its CPU), in one compiled step with XLA collectives between them, exactly
  as ``MirroredStrategy.run`` over those devices; on the coordinator, the
  coordinator's devices.
- ``reduce``, ``gather``, ``experimental_local_results``,
  ``experimental_distribute_values_from_function`` act on what that ``run``
  returned.
- ``distribute_datasets_from_function(dataset_fn)`` is meant for the
  per-worker dataset function handed to ``create_per_worker_dataset``: on a
  worker, ``dataset_fn`` gets ``InputContext(num_input_pipelines=<workers>,
  input_pipeline_id=<this worker>, num_replicas_in_sync=<local replicas>)``
  and each ``next()`` yields one batch per local replica.
- ``strategy.scope()`` makes ``jaxdist.get_strategy()`` return the strategy.
- ``strategy.extended``: ``colocate_vars_with`` (new variables go to the same
  PS task, unsharded, as TF), ``variable_created_in_scope``, ``update``,
  ``reduce_to``/``batch_reduce_to`` (on local per-replica values).

A closure that uses ``strategy`` carries a small picklable stand-in (the
strategy's PS connections stay on the coordinator): on the worker it
answers these methods with a ``MirroredStrategy`` over the worker's devices.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jaxdist.base.input_context import InputContext

__all__ = ["PSStrategyMethods", "PSWorkerStrategy", "RunHook", "WorkerDistributedDataset", "local_strategy",
           "register_run_hook", "run_hooks"]

logger = logging.getLogger(__name__)

#: TF's usage warning for ``run``/``reduce`` called outside a scheduled function (its wording, kept so
#: that TF users recognise it).
_USAGE_WARNING = (
    "A `ParameterServerStrategy` method (%s) is invoked without using `ClusterCoordinator.schedule`: it runs on "
    "this process's devices (the coordinator's), which can be slow. To run on the workers, call methods like "
    "`run` or `reduce` within a function passed to `ClusterCoordinator.schedule`.")

_LOCAL: dict[str, Any] = {}
_LOCAL_LOCK = threading.Lock()

#: ``hook()`` returns the context manager entered around each ``ParameterServerStrategy.run`` (the worker's
#: local step); it sees the step's exception, if any, when exited.
RunHook = Callable[[], contextlib.AbstractContextManager[Any]]
_RUN_HOOKS: dict[str, RunHook] = {}


def register_run_hook(name: str, hook: RunHook) -> None:
    """Enter ``hook()`` around every ``ParameterServerStrategy.run`` from now on (replaces one of that name).

    How code built on the strategy (the Keras integration: a Keras model's pulls and pushes in a closure,
    :mod:`jaxdist.keras.ps_custom_loop`) acts before and after each local step without this layer importing it.
    """
    if not callable(hook):
        raise TypeError(f"run hook {name!r} must be callable, got {type(hook).__name__}")
    with _LOCAL_LOCK:
        _RUN_HOOKS[name] = hook


def run_hooks() -> dict[str, RunHook]:
    """The registered run hooks by name, in the order they are entered (a copy)."""
    with _LOCAL_LOCK:
        return dict(_RUN_HOOKS)


def local_strategy() -> Any:
    """This process's MirroredStrategy over its local devices: what ``ParameterServerStrategy.run`` runs on."""
    return _local_strategy()


def _local_strategy() -> Any:
    """This process's MirroredStrategy over its local devices (one per process, made on first use)."""
    with _LOCAL_LOCK:
        s = _LOCAL.get("mirrored")
        if s is None:
            import jax

            s = _LocalMirrored(jax.local_devices())
            _LOCAL["mirrored"] = s
        return s


def _worker_context() -> tuple[int, int] | None:
    from jaxdist.worker import context as wctx

    try:
        return wctx.current_num_workers(), wctx.current_worker_index()
    except RuntimeError:
        return None


def _make_local_mirrored_class() -> type:
    import jax

    from jaxdist.sync.engine import MeshEngine
    from jaxdist.sync.strategies import MirroredStrategy

    class LocalEngine(MeshEngine):
        """A local MirroredStrategy's engine: input pipelines are numbered by worker."""

        def input_context(self) -> InputContext:
            w = _worker_context()
            if w is None:
                return InputContext(1, 0, self.num_replicas)
            return InputContext(w[0], w[1], self.num_replicas)

    class LocalMirrored(MirroredStrategy):
        """MirroredStrategy over one process's devices, whose input pipelines are numbered by worker."""

        def _new_engine(self, devices: list[jax.Device]) -> MeshEngine:
            return LocalEngine(self, devices)

    return LocalMirrored


class _LazyClass:
    def __init__(self) -> None:
        self._cls: type | None = None

    def __call__(self, *args: Any) -> Any:
        if self._cls is None:
            self._cls = _make_local_mirrored_class()
        return self._cls(*args)


_LocalMirrored = _LazyClass()


class _Delegating:
    """Strategy methods answered by this process's local MirroredStrategy."""

    def _local(self) -> Any:
        return _local_strategy()

    def run(
        self, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, options: Any = None
    ) -> Any:
        """Run ``fn`` on every local device of this process (a worker's devices inside a closure).

        ``fn`` may update ``jaxdist.metrics`` made in this strategy's scope: their increments are
        pushed to the parameter servers when the step is done (see :mod:`jaxdist.metrics`)."""
        from jaxdist.metrics import run_with_ps_metrics  # the public layer above; imported when first run

        if _worker_context() is None:
            logger.warning(_USAGE_WARNING, "run")
        hooks = run_hooks()
        if not hooks:
            return run_with_ps_metrics(self._local(), fn, args, kwargs, options)
        with contextlib.ExitStack() as stack:
            for hook in hooks.values():
                stack.enter_context(hook())
            return run_with_ps_metrics(self._local(), fn, args, kwargs, options)

    def reduce(self, reduce_op: Any, value: Any, axis: int | None = None) -> Any:
        if _worker_context() is None:
            logger.warning(_USAGE_WARNING, "reduce")
        return self._local().reduce(reduce_op, value, axis)

    def gather(self, value: Any, axis: int) -> Any:
        return self._local().gather(value, axis)

    def experimental_local_results(self, value: Any) -> tuple[Any, ...]:
        return self._local().experimental_local_results(value)

    def experimental_distribute_values_from_function(self, value_fn: Callable[..., Any]) -> Any:
        return self._local().experimental_distribute_values_from_function(value_fn)

    def experimental_distribute_dataset(self, dataset: Any, options: Any = None, **kwargs: Any) -> Any:
        """On a worker (inside the per-worker dataset function), the dataset split over its local
        replicas; on the coordinator, a :class:`WorkerDistributedDataset` for ``create_per_worker_dataset``."""
        if _worker_context() is None:
            return WorkerDistributedDataset("experimental_distribute_dataset", dataset, options, kwargs)
        return self._local().experimental_distribute_dataset(dataset, options, **kwargs)

    def distribute_datasets_from_function(self, dataset_fn: Callable[[InputContext], Any], options: Any = None, **kwargs: Any) -> Any:
        """Use inside the per-worker dataset function (see the module docstring); on the coordinator,
        returns a :class:`WorkerDistributedDataset` for ``create_per_worker_dataset``."""
        if _worker_context() is None:
            return WorkerDistributedDataset("distribute_datasets_from_function", dataset_fn, options, kwargs)
        return self._local().distribute_datasets_from_function(dataset_fn, options, **kwargs)

    @property
    def trace_count(self) -> int:
        """Programs ``run`` has traced (compiled) in this process so far, as ``MirroredStrategy.trace_count``."""
        return int(self._local().trace_count)

    @property
    def local_num_replicas(self) -> int:
        """Replicas of ``run`` in this process (its local devices)."""
        return self._local().num_replicas_in_sync


class PSWorkerStrategy(_Delegating):
    """What a ``ParameterServerStrategy`` captured by a closure becomes on the worker."""

    @property
    def num_replicas_in_sync(self) -> int:
        return self._local().num_replicas_in_sync

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return self._local().scope()

    @property
    def extended(self) -> Any:
        return self._local().extended

    def __reduce__(self) -> tuple[Any, ...]:
        return (PSWorkerStrategy, ())

    def __repr__(self) -> str:
        return "ParameterServerStrategy(on a worker: run uses this process's devices)"


class _PSExtended:
    """``ParameterServerStrategy.extended``."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @contextlib.contextmanager
    def colocate_vars_with(self, colocate_with_variable: Any) -> Iterator[None]:
        """Variables created inside go to ``colocate_with_variable``'s PS task, unsharded (as TF)."""
        ps = getattr(colocate_with_variable, "ps_index", None)
        if ps is None:
            raise ValueError(
                f"colocate_vars_with wants a (non-sharded) variable of this ParameterServerStrategy, got "
                f"{colocate_with_variable!r}"
            )
        with self._strategy.colocated_on(ps), self._strategy.scope():
            yield

    def variable_created_in_scope(self, v: Any) -> bool:
        for var in self._strategy.variables.values():
            if var is v or v in getattr(var, "variables", ()):
                return True
        return False

    def update(self, var: Any, fn: Callable[..., Any], args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None, group: bool = True) -> Any:
        """``fn(var, *args, **kwargs)``: the update runs on the variable's PS (e.g. ``var.assign_add``)."""
        if not self.variable_created_in_scope(var):
            raise ValueError(f"update: {var!r} is not a variable of this ParameterServerStrategy")
        out = fn(var, *args, **dict(kwargs or {}))
        return out if group else (out,)

    def reduce_to(self, reduce_op: Any, value: Any, destinations: Any, options: Any = None) -> Any:
        return _local_strategy().extended.reduce_to(reduce_op, value, destinations, options)

    def batch_reduce_to(self, reduce_op: Any, value_destination_pairs: Sequence[tuple[Any, Any]], options: Any = None) -> list[Any]:
        return _local_strategy().extended.batch_reduce_to(reduce_op, value_destination_pairs, options)

    @property
    def worker_devices(self) -> tuple[Any, ...]:
        return _local_strategy().extended.worker_devices

    @property
    def parameter_devices(self) -> tuple[str, ...]:
        return tuple(f"/job:ps/task:{i}" for i in range(self._strategy.num_ps))


class WorkerDistributedDataset:
    """A distributed dataset made on the coordinator by a ``ParameterServerStrategy``: it is for the
    workers. Hand it to ``ClusterCoordinator.create_per_worker_dataset`` (each worker then makes it
    over its own devices); iterating it on the coordinator raises ValueError, as TF's does.
    """

    def __init__(self, method: str, source: Any, options: Any, kwargs: dict[str, Any]) -> None:
        self._method = method
        self._source = source
        self._options = options
        self._kwargs = kwargs

    def __iter__(self) -> Any:
        if _worker_context() is None:
            raise ValueError(
                f"a dataset made by ParameterServerStrategy.{self._method} on the coordinator cannot be iterated "
                "there: pass it (or a function that makes it) to ClusterCoordinator.create_per_worker_dataset and "
                "iterate the per-worker iterator in scheduled functions")
        made = getattr(_local_strategy(), self._method)(self._source, self._options, **self._kwargs)
        return iter(made)

    def __repr__(self) -> str:
        return f"<WorkerDistributedDataset from {self._method}>"


class PSStrategyMethods(_Delegating):
    """Mixed into ``ParameterServerStrategy``: TF's strategy methods (see the module docstring)."""

    @property
    def extended(self) -> Any:
        ext = self.__dict__.get("_extended_obj")
        if ext is None:
            ext = _PSExtended(self)
            self.__dict__["_extended_obj"] = ext
        return ext

    def __reduce__(self) -> tuple[Any, ...]:
        # A closure that captures the strategy ships this stand-in, not the PS connections.
        return (PSWorkerStrategy, ())
