"""The data plane: parameter-server Pull and Push over a plain TCP connection, beside gRPC.

Why: on the machines we measured, Python gRPC spends ~1.3 core-ms per MB
moved (both ends together) while a plain TCP socket moving the same bytes
with ``sendall``/``recv_into`` spends ~0.65. Pull and push of tensors are
where a parameter server spends its time, so they get this second path.
Everything else (control calls, checkpoints, replication, health) stays on
gRPC, and Pull/Push keep working over gRPC too: the data plane is used only
when the PS announces a data port (``TaskStatus.data_port``) and the client
can reach it; otherwise clients use gRPC (see :class:`jaxdist.ps_server.client.PSClient`).

The calls carry the same messages as the gRPC methods (``PullRequest`` /
``PullHeader``, ``PushHeader`` / ``PushResponse``), so semantics (versions,
dedupe of ``update_id``, replication, fencing, typed errors) are the same;
only the framing differs: tensor bytes go from numpy buffers to the socket
and from the socket into preallocated numpy arrays with no copy in Python.

Wire format (little-endian; one connection carries one call at a time):

- hello, client -> server, once: ``"JXB1"``, u32 token length, token bytes;
  the server answers with a response envelope (OK, or UNAUTHENTICATED /
  RESOURCE_EXHAUSTED and then closes).
- request: ``"JXRQ"``, u8 method, 3 pad bytes, u32 header length, u64 payload
  length; then the header message and the payload bytes.
- response: ``"JXRS"``, u32 gRPC status code, u32 reason length, u32 body
  length, u64 payload length; then the reason (the typed error's ``reason``,
  see :mod:`jaxdist.proto.status`), the body (the response message when OK,
  the error text otherwise) and the payload.

TLS: a PS that serves gRPC with TLS serves the data plane with TLS too, with
the same certificate, CA and client-certificate rule (``TLSConfig.server_ssl_context``
/ ``client_ssl_context``); the handshake comes first, then the hello above.
A plaintext or untrusted peer fails the handshake and only its connection ends.

Bad input never kills a server: an unknown method, bad magic or over-large
header ends that connection after an error response (the framing can no
longer be trusted); a request whose header is garbage, names an unknown
variable or announces the wrong payload size gets its payload drained and an
error response, and the connection stays usable. Every call has a deadline
(socket timeouts, from the caller's deadline); the server bounds the time a
started request may take too, and detects dead idle peers with TCP keepalive.

Same-host fast path (shared memory). Loopback TCP still costs two kernel
copies per byte (~0.8 core-ms per MB for both ends); two ``memcpy`` through a
shared mapping cost ~0.2. So a client first offers a shared-memory region
(method 3, ``ShmAttach``: slot size, a random nonce written at the region's
start, and the region's name), in two kinds, best first (see :mod:`.shm`):

* a **sealed** ``memfd`` (pages reserved with ``posix_fallocate``, then sealed
  against shrinking and growing), named ``fd:<pid>/<fd>``. A server that
  reaches it through ``/proc/<pid>/fd/<fd>`` (same host, same PID namespace,
  allowed to read the client's descriptors), finds the seal and reads the same
  nonce **maps** it and answers OK; the client then closes its descriptor. The
  seal means no process can shrink the file under the server's mapping.
* a **named** file ``/dev/shm/jaxdist-<random>`` (mode 0600, reserved the same
  way) for a server that shares ``/dev/shm`` but not the PID namespace. The
  server opens it (same user), checks the nonce, keeps the descriptor and
  copies through the file, never a mapping (a tmpfs file cannot be sealed, and
  a truncated mapping would SIGBUS the server); the client then unlinks it.

Nothing is left behind even if both processes are SIGKILLed later. A server
that cannot reach a kind answers FAILED_PRECONDITION and the client stops
offering that kind (then tries the next); any other refusal (e.g. the server's
region budget) keeps that connection on the socket. ``JAXDIST_SHM=0`` turns
shared memory off in a process, ``JAXDIST_SHM_SEALED=0`` its sealed kind.

On a connection with a region, payloads of at least :data:`SHM_MIN_PAYLOAD`
bytes move through its two slots instead of the socket; everything else
(envelopes, headers, small payloads) stays on the socket, which also carries
one-byte tokens that order the slots: the sender copies chunk ``i`` into slot
``i % 2`` and sends ``D``; the receiver copies it out and answers ``A``; the
sender waits for chunk ``i - 2``'s ``A`` before reusing its slot, and reads
any ``A`` still due before it reads its next message. Chunk sizes follow
from the payload length in the (socket) envelope, so both ends agree. To spend
one wake-up per message, a sender writes a payload's first chunk before the
envelope that announces it and sends envelope and ``D`` together, and a
receiver sends the ``A`` of a payload's last chunk in front of its own next
message rather than on its own: the same bytes in the same order, so a peer
that sends each token at once interoperates.

Modules: :mod:`~jaxdist.transport.dataplane.framing` (the envelopes above,
method numbers, socket I/O), :mod:`~jaxdist.transport.dataplane.shm` (regions
and the slot protocol: how one connection moves payloads),
:mod:`~jaxdist.transport.dataplane.server` (:class:`DataPlaneServer`) and
:mod:`~jaxdist.transport.dataplane.client` (:class:`DataPlaneClient`). Errors
a handler raises are answered through the same guard as gRPC's
(:mod:`jaxdist.transport.guard`).
"""

from __future__ import annotations

from jaxdist.transport.dataplane.client import DataPlaneClient
from jaxdist.transport.dataplane.framing import (
    ENV_DATA_PLANE,
    HELLO_MAGIC,
    MAX_HEADER_BYTES,
    METHOD_NAMES,
    PULL,
    PUSH,
    PUSH_PULL,
    REQUEST_MAGIC,
    RESPONSE_MAGIC,
    SHM_ATTACH,
    DataPlaneError,
    enabled,
)
from jaxdist.transport.dataplane.server import DataPlaneServer, Handler, Payload
from jaxdist.transport.dataplane.shm import ENV_SHM, ENV_SHM_SEALED, SHM_DIR, SHM_MIN_PAYLOAD, SHM_SLOT_BYTES, sealed_enabled, shm_enabled

__all__ = [
    "DataPlaneClient",
    "DataPlaneError",
    "DataPlaneServer",
    "ENV_DATA_PLANE",
    "ENV_SHM",
    "ENV_SHM_SEALED",
    "HELLO_MAGIC",
    "Handler",
    "MAX_HEADER_BYTES",
    "METHOD_NAMES",
    "PULL",
    "PUSH",
    "PUSH_PULL",
    "Payload",
    "REQUEST_MAGIC",
    "RESPONSE_MAGIC",
    "SHM_ATTACH",
    "SHM_DIR",
    "SHM_MIN_PAYLOAD",
    "SHM_SLOT_BYTES",
    "enabled",
    "sealed_enabled",
    "shm_enabled",
]
