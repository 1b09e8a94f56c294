"""The Coordinator service (``proto/coordinator.proto``): workers join and leave a running job.

Served by :meth:`ClusterCoordinator.serve_registration`; the worker's end is
:class:`jaxdist.worker.coordinator_client.CoordinatorClient`.

- ``RegisterWorker(address)``: the worker at ``address`` joins (configured,
  per-worker datasets built, then it takes closures); answers its index.
  An address already active answers its existing index.
- ``DeregisterWorker(address)``: the worker leaves; its running closures go
  elsewhere. Answers at once (the removal runs in the background, so a
  worker that deregisters while draining does not wait on itself);
  ``FAILED_PRECONDITION`` when no active worker serves at ``address``.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import grpc
from jaxdist.base.errors import ConfigurationError
from jaxdist.proto import coordinator_pb2
from jaxdist.transport import rpc
from jaxdist.worker.coordinator_client import SERVICE

logger = logging.getLogger(__name__)

__all__ = ["SERVICE", "CoordinatorServicer", "Membership"]


class Membership(Protocol):
    """What the service changes: the coordinator's worker membership."""

    def add_worker(self, address: str) -> int: ...

    def remove_worker(self, index: int) -> None: ...

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
            "RegisterWorker": rpc.unary_handler("RegisterWorker", parse, self.register_worker),
            "DeregisterWorker": rpc.unary_handler("DeregisterWorker", parse, self.deregister_worker),
        }

    def register_worker(self, req: coordinator_pb2.RegisterWorkerRequest, context: grpc.ServicerContext) -> coordinator_pb2.RegisterWorkerResponse:
        return coordinator_pb2.RegisterWorkerResponse(worker_index=self._membership.add_worker(req.address))

    def deregister_worker(self, req: coordinator_pb2.RegisterWorkerRequest, context: grpc.ServicerContext) -> coordinator_pb2.RegisterWorkerResponse:
        index = self._membership.active_worker_index(req.address)
        if index is None:
            raise ConfigurationError(f"no active worker at {req.address}")
        threading.Thread(target=self._membership.remove_worker, args=(index,), name="jaxdist-deregister", daemon=True).start()
        return coordinator_pb2.RegisterWorkerResponse(worker_index=index)
