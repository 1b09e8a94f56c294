"""Worker service: runs closures shipped by the coordinator.

Contract:

- Functions are cloudpickled once per worker process and cached by digest;
  a call naming an unknown digest without its payload is answered
  FUNCTION_UNKNOWN (the coordinator resends it).
- Closures of one worker run one at a time, in the order received, so
  per-worker iterators advance consistently.
- A batch stops at its first failing closure; the rest are answered SKIPPED.
- Per-worker resources (datasets, iterators) live in a table keyed by ids the
  coordinator assigns; a new coordinator (different ``coordinator_id``)
  empties it.
- Return values are converted to numpy before pickling, so the coordinator
  needs no device to read them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
import traceback
import uuid
from typing import Any

import cloudpickle
import grpc
import jax
import numpy as np

from jaxdist.base.errors import ClosureError, InvalidRequestError, OutOfRangeError, PerWorkerInputError, WorkerRestartedError
from jaxdist.proto import common_pb2, pickling, worker_pb2
from jaxdist.transport.handlers import unary_handler
from jaxdist.ps_server.connections import PSConnections
from jaxdist.transport.credentials import Credentials
from jaxdist.transport.credentials import PLAINTEXT
from jaxdist.worker import closure_args
from jaxdist.worker import context as wctx
from jaxdist.worker import prefetch

logger = logging.getLogger(__name__)

SERVICE = "jaxdist.Worker"

#: Functions kept per worker (LRU); a closure's function is a few KB.
_FUNCTION_CACHE_SIZE = 1024


def _ps_addresses(cluster_json: str) -> list[str]:
    """The PS addresses of a Configure's ``cluster_json`` (``{"ps": ["host:port", ...], ...}``).

    Raises:
        InvalidRequestError: not JSON (nesting too deep included), not an object, or a
            ``ps`` that is not a list of non-empty address strings.
    """
    try:
        cluster = json.loads(cluster_json or "{}")
    except (ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError; so are 5,000-digit numbers
        raise InvalidRequestError(f"cluster_json is not JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(cluster, dict) or not isinstance(cluster.get("ps", []), list):
        raise InvalidRequestError("cluster_json must be an object with a 'ps' list")
    addresses = cluster.get("ps", [])
    bad = [a for a in addresses if not isinstance(a, str) or not a or "\0" in a]
    if bad:
        raise InvalidRequestError(f"cluster_json: 'ps' must list addresses (non-empty strings), not {str(bad[0])[:64]!r}")
    return addresses


def _check_digest(call: worker_pb2.ClosureCall) -> None:
    """A call's function payload, when it has one, must hash to its digest.

    Raises:
        InvalidRequestError: it does not.
    """
    if call.fn_payload and hashlib.sha256(call.fn_payload).hexdigest() != call.fn_digest:
        raise InvalidRequestError(f"closure {call.closure_id}: function digest does not match its payload")


def _to_host(value: Any) -> Any:
    return jax.tree.map(lambda x: np.asarray(x) if isinstance(x, jax.Array) else x, value)


class WorkerServicer:
    """Serves one worker task. Closures and ``dataset_fn`` run in this worker's
    :class:`~jaxdist.worker.context.TaskContext` (its credentials, PS
    connections, index and the closure's push identity)."""

    def __init__(self, task_index: int = 0, credentials: Credentials = PLAINTEXT) -> None:
        self.task_index = task_index
        self.credentials = credentials
        self.incarnation = uuid.uuid4().hex
        self.started = time.monotonic()
        self.shutdown_event = threading.Event()
        self.exit_code = 0
        self._functions: dict[str, Any] = {}
        self._resources: dict[int, Any] = {}
        self._run_lock = threading.Lock()
        self._config_lock = threading.Lock()
        self._coordinator_id = ""
        self._cluster_json = ""
        self._conns: PSConnections | None = None
        #: The context closures run in (set by Configure).
        self.context = wctx.TaskContext(credentials)
        # Threads a closure starts push with identities of their own (exactly-once updates).
        wctx.inherit_in_threads()
        #: (coordinator registration address, this worker's address there), from Configure.
        self.registration: tuple[str, str] = ("", "")
        self.stats = {"closures_done": 0.0, "closures_failed": 0.0, "functions_cached": 0.0, "bytes_in": 0.0, "bytes_out": 0.0}

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "Configure": unary_handler("Configure", worker_pb2.ConfigureRequest.FromString, self.configure),
            "RunClosures": unary_handler("RunClosures", worker_pb2.RunRequest.FromString, self.run_closures),
            "Heartbeat": unary_handler("Heartbeat", common_pb2.Empty.FromString, self.heartbeat),
            "Shutdown": unary_handler("Shutdown", common_pb2.ShutdownRequest.FromString, self.shutdown),
        }

    def close(self) -> None:
        wctx.register_service(id(self), None)
        if self._conns is not None:
            prefetch.forget(self._conns)
            self._conns.close()
            self._conns = None

    # --------------------------------------------------------------- configure
    def configure(self, req: worker_pb2.ConfigureRequest, context: grpc.ServicerContext) -> worker_pb2.ConfigureResponse:
        ps_addresses = _ps_addresses(req.cluster_json)  # checked before anything changes
        with self._config_lock, self._run_lock:
            if req.cluster_json != self._cluster_json:
                old = self._conns
                self._conns = PSConnections(ps_addresses, self.credentials)
                self._cluster_json = req.cluster_json
                if old is not None:
                    prefetch.forget(old)
                    old.close()
            if req.coordinator_id != self._coordinator_id:
                self._resources.clear()
                self._coordinator_id = req.coordinator_id
                self.registration = ("", "")
            self.context = wctx.TaskContext(self.credentials, self._conns, req.worker_index, req.num_workers)
            wctx.register_service(id(self), self.context)
            if req.registration_address:  # a late, older Configure must not erase it
                self.registration = (req.registration_address, req.worker_address)
        logger.info("configured as worker %d of %d", req.worker_index, req.num_workers)
        return worker_pb2.ConfigureResponse(incarnation=self.incarnation)

    # --------------------------------------------------------------------- run
    def run_closures(self, req: worker_pb2.RunRequest, context: grpc.ServicerContext) -> worker_pb2.RunResponse:
        if req.incarnation and req.incarnation != self.incarnation:
            raise WorkerRestartedError(f"worker:{self.task_index} restarted (incarnation {self.incarnation[:8]})")
        if not self._cluster_json:
            raise WorkerRestartedError(f"worker:{self.task_index} is not configured yet")
        for call in req.calls:  # a batch refused for one call runs none, and is not counted
            _check_digest(call)
        resp = worker_pb2.RunResponse(incarnation=self.incarnation)
        with self._run_lock:
            self.stats["bytes_in"] += req.ByteSize()
            failed = False
            t0 = time.perf_counter()
            for call in req.calls:
                result = resp.results.add(closure_id=call.closure_id)
                if failed:
                    result.status = worker_pb2.SKIPPED
                    continue
                self._run_one(call, result)
                failed = result.status != worker_pb2.CLOSURE_OK
            # How long closures take here: the coordinator sizes its batches by it.
            resp.run_s = time.perf_counter() - t0
            self.stats["bytes_out"] += resp.ByteSize()
        return resp

    def _function(self, call: worker_pb2.ClosureCall) -> Any:
        fn = self._functions.get(call.fn_digest)
        if fn is not None:
            return fn
        if not call.fn_payload:
            return None
        fn = cloudpickle.loads(call.fn_payload)  # the digest was checked by run_closures
        if len(self._functions) >= _FUNCTION_CACHE_SIZE:
            self._functions.pop(next(iter(self._functions)))
        self._functions[call.fn_digest] = fn
        self.stats["functions_cached"] = float(len(self._functions))
        return fn

    def _run_one(self, call: worker_pb2.ClosureCall, result: worker_pb2.ClosureResult) -> None:
        try:
            fn = self._function(call)
        except Exception as e:  # noqa: BLE001 - a function that fails to unpickle is the closure's error
            if call.resource_id:
                e = self._input_error(call.resource_id, e)
                self._resources[call.resource_id] = closure_args.FailedResource(e)
            self._set_error(result, e)
            return
        if fn is None:
            result.status = worker_pb2.FUNCTION_UNKNOWN
            return
        try:
            args, kwargs = closure_args.loads(call.args, self._resources)
        except closure_args.ResourceMissing:
            result.status = worker_pb2.RESOURCE_UNKNOWN
            return
        except PerWorkerInputError as e:  # an input of this closure failed to build here
            if call.resource_id:  # a resource made from it (an iterator of a failed dataset) fails too
                self._resources[call.resource_id] = closure_args.FailedResource(e)
            self._set_error(result, e)
            return
        except Exception as e:  # noqa: BLE001
            if call.resource_id:
                e = self._input_error(call.resource_id, e)
                self._resources[call.resource_id] = closure_args.FailedResource(e)
            self._set_error(result, e)
            return
        closure_ctx = self.context.for_closure(f"{self._coordinator_id}/{call.closure_id}")
        try:
            with wctx.use(closure_ctx):
                try:
                    value = fn(*args, **kwargs)
                except StopIteration as stop:
                    # End of data is an ordinary closure error, typed like TF's.
                    raise OutOfRangeError(f"end of data on worker {self.task_index}") from stop
            if call.resource_id:
                if isinstance(value, closure_args.ReleasedResource):  # its last handle is gone: free it
                    self._resources.pop(call.resource_id, None)
                else:
                    self._resources[call.resource_id] = value
            elif not call.discard_result and value is not None:
                result.value = pickling.dumps(_to_host(value))
        except Exception as e:  # noqa: BLE001 - the user's exception goes back to the coordinator
            if call.resource_id:
                # Kept as failed, not missing: the closures that consume it fail with this error, the
                # others run (TF fails only a failed input's consumers).
                e = self._input_error(call.resource_id, e)
                self._resources[call.resource_id] = closure_args.FailedResource(e)
            self._set_error(result, e)
            # Whether a push of it may have been applied: its exactly-once batches are then consumed.
            assert closure_ctx.identity is not None
            result.pushed = closure_ctx.identity.pushed.is_set()
            return
        result.status = worker_pb2.CLOSURE_OK
        self.stats["closures_done"] += 1

    def _input_error(self, resource_id: int, exc: BaseException) -> PerWorkerInputError:
        """The error of per-worker resource ``resource_id``, whose function raised ``exc`` here."""
        task = f"worker:{self.task_index}"
        err = PerWorkerInputError(
            f"per-worker input {resource_id} failed to build on {task}: {type(exc).__name__}: {exc}", resource_id, task)
        cause: BaseException = exc
        try:
            pickling.dumps(exc)
        except Exception:  # noqa: BLE001 - an unpicklable cause travels as its type, message and traceback
            cause = ClosureError(f"{type(exc).__qualname__}: {exc}", "".join(traceback.format_exception(exc)))
        err.__cause__ = cause
        return err

    def _set_error(self, result: worker_pb2.ClosureResult, exc: BaseException) -> None:
        self.stats["closures_failed"] += 1
        result.status = worker_pb2.CLOSURE_ERROR
        result.error_type = f"{type(exc).__module__}.{type(exc).__qualname__}"
        result.traceback = "".join(traceback.format_exception(exc))
        try:
            result.error = pickling.dumps(exc)
        except Exception:  # noqa: BLE001 - unpicklable exceptions travel as text only
            result.error = b""
        logger.debug("closure failed: %s", result.error_type)

    # ----------------------------------------------------------------- control
    def heartbeat(self, req: common_pb2.Empty, context: grpc.ServicerContext) -> common_pb2.TaskStatus:
        return common_pb2.TaskStatus(
            role="worker", index=self.task_index, incarnation=self.incarnation,
            uptime_s=time.monotonic() - self.started, counters=dict(self.stats),
        )

    def shutdown(self, req: common_pb2.ShutdownRequest, context: grpc.ServicerContext) -> common_pb2.ShutdownResponse:
        logger.info("shutdown requested: %s (exit code %d)", req.reason or "job finished", req.exit_code)
        self.exit_code = req.exit_code
        self.shutdown_event.set()
        return common_pb2.ShutdownResponse()
