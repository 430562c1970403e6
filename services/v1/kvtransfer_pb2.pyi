from pdserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RegisterPoolRequest(_message.Message):
    __slots__ = ("worker_id", "shm_name", "cuda_ipc_handle", "num_pages", "page_bytes", "fingerprint")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    CUDA_IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    shm_name: str
    cuda_ipc_handle: bytes
    num_pages: int
    page_bytes: int
    fingerprint: _common_pb2.LayoutFingerprint
    def __init__(self, worker_id: _Optional[str] = ..., shm_name: _Optional[str] = ..., cuda_ipc_handle: _Optional[bytes] = ..., num_pages: _Optional[int] = ..., page_bytes: _Optional[int] = ..., fingerprint: _Optional[_Union[_common_pb2.LayoutFingerprint, _Mapping]] = ...) -> None: ...

class RegisterPoolResponse(_message.Message):
    __slots__ = ("pool_id", "agent_epoch", "agent_id")
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    AGENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    pool_id: str
    agent_epoch: int
    agent_id: str
    def __init__(self, pool_id: _Optional[str] = ..., agent_epoch: _Optional[int] = ..., agent_id: _Optional[str] = ...) -> None: ...

class GetAgentInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentInfo(_message.Message):
    __slots__ = ("agent_id", "epoch", "ucx_worker_address", "tcp_address", "transport", "pool_ids", "local_socket", "local_token", "same_host_copy")
    AGENT_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    UCX_WORKER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TCP_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    POOL_IDS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_SOCKET_FIELD_NUMBER: _ClassVar[int]
    LOCAL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_COPY_FIELD_NUMBER: _ClassVar[int]
    agent_id: str
    epoch: int
    ucx_worker_address: bytes
    tcp_address: str
    transport: str
    pool_ids: _containers.RepeatedScalarFieldContainer[str]
    local_socket: str
    local_token: bytes
    same_host_copy: bool
    def __init__(self, agent_id: _Optional[str] = ..., epoch: _Optional[int] = ..., ucx_worker_address: _Optional[bytes] = ..., tcp_address: _Optional[str] = ..., transport: _Optional[str] = ..., pool_ids: _Optional[_Iterable[str]] = ..., local_socket: _Optional[str] = ..., local_token: _Optional[bytes] = ..., same_host_copy: _Optional[bool] = ...) -> None: ...

class ExpectTransferRequest(_message.Message):
    __slots__ = ("ticket", "pool_id", "page_ids", "lease_ms")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    POOL_ID_FIELD_NUMBER: _ClassVar[int]
    PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    ticket: _common_pb2.Ticket
    pool_id: str
    page_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_ms: float
    def __init__(self, ticket: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ..., pool_id: _Optional[str] = ..., page_ids: _Optional[_Iterable[int]] = ..., lease_ms: _Optional[float] = ...) -> None: ...

class ExpectTransferResponse(_message.Message):
    __slots__ = ("agent_epoch",)
    AGENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    agent_epoch: int
    def __init__(self, agent_epoch: _Optional[int] = ...) -> None: ...

class CancelTransferRequest(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: _common_pb2.Ticket
    def __init__(self, ticket: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ...) -> None: ...

class CancelTransferResponse(_message.Message):
    __slots__ = ("was_pending", "was_complete")
    WAS_PENDING_FIELD_NUMBER: _ClassVar[int]
    WAS_COMPLETE_FIELD_NUMBER: _ClassVar[int]
    was_pending: bool
    was_complete: bool
    def __init__(self, was_pending: _Optional[bool] = ..., was_complete: _Optional[bool] = ...) -> None: ...

class TransferStatusRequest(_message.Message):
    __slots__ = ("ticket",)
    TICKET_FIELD_NUMBER: _ClassVar[int]
    ticket: _common_pb2.Ticket
    def __init__(self, ticket: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ...) -> None: ...

class TransferStatusResponse(_message.Message):
    __slots__ = ("complete", "kv_bytes", "completed_unix_ms")
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    complete: bool
    kv_bytes: int
    completed_unix_ms: float
    def __init__(self, complete: _Optional[bool] = ..., kv_bytes: _Optional[int] = ..., completed_unix_ms: _Optional[float] = ...) -> None: ...

class SendPagesRequest(_message.Message):
    __slots__ = ("ticket", "src_pool_id", "src_page_ids", "destination", "timeout_ms")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    SRC_POOL_ID_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGE_IDS_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    ticket: _common_pb2.Ticket
    src_pool_id: str
    src_page_ids: _containers.RepeatedScalarFieldContainer[int]
    destination: _common_pb2.KVDestination
    timeout_ms: float
    def __init__(self, ticket: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ..., src_pool_id: _Optional[str] = ..., src_page_ids: _Optional[_Iterable[int]] = ..., destination: _Optional[_Union[_common_pb2.KVDestination, _Mapping]] = ..., timeout_ms: _Optional[float] = ...) -> None: ...

class SendPagesResponse(_message.Message):
    __slots__ = ("report",)
    REPORT_FIELD_NUMBER: _ClassVar[int]
    report: _common_pb2.TransferReport
    def __init__(self, report: _Optional[_Union[_common_pb2.TransferReport, _Mapping]] = ...) -> None: ...

class GrantWriteRequest(_message.Message):
    __slots__ = ("ticket", "reply_to")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    REPLY_TO_FIELD_NUMBER: _ClassVar[int]
    ticket: _common_pb2.Ticket
    reply_to: bytes
    def __init__(self, ticket: _Optional[_Union[_common_pb2.Ticket, _Mapping]] = ..., reply_to: _Optional[bytes] = ...) -> None: ...

class GrantWriteResponse(_message.Message):
    __slots__ = ("grant",)
    GRANT_FIELD_NUMBER: _ClassVar[int]
    grant: bytes
    def __init__(self, grant: _Optional[bytes] = ...) -> None: ...
