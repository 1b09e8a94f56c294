"""WorkerClient: typed calls to one worker task, with deadlines (see :class:`~jaxdist.transport.client.ServiceClient`)."""

from __future__ import annotations

import grpc

from jaxdist.proto import common_pb2, worker_pb2
from jaxdist.transport.client import ServiceClient
from jaxdist.transport.credentials import PLAINTEXT, Credentials

__all__ = ["WorkerClient"]


class WorkerClient(ServiceClient):
    """Client for one worker task (``credentials``: token and TLS of every call). Thread-safe."""

    SERVICE = "jaxdist.Worker"
    ROLE = "worker"

    def __init__(self, address: str, credentials: Credentials = PLAINTEXT, task: str = "worker:?") -> None:
        super().__init__(address, credentials, task)
        self._configure = self._unary("Configure", worker_pb2.ConfigureRequest, worker_pb2.ConfigureResponse)
        self._run = self._unary("RunClosures", worker_pb2.RunRequest, worker_pb2.RunResponse)
        self._heartbeat = self._unary("Heartbeat", common_pb2.Empty, common_pb2.TaskStatus)
        self._shutdown = self._unary("Shutdown", common_pb2.ShutdownRequest, common_pb2.ShutdownResponse)

    def configure(self, req: worker_pb2.ConfigureRequest, timeout: float = 10.0) -> worker_pb2.ConfigureResponse:
        return self._call(self._configure, req, timeout)

    def run_future(self, req: worker_pb2.RunRequest, timeout: float | None) -> grpc.Future:
        """Start RunClosures; the returned future can be cancelled (worker declared dead).

        Its failure is a ``grpc.RpcError``: :meth:`error` gives the typed error.
        """
        return self._future(self._run, req, timeout)

    def heartbeat(self, timeout: float = 2.0) -> common_pb2.TaskStatus:
        return self._call(self._heartbeat, common_pb2.Empty(), timeout, wait_for_ready=False)

    def shutdown(self, reason: str = "", exit_code: int = 0, timeout: float = 5.0) -> None:
        self._call(self._shutdown, common_pb2.ShutdownRequest(reason=reason, exit_code=exit_code), timeout)
