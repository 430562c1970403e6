"""The agent: local pools, expected writes, and the send path (local copy, same-host copy, or
a network transport).

One agent per host. Local workers register their pools (a nameless segment's descriptor over
the local socket, see local.py; or by shared-memory name over gRPC); the decode worker opens a
write window per ticket (`expect`) and closes it (`cancel`); the prefill worker asks for its
pages to be shipped (`send_pages`). Incoming writes arrive through a transport or the
same-host path, which call `accept` / `finish` on the agent's sink for them (receive.py).

Where pages go is decided per destination: the same agent -> one local copy; an agent on this
host (its local socket reachable and its token found there, see shm.py) -> it copies the pages
straight out of this pool, mapped read-only: one memory copy; else the network transport (UCX
or TCP). A same-host attempt that turns out impossible falls back to the network (sender.py).

`epoch` is drawn fresh at every start (milliseconds since 1970 shifted left 16 bits, plus 16
random bits): a sender that sees a different epoch than the one a reservation was made at
knows the destination restarted and its reservation is gone.

With mutual TLS (`grant_writes`), a write from a peer is accepted only for a ticket this agent
granted to that authenticated peer (pdserve.kvtransfer.grants), and a sender asks the
destination for the grant (GrantWrite, over the authenticated control channel) first.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pdserve.common import failpoints, tracing
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.kv.errors import (
    BadRequest,
    KvTransferError,
    TicketBusy,
    Unauthorized,
    UnknownPool,
    cause,
)
from pdserve.common.kv.wire import WriteHeader, fingerprint_bytes
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.metrics import AgentMetrics
from pdserve.common.security import ChannelSecurity
from pdserve.common.shm import SharedSegment
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.grants import GrantBook, GrantedSink
from pdserve.kvtransfer.native import NativeReceiver
from pdserve.kvtransfer.peers import PeerDirectory
from pdserve.kvtransfer.pool import Pool, map_by_name
from pdserve.kvtransfer.receive import AgentSink, check_pages, count_received
from pdserve.kvtransfer.sender import Sender
from pdserve.kvtransfer.shm import ShmSender
from pdserve.kvtransfer.tickets import Expectation, Status, TicketBook
from pdserve.kvtransfer.traced import traced_sink
from pdserve.kvtransfer.transport import PeerContact, Transport, WriteSink

log = logging.getLogger("pdserve.kvtransfer")

SWEEP_INTERVAL_S = 0.25
MAX_LEASE_S = 3600.0
# A sender asks for its grant right before it sends the header, so the grant has to outlive
# only that gap; a short life keeps the grants of tickets that never got a write few.
GRANT_TTL_S = 300.0


@dataclass(frozen=True)
class AgentInfo:
    agent_id: str
    epoch: int
    ucx_worker_address: bytes
    tcp_address: str
    transport: str
    pool_ids: tuple[str, ...]
    local_socket: str = ""
    local_token: bytes = b""
    same_host_copy: bool = False


def new_epoch() -> int:
    return ((time.time_ns() // 1_000_000) << 16) | secrets.randbits(16)


class Agent:
    """The host's KV transfer agent (thread-safe; see the module docstring)."""

    def __init__(self, agent_id: str, transport: Transport, *, default_timeout_s: float = 30.0,
                 cancel_wait_s: float = 10.0, retention_s: float = 60.0,
                 metrics: AgentMetrics | None = None, security: ChannelSecurity | None = None,
                 grant_writes: bool = False, local_socket: str = "",
                 same_host_copy: bool = False):
        self.agent_id = agent_id
        self.metrics = metrics or AgentMetrics()
        self.epoch = new_epoch()
        self.transport = transport
        self.default_timeout_s = default_timeout_s
        self.cancel_wait_s = cancel_wait_s
        # same-host writes served natively (native.py); not under mutual TLS (grants)
        self.native = NativeReceiver.create() if not grant_writes else None
        self.tickets = TicketBook(retention_s=retention_s, native_writes=self.native)
        self.peers = PeerDirectory(security=security)
        # Mutual TLS: writes need this agent's grant; sends ask the destination for one.
        self.grants = GrantBook(ttl_s=GRANT_TTL_S) if grant_writes else None
        self.ask_grants = security is not None and bool(security.cert)
        self.local_socket = local_socket
        self.local_token = secrets.token_bytes(16)
        self.same_host_copy = same_host_copy and bool(local_socket)
        self.shm = ShmSender(agent_id, self.peers) if self.same_host_copy else None
        self.shm_sink: WriteSink = AgentSink(self, "shm")
        self.contact = PeerContact(agent_id)
        self._sender = Sender(self)
        self._pools: dict[str, Pool] = {}
        self._lock = threading.Lock()
        self._next_pool = 0
        self._stop = threading.Event()
        self._janitor = threading.Thread(target=self._sweep_loop, name="kv-lease-sweep",
                                         daemon=True)

    def start(self) -> None:
        """Start the transport's receiving side and the lease sweeper."""
        self.shm_sink = self._guarded(AgentSink(self, "shm"), "shm")
        name = self.transport.name
        self.transport.receive_natively(
            self.native, lambda header, error: self.native_write_landed(header, error, name))
        contact = self.transport.start(self._guarded(AgentSink(self, name), name))
        self.contact = replace(contact, agent_id=self.agent_id)
        self._janitor.start()
        log.info("agent %s up: epoch %d, transport %s, local socket %s, same-host copy %s",
                 self.agent_id, self.epoch, self.transport.name, self.local_socket or "none",
                 "on" if self.same_host_copy else "off")

    def _guarded(self, sink: WriteSink, transport: str) -> WriteSink:
        """The sink with a kv.receive span per write, and the write grants under mutual TLS."""
        sink = traced_sink(sink, self.agent_id, transport)
        if self.grants is not None:
            sink = GrantedSink(sink, self.grants,
                               lambda: self.metrics.failed("unauthorized", "receive"))
        return sink

    def close(self) -> None:
        """Stop the transport, forget peers, unmap pools. Safe to call twice."""
        self._stop.set()
        self.transport.close()
        if self.shm is not None:
            self.shm.close()
        self.peers.close()
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    # ---- control plane ----------------------------------------------------------------
    def info(self) -> AgentInfo:
        with self._lock:
            pool_ids = tuple(self._pools)
        return AgentInfo(self.agent_id, self.epoch, self.contact.ucx_worker_address,
                         self.contact.tcp_address, self.transport.name, pool_ids,
                         self.local_socket, self.local_token, self.same_host_copy)

    def register_pool(self, worker_id: str, shm_name: str, num_pages: int, page_bytes: int,
                      fingerprint: LayoutFingerprint) -> str:
        """Map a named pool (RegisterPool over gRPC); returns its pool id. Registering the same
        pool again returns the same id."""
        if not worker_id or not shm_name:
            raise BadRequest("worker_id and shm_name are required")
        with self._lock:
            for pool in self._pools.values():
                if (pool.worker_id, pool.shm_name, pool.num_pages, pool.page_bytes,
                        pool.fingerprint) == (worker_id, shm_name, num_pages, page_bytes,
                                              fingerprint):
                    return pool.pool_id
        return self.add_pool(worker_id, map_by_name(shm_name, num_pages, page_bytes), num_pages,
                             page_bytes, fingerprint).pool_id

    def add_pool(self, worker_id: str, segment: SharedSegment, num_pages: int, page_bytes: int,
                 fingerprint: LayoutFingerprint) -> Pool:
        """Take a mapped segment as the worker's pool (closed here if refused). A worker's newer
        pool replaces its older one."""
        if not worker_id:
            segment.close()
            raise BadRequest("worker_id is required")
        with self._lock:
            self._next_pool += 1
            pool_id = f"{worker_id}/{self._next_pool}"
        try:
            pool = Pool(pool_id, worker_id, segment, num_pages, page_bytes, fingerprint,
                        self.native)
        except BaseException:
            segment.close()
            raise
        with self._lock:
            replaced = [p for p in self._pools.values() if p.worker_id == worker_id]
            for old in replaced:
                del self._pools[old.pool_id]
            self._pools[pool_id] = pool
        for old in replaced:
            self._retire(old)
        log.info("pool %s registered: %s, %d pages of %d bytes", pool_id,
                 segment.name or "nameless segment", num_pages, page_bytes)
        return pool

    def drop_pool(self, pool_id: str) -> bool:
        """Forget a pool whose worker is gone (its local connection closed); False if unknown."""
        with self._lock:
            pool = self._pools.pop(pool_id, None)
        if pool is None:
            return False
        self._retire(pool)
        log.info("pool %s dropped: its worker's connection closed", pool_id)
        return True

    def _retire(self, pool: Pool) -> None:
        if self.shm is not None:  # same-host peers unmap it once their connections close
            self.shm.forget_pool(pool.pool_id)
        pool.close()

    def expect(self, key: TicketKey, pool_id: str, page_ids: Sequence[int], lease_ms: float) -> int:
        """Accept writes for `key` into these pages until the lease passes; returns the epoch."""
        pool = self.pool(pool_id)
        check_pages(page_ids, pool.num_pages, "page_ids")
        if not 0 < lease_ms <= MAX_LEASE_S * 1e3:
            raise BadRequest(f"lease_ms must be in (0, {MAX_LEASE_S * 1e3:.0f}], got {lease_ms:g}")
        self.tickets.expect(key, pool_id, page_ids, lease_ms / 1e3,
                            arm=lambda exp: self._arm(exp, pool))
        return self.epoch

    def native_write_landed(self, header: WriteHeader, error: KvTransferError | None,
                            transport: str = "shm") -> None:
        """Count a write the native path served (its pages landed, or why not)."""
        if error is None:
            count_received(self, transport, header)
        else:
            self.metrics.failed(cause(error), "receive")

    def _arm(self, exp: Expectation, pool: Pool) -> bool:
        """Arm the ticket for the native write (same-host, or plain TCP), unless something
        must see each write: a kv.receive span (tracing) or a failpoint."""
        if self.native is None or tracing.enabled() or failpoints.active():
            return False
        return self.native.arm(exp.key, pool.native_handle, pool.pool_id, self.epoch,
                               fingerprint_bytes(pool.fingerprint), pool.page_bytes, exp.spans,
                               exp.lease_deadline)

    def cancel(self, key: TicketKey) -> tuple[bool, bool]:
        """Close the ticket; returns (was_pending, was_complete) once nothing writes for it."""
        if self.grants is not None:
            self.grants.drop(key)
        return self.tickets.cancel(key, self.cancel_wait_s)

    def grant(self, key: TicketKey, peer: str, reply_to: bytes) -> bytes:
        """A write grant for an expected ticket to the authenticated `peer` (see grants)."""
        if self.grants is None:
            raise Unauthorized(f"agent {self.agent_id} runs without mutual TLS: it grants no "
                               "writes (and needs none)")
        if self.tickets.status(key).complete:  # raises for unknown and closed tickets
            raise TicketBusy(f"ticket {key}: its pages have already landed")
        return self.grants.issue(key, peer, reply_to)

    def status(self, key: TicketKey) -> Status:
        return self.tickets.status(key)

    # ---- sending ----------------------------------------------------------------------
    def send_pages(self, key: TicketKey, src_pool_id: str, src_page_ids: Sequence[int],
                   dest: Destination, timeout_ms: float) -> TransferReport:
        """Copy the pages to the destination; returns once they are resident there."""
        return self._sender.send_pages(key, src_pool_id, src_page_ids, dest, timeout_ms)

    # ---- internals --------------------------------------------------------------------
    def pool(self, pool_id: str) -> Pool:
        with self._lock:
            pool = self._pools.get(pool_id)
        if pool is None:
            raise UnknownPool(f"no pool {pool_id!r} on agent {self.agent_id} (registered: "
                              f"{', '.join(self._pools) or 'none'})")
        return pool

    def _sweep_loop(self) -> None:
        while not self._stop.wait(SWEEP_INTERVAL_S):
            self.tickets.sweep()
            if self.grants is not None:
                self.grants.sweep()
