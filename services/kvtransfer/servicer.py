"""pdserve.v1.KVTransfer over gRPC: proto in, agent call, proto out.

Domain errors become status codes in one place (`_status`): BadRequest (and LayoutMismatch)
-> INVALID_ARGUMENT, Unauthorized (mutual TLS write grants) -> PERMISSION_DENIED, NotFound ->
NOT_FOUND, Refused (expired, cancelled, stale epoch, busy) -> FAILED_PRECONDITION,
TransferTimeout -> DEADLINE_EXCEEDED, PeerUnavailable -> UNAVAILABLE.
The shared server's interceptor turns the raised `ServiceError` into the call's status.

SendPages is traced as kv.send (a child of the prefill worker's span; the receiving agent's
kv.receive is its child, through the write header) with the transfer report as attributes.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import grpc
from pdserve.common import errors as svc
from pdserve.common import wire
from pdserve.common.handoff import Destination
from pdserve.common.kv import errors
from pdserve.common.kv.spans import send_span
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.security import peer_identity
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.agent import Agent
from pdserve.v1 import common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc

F = TypeVar("F", bound=Callable[..., Any])

def _status(handler: F) -> F:
    """Re-raise the agent's errors as the ServiceError of their status code."""
    @functools.wraps(handler)
    def call(self: Any, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            return handler(self, request, context)
        except errors.KvTransferError as exc:
            raise svc.ServiceError(exc.message, errors.status_name(exc)) from None
    return call  # type: ignore[return-value]


def ticket_key(ticket: common_pb2.Ticket) -> TicketKey:
    if not ticket.request_id:
        raise errors.BadRequest("ticket.request_id is empty")
    return TicketKey(ticket.request_id, ticket.epoch)


def fingerprint(fp: common_pb2.LayoutFingerprint) -> LayoutFingerprint:
    try:
        return LayoutFingerprint(fp.model_id, fp.model_revision, fp.dtype, fp.num_layers,
                           fp.num_kv_heads, fp.head_dim, fp.block_size, fp.tp_rank, fp.tp_size)
    except ValueError as exc:
        raise errors.BadRequest(f"fingerprint: {exc}") from None


class KVTransferServicer(kvtransfer_pb2_grpc.KVTransferServicer):
    """Thin mapping of pdserve.v1.KVTransfer onto an `Agent`."""

    def __init__(self, agent: Agent):
        self.agent = agent

    @_status
    def RegisterPool(self, request: kvtransfer_pb2.RegisterPoolRequest,
                     context: grpc.ServicerContext) -> kvtransfer_pb2.RegisterPoolResponse:
        if request.cuda_ipc_handle:
            raise errors.BadRequest("CUDA IPC pools are not supported by this agent "
                                    "(CPU shared memory only): give shm_name")
        if not request.HasField("fingerprint"):
            raise errors.BadRequest("fingerprint is required")
        pool_id = self.agent.register_pool(request.worker_id, request.shm_name, request.num_pages,
                                           request.page_bytes, fingerprint(request.fingerprint))
        return kvtransfer_pb2.RegisterPoolResponse(pool_id=pool_id, agent_epoch=self.agent.epoch,
                                                   agent_id=self.agent.agent_id)

    @_status
    def GetAgentInfo(self, request: kvtransfer_pb2.GetAgentInfoRequest,
                     context: grpc.ServicerContext) -> kvtransfer_pb2.AgentInfo:
        info = self.agent.info()
        return kvtransfer_pb2.AgentInfo(agent_id=info.agent_id, epoch=info.epoch,
                                        ucx_worker_address=info.ucx_worker_address,
                                        tcp_address=info.tcp_address, transport=info.transport,
                                        pool_ids=list(info.pool_ids),
                                        local_socket=info.local_socket,
                                        local_token=info.local_token,
                                        same_host_copy=info.same_host_copy)

    @_status
    def ExpectTransfer(self, request: kvtransfer_pb2.ExpectTransferRequest,
                       context: grpc.ServicerContext) -> kvtransfer_pb2.ExpectTransferResponse:
        epoch = self.agent.expect(ticket_key(request.ticket), request.pool_id,
                                  list(request.page_ids), request.lease_ms)
        return kvtransfer_pb2.ExpectTransferResponse(agent_epoch=epoch)

    @_status
    def CancelTransfer(self, request: kvtransfer_pb2.CancelTransferRequest,
                       context: grpc.ServicerContext) -> kvtransfer_pb2.CancelTransferResponse:
        was_pending, was_complete = self.agent.cancel(ticket_key(request.ticket))
        return kvtransfer_pb2.CancelTransferResponse(was_pending=was_pending,
                                                     was_complete=was_complete)

    @_status
    def TransferStatus(self, request: kvtransfer_pb2.TransferStatusRequest,
                       context: grpc.ServicerContext) -> kvtransfer_pb2.TransferStatusResponse:
        status = self.agent.status(ticket_key(request.ticket))
        return kvtransfer_pb2.TransferStatusResponse(complete=status.complete,
                                                     kv_bytes=status.kv_bytes,
                                                     completed_unix_ms=status.completed_unix_ms)

    @_status
    def GrantWrite(self, request: kvtransfer_pb2.GrantWriteRequest,
                   context: grpc.ServicerContext) -> kvtransfer_pb2.GrantWriteResponse:
        grant = self.agent.grant(ticket_key(request.ticket), peer_identity(context),
                                 request.reply_to)
        return kvtransfer_pb2.GrantWriteResponse(grant=grant)

    def SendPages(self, request: kvtransfer_pb2.SendPagesRequest,
                  context: grpc.ServicerContext) -> kvtransfer_pb2.SendPagesResponse:
        with send_span(self.agent.agent_id, request.ticket.request_id,
                       request.destination.agent_address, len(request.src_page_ids)) as span:
            reply = self._send_pages(request, context)
            span.report(wire.report_from_pb(reply.report))
            return reply

    @_status
    def _send_pages(self, request: kvtransfer_pb2.SendPagesRequest,
                    context: grpc.ServicerContext) -> kvtransfer_pb2.SendPagesResponse:
        d = request.destination
        dest = Destination(d.agent_address, d.agent_epoch, d.pool_id, tuple(d.page_ids),
                           fingerprint(d.fingerprint) if d.HasField("fingerprint") else None)
        report = self.agent.send_pages(ticket_key(request.ticket), request.src_pool_id,
                                       list(request.src_page_ids), dest, request.timeout_ms)
        return kvtransfer_pb2.SendPagesResponse(report=wire.report_to_pb(report))
