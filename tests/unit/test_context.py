"""The task context's push identities in threads a closure starts, without sockets.

Each test runs "closure attempts" the way the worker service does (``use(ctx.for_closure(prefix))``)
and records the update ids their pushes would carry.
"""

from __future__ import annotations

import _thread
import asyncio
import concurrent.futures
import contextvars
import threading
from collections.abc import Callable

import pytest

from jaxdist.base.errors import UnidentifiedPushError
from jaxdist.worker import context as wctx

pytestmark = pytest.mark.timeout(60)

wctx.inherit_in_threads()  # what every worker service does


def _attempt(body: Callable[[list[str]], None]) -> list[str]:
    """Run ``body`` as one attempt of closure ``run/7``; returns the update ids its pushes took, sorted."""
    ids: list[str] = []
    with wctx.use(wctx.TaskContext().for_closure("run/7")):
        body(ids)
    return sorted(ids)


def _push(ids: list[str]) -> None:
    ids.append(wctx.next_update_id(own_connections=False))


def test_threads_a_closure_starts_carry_child_identities_that_a_rerun_repeats() -> None:
    def body(ids: list[str], order: list[int]) -> None:
        _push(ids)
        gates = [threading.Event() for _ in range(3)]

        def helper(i: int) -> None:
            gates[i].wait(10)
            _push(ids)
            _push(ids)

        threads = [threading.Thread(target=helper, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for i in order:  # the helpers push in a different order in each attempt
            gates[i].set()
            threads[i].join()
        _push(ids)

    first = _attempt(lambda ids: body(ids, [0, 1, 2]))
    again = _attempt(lambda ids: body(ids, [2, 0, 1]))
    assert first == again and len(set(first)) == 8
    assert all(i.startswith("run/7/") for i in first)
    assert {"run/7/1", "run/7/2"} <= set(first)  # the closure's own thread keeps its own sequence


def _attempt_pushing(signatures: list[str]) -> list[str]:
    """The ids of one attempt of closure ``run/7`` whose pushes name ``signatures`` (in that order),
    half of them from a thread it starts; in push order."""
    ids: list[str] = []

    def push_all() -> None:
        for sig in signatures:
            ids.append(wctx.next_update_id(own_connections=False, signature=sig))

    with wctx.use(wctx.TaskContext().for_closure("run/7")):
        push_all()
        t = threading.Thread(target=push_all)
        t.start()
        t.join()
    return ids


def test_identities_follow_what_a_push_names_so_a_rerun_on_another_path_lines_up() -> None:
    """TF's fault-tolerance model: a loop pushes ``w`` while a flag is set, then ``it``. A first attempt
    killed after three rounds and a re-run that loops once: the re-run's ``w`` push is the first
    attempt's first (a duplicate on the PS), its ``it`` push is an identity the first attempt never
    used (applied). Positions among all pushes would have put ``it`` on the first attempt's second ``w``."""
    first = _attempt_pushing(["w", "w", "w"])
    rerun = _attempt_pushing(["w", "it"])
    assert len(set(first)) == 6 and len(set(rerun)) == 4
    own, helper = rerun[:2], rerun[2:]
    assert own[0] == first[0] and helper[0] == first[3]  # the same update of w: applied at most once
    assert own[1] not in first and helper[1] not in first  # the counter's push: new
    assert own == ["run/7/w.1", "run/7/it.1"] and helper[0].startswith("run/7/") and helper[0].endswith("/w.1")
    # Another order of the same pushes is the same set of updates; more rounds are new updates.
    assert sorted(_attempt_pushing(["a", "b", "a"])) == sorted(_attempt_pushing(["a", "a", "b"]))
    more = _attempt_pushing(["w"] * 4)
    assert set(first) < set(more) and len(set(more) - set(first)) == 2


def test_a_thread_started_elsewhere_does_not_shift_the_helpers_identities() -> None:
    """A library that starts a thread lazily (only in some attempts) starts it from its own line."""

    def lazy_library_thread() -> None:
        threading.Thread(target=lambda: None).start()

    def body(ids: list[str], lazy: bool) -> None:
        if lazy:
            lazy_library_thread()
        t = threading.Thread(target=_push, args=(ids,))
        t.start()
        t.join()

    assert _attempt(lambda ids: body(ids, True)) == _attempt(lambda ids: body(ids, False))


def test_executor_calls_carry_identities_in_submit_order_and_its_threads_none() -> None:
    def body(ids: list[str], pool: concurrent.futures.ThreadPoolExecutor) -> None:
        futures = [pool.submit(_push, ids) for _ in range(4)]
        for f in futures:
            f.result()
        list(pool.map(lambda _: _push(ids), range(2)))

    with concurrent.futures.ThreadPoolExecutor(max_workers=3) as pool:
        first = _attempt(lambda ids: body(ids, pool))
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        again = _attempt(lambda ids: body(ids, pool))
        assert first == again and len(set(first)) == 6
        # The pool's threads (started inside the closure) carry no context: outside closures, its
        # calls have none, as before.
        assert pool.submit(wctx.current).result() is None
        with pytest.raises(UnidentifiedPushError):
            pool.submit(wctx.next_update_id, own_connections=False).result()


def test_a_started_thread_keeps_its_identity_in_a_copy_of_the_closures_context() -> None:
    """``asyncio.to_thread`` and ``Thread(target=contextvars.copy_context().run, ...)`` run in a copy of
    the closure's context: the thread still pushes with the identity it got when it was started."""

    def body(ids: list[str]) -> None:
        ctx = contextvars.copy_context()
        t = threading.Thread(target=ctx.run, args=(_push, ids))
        t.start()
        t.join()
        asyncio.run(asyncio.to_thread(_push, ids))

    first = _attempt(body)
    assert first == _attempt(body) and len(set(first)) == 2 and "run/7/1" not in first


def test_a_thread_sharing_the_closures_context_without_its_own_identity_is_refused() -> None:
    """A thread started by other means that enters a copy of the closure's context would share its
    sequence: the push's position would depend on scheduling, so it is refused."""
    errors: list[BaseException] = []

    def body(ids: list[str]) -> None:
        ctx = contextvars.copy_context()
        done = threading.Event()

        def shared() -> None:
            try:
                _push(ids)
            except UnidentifiedPushError as e:
                errors.append(e)
            finally:
                done.set()

        _thread.start_new_thread(ctx.run, (shared,))
        assert done.wait(10)

    assert _attempt(body) == [] and len(errors) == 1 and errors[0].code.name == "FAILED_PRECONDITION"


def test_pushes_outside_a_closures_threads() -> None:
    # The coordinator's handles (their own connections): no identity, no refusal.
    assert wctx.next_update_id(own_connections=True) == ""
    # A worker-side push from a thread without the closure's identity: refused before it is sent.
    with pytest.raises(UnidentifiedPushError):
        wctx.next_update_id(own_connections=False)
    # Threads started outside closures carry no context, as before.
    seen: list[object] = []
    t = threading.Thread(target=lambda: seen.append(wctx.current()))
    t.start()
    t.join()
    assert seen == [None]


def test_a_push_is_signed_by_its_variables_not_by_the_shards_its_rows_reached() -> None:
    """A row-sparse push to a partitioned variable reaches the shards its rows fall in: a re-run on
    other rows is the same update, and a dense gradient pushed with it stays one update."""
    import numpy as np

    from jaxdist import variables
    from jaxdist.proto.ps_wire import Op, Update

    def sig(*names: str, op: Op = Op.SPARSE_APPLY_GRADIENT) -> str:
        return variables._signature([Update(n, op, np.zeros(1, np.float32)) for n in names])

    assert sig("emb/part_0") == sig("emb/part_1") == sig("emb/part_0", "emb/part_2")
    assert sig("dense", "emb/part_0") == sig("emb/part_1", "dense")
    assert sig("emb/part_0") != sig("emb2/part_0") and sig("emb/part_0") != sig("emb/part_0", op=Op.ASSIGN_ADD)
    assert sig("dense") != sig("dense", "emb/part_0")
