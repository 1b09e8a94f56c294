"""The worker process: ``python -m jaxdist.worker`` / ``jaxdist worker``."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING, Any

from jaxdist.base import task_process
from jaxdist.base.errors import ConfigurationError, JaxdistError
from jaxdist.transport.channel import dialable_host
from jaxdist.transport.credentials import PLAINTEXT, Credentials
from jaxdist.worker.coordinator_client import CoordinatorClient
from jaxdist.worker.servicer import SERVICE, WorkerServicer

if TYPE_CHECKING:
    from jaxdist.base.monitoring import MetricsExporter

logger = logging.getLogger(__name__)


class WorkerServer(task_process.TaskServer):
    """A worker task in this process (tests, and :func:`main`). ``start``/``stop`` or a context manager.

    ``credentials`` and ``metrics`` as for :class:`jaxdist.ps_server.server.ParameterServer`; the
    worker's own PS connections use the same credentials.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, credentials: Credentials = PLAINTEXT,
                 insecure: bool = False, task_index: int = 0, metrics: MetricsExporter | None = None) -> None:
        super().__init__(SERVICE, WorkerServicer(task_index, credentials), _worker_collector, host, port, credentials,
                         insecure, metrics, liveness=("Heartbeat",))


def _worker_collector(servicer: WorkerServicer) -> Any:
    from jaxdist.worker.monitoring import WorkerCollector

    return WorkerCollector(servicer)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdist worker", description="Run a jaxdist worker task.")
    task_process.add_server_args(p)
    p.add_argument("--register-with", default=None, metavar="HOST:PORT",
                   help="coordinator registration address: join the running job (and leave it on SIGTERM)")
    p.add_argument("--advertise-address", default=None, metavar="HOST:PORT",
                   help="address the coordinator should call (default: --host and the bound port)")
    return p


def _leave(coordinator: str, me: str, credentials: Credentials) -> None:
    """Deregister the worker at ``me`` from the coordinator at ``coordinator`` (best effort: it may be gone)."""
    with CoordinatorClient(coordinator, credentials) as client:
        try:
            client.deregister(me)
        except JaxdistError as e:
            logger.info("could not deregister: %s", e)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    task_process.setup_logging(args.log_level, "worker", args.task_index)
    try:
        metrics = task_process.metrics_from_args(args, "worker", args.task_index)
        w = WorkerServer(args.host, args.port, task_process.credentials_from_args(args), insecure=args.insecure,
                         task_index=args.task_index, metrics=metrics)
    except ConfigurationError as e:
        print(f"jaxdist worker: {e}", file=sys.stderr)
        return task_process.EXIT_CONFIG
    joined: list[str] = []  # the address this worker registered under (--register-with)

    def on_started(port: int) -> None:
        if args.register_with:
            me = args.advertise_address or f"{dialable_host(args.host)}:{port}"
            with CoordinatorClient(args.register_with, w.credentials) as client:
                index = client.register(me)
            joined.append(me)
            logger.info("joined the job as worker %d", index)

    def on_stop() -> None:
        if args.register_with:
            if joined:
                _leave(args.register_with, joined[0], w.credentials)
        elif w.servicer.registration[0] and not w.servicer.shutdown_event.is_set():
            # Configured by a coordinator that accepts registrations: leave it properly on SIGTERM.
            coordinator, me = w.servicer.registration
            _leave(coordinator, me, w.credentials)

    def report() -> str:
        stats = dict(w.servicer.stats)
        return f"closures_done={stats['closures_done']:.0f} closures_failed={stats['closures_failed']:.0f}"

    return task_process.run_service(
        w.server, "worker", args.task_index, w.servicer.shutdown_event, lambda: w.servicer.exit_code,
        on_stop=on_stop, on_started=on_started, metrics=metrics, metrics_host=args.metrics_host,
        metrics_port=args.metrics_port or 0, drain_timeout=args.drain_timeout, final_report=report,
        after_drain=w.servicer.close,
    )
