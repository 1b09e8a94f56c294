"""Same-host shared memory for the data plane: regions, and how one connection moves payloads.

A client creates a region file in ``/dev/shm``, the server maps it
(``ShmAttach``, see :mod:`jaxdist.transport.dataplane`), and the client unlinks
it. :class:`Channel` then moves each payload of one connection either on its
socket or, for payloads of at least :data:`SHM_MIN_PAYLOAD` bytes, through the
region's two slots, ordered by one-byte tokens on the socket.
"""

from __future__ import annotations

import hmac
import logging
import mmap
import os
import re
import secrets
import socket
import stat
import struct
import time
from collections.abc import Sequence
from typing import Any

import grpc
import numpy as np

from jaxdist.base import errors as E
from jaxdist.proto import codec
from jaxdist.transport.dataplane.framing import env_on, recv_exact, recv_into

logger = logging.getLogger(__name__)

__all__ = [
    "ATTACH",
    "DEFAULT_MAX_SHM_CONNECTIONS",
    "ENV_SHM",
    "SHM_DIR",
    "SHM_MIN_PAYLOAD",
    "SHM_SLOT_BYTES",
    "Channel",
    "Region",
    "create_region",
    "open_region",
    "shm_enabled",
    "unlink",
]

#: ``JAXDIST_SHM=0`` turns the same-host shared-memory path off in this process.
ENV_SHM = "JAXDIST_SHM"

#: Where regions are made: a tmpfs shared by the processes of one host (not by Kubernetes pods).
SHM_DIR = "/dev/shm"
#: Region file names: 128 random bits, so a server never maps a file that is not a jaxdist region.
_SHM_NAME = re.compile(r"jaxdist-[0-9a-f]{32}")
#: ShmAttach header: u64 slot size, 16-byte nonce, then the file's name (utf-8).
ATTACH = struct.Struct("<Q16s")
#: The region starts with one page holding the nonce; the two slots follow (page aligned).
_SHM_HEAD = 4096
#: Bytes per slot. Measured between two processes: 1-2 MB chunks stay in cache (~8-10 GB/s);
#: 256 KB chunks pay too many token round trips (~2 GB/s).
SHM_SLOT_BYTES = 2 << 20
_SHM_SLOT_MIN, _SHM_SLOT_MAX = 64 << 10, 64 << 20
#: Payloads smaller than this go on the socket even with a region (two tokens cost more).
SHM_MIN_PAYLOAD = 64 << 10
#: Regions one server maps at once (each ``2 * slot + 4 KB``); beyond that, connections use the socket.
DEFAULT_MAX_SHM_CONNECTIONS = 256
#: Slot tokens on the socket: "chunk ready in its slot" and "slot free again".
_DATA, _ACK = b"D", b"A"
#: Scratch size for draining an unwanted payload off the socket.
_DRAIN_CHUNK = 1 << 20


def shm_enabled() -> bool:
    """Whether this process may offer or accept shared memory (``JAXDIST_SHM`` is not ``0``, ``/dev/shm`` exists)."""
    return env_on(ENV_SHM) and os.path.isdir(SHM_DIR)


class Region:
    """A mapped shared-memory region: one nonce page, then two slots of ``slot_bytes``."""

    def __init__(self, mm: mmap.mmap, slot_bytes: int) -> None:
        self._mm = mm
        self.slot_bytes = slot_bytes
        whole = np.frombuffer(mm, np.uint8)
        self.slots: tuple[np.ndarray, ...] = (whole[_SHM_HEAD:_SHM_HEAD + slot_bytes], whole[_SHM_HEAD + slot_bytes:_SHM_HEAD + 2 * slot_bytes])
        del whole

    @staticmethod
    def size(slot_bytes: int) -> int:
        return _SHM_HEAD + 2 * slot_bytes

    def nonce(self) -> bytes:
        return bytes(self._mm[:16])

    def close(self) -> None:
        self.slots = ()  # numpy views pin the mapping; drop them before closing it
        try:
            self._mm.close()
        except BufferError:  # a view escaped somewhere: the mapping goes when it does
            logger.debug("shared-memory region still referenced at close")


def create_region(slot_bytes: int) -> tuple[str, Region] | None:
    """Create, reserve and map a region file in :data:`SHM_DIR`; None when that is not possible here."""
    name = f"jaxdist-{secrets.token_hex(16)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        logger.debug("no shared memory: cannot create %s (%s)", path, e)
        return None
    try:
        size = Region.size(slot_bytes)
        # Reserve every page now: a tmpfs that is full fails here (ENOSPC), not with SIGBUS on a later write.
        os.posix_fallocate(fd, 0, size)
        mm = mmap.mmap(fd, size)
    except (OSError, ValueError) as e:
        os.close(fd)
        unlink(path)
        logger.debug("no shared memory: cannot reserve %s (%s)", path, e)
        return None
    os.close(fd)
    mm[:16] = secrets.token_bytes(16)
    return path, Region(mm, slot_bytes)


def open_region(header: bytes) -> Region:
    """The server's half of ShmAttach: map the client's region named in ``header``, or raise a typed error."""
    if len(header) < ATTACH.size:
        raise E.InvalidRequestError("ShmAttach: header too short")
    slot_bytes, nonce = ATTACH.unpack_from(header)
    name = header[ATTACH.size:].decode("ascii", errors="replace")
    if not _SHM_NAME.fullmatch(name):
        raise E.InvalidRequestError(f"ShmAttach: {name[:80]!r} is not a jaxdist region name")
    if not _SHM_SLOT_MIN <= slot_bytes <= _SHM_SLOT_MAX or slot_bytes % mmap.PAGESIZE:
        raise E.InvalidRequestError(f"ShmAttach: slot size {slot_bytes} outside [{_SHM_SLOT_MIN}, {_SHM_SLOT_MAX}] pages")
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:  # another host (or container, or user): the client falls back to the socket
        raise E.RemoteError(f"ShmAttach: cannot open {path} here ({e.strerror})",
                            code=grpc.StatusCode.FAILED_PRECONDITION) from None
    try:
        st = os.fstat(fd)
        size = Region.size(slot_bytes)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size:
            raise E.InvalidRequestError(f"ShmAttach: {path} is not a {size}-byte region file of this user")
        mm = mmap.mmap(fd, size)
    except OSError as e:  # e.g. ENOMEM: this connection stays on the socket, the server goes on
        raise E.RemoteError(f"ShmAttach: cannot map {path} ({e.strerror})", code=grpc.StatusCode.RESOURCE_EXHAUSTED) from None
    finally:
        os.close(fd)
    region = Region(mm, slot_bytes)
    if not hmac.compare_digest(region.nonce(), nonce):
        region.close()
        raise E.RemoteError(f"ShmAttach: {path} holds another region", code=grpc.StatusCode.FAILED_PRECONDITION)
    return region


def unlink(path: str) -> None:
    """Remove a region file; one already gone is fine."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _copy_views(views: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [codec.byte_view(a) for a in views if a.nbytes]


class Channel:
    """How one connection moves payloads: on its socket, or through its shared-memory region.

    ``send``/``recv_into``/``discard`` move one payload whose length both ends
    already know from an envelope; ``settle`` reads the slot acknowledgements
    still due and must run before the next message is read from the socket.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.region: Region | None = None
        self._due = 0  # acknowledgements this end still has to read

    def attach(self, region: Region) -> None:
        self.region = region

    def close(self) -> None:
        if self.region is not None:
            self.region.close()
            self.region = None

    def _shm(self, nbytes: int) -> bool:
        return self.region is not None and nbytes >= SHM_MIN_PAYLOAD

    def _token(self, want: bytes, deadline: float | None) -> None:
        got = recv_exact(self.sock, 1, deadline)
        if got != want:
            raise ConnectionError(f"data plane: expected slot token {want!r}, got {got!r}")

    def settle(self, deadline: float | None = None, keep: int = 0) -> None:
        """Read acknowledgements until at most ``keep`` are still due."""
        while self._due > keep:
            self._token(_ACK, deadline)
            self._due -= 1

    def send(self, arrays: Sequence[np.ndarray], deadline: float | None) -> None:
        views = _copy_views(arrays)
        total = sum(v.nbytes for v in views)
        if not self._shm(total):
            for v in views:
                self.sock.sendall(codec.as_memoryview(v))
            return
        assert self.region is not None
        self.settle(deadline)
        slots, size = self.region.slots, self.region.slot_bytes
        chunk = filled = 0
        for v in views:
            pos, n = 0, v.nbytes
            while pos < n:
                if filled == 0:
                    self.settle(deadline, keep=1)  # the slot we are about to fill held chunk - 2
                take = min(n - pos, size - filled)
                slots[chunk & 1][filled:filled + take] = v[pos:pos + take]
                filled += take
                pos += take
                if filled == size:
                    self._ready(deadline)
                    chunk += 1
                    filled = 0
        if filled:
            self._ready(deadline)

    def _ready(self, deadline: float | None) -> None:
        if deadline is not None:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        self.sock.sendall(_DATA)
        self._due += 1

    def _chunks(self, total: int, deadline: float | None) -> Any:
        """Yield each chunk's bytes in its slot, acknowledging it once the caller is done with it."""
        assert self.region is not None
        size = self.region.slot_bytes
        for i, start in enumerate(range(0, total, size)):
            self._token(_DATA, deadline)
            yield self.region.slots[i & 1][:min(size, total - start)]
            self.sock.sendall(_ACK)

    def recv_into(self, arrays: Sequence[np.ndarray], deadline: float | None) -> None:
        views = _copy_views(arrays)
        total = sum(v.nbytes for v in views)
        if not self._shm(total):
            for v in views:
                recv_into(self.sock, codec.as_memoryview(v), deadline)
            return
        it = iter(views)
        dst, pos = next(it), 0
        for src in self._chunks(total, deadline):
            off = 0
            while off < src.nbytes:
                if pos == dst.nbytes:
                    dst, pos = next(it), 0
                take = min(src.nbytes - off, dst.nbytes - pos)
                dst[pos:pos + take] = src[off:off + take]
                off += take
                pos += take

    def discard(self, nbytes: int, deadline: float | None) -> None:
        if self._shm(nbytes):
            for _ in self._chunks(nbytes, deadline):
                pass
            return
        scratch = memoryview(bytearray(min(nbytes, _DRAIN_CHUNK)))
        while nbytes:
            take = min(nbytes, len(scratch))
            recv_into(self.sock, scratch[:take], deadline)
            nbytes -= take
