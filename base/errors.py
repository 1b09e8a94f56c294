"""The jaxdist exception hierarchy, shared by every role.

Every error that crosses the wire is identified by a gRPC status code plus a
``reason`` string (sent as trailing metadata, see :mod:`jaxdist.proto.status`).
Clients classify failures by that pair and by which task they called, never by
matching message text.
"""

from __future__ import annotations

import grpc

__all__ = [
    "JaxdistError",
    "ConfigurationError",
    "UnreachableWorkerAddressError",
    "ClosureError",
    "CancelledError",
    "TaskUnavailableError",
    "WorkerUnavailableError",
    "PSUnavailableError",
    "NotPrimaryError",
    "StaleEpochError",
    "BackupNotAttachedError",
    "RemoteError",
    "VariableNotFoundError",
    "VariableExistsError",
    "ShapeMismatchError",
    "DTypeMismatchError",
    "InvalidRequestError",
    "PayloadTooLargeError",
    "ServerBusyError",
    "AuthenticationError",
    "StaleFunctionError",
    "OutOfRangeError",
    "PerWorkerInputError",
    "WorkerRestartedError",
    "UnidentifiedPushError",
    "UpdateMismatchError",
    "StaleRunError",
    "StepMembershipError",
    "StepBarrierTimeoutError",
]


class JaxdistError(Exception):
    """Root of every error jaxdist raises."""

    #: gRPC status a server answers with when this error is raised while serving.
    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN
    #: Stable machine-readable reason, sent beside the status code.
    reason: str = "UNKNOWN"


class ConfigurationError(JaxdistError, ValueError):
    """The cluster or a component is set up wrongly; the message says how to fix it."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "CONFIGURATION"


class UnreachableWorkerAddressError(ConfigurationError):
    """A worker asked to join (``RegisterWorker``) at an address where the coordinator
    reaches nothing: nothing listens there, the host does not resolve, or nothing answered in
    time. Not retryable as it is: the worker must advertise an address the coordinator can dial
    (``--advertise-address``). ``address`` is the refused address (cut to 200 characters).

    Answered FAILED_PRECONDITION, not UNAVAILABLE: UNAVAILABLE would tell the worker (and every gRPC
    client) that the coordinator is down and the same call may succeed later."""

    reason = "WORKER_ADDRESS_UNREACHABLE"

    def __init__(self, message: str, address: str = "") -> None:
        super().__init__(message)
        self.address = address[:200]


class ClosureError(JaxdistError):
    """Wraps nothing: closures re-raise the user's own exception type.

    Used only when the original exception cannot be unpickled on the
    coordinator; the remote traceback text is kept in ``remote_traceback``.
    """

    def __init__(self, message: str, remote_traceback: str = "") -> None:
        super().__init__(message)
        self.remote_traceback = remote_traceback


class CancelledError(JaxdistError):
    """A closure was cancelled before it ran (an earlier closure failed).

    Reschedule the function to run it.
    """

    code = grpc.StatusCode.CANCELLED
    reason = "CANCELLED"


class TaskUnavailableError(JaxdistError):
    """A cluster task cannot be reached (dead, restarting or cut off)."""

    code = grpc.StatusCode.UNAVAILABLE
    reason = "TASK_UNAVAILABLE"

    def __init__(self, message: str, task: str = "") -> None:
        super().__init__(message)
        self.task = task


class WorkerUnavailableError(TaskUnavailableError):
    """A worker is unreachable. The coordinator retries its closures elsewhere."""

    reason = "WORKER_UNAVAILABLE"


class PSUnavailableError(TaskUnavailableError):
    """A parameter-server task is unreachable; surfaced by schedule/join/done."""

    reason = "PS_UNAVAILABLE"


class NotPrimaryError(PSUnavailableError):
    """The PS called is not (or no longer) the primary of its shard: a backup, or a
    primary that a promoted backup superseded. Like any unavailable PS, the
    coordinator re-runs the closure once the shard's current primary is known."""

    reason = "PS_NOT_PRIMARY"


class StaleEpochError(JaxdistError):
    """A replication message from an older epoch: its sender was superseded (fenced)."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "STALE_EPOCH"


class BackupNotAttachedError(JaxdistError):
    """A replication message reached a PS task that is not an attached backup: a fresh process
    at the backup's address (the backup restarted) that no full sync has made a backup yet.

    Unlike :class:`StaleEpochError` it does not mean the sender was superseded: the primary
    detaches that backup and goes on alone, and the coordinator attaches it again with a full sync."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "BACKUP_NOT_ATTACHED"


class RemoteError(JaxdistError):
    """A server answered with a status jaxdist has no more specific class for."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None, task: str = "") -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.task = task


class VariableNotFoundError(JaxdistError, KeyError):
    """The named variable does not exist on the parameter server."""

    code = grpc.StatusCode.NOT_FOUND
    reason = "VARIABLE_NOT_FOUND"

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable.
        return str(self.args[0]) if self.args else ""


class VariableExistsError(JaxdistError):
    """A variable of that name already exists on the parameter server."""

    code = grpc.StatusCode.ALREADY_EXISTS
    reason = "VARIABLE_EXISTS"


class ShapeMismatchError(JaxdistError, ValueError):
    """A value's shape does not match the variable's."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "SHAPE_MISMATCH"


class DTypeMismatchError(JaxdistError, TypeError):
    """A value's dtype does not match the variable's."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "DTYPE_MISMATCH"


class InvalidRequestError(JaxdistError, ValueError):
    """A request is malformed: garbage bytes, truncated stream, bad field values."""

    code = grpc.StatusCode.INVALID_ARGUMENT
    reason = "INVALID_REQUEST"


class PayloadTooLargeError(JaxdistError, ValueError):
    """A request exceeds the server's size limit."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "PAYLOAD_TOO_LARGE"


class ServerBusyError(JaxdistError):
    """A server refused a call because that method already has as many calls in flight as it
    admits (its admission cap). Nothing was done: the call may be made again later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "SERVER_BUSY"


class AuthenticationError(JaxdistError, PermissionError):
    """The caller did not present the cluster's token."""

    code = grpc.StatusCode.UNAUTHENTICATED
    reason = "UNAUTHENTICATED"


class StaleFunctionError(JaxdistError):
    """The worker does not hold the function asked for (it restarted); resend it."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "FUNCTION_UNKNOWN"


class OutOfRangeError(JaxdistError):
    """A closure's iterator ran out of data (TF's ``OutOfRangeError``).

    Raised by the closure's ``fetch()`` and by ``join``/``done``/``schedule``
    like any closure error; the worker-side ``StopIteration`` is its ``__cause__``.
    """

    code = grpc.StatusCode.OUT_OF_RANGE
    reason = "OUT_OF_RANGE"


class PerWorkerInputError(JaxdistError):
    """A per-worker input (a per-worker dataset, its iterator, or another per-worker resource)
    failed to build on a worker; the function's own exception is the ``__cause__``.

    Raised by ``create_per_worker_dataset`` when the dataset function raises
    on the worker that builds it first, and by every closure that consumes the
    failed input on a worker where it failed (its ``fetch()``, then
    ``join``/``done``/``schedule`` as any closure error). An input that failed
    fails no closure that does not use it (TF's ``ClosureInputError``).
    ``resource_id`` names the input, ``task`` the worker (``"worker:3"``).
    The cause travels with the error between processes (pickled with it).
    """

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "PER_WORKER_INPUT_FAILED"

    def __init__(self, message: str, resource_id: int = 0, task: str = "") -> None:
        super().__init__(message)
        self.resource_id = resource_id
        self.task = task

    def __reduce__(self) -> tuple[object, ...]:
        # Exceptions pickle their args and __dict__, not __cause__: carry the cause by hand.
        return (_rebuild_input_error, (type(self), str(self), self.resource_id, self.task, self.__cause__))


def _rebuild_input_error(
    cls: type[PerWorkerInputError], message: str, resource_id: int, task: str, cause: BaseException | None
) -> PerWorkerInputError:
    err = cls(message, resource_id, task)
    err.__cause__ = cause
    return err


class WorkerRestartedError(JaxdistError):
    """The worker restarted since the coordinator configured it; the coordinator reconfigures it."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "WORKER_RESTARTED"


class UnidentifiedPushError(ConfigurationError):
    """A push made on a worker that cannot carry an update identity, refused before it is sent.

    Exactly-once updates need every push made by a closure to have a position
    that a re-run of the closure repeats. A push from a thread jaxdist cannot
    place (one started inside the closure by other means than
    ``threading.Thread`` or a ``concurrent.futures.ThreadPoolExecutor``: with
    no context, or entering a copy of the closure's through
    ``contextvars.copy_context().run``) could be applied again when the
    closure is re-run, so it is refused instead.
    """

    reason = "PUSH_WITHOUT_IDENTITY"


class UpdateMismatchError(JaxdistError):
    """A push repeats an update identity the PS already applied, but to other variables or ops.

    An identity names one update. The identities of a closure's pushes
    include what each push names (variables and ops), so a re-run closure
    never repeats one with something else, whatever path it takes; this error
    means two different pushes were given one identity (an identity made by
    hand on the PS client, or a client that numbers pushes otherwise). The PS
    refuses the second rather than drop it as a duplicate.
    """

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "UPDATE_MISMATCH"


class StaleRunError(JaxdistError):
    """A push from a closure of an earlier coordinator run, refused by a PS that a newer run began on.

    Workers can outlive their coordinator (its script killed and run again, resuming from a
    checkpoint): a closure of the old run still running there must not change the variables the new
    run restored. Every coordinator begins its run on each PS task, and the PS refuses pushes whose
    identity names another run; nothing is changed. Not retried: the closure's run is over."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "STALE_RUN"


class StepMembershipError(JaxdistError):
    """A worker outside the synchronous steps (declared failed, or left) pushed gradients for one.

    Its closure is re-run elsewhere by the coordinator; the push changed nothing."""

    code = grpc.StatusCode.FAILED_PRECONDITION
    reason = "NOT_STEP_MEMBER"


class StepBarrierTimeoutError(JaxdistError):
    """A pull waited at the step barrier (synchronous or bounded-stale training) longer than its
    limit: the slowest worker did not commit its step (see the README, "Bounded staleness")."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "STEP_BARRIER_TIMEOUT"
