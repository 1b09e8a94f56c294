from jaxdist.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ClosureStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLOSURE_OK: _ClassVar[ClosureStatus]
    CLOSURE_ERROR: _ClassVar[ClosureStatus]
    FUNCTION_UNKNOWN: _ClassVar[ClosureStatus]
    SKIPPED: _ClassVar[ClosureStatus]
    RESOURCE_UNKNOWN: _ClassVar[ClosureStatus]
CLOSURE_OK: ClosureStatus
CLOSURE_ERROR: ClosureStatus
FUNCTION_UNKNOWN: ClosureStatus
SKIPPED: ClosureStatus
RESOURCE_UNKNOWN: ClosureStatus

class ConfigureRequest(_message.Message):
    __slots__ = ("cluster_json", "worker_index", "num_workers", "coordinator_id", "registration_address", "worker_address")
    CLUSTER_JSON_FIELD_NUMBER: _ClassVar[int]
    WORKER_INDEX_FIELD_NUMBER: _ClassVar[int]
    NUM_WORKERS_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ID_FIELD_NUMBER: _ClassVar[int]
    REGISTRATION_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    cluster_json: str
    worker_index: int
    num_workers: int
    coordinator_id: str
    registration_address: str
    worker_address: str
    def __init__(self, cluster_json: _Optional[str] = ..., worker_index: _Optional[int] = ..., num_workers: _Optional[int] = ..., coordinator_id: _Optional[str] = ..., registration_address: _Optional[str] = ..., worker_address: _Optional[str] = ...) -> None: ...

class ConfigureResponse(_message.Message):
    __slots__ = ("incarnation",)
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    def __init__(self, incarnation: _Optional[str] = ...) -> None: ...

class ClosureCall(_message.Message):
    __slots__ = ("closure_id", "attempt", "fn_digest", "fn_payload", "args", "resource_id", "discard_result")
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    FN_DIGEST_FIELD_NUMBER: _ClassVar[int]
    FN_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    ARGS_FIELD_NUMBER: _ClassVar[int]
    RESOURCE_ID_FIELD_NUMBER: _ClassVar[int]
    DISCARD_RESULT_FIELD_NUMBER: _ClassVar[int]
    closure_id: int
    attempt: int
    fn_digest: str
    fn_payload: bytes
    args: bytes
    resource_id: int
    discard_result: bool
    def __init__(self, closure_id: _Optional[int] = ..., attempt: _Optional[int] = ..., fn_digest: _Optional[str] = ..., fn_payload: _Optional[bytes] = ..., args: _Optional[bytes] = ..., resource_id: _Optional[int] = ..., discard_result: _Optional[bool] = ...) -> None: ...

class ClosureResult(_message.Message):
    __slots__ = ("closure_id", "status", "value", "error", "error_type", "traceback", "pushed")
    CLOSURE_ID_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_TYPE_FIELD_NUMBER: _ClassVar[int]
    TRACEBACK_FIELD_NUMBER: _ClassVar[int]
    PUSHED_FIELD_NUMBER: _ClassVar[int]
    closure_id: int
    status: ClosureStatus
    value: bytes
    error: bytes
    error_type: str
    traceback: str
    pushed: bool
    def __init__(self, closure_id: _Optional[int] = ..., status: _Optional[_Union[ClosureStatus, str]] = ..., value: _Optional[bytes] = ..., error: _Optional[bytes] = ..., error_type: _Optional[str] = ..., traceback: _Optional[str] = ..., pushed: _Optional[bool] = ...) -> None: ...

class RunRequest(_message.Message):
    __slots__ = ("calls", "incarnation")
    CALLS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    calls: _containers.RepeatedCompositeFieldContainer[ClosureCall]
    incarnation: str
    def __init__(self, calls: _Optional[_Iterable[_Union[ClosureCall, _Mapping]]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RunResponse(_message.Message):
    __slots__ = ("results", "incarnation", "run_s")
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    RUN_S_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[ClosureResult]
    incarnation: str
    run_s: float
    def __init__(self, results: _Optional[_Iterable[_Union[ClosureResult, _Mapping]]] = ..., incarnation: _Optional[str] = ..., run_s: _Optional[float] = ...) -> None: ...
