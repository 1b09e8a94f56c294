"""The one place where exceptions and gRPC statuses are mapped, both ways.

Servers abort with the error's status code and put its ``reason`` in the
trailing metadata key :data:`REASON_KEY`. Clients rebuild the typed error from
(code, reason, which task was called). Message text is shown to people and
never parsed.
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from jaxdist.base import errors as E

REASON_KEY = "jaxdist-reason"

_BY_REASON: dict[str, type[E.JaxdistError]] = {
    cls.reason: cls
    for cls in (
        E.ConfigurationError,
        E.UnreachableWorkerAddressError,
        E.CancelledError,
        E.VariableNotFoundError,
        E.VariableExistsError,
        E.ShapeMismatchError,
        E.DTypeMismatchError,
        E.InvalidRequestError,
        E.PayloadTooLargeError,
        E.ServerBusyError,
        E.AuthenticationError,
        E.StaleFunctionError,
        E.WorkerRestartedError,
        E.NotPrimaryError,
        E.StaleEpochError,
        E.BackupNotAttachedError,
        E.StaleRunError,
        E.UnidentifiedPushError,
        E.UpdateMismatchError,
        E.StepMembershipError,
        E.StepBarrierTimeoutError,
    )
}

#: Codes that mean "the task could not be reached or did not answer in time".
UNAVAILABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


#: The most UTF-8 bytes of an error's text a caller is sent. gRPC carries the text in
#: trailing metadata, percent-encoded (up to 3x), and drops metadata past 8 KB at random
#: and past 16 KB always, answering RESOURCE_EXHAUSTED instead of the error's own status;
#: error texts echo request fields (a 20 KB variable name), so they are cut to fit.
MAX_DETAILS_BYTES = 2048


def details(exc: E.JaxdistError) -> str:
    """The text a caller is sent for ``exc`` (both transports): its message, cut to
    :data:`MAX_DETAILS_BYTES` with the number of bytes left out."""
    text = str(exc) or type(exc).__name__
    raw = text.encode(errors="replace")
    if len(raw) <= MAX_DETAILS_BYTES:
        return text
    keep = MAX_DETAILS_BYTES - 64  # room for the marker
    return raw[:keep].decode(errors="ignore") + f"... [{len(raw) - keep} more bytes]"


def abort(context: grpc.ServicerContext, exc: E.JaxdistError) -> NoReturn:
    """End the current RPC with ``exc``'s status code and reason (its text cut by :func:`details`)."""
    context.set_trailing_metadata(((REASON_KEY, exc.reason),))
    context.abort(exc.code, details(exc))
    raise AssertionError("unreachable")  # context.abort raises


def reason_of(err: grpc.RpcError) -> str:
    md = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
    for key, value in md or ():
        if key == REASON_KEY:
            return value if isinstance(value, str) else value.decode()
    return ""


def error_from_rpc(err: grpc.RpcError, task: str, role: str) -> E.JaxdistError:
    """Typed error for a failed call to ``task`` (e.g. "ps:1") of ``role`` ("ps"/"worker").

    Classification uses the status code, the reason metadata and the role of
    the task called, never the message text.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else "") or ""
    return error_from_status(code, details, reason_of(err), task, role)


def error_from_status(code: grpc.StatusCode, details: str, reason: str, task: str, role: str) -> E.JaxdistError:
    """Typed error from a status code, its details and reason (both transports: gRPC and the data plane)."""
    message = f"{task}: {details}" if details else f"{task}: {code.name}"
    cls = _BY_REASON.get(reason)
    if cls is not None:
        out: E.JaxdistError = cls(message)
    elif code in UNAVAILABLE_CODES or code == grpc.StatusCode.CANCELLED and not reason:
        unavailable = E.PSUnavailableError if role == "ps" else E.WorkerUnavailableError
        out = unavailable(message, task=task)
    elif code == grpc.StatusCode.UNAUTHENTICATED:
        out = E.AuthenticationError(message)
    elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        out = E.PayloadTooLargeError(message)
    elif code == grpc.StatusCode.INVALID_ARGUMENT:
        out = E.InvalidRequestError(message)
    else:
        out = E.RemoteError(message, code=code, task=task)
    out.task = task  # type: ignore[attr-defined]
    out.grpc_code = code  # type: ignore[attr-defined]
    return out
