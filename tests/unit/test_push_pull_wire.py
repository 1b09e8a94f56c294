"""The fused push-then-pull (PushPull) message: encoding, decoding, and what a PS refuses before reading a payload."""

from __future__ import annotations

import numpy as np
import pytest

from jaxdist.base.errors import InvalidRequestError, PayloadTooLargeError
from jaxdist.proto import ps_pb2, ps_wire
from jaxdist.proto.ps_wire import CreateSpec, Op, PullSpec, Update
from jaxdist.transport import dataplane


def test_encode_push_pull_carries_the_push_and_its_reads() -> None:
    g = np.arange(6, dtype=np.float32).reshape(2, 3)
    header, arrays = ps_wire.encode_push_pull(
        [Update("w", Op.APPLY_GRADIENT, g)],
        [PullSpec("w"), PullSpec("e", indices=np.array([3, 1])), PullSpec("w", as_dtype=np.dtype("float16"))],
        update_id="c1/1", contributor=2)
    back = ps_pb2.PushHeader.FromString(header.SerializeToString())
    assert back.update_id == "c1/1" and back.contributor == 3  # worker index + 1, as a push's
    assert ps_wire.push_payload_specs(back, 1 << 20) == [((2, 3), np.dtype(np.float32))]
    assert len(arrays) == 1 and np.array_equal(arrays[0], g)
    (u,) = ps_wire.decode_updates(back, iter(arrays))
    assert (u.name, u.op) == ("w", Op.APPLY_GRADIENT)
    reads = ps_wire.decode_pull_after(back, 1 << 20)
    assert [r.name for r in reads] == ["w", "e", "w"]
    assert reads[0].indices is None and reads[0].as_dtype is None
    assert reads[1].indices.tolist() == [3, 1]
    assert reads[2].as_dtype == np.dtype("float16")


def test_a_push_pull_without_reads_is_refused() -> None:
    header, _ = ps_wire.encode_push_pull([Update("w", Op.ASSIGN, np.zeros(2, np.float32))], [])
    with pytest.raises(InvalidRequestError, match="pull_after is empty"):
        ps_wire.decode_pull_after(header, 1 << 20)


def test_a_create_cannot_read_back() -> None:
    header, _ = ps_wire.encode_create([CreateSpec("w", value=np.zeros(2, np.float32))])
    header.pull_after.add(name="w")
    with pytest.raises(InvalidRequestError, match="cannot read any back"):
        ps_wire.push_payload_specs(header, 1 << 20)


def test_malformed_reads_are_typed_errors() -> None:
    header, _ = ps_wire.encode_push_pull([Update("w", Op.ASSIGN, np.zeros(2, np.float32))], [PullSpec("w")])
    header.pull_after[0].as_dtype = 9999  # no such dtype
    with pytest.raises(InvalidRequestError):
        ps_wire.decode_pull_after(header, 1 << 20)
    header, _ = ps_wire.encode_push_pull([Update("w", Op.ASSIGN, np.zeros(2, np.float32))],
                                         [PullSpec("w", indices=np.arange(1000))])
    with pytest.raises(PayloadTooLargeError):
        ps_wire.decode_pull_after(header, 64)  # inline index tensor over the PS's limit


def test_push_pull_has_its_own_data_plane_method() -> None:
    assert dataplane.PUSH_PULL not in (dataplane.PULL, dataplane.PUSH, dataplane.SHM_ATTACH)
    assert dataplane.METHOD_NAMES[dataplane.PUSH_PULL] == "PushPull"
