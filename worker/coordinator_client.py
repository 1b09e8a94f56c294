"""CoordinatorClient: a worker's typed calls to the coordinator's registration service, with deadlines.

The service (``jaxdist.Coordinator``, :mod:`jaxdist.cluster_coordinator.servicer`)
runs in the coordinator script once it calls ``serve_registration()``. A
worker started with ``--register-with HOST:PORT`` joins the running job
through it, and a worker that a registration-serving coordinator configured
leaves through it on SIGTERM. A worker host (:mod:`jaxdist.worker.host`)
joins and leaves its many services at once (``register_many``,
``deregister_many``: concurrent calls on one channel).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from jaxdist.base.errors import JaxdistError
from jaxdist.proto import coordinator_pb2
from jaxdist.transport.client import ServiceClient
from jaxdist.transport.credentials import PLAINTEXT, Credentials

__all__ = ["SERVICE", "CoordinatorClient"]

#: The gRPC service name (``proto/coordinator.proto``).
SERVICE = "jaxdist.Coordinator"

#: Seconds a joining worker waits for the coordinator (it may still be starting).
DEFAULT_REGISTER_TIMEOUT = 30.0
#: Seconds a leaving worker gives the coordinator to take note.
DEFAULT_DEREGISTER_TIMEOUT = 5.0


class CoordinatorClient(ServiceClient):
    """Client of one coordinator's registration service. Thread-safe; ``close()`` when done."""

    SERVICE = SERVICE
    ROLE = "coordinator"

    def __init__(self, address: str, credentials: Credentials = PLAINTEXT, task: str = "coordinator") -> None:
        super().__init__(address, credentials, task)
        req, resp = coordinator_pb2.RegisterWorkerRequest, coordinator_pb2.RegisterWorkerResponse
        self._register = self._unary("RegisterWorker", req, resp)
        self._deregister = self._unary("DeregisterWorker", req, resp)

    def register(self, worker_address: str, timeout: float = DEFAULT_REGISTER_TIMEOUT) -> int:
        """Join the job as the worker serving at ``worker_address``; returns its worker index.

        Waits (up to ``timeout``) for the coordinator to be reachable.
        Registering an address that is already active returns its index.
        """
        request = coordinator_pb2.RegisterWorkerRequest(address=worker_address)
        return int(self._call(self._register, request, timeout, wait_for_ready=True).worker_index)

    def deregister(self, worker_address: str, timeout: float = DEFAULT_DEREGISTER_TIMEOUT) -> int:
        """Leave the job; the worker's running closures go elsewhere. Returns the index it had.

        Raises:
            ConfigurationError: no active worker serves at ``worker_address``.
            TaskUnavailableError: the coordinator is gone.
        """
        request = coordinator_pb2.RegisterWorkerRequest(address=worker_address)
        return int(self._call(self._deregister, request, timeout).worker_index)

    def register_many(self, worker_addresses: Sequence[str], timeout: float = DEFAULT_REGISTER_TIMEOUT) -> list[int | JaxdistError]:
        """Register several workers at once (concurrent calls on this channel, waiting up to
        ``timeout`` for the coordinator); one result per address, in order: its index or its error."""
        calls = [self._future(self._register, coordinator_pb2.RegisterWorkerRequest(address=a), timeout, wait_for_ready=True)
                 for a in worker_addresses]
        return self._results(calls)

    def deregister_many(self, worker_addresses: Sequence[str], timeout: float = DEFAULT_DEREGISTER_TIMEOUT) -> list[int | JaxdistError]:
        """Deregister several workers at once; one result per address, in order: its index or its error."""
        calls = [self._future(self._deregister, coordinator_pb2.RegisterWorkerRequest(address=a), timeout)
                 for a in worker_addresses]
        return self._results(calls)

    def _results(self, calls: list[grpc.Future]) -> list[int | JaxdistError]:
        out: list[int | JaxdistError] = []
        for call in calls:
            try:
                out.append(int(call.result().worker_index))
            except grpc.RpcError as e:
                out.append(self.error(e))
        return out
