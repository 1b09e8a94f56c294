"""PSConnections: a process's clients for every PS task of one cluster, with parallel fan-out."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

from jaxdist.base.errors import ConfigurationError
from jaxdist.ps_server.client import PSClient
from jaxdist.transport.credentials import Credentials
from jaxdist.transport.credentials import PLAINTEXT

__all__ = ["PSConnections"]


class PSConnections:
    """Clients for every PS task of one cluster, with parallel fan-out. Thread-safe.

    One per strategy on the coordinator and one per configured worker service;
    ``close`` closes every client. Shard ``i``'s client can be pointed at
    another address (its promoted backup) with :meth:`replace`.
    """

    def __init__(self, addresses: Sequence[str], credentials: Credentials = PLAINTEXT) -> None:
        self.addresses = list(addresses)
        self.credentials = credentials
        self.clients = [PSClient(a, credentials, task=f"ps:{i}") for i, a in enumerate(self.addresses)]
        self._pool = futures.ThreadPoolExecutor(max_workers=max(1, len(self.clients)), thread_name_prefix="jaxdist-ps-io")
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close every client; later calls raise :class:`ConfigurationError`. Idempotent."""
        self._closed = True
        self._pool.shutdown(wait=False, cancel_futures=True)
        for c in self.clients:
            c.close()

    def replace(self, ps_index: int, address: str) -> None:
        """Point shard ``ps_index`` at ``address`` (its promoted backup, after a failover)."""
        old = self.clients[ps_index]
        self.clients[ps_index] = PSClient(address, self.credentials, task=f"ps:{ps_index}")
        self.addresses[ps_index] = address
        old.close()  # calls still in flight on it fail as unavailable and are retried

    def client(self, ps_index: int) -> PSClient:
        if self._closed:
            raise ConfigurationError(
                "the PS connections are closed: the strategy was closed, or its ClusterCoordinator shut the "
                "cluster down (shutdown(exit_tasks=False) keeps them open)"
            )
        try:
            return self.clients[ps_index]
        except IndexError:
            raise ConfigurationError(
                f"variable placed on ps:{ps_index} but this process knows {len(self.clients)} PS task(s)"
            ) from None

    def fan_out(self, calls: Mapping[int, Callable[[PSClient], Any]]) -> dict[int, Any]:
        """Run one call per PS task in parallel; the first error is raised after all finish."""
        if len(calls) == 1:
            (i, fn), = calls.items()
            return {i: fn(self.client(i))}
        # The first call runs in this thread, the others on the pool: a small call (a lookup's
        # rows) then costs one thread hand-off less, and this thread is not idle while it waits.
        items = list(calls.items())
        clients = [self.client(i) for i, _ in items]
        futs = [self._pool.submit(fn, c) for (_, fn), c in zip(items[1:], clients[1:])]
        here: futures.Future[Any] = futures.Future()
        try:
            here.set_result(items[0][1](clients[0]))
        except BaseException as e:  # raised below, once every call finished, in call order
            here.set_exception(e)
        futures.wait(futs)
        return {i: f.result() for (i, _), f in zip(items, [here, *futs])}
