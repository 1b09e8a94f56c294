"""Process lifecycle shared by the PS and worker commands.

A service process binds its port, prints one machine-readable ready line
(``JAXDIST_READY role=ps index=0 port=12345``, plus ``metrics_port=N`` when
``--metrics-port`` is given) on stdout, and runs until one of:
SIGTERM/SIGINT (graceful stop, exit 0), a Shutdown RPC from the coordinator
(exit with the code it asks for, 0 when the job finished), or the death of
its launcher when started by ``LocalCluster`` (exit at once).

**Drain.** On SIGTERM or Shutdown the server stops taking new calls (they
get UNAVAILABLE; the health service answers NOT_SERVING) and lets calls in
flight finish for up to ``--drain-timeout`` seconds (default 5): a push that
arrived before the signal is applied and acknowledged, or, if it never
completes, not applied at all (a push is applied atomically after its last
frame). The last log line gives the task's final counters.

Exit codes (what Kubernetes / Kubeflow's ``ExitCode`` restart policy sees):

- 0: the job finished (``coordinator.shutdown()``) or the task was terminated
  (SIGTERM/SIGINT) and drained;
- 1: the coordinator ended the job as failed (``shutdown(exit_code=1)``, what
  ``with ClusterCoordinator(...)`` sends when its block raises; any code the
  coordinator passes to ``shutdown(exit_code=...)`` is forwarded as is);
  TFJob treats 1 as permanent;
- 2: bad configuration (flags, token, TLS files); permanent;
- 3: the launching process died (``LocalCluster`` children only);
- 137/143 (killed by SIGKILL/SIGTERM before it could drain) and others: a
  crash; 137 and 143 are retryable for TFJob.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxdist.base.errors import ConfigurationError
from jaxdist.transport.channel import DEFAULT_MAX_MESSAGE_BYTES
from jaxdist.transport.credentials import ENV_TLS_CA, ENV_TLS_CERT, ENV_TLS_KEY, ENV_TOKEN, Credentials, TLSConfig
from jaxdist.transport.server import Server

if TYPE_CHECKING:
    from jaxdist.base.monitoring import MetricsExporter

logger = logging.getLogger(__name__)

#: Set by LocalCluster: the child dies with its launcher (no orphans, even on SIGKILL).
ENV_PARENT_PID = "JAXDIST_PARENT_PID"

#: glibc malloc settings for PS and worker tasks. By default glibc serves every
#: allocation above ~32 MB (and, adaptively, smaller ones) with a fresh mmap and
#: unmaps it on free, so each pulled or pushed tensor lands in new pages and pays
#: a page fault per 4 KiB, which is expensive in VMs and sandboxes. Keeping freed
#: memory in the heap for reuse measured 870 -> 1,930 MB/s for a 64 MB pull and
#: +15% MLP steps/s here (bench/compare_tf.py). Cost: a task's resident memory
#: stays at its high-water mark. ``JAXDIST_MALLOC_TUNING=0`` turns it off.
MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": str(4 << 30),  # never mmap below 4 GiB
    "MALLOC_TRIM_THRESHOLD_": str(8 << 30),  # do not give freed heap back to the OS
    "MALLOC_TOP_PAD_": str(256 << 20),  # grow the heap in 256 MiB steps
}
ENV_MALLOC_TUNING = "JAXDIST_MALLOC_TUNING"


def task_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` plus :data:`MALLOC_ENV` (unless set or turned off) for a task process to start with."""
    if env.get(ENV_MALLOC_TUNING, "1") != "0":
        for k, v in MALLOC_ENV.items():
            env.setdefault(k, v)
    return env


def reexec_with_task_environment() -> None:
    """Called first thing by the ``jaxdist ps|worker|task`` entry points: glibc reads its
    malloc settings only at start-up, so when they are missing the process re-executes
    itself once with them (same pid, same arguments, same open files)."""
    if os.environ.get(ENV_MALLOC_TUNING, "1") == "0" or all(k in os.environ for k in MALLOC_ENV):
        return
    env = task_environment(dict(os.environ))
    os.execve(sys.executable, [sys.executable] + sys.orig_argv[1:], env)
EXIT_CONFIG = 2
EXIT_PARENT_GONE = 3
#: How often a LocalCluster task checks that its launcher is alive.
_PARENT_POLL_S = 0.25


#: Seconds calls in flight may take to finish after SIGTERM or Shutdown.
DEFAULT_DRAIN_TIMEOUT_S = 5.0


class TaskServer:
    """The gRPC server of one task (PS or worker) in this process.

    ``start`` (returns the bound port) and ``stop`` (stops serving, then closes
    the servicer's own outgoing channels), or a context manager. With
    ``metrics`` the servicer's counters (``collector(servicer)``) and the RPC
    latencies are registered in that exporter (start it yourself).
    ``credentials`` are the task's token and TLS material, used by the server
    and by the clients its servicer makes. ``liveness`` names the service's
    methods that must answer whatever else is in flight (GetStatus, Heartbeat).
    """

    def __init__(
        self,
        service_name: str,
        servicer: Any,
        collector: Callable[[Any], Any],
        host: str,
        port: int,
        credentials: Credentials,
        insecure: bool,
        metrics: MetricsExporter | None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        liveness: Sequence[str] = (),
    ) -> None:
        self.servicer = servicer
        self.credentials = credentials
        self.server = Server(host, port, credentials, insecure=insecure, max_message_bytes=max_message_bytes,
                                 metrics_registry=metrics.registry if metrics is not None else None)
        # ``liveness``: the methods a coordinator polls to know this task is alive, served on
        # their own thread lane (see :mod:`jaxdist.transport.admission`).
        self.server.add_service(service_name, servicer.handlers(), liveness=liveness)
        if metrics is not None:
            metrics.register(collector(servicer))
            metrics.incarnation = servicer.incarnation

    @property
    def port(self) -> int | None:
        return self.server.port

    @property
    def host(self) -> str:
        return self.server.host

    @property
    def tls(self) -> TLSConfig | None:
        return self.server.tls

    @property
    def address(self) -> str:
        return self.server.address

    def start(self) -> int:
        return self.server.start()

    def stop(self, grace: float | None = 1.0) -> None:
        self.server.stop(grace)
        self.servicer.close()

    def __enter__(self) -> TaskServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def add_server_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (printed in the ready line)")
    p.add_argument("--task-index", type=int, default=0, help="this task's index in its job")
    p.add_argument("--token-file", default=None, help=f"file holding the cluster token (default: ${ENV_TOKEN})")
    p.add_argument("--insecure", action="store_true", help="allow a non-loopback bind without a token")
    p.add_argument("--log-level", default=os.environ.get("JAXDIST_LOG_LEVEL", "INFO"))
    tls = p.add_argument_group("TLS (mutual: peers must show a certificate signed by --tls-ca; default: $JAXDIST_TLS_*)")
    tls.add_argument("--tls-cert", default=None, metavar="PEM", help=f"this task's certificate (default: ${ENV_TLS_CERT})")
    tls.add_argument("--tls-key", default=None, metavar="PEM", help=f"its private key (default: ${ENV_TLS_KEY})")
    tls.add_argument("--tls-ca", default=None, metavar="PEM", help=f"CA that signs every task's certificate (default: ${ENV_TLS_CA})")
    p.add_argument("--metrics-port", type=int, default=None,
                   help="serve Prometheus metrics over HTTP on this port (0 picks a free one, announced as metrics_port=N); "
                        "off when not given")
    p.add_argument("--metrics-host", default=None, help="address the metrics endpoint binds (default: --host)")
    p.add_argument("--drain-timeout", type=float, default=DEFAULT_DRAIN_TIMEOUT_S,
                   help="seconds calls in flight may take to finish after SIGTERM/Shutdown (default %(default)s)")


def credentials_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> Credentials:
    """The task's credentials: the token from ``--token-file`` (else ``JAXDIST_TOKEN``) and TLS from
    ``--tls-*`` (each flag falling back to its ``JAXDIST_TLS_*`` variable).

    Raises:
        ConfigurationError: an unreadable token file, a certificate without a key or the reverse.
    """
    env = os.environ if environ is None else environ
    from_env = TLSConfig.from_env(env)
    tls = from_env
    if args.tls_cert or args.tls_key or args.tls_ca:
        tls = TLSConfig(
            cert=args.tls_cert or (from_env.cert if from_env else None),
            key=args.tls_key or (from_env.key if from_env else None),
            ca=args.tls_ca or (from_env.ca if from_env else None),
            server_name=from_env.server_name if from_env else None,
        )
    return Credentials(token=read_token(args.token_file, env), tls=tls)


def metrics_from_args(args: argparse.Namespace, role: str, index: int, incarnation: str = "") -> MetricsExporter | None:
    """A :class:`~jaxdist.base.monitoring.MetricsExporter` when ``--metrics-port`` was given, else None (not started)."""
    if args.metrics_port is None:
        return None
    from jaxdist.base.monitoring import MetricsExporter

    return MetricsExporter(role, index, incarnation)


def read_token(token_file: str | None, environ: Mapping[str, str] | None = None) -> str | None:
    """The token in ``token_file`` (stripped), else ``JAXDIST_TOKEN``; None when neither gives one."""
    if token_file:
        try:
            with open(token_file) as f:
                return f.read().strip() or None
        except OSError as e:
            raise ConfigurationError(f"cannot read --token-file {token_file!r}: {e}") from None
    return (os.environ if environ is None else environ).get(ENV_TOKEN) or None


def setup_logging(level: str, role: str, index: int) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s %(levelname)s [{role}:{index} pid=%(process)d] %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _die_with_parent() -> None:
    """Exit as soon as the launching process is gone (polled: PR_SET_PDEATHSIG would fire
    when the launcher's *thread* that started us ends, e.g. a fault-injection thread)."""
    ppid = os.environ.get(ENV_PARENT_PID)
    if not ppid:
        return

    def watch() -> None:
        while True:
            if os.getppid() != int(ppid):
                os._exit(EXIT_PARENT_GONE)
            time.sleep(_PARENT_POLL_S)

    threading.Thread(target=watch, name="jaxdist-parent-watch", daemon=True).start()


def stop_on_signals() -> threading.Event:
    """Set up a task process's main thread: exit when the launcher is gone, dump every thread's
    stack on SIGUSR1, and return an event that SIGTERM or SIGINT sets (the process then drains)."""
    _die_with_parent()
    # `kill -USR1 <pid>` dumps every thread's stack to the log: the first tool for a hang.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        logger.info("received %s, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def run_service(
    server: Server | TaskServer,
    role: str,
    index: int,
    shutdown_event: threading.Event,
    exit_code: Callable[[], int],
    on_stop: Callable[[], None] | None = None,
    on_started: Callable[[int], None] | None = None,
    metrics: MetricsExporter | None = None,
    metrics_host: str | None = None,
    metrics_port: int = 0,
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT_S,
    final_report: Callable[[], str] | None = None,
    after_drain: Callable[[], None] | None = None,
) -> int:
    """Start ``server`` (and ``metrics`` on ``metrics_host:metrics_port``), announce them, block until
    told to stop, drain for up to ``drain_timeout`` seconds; return the exit code.

    ``on_stop`` runs before the drain, ``after_drain`` after it (release what
    calls in flight still used); ``final_report()`` (e.g. counters) is logged
    last.
    """
    stop = stop_on_signals()

    def relay() -> None:
        shutdown_event.wait()
        stop.set()

    threading.Thread(target=relay, name="jaxdist-shutdown-relay", daemon=True).start()
    port = server.start()
    ready = f"JAXDIST_READY role={role} index={index} port={port}"
    if metrics is not None:
        try:
            ready += f" metrics_port={metrics.start(metrics_host or server.host, metrics_port)}"
        except OSError as e:
            server.stop(grace=None)
            print(f"jaxdist {role}: cannot serve metrics on {metrics_host or server.host}:{metrics_port}: {e}", file=sys.stderr)
            return EXIT_CONFIG
    logger.info("%s:%d serving on %s:%d%s", role, index, server.host, port, " with TLS" if server.tls else "")
    print(ready, flush=True)
    if on_started is not None:
        on_started(port)
    while not stop.wait(0.5):
        pass
    code = exit_code() if shutdown_event.is_set() else 0
    if on_stop is not None:
        on_stop()
    logger.info("%s:%d draining (up to %.1fs for calls in flight)", role, index, drain_timeout)
    server.stop(grace=drain_timeout)
    if after_drain is not None:
        after_drain()
    if metrics is not None:
        metrics.stop()
    report = ""
    if final_report is not None:
        try:
            report = ": " + final_report()
        except Exception as e:  # noqa: BLE001 - a report must not change the exit code
            report = f": (no report: {e})"
    logger.info("%s:%d stopped (exit %d)%s", role, index, code, report)
    return code
