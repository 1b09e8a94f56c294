"""Same-host shared memory for the data plane: regions, and how one connection moves payloads.

A client makes a region and names it in ``ShmAttach`` (see
:mod:`jaxdist.transport.dataplane`); the server opens it. :class:`Channel` then
moves each payload of one connection either on its socket or, for payloads of
at least :data:`SHM_MIN_PAYLOAD` bytes, through the region's two slots, ordered
by one-byte tokens on the socket.

A region comes in one of two kinds, offered best first:

* **sealed** (:func:`create_sealed_region`): a ``memfd`` the client sealed
  against shrinking (``F_SEAL_SHRINK``) before offering it, named
  ``fd:<pid>/<fd>``. The server reaches it through ``/proc/<pid>/fd/<fd>``,
  checks the seal, and **maps** it: ``memcpy`` in and out, ~4x faster than the
  copies through a file below. The seal is what makes the mapping safe: no
  process can make the file shorter than the mapping, so no access faults
  with SIGBUS.
* **named** (:func:`create_region`): ``/dev/shm/jaxdist-<random>``, for peers
  that share ``/dev/shm`` but not a PID namespace (or where ``memfd`` is
  missing). A tmpfs file cannot be sealed and a same-user peer can truncate it
  after ShmAttach; through a mapping the next access would be SIGBUS and kill
  the server. So the server never maps a named region: it
  keeps the file descriptor and copies with ``preadv``/``pwrite``
  (:class:`PeerRegion`), and a truncated file is a short read, which ends that
  one connection.

The client always maps its own region (:class:`Region`).
"""

from __future__ import annotations

import fcntl
import hmac
import logging
import mmap
import os
import re
import secrets
import socket
import ssl
import stat
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from jaxdist.base import errors as E
from jaxdist.proto import codec
from jaxdist.transport.dataplane.framing import env_on, recv_exact, recv_into

logger = logging.getLogger(__name__)

__all__ = [
    "ATTACH",
    "PeerRegion",
    "DEFAULT_MAX_SHM_CONNECTIONS",
    "ENV_SHM",
    "ENV_SHM_SEALED",
    "NAMED",
    "Offer",
    "SEALED",
    "SHM_DIR",
    "SHM_MIN_PAYLOAD",
    "SHM_SLOT_BYTES",
    "Channel",
    "Region",
    "create_region",
    "create_sealed_region",
    "make_offer",
    "open_region",
    "sealed_enabled",
    "shm_enabled",
    "unlink",
]

#: ``JAXDIST_SHM=0`` turns the same-host shared-memory path off in this process.
ENV_SHM = "JAXDIST_SHM"

#: ``JAXDIST_SHM_SEALED=0``: this process offers only named regions (the server then copies through the file).
ENV_SHM_SEALED = "JAXDIST_SHM_SEALED"
#: The two kinds of region (see the module docstring), in the order a client offers them.
SEALED, NAMED = "sealed", "named"

#: Where named regions are made: a tmpfs shared by the processes of one host (not by Kubernetes pods).
SHM_DIR = "/dev/shm"
#: Region file names: 128 random bits, so a server never maps a file that is not a jaxdist region.
_SHM_NAME = re.compile(r"jaxdist-[0-9a-f]{32}")
#: Sealed region names: the offering process's pid and its memfd's descriptor number.
_FD_NAME = re.compile(r"fd:([1-9][0-9]{0,9})/([0-9]{1,9})")
_F_SEALS = getattr(fcntl, "F_SEAL_SHRINK", 0) | getattr(fcntl, "F_SEAL_GROW", 0) | getattr(fcntl, "F_SEAL_SEAL", 0)
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
#: Buffers one ``sendmsg`` passes (well under every platform's IOV_MAX).
_IOV_MAX = 64
#: Scratch size for draining an unwanted payload off the socket.
_DRAIN_CHUNK = 1 << 20


def shm_enabled() -> bool:
    """Whether this process may offer or accept shared memory (``JAXDIST_SHM`` is not ``0``, ``/dev/shm`` exists)."""
    return env_on(ENV_SHM) and os.path.isdir(SHM_DIR)


def sealed_enabled() -> bool:
    """Whether this process may offer sealed regions: :func:`shm_enabled`, ``JAXDIST_SHM_SEALED`` is not
    ``0``, and the platform has ``memfd_create`` with file seals and ``/proc``."""
    return (shm_enabled() and env_on(ENV_SHM_SEALED) and hasattr(os, "memfd_create")
            and hasattr(fcntl, "F_ADD_SEALS") and hasattr(os, "O_PATH") and os.path.isdir("/proc/self/fd"))


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

    def read(self, slot: int, offset: int, dst: np.ndarray) -> None:
        """Copy ``dst.nbytes`` bytes at ``offset`` of ``slot`` into ``dst`` (uint8, contiguous)."""
        dst[:] = self.slots[slot][offset:offset + dst.nbytes]

    def write(self, slot: int, offset: int, src: np.ndarray) -> None:
        """Copy ``src`` (uint8, contiguous) to ``offset`` of ``slot``."""
        self.slots[slot][offset:offset + src.nbytes] = src

    def close(self) -> None:
        self.slots = ()  # numpy views pin the mapping; drop them before closing it
        try:
            self._mm.close()
        except BufferError:  # a view escaped somewhere: the mapping goes when it does
            logger.debug("shared-memory region still referenced at close")


class PeerRegion:
    """A peer's region as the server holds it: the open file, never a mapping (see the module docstring).

    A region the peer shrank reads short: :meth:`read` raises ``ConnectionError``
    (that connection ends; the server goes on).
    """

    def __init__(self, fd: int, slot_bytes: int) -> None:
        self._fd = fd
        self.slot_bytes = slot_bytes

    def _offset(self, slot: int, offset: int) -> int:
        return _SHM_HEAD + slot * self.slot_bytes + offset

    def nonce(self) -> bytes:
        return os.pread(self._fd, 16, 0)

    def read(self, slot: int, offset: int, dst: np.ndarray) -> None:
        view, pos = codec.as_memoryview(dst).cast("B"), self._offset(slot, offset)
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], pos + done)
            if got <= 0:
                raise ConnectionError("data plane: the peer's shared-memory region shrank under a transfer")
            done += got

    def write(self, slot: int, offset: int, src: np.ndarray) -> None:
        view, pos = codec.as_memoryview(src).cast("B"), self._offset(slot, offset)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], pos + done)

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def create_region(slot_bytes: int) -> tuple[str, Region] | None:
    """Create, reserve and map a named region file in :data:`SHM_DIR`; None when that is not possible here."""
    name = f"jaxdist-{secrets.token_hex(16)}"
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
    except OSError as e:
        logger.debug("no shared memory: cannot create %s (%s)", path, e)
        return None
    try:
        mm = _reserve_and_map(fd, Region.size(slot_bytes))
    except (OSError, ValueError) as e:
        os.close(fd)
        unlink(path)
        logger.debug("no shared memory: cannot reserve %s (%s)", path, e)
        return None
    os.close(fd)
    mm[:16] = secrets.token_bytes(16)
    return path, Region(mm, slot_bytes)


def create_sealed_region(slot_bytes: int) -> tuple[int, Region] | None:
    """Create, reserve, seal and map a ``memfd`` region; ``(fd, region)``, or None when that is not possible here.

    The seals (no shrinking, no growing, no more seals) are set before anyone else
    can see the file, so the server may map it. The caller keeps ``fd`` open until
    the server has answered ShmAttach (the server opens ``/proc/<pid>/fd/<fd>``), then
    closes it: the mappings keep the memory, and it is freed with the last one.
    """
    try:
        fd = os.memfd_create(f"jaxdist-{secrets.token_hex(16)}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    except (OSError, AttributeError) as e:
        logger.debug("no sealed shared memory: memfd_create failed (%s)", e)
        return None
    try:
        size = Region.size(slot_bytes)
        os.ftruncate(fd, size)
        mm = _reserve_and_map(fd, size)
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _F_SEALS)
        except OSError:
            mm.close()
            raise
    except (OSError, ValueError) as e:
        os.close(fd)
        logger.debug("no sealed shared memory: cannot reserve or seal a region (%s)", e)
        return None
    mm[:16] = secrets.token_bytes(16)
    return fd, Region(mm, slot_bytes)


def _reserve_and_map(fd: int, size: int) -> mmap.mmap:
    # Reserve every page now: a tmpfs that is full fails here (ENOSPC), not with SIGBUS on a later write.
    os.posix_fallocate(fd, 0, size)
    return mmap.mmap(fd, size)


@dataclass
class Offer:
    """A region a client made, with the name that tells a server where to find it (the ShmAttach header).

    :meth:`release` once the server has answered: it unlinks the named file, or
    closes the sealed region's descriptor; the region itself stays mapped.
    """

    name: str
    region: Region
    release: Callable[[], None]

    def header(self) -> bytes:
        return ATTACH.pack(self.region.slot_bytes, self.region.nonce()) + self.name.encode()


def make_offer(kind: str, slot_bytes: int) -> Offer | None:
    """A fresh region of ``kind`` (:data:`SEALED` or :data:`NAMED`), or None when this host cannot make one."""
    if kind == SEALED:
        sealed = create_sealed_region(slot_bytes)
        if sealed is None:
            return None
        fd, region = sealed
        return Offer(f"fd:{os.getpid()}/{fd}", region, lambda: os.close(fd))
    if kind != NAMED:
        raise ValueError(f"unknown region kind {kind!r}")
    named = create_region(slot_bytes)
    if named is None:
        return None
    path, region = named
    return Offer(os.path.basename(path), region, lambda: unlink(path))


def _elsewhere(what: str) -> E.RemoteError:
    """The name does not lead to the offered region here (another host, PID namespace or user):
    the client keeps the socket, and stops offering this kind."""
    return E.RemoteError(f"ShmAttach: {what}", code=grpc.StatusCode.FAILED_PRECONDITION)


def open_region(header: bytes) -> Region | PeerRegion:
    """The server's half of ShmAttach: open the client's region named in ``header``, or raise a typed error.

    A sealed region comes back mapped (:class:`Region`), a named one as a
    :class:`PeerRegion` (copies through its file). Nothing is written to a
    region before its nonce has been checked.
    """
    if len(header) < ATTACH.size:
        raise E.InvalidRequestError("ShmAttach: header too short")
    slot_bytes, nonce = ATTACH.unpack_from(header)
    name = header[ATTACH.size:].decode("ascii", errors="replace")
    sealed = _FD_NAME.fullmatch(name)
    if not sealed and not _SHM_NAME.fullmatch(name):
        raise E.InvalidRequestError(f"ShmAttach: {name[:80]!r} is not a jaxdist region name")
    if not _SHM_SLOT_MIN <= slot_bytes <= _SHM_SLOT_MAX or slot_bytes % mmap.PAGESIZE:
        raise E.InvalidRequestError(f"ShmAttach: slot size {slot_bytes} outside [{_SHM_SLOT_MIN}, {_SHM_SLOT_MAX}] pages")
    if sealed:
        return _open_sealed(int(sealed[1]), int(sealed[2]), slot_bytes, nonce)
    return _open_named(name, slot_bytes, nonce)


def _open_sealed(pid: int, fd: int, slot_bytes: int, nonce: bytes) -> Region:
    if not hasattr(os, "O_PATH") or not hasattr(fcntl, "F_GET_SEALS"):
        raise _elsewhere("this server's platform has no sealed files")
    path = f"/proc/{pid}/fd/{fd}"
    try:
        # O_PATH pins whatever the descriptor names without opening it: a device or FIFO
        # a hostile name points at is never opened (no driver open, no side effect).
        pinned = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError as e:
        raise _elsewhere(f"cannot reach {path} here ({e.strerror})") from None
    try:
        if not stat.S_ISREG(os.fstat(pinned).st_mode):
            raise _elsewhere(f"{path} is not a region file")
        # Reopened through our own descriptor, so it is the file just checked.
        rfd = os.open(f"/proc/self/fd/{pinned}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise _elsewhere(f"cannot open {path} ({e.strerror})") from None
    finally:
        os.close(pinned)
    try:
        size = Region.size(slot_bytes)
        try:
            seals = fcntl.fcntl(rfd, fcntl.F_GET_SEALS)  # EINVAL: not a memfd (nor tmpfs) file
            st = os.fstat(rfd)
        except OSError:
            raise _elsewhere(f"{path} is not a sealed region") from None
        # F_SEAL_SHRINK can never be removed: the file stays at least this long while we map it.
        # st_blksize is one page on shmem (a hugetlbfs file could fault with SIGBUS when huge pages run out).
        if not seals & fcntl.F_SEAL_SHRINK or st.st_size != size or st.st_blksize != mmap.PAGESIZE:
            raise _elsewhere(f"{path} is not a sealed {size}-byte region")
        if not hmac.compare_digest(os.pread(rfd, 16, 0), nonce):
            raise _elsewhere(f"{path} holds another region")
        return Region(mmap.mmap(rfd, size), slot_bytes)
    except OSError as e:  # mapping failed (e.g. ENOMEM): this connection stays on the socket
        raise E.RemoteError(f"ShmAttach: cannot map {path} ({e.strerror})", code=grpc.StatusCode.RESOURCE_EXHAUSTED) from None
    finally:
        os.close(rfd)


def _open_named(name: str, slot_bytes: int, nonce: bytes) -> PeerRegion:
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:  # another host (or container, or user): the client falls back to the socket
        raise E.RemoteError(f"ShmAttach: cannot open {path} here ({e.strerror})",
                            code=grpc.StatusCode.FAILED_PRECONDITION) from None
    region = PeerRegion(fd, slot_bytes)  # owns ``fd`` from here on
    try:
        st = os.fstat(fd)
        size = Region.size(slot_bytes)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_size != size:
            raise E.InvalidRequestError(f"ShmAttach: {path} is not a {size}-byte region file of this user")
        if not hmac.compare_digest(region.nonce(), nonce):
            raise E.RemoteError(f"ShmAttach: {path} holds another region", code=grpc.StatusCode.FAILED_PRECONDITION)
    except OSError as e:  # this connection stays on the socket, the server goes on
        region.close()
        raise E.RemoteError(f"ShmAttach: cannot read {path} ({e.strerror})", code=grpc.StatusCode.RESOURCE_EXHAUSTED) from None
    except BaseException:
        region.close()
        raise
    return region


def unlink(path: str) -> None:
    """Remove a region file; one already gone is fine."""
    try:
        os.unlink(path)
    except OSError:
        pass


def _copy_views(views: Sequence[np.ndarray]) -> list[np.ndarray]:
    return [codec.byte_view(a) for a in views if a.nbytes]


def _send_buffers(sock: socket.socket, buffers: list[bytes | memoryview]) -> None:
    """Send every buffer, in order: gathered into as few system calls as the socket takes
    (``sendmsg``), or one ``sendall`` each on a TLS socket (which has no ``sendmsg``)."""
    if isinstance(sock, ssl.SSLSocket):
        for b in buffers:
            sock.sendall(b)
        return
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        sent = sock.sendmsg(views[:_IOV_MAX])
        while sent and views:
            n = len(views[0])
            if sent >= n:
                sent -= n
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


class Channel:
    """How one connection moves payloads: on its socket, or through its shared-memory region.

    ``send``/``recv_into``/``discard`` move one payload whose length both ends
    already know from an envelope; ``settle`` reads the slot acknowledgements
    still due and must run before the next message is read from the socket.

    Fewer wake-ups per call (each one, on a loaded host, waits for a core): a
    payload's first chunk is written to its slot before the message that
    announces it, and the message and the chunk's token go out in one send
    (``send``'s ``prefix``); the acknowledgement of a payload's last chunk is
    not sent on its own but in front of this end's next message (:meth:`write`,
    ``send``'s ``prefix``), since the sender waits for it only before its next
    payload, which never comes before that message. The bytes on the socket and
    their order are the same as with separate sends, so peers that send each
    token at once interoperate.
    """

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.region: Region | PeerRegion | None = None
        self.kind: str | None = None  # SEALED or NAMED once a region is attached
        self._due = 0  # acknowledgements this end still has to read
        self._owed = 0  # acknowledgements this end still has to send (in front of its next message)

    def attach(self, region: Region | PeerRegion, kind: str) -> None:
        self.region, self.kind = region, kind

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

    def _with_owed(self, data: bytes) -> bytes:
        owed, self._owed = self._owed, 0
        return _ACK * owed + data if owed else data

    def write(self, data: bytes) -> None:
        """Send a message (an envelope, with its header) on the socket, after the acknowledgements owed."""
        self.sock.sendall(self._with_owed(data))

    def send(self, arrays: Sequence[np.ndarray], deadline: float | None, prefix: bytes = b"") -> None:
        """Send ``prefix`` (the message announcing the payload; the acknowledgements owed go first),
        then the arrays' bytes, on the socket or through the region."""
        views = _copy_views(arrays)
        total = sum(v.nbytes for v in views)
        if not self._shm(total):
            if total < SHM_MIN_PAYLOAD:  # small: one send, message and payload together
                self.sock.sendall(b"".join([self._with_owed(prefix), *(codec.as_memoryview(v) for v in views)]))
                return
            _send_buffers(self.sock, [self._with_owed(prefix), *(codec.as_memoryview(v) for v in views)])
            return
        assert self.region is not None
        self.settle(deadline)
        region, size = self.region, self.region.slot_bytes
        chunk = filled = 0
        for v in views:
            pos, n = 0, v.nbytes
            while pos < n:
                if filled == 0:
                    self.settle(deadline, keep=1)  # the slot we are about to fill held chunk - 2
                take = min(n - pos, size - filled)
                region.write(chunk & 1, filled, v[pos:pos + take])
                filled += take
                pos += take
                if filled == size:
                    self._ready(deadline, prefix if chunk == 0 else b"")
                    chunk += 1
                    filled = 0
        if filled:
            self._ready(deadline, prefix if chunk == 0 else b"")

    def _ready(self, deadline: float | None, prefix: bytes = b"") -> None:
        if deadline is not None:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
        self.sock.sendall(self._with_owed(prefix + _DATA))
        self._due += 1

    def _chunks(self, total: int, deadline: float | None) -> Any:
        """Yield each chunk's ``(slot, length)`` once it is ready, acknowledging it once the caller is done
        with it: at once, except the last chunk's (owed: it goes out in front of this end's next message)."""
        assert self.region is not None
        size = self.region.slot_bytes
        last = (total - 1) // size
        for i, start in enumerate(range(0, total, size)):
            self._token(_DATA, deadline)
            yield i & 1, min(size, total - start)
            if i == last:
                self._owed += 1
            else:
                self.sock.sendall(_ACK)

    def recv_into(self, arrays: Sequence[np.ndarray], deadline: float | None) -> None:
        views = _copy_views(arrays)
        total = sum(v.nbytes for v in views)
        if not self._shm(total):
            for v in views:
                recv_into(self.sock, codec.as_memoryview(v), deadline)
            return
        region = self.region
        assert region is not None
        it = iter(views)
        dst, pos = next(it), 0
        for slot, length in self._chunks(total, deadline):
            off = 0
            while off < length:
                if pos == dst.nbytes:
                    dst, pos = next(it), 0
                take = min(length - off, dst.nbytes - pos)
                region.read(slot, off, dst[pos:pos + take])
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
