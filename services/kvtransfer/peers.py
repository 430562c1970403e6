"""Remote agents as a sender knows them: their AgentInfo, fetched over gRPC and cached.

The cache is keyed by the agent's gRPC address and trusted only while the epoch a handoff
names (the epoch the destination agent had when the pages were reserved) equals the cached
one; otherwise it is fetched again, and a destination that has really restarted since the
reservation is refused as a stale epoch. A send that fails on the data path drops the entry too.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
from pdserve.common import wire
from pdserve.common.kv.errors import (
    BadRequest,
    KvTransferError,
    PeerUnavailable,
    Refused,
    StaleEpoch,
    Unauthorized,
    UnknownTicket,
)
from pdserve.common.security import ChannelSecurity, open_channel
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.transport import PeerContact
from pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc

_GRANT_ERRORS: dict[grpc.StatusCode, type[KvTransferError]] = {
    grpc.StatusCode.PERMISSION_DENIED: Unauthorized,
    grpc.StatusCode.UNAUTHENTICATED: Unauthorized,
    grpc.StatusCode.NOT_FOUND: UnknownTicket,
    grpc.StatusCode.FAILED_PRECONDITION: Refused,
    grpc.StatusCode.INVALID_ARGUMENT: BadRequest,
}


@dataclass(frozen=True)
class PeerInfo:
    address: str
    agent_id: str
    epoch: int
    transport: str
    contact: PeerContact
    local_socket: str = ""  # reachable from this host only if the peer shares it
    local_token: bytes = b""
    same_host_copy: bool = False


class PeerDirectory:
    """AgentInfo of remote agents by gRPC address; thread-safe."""

    def __init__(self, rpc_timeout_s: float = 5.0, security: ChannelSecurity | None = None):
        self._rpc_timeout_s = rpc_timeout_s
        self._security = security
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._infos: dict[str, PeerInfo] = {}

    def lookup(self, address: str, epoch: int) -> PeerInfo:
        """The agent at `address`, which must still be at `epoch` (else StaleEpoch)."""
        with self._lock:
            info = self._infos.get(address)
        if info is None or info.epoch != epoch:
            info = self.refresh(address)
        _expect_epoch(info, epoch)
        return info

    def check(self, address: str, epoch: int) -> None:
        """Ask the agent again; raise StaleEpoch if it restarted, PeerUnavailable if gone."""
        _expect_epoch(self.refresh(address), epoch)

    def refresh(self, address: str) -> PeerInfo:
        """Fetch the agent's info now (GetAgentInfo) and cache it."""
        if not address:
            raise PeerUnavailable("destination.agent_address is empty")
        try:
            reply = self._stub(address).GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(),
                                                     timeout=self._rpc_timeout_s)
        except grpc.RpcError as exc:
            self.forget(address)
            raise PeerUnavailable(f"kvtransfer agent at {address} did not answer GetAgentInfo: "
                                  f"{exc.code().name}: {exc.details()}", retryable=True) from None
        info = PeerInfo(address, reply.agent_id, reply.epoch, reply.transport,
                        PeerContact(reply.agent_id, reply.ucx_worker_address, reply.tcp_address),
                        reply.local_socket, reply.local_token, reply.same_host_copy)
        with self._lock:
            self._infos[address] = info
        return info

    def grant(self, address: str, key: TicketKey, reply_to: bytes) -> bytes:
        """Ask the agent at `address` for its write grant for `key` (mutual TLS; see grants)."""
        try:
            reply = self._stub(address).GrantWrite(kvtransfer_pb2.GrantWriteRequest(
                ticket=wire.ticket_to_pb(key),
                reply_to=reply_to), timeout=self._rpc_timeout_s)
        except grpc.RpcError as exc:
            message = (f"kvtransfer agent at {address} refused a write grant for ticket {key}: "
                       f"{exc.code().name}: {exc.details()}")
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                raise PeerUnavailable(message, retryable=True) from None
            kind = _GRANT_ERRORS.get(exc.code(), PeerUnavailable)
            raise kind(message) from None
        return bytes(reply.grant)

    def forget(self, address: str) -> None:
        with self._lock:
            self._infos.pop(address, None)

    def close(self) -> None:
        with self._lock:
            channels, self._channels = self._channels, {}
            self._infos.clear()
        for channel in channels.values():
            channel.close()

    def _stub(self, address: str) -> kvtransfer_pb2_grpc.KVTransferStub:
        with self._lock:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = open_channel(address, self._security)
        return kvtransfer_pb2_grpc.KVTransferStub(channel)


def _expect_epoch(info: PeerInfo, epoch: int) -> None:
    if info.epoch != epoch:
        raise StaleEpoch(f"destination agent {info.agent_id} at {info.address} restarted: the "
                         f"pages were reserved at agent epoch {epoch}, it is now at epoch "
                         f"{info.epoch}; the reservation is gone")
