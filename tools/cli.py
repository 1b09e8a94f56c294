"""The ``jaxdist`` command.

Subcommands:
  ps        run a parameter-server task
  worker    run a worker task
  workers   run many worker tasks in one process (a simulated big cluster: --count N)
  launch    start a local cluster (and optionally run a coordinator script in it)
  task      become whatever task the environment says (TF_CONFIG, Slurm, launcher)
  demo      train an MLP on a local cluster of real processes
  status    show every task of a running cluster (health, uptime, work, bytes, throughput)
  certs     generate a CA and server/client certificates for a TLS cluster
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys


def _launch_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxdist launch",
        description="Start a local cluster of real PS and worker processes. With a command after `--`, "
        "run it as the coordinator (JAXDIST_CLUSTER and JAXDIST_TOKEN set) and stop the cluster when it exits; "
        "without one, print the cluster and wait for Ctrl-C.",
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ps", type=int, default=1)
    p.add_argument("--tls-dir", default=None, help="serve mutual TLS with the certificates in this directory (made when missing)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="coordinator command, after --")
    return p


def _launch(argv: list[str]) -> int:
    args = _launch_parser().parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    from jaxdist.local_cluster import LocalCluster

    with LocalCluster(num_workers=args.workers, num_ps=args.ps, tls_dir=args.tls_dir) as cluster:
        env = cluster.coordinator_env()
        if not cmd:
            print(json.dumps({"cluster": cluster.cluster_spec.as_dict(), "logs": cluster.log_dir}, indent=2))
            print("export " + " ".join(f"{k}='{v}'" for k, v in env.items()))
            print("cluster running; Ctrl-C to stop", flush=True)
            try:
                signal.sigwait({signal.SIGINT, signal.SIGTERM})
            except KeyboardInterrupt:
                pass
            return 0
        child = subprocess.Popen(cmd, env={**os.environ, **env})
        try:
            return child.wait()
        except KeyboardInterrupt:
            child.terminate()
            return child.wait()


def _task_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="jaxdist task",
        description="Run this process's task as the environment (TF_CONFIG, Slurm, JAXDIST_CLUSTER) assigns it: "
        "ps and worker tasks serve on the port of their own address; the chief runs the command after `--`.",
    )
    p.add_argument("--host", default="0.0.0.0", help="address PS/worker tasks bind (default: all interfaces)")
    p.add_argument("--insecure", action="store_true", help="serve without a token on a non-loopback address")
    p.add_argument("--metrics-port", default=None, help="PS/worker tasks serve Prometheus metrics on this port")
    p.add_argument("--data-port", default=None,
                   help="PS tasks serve the bulk data plane (Pull/Push over TCP) on this port (default: a free one)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    return p


def _task(argv: list[str]) -> int:
    args = _task_parser().parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    from jaxdist.base.cluster_resolver import detect
    from jaxdist.base.errors import ConfigurationError

    try:
        resolver = detect()
        role, index = resolver.task_type, resolver.task_id
        if role is None or index is None:
            raise ConfigurationError("the environment names no task for this process (task type/index missing)")
    except ConfigurationError as e:
        print(f"jaxdist task: {e}", file=sys.stderr)
        return 2
    if role in ("ps", "worker"):
        port = resolver.cluster_spec().task_address(role, index).rpartition(":")[2]
        serve = ["--host", args.host, "--port", port, "--task-index", str(index)] + (["--insecure"] if args.insecure else [])
        serve += ["--metrics-port", args.metrics_port] if args.metrics_port is not None else []
        if role == "ps":
            from jaxdist.ps_server.server import main as ps_main

            return ps_main(serve + (["--data-port", args.data_port] if args.data_port is not None else []))
        from jaxdist.worker.server import main as worker_main

        return worker_main(serve)
    if role == "chief":
        if not cmd:
            print("jaxdist task: this is the chief; give the coordinator command after `--`", file=sys.stderr)
            return 2
        return subprocess.call(cmd)
    print(f"jaxdist task: role {role!r} has nothing to run in jaxdist (evaluators run their own script)", file=sys.stderr)
    return 2


def subcommands() -> dict[str, str]:
    """Every subcommand and its one-line summary, in the order of the module docstring (``jaxdist --help``)."""
    out: dict[str, str] = {}
    for line in (__doc__ or "").split("Subcommands:", 1)[1].splitlines():
        name, _, summary = line.strip().partition(" ")
        if name:
            out[name] = summary.strip()
    return out


def build_parser() -> argparse.ArgumentParser:
    """The ``jaxdist`` command as one parser, each subcommand a sub-parser with its own flags.

    For documentation (docs/_ext renders the CLI reference from it) and tests: :func:`main`
    dispatches by hand (``ps``/``worker``/``task`` must re-exec before argparse runs) and does not
    use it. Building it imports the subcommands' modules and nothing else: no side effects.
    ``demo`` and ``certs`` build their parsers inside their ``main``; their sub-parsers here carry
    the summary only.
    """
    from jaxdist.ps_server.server import build_parser as ps_parser
    from jaxdist.tools.cluster_status import build_parser as status_parser
    from jaxdist.worker.host import build_parser as host_parser
    from jaxdist.worker.server import build_parser as worker_parser

    builders = {"ps": ps_parser, "worker": worker_parser, "workers": host_parser, "launch": _launch_parser,
                "task": _task_parser, "status": status_parser}
    top = argparse.ArgumentParser(prog="jaxdist", description="Run jaxdist tasks, local clusters and operator tools.")
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    for name, summary in subcommands().items():
        if name in builders:
            own = builders[name]()
            sub.add_parser(name, parents=[own], add_help=False, help=summary, description=own.description)
        else:
            sub.add_parser(name, help=summary, description=summary)
    return top


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] and sys.argv[1] in ("ps", "worker", "workers", "task"):
        from jaxdist.base.task_process import reexec_with_task_environment

        reexec_with_task_environment()  # a real task process (not a call from Python): tune malloc first
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "ps":
        from jaxdist.ps_server.server import main as ps_main

        return ps_main(rest)
    if cmd == "worker":
        from jaxdist.worker.server import main as worker_main

        return worker_main(rest)
    if cmd == "workers":
        from jaxdist.worker.host import main as host_main

        return host_main(rest)
    if cmd == "launch":
        return _launch(rest)
    if cmd == "task":
        return _task(rest)
    if cmd == "demo":
        from jaxdist.tools.demo import main as demo_main

        return demo_main(rest)
    if cmd == "status":
        from jaxdist.tools.cluster_status import main as status_main

        return status_main(rest)
    if cmd == "certs":
        from jaxdist.tools.certs import main as certs_main

        return certs_main(rest)
    print(f"jaxdist: unknown command {cmd!r}\n\n{__doc__.strip()}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
