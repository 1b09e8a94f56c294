"""The data ledger, ledger positions of scheduled closures and the per-worker argument protocol, without
sockets: the coordinator's end (pickling) and the worker's end (unpickling) of the same bytes."""

from __future__ import annotations

import pickle

import cloudpickle

import pytest
from jaxdist.base.errors import ConfigurationError
from jaxdist.cluster_coordinator.closure_queue import Closure
from jaxdist.cluster_coordinator.datasets import DataLedger, ExactlyOnceIterator, LedgerItem, assign_ledger_positions
from jaxdist.cluster_coordinator.remote_value import PerWorkerResource, PerWorkerResourceValues, PerWorkerValues, resolve_per_worker
from jaxdist.worker import closure_args

pytestmark = pytest.mark.timeout(30)


def noop(*args: object) -> None:
    return None


# ------------------------------------------------------------------------ ledger
def test_ledger_sans_io() -> None:
    led = DataLedger(num_batches=3, epochs=2)
    got = [led.take() for _ in range(4)]
    assert got == [0, 1, 2, 3]
    led.give_back(1)
    assert led.take() == 1
    for p in (0, 1, 2):
        led.mark_done(p)
    restored = DataLedger.from_state(led.state())
    assert [restored.take() for _ in range(4)] == [3, 4, 5, None]


def test_ledger_ignores_giving_back_a_done_position() -> None:
    led = DataLedger(num_batches=2)
    a = led.take()
    assert a == 0
    led.mark_done(a)
    led.give_back(a)
    assert [led.take(), led.take()] == [1, None]
    assert led.completed == 1


def test_ledger_load_state_reissues_what_was_handed_out_but_not_done() -> None:
    led = DataLedger(num_batches=5)
    for _ in range(4):
        led.take()
    led.mark_done(1)
    led.give_back(3)
    other = DataLedger(num_batches=1)
    other.load_state(led.state())
    assert (other.num_batches, other.epochs, other.completed) == (5, 1, 1)
    assert [other.take() for _ in range(5)] == [0, 2, 3, 4, None]


def test_ledger_remaining_counts_what_is_not_done() -> None:
    led = DataLedger(num_batches=3, epochs=2)
    assert led.remaining == 6
    a, b = led.take(), led.take()
    assert led.remaining == 6  # handed out is not done
    led.mark_done(a)
    led.give_back(b)
    assert (led.remaining, led.completed) == (5, 1)
    assert DataLedger.from_state(led.state()).remaining == 5  # what a resumed run still schedules


def test_ledger_refuses_to_load_a_state_while_closures_hold_positions() -> None:
    led = DataLedger(num_batches=4)
    saved = DataLedger(num_batches=4).state()
    held = led.take()
    assert held is not None
    with pytest.raises(ConfigurationError, match="1 scheduled closure"):
        led.load_state(saved)
    with pytest.raises(ConfigurationError):
        led.check_restorable()
    assert led.take() == 1  # unchanged by the refused load
    led.mark_done(held)
    led.give_back(1)
    led.check_restorable()  # every position settled: a restore is safe
    led.load_state(saved)
    assert [led.take() for _ in range(5)] == [0, 1, 2, 3, None]


def test_ledger_rejects_empty_data() -> None:
    with pytest.raises(ValueError):
        DataLedger(num_batches=0)
    with pytest.raises(ValueError):
        DataLedger(num_batches=1, epochs=0)


# ------------------------------------------------------------------ positions
def test_each_closure_gets_one_position_marked_done_or_given_back() -> None:
    led = DataLedger(num_batches=2, epochs=2)
    it = ExactlyOnceIterator(PerWorkerResourceValues(7), led)
    closures = [Closure(noop, (it,), per_worker=True) for _ in range(5)]
    for c in closures:
        assign_ledger_positions(c)
    items = [c.args[0] for c in closures]
    assert all(isinstance(i, LedgerItem) and i.resource_id == 7 for i in items)
    assert [i.index for i in items] == [0, 1, 0, 1, None]  # position p is batch p % num_batches; then exhausted
    closures[0].succeed(b"")
    closures[1].fail(RuntimeError("lost"))  # its batch goes to a later closure
    assert led.completed == 1
    later = Closure(noop, (it,), per_worker=True)
    assign_ledger_positions(later)
    assert later.args[0].index == 1
    closures[4].cancel(RuntimeError("never ran"))  # exhausted: nothing to give back
    assert led.take() is None


def test_closures_without_ledger_iterators_are_left_alone() -> None:
    c = Closure(noop, (1, PerWorkerValues(["a", "b"])), {"k": 2}, per_worker=True)
    args = c.args
    assign_ledger_positions(c)
    assert c.args[0] == 1 and c.args[1] is args[1] and c.on_done is None and c.on_cancel is None


# ------------------------------------------------------------ argument protocol
def test_per_worker_arguments_resolve_per_worker() -> None:
    pw = PerWorkerValues(["zero", "one"])
    res = PerWorkerResourceValues(3)
    (a, r), kw = resolve_per_worker(((pw, res), {"x": pw}), 1)
    assert a == "one" and kw == {"x": "one"}
    assert isinstance(r, PerWorkerResource) and (r.resource_id, r.worker_index) == (3, 1)


def test_argument_bytes_carry_resources_and_batches_by_reference() -> None:
    dataset = ["b0", "b1", "b2"]
    iterator = iter(range(10))
    data = closure_args.dumps((PerWorkerResource(1, 0), LedgerItem(2, 2), [3, 4]), {"it": PerWorkerResource(1, 0)})
    args, kwargs = closure_args.loads(data, {1: iterator, 2: dataset})
    assert args[0] is iterator and kwargs["it"] is iterator and args[2] == [3, 4]
    batch = args[1]
    assert iter(batch) is batch
    assert len(batch) == 1 and next(batch) == "b2" and len(batch) == 0
    with pytest.raises(ConfigurationError):  # one batch per closure: asking for more is an error, not end of data
        next(batch)
    (exhausted,), _ = closure_args.loads(closure_args.dumps((LedgerItem(2, None),), {}), {2: dataset})
    with pytest.raises(StopIteration):  # the ledger ran out: end of data
        next(exhausted)


def test_no_arguments_are_no_bytes() -> None:
    assert closure_args.dumps((), {}) == b""
    assert closure_args.loads(b"", {}) == ((), {})


def test_a_resource_the_worker_lacks_is_reported() -> None:
    data = closure_args.dumps((PerWorkerResource(5, 0),), {})
    with pytest.raises(closure_args.ResourceMissing) as info:
        closure_args.loads(data, {})
    assert info.value.resource_id == 5


def test_unknown_persistent_ids_are_refused() -> None:
    class Forged(closure_args.WorkerResident):
        def persistent_id(self) -> tuple[object, ...]:
            return ("os.system", "rm -rf")

    data = closure_args.dumps((Forged(),), {})
    with pytest.raises(pickle.UnpicklingError):
        closure_args.loads(data, {"rm -rf": 1})


# ------------------------------------------------------ steps_per_execution x ledger
def test_steps_per_execution_closures_get_one_position_per_step() -> None:
    """``steps_per_execution(fn, k)`` with an exactly-once iterator takes k positions per
    closure (fewer at the end of the data); a failed closure gives all of them back, in order."""
    from jaxdist.cluster_coordinator.datasets import steps_per_execution

    led = DataLedger(num_batches=5)
    it = ExactlyOnceIterator(PerWorkerResourceValues(7), led)
    step = steps_per_execution(noop, 2)
    closures = [Closure(step, (it,), per_worker=True) for _ in range(4)]
    for c in closures:
        assign_ledger_positions(c)
    assert [c.args[0].index for c in closures] == [(0, 1), (2, 3), (4,), None]
    closures[0].succeed(b"")
    closures[1].fail(RuntimeError("lost"))
    assert led.completed == 2
    again = Closure(step, (it,), per_worker=True)
    assign_ledger_positions(again)
    assert again.args[0].index == (2, 3)


def test_steps_per_execution_runs_one_step_per_assigned_batch_on_the_worker() -> None:
    from jaxdist.cluster_coordinator.datasets import steps_per_execution

    dataset = [f"b{i}" for i in range(6)]
    seen: list[str] = []

    def train(iterator: object) -> str:
        seen.append(next(iterator))  # type: ignore[call-overload]
        return seen[-1]

    step = steps_per_execution(train, 3)
    for index, want in (((1, 4, 5), ["b1", "b4", "b5"]), ((2,), ["b2"])):
        seen.clear()
        (batches,), _ = closure_args.loads(closure_args.dumps((LedgerItem(2, index),), {}), {2: dataset})
        assert step(batches) == want[-1] and seen == want  # the last closure of the data runs fewer steps
    (exhausted,), _ = closure_args.loads(closure_args.dumps((LedgerItem(2, None),), {}), {2: dataset})
    with pytest.raises(StopIteration):  # no batch at all: one step, whose next() ends the data
        step(exhausted)
    seen.clear()
    assert steps_per_execution(lambda: seen.append("x"), 4)() is None and seen == ["x"] * 4  # no ledger: k steps
    with pytest.raises(ValueError):
        steps_per_execution(train, 0)
    assert pickle.loads(cloudpickle.dumps(step)).steps == 3


def test_malformed_ledger_ids_are_refused() -> None:
    class Forged(closure_args.WorkerResident):
        def __init__(self, index: object) -> None:
            self.index = index

        def persistent_id(self) -> tuple[object, ...]:
            return (closure_args.LEDGER, 2, self.index)

    for bad in ("1", 1.5, (1, "2"), [1, 2], (True,)):
        with pytest.raises(pickle.UnpicklingError):
            closure_args.loads(closure_args.dumps((Forged(bad),), {}), {2: [0, 1, 2]})
