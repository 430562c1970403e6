"""The agent: local pools, expected writes, and the send path (local copy or a transport).

One agent per host. Local workers register their pools (shared memory, attached by name);
the decode worker opens a write window per ticket (`expect`) and closes it (`cancel`); the
prefill worker asks for its pages to be shipped (`send_pages`). Incoming writes from peers
arrive through the transport, which asks `accept` / `finish` (the `WriteSink` contract).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from pdserve.common import tracing
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.logs import outcome
from pdserve.common.metrics import AgentMetrics
from pdserve.common.security import ChannelSecurity
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.errors import (
    BadRequest,
    PeerUnavailable,
    StaleEpoch,
    TicketBusy,
    TransportMismatch,
    Unauthorized,
    UnknownPool,
    cause,
)
from pdserve.kvtransfer.grants import GrantBook, GrantedSink
from pdserve.kvtransfer.peers import PeerDirectory
from pdserve.kvtransfer.pool import Pool, expect_same
from pdserve.kvtransfer.runs import check_page_ids, coalesce, expand
from pdserve.kvtransfer.tickets import Status, TicketBook
from pdserve.kvtransfer.traced import traced_sink
from pdserve.kvtransfer.transport import IncomingWrite, PeerContact, Transport
from pdserve.kvtransfer.wire import MAX_RUNS, WriteHeader

log = logging.getLogger("pdserve.kvtransfer")

SWEEP_INTERVAL_S = 0.25
MAX_LEASE_S = 3600.0
# A sender asks for its grant right before it sends the header, so the grant has to outlive
# only that gap; a short life keeps the grants of tickets that never got a write few.
GRANT_TTL_S = 300.0
LIVENESS_FAILURES = 3  # consecutive unanswered GetAgentInfo calls before a sender gives up


@dataclass(frozen=True)
class AgentInfo:
    agent_id: str
    epoch: int
    ucx_worker_address: bytes
    tcp_address: str
    transport: str
    pool_ids: tuple[str, ...]


def new_epoch() -> int:
    return ((time.time_ns() // 1_000_000) << 16) | secrets.randbits(16)


class Agent:
    """The host's KV transfer agent (thread-safe; see the module docstring)."""

    def __init__(self, agent_id: str, transport: Transport, *, default_timeout_s: float = 30.0,
                 cancel_wait_s: float = 10.0, retention_s: float = 60.0,
                 metrics: AgentMetrics | None = None, security: ChannelSecurity | None = None,
                 grant_writes: bool = False):
        self.agent_id = agent_id
        self.metrics = metrics or AgentMetrics()
        self.epoch = new_epoch()
        self.transport = transport
        self.default_timeout_s = default_timeout_s
        self.cancel_wait_s = cancel_wait_s
        self.tickets = TicketBook(retention_s=retention_s)
        self.peers = PeerDirectory(security=security)
        # Mutual TLS: writes need this agent's grant; sends ask the destination for one.
        self.grants = GrantBook(ttl_s=GRANT_TTL_S) if grant_writes else None
        self._ask_grants = security is not None and bool(security.cert)
        self._contact = PeerContact(agent_id)
        self._pools: dict[str, Pool] = {}
        self._lock = threading.Lock()
        self._next_pool = 0
        self._stop = threading.Event()
        self._janitor = threading.Thread(target=self._sweep_loop, name="kv-lease-sweep",
                                         daemon=True)

    def start(self) -> None:
        """Start the transport's receiving side and the lease sweeper."""
        sink = traced_sink(self, self.agent_id, self.transport.name)
        if self.grants is not None:
            sink = GrantedSink(sink, self.grants,
                               lambda: self.metrics.failed("unauthorized", "receive"))
        contact = self.transport.start(sink)
        self._contact = replace(contact, agent_id=self.agent_id)
        self._janitor.start()
        log.info("agent %s up: epoch %d, transport %s", self.agent_id, self.epoch,
                 self.transport.name)

    def close(self) -> None:
        """Stop the transport, forget peers, unmap pools. Safe to call twice."""
        self._stop.set()
        self.transport.close()
        self.peers.close()
        with self._lock:
            pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()

    # ---- control plane ----------------------------------------------------------------
    def info(self) -> AgentInfo:
        with self._lock:
            pool_ids = tuple(self._pools)
        return AgentInfo(self.agent_id, self.epoch, self._contact.ucx_worker_address,
                         self._contact.tcp_address, self.transport.name, pool_ids)

    def register_pool(self, worker_id: str, shm_name: str, num_pages: int, page_bytes: int,
                      fingerprint: LayoutFingerprint) -> str:
        """Map a worker's pool; returns its pool id. A worker's newer pool replaces its older."""
        if not worker_id or not shm_name:
            raise BadRequest("worker_id and shm_name are required")
        with self._lock:
            for pool in self._pools.values():
                if (pool.worker_id, pool.shm_name, pool.num_pages, pool.page_bytes,
                        pool.fingerprint) == (worker_id, shm_name, num_pages, page_bytes,
                                              fingerprint):
                    return pool.pool_id
            self._next_pool += 1
            pool_id = f"{worker_id}/{self._next_pool}"
        pool = Pool(pool_id, worker_id, shm_name, num_pages, page_bytes, fingerprint)
        with self._lock:
            replaced = [p for p in self._pools.values() if p.worker_id == worker_id]
            for old in replaced:
                del self._pools[old.pool_id]
            self._pools[pool_id] = pool
        for old in replaced:
            old.close()
        log.info("pool %s registered: %s, %d pages of %d bytes", pool_id, shm_name, num_pages,
                 page_bytes)
        return pool_id

    def expect(self, key: TicketKey, pool_id: str, page_ids: Sequence[int], lease_ms: float) -> int:
        """Accept writes for `key` into these pages until the lease passes; returns the epoch."""
        pool = self._pool(pool_id)
        _check_pages(page_ids, pool.num_pages, "page_ids")
        if not 0 < lease_ms <= MAX_LEASE_S * 1e3:
            raise BadRequest(f"lease_ms must be in (0, {MAX_LEASE_S * 1e3:.0f}], got {lease_ms:g}")
        self.tickets.expect(key, pool_id, page_ids, lease_ms / 1e3)
        return self.epoch

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
        try:
            report, peer = self._send_pages(key, src_pool_id, src_page_ids, dest, timeout_ms)
        except Exception as exc:
            self.metrics.failed(cause(exc), "send")
            raise
        self.metrics.sent(report.transport, report.kv_bytes, report.kv_pages,
                          report.handoff_ms / 1e3, peer)
        return report

    def _send_pages(self, key: TicketKey, src_pool_id: str, src_page_ids: Sequence[int],
                    dest: Destination, timeout_ms: float) -> tuple[TransferReport, str]:
        """The report, and the destination agent's id."""
        started = time.perf_counter()
        if timeout_ms < 0:
            raise BadRequest(f"timeout_ms must be >= 0 (0 = default), got {timeout_ms:g}")
        timeout_s = timeout_ms / 1e3 if timeout_ms > 0 else self.default_timeout_s
        pool = self._pool(src_pool_id)
        if not src_page_ids:
            raise BadRequest("src_page_ids is empty")
        _check_pages(src_page_ids, pool.num_pages, "src_page_ids")
        if dest.fingerprint is not None:
            expect_same(pool.fingerprint, dest.fingerprint, "source", "destination")
        try:
            runs = coalesce(src_page_ids, dest.page_ids)
        except ValueError as exc:
            raise BadRequest(f"src_page_ids / destination.page_ids: {exc}") from None
        if len(runs) > MAX_RUNS:
            raise BadRequest(f"{len(runs)} separate runs in one handoff (limit {MAX_RUNS})")
        header = WriteHeader(
            xfer_id=secrets.randbits(36), ticket=key, dst_agent_epoch=dest.agent_epoch,
            dst_pool_id=dest.pool_id, fingerprint=pool.fingerprint, page_bytes=pool.page_bytes,
            dst_runs=tuple((r.dst_start, r.num_pages) for r in runs), timeout_ms=timeout_s * 1e3,
            traceparent=tracing.traceparent(), sender=self.agent_id)
        views = [pool.pages(r.src_start, r.num_pages) for r in runs]
        if dest.agent_epoch == self.epoch:
            self._copy_local(header, views)
            transport, peer = "local", self.agent_id
        else:
            peer = self._send_remote(dest, header, views, time.monotonic() + timeout_s)
            transport = self.transport.name
        report = TransferReport((time.perf_counter() - started) * 1e3, header.kv_bytes,
                                len(src_page_ids), transport, len(runs))
        outcome(log, "handoff", level=logging.DEBUG, request_id=key.request_id,
                handoff_ms=report.handoff_ms, kv_bytes=report.kv_bytes, runs=report.num_runs,
                transport=transport)
        return report, peer

    def _copy_local(self, header: WriteHeader, views: list[np.ndarray]) -> None:
        write = self.accept(header)
        ok = False
        try:
            for src, dst in zip(views, write.dst_views):
                np.copyto(dst, src)
            ok = True
        finally:
            self._finish(write, ok, "local")

    def _send_remote(self, dest: Destination, header: WriteHeader, views: list[np.ndarray],
                     deadline: float) -> str:
        """Push the handoff to the destination's agent; returns that agent's id."""
        for attempt in range(2):
            peer = self.peers.lookup(dest.agent_address, dest.agent_epoch)
            if peer.transport != self.transport.name:
                raise TransportMismatch(f"this agent moves pages over {self.transport.name}, "
                                        f"agent {peer.agent_id} at {peer.address} over "
                                        f"{peer.transport}; run both with the same --transport")
            if self._ask_grants:
                header = replace(header, grant=self.peers.grant(
                    dest.agent_address, header.ticket, self._contact.ucx_worker_address))
            try:
                self.transport.send(peer.contact, header, views,
                                    max(0.001, deadline - time.monotonic()),
                                    liveness=self._liveness(dest))
                return peer.agent_id
            except (PeerUnavailable, StaleEpoch) as exc:
                self.peers.forget(dest.agent_address)
                self.transport.forget(peer.contact)
                retry = isinstance(exc, PeerUnavailable) and exc.retryable
                if attempt or not retry or time.monotonic() >= deadline:
                    raise
                log.info("handoff to %s: %s; asking the agent again", dest.agent_address, exc)
                header = replace(header, xfer_id=secrets.randbits(36))
        raise AssertionError("unreachable: the second attempt returns or raises")

    def _liveness(self, dest: Destination) -> Callable[[], None]:
        """Raise StaleEpoch at once if the destination restarted, PeerUnavailable once its
        agent missed LIVENESS_FAILURES checks in a row."""
        failures = 0

        def check() -> None:
            nonlocal failures
            try:
                self.peers.check(dest.agent_address, dest.agent_epoch)
                failures = 0
            except PeerUnavailable:
                failures += 1
                if failures >= LIVENESS_FAILURES:
                    raise
        return check

    # ---- receiving (the transport's WriteSink) -----------------------------------------
    def accept(self, header: WriteHeader) -> IncomingWrite:
        """Check an incoming handoff against what `expect` registered; open the write."""
        try:
            return self._accept(header)
        except Exception as exc:
            self.metrics.failed(cause(exc), "receive")
            raise

    def _accept(self, header: WriteHeader) -> IncomingWrite:
        if header.dst_agent_epoch != self.epoch:
            raise StaleEpoch(f"agent {self.agent_id} is at epoch {self.epoch}, the handoff was "
                             f"addressed to epoch {header.dst_agent_epoch}: the agent restarted "
                             "since the pages were reserved")
        pool = self._pool(header.dst_pool_id)
        expect_same(pool.fingerprint, header.fingerprint, "destination", "source")
        if header.page_bytes != pool.page_bytes:
            raise BadRequest(f"page_bytes: source {header.page_bytes} != destination "
                             f"{pool.page_bytes}")
        try:
            page_ids = expand(header.dst_runs)
        except ValueError as exc:
            raise BadRequest(f"destination runs: {exc}") from None
        _check_pages(page_ids, pool.num_pages, "destination pages")
        exp = self.tickets.begin_write(header.ticket, pool.pool_id, page_ids)
        views = [pool.pages(start, n) for start, n in header.dst_runs]
        return IncomingWrite(header, views, exp.abort, exp)

    def finish(self, write: IncomingWrite, ok: bool) -> None:
        self._finish(write, ok, self.transport.name)

    def _finish(self, write: IncomingWrite, ok: bool, transport: str) -> None:
        kv_bytes = write.header.kv_bytes
        try:
            self.tickets.finish_write(write.handle, ok, kv_bytes)
        except Exception as exc:
            self.metrics.failed(cause(exc), "receive")
            raise
        if ok:
            self.metrics.received(transport, kv_bytes, sum(n for _, n in write.header.dst_runs),
                                  write.header.sender)
        else:
            self.metrics.failed("incomplete", "receive")

    # ---- internals --------------------------------------------------------------------
    def _pool(self, pool_id: str) -> Pool:
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


def _check_pages(page_ids: Sequence[int], num_pages: int, what: str) -> None:
    try:
        check_page_ids(page_ids, num_pages, what)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
