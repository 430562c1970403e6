"""A prefill worker's own lane to another host's agent over plain TCP: the pages go from this
worker's pool straight onto the data connection, with this host's agent out of the way.

Through the agent, a handoff to another host first crosses this host: the worker asks its
agent over the local socket, the agent checks and sends, the agent answers. For a short
prompt's page on a small machine that hop was ~0.6 ms of a 2.3 ms handoff (docs/kv-transfer.md).
Here the worker speaks the TCP transport's wire itself (pdserve.common.kv.tcpwire, the same
`TcpSender` the agent uses, with the agent's write size and socket buffers); the receiving
agent checks the write exactly as any peer's (ticket and epoch, pool, layout, pages; a cancel
stops it). This host's agent still decides which destinations qualify (`peer`: plain TCP on
both sides, no mutual TLS, since writes then need a grant only agents hold), answers whether a
destination still lives while the worker waits on it (`alive`), and counts what was sent
(`sent`). The lane's bookkeeping (routes, fallbacks, notes) is pdserve.worker.samehost's.
"""

from __future__ import annotations

import mmap
import socket
from collections.abc import Callable, Sequence

import numpy as np
from pdserve.common.errors import ServiceError
from pdserve.common.kv.errors import PeerUnavailable, StaleEpoch
from pdserve.common.kv.runs import PageRun
from pdserve.common.kv.tcpwire import Prepared, TcpSender
from pdserve.common.kv.wire import Liveness, WriteHeader, counted_liveness
from pdserve.worker.agent_client import AgentClient


class TcpLane:
    """Sends from one pool to other hosts' agents over TCP (thread-safe)."""

    def __init__(self, agent: AgentClient, pool_fd: int, num_pages: int, page_bytes: int):
        self._agent = agent
        self._page_bytes = page_bytes
        self._map = mmap.mmap(pool_fd, num_pages * page_bytes, prot=mmap.PROT_READ)
        self._pool = np.frombuffer(self._map, dtype=np.uint8)
        self._senders: dict[tuple[int, int], TcpSender] = {}  # by (write, buffer) bytes

    def sender(self, write_bytes: int, buffer_bytes: int) -> TcpSender:
        key = (write_bytes, buffer_bytes)
        sender = self._senders.get(key)
        if sender is None:  # a race makes two; the loser's connections are closed with it
            sender = self._senders.setdefault(
                key, TcpSender(buffer_bytes=buffer_bytes, write_bytes=write_bytes))
        return sender

    def views(self, runs: Sequence[PageRun]) -> list[np.ndarray]:
        b = self._page_bytes
        return [self._pool[r.src_start * b:(r.src_start + r.num_pages) * b] for r in runs]

    def prepare(self, sender: TcpSender, address: str, header: WriteHeader,
                runs: Sequence[PageRun], timeout_s: float) -> Prepared | None:
        """An eager handoff ready to go (`TcpSender.prepare`)."""
        return sender.prepare(address, header, self.views(runs), timeout_s)

    def send(self, sender: TcpSender, address: str, header: WriteHeader,
             runs: Sequence[PageRun], timeout_s: float, agent_address: str,
             attach: Callable[[socket.socket | None], None], begun: Prepared | None = None
             ) -> None:
        """One handoff (or the rest of a begun one); the receiver's refusal, TransferTimeout
        or PeerUnavailable as the agent's transport raises them."""
        sender.send(address, header, self.views(runs), timeout_s,
                    self._liveness(agent_address, header.dst_agent_epoch), attach, begun)

    def _liveness(self, address: str, epoch: int) -> Liveness:
        def ask() -> None:
            try:
                reply = self._agent.call({"op": "alive", "address": address, "epoch": epoch},
                                         "the destination agent's liveness", 5.0)
            except ServiceError as exc:  # this host's agent is gone: count it as unanswered
                raise PeerUnavailable(f"agent {address}: {exc}") from None
            if reply.get("stale"):
                raise StaleEpoch(str(reply.get("message")))
            if not reply.get("alive"):
                raise PeerUnavailable(f"agent {address} stopped answering: "
                                      f"{reply.get('message')}")
        return counted_liveness(ask)

    def close(self) -> None:
        for sender in list(self._senders.values()):
            sender.close()
        self._pool = np.empty(0, np.uint8)  # views still in use keep the mapping alive
