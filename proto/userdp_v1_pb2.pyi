from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorChunk(_message.Message):
    __slots__ = ("name", "dtype", "shape", "total_bytes", "offset", "data")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    total_bytes: int
    offset: int
    data: bytes
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., total_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class ShardHolding(_message.Message):
    __slots__ = ("name", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    sha256: str
    def __init__(self, name: _Optional[str] = ..., sha256: _Optional[str] = ...) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("device", "num_devices", "engines", "max_message_bytes", "userdp_version", "collective_plane")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    ENGINES_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    USERDP_VERSION_FIELD_NUMBER: _ClassVar[int]
    COLLECTIVE_PLANE_FIELD_NUMBER: _ClassVar[int]
    device: str
    num_devices: int
    engines: _containers.RepeatedScalarFieldContainer[str]
    max_message_bytes: int
    userdp_version: str
    collective_plane: bool
    def __init__(self, device: _Optional[str] = ..., num_devices: _Optional[int] = ..., engines: _Optional[_Iterable[str]] = ..., max_message_bytes: _Optional[int] = ..., userdp_version: _Optional[str] = ..., collective_plane: _Optional[bool] = ...) -> None: ...

class Register(_message.Message):
    __slots__ = ("worker_id", "protocol_version", "shards", "capabilities", "model_version", "shard_manifest_sha256", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    CAPABILITIES_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHARD_MANIFEST_SHA256_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    protocol_version: int
    shards: _containers.RepeatedCompositeFieldContainer[ShardHolding]
    capabilities: Capabilities
    model_version: int
    shard_manifest_sha256: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., protocol_version: _Optional[int] = ..., shards: _Optional[_Iterable[_Union[ShardHolding, _Mapping]]] = ..., capabilities: _Optional[_Union[Capabilities, _Mapping]] = ..., model_version: _Optional[int] = ..., shard_manifest_sha256: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class StartupReport(_message.Message):
    __slots__ = ("worker_id", "phase", "phase_seconds", "shards")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    PHASE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    phase: str
    phase_seconds: float
    shards: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, worker_id: _Optional[str] = ..., phase: _Optional[str] = ..., phase_seconds: _Optional[float] = ..., shards: _Optional[_Iterable[str]] = ...) -> None: ...

class StartupAck(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("model_version", "running_task_ids")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RUNNING_TASK_IDS_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    running_task_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_version: _Optional[int] = ..., running_task_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class ResultPart(_message.Message):
    __slots__ = ("task_id", "attempt", "chunk")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    chunk: TensorChunk
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class NormStats(_message.Message):
    __slots__ = ("min", "max", "sum", "sum_sq")
    MIN_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    SUM_FIELD_NUMBER: _ClassVar[int]
    SUM_SQ_FIELD_NUMBER: _ClassVar[int]
    min: float
    max: float
    sum: float
    sum_sq: float
    def __init__(self, min: _Optional[float] = ..., max: _Optional[float] = ..., sum: _Optional[float] = ..., sum_sq: _Optional[float] = ...) -> None: ...

class Result(_message.Message):
    __slots__ = ("task_id", "attempt", "step", "model_version", "num_tensors", "count", "nonfinite", "clipped", "norms", "loss_sum", "tokens", "compute_seconds", "unit_ids", "held")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    NONFINITE_FIELD_NUMBER: _ClassVar[int]
    CLIPPED_FIELD_NUMBER: _ClassVar[int]
    NORMS_FIELD_NUMBER: _ClassVar[int]
    LOSS_SUM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UNIT_IDS_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    step: int
    model_version: int
    num_tensors: int
    count: int
    nonfinite: int
    clipped: int
    norms: NormStats
    loss_sum: float
    tokens: int
    compute_seconds: float
    unit_ids: _containers.RepeatedScalarFieldContainer[str]
    held: bool
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ..., model_version: _Optional[int] = ..., num_tensors: _Optional[int] = ..., count: _Optional[int] = ..., nonfinite: _Optional[int] = ..., clipped: _Optional[int] = ..., norms: _Optional[_Union[NormStats, _Mapping]] = ..., loss_sum: _Optional[float] = ..., tokens: _Optional[int] = ..., compute_seconds: _Optional[float] = ..., unit_ids: _Optional[_Iterable[str]] = ..., held: _Optional[bool] = ...) -> None: ...

class TaskFailed(_message.Message):
    __slots__ = ("task_id", "attempt", "reason")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    reason: str
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., reason: _Optional[str] = ...) -> None: ...

class ModelAck(_message.Message):
    __slots__ = ("model_version", "params_sha256", "rejected")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PARAMS_SHA256_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    params_sha256: str
    rejected: bool
    def __init__(self, model_version: _Optional[int] = ..., params_sha256: _Optional[str] = ..., rejected: _Optional[bool] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class GroupJoined(_message.Message):
    __slots__ = ("generation", "ok", "error")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    generation: int
    ok: bool
    error: str
    def __init__(self, generation: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("register", "heartbeat", "result_part", "result", "task_failed", "model_ack", "drain", "group_joined")
    REGISTER_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    RESULT_PART_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    TASK_FAILED_FIELD_NUMBER: _ClassVar[int]
    MODEL_ACK_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    GROUP_JOINED_FIELD_NUMBER: _ClassVar[int]
    register: Register
    heartbeat: Heartbeat
    result_part: ResultPart
    result: Result
    task_failed: TaskFailed
    model_ack: ModelAck
    drain: DrainRequest
    group_joined: GroupJoined
    def __init__(self, register: _Optional[_Union[Register, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., result_part: _Optional[_Union[ResultPart, _Mapping]] = ..., result: _Optional[_Union[Result, _Mapping]] = ..., task_failed: _Optional[_Union[TaskFailed, _Mapping]] = ..., model_ack: _Optional[_Union[ModelAck, _Mapping]] = ..., drain: _Optional[_Union[DrainRequest, _Mapping]] = ..., group_joined: _Optional[_Union[GroupJoined, _Mapping]] = ...) -> None: ...

class Welcome(_message.Message):
    __slots__ = ("session_id", "model_version", "resync", "max_message_bytes", "heartbeat_interval_s", "incarnation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    model_version: int
    resync: bool
    max_message_bytes: int
    heartbeat_interval_s: float
    incarnation: str
    def __init__(self, session_id: _Optional[str] = ..., model_version: _Optional[int] = ..., resync: _Optional[bool] = ..., max_message_bytes: _Optional[int] = ..., heartbeat_interval_s: _Optional[float] = ..., incarnation: _Optional[str] = ...) -> None: ...

class EngineOptions(_message.Message):
    __slots__ = ("engine", "probes", "token_budget", "unit", "local_steps", "local_lr", "local_batch_size", "estimator")
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    PROBES_FIELD_NUMBER: _ClassVar[int]
    TOKEN_BUDGET_FIELD_NUMBER: _ClassVar[int]
    UNIT_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_LR_FIELD_NUMBER: _ClassVar[int]
    LOCAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    ESTIMATOR_FIELD_NUMBER: _ClassVar[int]
    engine: str
    probes: int
    token_budget: int
    unit: str
    local_steps: int
    local_lr: float
    local_batch_size: int
    estimator: str
    def __init__(self, engine: _Optional[str] = ..., probes: _Optional[int] = ..., token_budget: _Optional[int] = ..., unit: _Optional[str] = ..., local_steps: _Optional[int] = ..., local_lr: _Optional[float] = ..., local_batch_size: _Optional[int] = ..., estimator: _Optional[str] = ...) -> None: ...

class Selection(_message.Message):
    __slots__ = ("strategy", "group_size", "seq_len")
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    SEQ_LEN_FIELD_NUMBER: _ClassVar[int]
    strategy: str
    group_size: int
    seq_len: int
    def __init__(self, strategy: _Optional[str] = ..., group_size: _Optional[int] = ..., seq_len: _Optional[int] = ...) -> None: ...

class Task(_message.Message):
    __slots__ = ("task_id", "attempt", "step", "model_version", "unit_ids", "clip_norm", "engine", "selection", "deadline_s", "selection_seed", "padded_size", "hold", "gather")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    UNIT_IDS_FIELD_NUMBER: _ClassVar[int]
    CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    SELECTION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_S_FIELD_NUMBER: _ClassVar[int]
    SELECTION_SEED_FIELD_NUMBER: _ClassVar[int]
    PADDED_SIZE_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    GATHER_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    step: int
    model_version: int
    unit_ids: _containers.RepeatedScalarFieldContainer[str]
    clip_norm: float
    engine: EngineOptions
    selection: Selection
    deadline_s: float
    selection_seed: int
    padded_size: int
    hold: bool
    gather: int
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., step: _Optional[int] = ..., model_version: _Optional[int] = ..., unit_ids: _Optional[_Iterable[str]] = ..., clip_norm: _Optional[float] = ..., engine: _Optional[_Union[EngineOptions, _Mapping]] = ..., selection: _Optional[_Union[Selection, _Mapping]] = ..., deadline_s: _Optional[float] = ..., selection_seed: _Optional[int] = ..., padded_size: _Optional[int] = ..., hold: _Optional[bool] = ..., gather: _Optional[int] = ...) -> None: ...

class CancelTask(_message.Message):
    __slots__ = ("task_id", "attempt")
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    task_id: str
    attempt: int
    def __init__(self, task_id: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class ModelPart(_message.Message):
    __slots__ = ("model_version", "chunk")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    chunk: TensorChunk
    def __init__(self, model_version: _Optional[int] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class ModelCommit(_message.Message):
    __slots__ = ("model_version", "full", "num_tensors", "params_sha256")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    FULL_FIELD_NUMBER: _ClassVar[int]
    NUM_TENSORS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_SHA256_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    full: bool
    num_tensors: int
    params_sha256: str
    def __init__(self, model_version: _Optional[int] = ..., full: _Optional[bool] = ..., num_tensors: _Optional[int] = ..., params_sha256: _Optional[str] = ...) -> None: ...

class Drain(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class TensorMeta(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class GroupJoin(_message.Message):
    __slots__ = ("generation", "rank", "world_size", "store_host", "store_port", "store_prefix", "backend", "timeout_s", "coordinator_root")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    STORE_HOST_FIELD_NUMBER: _ClassVar[int]
    STORE_PORT_FIELD_NUMBER: _ClassVar[int]
    STORE_PREFIX_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    COORDINATOR_ROOT_FIELD_NUMBER: _ClassVar[int]
    generation: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    store_prefix: str
    backend: str
    timeout_s: float
    coordinator_root: bool
    def __init__(self, generation: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., store_host: _Optional[str] = ..., store_port: _Optional[int] = ..., store_prefix: _Optional[str] = ..., backend: _Optional[str] = ..., timeout_s: _Optional[float] = ..., coordinator_root: _Optional[bool] = ...) -> None: ...

class GroupReduce(_message.Message):
    __slots__ = ("step", "generation", "task_id", "attempt", "model_version", "held", "tensors", "gather")
    STEP_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    HELD_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    GATHER_FIELD_NUMBER: _ClassVar[int]
    step: int
    generation: int
    task_id: str
    attempt: int
    model_version: int
    held: _containers.RepeatedScalarFieldContainer[str]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    gather: int
    def __init__(self, step: _Optional[int] = ..., generation: _Optional[int] = ..., task_id: _Optional[str] = ..., attempt: _Optional[int] = ..., model_version: _Optional[int] = ..., held: _Optional[_Iterable[str]] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ..., gather: _Optional[int] = ...) -> None: ...

class GroupModel(_message.Message):
    __slots__ = ("model_version", "generation", "source", "tensors")
    MODEL_VERSION_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    model_version: int
    generation: int
    source: bool
    tensors: _containers.RepeatedCompositeFieldContainer[TensorMeta]
    def __init__(self, model_version: _Optional[int] = ..., generation: _Optional[int] = ..., source: _Optional[bool] = ..., tensors: _Optional[_Iterable[_Union[TensorMeta, _Mapping]]] = ...) -> None: ...

class CoordinatorMessage(_message.Message):
    __slots__ = ("welcome", "task", "cancel", "model_part", "model_commit", "drain", "group_join", "group_reduce", "group_model")
    WELCOME_FIELD_NUMBER: _ClassVar[int]
    TASK_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_PART_FIELD_NUMBER: _ClassVar[int]
    MODEL_COMMIT_FIELD_NUMBER: _ClassVar[int]
    DRAIN_FIELD_NUMBER: _ClassVar[int]
    GROUP_JOIN_FIELD_NUMBER: _ClassVar[int]
    GROUP_REDUCE_FIELD_NUMBER: _ClassVar[int]
    GROUP_MODEL_FIELD_NUMBER: _ClassVar[int]
    welcome: Welcome
    task: Task
    cancel: CancelTask
    model_part: ModelPart
    model_commit: ModelCommit
    drain: Drain
    group_join: GroupJoin
    group_reduce: GroupReduce
    group_model: GroupModel
    def __init__(self, welcome: _Optional[_Union[Welcome, _Mapping]] = ..., task: _Optional[_Union[Task, _Mapping]] = ..., cancel: _Optional[_Union[CancelTask, _Mapping]] = ..., model_part: _Optional[_Union[ModelPart, _Mapping]] = ..., model_commit: _Optional[_Union[ModelCommit, _Mapping]] = ..., drain: _Optional[_Union[Drain, _Mapping]] = ..., group_join: _Optional[_Union[GroupJoin, _Mapping]] = ..., group_reduce: _Optional[_Union[GroupReduce, _Mapping]] = ..., group_model: _Optional[_Union[GroupModel, _Mapping]] = ...) -> None: ...
