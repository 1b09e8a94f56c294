"""The ParameterServer service: thin adapters between its two transports and the PS's parts.

Each RPC decodes its request (:mod:`jaxdist.proto.ps_wire`), calls the part
that does the work and encodes the answer:

- the variables: :class:`~jaxdist.ps_server.store.VariableStore`;
- optimizers sent by clients: :class:`~jaxdist.ps_server.optimizer_cache.OptimizerCache`;
- Save/Restore/Export: :mod:`jaxdist.ps_server.save_restore` (exports' change tracking:
  :mod:`jaxdist.ps_server.export_rows`);
- primary/backup replication: :class:`~jaxdist.ps_server.backup.Replication`;
- what is counted: :class:`~jaxdist.ps_server.counters.PSCounters`;
- synchronous and bounded-stale steps (the step barrier pulls wait at, gradients
  staged per step and applied as their mean): :class:`~jaxdist.ps_server.sync_steps.SyncSteps`.

Pull and Push are served over gRPC (:meth:`handlers`) and over the data plane
(:meth:`data_plane_handlers`); both go through the same two halves
(:meth:`_pull_snapshot`; :meth:`_push_specs` then :meth:`_push_apply`), so
their semantics and errors are the same. PushPull (a push, then a read of the
variables it names, in one round trip) is a Push followed by the reading half of
a Pull, on both transports. Errors are answered by the
transports' guard (:mod:`jaxdist.transport.guard`).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import grpc
import numpy as np

from jaxdist.base.errors import ConfigurationError, InvalidRequestError
from jaxdist.proto import codec, common_pb2, ps_pb2, ps_wire
from jaxdist.ps_server import save_restore
from jaxdist.ps_server.backup import ROLE_CODES, Replication
from jaxdist.ps_server.client import PSClient
from jaxdist.ps_server.counters import PSCounters
from jaxdist.ps_server.dynamic_tables import DynamicTables, config_from_json, decode_counts, decode_keys
from jaxdist.ps_server.optimizer_cache import OptimizerCache, unpickle
from jaxdist.ps_server.run_fence import RunFence
from jaxdist.ps_server.store import NewVariable, VariableStore
from jaxdist.ps_server.sync_steps import SyncSteps
from jaxdist.transport import dataplane
from jaxdist.transport.credentials import PLAINTEXT, Credentials
from jaxdist.transport.handlers import stream_in_handler, stream_out_handler, stream_stream_handler, unary_handler

logger = logging.getLogger(__name__)

__all__ = ["SERVICE", "ParameterServerServicer"]

SERVICE = "jaxdist.ParameterServer"

#: Longest a pull waits at the step barrier before answering "still waiting" (the client asks again):
#: bounds how long a data-plane connection or gRPC thread is held.
_MAX_BARRIER_WAIT_MS = 2000


class ParameterServerServicer:
    """Serves one PS task. ``shutdown_event`` is set by the Shutdown RPC."""

    def __init__(self, store: VariableStore, task_index: int = 0, credentials: Credentials = PLAINTEXT) -> None:
        self.store = store
        self.task_index = task_index
        self.task = f"ps:{task_index}"
        self._credentials = credentials  # for calls to this PS's backup
        self._backup_client: PSClient | None = None  # to the attached backup (made on its first forward)
        self.optimizers = OptimizerCache()
        self.counters = PSCounters()
        self.replication = Replication(store, self._send_replica, self.optimizers.blob)
        self.sync = SyncSteps(store.apply_step, lambda name: store.spec(name)[1], store.was_applied)
        self.run_fence = RunFence(self.task)
        self.dynamic = DynamicTables(store)
        self.dynamic.forward = self.replication.forward_dynamic
        self.replication.dynamic = self.dynamic
        self.incarnation = uuid.uuid4().hex
        self.started = time.monotonic()
        self.shutdown_event = threading.Event()
        self.data_port = 0  # set when a data plane serves this PS (announced in GetStatus)
        self.exit_code = 0

    def handlers(self) -> dict[str, grpc.RpcMethodHandler]:
        return {
            "Pull": stream_out_handler("Pull", ps_pb2.PullRequest.FromString, self.pull),
            "Push": stream_in_handler("Push", self.push),
            "PushPull": stream_stream_handler("PushPull", self.push_pull),
            "ListVariables": unary_handler("ListVariables", ps_pb2.ListVariablesRequest.FromString, self.list_variables),
            "DeleteVariables": unary_handler("DeleteVariables", ps_pb2.DeleteVariablesRequest.FromString, self.delete_variables),
            "GetStatus": unary_handler("GetStatus", common_pb2.Empty.FromString, self.get_status),
            "Save": unary_handler("Save", ps_pb2.SaveRequest.FromString, self.save),
            "Restore": unary_handler("Restore", ps_pb2.RestoreRequest.FromString, self.restore),
            "Export": unary_handler("Export", ps_pb2.ExportRequest.FromString, self.export),
            "Shutdown": unary_handler("Shutdown", common_pb2.ShutdownRequest.FromString, self.shutdown),
            "Replicate": stream_in_handler("Replicate", self.replicate),
            "SetBackup": unary_handler("SetBackup", ps_pb2.SetBackupRequest.FromString, self.set_backup),
            "Promote": unary_handler("Promote", ps_pb2.PromoteRequest.FromString, self.promote),
            "BeginRun": unary_handler("BeginRun", ps_pb2.BeginRunRequest.FromString, self.begin_run),
            "SyncSteps": unary_handler("SyncSteps", ps_pb2.SyncStepsRequest.FromString, self.sync_steps),
            "CreateDynamicTable": unary_handler(
                "CreateDynamicTable", ps_pb2.CreateDynamicTableRequest.FromString, self.create_dynamic_table),
            "DynamicLookup": unary_handler("DynamicLookup", ps_pb2.DynamicLookupRequest.FromString, self.dynamic_lookup),
            "DynamicPush": unary_handler("DynamicPush", ps_pb2.DynamicPushRequest.FromString, self.dynamic_push),
        }

    def data_plane_handlers(self) -> dict[int, dataplane.Handler]:
        """Pull, Push and PushPull for :class:`jaxdist.transport.dataplane.DataPlaneServer` (same messages, raw framing)."""
        return {dataplane.PULL: self._data_plane_pull, dataplane.PUSH: self._data_plane_push,
                dataplane.PUSH_PULL: self._data_plane_push_pull}

    def close(self) -> None:
        """Close the channel to the backup, if any."""
        client, self._backup_client = self._backup_client, None
        if client is not None:
            client.close()

    # -------------------------------------------------------------------- pull
    @contextmanager
    def _pull_snapshot(self, req: ps_pb2.PullRequest) -> Iterator[tuple[ps_pb2.PullHeader, list[np.ndarray]]]:
        """The response header and payload arrays, valid while the context is open (read snapshots)."""
        self.replication.check_primary(self.task)
        specs = ps_wire.decode_pull(req, self.store.max_variable_bytes)
        step = -1
        if req.contributor > 0 and self.sync.enabled:
            # The step barrier: wait (bounded; the client asks again) until this worker may start its step.
            is_open, step = self.sync.wait_ready(req.contributor - 1, min(req.barrier_wait_ms, _MAX_BARRIER_WAIT_MS) / 1000)
            if not is_open:
                yield ps_pb2.PullHeader(barrier_waiting=True, synchronous=True, step=step), []
                return
        with self._reading(specs) as (header, payload):
            if step >= 0:
                header.synchronous, header.step = True, step
            yield header, payload

    @contextmanager
    def _reading(self, specs: list[ps_wire.PullSpec]) -> Iterator[tuple[ps_pb2.PullHeader, list[np.ndarray]]]:
        """Read snapshots of ``specs`` as a pull's answer (valid while the context is open), counted as a pull."""
        with ExitStack() as stack:
            reads = [stack.enter_context(self.store.reading(s.name, s.indices, s.known_version, s.as_dtype)) for s in specs]
            header, payload = ps_wire.encode_pull_header(reads)
            self.counters.add(pulls=1, bytes_pulled=sum(a.nbytes for a in payload))
            self.counters.add_variable_bytes("pulled", ((s.name, r.value.nbytes) for s, r in zip(specs, reads) if r.value is not None))
            yield header, payload

    def pull(self, req: ps_pb2.PullRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        with self._pull_snapshot(req) as (header, payload):
            yield header.SerializeToString()
            yield from codec.iter_frames(payload)

    @contextmanager
    def _data_plane_pull(self, header: bytes, payload: dataplane.Payload) -> Iterator[tuple[bytes, list[np.ndarray]]]:
        with self._pull_snapshot(ps_pb2.PullRequest.FromString(header)) as (resp, arrays):
            yield resp.SerializeToString(), arrays

    # -------------------------------------------------------------------- push
    def _push_specs(self, first: bytes, fused: bool = False) -> tuple[ps_pb2.PushHeader, list[ps_wire.ArraySpec]]:
        """Parse and check a push's header; the specs of its payload arrays, in order. ``fused``: the
        header of a PushPull (its reads are checked by :meth:`_push_pull_specs`), else a plain push,
        which must name nothing to read."""
        self.replication.check_primary(self.task)
        header = ps_pb2.PushHeader.FromString(first)
        if header.pull_after and not fused:
            raise InvalidRequestError("Push names variables to read after it (pull_after): that is a PushPull call")
        return header, ps_wire.push_payload_specs(header, self.store.max_variable_bytes)

    def _push_pull_specs(self, first: bytes) -> tuple[ps_pb2.PushHeader, list[ps_wire.ArraySpec], list[ps_wire.PullSpec]]:
        """:meth:`_push_specs` for a PushPull, plus its checked reads; all before any payload is read.

        Raises:
            ConfigurationError: a worker's gradients while this PS runs synchronous steps: they are
                staged, not applied, so no updated value exists to answer with (use Pull + Push).
        """
        header, specs = self._push_specs(first, fused=True)
        reads = ps_wire.decode_pull_after(header, self.store.max_variable_bytes)
        if header.contributor > 0 and self.sync.enabled:
            raise ConfigurationError(
                f"{self.task} runs synchronous/bounded-stale steps: a worker's PushPull would stage its "
                "gradients for the step, so there are no updated values to return; pull and push separately")
        for r in reads:  # a read that would fail must fail before the push changes anything
            self.store.check_readable(r.name, r.indices, r.as_dtype)
        return header, specs, reads

    def _push_apply(self, header: ps_pb2.PushHeader, received: list[np.ndarray]) -> ps_pb2.PushResponse:
        """Apply a checked push (:meth:`_push_specs`); counted only once it was applied (or was a
        duplicate): a rejected push changes nothing, its counters included. A push of a closure of
        another coordinator run than the one begun here is refused (:class:`RunFence`)."""
        with self.run_fence.admit(header.update_id):
            return self._push_apply_admitted(header, received)

    def _push_apply_admitted(self, header: ps_pb2.PushHeader, received: list[np.ndarray]) -> ps_pb2.PushResponse:
        if ps_wire.is_create(header):
            created = ps_wire.decode_creates(header, iter(received), self.store.max_variable_bytes)
            versions = self.store.create_many([self._new_variable(c) for c in created])
            self.counters.add(pushes=1, bytes_pushed=sum(a.nbytes for a in received))
            self.replication.forward_install([c.name for c in created])
            return ps_pb2.PushResponse(versions=versions)
        updates = ps_wire.decode_updates(header, iter(received))
        if header.contributor > 0 and self.sync.enabled and any(u.op in ps_wire.GRADIENT_OPS for u in updates):
            # A worker's gradients in synchronous steps: staged for its step, applied as the step's mean.
            self.store.validate(updates)
            dup, staged, step = self.sync.push(header.contributor - 1, header.update_id, updates, header.commit,
                                               header.step - 1)
            self.counters.add(pushes=1, bytes_pushed=sum(a.nbytes for a in received), duplicates=1 if dup else 0)
            self.counters.add_variable_bytes("pushed", ((u.name, u.value.nbytes) for u in updates))
            return ps_pb2.PushResponse(duplicate=dup, staged=staged, step=step)
        versions, dup = self.store.apply(updates, header.update_id)
        self.counters.add(pushes=1, bytes_pushed=sum(a.nbytes for a in received), duplicates=1 if dup else 0)
        self.counters.add_variable_bytes("pushed", ((u.name, u.value.nbytes) for u in updates))
        return ps_pb2.PushResponse(versions=versions, duplicate=dup)

    def push(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        try:
            first = next(frames)
        except StopIteration:
            raise InvalidRequestError("empty Push stream: the first frame must be a PushHeader") from None
        header, specs = self._push_specs(first)
        return self._push_apply(header, _read_frames(frames, specs, aligned=True))

    @contextmanager
    def _data_plane_push(self, header: bytes, payload: dataplane.Payload) -> Iterator[tuple[bytes, list[np.ndarray]]]:
        msg, specs = self._push_specs(header)
        received = codec.destination_arrays(specs, aligned=True)
        payload.read_into(received)
        yield self._push_apply(msg, received).SerializeToString(), []

    # --------------------------------------------------- fused push-then-pull
    @contextmanager
    def _push_pull_answer(
        self, header: ps_pb2.PushHeader, received: list[np.ndarray], reads: list[ps_wire.PullSpec]
    ) -> Iterator[tuple[ps_pb2.PullHeader, list[np.ndarray]]]:
        """Apply the push exactly as Push does (dedupe, digest check, replication), then read
        ``reads``: the answer header (with the push's answer in ``push``) and payload arrays."""
        pushed = self._push_apply(header, received)
        with self._reading(reads) as (answer, payload):
            answer.push.CopyFrom(pushed)
            answer.has_push = True
            yield answer, payload

    def push_pull(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        try:
            first = next(frames)
        except StopIteration:
            raise InvalidRequestError("empty PushPull stream: the first frame must be a PushHeader") from None
        header, specs, reads = self._push_pull_specs(first)
        received = _read_frames(frames, specs, aligned=True)
        with self._push_pull_answer(header, received, reads) as (answer, payload):
            yield answer.SerializeToString()
            yield from codec.iter_frames(payload)

    @contextmanager
    def _data_plane_push_pull(self, header: bytes, payload: dataplane.Payload) -> Iterator[tuple[bytes, list[np.ndarray]]]:
        msg, specs, reads = self._push_pull_specs(header)
        received = codec.destination_arrays(specs, aligned=True)
        payload.read_into(received)
        with self._push_pull_answer(msg, received, reads) as (answer, arrays):
            yield answer.SerializeToString(), arrays

    def _new_variable(self, c: ps_wire.Created) -> NewVariable:
        """What the store creates for ``c``: its initializer unpickled, its optimizer from the cache."""
        return NewVariable(
            c.name,
            value=c.value,
            shape=c.shape,
            dtype=c.dtype,
            initializer=unpickle(c.initializer, "initializer") if c.initializer else None,
            offset=c.offset,
            optimizer=self.optimizers.get(c.optimizer, c.optimizer_digest),
            if_exists=c.if_exists,
        )

    def sync_steps(self, req: ps_pb2.SyncStepsRequest, context: grpc.ServicerContext) -> ps_pb2.SyncStepsResponse:
        kind, contributor, staleness, members, step = ps_wire.decode_sync_request(req)
        return ps_wire.encode_sync_report(self.sync.control(kind, contributor, staleness, members, step))

    # ---------------------------------------------------------- dynamic tables
    def create_dynamic_table(
        self, req: ps_pb2.CreateDynamicTableRequest, context: grpc.ServicerContext
    ) -> ps_pb2.CreateDynamicTableResponse:
        self.replication.check_primary(self.task)
        config = config_from_json(req.config_json)
        if not 0 <= req.shard < req.num_shards:
            raise InvalidRequestError(f"dynamic table shard {req.shard} out of range for {req.num_shards} shards")
        return ps_pb2.CreateDynamicTableResponse(created=self.dynamic.create(config, req.shard, req.num_shards))

    def dynamic_lookup(self, req: ps_pb2.DynamicLookupRequest, context: grpc.ServicerContext) -> ps_pb2.DynamicLookupResponse:
        self.replication.check_primary(self.task)
        rows, admitted = self.dynamic.lookup(req.table, decode_keys(req.keys, self.store.max_variable_bytes))
        out = ps_pb2.DynamicLookupResponse()
        codec.tensor_to_proto(rows, out.rows)
        codec.tensor_to_proto(admitted, out.admitted)
        self.counters.add(pulls=1, bytes_pulled=rows.nbytes)
        return out

    def dynamic_push(self, req: ps_pb2.DynamicPushRequest, context: grpc.ServicerContext) -> ps_pb2.DynamicPushResponse:
        self.replication.check_primary(self.task)
        keys = decode_keys(req.keys, self.store.max_variable_bytes)
        grads = codec.tensor_from_proto(req.grads, self.store.max_variable_bytes)
        with self.run_fence.admit(req.update_id):
            counts, dup = self.dynamic.push(req.table, keys, grads, req.update_id, wire=req,
                                            occurrences=decode_counts(req))
        self.counters.add(pushes=1, bytes_pushed=grads.nbytes, duplicates=1 if dup else 0)
        if counts is None:
            return ps_pb2.DynamicPushResponse(duplicate=True)
        return ps_pb2.DynamicPushResponse(applied=counts["applied"], refused=counts["refused"],
                                          inserted=counts["inserted"], evicted=counts["evicted"])

    # -------------------------------------------------------------- checkpoint
    def save(self, req: ps_pb2.SaveRequest, context: grpc.ServicerContext) -> ps_pb2.SaveResponse:
        return save_restore.save(self.store, req, self.dynamic.save_arrays)

    def export(self, req: ps_pb2.ExportRequest, context: grpc.ServicerContext) -> ps_pb2.ExportResponse:
        # A deposed primary's or a backup's changes are not the shard's: only the primary exports.
        self.replication.check_primary(self.task)
        return save_restore.export(self.store, req, self.dynamic.participants())

    def restore(self, req: ps_pb2.RestoreRequest, context: grpc.ServicerContext) -> ps_pb2.RestoreResponse:
        staged = save_restore.read_restore(req, self.store.max_variable_bytes, self.optimizers.get)
        dynamic = self.dynamic.read_restore(req)
        self.replication.check_primary(self.task)
        for name, value, opt, state in staged:  # install only once every entry was read and verified
            self.store.install(name, value, opt, state)
        self.dynamic.install(dynamic)
        if self.replication.backup:
            self.dynamic.forward_installs([t.config.name for t in dynamic])
        self.replication.forward_install([name for name, *_ in staged])
        return ps_pb2.RestoreResponse(restored=len(staged) + len(dynamic))

    # ----------------------------------------------------------------- control
    def list_variables(self, req: ps_pb2.ListVariablesRequest, context: grpc.ServicerContext) -> ps_pb2.ListVariablesResponse:
        out = ps_pb2.ListVariablesResponse()
        for info in self.store.info():
            v = out.variables.add(name=info.name, version=info.version, has_optimizer=info.has_optimizer)
            codec.spec_to_proto(info.shape, info.dtype, v.spec)
        return out

    def delete_variables(self, req: ps_pb2.DeleteVariablesRequest, context: grpc.ServicerContext) -> common_pb2.Empty:
        self.replication.check_primary(self.task)
        self.store.delete(list(req.names))
        self.replication.forward_delete(list(req.names))
        return common_pb2.Empty()

    def get_status(self, req: common_pb2.Empty, context: grpc.ServicerContext) -> common_pb2.TaskStatus:
        counters = self.counters.snapshot()
        counters["variables"] = float(len(self.store.info()))
        counters["updates_applied"] = float(self.store.updates_applied)
        counters["shared_pass_pushes"] = float(self.store.shared_pass_pushes)
        r = self.replication
        counters["replica_role"] = ROLE_CODES[r.role]
        counters["replica_epoch"] = float(r.epoch)
        counters["replica_has_backup"] = 1.0 if r.backup else 0.0
        counters["replica_forwarded"] = float(r.forwarded)
        counters["replica_degraded"] = float(r.degraded_events)
        counters["sync_steps_applied"] = float(self.sync.steps_applied)
        counters.update(self.dynamic.status_counters())
        return common_pb2.TaskStatus(
            role="ps", index=self.task_index, incarnation=self.incarnation,
            uptime_s=time.monotonic() - self.started, counters=counters, data_port=self.data_port,
        )

    def shutdown(self, req: common_pb2.ShutdownRequest, context: grpc.ServicerContext) -> common_pb2.ShutdownResponse:
        logger.info("shutdown requested: %s (exit code %d)", req.reason or "job finished", req.exit_code)
        self.exit_code = req.exit_code
        self.shutdown_event.set()
        return common_pb2.ShutdownResponse()

    # ------------------------------------------------------------- replication
    def _send_replica(self, address: str, header: ps_pb2.ReplicaHeader, arrays: list[np.ndarray]) -> None:
        client = self._backup_client
        if client is None or client.address != address:
            old, client = client, PSClient(address, self._credentials, task=f"backup of {self.task}")
            self._backup_client = client
            if old is not None:
                old.close()
        client.replicate(header, arrays)

    def replicate(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        try:
            first = next(frames)
        except StopIteration:
            raise InvalidRequestError("empty Replicate stream: the first frame must be a ReplicaHeader") from None
        header = ps_pb2.ReplicaHeader.FromString(first)
        arrays = _read_frames(frames, ps_wire.replica_payload_specs(header, self.store.max_variable_bytes))
        self.replication.accept(header, arrays, self.optimizers.get)
        return ps_pb2.PushResponse()

    def set_backup(self, req: ps_pb2.SetBackupRequest, context: grpc.ServicerContext) -> ps_pb2.SetBackupResponse:
        n, nbytes = self.replication.attach(req.address, req.epoch)
        return ps_pb2.SetBackupResponse(variables=n, bytes=nbytes)

    def begin_run(self, req: ps_pb2.BeginRunRequest, context: grpc.ServicerContext) -> ps_pb2.BeginRunResponse:
        if not req.run_id:
            raise InvalidRequestError("BeginRun needs a run_id")
        return ps_pb2.BeginRunResponse(previous_run_id=self.run_fence.begin(req.run_id))

    def promote(self, req: ps_pb2.PromoteRequest, context: grpc.ServicerContext) -> ps_pb2.PromoteResponse:
        epoch = self.replication.promote(req.epoch)
        return ps_pb2.PromoteResponse(epoch=epoch, variables=len(self.store.info()))


def _read_frames(frames: Iterator[bytes], specs: list[ps_wire.ArraySpec], aligned: bool = False) -> list[np.ndarray]:
    """The payload arrays of a gRPC stream's raw frames (exact sizes: a short or long stream is an error)."""
    reader = codec.FrameReader(specs, aligned=aligned)
    for frame in frames:
        reader.feed(frame)
    return reader.finish()
