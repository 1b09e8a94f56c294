"""Receive buffers reused once nobody holds them (jaxdist.proto.recycle): never while a caller can see them."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from jaxdist.errors import ConfigurationError
from jaxdist.proto import recycle
from jaxdist.proto.recycle import RecvPool

MB = 1 << 20


def _addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_a_dropped_buffer_is_reused_and_a_held_one_never_is() -> None:
    pool = RecvPool(max_bytes=64 * MB)
    a = pool.empty((MB // 4,), np.float32)
    where = _addr(a)
    b = pool.empty((MB // 4,), np.float32)  # ``a`` is held: a new buffer
    assert _addr(b) != where
    del a
    gc.collect()
    c = pool.empty((256, 1024), np.float32)  # same bytes, another shape: ``a``'s buffer again
    assert _addr(c) == where and c.shape == (256, 1024) and c.dtype == np.float32
    assert (pool.reused, pool.allocated) == (1, 2)


def _keep(a: np.ndarray, keep: str) -> object:
    """Something that sees ``a``'s bytes, of kind ``keep``."""
    if keep == "slice":
        return a[10:20]
    if keep == "reshape":
        return a.reshape(512, -1)
    if keep == "memoryview":
        return memoryview(a)
    if keep == "frombuffer":
        return np.frombuffer(memoryview(a), np.float32)
    if keep == "dtype_view":
        return a.view(np.int32)
    return [a]


def _seen(held: object) -> np.ndarray:
    """A copy of the bytes ``held`` sees."""
    obj = held[0] if isinstance(held, list) else held
    return np.array(np.asarray(obj).reshape(-1).view(np.uint8))


@pytest.mark.parametrize("keep", ["slice", "reshape", "memoryview", "frombuffer", "dtype_view", "in_a_list"])
def test_any_view_of_a_handed_out_array_keeps_its_buffer_from_reuse(keep: str) -> None:
    """A caller that dropped the array itself but kept something that sees its bytes keeps them:
    the buffer is not handed out again (its bytes stay as they were) until that goes too."""
    pool = RecvPool(max_bytes=64 * MB)
    a = pool.empty((MB // 4,), np.float32)
    a[:] = np.arange(a.size, dtype=np.float32)
    held = _keep(a, keep)
    before = _seen(held)
    where = _addr(a)
    del a
    gc.collect()
    for _ in range(3):
        other = pool.empty((MB // 4,), np.float32)
        assert _addr(other) != where
        other[:] = -1  # writing the new buffer must not touch the held bytes
    assert np.array_equal(_seen(held), before)
    del held
    gc.collect()
    again = pool.empty((MB // 4,), np.float32)
    assert _addr(again) == where


def test_small_and_oversized_arrays_are_not_pooled_and_the_cap_holds() -> None:
    pool = RecvPool(max_bytes=3 * MB)
    small = pool.empty((100,), np.float32)
    assert small.shape == (100,) and pool.held_bytes == 0
    big = pool.empty((4 * MB,), np.uint8)  # over the cap: plain np.empty
    assert big.nbytes == 4 * MB and pool.held_bytes == 0
    x = pool.empty((2 * MB,), np.uint8)
    y = pool.empty((2 * MB,), np.uint8)  # x is held: y is made but would pass the cap, so not kept
    assert pool.held_bytes == 2 * MB
    del x
    gc.collect()
    z = pool.empty((3 * MB,), np.uint8)  # the free 2 MB one is released to make room
    assert pool.held_bytes == 3 * MB and z.nbytes == 3 * MB
    del y, z


def test_pool_off_and_bad_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = RecvPool(max_bytes=0)
    a = pool.empty((2 * MB,), np.uint8)
    assert a.nbytes == 2 * MB and pool.held_bytes == 0
    monkeypatch.setenv(recycle.ENV_POOL_BYTES, "lots")
    with pytest.raises(ConfigurationError, match="JAXDIST_RECV_POOL_BYTES"):
        RecvPool()
    monkeypatch.setenv(recycle.ENV_POOL_BYTES, str(5 * MB))
    assert RecvPool().max_bytes == 5 * MB


def test_threads_never_share_a_buffer() -> None:
    """Concurrent takers each get a buffer no other live taker has (each fills its own, then checks it)."""
    pool = RecvPool(max_bytes=64 * MB)
    errors: list[str] = []

    def work(k: int) -> None:
        for i in range(200):
            a = pool.empty((MB // 8,), np.float64)
            a[:] = k * 1000 + i
            if not (a == k * 1000 + i).all():
                errors.append(f"thread {k} round {i}: its buffer was written by another")
            del a

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and pool.reused > 0


def test_a_jax_array_made_from_a_pooled_value_keeps_its_buffer() -> None:
    """XLA's CPU client may adopt an aligned numpy buffer without copying it: the jax.Array then
    holds the numpy array, so the pool sees the reference and does not reuse the buffer."""
    import jax.numpy as jnp

    pool = RecvPool(max_bytes=64 * MB)
    a = pool.empty((MB // 4,), np.float32)
    a[:] = 7.0
    x = jnp.asarray(a)
    del a
    gc.collect()
    for _ in range(2):  # had the pool reused an adopted buffer, writing it would change ``x``
        other = pool.empty((MB // 4,), np.float32)
        other[:] = -1.0
    assert bool((x == 7.0).all())
