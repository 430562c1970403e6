"""The workers' side of the host's kvtransfer agent: thin calls over the KVTransfer stubs."""

from __future__ import annotations

import dataclasses
from typing import Any

import grpc
from pdserve.common import tracing
from pdserve.v1 import common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc


def fingerprint_pb(fp: Any) -> common_pb2.LayoutFingerprint:
    """The proto of an engine `LayoutFingerprint` (same field names)."""
    return common_pb2.LayoutFingerprint(**dataclasses.asdict(fp))


class AgentClient:
    """Calls to the local agent; every call carries a deadline."""

    def __init__(self, address: str, timeout_s: float = 10.0):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = grpc.insecure_channel(address)
        self.stub = kvtransfer_pb2_grpc.KVTransferStub(self._channel)

    def wait_ready(self, timeout_s: float) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s)
        except grpc.FutureTimeoutError:
            raise ConnectionError(f"kvtransfer agent at {self.address} not reachable "
                                  f"after {timeout_s:.0f}s (is `pdserve kvtransfer` running?)") from None

    def register_pool(self, worker_id: str, shm_name: str, num_pages: int, page_bytes: int,
                      fingerprint: common_pb2.LayoutFingerprint) -> kvtransfer_pb2.RegisterPoolResponse:
        return self.stub.RegisterPool(kvtransfer_pb2.RegisterPoolRequest(
            worker_id=worker_id, shm_name=shm_name, num_pages=num_pages, page_bytes=page_bytes,
            fingerprint=fingerprint), timeout=self.timeout_s, wait_for_ready=True)

    def info(self) -> kvtransfer_pb2.AgentInfo:
        return self.stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(), timeout=self.timeout_s)

    def expect(self, ticket: common_pb2.Ticket, pool_id: str, page_ids: list[int],
               lease_ms: float) -> kvtransfer_pb2.ExpectTransferResponse:
        return self.stub.ExpectTransfer(kvtransfer_pb2.ExpectTransferRequest(
            ticket=ticket, pool_id=pool_id, page_ids=page_ids, lease_ms=lease_ms),
            timeout=self.timeout_s)

    def cancel(self, ticket: common_pb2.Ticket) -> kvtransfer_pb2.CancelTransferResponse:
        # The agent may wait for an in-flight write to stop before it answers (its
        # --cancel-wait-s); give it longer than that, so "timed out" means it could not.
        return self.stub.CancelTransfer(kvtransfer_pb2.CancelTransferRequest(ticket=ticket),
                                        timeout=2 * self.timeout_s)

    def status(self, ticket: common_pb2.Ticket) -> kvtransfer_pb2.TransferStatusResponse:
        return self.stub.TransferStatus(kvtransfer_pb2.TransferStatusRequest(ticket=ticket),
                                        timeout=self.timeout_s)

    def send_async(self, ticket: common_pb2.Ticket, src_pool_id: str, src_page_ids: list[int],
                   destination: common_pb2.KVDestination, timeout_s: float) -> grpc.Future:
        """Start shipping pages; the future (cancellable) gives a SendPagesResponse. The
        agent's kv.send span continues the current trace."""
        return self.stub.SendPages.future(kvtransfer_pb2.SendPagesRequest(
            ticket=ticket, src_pool_id=src_pool_id, src_page_ids=src_page_ids,
            destination=destination, timeout_ms=timeout_s * 1e3), timeout=timeout_s + 1.0,
            metadata=tracing.outgoing_metadata())

    def close(self) -> None:
        self._channel.close()
