from jaxdist.proto import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class UpdateOp(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_UNSPECIFIED: _ClassVar[UpdateOp]
    CREATE: _ClassVar[UpdateOp]
    ASSIGN: _ClassVar[UpdateOp]
    ASSIGN_ADD: _ClassVar[UpdateOp]
    ASSIGN_SUB: _ClassVar[UpdateOp]
    APPLY_GRADIENT: _ClassVar[UpdateOp]
    SCATTER_UPDATE: _ClassVar[UpdateOp]
    SCATTER_ADD: _ClassVar[UpdateOp]
    SCATTER_SUB: _ClassVar[UpdateOp]
    SCATTER_MIN: _ClassVar[UpdateOp]
    SCATTER_MAX: _ClassVar[UpdateOp]
    SPARSE_APPLY_GRADIENT: _ClassVar[UpdateOp]

class IfExists(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAIL: _ClassVar[IfExists]
    KEEP: _ClassVar[IfExists]
    REPLACE: _ClassVar[IfExists]

class ReplicaKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REPLICA_UPDATE: _ClassVar[ReplicaKind]
    REPLICA_INSTALL: _ClassVar[ReplicaKind]
    REPLICA_DELETE: _ClassVar[ReplicaKind]
    REPLICA_DYNAMIC: _ClassVar[ReplicaKind]

class SyncStepsKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SYNC_STATUS: _ClassVar[SyncStepsKind]
    SYNC_CONFIGURE: _ClassVar[SyncStepsKind]
    SYNC_COMMIT: _ClassVar[SyncStepsKind]
    SYNC_FENCE: _ClassVar[SyncStepsKind]
    SYNC_DROP: _ClassVar[SyncStepsKind]
    SYNC_JOIN: _ClassVar[SyncStepsKind]
    SYNC_SKIP: _ClassVar[SyncStepsKind]
OP_UNSPECIFIED: UpdateOp
CREATE: UpdateOp
ASSIGN: UpdateOp
ASSIGN_ADD: UpdateOp
ASSIGN_SUB: UpdateOp
APPLY_GRADIENT: UpdateOp
SCATTER_UPDATE: UpdateOp
SCATTER_ADD: UpdateOp
SCATTER_SUB: UpdateOp
SCATTER_MIN: UpdateOp
SCATTER_MAX: UpdateOp
SPARSE_APPLY_GRADIENT: UpdateOp
FAIL: IfExists
KEEP: IfExists
REPLACE: IfExists
REPLICA_UPDATE: ReplicaKind
REPLICA_INSTALL: ReplicaKind
REPLICA_DELETE: ReplicaKind
REPLICA_DYNAMIC: ReplicaKind
SYNC_STATUS: SyncStepsKind
SYNC_CONFIGURE: SyncStepsKind
SYNC_COMMIT: SyncStepsKind
SYNC_FENCE: SyncStepsKind
SYNC_DROP: SyncStepsKind
SYNC_JOIN: SyncStepsKind
SYNC_SKIP: SyncStepsKind

class RawFrame(_message.Message):
    __slots__ = ("data",)
    DATA_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    def __init__(self, data: _Optional[bytes] = ...) -> None: ...

class PullEntry(_message.Message):
    __slots__ = ("name", "known_version", "indices", "has_indices", "as_dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KNOWN_VERSION_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    HAS_INDICES_FIELD_NUMBER: _ClassVar[int]
    AS_DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    known_version: int
    indices: _common_pb2.Tensor
    has_indices: bool
    as_dtype: _common_pb2.DType
    def __init__(self, name: _Optional[str] = ..., known_version: _Optional[int] = ..., indices: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., has_indices: _Optional[bool] = ..., as_dtype: _Optional[_Union[_common_pb2.DType, str]] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("entries", "contributor", "barrier_wait_ms")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTOR_FIELD_NUMBER: _ClassVar[int]
    BARRIER_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[PullEntry]
    contributor: int
    barrier_wait_ms: int
    def __init__(self, entries: _Optional[_Iterable[_Union[PullEntry, _Mapping]]] = ..., contributor: _Optional[int] = ..., barrier_wait_ms: _Optional[int] = ...) -> None: ...

class PulledTensor(_message.Message):
    __slots__ = ("spec", "version", "not_modified")
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NOT_MODIFIED_FIELD_NUMBER: _ClassVar[int]
    spec: _common_pb2.TensorSpec
    version: int
    not_modified: bool
    def __init__(self, spec: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., version: _Optional[int] = ..., not_modified: _Optional[bool] = ...) -> None: ...

class PullHeader(_message.Message):
    __slots__ = ("entries", "barrier_waiting", "synchronous", "step", "push", "has_push")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BARRIER_WAITING_FIELD_NUMBER: _ClassVar[int]
    SYNCHRONOUS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    HAS_PUSH_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[PulledTensor]
    barrier_waiting: bool
    synchronous: bool
    step: int
    push: PushResponse
    has_push: bool
    def __init__(self, entries: _Optional[_Iterable[_Union[PulledTensor, _Mapping]]] = ..., barrier_waiting: _Optional[bool] = ..., synchronous: _Optional[bool] = ..., step: _Optional[int] = ..., push: _Optional[_Union[PushResponse, _Mapping]] = ..., has_push: _Optional[bool] = ...) -> None: ...

class UpdateEntry(_message.Message):
    __slots__ = ("name", "op", "value", "has_value", "indices", "has_indices", "create_spec", "optimizer", "optimizer_digest", "initializer", "if_exists", "offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    HAS_VALUE_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    HAS_INDICES_FIELD_NUMBER: _ClassVar[int]
    CREATE_SPEC_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    INITIALIZER_FIELD_NUMBER: _ClassVar[int]
    IF_EXISTS_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    op: UpdateOp
    value: _common_pb2.TensorSpec
    has_value: bool
    indices: _common_pb2.TensorSpec
    has_indices: bool
    create_spec: _common_pb2.TensorSpec
    optimizer: bytes
    optimizer_digest: str
    initializer: bytes
    if_exists: IfExists
    offset: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., op: _Optional[_Union[UpdateOp, str]] = ..., value: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., has_value: _Optional[bool] = ..., indices: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., has_indices: _Optional[bool] = ..., create_spec: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., optimizer: _Optional[bytes] = ..., optimizer_digest: _Optional[str] = ..., initializer: _Optional[bytes] = ..., if_exists: _Optional[_Union[IfExists, str]] = ..., offset: _Optional[_Iterable[int]] = ...) -> None: ...

class PushHeader(_message.Message):
    __slots__ = ("entries", "update_id", "contributor", "commit", "step", "pull_after")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTOR_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PULL_AFTER_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[UpdateEntry]
    update_id: str
    contributor: int
    commit: bool
    step: int
    pull_after: _containers.RepeatedCompositeFieldContainer[PullEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[UpdateEntry, _Mapping]]] = ..., update_id: _Optional[str] = ..., contributor: _Optional[int] = ..., commit: _Optional[bool] = ..., step: _Optional[int] = ..., pull_after: _Optional[_Iterable[_Union[PullEntry, _Mapping]]] = ...) -> None: ...

class PushResponse(_message.Message):
    __slots__ = ("versions", "duplicate", "staged", "step")
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    STAGED_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    duplicate: bool
    staged: bool
    step: int
    def __init__(self, versions: _Optional[_Iterable[int]] = ..., duplicate: _Optional[bool] = ..., staged: _Optional[bool] = ..., step: _Optional[int] = ...) -> None: ...

class VariableInfo(_message.Message):
    __slots__ = ("name", "spec", "version", "has_optimizer")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    HAS_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: _common_pb2.TensorSpec
    version: int
    has_optimizer: bool
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., version: _Optional[int] = ..., has_optimizer: _Optional[bool] = ...) -> None: ...

class ListVariablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListVariablesResponse(_message.Message):
    __slots__ = ("variables",)
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    variables: _containers.RepeatedCompositeFieldContainer[VariableInfo]
    def __init__(self, variables: _Optional[_Iterable[_Union[VariableInfo, _Mapping]]] = ...) -> None: ...

class DeleteVariablesRequest(_message.Message):
    __slots__ = ("names",)
    NAMES_FIELD_NUMBER: _ClassVar[int]
    names: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, names: _Optional[_Iterable[str]] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("directory", "file_name")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    directory: str
    file_name: str
    def __init__(self, directory: _Optional[str] = ..., file_name: _Optional[str] = ...) -> None: ...

class SavedVariable(_message.Message):
    __slots__ = ("name", "spec", "version", "optimizer_leaves")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_LEAVES_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: _common_pb2.TensorSpec
    version: int
    optimizer_leaves: int
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., version: _Optional[int] = ..., optimizer_leaves: _Optional[int] = ...) -> None: ...

class SaveResponse(_message.Message):
    __slots__ = ("file_name", "sha256", "bytes", "variables", "dynamic_tables")
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_TABLES_FIELD_NUMBER: _ClassVar[int]
    file_name: str
    sha256: str
    bytes: int
    variables: _containers.RepeatedCompositeFieldContainer[SavedVariable]
    dynamic_tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, file_name: _Optional[str] = ..., sha256: _Optional[str] = ..., bytes: _Optional[int] = ..., variables: _Optional[_Iterable[_Union[SavedVariable, _Mapping]]] = ..., dynamic_tables: _Optional[_Iterable[str]] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("file", "source", "src_start", "src_stop", "dst_start", "sha256")
    FILE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SRC_START_FIELD_NUMBER: _ClassVar[int]
    SRC_STOP_FIELD_NUMBER: _ClassVar[int]
    DST_START_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    file: str
    source: str
    src_start: int
    src_stop: int
    dst_start: int
    sha256: str
    def __init__(self, file: _Optional[str] = ..., source: _Optional[str] = ..., src_start: _Optional[int] = ..., src_stop: _Optional[int] = ..., dst_start: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class RestoreEntry(_message.Message):
    __slots__ = ("name", "spec", "optimizer", "optimizer_digest", "pieces", "with_optimizer_state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: _common_pb2.TensorSpec
    optimizer: bytes
    optimizer_digest: str
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    with_optimizer_state: bool
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., optimizer: _Optional[bytes] = ..., optimizer_digest: _Optional[str] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ..., with_optimizer_state: _Optional[bool] = ...) -> None: ...

class RestoreRequest(_message.Message):
    __slots__ = ("directory", "entries", "dynamic")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_FIELD_NUMBER: _ClassVar[int]
    directory: str
    entries: _containers.RepeatedCompositeFieldContainer[RestoreEntry]
    dynamic: _containers.RepeatedCompositeFieldContainer[DynamicRestoreEntry]
    def __init__(self, directory: _Optional[str] = ..., entries: _Optional[_Iterable[_Union[RestoreEntry, _Mapping]]] = ..., dynamic: _Optional[_Iterable[_Union[DynamicRestoreEntry, _Mapping]]] = ...) -> None: ...

class SavedFile(_message.Message):
    __slots__ = ("file", "sha256")
    FILE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    file: str
    sha256: str
    def __init__(self, file: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class DynamicRestoreEntry(_message.Message):
    __slots__ = ("config_json", "shard", "num_shards", "files")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    shard: int
    num_shards: int
    files: _containers.RepeatedCompositeFieldContainer[SavedFile]
    def __init__(self, config_json: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., files: _Optional[_Iterable[_Union[SavedFile, _Mapping]]] = ...) -> None: ...

class RestoreResponse(_message.Message):
    __slots__ = ("restored",)
    RESTORED_FIELD_NUMBER: _ClassVar[int]
    restored: int
    def __init__(self, restored: _Optional[int] = ...) -> None: ...

class ExportVariable(_message.Message):
    __slots__ = ("name", "row_offset")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ROW_OFFSET_FIELD_NUMBER: _ClassVar[int]
    name: str
    row_offset: int
    def __init__(self, name: _Optional[str] = ..., row_offset: _Optional[int] = ...) -> None: ...

class ExportRequest(_message.Message):
    __slots__ = ("directory", "file_name", "variables", "delta", "base_generation", "base_cut")
    DIRECTORY_FIELD_NUMBER: _ClassVar[int]
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    BASE_GENERATION_FIELD_NUMBER: _ClassVar[int]
    BASE_CUT_FIELD_NUMBER: _ClassVar[int]
    directory: str
    file_name: str
    variables: _containers.RepeatedCompositeFieldContainer[ExportVariable]
    delta: bool
    base_generation: str
    base_cut: int
    def __init__(self, directory: _Optional[str] = ..., file_name: _Optional[str] = ..., variables: _Optional[_Iterable[_Union[ExportVariable, _Mapping]]] = ..., delta: _Optional[bool] = ..., base_generation: _Optional[str] = ..., base_cut: _Optional[int] = ...) -> None: ...

class ExportedVariable(_message.Message):
    __slots__ = ("name", "spec", "whole", "rows")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    WHOLE_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    name: str
    spec: _common_pb2.TensorSpec
    whole: bool
    rows: int
    def __init__(self, name: _Optional[str] = ..., spec: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., whole: _Optional[bool] = ..., rows: _Optional[int] = ...) -> None: ...

class ExportResponse(_message.Message):
    __slots__ = ("file_name", "sha256", "bytes", "variables", "generation", "cut", "delta_unavailable", "tables", "whole_tables")
    FILE_NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CUT_FIELD_NUMBER: _ClassVar[int]
    DELTA_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    TABLES_FIELD_NUMBER: _ClassVar[int]
    WHOLE_TABLES_FIELD_NUMBER: _ClassVar[int]
    file_name: str
    sha256: str
    bytes: int
    variables: _containers.RepeatedCompositeFieldContainer[ExportedVariable]
    generation: str
    cut: int
    delta_unavailable: bool
    tables: _containers.RepeatedScalarFieldContainer[str]
    whole_tables: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, file_name: _Optional[str] = ..., sha256: _Optional[str] = ..., bytes: _Optional[int] = ..., variables: _Optional[_Iterable[_Union[ExportedVariable, _Mapping]]] = ..., generation: _Optional[str] = ..., cut: _Optional[int] = ..., delta_unavailable: _Optional[bool] = ..., tables: _Optional[_Iterable[str]] = ..., whole_tables: _Optional[_Iterable[str]] = ...) -> None: ...

class InstallEntry(_message.Message):
    __slots__ = ("name", "value", "version", "optimizer", "optimizer_digest", "state")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_DIGEST_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: _common_pb2.TensorSpec
    version: int
    optimizer: bytes
    optimizer_digest: str
    state: _containers.RepeatedCompositeFieldContainer[_common_pb2.TensorSpec]
    def __init__(self, name: _Optional[str] = ..., value: _Optional[_Union[_common_pb2.TensorSpec, _Mapping]] = ..., version: _Optional[int] = ..., optimizer: _Optional[bytes] = ..., optimizer_digest: _Optional[str] = ..., state: _Optional[_Iterable[_Union[_common_pb2.TensorSpec, _Mapping]]] = ...) -> None: ...

class ReplicaHeader(_message.Message):
    __slots__ = ("epoch", "kind", "push", "installs", "deletes", "full_sync", "applied_ids", "dynamic_create", "dynamic_push", "dynamic_installs")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    PUSH_FIELD_NUMBER: _ClassVar[int]
    INSTALLS_FIELD_NUMBER: _ClassVar[int]
    DELETES_FIELD_NUMBER: _ClassVar[int]
    FULL_SYNC_FIELD_NUMBER: _ClassVar[int]
    APPLIED_IDS_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_CREATE_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_PUSH_FIELD_NUMBER: _ClassVar[int]
    DYNAMIC_INSTALLS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    kind: ReplicaKind
    push: PushHeader
    installs: _containers.RepeatedCompositeFieldContainer[InstallEntry]
    deletes: _containers.RepeatedScalarFieldContainer[str]
    full_sync: bool
    applied_ids: _containers.RepeatedScalarFieldContainer[str]
    dynamic_create: CreateDynamicTableRequest
    dynamic_push: DynamicPushRequest
    dynamic_installs: _containers.RepeatedCompositeFieldContainer[DynamicInstall]
    def __init__(self, epoch: _Optional[int] = ..., kind: _Optional[_Union[ReplicaKind, str]] = ..., push: _Optional[_Union[PushHeader, _Mapping]] = ..., installs: _Optional[_Iterable[_Union[InstallEntry, _Mapping]]] = ..., deletes: _Optional[_Iterable[str]] = ..., full_sync: _Optional[bool] = ..., applied_ids: _Optional[_Iterable[str]] = ..., dynamic_create: _Optional[_Union[CreateDynamicTableRequest, _Mapping]] = ..., dynamic_push: _Optional[_Union[DynamicPushRequest, _Mapping]] = ..., dynamic_installs: _Optional[_Iterable[_Union[DynamicInstall, _Mapping]]] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: _common_pb2.Tensor
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DynamicInstall(_message.Message):
    __slots__ = ("config_json", "shard", "num_shards", "arrays")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    shard: int
    num_shards: int
    arrays: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    def __init__(self, config_json: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ..., arrays: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ...) -> None: ...

class SetBackupRequest(_message.Message):
    __slots__ = ("address", "epoch")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    address: str
    epoch: int
    def __init__(self, address: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class SetBackupResponse(_message.Message):
    __slots__ = ("variables", "bytes")
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    variables: int
    bytes: int
    def __init__(self, variables: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class PromoteRequest(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class PromoteResponse(_message.Message):
    __slots__ = ("epoch", "variables")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VARIABLES_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    variables: int
    def __init__(self, epoch: _Optional[int] = ..., variables: _Optional[int] = ...) -> None: ...

class SyncStepsRequest(_message.Message):
    __slots__ = ("kind", "contributor", "staleness", "members", "step")
    KIND_FIELD_NUMBER: _ClassVar[int]
    CONTRIBUTOR_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    kind: SyncStepsKind
    contributor: int
    staleness: int
    members: _containers.RepeatedScalarFieldContainer[int]
    step: int
    def __init__(self, kind: _Optional[_Union[SyncStepsKind, str]] = ..., contributor: _Optional[int] = ..., staleness: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., step: _Optional[int] = ...) -> None: ...

class SyncStepsResponse(_message.Message):
    __slots__ = ("enabled", "staleness", "applied", "members", "clocks", "waiting", "staged_steps", "max_lead", "uncommitted")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    CLOCKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    STAGED_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_LEAD_FIELD_NUMBER: _ClassVar[int]
    UNCOMMITTED_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    staleness: int
    applied: int
    members: _containers.RepeatedScalarFieldContainer[int]
    clocks: _containers.RepeatedScalarFieldContainer[int]
    waiting: _containers.RepeatedScalarFieldContainer[int]
    staged_steps: _containers.RepeatedScalarFieldContainer[int]
    max_lead: int
    uncommitted: int
    def __init__(self, enabled: _Optional[bool] = ..., staleness: _Optional[int] = ..., applied: _Optional[int] = ..., members: _Optional[_Iterable[int]] = ..., clocks: _Optional[_Iterable[int]] = ..., waiting: _Optional[_Iterable[int]] = ..., staged_steps: _Optional[_Iterable[int]] = ..., max_lead: _Optional[int] = ..., uncommitted: _Optional[int] = ...) -> None: ...

class BeginRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class BeginRunResponse(_message.Message):
    __slots__ = ("previous_run_id",)
    PREVIOUS_RUN_ID_FIELD_NUMBER: _ClassVar[int]
    previous_run_id: str
    def __init__(self, previous_run_id: _Optional[str] = ...) -> None: ...

class DynamicKeys(_message.Message):
    __slots__ = ("ids", "strings", "is_string")
    IDS_FIELD_NUMBER: _ClassVar[int]
    STRINGS_FIELD_NUMBER: _ClassVar[int]
    IS_STRING_FIELD_NUMBER: _ClassVar[int]
    ids: _common_pb2.Tensor
    strings: _containers.RepeatedScalarFieldContainer[str]
    is_string: bool
    def __init__(self, ids: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., strings: _Optional[_Iterable[str]] = ..., is_string: _Optional[bool] = ...) -> None: ...

class CreateDynamicTableRequest(_message.Message):
    __slots__ = ("config_json", "shard", "num_shards")
    CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    SHARD_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    config_json: str
    shard: int
    num_shards: int
    def __init__(self, config_json: _Optional[str] = ..., shard: _Optional[int] = ..., num_shards: _Optional[int] = ...) -> None: ...

class CreateDynamicTableResponse(_message.Message):
    __slots__ = ("created",)
    CREATED_FIELD_NUMBER: _ClassVar[int]
    created: bool
    def __init__(self, created: _Optional[bool] = ...) -> None: ...

class DynamicLookupRequest(_message.Message):
    __slots__ = ("table", "keys")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: DynamicKeys
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Union[DynamicKeys, _Mapping]] = ...) -> None: ...

class DynamicLookupResponse(_message.Message):
    __slots__ = ("rows", "admitted")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ADMITTED_FIELD_NUMBER: _ClassVar[int]
    rows: _common_pb2.Tensor
    admitted: _common_pb2.Tensor
    def __init__(self, rows: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., admitted: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ...) -> None: ...

class DynamicPushRequest(_message.Message):
    __slots__ = ("table", "keys", "grads", "update_id", "counts")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    GRADS_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    table: str
    keys: DynamicKeys
    grads: _common_pb2.Tensor
    update_id: str
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, table: _Optional[str] = ..., keys: _Optional[_Union[DynamicKeys, _Mapping]] = ..., grads: _Optional[_Union[_common_pb2.Tensor, _Mapping]] = ..., update_id: _Optional[str] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...

class DynamicPushResponse(_message.Message):
    __slots__ = ("duplicate", "applied", "refused", "inserted", "evicted")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    INSERTED_FIELD_NUMBER: _ClassVar[int]
    EVICTED_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    applied: int
    refused: int
    inserted: int
    evicted: int
    def __init__(self, duplicate: _Optional[bool] = ..., applied: _Optional[int] = ..., refused: _Optional[int] = ..., inserted: _Optional[int] = ..., evicted: _Optional[int] = ...) -> None: ...
