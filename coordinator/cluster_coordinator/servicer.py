"""The Coordinator service (``proto/coordinator.proto``): workers join and leave a running job.

Served by :meth:`ClusterCoordinator.serve_registration`; the worker's end is
:class:`jaxdist.worker.coordinator_client.CoordinatorClient`.

- ``RegisterWorker(address)``: the worker at ``address`` joins (configured,
  per-worker datasets built, then it takes closures); answers its index.
  An address already active answers its existing index. The address must be
  a ``host:port`` the coordinator can dial (:func:`check_worker_address`:
  else ``INVALID_ARGUMENT`` saying why), and a jaxdist worker of this
  cluster must answer a heartbeat there before it joins (nobody answers:
  ``UNAVAILABLE``; something else answers: ``INVALID_ARGUMENT``), so an
  address that is not a worker costs the coordinator one probe and nothing
  after. A worker that joined this way and then stays unreachable for
  ``forget_after`` seconds leaves the job by itself.
- ``DeregisterWorker(address)``: the worker leaves; its running closures go
  elsewhere. Answers at once (the removal finishes on the dispatch loop,
  so a worker that deregisters while draining does not wait on itself);
  ``FAILED_PRECONDITION`` when no active worker serves at ``address``.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from typing import Protocol

import grpc
from jaxdist.base.errors import ConfigurationError, InvalidRequestError
from jaxdist.proto import coordinator_pb2
from jaxdist.transport.handlers import unary_handler
from jaxdist.worker.coordinator_client import SERVICE

logger = logging.getLogger(__name__)

__all__ = ["SERVICE", "CoordinatorServicer", "Membership", "check_worker_address"]

#: Longest worker address: a 253-character DNS name, ':' and a 5-digit port.
MAX_ADDRESS_CHARS = 259
#: Characters of an address quoted back in an error (details over 16 KB would not even reach the caller).
_QUOTE_CHARS = 64
#: A DNS name (RFC 1123): dot-separated labels of letters, digits and inner hyphens.
_HOSTNAME = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)(\.(?!-)[A-Za-z0-9-]{1,63}(?<!-))*\.?")
#: Target schemes gRPC would read in ``scheme:rest`` (a worker address is never one).
_GRPC_SCHEMES = frozenset({"dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock", "xds", "passthrough", "google-c2p"})
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


def _quote(address: str) -> str:
    return repr(address if len(address) <= _QUOTE_CHARS else address[:_QUOTE_CHARS] + "...")


def check_worker_address(address: str, own: str = "") -> str:
    """``address`` if it is a ``host:port`` a coordinator can dial, else InvalidRequestError saying why.

    ``host`` is a DNS name, an IPv4 address or a bracketed IPv6 address (not
    a wildcard such as ``0.0.0.0``); ``port`` is 1..65535. Refused as well:
    gRPC targets of another kind (``unix:...``, ``dns:...``) and ``own``,
    the coordinator's own registration address.
    """
    if not address:
        raise InvalidRequestError("worker address is empty; register as host:port")
    if len(address) > MAX_ADDRESS_CHARS:
        raise InvalidRequestError(f"worker address is {len(address)} characters; a host:port has at most {MAX_ADDRESS_CHARS}")
    if not address.isascii() or not address.isprintable() or any(c.isspace() for c in address):
        raise InvalidRequestError(f"worker address {_quote(address)} has characters no host:port has (control, space, non-ASCII)")
    if "/" in address:
        raise InvalidRequestError(f"worker address {_quote(address)} is not a host:port (a path or URI)")
    if address.startswith("["):
        host, sep, port = address[1:].partition("]:")
        if not sep:
            raise InvalidRequestError(f"worker address {_quote(address)}: an IPv6 host is written [address]:port")
        try:
            ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.IPv6Address(host)
        except ValueError:
            raise InvalidRequestError(f"worker address {_quote(address)}: {host!r} is not an IPv6 address") from None
    else:
        host, sep, port = address.rpartition(":")
        if not sep or not host:
            raise InvalidRequestError(f"worker address {_quote(address)} has no host:port form")
        if ":" in host:
            raise InvalidRequestError(f"worker address {_quote(address)}: write an IPv6 host in brackets, [address]:port")
        if host.lower() in _GRPC_SCHEMES:
            raise InvalidRequestError(f"worker address {_quote(address)} is a gRPC {host} target, not a host:port")
        try:
            ip = ipaddress.IPv4Address(host)
        except ValueError:
            ip = None
            if not _HOSTNAME.fullmatch(host) or len(host) > 253:
                raise InvalidRequestError(f"worker address {_quote(address)}: {host[:_QUOTE_CHARS]!r} is not a host name") from None
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise InvalidRequestError(f"worker address {_quote(address)}: port {port[:8]!r} is not 1..65535")
    if ip is not None and ip.is_unspecified:
        raise InvalidRequestError(f"worker address {_quote(address)}: {host} is a bind-everything address; register one "
                                  "the coordinator can dial (--advertise-address)")
    if own and _same_endpoint(address, own):
        raise InvalidRequestError(f"worker address {_quote(address)} is the coordinator's own registration address")
    return address


def _same_endpoint(a: str, b: str) -> bool:
    """Whether ``a`` and ``b`` name the same endpoint (equal, or the same port on loopback)."""
    if a == b:
        return True
    ha, _, pa = a.rpartition(":")
    hb, _, pb = b.rpartition(":")
    strip = lambda h: h.strip("[]").lower()  # noqa: E731
    return pa == pb and strip(ha) in _LOOPBACK_NAMES and strip(hb) in _LOOPBACK_NAMES


class Membership(Protocol):
    """What the service changes: the coordinator's worker membership."""

    def register_worker(self, address: str) -> int:
        """Admit the worker at ``address`` (validated and probed first); its index."""
        ...

    def remove_worker(self, index: int, wait: bool = True) -> None: ...

    def active_worker_index(self, address: str) -> int | None:
        """The index of the active (not departed) worker at ``address``, or None."""
        ...


class CoordinatorServicer:
    """Serves ``jaxdist.Coordinator`` for one coordinator's ``membership``."""

    def __init__(self, membership: Membership) -> None:
        self._membership = membership

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        parse = coordinator_pb2.RegisterWorkerRequest.FromString
        return {
            "RegisterWorker": unary_handler("RegisterWorker", parse, self.register_worker),
            "DeregisterWorker": unary_handler("DeregisterWorker", parse, self.deregister_worker),
        }

    def register_worker(self, req: coordinator_pb2.RegisterWorkerRequest, context: grpc.ServicerContext) -> coordinator_pb2.RegisterWorkerResponse:
        return coordinator_pb2.RegisterWorkerResponse(worker_index=self._membership.register_worker(req.address))

    def deregister_worker(self, req: coordinator_pb2.RegisterWorkerRequest, context: grpc.ServicerContext) -> coordinator_pb2.RegisterWorkerResponse:
        index = self._membership.active_worker_index(req.address)
        if index is None:
            raise ConfigurationError(f"no active worker at {_quote(req.address)}")
        self._membership.remove_worker(index, wait=False)
        return coordinator_pb2.RegisterWorkerResponse(worker_index=index)
