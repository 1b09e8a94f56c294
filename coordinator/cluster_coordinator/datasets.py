"""Per-worker datasets and the exactly-once data ledger (the coordinator's side).

- :class:`PerWorkerDataset`: ``dataset_fn`` built on every worker (and
  rebuilt on a worker that restarts or joins); ``iter()`` of it is a
  :class:`PerWorkerDatasetIterator` that closures receive as their own
  worker's iterator.
- **Exactly-once data** (:class:`ExactlyOnceDataset`): ``dataset_fn``
  returns the whole data set as ``num_batches`` batches; the coordinator's
  :class:`DataLedger` gives each scheduled closure one batch *position*
  (:func:`assign_ledger_positions`, at ``schedule`` time) and the closure's
  ``next(it)`` returns that batch on whichever worker runs it. A closure
  re-run after a worker failure keeps its position; a cancelled or failed
  closure gives it back to a later closure; after ``num_batches * epochs``
  positions ``next`` ends the data. With exactly-once updates every batch
  of every epoch is trained on exactly once.
- :func:`steps_per_execution` runs several steps in one closure; with an
  exactly-once iterator the closure gets one batch position per step (k
  positions, fewer at the end of the data), all kept by a re-run.

Batches travel to the worker as persistent ids of the argument protocol
(:mod:`jaxdist.worker.closure_args`); the worker reads ``ds[index]`` itself.
"""

from __future__ import annotations

import collections
import collections.abc
import inspect
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
from jaxdist.base.errors import ConfigurationError
from jaxdist.base.input_context import InputContext
from jaxdist.cluster_coordinator.closure_queue import Closure
from jaxdist.cluster_coordinator.remote_value import PerWorkerResourceValues, PerWorkerValues
from jaxdist.worker.closure_args import LedgerBatches, PersistentId, WorkerResident, batch_ref
from jaxdist.worker.context import current_num_workers, current_worker_index

if TYPE_CHECKING:
    from jaxdist.cluster_coordinator.coordinator import ClusterCoordinator

__all__ = [
    "DataLedger",
    "ExactlyOnceDataset",
    "ExactlyOnceIterator",
    "LedgerItem",
    "PerWorkerDataset",
    "PerWorkerDatasetIterator",
    "StepsPerExecution",
    "assign_ledger_positions",
    "steps_per_execution",
]


class DataLedger:
    """The coordinator's record of which batches of an epoch were handed out and trained on.

    Positions ``0 .. num_batches * epochs - 1`` are handed out in order
    (position ``p`` is batch ``p % num_batches``); a closure that is
    cancelled or fails gives its position back and the next closure gets it
    again; a closure re-run after a worker failure keeps its position. With
    exactly-once updates this trains on every batch of every epoch exactly
    once. Thread-safe.

    In a checkpoint (:meth:`state`): the positions done, the ones given
    back, and how far positions were handed out. A position handed out but
    neither done nor given back (its closure queued, or running) is handed
    out again first by a ledger restored from it (:meth:`load_state`): the
    checkpoint's save re-ran to their end the closures that may have
    trained in part (``ClusterCoordinator.paused(drain=True)``), so such a
    position's closure never ran and its batch is in no saved variable.
    """

    def __init__(self, num_batches: int, epochs: int = 1) -> None:
        if num_batches < 1 or epochs < 1:
            raise ValueError("num_batches and epochs must be >= 1")
        self.num_batches = num_batches
        self.epochs = epochs
        self._next = 0
        self._returned: collections.deque[int] = collections.deque()
        self._done: set[int] = set()
        self._consumed: set[int] = set()  # failed after a push of them may have applied: never handed out again
        self._out: set[int] = set()  # handed out, neither done nor given back: a closure holds it
        self._lock = threading.Lock()

    def take(self) -> int | None:
        """The next position to train on (given-back ones first); None when the data is exhausted."""
        with self._lock:
            if self._returned:
                pos = self._returned.popleft()
            elif self._next >= self.num_batches * self.epochs:
                return None
            else:
                pos = self._next
                self._next += 1
            self._out.add(pos)
            return pos

    def give_back(self, position: int) -> None:
        """``position``'s closure was cancelled or failed: hand it out again, first."""
        with self._lock:
            self._out.discard(position)
            if position not in self._done and position not in self._consumed:
                self._returned.appendleft(position)

    def mark_done(self, position: int) -> None:
        """``position``'s closure finished: its batch is trained on."""
        with self._lock:
            self._out.discard(position)
            self._done.add(position)

    def mark_consumed(self, position: int) -> None:
        """``position``'s closure failed (or was cancelled) after a push of it may have been applied: the
        batch is never handed out again (a new closure's pushes would repeat the applied ones under new
        identities). It counts as trained for :attr:`remaining`; :attr:`consumed` lists it."""
        with self._lock:
            self._out.discard(position)
            if position not in self._done:
                self._consumed.add(position)

    @property
    def consumed(self) -> list[int]:
        """Positions whose closure failed or was cancelled after it may have applied a push: each of their
        batches was trained at most in part, and is not handed out again."""
        with self._lock:
            return sorted(self._consumed)

    @property
    def completed(self) -> int:
        """Positions whose closure finished (their batches trained on); not the :attr:`consumed` ones."""
        with self._lock:
            return len(self._done)

    @property
    def remaining(self) -> int:
        """Positions not done yet, handed out or not: what a run resumed from a checkpoint still
        schedules (one closure per position; ``steps_per_execution(fn, k)``: one per ``k``)."""
        with self._lock:
            return self.num_batches * self.epochs - len(self._done) - len(self._consumed)

    def state(self) -> dict[str, Any]:
        """Serializable state (for checkpoints): what was trained and what remains."""
        with self._lock:
            return {"num_batches": self.num_batches, "epochs": self.epochs, "next": self._next,
                    "returned": sorted(self._returned), "done": sorted(self._done), "consumed": sorted(self._consumed)}

    def load_state(self, state: dict[str, Any]) -> None:
        """Become the ledger ``state`` describes (a checkpoint's). Positions handed out but not
        completed then are handed out again first.

        Raises:
            ConfigurationError: closures hold positions of this ledger (scheduled and not yet
                finished, failed or cancelled): the restored ledger would hand their batches out
                again while they train them. Restore before scheduling, or after ``join()``.
        """
        done = set(state["done"])
        consumed = set(state.get("consumed", ()))  # (checkpoints before this release have none)
        returned = collections.deque(sorted((set(state["returned"]) | set(range(state["next"]))) - done - consumed))
        with self._lock:
            self._check_restorable()
            self.num_batches = state["num_batches"]
            self.epochs = state["epochs"]
            self._done = done
            self._consumed = consumed
            self._out = set()
            self._returned = returned
            self._next = state["next"]

    def check_restorable(self) -> None:
        """Raise what :meth:`load_state` would raise now (closures hold positions); ``Checkpoint.restore``
        checks this before it changes any variable."""
        with self._lock:
            self._check_restorable()

    def _check_restorable(self) -> None:
        # Under the lock.
        if self._out:
            raise ConfigurationError(
                f"cannot restore the data ledger while {len(self._out)} scheduled closure(s) hold batch positions "
                "of it (queued or running): their batches would be handed out again and trained twice. Restore "
                "the checkpoint before scheduling closures on this dataset, or after coordinator.join()"
            )

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DataLedger:
        led = cls(state["num_batches"], state["epochs"])
        led.load_state(state)
        return led


class LedgerItem(WorkerResident):
    """Batch ``index`` of per-worker dataset ``resource_id``: one batch index, a tuple of them (one per
    step of a :func:`steps_per_execution` closure, in order), or None (the ledger is exhausted)."""

    __slots__ = ("resource_id", "index")

    def __init__(self, resource_id: int, index: int | tuple[int, ...] | None) -> None:
        self.resource_id = resource_id
        self.index = index

    def persistent_id(self) -> PersistentId:
        return batch_ref(self.resource_id, self.index)


def assign_ledger_positions(closure: Closure) -> None:
    """Give ``closure`` its ledger positions for each exactly-once iterator among its arguments.

    One position per iterator, or ``k`` for a :func:`steps_per_execution`
    function of ``k`` steps (one per step; fewer when the data runs out). The
    iterators are replaced by :class:`LedgerItem`s, so a re-run of the
    closure trains the same batches; the positions are marked done when the
    closure finishes and given back when it is cancelled or fails (the
    closure's ``on_done``/``on_cancel``).
    """
    per_closure = closure.fn.steps if isinstance(closure.fn, StepsPerExecution) else 1
    taken: list[tuple[DataLedger, int]] = []

    def assign(x: Any) -> Any:
        if not isinstance(x, ExactlyOnceIterator):
            return x
        indices = []
        for _ in range(per_closure):
            pos = x.ledger.take()
            if pos is None:
                break
            taken.append((x.ledger, pos))
            indices.append(pos % x.ledger.num_batches)
        if per_closure > 1:
            return LedgerItem(x.resource_id, tuple(indices) or None)
        return LedgerItem(x.resource_id, indices[0] if indices else None)

    closure.args, closure.kwargs = jax.tree.map(
        assign, (closure.args, closure.kwargs), is_leaf=lambda x: isinstance(x, PerWorkerValues)
    )
    if taken:

        def on_done() -> None:
            for led, p in taken:
                led.mark_done(p)

        def on_cancel() -> None:
            for led, p in reversed(taken):  # each goes to the front: in reverse, they are handed out in order again
                led.give_back(p)

        def on_consumed() -> None:
            for led, p in taken:
                led.mark_consumed(p)

        closure.on_done = on_done
        closure.on_cancel = on_cancel
        closure.on_consumed = on_consumed


class DatasetObject:
    """A dataset *object* given to ``create_per_worker_dataset`` instead of a function (TF accepts a
    ``tf.data.Dataset`` there): every worker gets a copy (pickled with the closure) and iterates its own.

    Only a re-iterable object qualifies (a list, an array, a class with ``__iter__``): a worker that
    restarts or joins builds the dataset again and must start a new pass, which a one-shot iterator
    (a generator, ``map(...)``, ``iter(x)``) cannot give.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __call__(self) -> Any:
        return self.dataset

    def __repr__(self) -> str:
        return f"DatasetObject({type(self.dataset).__name__})"


def as_dataset_fn(dataset: Any) -> Callable[..., Any]:
    """``dataset`` itself when it is a function, else a :class:`DatasetObject` for a re-iterable
    dataset object; raises TypeError for anything else (a one-shot iterator included)."""
    if callable(dataset):
        return dataset
    if isinstance(dataset, collections.abc.Iterator):
        raise TypeError(
            f"create_per_worker_dataset got a one-shot iterator ({type(dataset).__name__}): a worker that "
            "restarts builds its dataset again and needs a new pass; pass a function that makes it "
            "(lambda: ...) or a re-iterable object (a list, an array, a class with __iter__)")
    if not isinstance(dataset, collections.abc.Iterable):  # (not iter(): a dataset may refuse the coordinator)
        raise TypeError(
            f"create_per_worker_dataset wants a dataset function (or a re-iterable dataset object), got "
            f"{type(dataset).__name__}")
    return DatasetObject(dataset)


def _call_dataset_fn(dataset_fn: Callable[..., Any]) -> Any:
    """Runs on the worker: ``dataset_fn(InputContext)`` (or ``dataset_fn()`` if it takes nothing)."""
    ctx = InputContext(num_input_pipelines=current_num_workers(), input_pipeline_id=current_worker_index(), num_replicas_in_sync=1)
    try:
        takes_arg = bool(inspect.signature(dataset_fn).parameters)
    except (TypeError, ValueError):
        takes_arg = True
    return dataset_fn(ctx) if takes_arg else dataset_fn()


class PerWorkerDataset:
    """A dataset built on every worker. ``iter()`` gives a :class:`PerWorkerDatasetIterator`."""

    def __init__(self, coordinator: ClusterCoordinator, dataset_fn: Callable[..., Any]) -> None:
        self._coordinator = coordinator
        self._values = coordinator.create_per_worker_resource(_call_dataset_fn, (dataset_fn,))

    @property
    def resource(self) -> PerWorkerResourceValues:
        """The per-worker resource the dataset is on each worker."""
        return self._values

    def __iter__(self) -> PerWorkerDatasetIterator:
        return PerWorkerDatasetIterator(self._coordinator.create_per_worker_resource(iter, (self._values,)))


class ExactlyOnceDataset(PerWorkerDataset):
    """A per-worker dataset read by batch position from the coordinator's :class:`DataLedger`."""

    def __init__(self, coordinator: ClusterCoordinator, dataset_fn: Callable[..., Any], ledger: DataLedger) -> None:
        super().__init__(coordinator, dataset_fn)
        self.ledger = ledger

    def __iter__(self) -> ExactlyOnceIterator:  # type: ignore[override]
        return ExactlyOnceIterator(self._values, self.ledger)


class ExactlyOnceIterator(PerWorkerValues):
    """Pass to ``schedule``: each closure gets the batch the ledger assigns it."""

    def __init__(self, values: PerWorkerResourceValues, ledger: DataLedger) -> None:
        self._inner = values
        self.resource_id = values.resource_id
        self.ledger = ledger

    def value_for(self, worker_index: int) -> Any:  # pragma: no cover - replaced at schedule time
        raise AssertionError("ledger iterators are resolved when the closure is scheduled")

    def __iter__(self) -> ExactlyOnceIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError("pass the iterator to coordinator.schedule(fn, args=(it,)) and call next(it) inside fn")


class PerWorkerDatasetIterator(PerWorkerValues):
    """One iterator per worker; pass it to ``schedule`` and call ``next()`` on it in the closure."""

    def __init__(self, values: PerWorkerValues) -> None:
        self._inner = values

    def value_for(self, worker_index: int) -> Any:
        return self._inner.value_for(worker_index)

    def __iter__(self) -> PerWorkerDatasetIterator:
        return self

    def __next__(self) -> Any:
        raise TypeError(
            "a per-worker iterator lives on the workers: pass it to coordinator.schedule(fn, args=(it,)) "
            "and call next(it) inside fn"
        )

    def __repr__(self) -> str:
        return f"PerWorkerDatasetIterator({self._inner!r})"


class StepsPerExecution:
    """``fn`` run ``steps`` times in one closure (made by :func:`steps_per_execution`); picklable.

    On the worker, when the arguments hold exactly-once batches
    (:class:`~jaxdist.worker.closure_args.LedgerBatches`), it runs one step
    per batch assigned (``steps``, or fewer at the end of the data), so no
    step asks for a batch the ledger did not give this closure; with none
    assigned (the data is over) it runs one step, whose ``next`` ends the data.
    """

    def __init__(self, fn: Callable[..., Any], steps: int) -> None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        self.fn = fn
        self.steps = steps
        self.__name__ = f"{getattr(fn, '__name__', 'fn')}_x{steps}"
        self.__qualname__ = self.__name__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        steps = self.steps
        assigned = [len(b) for b in jax.tree.leaves((args, kwargs), is_leaf=lambda x: isinstance(x, LedgerBatches))
                    if isinstance(b, LedgerBatches)]
        if assigned:
            steps = max(1, min(steps, *assigned))
        out = None
        for _ in range(steps):
            out = self.fn(*args, **kwargs)
        return out

    def __repr__(self) -> str:
        return f"steps_per_execution({self.fn!r}, {self.steps})"


def steps_per_execution(fn: Callable[..., Any], steps: int) -> StepsPerExecution:
    """Run ``fn`` ``steps`` times inside one closure (TF's ``steps_per_execution``); returns the last result.

    Scheduling ``steps_per_execution(train_step, 10)`` cuts per-closure
    overhead tenfold. Each inner step's pushes keep their own identities, so
    a re-run closure still applies every step's update exactly once. With an
    exactly-once iterator (``create_per_worker_dataset(..., exactly_once=True)``)
    the closure gets ``steps`` batch positions, one per step, and a re-run
    trains the same ones; the last closure of the data may get fewer and runs
    that many steps.
    """
    return StepsPerExecution(fn, steps)
