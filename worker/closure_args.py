"""The per-worker argument protocol: how a closure's arguments travel to the worker that runs it.

Both ends live here, so they cannot drift apart: the coordinator pickles a
closure's ``(args, kwargs)`` with :func:`dumps`, the worker reads them back
with :func:`loads`.

Arguments are cloudpickled, except objects that stand for something that
lives *on the worker* (a per-worker dataset or iterator, one batch of an
exactly-once dataset). Those are :class:`WorkerResident` and travel as a
pickle *persistent id* (a small tuple) that the worker resolves against its
resource table:

- ``("jaxdist-resource", resource_id)``: the resource itself;
- ``("jaxdist-ledger", resource_id, index)``: batches of the resource (an
  exactly-once dataset, ``ds[i]``) assigned to the closure, seen by it as an
  iterator (:class:`LedgerBatches`) yielding them in order: ``index`` is one
  batch index, a tuple of them (``steps_per_execution``: one per step), or
  None (the data is exhausted, the iterator is empty).

A persistent id naming a resource the worker does not hold (it restarted,
or the resource was never built there) makes :func:`loads` raise
:class:`ResourceMissing`; the worker answers ``RESOURCE_UNKNOWN`` and the
coordinator rebuilds the worker's resources. A resource whose function
raised on this worker is held as a :class:`FailedResource`: naming it makes
:func:`loads` raise its :class:`~jaxdist.base.errors.PerWorkerInputError`, so
only the closures that consume it fail. Any other persistent id is a
malformed request (:class:`pickle.UnpicklingError`).

This module sits in the worker role's package (both the coordinator and the
worker may import it) and imports nothing from the coordinator: the
coordinator's handle types subclass :class:`WorkerResident`.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping, Sequence
from typing import Any


from jaxdist.base.errors import ConfigurationError, PerWorkerInputError
from jaxdist.proto import pickling

__all__ = [
    "LEDGER",
    "RESOURCE",
    "FailedResource",
    "ReleasedResource",
    "LedgerBatches",
    "ResourceMissing",
    "WorkerResident",
    "batch_ref",
    "dumps",
    "release_resource",
    "loads",
    "resource_ref",
]

#: Kind of a persistent id naming a whole per-worker resource.
RESOURCE = "jaxdist-resource"
#: Kind of a persistent id naming one batch of a per-worker (exactly-once) dataset.
LEDGER = "jaxdist-ledger"

PersistentId = tuple[Any, ...]


def resource_ref(resource_id: int) -> PersistentId:
    """The persistent id of per-worker resource ``resource_id``."""
    return (RESOURCE, resource_id)


def batch_ref(resource_id: int, index: int | Sequence[int] | None) -> PersistentId:
    """The persistent id of batch ``index`` (or batches, in order) of resource ``resource_id`` (None: no batch left)."""
    if index is None or isinstance(index, int):
        return (LEDGER, resource_id, index)
    return (LEDGER, resource_id, tuple(int(i) for i in index))


class WorkerResident:
    """Base of coordinator-side handles to things living on the worker.

    A subclass says which persistent id it travels as (:func:`resource_ref`
    or :func:`batch_ref`); nothing else of it is pickled.
    """

    __slots__ = ()

    def persistent_id(self) -> PersistentId:
        raise NotImplementedError


class ResourceMissing(Exception):
    """The arguments name a per-worker resource this worker does not hold."""

    def __init__(self, resource_id: int) -> None:
        super().__init__(f"per-worker resource {resource_id} is not on this worker")
        self.resource_id = resource_id


class FailedResource:
    """What a worker holds for a per-worker resource whose function raised there.

    ``error`` is the :class:`~jaxdist.base.errors.PerWorkerInputError` (its
    ``__cause__`` the function's exception) that every closure naming the
    resource on this worker fails with.
    """

    __slots__ = ("error",)

    def __init__(self, error: PerWorkerInputError) -> None:
        self.error = error


class ReleasedResource:
    """What :func:`release_resource` returns: a per-worker resource closure whose value is this drops
    the resource from the worker's table instead of storing it (its coordinator-side handle is gone)."""

    __slots__ = ()


def release_resource() -> ReleasedResource:
    """Runs on a worker as the resource closure of a resource to free (the coordinator sends it when the
    resource's last handle was collected, as TF frees a dropped per-worker iterator)."""
    return ReleasedResource()


class _ArgsPickler(pickling.Pickler):
    def persistent_id(self, obj: Any) -> PersistentId | None:  # noqa: D401 - pickle hook
        return obj.persistent_id() if isinstance(obj, WorkerResident) else None


def dumps(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> bytes:
    """Pickle a closure's arguments (``b""`` for none). Raises what pickling raises."""
    if not args and not kwargs:
        return b""
    buf = io.BytesIO()
    _ArgsPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump((args, dict(kwargs)))
    return buf.getvalue()


class LedgerBatches:
    """The iterator a closure sees for an exactly-once dataset: the batches the ledger assigned it.

    ``len()`` is the number of batches not taken yet. Once they are taken,
    ``next`` raises ``StopIteration`` (end of data) if the closure was
    assigned none (the ledger is exhausted), else :class:`ConfigurationError`:
    the data is not over, the closure asked for more batches than it was
    given (one per step; ``steps_per_execution(fn, k)`` gives k).
    """

    __slots__ = ("_dataset", "_indices", "_next")

    def __init__(self, dataset: Any, indices: Sequence[int]) -> None:
        self._dataset = dataset
        self._indices = tuple(indices)
        self._next = 0

    def __iter__(self) -> LedgerBatches:
        return self

    def __len__(self) -> int:
        return len(self._indices) - self._next

    def __next__(self) -> Any:
        if self._next >= len(self._indices):
            if not self._indices:
                raise StopIteration
            raise ConfigurationError(
                f"this closure was given {len(self._indices)} batch(es) of an exactly-once dataset and asked for "
                "another: each closure gets one batch per step (steps_per_execution(fn, k): k), so every batch "
                "is trained on exactly once; call next() once per step"
            )
        index = self._indices[self._next]
        self._next += 1
        return self._dataset[index]


def _ledger_indices(pid: tuple[Any, ...]) -> tuple[int, ...]:
    """The batch indices a ledger persistent id names (see :func:`batch_ref`)."""
    index = pid[2]
    if index is None:
        return ()
    if type(index) is int:
        return (index,)
    if type(index) is tuple and all(type(i) is int for i in index):
        return index
    raise pickle.UnpicklingError(f"malformed persistent id {pid!r}")


class _ArgsUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, resources: Mapping[int, Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._resources = resources

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or len(pid) < 2 or pid[0] not in (RESOURCE, LEDGER):
            raise pickle.UnpicklingError(f"unknown persistent id {pid!r}")
        rid = pid[1]
        try:
            resource = self._resources[rid]
        except KeyError:
            raise ResourceMissing(rid) from None
        if isinstance(resource, FailedResource):
            raise resource.error.with_traceback(None)  # raised per consumer: its traceback must not grow
        if pid[0] == LEDGER:
            if len(pid) != 3:
                raise pickle.UnpicklingError(f"malformed persistent id {pid!r}")
            return LedgerBatches(resource, _ledger_indices(pid))
        return resource


def loads(data: bytes, resources: Mapping[int, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A closure's ``(args, kwargs)`` from :func:`dumps`' bytes, per-worker resources from ``resources``.

    Raises:
        ResourceMissing: a named resource is not in ``resources``.
        PerWorkerInputError: a named resource failed to build here (a :class:`FailedResource`).
        pickle.UnpicklingError: an unknown persistent id (and whatever else unpickling raises).
    """
    if not data:
        return (), {}
    args, kwargs = _ArgsUnpickler(data, resources).load()
    return args, kwargs
