"""The PS client's deadlines follow the work a call asks for, not only the bytes it sends."""

from __future__ import annotations

import numpy as np
import pytest

from jaxdist.base.errors import InvalidRequestError
from jaxdist.ps_server.client import CreateSpec, create_deadline, deadline_for

pytestmark = pytest.mark.timeout(60)


def _init(shape, dtype, offset):  # type: ignore[no-untyped-def]
    return np.zeros(shape, dtype)


def test_a_create_by_initializer_gets_the_time_its_shard_needs_though_nothing_travels() -> None:
    small = create_deadline([CreateSpec("s", shape=(4, 3), dtype="float32", initializer=_init)])
    third_of_2m_x_64 = create_deadline([CreateSpec("t", shape=(666_667, 64), dtype="float32", initializer=_init)])
    assert small == pytest.approx(deadline_for(0), abs=0.01)  # a small create: the base deadline
    # 170 MB made on the PS (its initializer runs there): far more than moving those bytes would be given.
    assert third_of_2m_x_64 > deadline_for(666_667 * 64 * 4) + 20
    doubled = create_deadline([CreateSpec("t", shape=(666_667, 64), dtype="float64", initializer=_init)])
    assert doubled - deadline_for(0) == pytest.approx(2 * (third_of_2m_x_64 - deadline_for(0)))


def test_a_create_deadline_adds_up_its_entries_values_included() -> None:
    one = create_deadline([CreateSpec("a", value=np.zeros((1000, 1000), np.float32))])
    two = create_deadline([CreateSpec("a", value=np.zeros((1000, 1000), np.float32)),
                           CreateSpec("b", shape=(1000, 1000), dtype=np.float32, initializer=_init)])
    assert two - deadline_for(0) == pytest.approx(2 * (one - deadline_for(0)))
    # A dtype that cannot travel is refused as encoding the create refuses it.
    with pytest.raises(InvalidRequestError):
        create_deadline([CreateSpec("c", shape=(10,), dtype="not-a-dtype", initializer=_init)])
