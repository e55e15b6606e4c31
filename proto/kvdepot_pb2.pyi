from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class AttachRequest(_message.Message):
    __slots__ = ("client_name", "pid", "protocol_version")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    protocol_version: int
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., protocol_version: _Optional[int] = ...) -> None: ...

class Notification(_message.Message):
    __slots__ = ("started", "job_done", "blocks_changed")
    STARTED_FIELD_NUMBER: _ClassVar[int]
    JOB_DONE_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CHANGED_FIELD_NUMBER: _ClassVar[int]
    started: SessionStarted
    job_done: JobDone
    blocks_changed: BlocksChanged
    def __init__(self, started: _Optional[_Union[SessionStarted, _Mapping]] = ..., job_done: _Optional[_Union[JobDone, _Mapping]] = ..., blocks_changed: _Optional[_Union[BlocksChanged, _Mapping]] = ...) -> None: ...

class BlocksChanged(_message.Message):
    __slots__ = ("engine_id", "ready", "storing", "dropped", "lower", "were_ready")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STORING_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    LOWER_FIELD_NUMBER: _ClassVar[int]
    WERE_READY_FIELD_NUMBER: _ClassVar[int]
    engine_id: int
    ready: _containers.RepeatedScalarFieldContainer[bytes]
    storing: _containers.RepeatedScalarFieldContainer[bytes]
    dropped: _containers.RepeatedScalarFieldContainer[bytes]
    lower: _containers.RepeatedScalarFieldContainer[bytes]
    were_ready: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, engine_id: _Optional[int] = ..., ready: _Optional[_Iterable[bytes]] = ..., storing: _Optional[_Iterable[bytes]] = ..., dropped: _Optional[_Iterable[bytes]] = ..., lower: _Optional[_Iterable[bytes]] = ..., were_ready: _Optional[_Iterable[bytes]] = ...) -> None: ...

class SessionStarted(_message.Message):
    __slots__ = ("session_id", "daemon_instance", "pool", "daemon_version", "job_socket", "tenant")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    JOB_SOCKET_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    daemon_instance: str
    pool: PoolInfo
    daemon_version: str
    job_socket: str
    tenant: str
    def __init__(self, session_id: _Optional[str] = ..., daemon_instance: _Optional[str] = ..., pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., daemon_version: _Optional[str] = ..., job_socket: _Optional[str] = ..., tenant: _Optional[str] = ...) -> None: ...

class PoolInfo(_message.Message):
    __slots__ = ("slot_bytes", "num_slots", "pinned", "online_slots", "bring_up_error")
    SLOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_FIELD_NUMBER: _ClassVar[int]
    ONLINE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BRING_UP_ERROR_FIELD_NUMBER: _ClassVar[int]
    slot_bytes: int
    num_slots: int
    pinned: bool
    online_slots: int
    bring_up_error: str
    def __init__(self, slot_bytes: _Optional[int] = ..., num_slots: _Optional[int] = ..., pinned: _Optional[bool] = ..., online_slots: _Optional[int] = ..., bring_up_error: _Optional[str] = ...) -> None: ...

class JobDone(_message.Message):
    __slots__ = ("job_id", "ok", "error", "already_stored", "not_stored")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    NOT_STORED_FIELD_NUMBER: _ClassVar[int]
    job_id: int
    ok: bool
    error: str
    already_stored: int
    not_stored: int
    def __init__(self, job_id: _Optional[int] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., already_stored: _Optional[int] = ..., not_stored: _Optional[int] = ...) -> None: ...

class NamespaceSpec(_message.Message):
    __slots__ = ("model", "revision", "kv_dtype", "block_size", "layout", "tp_size", "kv_group", "extra", "key_version")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    REVISION_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_GROUP_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    KEY_VERSION_FIELD_NUMBER: _ClassVar[int]
    model: str
    revision: str
    kv_dtype: str
    block_size: int
    layout: str
    tp_size: int
    kv_group: int
    extra: str
    key_version: int
    def __init__(self, model: _Optional[str] = ..., revision: _Optional[str] = ..., kv_dtype: _Optional[str] = ..., block_size: _Optional[int] = ..., layout: _Optional[str] = ..., tp_size: _Optional[int] = ..., kv_group: _Optional[int] = ..., extra: _Optional[str] = ..., key_version: _Optional[int] = ...) -> None: ...

class RegisterEngineRequest(_message.Message):
    __slots__ = ("session_id", "namespace")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: NamespaceSpec
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ...) -> None: ...

class RegisterEngineResponse(_message.Message):
    __slots__ = ("engine_id", "namespace_name", "remote_tier")
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_NAME_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TIER_FIELD_NUMBER: _ClassVar[int]
    engine_id: int
    namespace_name: str
    remote_tier: bool
    def __init__(self, engine_id: _Optional[int] = ..., namespace_name: _Optional[str] = ..., remote_tier: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape", "strides", "byte_offset", "storage_bytes", "block_dim", "page_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    STRIDES_FIELD_NUMBER: _ClassVar[int]
    BYTE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STORAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCK_DIM_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    strides: _containers.RepeatedScalarFieldContainer[int]
    byte_offset: int
    storage_bytes: int
    block_dim: int
    page_bytes: int
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., strides: _Optional[_Iterable[int]] = ..., byte_offset: _Optional[int] = ..., storage_bytes: _Optional[int] = ..., block_dim: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class CudaIpcHandle(_message.Message):
    __slots__ = ("mem_handle", "device_uuid", "storage_offset")
    MEM_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    STORAGE_OFFSET_FIELD_NUMBER: _ClassVar[int]
    mem_handle: bytes
    device_uuid: str
    storage_offset: int
    def __init__(self, mem_handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ..., storage_offset: _Optional[int] = ...) -> None: ...

class TensorHandle(_message.Message):
    __slots__ = ("shared_memory", "cuda_ipc")
    SHARED_MEMORY_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_FIELD_NUMBER: _ClassVar[int]
    shared_memory: SharedMemoryWorker
    cuda_ipc: CudaIpcHandle
    def __init__(self, shared_memory: _Optional[_Union[SharedMemoryWorker, _Mapping]] = ..., cuda_ipc: _Optional[_Union[CudaIpcHandle, _Mapping]] = ...) -> None: ...

class SharedMemoryWorker(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("session_id", "namespace", "rank", "device", "tensors", "handles", "cuda_fence", "staging_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    CUDA_FENCE_FIELD_NUMBER: _ClassVar[int]
    STAGING_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    namespace: NamespaceSpec
    rank: int
    device: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    handles: _containers.RepeatedCompositeFieldContainer[TensorHandle]
    cuda_fence: CudaIpcHandle
    staging_id: int
    def __init__(self, session_id: _Optional[str] = ..., namespace: _Optional[_Union[NamespaceSpec, _Mapping]] = ..., rank: _Optional[int] = ..., device: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., handles: _Optional[_Iterable[_Union[TensorHandle, _Mapping]]] = ..., cuda_fence: _Optional[_Union[CudaIpcHandle, _Mapping]] = ..., staging_id: _Optional[int] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("worker_id", "namespace_name", "block_bytes", "slot_offsets")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_NAME_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    SLOT_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    namespace_name: str
    block_bytes: int
    slot_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker_id: _Optional[int] = ..., namespace_name: _Optional[str] = ..., block_bytes: _Optional[int] = ..., slot_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("session_id", "engine_id", "keys")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, session_id: _Optional[str] = ..., engine_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("status", "ready_blocks", "loading_blocks", "storing_blocks")
    class Status(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STATUS_UNSPECIFIED: _ClassVar[LookupResponse.Status]
        READY: _ClassVar[LookupResponse.Status]
        NOT_YET: _ClassVar[LookupResponse.Status]
    STATUS_UNSPECIFIED: LookupResponse.Status
    READY: LookupResponse.Status
    NOT_YET: LookupResponse.Status
    STATUS_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORING_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    status: LookupResponse.Status
    ready_blocks: int
    loading_blocks: int
    storing_blocks: int
    def __init__(self, status: _Optional[_Union[LookupResponse.Status, str]] = ..., ready_blocks: _Optional[int] = ..., loading_blocks: _Optional[int] = ..., storing_blocks: _Optional[int] = ...) -> None: ...

class ReportLookupsRequest(_message.Message):
    __slots__ = ("session_id", "engine_id", "lookups", "hit_blocks", "miss_blocks")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    engine_id: int
    lookups: int
    hit_blocks: int
    miss_blocks: int
    def __init__(self, session_id: _Optional[str] = ..., engine_id: _Optional[int] = ..., lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ...) -> None: ...

class ReportLookupsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SubmitStoreRequest(_message.Message):
    __slots__ = ("session_id", "worker_id", "job_id", "keys", "block_ids", "cuda_event_handle", "cuda_fence_seq")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    CUDA_EVENT_HANDLE_FIELD_NUMBER: _ClassVar[int]
    CUDA_FENCE_SEQ_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    worker_id: int
    job_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    cuda_event_handle: bytes
    cuda_fence_seq: int
    def __init__(self, session_id: _Optional[str] = ..., worker_id: _Optional[int] = ..., job_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ..., cuda_event_handle: _Optional[bytes] = ..., cuda_fence_seq: _Optional[int] = ...) -> None: ...

class SubmitStoreResponse(_message.Message):
    __slots__ = ("already_stored", "not_stored")
    ALREADY_STORED_FIELD_NUMBER: _ClassVar[int]
    NOT_STORED_FIELD_NUMBER: _ClassVar[int]
    already_stored: int
    not_stored: int
    def __init__(self, already_stored: _Optional[int] = ..., not_stored: _Optional[int] = ...) -> None: ...

class SubmitLoadRequest(_message.Message):
    __slots__ = ("session_id", "worker_id", "job_id", "keys", "block_ids")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    worker_id: int
    job_id: int
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., worker_id: _Optional[int] = ..., job_id: _Optional[int] = ..., keys: _Optional[_Iterable[bytes]] = ..., block_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SubmitLoadResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class JobFrame(_message.Message):
    __slots__ = ("request_id", "hello", "submit_store", "submit_load", "staging")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    HELLO_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_STORE_FIELD_NUMBER: _ClassVar[int]
    SUBMIT_LOAD_FIELD_NUMBER: _ClassVar[int]
    STAGING_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    hello: JobSocketHello
    submit_store: SubmitStoreRequest
    submit_load: SubmitLoadRequest
    staging: StagingOffer
    def __init__(self, request_id: _Optional[int] = ..., hello: _Optional[_Union[JobSocketHello, _Mapping]] = ..., submit_store: _Optional[_Union[SubmitStoreRequest, _Mapping]] = ..., submit_load: _Optional[_Union[SubmitLoadRequest, _Mapping]] = ..., staging: _Optional[_Union[StagingOffer, _Mapping]] = ...) -> None: ...

class JobSocketHello(_message.Message):
    __slots__ = ("session_id", "quiet_submits")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    QUIET_SUBMITS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    quiet_submits: bool
    def __init__(self, session_id: _Optional[str] = ..., quiet_submits: _Optional[bool] = ...) -> None: ...

class JobReply(_message.Message):
    __slots__ = ("request_id", "store_submitted", "load_submitted", "refused", "job_done", "ready", "staging_ready", "staging_taken")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    STORE_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    LOAD_SUBMITTED_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    JOB_DONE_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    STAGING_READY_FIELD_NUMBER: _ClassVar[int]
    STAGING_TAKEN_FIELD_NUMBER: _ClassVar[int]
    request_id: int
    store_submitted: SubmitStoreResponse
    load_submitted: SubmitLoadResponse
    refused: JobRefused
    job_done: JobDone
    ready: JobSocketReady
    staging_ready: StagingReady
    staging_taken: StagingTaken
    def __init__(self, request_id: _Optional[int] = ..., store_submitted: _Optional[_Union[SubmitStoreResponse, _Mapping]] = ..., load_submitted: _Optional[_Union[SubmitLoadResponse, _Mapping]] = ..., refused: _Optional[_Union[JobRefused, _Mapping]] = ..., job_done: _Optional[_Union[JobDone, _Mapping]] = ..., ready: _Optional[_Union[JobSocketReady, _Mapping]] = ..., staging_ready: _Optional[_Union[StagingReady, _Mapping]] = ..., staging_taken: _Optional[_Union[StagingTaken, _Mapping]] = ...) -> None: ...

class StagingOffer(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class StagingReady(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StagingTaken(_message.Message):
    __slots__ = ("staging_id",)
    STAGING_ID_FIELD_NUMBER: _ClassVar[int]
    staging_id: int
    def __init__(self, staging_id: _Optional[int] = ...) -> None: ...

class JobSocketReady(_message.Message):
    __slots__ = ("tenant", "admin", "quiet_submits")
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ADMIN_FIELD_NUMBER: _ClassVar[int]
    QUIET_SUBMITS_FIELD_NUMBER: _ClassVar[int]
    tenant: str
    admin: bool
    quiet_submits: bool
    def __init__(self, tenant: _Optional[str] = ..., admin: _Optional[bool] = ..., quiet_submits: _Optional[bool] = ...) -> None: ...

class JobRefused(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class Counters(_message.Message):
    __slots__ = ("lookups", "hit_blocks", "miss_blocks", "stored_blocks", "stored_bytes", "loaded_blocks", "loaded_bytes", "evicted_blocks", "failed_jobs", "store_gbps", "load_gbps", "disk_hit_blocks")
    LOOKUPS_FIELD_NUMBER: _ClassVar[int]
    HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    MISS_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOADED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    LOADED_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FAILED_JOBS_FIELD_NUMBER: _ClassVar[int]
    STORE_GBPS_FIELD_NUMBER: _ClassVar[int]
    LOAD_GBPS_FIELD_NUMBER: _ClassVar[int]
    DISK_HIT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    lookups: int
    hit_blocks: int
    miss_blocks: int
    stored_blocks: int
    stored_bytes: int
    loaded_blocks: int
    loaded_bytes: int
    evicted_blocks: int
    failed_jobs: int
    store_gbps: float
    load_gbps: float
    disk_hit_blocks: int
    def __init__(self, lookups: _Optional[int] = ..., hit_blocks: _Optional[int] = ..., miss_blocks: _Optional[int] = ..., stored_blocks: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., loaded_blocks: _Optional[int] = ..., loaded_bytes: _Optional[int] = ..., evicted_blocks: _Optional[int] = ..., failed_jobs: _Optional[int] = ..., store_gbps: _Optional[float] = ..., load_gbps: _Optional[float] = ..., disk_hit_blocks: _Optional[int] = ...) -> None: ...

class TierStats(_message.Message):
    __slots__ = ("name", "shards", "bytes", "capacity_bytes", "written_shards", "written_bytes", "read_shards", "read_bytes", "promotions", "failed_promotions", "evicted_shards", "recovered_shards", "discarded", "direct_io", "write_errors", "misses", "dropped_writes", "circuit", "fetch_bounds", "fetch_counts", "fetch_seconds")
    class DiscardedEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHARDS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_SHARDS_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    READ_SHARDS_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    FAILED_PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    RECOVERED_SHARDS_FIELD_NUMBER: _ClassVar[int]
    DISCARDED_FIELD_NUMBER: _ClassVar[int]
    DIRECT_IO_FIELD_NUMBER: _ClassVar[int]
    WRITE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    DROPPED_WRITES_FIELD_NUMBER: _ClassVar[int]
    CIRCUIT_FIELD_NUMBER: _ClassVar[int]
    FETCH_BOUNDS_FIELD_NUMBER: _ClassVar[int]
    FETCH_COUNTS_FIELD_NUMBER: _ClassVar[int]
    FETCH_SECONDS_FIELD_NUMBER: _ClassVar[int]
    name: str
    shards: int
    bytes: int
    capacity_bytes: int
    written_shards: int
    written_bytes: int
    read_shards: int
    read_bytes: int
    promotions: int
    failed_promotions: int
    evicted_shards: int
    recovered_shards: int
    discarded: _containers.ScalarMap[str, int]
    direct_io: bool
    write_errors: int
    misses: int
    dropped_writes: int
    circuit: str
    fetch_bounds: _containers.RepeatedScalarFieldContainer[float]
    fetch_counts: _containers.RepeatedScalarFieldContainer[int]
    fetch_seconds: float
    def __init__(self, name: _Optional[str] = ..., shards: _Optional[int] = ..., bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., written_shards: _Optional[int] = ..., written_bytes: _Optional[int] = ..., read_shards: _Optional[int] = ..., read_bytes: _Optional[int] = ..., promotions: _Optional[int] = ..., failed_promotions: _Optional[int] = ..., evicted_shards: _Optional[int] = ..., recovered_shards: _Optional[int] = ..., discarded: _Optional[_Mapping[str, int]] = ..., direct_io: _Optional[bool] = ..., write_errors: _Optional[int] = ..., misses: _Optional[int] = ..., dropped_writes: _Optional[int] = ..., circuit: _Optional[str] = ..., fetch_bounds: _Optional[_Iterable[float]] = ..., fetch_counts: _Optional[_Iterable[int]] = ..., fetch_seconds: _Optional[float] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("name", "counters", "ready_blocks", "used_slots", "block_bytes", "used_bytes")
    NAME_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    READY_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    counters: Counters
    ready_blocks: int
    used_slots: int
    block_bytes: int
    used_bytes: int
    def __init__(self, name: _Optional[str] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., ready_blocks: _Optional[int] = ..., used_slots: _Optional[int] = ..., block_bytes: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class BlockSizeStats(_message.Message):
    __slots__ = ("block_bytes", "namespaces", "used_slots", "used_bytes")
    BLOCK_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    block_bytes: int
    namespaces: int
    used_slots: int
    used_bytes: int
    def __init__(self, block_bytes: _Optional[int] = ..., namespaces: _Optional[int] = ..., used_slots: _Optional[int] = ..., used_bytes: _Optional[int] = ...) -> None: ...

class ClientStats(_message.Message):
    __slots__ = ("client_name", "pid", "counters", "jobs_in_flight", "workers", "session_number", "tenant", "uid")
    CLIENT_NAME_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    JOBS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    SESSION_NUMBER_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    client_name: str
    pid: int
    counters: Counters
    jobs_in_flight: int
    workers: int
    session_number: int
    tenant: str
    uid: int
    def __init__(self, client_name: _Optional[str] = ..., pid: _Optional[int] = ..., counters: _Optional[_Union[Counters, _Mapping]] = ..., jobs_in_flight: _Optional[int] = ..., workers: _Optional[int] = ..., session_number: _Optional[int] = ..., tenant: _Optional[str] = ..., uid: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("daemon_version", "daemon_instance", "uptime_seconds", "pool", "used_slots", "pinned_slots", "occupancy", "eviction_policy", "totals", "namespaces", "clients", "sessions_ended", "open_ipc_mappings", "gpus", "namespaces_omitted", "clients_omitted", "tiers", "numa_nodes", "numa_carved", "kv_bytes", "free_bytes", "fragmentation", "block_sizes", "numa_gpus_elsewhere", "free_any_size_bytes")
    DAEMON_VERSION_FIELD_NUMBER: _ClassVar[int]
    DAEMON_INSTANCE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    PINNED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    OCCUPANCY_FIELD_NUMBER: _ClassVar[int]
    EVICTION_POLICY_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_ENDED_FIELD_NUMBER: _ClassVar[int]
    OPEN_IPC_MAPPINGS_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_OMITTED_FIELD_NUMBER: _ClassVar[int]
    CLIENTS_OMITTED_FIELD_NUMBER: _ClassVar[int]
    TIERS_FIELD_NUMBER: _ClassVar[int]
    NUMA_NODES_FIELD_NUMBER: _ClassVar[int]
    NUMA_CARVED_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FRAGMENTATION_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZES_FIELD_NUMBER: _ClassVar[int]
    NUMA_GPUS_ELSEWHERE_FIELD_NUMBER: _ClassVar[int]
    FREE_ANY_SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    daemon_version: str
    daemon_instance: str
    uptime_seconds: float
    pool: PoolInfo
    used_slots: int
    pinned_slots: int
    occupancy: float
    eviction_policy: str
    totals: Counters
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    clients: _containers.RepeatedCompositeFieldContainer[ClientStats]
    sessions_ended: int
    open_ipc_mappings: int
    gpus: _containers.RepeatedCompositeFieldContainer[GpuStats]
    namespaces_omitted: int
    clients_omitted: int
    tiers: _containers.RepeatedCompositeFieldContainer[TierStats]
    numa_nodes: _containers.RepeatedCompositeFieldContainer[NumaNodeStats]
    numa_carved: bool
    kv_bytes: int
    free_bytes: int
    fragmentation: float
    block_sizes: _containers.RepeatedCompositeFieldContainer[BlockSizeStats]
    numa_gpus_elsewhere: _containers.RepeatedScalarFieldContainer[str]
    free_any_size_bytes: int
    def __init__(self, daemon_version: _Optional[str] = ..., daemon_instance: _Optional[str] = ..., uptime_seconds: _Optional[float] = ..., pool: _Optional[_Union[PoolInfo, _Mapping]] = ..., used_slots: _Optional[int] = ..., pinned_slots: _Optional[int] = ..., occupancy: _Optional[float] = ..., eviction_policy: _Optional[str] = ..., totals: _Optional[_Union[Counters, _Mapping]] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., clients: _Optional[_Iterable[_Union[ClientStats, _Mapping]]] = ..., sessions_ended: _Optional[int] = ..., open_ipc_mappings: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[GpuStats, _Mapping]]] = ..., namespaces_omitted: _Optional[int] = ..., clients_omitted: _Optional[int] = ..., tiers: _Optional[_Iterable[_Union[TierStats, _Mapping]]] = ..., numa_nodes: _Optional[_Iterable[_Union[NumaNodeStats, _Mapping]]] = ..., numa_carved: _Optional[bool] = ..., kv_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., fragmentation: _Optional[float] = ..., block_sizes: _Optional[_Iterable[_Union[BlockSizeStats, _Mapping]]] = ..., numa_gpus_elsewhere: _Optional[_Iterable[str]] = ..., free_any_size_bytes: _Optional[int] = ...) -> None: ...

class NumaNodeStats(_message.Message):
    __slots__ = ("node", "first_slot", "slots", "used_slots", "bound", "gpus")
    NODE_FIELD_NUMBER: _ClassVar[int]
    FIRST_SLOT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    USED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    BOUND_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    node: int
    first_slot: int
    slots: int
    used_slots: int
    bound: bool
    gpus: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[int] = ..., first_slot: _Optional[int] = ..., slots: _Optional[int] = ..., used_slots: _Optional[int] = ..., bound: _Optional[bool] = ..., gpus: _Optional[_Iterable[str]] = ...) -> None: ...

class GpuStats(_message.Message):
    __slots__ = ("index", "uuid", "daemon_memory_bytes")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    DAEMON_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    index: int
    uuid: str
    daemon_memory_bytes: int
    def __init__(self, index: _Optional[int] = ..., uuid: _Optional[str] = ..., daemon_memory_bytes: _Optional[int] = ...) -> None: ...

class ClearRequest(_message.Message):
    __slots__ = ("namespace_name", "session_id")
    NAMESPACE_NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    namespace_name: str
    session_id: str
    def __init__(self, namespace_name: _Optional[str] = ..., session_id: _Optional[str] = ...) -> None: ...

class ClearResponse(_message.Message):
    __slots__ = ("cleared_blocks", "pinned_blocks")
    CLEARED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PINNED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    cleared_blocks: int
    pinned_blocks: int
    def __init__(self, cleared_blocks: _Optional[int] = ..., pinned_blocks: _Optional[int] = ...) -> None: ...
