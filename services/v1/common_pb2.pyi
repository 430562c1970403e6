from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "max_tokens")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    ignore_eos: bool
    max_tokens: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., ignore_eos: _Optional[bool] = ..., max_tokens: _Optional[int] = ...) -> None: ...

class Ticket(_message.Message):
    __slots__ = ("request_id", "epoch", "decode_worker")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    epoch: int
    decode_worker: str
    def __init__(self, request_id: _Optional[str] = ..., epoch: _Optional[int] = ..., decode_worker: _Optional[str] = ...) -> None: ...

class LayoutFingerprint(_message.Message):
    __slots__ = ("model_id", "model_revision", "dtype", "num_layers", "num_kv_heads", "head_dim", "block_size", "tp_rank", "tp_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_REVISION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    TP_RANK_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    model_revision: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_rank: int
    tp_size: int
    def __init__(self, model_id: _Optional[str] = ..., model_revision: _Optional[str] = ..., dtype: _Optional[str] = ..., num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., block_size: _Optional[int] = ..., tp_rank: _Optional[int] = ..., tp_size: _Optional[int] = ...) -> None: ...

class KVDestination(_message.Message):
    __slots__ = ("agent_address", "agent_epoch", "pool_id", "page_ids", "fingerprint", "first_page", "boundary_key", "tp_ranks")
    AGENT_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_PAGE_FIELD_NUMBER: _ClassVar[int]
    BOUNDARY_KEY_FIELD_NUMBER: _ClassVar[int]
    TP_RANKS_FIELD_NUMBER: _ClassVar[int]
    agent_address: str
    agent_epoch: int
    pool_id: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    fingerprint: LayoutFingerprint
    first_page: int
    boundary_key: int
    tp_ranks: _containers.RepeatedCompositeFieldContainer[KVDestination]
    def __init__(self, agent_address: _Optional[str] = ..., agent_epoch: _Optional[int] = ..., pool_id: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ..., fingerprint: _Optional[_Union[LayoutFingerprint, _Mapping]] = ..., first_page: _Optional[int] = ..., boundary_key: _Optional[int] = ..., tp_ranks: _Optional[_Iterable[_Union[KVDestination, _Mapping]]] = ...) -> None: ...

class TransferReport(_message.Message):
    __slots__ = ("handoff_ms", "kv_bytes", "kv_pages", "transport", "num_runs", "kv_transfer_total_ms", "ranks")
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    handoff_ms: float
    kv_bytes: int
    kv_pages: int
    transport: str
    num_runs: int
    kv_transfer_total_ms: float
    ranks: _containers.RepeatedCompositeFieldContainer[RankTransfer]
    def __init__(self, handoff_ms: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., kv_pages: _Optional[int] = ..., transport: _Optional[str] = ..., num_runs: _Optional[int] = ..., kv_transfer_total_ms: _Optional[float] = ..., ranks: _Optional[_Iterable[_Union[RankTransfer, _Mapping]]] = ...) -> None: ...

class RankTransfer(_message.Message):
    __slots__ = ("decode_rank", "prefill_rank_first", "prefill_rank_last", "kv_bytes", "handoff_ms", "total_ms", "transport", "relayout")
    DECODE_RANK_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RANK_FIRST_FIELD_NUMBER: _ClassVar[int]
    PREFILL_RANK_LAST_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    HANDOFF_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    RELAYOUT_FIELD_NUMBER: _ClassVar[int]
    decode_rank: int
    prefill_rank_first: int
    prefill_rank_last: int
    kv_bytes: int
    handoff_ms: float
    total_ms: float
    transport: str
    relayout: str
    def __init__(self, decode_rank: _Optional[int] = ..., prefill_rank_first: _Optional[int] = ..., prefill_rank_last: _Optional[int] = ..., kv_bytes: _Optional[int] = ..., handoff_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., transport: _Optional[str] = ..., relayout: _Optional[str] = ...) -> None: ...

class CacheEventsRequest(_message.Message):
    __slots__ = ("heartbeat_ms",)
    HEARTBEAT_MS_FIELD_NUMBER: _ClassVar[int]
    heartbeat_ms: float
    def __init__(self, heartbeat_ms: _Optional[float] = ...) -> None: ...

class CacheEventBatch(_message.Message):
    __slots__ = ("worker_id", "epoch", "sequence", "snapshot", "stored", "removed", "block_size", "fingerprint", "since")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SINCE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    epoch: int
    sequence: int
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    fingerprint: LayoutFingerprint
    since: int
    def __init__(self, worker_id: _Optional[str] = ..., epoch: _Optional[int] = ..., sequence: _Optional[int] = ..., snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., fingerprint: _Optional[_Union[LayoutFingerprint, _Mapping]] = ..., since: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("cache_events", "cache_epoch", "cache_sequence")
    CACHE_EVENTS_FIELD_NUMBER: _ClassVar[int]
    CACHE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    CACHE_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    cache_events: bool
    cache_epoch: int
    cache_sequence: int
    def __init__(self, cache_events: _Optional[bool] = ..., cache_epoch: _Optional[int] = ..., cache_sequence: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("worker_id", "role", "num_pages", "free_pages", "running_sequences", "waiting_sequences", "reserved_tickets", "queued_prompt_tokens", "fingerprint", "max_model_len", "cached_pages", "serving", "cache")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_PAGES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    WAITING_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    RESERVED_TICKETS_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    CACHED_PAGES_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    role: str
    num_pages: int
    free_pages: int
    running_sequences: int
    waiting_sequences: int
    reserved_tickets: int
    queued_prompt_tokens: int
    fingerprint: LayoutFingerprint
    max_model_len: int
    cached_pages: int
    serving: bool
    cache: CacheEventBatch
    def __init__(self, worker_id: _Optional[str] = ..., role: _Optional[str] = ..., num_pages: _Optional[int] = ..., free_pages: _Optional[int] = ..., running_sequences: _Optional[int] = ..., waiting_sequences: _Optional[int] = ..., reserved_tickets: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., fingerprint: _Optional[_Union[LayoutFingerprint, _Mapping]] = ..., max_model_len: _Optional[int] = ..., cached_pages: _Optional[int] = ..., serving: _Optional[bool] = ..., cache: _Optional[_Union[CacheEventBatch, _Mapping]] = ...) -> None: ...
