"""The parameter-server process: ``python -m jaxdist.ps_server`` / ``jaxdist ps``."""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any

from jaxdist.base.errors import ConfigurationError
from jaxdist.base import task_process
from jaxdist.ps_server.servicer import SERVICE, ParameterServerServicer
from jaxdist.ps_server.store import DEFAULT_MAX_VARIABLE_BYTES, VariableStore
from jaxdist.transport import dataplane
from jaxdist.transport.channel import DEFAULT_MAX_MESSAGE_BYTES
from jaxdist.transport.credentials import PLAINTEXT, Credentials

if TYPE_CHECKING:
    from jaxdist.base.monitoring import MetricsExporter

logger = logging.getLogger(__name__)


class ParameterServer(task_process.TaskServer):
    """A PS task in this process (used by tests and by :func:`main`).

    Call :meth:`start` (returns the bound port) and :meth:`stop`, or use it as
    a context manager. ``credentials`` (:class:`~jaxdist.transport.credentials.Credentials`)
    are the token every call must carry and the TLS material to serve with
    (default: no token, plaintext; loopback only), also used for the calls
    this PS makes to its backup. With ``metrics`` (a :class:`~jaxdist.base.monitoring.MetricsExporter`)
    the PS's counters and RPC latencies are registered in it (start it yourself).
    ``data_port``: where the data plane listens (0: a free port; None: no data
    plane); it serves TLS exactly when gRPC does.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        credentials: Credentials = PLAINTEXT,
        insecure: bool = False,
        task_index: int = 0,
        max_variable_bytes: int = DEFAULT_MAX_VARIABLE_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        metrics: MetricsExporter | None = None,
        data_port: int | None = 0,
    ) -> None:
        self.store = VariableStore(max_variable_bytes=max_variable_bytes)
        super().__init__(SERVICE, ParameterServerServicer(self.store, task_index, credentials), _ps_collector,
                         host, port, credentials, insecure, metrics, max_message_bytes, liveness=("GetStatus",))
        # The data plane serves Pull/Push beside gRPC (see jaxdist.transport.dataplane), with
        # the same TLS rules as gRPC when this PS serves TLS.
        self.data_plane: dataplane.DataPlaneServer | None = None
        if data_port is not None and dataplane.enabled():
            self.data_plane = dataplane.DataPlaneServer(
                self.servicer.data_plane_handlers(), host, data_port, credentials,
                observe=lambda m, sec, failed: self.server.observe_call(f"{SERVICE}/{m}", sec, failed))

    @property
    def data_port(self) -> int | None:
        """The bound data-plane port (after :meth:`start`), None without a data plane."""
        return self.data_plane.port if self.data_plane is not None else None

    def start(self) -> int:
        port = super().start()
        global _serving
        with _serving_lock:
            _serving += 1
        if self.data_plane is not None:
            try:
                self.servicer.data_port = self.data_plane.start()
            except ConfigurationError:
                self.server.stop(grace=None)
                raise
            logger.info("ps:%d data plane on %s:%d", self.servicer.task_index, self.server.host, self.servicer.data_port)
        return port

    def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting on both transports at once, then let calls in flight finish (``grace``).

        The data plane drains beside gRPC, not after it: otherwise it would keep taking new
        pushes for as long as a gRPC call in flight holds the drain open.
        """
        global _serving
        with _serving_lock:
            _serving = max(0, _serving - 1)
        self.servicer.data_port = 0
        if self.data_plane is None:
            super().stop(grace)
            return
        dp = threading.Thread(target=self.data_plane.stop, args=(grace,), name="jaxdist-dataplane-stop")
        dp.start()
        try:
            super().stop(grace)
        finally:
            dp.join()


_serving_lock = threading.Lock()
_serving = 0  # ParameterServers started and not stopped in this process


def serving_in_this_process() -> bool:
    """Whether a PS task serves from this process (an in-process cluster): its optimizer steps then run on
    this process's XLA devices, beside (and queued behind) the process's own compiled steps."""
    with _serving_lock:
        return _serving > 0


def _ps_collector(servicer: ParameterServerServicer) -> Any:
    from jaxdist.ps_server.monitoring import PSCollector

    return PSCollector(servicer)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdist ps", description="Run a jaxdist parameter-server task.")
    task_process.add_server_args(p)
    p.add_argument("--max-variable-mb", type=float, default=DEFAULT_MAX_VARIABLE_BYTES / 2**20,
                   help="largest variable (shard) this PS accepts, in MiB")
    p.add_argument("--data-port", type=int, default=0,
                   help="TCP port of the data plane for Pull/Push (0 picks a free one; it is announced in "
                        "GetStatus, and clients that cannot reach it use gRPC; TLS when gRPC is); off with --no-data-plane")
    p.add_argument("--no-data-plane", action="store_true",
                   help=f"move tensors over gRPC only (also: {dataplane.ENV_DATA_PLANE}=0)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    task_process.setup_logging(args.log_level, "ps", args.task_index)
    try:
        metrics = task_process.metrics_from_args(args, "ps", args.task_index)
        ps = ParameterServer(
            host=args.host,
            port=args.port,
            credentials=task_process.credentials_from_args(args),
            insecure=args.insecure,
            task_index=args.task_index,
            max_variable_bytes=int(args.max_variable_mb * 2**20),
            metrics=metrics,
            data_port=None if args.no_data_plane else args.data_port,
        )
    except ConfigurationError as e:
        print(f"jaxdist ps: {e}", file=sys.stderr)
        return task_process.EXIT_CONFIG

    def report() -> str:
        stats = ps.servicer.counters.snapshot()
        return (f"pushes={stats['pushes']:.0f} updates_applied={ps.store.updates_applied} "
                f"duplicates={stats['duplicates']:.0f} pulls={stats['pulls']:.0f} variables={len(ps.store.info())}")

    return task_process.run_service(
        ps, "ps", args.task_index, ps.servicer.shutdown_event, lambda: ps.servicer.exit_code,
        metrics=metrics, metrics_host=args.metrics_host, metrics_port=args.metrics_port or 0,
        drain_timeout=args.drain_timeout, final_report=report,
    )
