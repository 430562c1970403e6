from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ReserveRequest(_message.Message):
    __slots__ = ("request_id", "num_prompt_tokens", "lease_ms", "renew_lease_ms", "prompt_token_ids", "prefill_here_below_tokens", "sampling")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    RENEW_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_HERE_BELOW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_prompt_tokens: int
    lease_ms: float
    renew_lease_ms: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_here_below_tokens: int
    sampling: _common_pb2.SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., lease_ms: _Optional[float] = ..., renew_lease_ms: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prefill_here_below_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ...) -> None: ...

class ReserveResponse(_message.Message):
    __slots__ = ("ticket", "destination", "renew_lease_ms", "cached_tokens", "prefilling_here")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    RENEW_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFILLING_HERE_FIELD_NUMBER: _ClassVar[int]
    ticket: _common_pb2.Ticket
    destination: _common_pb2.KVDestination
    renew_lease_ms: float
    cached_tokens: int
    prefilling_here: bool
    def __init__(self, ticket: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ..., destination: _Optional[_Union[_common_pb2.KVDestination, _Mapping]] = ..., renew_lease_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ..., prefilling_here: _Optional[bool] = ...) -> None: ...

class RenewRequest(_message.Message):
    __slots__ = ("tickets", "renew_lease_ms")
    TICKETS_FIELD_NUMBER: _ClassVar[int]
    RENEW_LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    tickets: _containers.RepeatedCompositeFieldContainer[_common_pb2.Ticket]
    renew_lease_ms: float
    def __init__(self, tickets: _Optional[_Iterable[_Union[_common_pb2.Ticket, _Mapping]]] = ..., renew_lease_ms: _Optional[float] = ...) -> None: ...

class RenewResponse(_message.Message):
    __slots__ = ("not_held",)
    NOT_HELD_FIELD_NUMBER: _ClassVar[int]
    not_held: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, not_held: _Optional[_Iterable[str]] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("ticket", "prompt_token_ids", "first_token", "sampling", "local_prefill", "stream_interval")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    STREAM_INTERVAL_FIELD_NUMBER: _ClassVar[int]
    ticket: _common_pb2.Ticket
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    first_token: int
    sampling: _common_pb2.SamplingParams
    local_prefill: bool
    stream_interval: int
    def __init__(self, ticket: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., first_token: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., local_prefill: _Optional[bool] = ..., stream_interval: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_ids", "finish_reason", "decode_start_ms", "prefill_ms", "queue_ms", "cached_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    DECODE_START_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    finish_reason: str
    decode_start_ms: float
    prefill_ms: float
    queue_ms: float
    cached_tokens: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., finish_reason: _Optional[str] = ..., decode_start_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., queue_ms: _Optional[float] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class DecodeManyRequest(_message.Message):
    __slots__ = ("start", "cancel", "traceparent")
    START_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    start: DecodeRequest
    cancel: _common_pb2.Ticket
    traceparent: str
    def __init__(self, start: _Optional[_Union[DecodeRequest, _Mapping]] = ..., cancel: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ..., traceparent: _Optional[str] = ...) -> None: ...

class DecodeManyResponse(_message.Message):
    __slots__ = ("updates",)
    UPDATES_FIELD_NUMBER: _ClassVar[int]
    updates: _containers.RepeatedCompositeFieldContainer[SequenceUpdate]
    def __init__(self, updates: _Optional[_Iterable[_Union[SequenceUpdate, _Mapping]]] = ...) -> None: ...

class SequenceUpdate(_message.Message):
    __slots__ = ("request_id", "message", "error_code", "error_message", "last")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    ERROR_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    message: DecodeResponse
    error_code: str
    error_message: str
    last: bool
    def __init__(self, request_id: _Optional[str] = ..., message: _Optional[_Union[DecodeResponse, _Mapping]] = ..., error_code: _Optional[str] = ..., error_message: _Optional[str] = ..., last: _Optional[bool] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("ticket", "reason")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ticket: _common_pb2.Ticket
    reason: str
    def __init__(self, ticket: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ..., reason: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...
