"""Helpers of the hostile-input tests: raw gRPC calls, the raw data-plane framing,
snapshots of a PS's state, and real ``jaxdist ps`` / ``jaxdist worker`` processes.

Everything here talks to servers over the wire: gRPC with the generated messages of
``jaxdist.proto.*_pb2`` and raw bytes, the data plane with raw sockets. The data-plane
framing is written out here (from the docstring of ``jaxdist/transport/dataplane/__init__.py``) rather than
imported, so that these tests keep describing the wire while modules move.

Not a conftest: ``tests/conftest.py`` already owns the module name ``conftest``.
"""

from __future__ import annotations

import os
import queue
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import grpc
from conftest import TOKEN
from grpc_health.v1 import health_pb2, health_pb2_grpc

from jaxdist.proto import common_pb2, ps_pb2

OK = grpc.StatusCode.OK
INVALID = grpc.StatusCode.INVALID_ARGUMENT
NOT_FOUND = grpc.StatusCode.NOT_FOUND
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
UNAUTH = grpc.StatusCode.UNAUTHENTICATED
UNAVAILABLE = grpc.StatusCode.UNAVAILABLE

MD = (("authorization", f"Bearer {TOKEN}"),)
WRONG_MD = (("authorization", "Bearer not-the-token"),)
REASON_KEY = "jaxdist-reason"

PS = "/jaxdist.ParameterServer/"
WORKER = "/jaxdist.Worker/"
COORDINATOR = "/jaxdist.Coordinator/"
HEALTH = "/grpc.health.v1.Health/"

ENV_PARENT_PID = "JAXDIST_PARENT_PID"  # a task started with it dies with this process
CODE_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}


# ----------------------------------------------------------------------------- gRPC
def channel(address: str, separate: bool = True) -> grpc.Channel:
    """A plaintext channel; ``separate``: its own TCP connection (no shared subchannel)."""
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", 256 << 20),
        ("grpc.max_receive_message_length", 256 << 20),
        ("grpc.enable_retries", 0),
    ]
    if separate:
        options.append(("grpc.use_local_subchannel_pool", 1))
    return grpc.insecure_channel(address, options=options)


@dataclass
class Answer:
    """What a call got: its status code, the jaxdist reason, the details and the response."""

    code: grpc.StatusCode
    reason: str = ""
    details: str = ""
    response: Any = None

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason} {self.details[:160]!r}"


def _answer_of(e: grpc.RpcError) -> Answer:
    md = dict(e.trailing_metadata() or ())  # type: ignore[attr-defined]
    reason = md.get(REASON_KEY, "")
    return Answer(e.code(), reason if isinstance(reason, str) else reason.decode(), e.details() or "")  # type: ignore[attr-defined]


def unary(ch: grpc.Channel, path: str, request: bytes | Any, md: Sequence[tuple[str, str]] | None = MD,
          timeout: float = 10.0) -> Answer:
    """One unary call with raw request bytes (or a message); the response stays raw bytes."""
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    try:
        resp = ch.unary_unary(path)(raw, metadata=md, timeout=timeout)
    except grpc.RpcError as e:
        return _answer_of(e)
    return Answer(OK, response=resp)


def stream_in(ch: grpc.Channel, path: str, frames: Iterable[bytes], md: Sequence[tuple[str, str]] | None = MD,
              timeout: float = 10.0) -> Answer:
    """One client-streaming call (Push, Replicate) with raw frames."""
    try:
        resp = ch.stream_unary(path)(iter(list(frames)), metadata=md, timeout=timeout)
    except grpc.RpcError as e:
        return _answer_of(e)
    return Answer(OK, response=resp)


def stream_out(ch: grpc.Channel, path: str, request: bytes | Any, md: Sequence[tuple[str, str]] | None = MD,
               timeout: float = 10.0) -> Answer:
    """One server-streaming call (Pull); the response is the list of raw frames."""
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    try:
        frames = list(ch.unary_stream(path)(raw, metadata=md, timeout=timeout))
    except grpc.RpcError as e:
        return _answer_of(e)
    return Answer(OK, response=frames)


def health_check(ch: grpc.Channel, service: str = "", timeout: float = 1.0) -> Answer:
    try:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
    except grpc.RpcError as e:
        return _answer_of(e)
    return Answer(OK, response=resp)


def ps_status(ch: grpc.Channel, timeout: float = 10.0) -> common_pb2.TaskStatus:
    a = unary(ch, PS + "GetStatus", common_pb2.Empty(), timeout=timeout)
    assert a.code == OK, f"GetStatus: {a}"
    return common_pb2.TaskStatus.FromString(a.response)


def ps_counters(ch: grpc.Channel) -> dict[str, float]:
    return dict(ps_status(ch).counters)


def spec(dtype: int, shape: Sequence[int], out: common_pb2.TensorSpec | None = None) -> common_pb2.TensorSpec:
    s = out if out is not None else common_pb2.TensorSpec()
    s.dtype = dtype
    del s.shape[:]
    s.shape.extend(shape)
    return s


def push_frames(entries: Sequence[dict[str, Any]], payload: bytes = b"", update_id: str = "") -> list[bytes]:
    """A Push stream: the header (one UpdateEntry per dict: name, op, value=(dtype, shape), ...) then the payload."""
    header = ps_pb2.PushHeader(update_id=update_id)
    for kw in entries:
        kw = dict(kw)
        value = kw.pop("value", None)
        indices = kw.pop("indices", None)
        create_spec = kw.pop("create_spec", None)
        e = header.entries.add(**kw)
        if value is not None:
            spec(*value, out=e.value)
            e.has_value = True
        if indices is not None:
            spec(*indices, out=e.indices)
            e.has_indices = True
        if create_spec is not None:
            spec(*create_spec, out=e.create_spec)
    return [header.SerializeToString()] + ([payload] if payload else [])


def create(ch: grpc.Channel, name: str, data: bytes, dtype: int, shape: Sequence[int]) -> None:
    """Create a variable over gRPC (a CREATE push)."""
    a = stream_in(ch, PS + "Push", push_frames([dict(name=name, op=ps_pb2.CREATE, value=(dtype, shape))], data))
    assert a.code == OK, f"create {name}: {a}"


def pull_bytes(ch: grpc.Channel, name: str) -> tuple[int, bytes]:
    """(version, raw bytes) of a variable, pulled over gRPC."""
    req = ps_pb2.PullRequest()
    req.entries.add(name=name)
    a = stream_out(ch, PS + "Pull", req)
    assert a.code == OK, f"pull {name}: {a}"
    header = ps_pb2.PullHeader.FromString(a.response[0])
    return header.entries[0].version, b"".join(a.response[1:])


def ps_variables(ch: grpc.Channel) -> dict[str, tuple[int, int, tuple[int, ...], bytes]]:
    """Every variable of a PS: name -> (version, dtype code, shape, raw bytes)."""
    a = unary(ch, PS + "ListVariables", ps_pb2.ListVariablesRequest())
    assert a.code == OK, f"ListVariables: {a}"
    out = {}
    for v in ps_pb2.ListVariablesResponse.FromString(a.response).variables:
        version, data = pull_bytes(ch, v.name)
        out[v.name] = (version, v.spec.dtype, tuple(v.spec.shape), data)
    return out


# The counters a rejected request must leave alone (pulls and bytes_pulled move with our own snapshots).
STATE_COUNTERS = ("pushes", "bytes_pushed", "duplicates", "variables", "updates_applied", "replica_role",
                  "replica_epoch", "replica_has_backup", "replica_forwarded", "replica_degraded")


def state_counters(ch: grpc.Channel) -> dict[str, float]:
    c = ps_counters(ch)
    return {k: c.get(k, 0.0) for k in STATE_COUNTERS}


def counter_changes(before: dict[str, float], after: dict[str, float]) -> str:
    """The counters that differ, as ``name a -> b`` ("" when none)."""
    return ", ".join(f"{k} {before.get(k, 0.0):g} -> {after.get(k, 0.0):g}"
                     for k in sorted(set(before) | set(after)) if before.get(k, 0.0) != after.get(k, 0.0))


# ------------------------------------------------------------------------ data plane
# Wire format of the PS data plane (documented at the top of jaxdist/transport/dataplane/__init__.py), little-endian:
HELLO = struct.Struct("<4sI")          # b"JXB1", token length; then the token
REQUEST = struct.Struct("<4sB3xIQ")    # b"JXRQ", method, 3 pad bytes, header length, payload length
RESPONSE = struct.Struct("<4sIIIQ")    # b"JXRS", status code, reason length, body length, payload length
ATTACH = struct.Struct("<Q16s")        # ShmAttach header: slot size, nonce; then the region's file name
HELLO_MAGIC, REQUEST_MAGIC, RESPONSE_MAGIC = b"JXB1", b"JXRQ", b"JXRS"
DP_PULL, DP_PUSH, DP_SHM_ATTACH = 1, 2, 3
SHM_HEAD = 4096                        # the region's first page holds the nonce; two slots follow
SHM_MIN_PAYLOAD = 64 << 10             # payloads of at least this size move through the slots


def hello_bytes(token: str | bytes = TOKEN) -> bytes:
    t = token.encode() if isinstance(token, str) else token
    return HELLO.pack(HELLO_MAGIC, len(t)) + t


def dp_request(method: int, header: bytes, payload: bytes = b"", payload_len: int | None = None) -> bytes:
    n = len(payload) if payload_len is None else payload_len
    return REQUEST.pack(REQUEST_MAGIC, method, len(header), n) + header + payload


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


@dataclass
class DPAnswer:
    code: grpc.StatusCode
    reason: str
    body: bytes
    payload: bytes = b""

    def __str__(self) -> str:
        return f"{self.code.name} {self.reason} {self.body[:160]!r}"


def dp_read(sock: socket.socket) -> DPAnswer:
    """One response envelope (raises ConnectionError when the server closed without one)."""
    magic, code, reason_len, body_len, payload_len = RESPONSE.unpack(recv_exact(sock, RESPONSE.size))
    assert magic == RESPONSE_MAGIC, f"bad response magic {magic!r}"
    reason = recv_exact(sock, reason_len).decode(errors="replace")
    body = recv_exact(sock, body_len)
    payload = recv_exact(sock, payload_len) if payload_len else b""
    return DPAnswer(CODE_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN), reason, body, payload)


def dp_connect(port: int, token: str | bytes | None = TOKEN, timeout: float = 10.0) -> socket.socket:
    """A raw data-plane connection; with ``token`` the hello is sent and must be answered OK."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    if token is not None:
        sock.sendall(hello_bytes(token))
        a = dp_read(sock)
        assert a.code == OK, f"hello refused: {a}"
    return sock


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """True when the peer closes the connection within ``timeout`` (bytes it sends meanwhile are skipped)."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False


def dp_push_header(entries: Sequence[dict[str, Any]], update_id: str = "") -> bytes:
    return push_frames(entries, update_id=update_id)[0]


# ---------------------------------------------------------------- task processes
@dataclass
class Task:
    """A ``jaxdist ps`` / ``jaxdist worker`` process of this test."""

    proc: subprocess.Popen[str]
    port: int
    metrics_port: int
    log_path: str
    extra: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()


_MODULES = {"ps": "jaxdist.ps_server", "worker": "jaxdist.worker"}


@contextmanager
def task_process(role: str, log_dir: str, *args: str, metrics: bool = True, start_timeout: float = 120.0) -> Iterator[Task]:
    """Start ``python -m jaxdist.<role>`` on 127.0.0.1 port 0 with the test token (and, with
    ``metrics``, ``--metrics-port 0`` as LocalCluster does); stop and reap it afterwards."""
    env = {**os.environ, "JAXDIST_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu", ENV_PARENT_PID: str(os.getpid())}
    cmd = [sys.executable, "-m", _MODULES[role], "--port", "0", *args]
    if metrics:
        cmd += ["--metrics-port", "0"]
    log_path = os.path.join(log_dir, f"{role}-{len(os.listdir(log_dir))}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put(None)

    reader = threading.Thread(target=read, name=f"hostile-{role}-stdout", daemon=True)
    reader.start()
    try:
        try:
            line = lines.get(timeout=start_timeout)
        except queue.Empty:
            raise AssertionError(f"{role} did not start within {start_timeout}s") from None
        assert line and line.startswith("JAXDIST_READY"), f"no ready line from {role}: {line!r}; log:\n{open(log_path).read()[-3000:]}"
        fields = dict(kv.split("=", 1) for kv in line.split()[1:] if "=" in kv)
        yield Task(proc, int(fields["port"]), int(fields.get("metrics_port", 0)), log_path)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=15)
        reader.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def open_sockets(pid: int) -> int:
    """Sockets the process ``pid`` holds (Linux /proc)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:"):
                n += 1
        except OSError:
            pass
    return n


# ------------------------------------------------------------------ stalled calls
class Stalled:
    """Calls whose request stream stops mid-way (a slow or hostile client); released at close."""

    def __init__(self) -> None:
        self._release = threading.Event()
        self._futures: list[grpc.Future] = []
        self.channels: list[grpc.Channel] = []

    def _frames(self, first: Sequence[bytes]) -> Iterator[bytes]:
        yield from first
        self._release.wait()

    def open(self, ch: grpc.Channel, path: str, first: Sequence[bytes] = (), md: Sequence[tuple[str, str]] | None = MD) -> None:
        """Start a call on ``path`` that sends ``first`` and then nothing more, without a deadline.

        On a unary method the request message never completes; on Push the stream never ends.
        """
        self._futures.append(ch.stream_unary(path).future(self._frames(first), metadata=md))

    def close(self) -> None:
        self._release.set()
        for f in self._futures:
            f.cancel()
        for ch in self.channels:
            ch.close()


class Watches:
    """Token-less ``grpc.health.v1.Health/Watch`` streams, cancelled at close."""

    def __init__(self) -> None:
        self._calls: list[Any] = []
        self.channels: list[grpc.Channel] = []

    def open(self, ch: grpc.Channel, service: str = "") -> None:
        call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(service=service))
        self._calls.append(call)

    def first_answers(self, timeout: float) -> int:
        """How many watches got their first status within ``timeout`` (read in threads)."""
        got = []
        lock = threading.Lock()

        def first(call: Any) -> None:
            try:
                next(call)
                with lock:
                    got.append(1)
            except Exception:  # noqa: BLE001 - cancelled or failed: not answered
                pass

        threads = [threading.Thread(target=first, args=(c,), daemon=True) for c in self._calls]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        with lock:
            return len(got)

    def close(self) -> None:
        for c in self._calls:
            c.cancel()
        for ch in self.channels:
            ch.close()


def wait_connected(ch: grpc.Channel, timeout: float = 30.0) -> None:
    grpc.channel_ready_future(ch).result(timeout=timeout)
