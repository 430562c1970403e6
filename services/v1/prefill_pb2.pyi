from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "sampling", "ticket", "destination")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TICKET_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    ticket: _common_pb2.Ticket
    destination: _common_pb2.KVDestination
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., ticket: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ..., destination: _Optional[_Union[_common_pb2.KVDestination, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "queue_ms", "prefill_ms", "transfer", "worker_id", "cached_tokens")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    first_token: int
    queue_ms: float
    prefill_ms: float
    transfer: _common_pb2.TransferReport
    worker_id: str
    cached_tokens: int
    def __init__(self, first_token: _Optional[int] = ..., queue_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer: _Optional[_Union[_common_pb2.TransferReport, _Mapping]] = ..., worker_id: _Optional[str] = ..., cached_tokens: _Optional[int] = ...) -> None: ...
