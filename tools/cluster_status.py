"""``jaxdist status``: a table of every task of a running cluster.

Each PS is asked ``GetStatus`` and each worker ``Heartbeat`` (the calls the
coordinator itself uses), all in parallel, with the cluster token (and TLS
when ``JAXDIST_TLS_*`` or ``--tls-*`` say so). Rows: task, address, health,
uptime, work done (PS: atomic updates applied; worker: closures done),
bytes in/out (PS: pushed/pulled; worker: RunClosures requests/responses)
and throughput since the previous refresh (on the first one: since the
task started). Tasks without a service (chief, evaluator) are listed as
``-``.

The cluster comes from ``--cluster`` (JSON, or ``@file``), else
``JAXDIST_CLUSTER`` (what ``jaxdist launch`` exports), else ``TF_CONFIG``.
JSON may be a cluster spec (``{"ps": [...], "worker": [...]}``) or a
TF_CONFIG-style object with a ``cluster`` key.

Exit status: 0 when every PS and worker answered, 1 when one did not,
2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

from jaxdist.base.cluster_resolver.base import ENV_TOKEN
from jaxdist.base.cluster_resolver.tfconfig import ENV_JAXDIST_CLUSTER
from jaxdist.base.errors import AuthenticationError, ConfigurationError, JaxdistError
from jaxdist.transport.credentials import Credentials
from jaxdist.transport.credentials import PLAINTEXT

logger = logging.getLogger(__name__)

__all__ = ["TaskRow", "StatusProbe", "parse_cluster", "format_table", "main"]

_ROLE_ORDER = {"chief": 0, "ps": 1, "worker": 2, "evaluator": 3}


def parse_cluster(text: str | None) -> dict[str, list[str]]:
    """``{job: [address, ...]}`` from JSON text, ``@file``, or (None) the environment.

    Raises:
        ConfigurationError: nothing given and no ``JAXDIST_CLUSTER``/``TF_CONFIG``,
            or the JSON is not a cluster.
    """
    source = "--cluster"
    if text is None:
        for var in (ENV_JAXDIST_CLUSTER, "TF_CONFIG"):
            if os.environ.get(var):
                text, source = os.environ[var], var
                break
        else:
            raise ConfigurationError(f"no cluster given: pass --cluster JSON (or @file), or set {ENV_JAXDIST_CLUSTER}")
    if text.startswith("@"):
        try:
            with open(text[1:]) as f:
                text, source = f.read(), text[1:]
        except OSError as e:
            raise ConfigurationError(f"cannot read {text[1:]!r}: {e}") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigurationError(f"{source} is not JSON: {e}") from None
    if isinstance(obj, dict) and isinstance(obj.get("cluster"), dict):
        obj = obj["cluster"]
    if not isinstance(obj, dict) or not all(isinstance(v, list) and all(isinstance(a, str) for a in v) for v in obj.values()):
        raise ConfigurationError(f"{source} is not a cluster: want {{\"ps\": [\"host:port\", ...], \"worker\": [...]}}")
    if not any(obj.get(j) for j in ("ps", "worker")):
        raise ConfigurationError(f"{source} names no ps or worker task")
    return {k: list(v) for k, v in obj.items()}


@dataclass
class TaskRow:
    """One task's state at one refresh."""

    role: str
    index: int
    address: str
    health: str  # "up", "DOWN", "AUTH", "restarted", "-" (not probed)
    uptime_s: float | None = None
    incarnation: str = ""
    work: float | None = None  # PS: updates applied; worker: closures done
    failed: float | None = None  # worker: closures failed
    bytes_in: float | None = None
    bytes_out: float | None = None
    work_rate: float | None = None  # per second, since the previous refresh
    bytes_rate: float | None = None  # in + out, per second
    error: str = ""
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def task(self) -> str:
        return f"{self.role}:{self.index}"


class StatusProbe:
    """Asks every task of ``cluster`` for its status; keeps channels and the previous
    refresh (for rates) between calls to :meth:`refresh`. Close it when done."""

    def __init__(self, cluster: dict[str, list[str]], credentials: Credentials = PLAINTEXT, timeout: float = 3.0) -> None:
        from jaxdist.ps_server.client import PSClient
        from jaxdist.worker.client import WorkerClient

        self.cluster = cluster
        self.timeout = timeout
        self._clients: dict[tuple[str, int], Any] = {}
        for i, a in enumerate(cluster.get("ps", [])):
            self._clients[("ps", i)] = PSClient(a, credentials, task=f"ps:{i}")
        for i, a in enumerate(cluster.get("worker", [])):
            self._clients[("worker", i)] = WorkerClient(a, credentials, task=f"worker:{i}")
        self._previous: dict[tuple[str, int], tuple[float, TaskRow]] = {}
        self._pool = futures.ThreadPoolExecutor(max_workers=min(32, max(1, len(self._clients))), thread_name_prefix="jaxdist-status")

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        for c in self._clients.values():
            c.close()

    def __enter__(self) -> StatusProbe:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ask(self, key: tuple[str, int]) -> tuple[float, Any]:
        client = self._clients[key]
        st = client.status(timeout=self.timeout) if key[0] == "ps" else client.heartbeat(timeout=self.timeout)
        return time.monotonic(), st

    def refresh(self) -> list[TaskRow]:
        """One row per task (PS, workers, then tasks without a service), probed in parallel."""
        futs = {key: self._pool.submit(self._ask, key) for key in self._clients}
        rows: list[TaskRow] = []
        for (role, index), fut in futs.items():
            address = self.cluster[role][index]
            try:
                now, st = fut.result()
            except AuthenticationError as e:
                rows.append(TaskRow(role, index, address, "AUTH", error=f"token rejected: {e}"))
                continue
            except JaxdistError as e:
                rows.append(TaskRow(role, index, address, "DOWN", error=f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"))
                continue
            rows.append(self._row(role, index, address, now, st))
        for role, addresses in self.cluster.items():
            if role not in ("ps", "worker"):
                rows.extend(TaskRow(role, i, a, "-", error="not probed: runs no jaxdist service") for i, a in enumerate(addresses))
        rows.sort(key=lambda r: (_ROLE_ORDER.get(r.role, 9), r.role, r.index))
        return rows

    def _row(self, role: str, index: int, address: str, now: float, st: Any) -> TaskRow:
        c = dict(st.counters)
        if role == "ps":
            row = TaskRow(role, index, address, "up", st.uptime_s, st.incarnation, work=c.get("updates_applied", 0.0),
                          bytes_in=c.get("bytes_pushed", 0.0), bytes_out=c.get("bytes_pulled", 0.0), counters=c)
        else:
            row = TaskRow(role, index, address, "up", st.uptime_s, st.incarnation, work=c.get("closures_done", 0.0),
                          failed=c.get("closures_failed", 0.0), bytes_in=c.get("bytes_in"), bytes_out=c.get("bytes_out"), counters=c)
        prev = self._previous.get((role, index))
        if prev is not None and prev[1].incarnation == row.incarnation:
            dt, before = now - prev[0], prev[1]
        else:
            if prev is not None:
                row.health = "restarted"
            dt, before = row.uptime_s or 0.0, TaskRow(role, index, address, "", work=0.0, bytes_in=0.0, bytes_out=0.0)
        if dt > 0:
            row.work_rate = ((row.work or 0.0) - (before.work or 0.0)) / dt
            if row.bytes_in is not None:
                row.bytes_rate = ((row.bytes_in or 0.0) + (row.bytes_out or 0.0) - (before.bytes_in or 0.0) - (before.bytes_out or 0.0)) / dt
        self._previous[(role, index)] = (now, row)
        return row


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"  # pragma: no cover


def _duration(s: float | None) -> str:
    if s is None:
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    if m < 60:
        return f"{m}m{sec:02d}s"
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m" if h < 48 else f"{h // 24}d{h % 24:02d}h"


def format_table(rows: list[TaskRow]) -> str:
    """The rows as an aligned text table, with a summary line."""
    header = ["TASK", "ADDRESS", "HEALTH", "UPTIME", "WORK", "IN", "OUT", "THROUGHPUT", "NET/s"]
    lines = [header]
    for r in rows:
        if r.work is None:
            work = r.error if r.health != "-" else "-"
            lines.append([r.task, r.address, r.health, "-", work, "-", "-", "-", "-"])
            continue
        if r.role == "ps":
            work, rate = f"{r.work:.0f} updates", f"{r.work_rate or 0.0:.1f} upd/s"
        else:
            work = f"{r.work:.0f} closures" + (f" ({r.failed:.0f} failed)" if r.failed else "")
            rate = f"{r.work_rate or 0.0:.1f} cl/s"
        net = f"{_bytes(r.bytes_rate)}/s" if r.bytes_rate is not None else "-"
        lines.append([r.task, r.address, r.health, _duration(r.uptime_s), work, _bytes(r.bytes_in), _bytes(r.bytes_out), rate, net])
    widths = [max(len(row[i]) for row in lines) for i in range(len(header))]
    right = {3, 5, 6, 7, 8}
    out = ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip() for row in lines]
    probed = [r for r in rows if r.health != "-"]
    up = sum(r.health in ("up", "restarted") for r in probed)
    out.append(f"{up}/{len(probed)} tasks answering; throughput since the previous refresh (first refresh: since task start)")
    out.extend(_dynamic_tables(rows))
    return "\n".join(out)


#: Per-table figures a PS reports as ``dynamic/<table>/<name>`` counters, and their column titles.
_DYNAMIC_COLUMNS = (("rows", "ROWS"), ("bytes", "BYTES"), ("inserts", "INSERTS"),
                    ("admissions_refused", "REFUSED"), ("evictions", "EVICTIONS"))


def _dynamic_tables(rows: list[TaskRow]) -> list[str]:
    """Lines of a second table: each dynamic embedding table's shard on each PS (none: no lines)."""
    lines: list[list[str]] = []
    for r in rows:
        tables = sorted({k.split("/")[1] for k in r.counters if k.startswith("dynamic/") and k.count("/") >= 2})
        for t in tables:
            c = [r.counters.get(f"dynamic/{t}/{k}", 0.0) for k, _ in _DYNAMIC_COLUMNS]
            lines.append([t, r.task, f"{c[0]:.0f}", _bytes(c[1]), f"{c[2]:.0f}", f"{c[3]:.0f}", f"{c[4]:.0f}"])
    if not lines:
        return []
    header = ["DYNAMIC TABLE", "TASK"] + [title for _, title in _DYNAMIC_COLUMNS]
    table = [header] + lines
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return [""] + ["  ".join(c.rjust(w) if i >= 2 else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip()
                   for row in table]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdist status", description="Show every task of a running jaxdist cluster.")
    p.add_argument("--cluster", default=None, metavar="JSON_OR_@FILE",
                   help=f"cluster spec or TF_CONFIG-style JSON, or @file holding it (default: ${ENV_JAXDIST_CLUSTER}, then $TF_CONFIG)")
    p.add_argument("--token", default=None, help=f"cluster token (default: ${ENV_TOKEN})")
    p.add_argument("--token-file", default=None, help="file holding the cluster token")
    p.add_argument("--tls-cert", default=None, metavar="PEM", help="client certificate (default: $JAXDIST_TLS_CERT)")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="its key (default: $JAXDIST_TLS_KEY)")
    p.add_argument("--tls-ca", default=None, metavar="PEM", help="CA of the tasks' certificates (default: $JAXDIST_TLS_CA)")
    p.add_argument("--watch", type=float, default=None, metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    p.add_argument("--count", type=int, default=None, help="with --watch: stop after this many refreshes")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for each task (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print one JSON object per refresh instead of a table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from jaxdist.base import task_process

    try:
        cluster = parse_cluster(args.cluster)
        credentials = task_process.credentials_from_args(args)
        if args.token:
            credentials = credentials.with_token(args.token)
    except ConfigurationError as e:
        print(f"jaxdist status: {e}", file=sys.stderr)
        return 2
    if args.count is not None and args.count < 1:
        print("jaxdist status: --count must be >= 1", file=sys.stderr)
        return 2
    clear = args.watch is not None and sys.stdout.isatty() and not args.json
    n = 0
    ok = False
    with StatusProbe(cluster, credentials, timeout=args.timeout) as probe:
        try:
            while True:
                rows = probe.refresh()
                ok = all(r.health in ("up", "restarted", "-") for r in rows)
                n += 1
                if args.json:
                    print(json.dumps({"time": time.time(), "tasks": [_row_json(r) for r in rows]}), flush=True)
                else:
                    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
                    print(("\x1b[H\x1b[2J" if clear else "") + f"jaxdist cluster at {stamp}\n{format_table(rows)}", flush=True)
                if args.watch is None or (args.count is not None and n >= args.count):
                    break
                if not clear:
                    print(flush=True)
                time.sleep(args.watch)  # the refresh interval itself
        except KeyboardInterrupt:
            pass
    return 0 if ok else 1


def _row_json(r: TaskRow) -> dict[str, Any]:
    d = {k: v for k, v in vars(r).items() if k != "counters"}
    d["task"] = r.task
    d["counters"] = r.counters
    return d
