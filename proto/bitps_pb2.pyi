from google.protobuf import any_pb2 as _any_pb2
from google.protobuf import struct_pb2 as _struct_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ProtocolVersion(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PROTOCOL_VERSION_UNSPECIFIED: _ClassVar[ProtocolVersion]
    PROTOCOL_VERSION_CURRENT: _ClassVar[ProtocolVersion]

class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_UNSPECIFIED: _ClassVar[Op]
    PUSH: _ClassVar[Op]
    PULL: _ClassVar[Op]
    PUSH_PULL: _ClassVar[Op]
    REPLY: _ClassVar[Op]
    ERROR: _ClassVar[Op]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_RAW: _ClassVar[Codec]
    CODEC_BF16: _ClassVar[Codec]
    CODEC_FP16: _ClassVar[Codec]
    CODEC_SIGN1: _ClassVar[Codec]
    CODEC_SPARSE: _ClassVar[Codec]

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]

class ErrorCode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OK: _ClassVar[ErrorCode]
    BAD_HEADER: _ClassVar[ErrorCode]
    UNKNOWN_OP: _ClassVar[ErrorCode]
    UNKNOWN_KEY: _ClassVar[ErrorCode]
    BAD_LENGTH: _ClassVar[ErrorCode]
    BAD_DTYPE: _ClassVar[ErrorCode]
    NOT_REGISTERED: _ClassVar[ErrorCode]
    NOT_INITIALIZED: _ClassVar[ErrorCode]
    BAD_CLOCK: _ClassVar[ErrorCode]
    FRAME_COUNT: _ClassVar[ErrorCode]
    DEADLINE: _ClassVar[ErrorCode]
    NON_FINITE: _ClassVar[ErrorCode]
    PROTOCOL: _ClassVar[ErrorCode]
    UNAUTHENTICATED: _ClassVar[ErrorCode]
    TOO_LARGE: _ClassVar[ErrorCode]
    LIMIT: _ClassVar[ErrorCode]
    SHUTTING_DOWN: _ClassVar[ErrorCode]
    BAD_HYPERPARAMETERS: _ClassVar[ErrorCode]
PROTOCOL_VERSION_UNSPECIFIED: ProtocolVersion
PROTOCOL_VERSION_CURRENT: ProtocolVersion
OP_UNSPECIFIED: Op
PUSH: Op
PULL: Op
PUSH_PULL: Op
REPLY: Op
ERROR: Op
CODEC_RAW: Codec
CODEC_BF16: Codec
CODEC_FP16: Codec
CODEC_SIGN1: Codec
CODEC_SPARSE: Codec
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
BFLOAT16: DType
FLOAT16: DType
OK: ErrorCode
BAD_HEADER: ErrorCode
UNKNOWN_OP: ErrorCode
UNKNOWN_KEY: ErrorCode
BAD_LENGTH: ErrorCode
BAD_DTYPE: ErrorCode
NOT_REGISTERED: ErrorCode
NOT_INITIALIZED: ErrorCode
BAD_CLOCK: ErrorCode
FRAME_COUNT: ErrorCode
DEADLINE: ErrorCode
NON_FINITE: ErrorCode
PROTOCOL: ErrorCode
UNAUTHENTICATED: ErrorCode
TOO_LARGE: ErrorCode
LIMIT: ErrorCode
SHUTTING_DOWN: ErrorCode
BAD_HYPERPARAMETERS: ErrorCode

class KeySpec(_message.Message):
    __slots__ = ("key", "name", "offset", "length", "dtype", "compressed_pull", "shape")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COMPRESSED_PULL_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    key: int
    name: str
    offset: int
    length: int
    dtype: DType
    compressed_pull: bool
    shape: TensorShape
    def __init__(self, key: _Optional[int] = ..., name: _Optional[str] = ..., offset: _Optional[int] = ..., length: _Optional[int] = ..., dtype: _Optional[_Union[DType, str]] = ..., compressed_pull: _Optional[bool] = ..., shape: _Optional[_Union[TensorShape, _Mapping]] = ...) -> None: ...

class TensorShape(_message.Message):
    __slots__ = ("dims",)
    DIMS_FIELD_NUMBER: _ClassVar[int]
    dims: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dims: _Optional[_Iterable[int]] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("protocol", "rank", "world_size", "signature", "num_shards", "shard_id", "keys", "sends_values", "token", "pull_codec", "pull_codec_chunk", "pull_codec_flags", "value_digests", "model_keys")
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    SENDS_VALUES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PULL_CODEC_FIELD_NUMBER: _ClassVar[int]
    PULL_CODEC_CHUNK_FIELD_NUMBER: _ClassVar[int]
    PULL_CODEC_FLAGS_FIELD_NUMBER: _ClassVar[int]
    VALUE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    MODEL_KEYS_FIELD_NUMBER: _ClassVar[int]
    protocol: int
    rank: int
    world_size: int
    signature: str
    num_shards: int
    shard_id: int
    keys: _containers.RepeatedCompositeFieldContainer[KeySpec]
    sends_values: bool
    token: str
    pull_codec: Codec
    pull_codec_chunk: int
    pull_codec_flags: int
    value_digests: _containers.RepeatedScalarFieldContainer[bytes]
    model_keys: int
    def __init__(self, protocol: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., signature: _Optional[str] = ..., num_shards: _Optional[int] = ..., shard_id: _Optional[int] = ..., keys: _Optional[_Iterable[_Union[KeySpec, _Mapping]]] = ..., sends_values: _Optional[bool] = ..., token: _Optional[str] = ..., pull_codec: _Optional[_Union[Codec, str]] = ..., pull_codec_chunk: _Optional[int] = ..., pull_codec_flags: _Optional[int] = ..., value_digests: _Optional[_Iterable[bytes]] = ..., model_keys: _Optional[int] = ...) -> None: ...

class KeyValues(_message.Message):
    __slots__ = ("key", "data")
    KEY_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    key: int
    data: bytes
    def __init__(self, key: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class RegisterMessage(_message.Message):
    __slots__ = ("request", "values")
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    request: RegisterRequest
    values: KeyValues
    def __init__(self, request: _Optional[_Union[RegisterRequest, _Mapping]] = ..., values: _Optional[_Union[KeyValues, _Mapping]] = ...) -> None: ...

class RegisterReply(_message.Message):
    __slots__ = ("shard_id", "num_shards", "data_port", "metrics_port", "mode", "staleness", "start_clock", "max_frame_bytes", "holds_pulls", "current_keys", "current_versions", "rule", "rule_params", "worker_lookahead", "step", "incarnation")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DATA_PORT_FIELD_NUMBER: _ClassVar[int]
    METRICS_PORT_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    START_CLOCK_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAME_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOLDS_PULLS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_KEYS_FIELD_NUMBER: _ClassVar[int]
    CURRENT_VERSIONS_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    RULE_PARAMS_FIELD_NUMBER: _ClassVar[int]
    WORKER_LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    num_shards: int
    data_port: int
    metrics_port: int
    mode: str
    staleness: int
    start_clock: int
    max_frame_bytes: int
    holds_pulls: bool
    current_keys: _containers.RepeatedScalarFieldContainer[int]
    current_versions: _containers.RepeatedScalarFieldContainer[int]
    rule: str
    rule_params: _any_pb2.Any
    worker_lookahead: bool
    step: int
    incarnation: int
    def __init__(self, shard_id: _Optional[int] = ..., num_shards: _Optional[int] = ..., data_port: _Optional[int] = ..., metrics_port: _Optional[int] = ..., mode: _Optional[str] = ..., staleness: _Optional[int] = ..., start_clock: _Optional[int] = ..., max_frame_bytes: _Optional[int] = ..., holds_pulls: _Optional[bool] = ..., current_keys: _Optional[_Iterable[int]] = ..., current_versions: _Optional[_Iterable[int]] = ..., rule: _Optional[str] = ..., rule_params: _Optional[_Union[_any_pb2.Any, _Mapping]] = ..., worker_lookahead: _Optional[bool] = ..., step: _Optional[int] = ..., incarnation: _Optional[int] = ...) -> None: ...

class RuleStateRequest(_message.Message):
    __slots__ = ("rank", "token")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    rank: int
    token: str
    def __init__(self, rank: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class StateArray(_message.Message):
    __slots__ = ("name", "dtype", "codec", "codec_chunk", "codec_flags", "length", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CODEC_FLAGS_FIELD_NUMBER: _ClassVar[int]
    LENGTH_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: DType
    codec: Codec
    codec_chunk: int
    codec_flags: int
    length: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., codec_chunk: _Optional[int] = ..., codec_flags: _Optional[int] = ..., length: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class KeyRuleState(_message.Message):
    __slots__ = ("key", "version", "arrays", "fields")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ARRAYS_FIELD_NUMBER: _ClassVar[int]
    FIELDS_FIELD_NUMBER: _ClassVar[int]
    key: int
    version: int
    arrays: _containers.RepeatedCompositeFieldContainer[StateArray]
    fields: _struct_pb2.Struct
    def __init__(self, key: _Optional[int] = ..., version: _Optional[int] = ..., arrays: _Optional[_Iterable[_Union[StateArray, _Mapping]]] = ..., fields: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("rank", "clock", "token", "steps_per_s", "samples_per_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    clock: int
    token: str
    steps_per_s: float
    samples_per_s: float
    def __init__(self, rank: _Optional[int] = ..., clock: _Optional[int] = ..., token: _Optional[str] = ..., steps_per_s: _Optional[float] = ..., samples_per_s: _Optional[float] = ...) -> None: ...

class HeartbeatReply(_message.Message):
    __slots__ = ("min_clock", "live", "max_steps_per_s", "incarnation", "samples_per_s")
    class SamplesPerSEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    min_clock: int
    live: _containers.RepeatedScalarFieldContainer[int]
    max_steps_per_s: float
    incarnation: int
    samples_per_s: _containers.ScalarMap[int, float]
    def __init__(self, min_clock: _Optional[int] = ..., live: _Optional[_Iterable[int]] = ..., max_steps_per_s: _Optional[float] = ..., incarnation: _Optional[int] = ..., samples_per_s: _Optional[_Mapping[int, float]] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("token",)
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    token: str
    def __init__(self, token: _Optional[str] = ...) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "clock", "live", "seconds_since_seen", "pending_pulls", "waiting_for", "registered", "left", "dropped", "clock_lead", "clock_lag", "held", "steps_per_s", "samples_per_s")
    RANK_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_SINCE_SEEN_FIELD_NUMBER: _ClassVar[int]
    PENDING_PULLS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_FIELD_NUMBER: _ClassVar[int]
    LEFT_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CLOCK_LEAD_FIELD_NUMBER: _ClassVar[int]
    CLOCK_LAG_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_PER_S_FIELD_NUMBER: _ClassVar[int]
    rank: int
    clock: int
    live: bool
    seconds_since_seen: float
    pending_pulls: int
    waiting_for: str
    registered: bool
    left: bool
    dropped: bool
    clock_lead: int
    clock_lag: int
    held: _containers.RepeatedCompositeFieldContainer[HeldPullStatus]
    steps_per_s: float
    samples_per_s: float
    def __init__(self, rank: _Optional[int] = ..., clock: _Optional[int] = ..., live: _Optional[bool] = ..., seconds_since_seen: _Optional[float] = ..., pending_pulls: _Optional[int] = ..., waiting_for: _Optional[str] = ..., registered: _Optional[bool] = ..., left: _Optional[bool] = ..., dropped: _Optional[bool] = ..., clock_lead: _Optional[int] = ..., clock_lag: _Optional[int] = ..., held: _Optional[_Iterable[_Union[HeldPullStatus, _Mapping]]] = ..., steps_per_s: _Optional[float] = ..., samples_per_s: _Optional[float] = ...) -> None: ...

class HeldPullStatus(_message.Message):
    __slots__ = ("clock", "waited_s", "deadline_in_s", "num_keys", "waiting_for", "reason")
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    WAITED_S_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_IN_S_FIELD_NUMBER: _ClassVar[int]
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    WAITING_FOR_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    clock: int
    waited_s: float
    deadline_in_s: float
    num_keys: int
    waiting_for: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    def __init__(self, clock: _Optional[int] = ..., waited_s: _Optional[float] = ..., deadline_in_s: _Optional[float] = ..., num_keys: _Optional[int] = ..., waiting_for: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ...) -> None: ...

class StatusReply(_message.Message):
    __slots__ = ("shard_id", "mode", "staleness", "min_clock", "workers", "num_keys", "num_elements", "updates_applied", "initialized", "signature", "max_clock", "world_size", "heartbeat_timeout_s", "held_pulls", "held_shown", "uninitialized_keys")
    SHARD_ID_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KEYS_FIELD_NUMBER: _ClassVar[int]
    NUM_ELEMENTS_FIELD_NUMBER: _ClassVar[int]
    UPDATES_APPLIED_FIELD_NUMBER: _ClassVar[int]
    INITIALIZED_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    MAX_CLOCK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    HELD_PULLS_FIELD_NUMBER: _ClassVar[int]
    HELD_SHOWN_FIELD_NUMBER: _ClassVar[int]
    UNINITIALIZED_KEYS_FIELD_NUMBER: _ClassVar[int]
    shard_id: int
    mode: str
    staleness: int
    min_clock: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    num_keys: int
    num_elements: int
    updates_applied: int
    initialized: bool
    signature: str
    max_clock: int
    world_size: int
    heartbeat_timeout_s: float
    held_pulls: int
    held_shown: int
    uninitialized_keys: int
    def __init__(self, shard_id: _Optional[int] = ..., mode: _Optional[str] = ..., staleness: _Optional[int] = ..., min_clock: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., num_keys: _Optional[int] = ..., num_elements: _Optional[int] = ..., updates_applied: _Optional[int] = ..., initialized: _Optional[bool] = ..., signature: _Optional[str] = ..., max_clock: _Optional[int] = ..., world_size: _Optional[int] = ..., heartbeat_timeout_s: _Optional[float] = ..., held_pulls: _Optional[int] = ..., held_shown: _Optional[int] = ..., uninitialized_keys: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("rank", "token")
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    rank: int
    token: str
    def __init__(self, rank: _Optional[int] = ..., token: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DataHeader(_message.Message):
    __slots__ = ("op", "protocol", "worker", "request_id", "clock", "keys", "versions", "dtype", "codec", "error", "message", "deadline_s", "token", "min_clock", "codec_chunk", "codec_flags", "frame_codecs", "pad", "incarnation", "lr", "weight_decay", "shard_incarnation")
    OP_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CLOCK_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    MIN_CLOCK_FIELD_NUMBER: _ClassVar[int]
    CODEC_CHUNK_FIELD_NUMBER: _ClassVar[int]
    CODEC_FLAGS_FIELD_NUMBER: _ClassVar[int]
    FRAME_CODECS_FIELD_NUMBER: _ClassVar[int]
    PAD_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    SHARD_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    op: Op
    protocol: int
    worker: int
    request_id: int
    clock: int
    keys: _containers.RepeatedScalarFieldContainer[int]
    versions: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    codec: Codec
    error: ErrorCode
    message: str
    deadline_s: float
    token: str
    min_clock: int
    codec_chunk: int
    codec_flags: int
    frame_codecs: _containers.RepeatedScalarFieldContainer[Codec]
    pad: bytes
    incarnation: int
    lr: _containers.RepeatedScalarFieldContainer[float]
    weight_decay: _containers.RepeatedScalarFieldContainer[float]
    shard_incarnation: int
    def __init__(self, op: _Optional[_Union[Op, str]] = ..., protocol: _Optional[int] = ..., worker: _Optional[int] = ..., request_id: _Optional[int] = ..., clock: _Optional[int] = ..., keys: _Optional[_Iterable[int]] = ..., versions: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec: _Optional[_Union[Codec, str]] = ..., error: _Optional[_Union[ErrorCode, str]] = ..., message: _Optional[str] = ..., deadline_s: _Optional[float] = ..., token: _Optional[str] = ..., min_clock: _Optional[int] = ..., codec_chunk: _Optional[int] = ..., codec_flags: _Optional[int] = ..., frame_codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., pad: _Optional[bytes] = ..., incarnation: _Optional[int] = ..., lr: _Optional[_Iterable[float]] = ..., weight_decay: _Optional[_Iterable[float]] = ..., shard_incarnation: _Optional[int] = ...) -> None: ...
