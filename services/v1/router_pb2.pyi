from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GenerateRequest(_message.Message):
    __slots__ = ("prompt", "token_ids", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "request_id", "model", "messages")
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    prompt: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    request_id: str
    model: str
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, prompt: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., request_id: _Optional[str] = ..., model: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class TokenDelta(_message.Message):
    __slots__ = ("text", "token_ids")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "prefill_ms", "kv_transfer_ms", "decode_start_ms", "ttft_ms", "kv_bytes", "kv_pages", "kv_transport", "prefill_worker", "decode_worker", "attempts", "kv_transfer_total_ms", "cached_tokens", "prefill_cached_tokens", "decode_cached_tokens", "prompt_pages", "prefill_on", "kv_ranks")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    DECODE_START_MS_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_PAGES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    PREFILL_WORKER_FIELD_NUMBER: _ClassVar[int]
    DECODE_WORKER_FIELD_NUMBER: _ClassVar[int]
    ATTEMPTS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    PREFILL_ON_FIELD_NUMBER: _ClassVar[int]
    KV_RANKS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    prefill_ms: float
    kv_transfer_ms: float
    decode_start_ms: float
    ttft_ms: float
    kv_bytes: int
    kv_pages: int
    kv_transport: str
    prefill_worker: str
    decode_worker: str
    attempts: int
    kv_transfer_total_ms: float
    cached_tokens: int
    prefill_cached_tokens: int
    decode_cached_tokens: int
    prompt_pages: int
    prefill_on: str
    kv_ranks: _containers.RepeatedCompositeFieldContainer[_common_pb2.RankTransfer]
    def __init__(self, queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., kv_transfer_ms: _Optional[float] = ..., decode_start_ms: _Optional[float] = ..., ttft_ms: _Optional[float] = ..., kv_bytes: _Optional[int] = ..., kv_pages: _Optional[int] = ..., kv_transport: _Optional[str] = ..., prefill_worker: _Optional[str] = ..., decode_worker: _Optional[str] = ..., attempts: _Optional[int] = ..., kv_transfer_total_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., prefill_cached_tokens: _Optional[int] = ..., decode_cached_tokens: _Optional[int] = ..., prompt_pages: _Optional[int] = ..., prefill_on: _Optional[str] = ..., kv_ranks: _Optional[_Iterable[_Union[_common_pb2.RankTransfer, _Mapping]]] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("finish_reason", "prompt_tokens", "completion_tokens", "e2e_ms", "tpot_ms", "itl_mean_ms", "itl_max_ms")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    E2E_MS_FIELD_NUMBER: _ClassVar[int]
    TPOT_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_MEAN_MS_FIELD_NUMBER: _ClassVar[int]
    ITL_MAX_MS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    e2e_ms: float
    tpot_ms: float
    itl_mean_ms: float
    itl_max_ms: float
    def __init__(self, finish_reason: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., e2e_ms: _Optional[float] = ..., tpot_ms: _Optional[float] = ..., itl_mean_ms: _Optional[float] = ..., itl_max_ms: _Optional[float] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "timing", "finish")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: TokenDelta
    timing: Timing
    finish: Finish
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[TokenDelta, _Mapping]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ...) -> None: ...

class PlacedBatch(_message.Message):
    __slots__ = ("router_id", "placed")
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    PLACED_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    placed: _containers.RepeatedCompositeFieldContainer[PlacedPages]
    def __init__(self, router_id: _Optional[str] = ..., placed: _Optional[_Iterable[_Union[PlacedPages, _Mapping]]] = ...) -> None: ...

class PlacedPages(_message.Message):
    __slots__ = ("worker", "root_key", "block_size", "page_keys")
    WORKER_FIELD_NUMBER: _ClassVar[int]
    ROOT_KEY_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_KEYS_FIELD_NUMBER: _ClassVar[int]
    worker: str
    root_key: int
    block_size: int
    page_keys: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, worker: _Optional[str] = ..., root_key: _Optional[int] = ..., block_size: _Optional[int] = ..., page_keys: _Optional[_Iterable[int]] = ...) -> None: ...

class PlacedAck(_message.Message):
    __slots__ = ("router_id",)
    ROUTER_ID_FIELD_NUMBER: _ClassVar[int]
    router_id: str
    def __init__(self, router_id: _Optional[str] = ...) -> None: ...
