"""The sending half of an agent: where a handoff's pages go, and how.

Per destination: the same agent -> one local copy; an agent on this host (shm.py) -> the
receiver copies out of this pool; otherwise the network transport (UCX or TCP), with one
retry on a fresh connection when nothing was accepted yet and the peer's liveness checked
while it waits. Every path builds the same write header (ticket, destination epoch and pool,
layout, runs) that the receiving side checks before a byte lands.

The sender holds its agent as a `SendingAgent` (owner.py): what it reads, not the agent module.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from pdserve.common import failpoints, fastcopy, tracing
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.kv.errors import (
    BadRequest,
    PeerUnavailable,
    SegmentUnavailable,
    StaleEpoch,
    TransportMismatch,
    cause,
)
from pdserve.common.kv.runs import PageRun, check_spans, coalesce
from pdserve.common.kv.wire import MAX_RUNS, WriteHeader, counted_liveness, expect_same
from pdserve.common.logs import outcome
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.owner import SendingAgent
from pdserve.kvtransfer.peers import PeerInfo
from pdserve.kvtransfer.pool import Pool
from pdserve.kvtransfer.receive import AgentSink, check_pages

log = logging.getLogger("pdserve.kvtransfer")


class Sender:
    """`Agent.send_pages` (thread-safe: it keeps no state of its own)."""

    def __init__(self, agent: SendingAgent):
        self._agent = agent

    def send_pages(self, key: TicketKey, src_pool_id: str, src_page_ids: Sequence[int],
                   dest: Destination, timeout_ms: float) -> TransferReport:
        """Copy the pages to the destination; returns once they are resident there."""
        try:
            report, peer = self._send_pages(key, src_pool_id, src_page_ids, dest, timeout_ms)
        except Exception as exc:
            self._agent.metrics.failed(cause(exc), "send")
            raise
        self._agent.metrics.sent(report.transport, report.kv_bytes, report.kv_pages,
                                 report.handoff_ms / 1e3, peer)
        return report

    def _send_pages(self, key: TicketKey, src_pool_id: str, src_page_ids: Sequence[int],
                    dest: Destination, timeout_ms: float) -> tuple[TransferReport, str]:
        """The report, and the destination agent's id."""
        started = time.perf_counter()
        failpoints.hit("kv.send", key.request_id)
        if timeout_ms < 0:
            raise BadRequest(f"timeout_ms must be >= 0 (0 = default), got {timeout_ms:g}")
        timeout_s = timeout_ms / 1e3 if timeout_ms > 0 else self._agent.default_timeout_s
        pool = self._agent.pool(src_pool_id)
        if not src_page_ids:
            raise BadRequest("src_page_ids is empty")
        try:
            runs = coalesce(src_page_ids, dest.page_ids)
            # coalesce refused repeats: the source pages' check is a few spans' bounds
            check_spans([(r.src_start, r.num_pages) for r in runs], pool.num_pages,
                        "src_page_ids")
        except ValueError as exc:
            check_pages(src_page_ids, pool.num_pages, "src_page_ids")  # names a bad page
            raise BadRequest(f"src_page_ids / destination.page_ids: {exc}") from None
        if dest.fingerprint is not None:
            expect_same(pool.fingerprint, dest.fingerprint, "source", "destination")
        if len(runs) > MAX_RUNS:
            raise BadRequest(f"{len(runs)} separate runs in one handoff (limit {MAX_RUNS})")
        header = WriteHeader(
            xfer_id=random.getrandbits(36), ticket=key, dst_agent_epoch=dest.agent_epoch,
            dst_pool_id=dest.pool_id, fingerprint=pool.fingerprint, page_bytes=pool.page_bytes,
            dst_runs=tuple((r.dst_start, r.num_pages) for r in runs), timeout_ms=timeout_s * 1e3,
            traceparent=tracing.traceparent(), sender=self._agent.agent_id)
        if dest.agent_epoch == self._agent.epoch:
            self._copy_local(header, pool, runs)
            transport, peer = "local", self._agent.agent_id
        else:
            transport, peer = self._send_remote(dest, header, pool, runs,
                                                time.monotonic() + timeout_s)
        elapsed_ms = (time.perf_counter() - started) * 1e3
        report = TransferReport(elapsed_ms, header.kv_bytes, len(src_page_ids), transport,
                                len(runs), elapsed_ms)
        if log.isEnabledFor(logging.DEBUG):
            outcome(log, "handoff", level=logging.DEBUG, request_id=key.request_id,
                    handoff_ms=report.handoff_ms, kv_bytes=report.kv_bytes,
                    runs=report.num_runs, transport=transport)
        return report, peer

    def _copy_local(self, header: WriteHeader, pool: Pool, runs: list[PageRun]) -> None:
        sink = AgentSink(self._agent, "local")
        write = sink.accept(header)
        ok = False
        try:
            for run, dst in zip(runs, write.dst_views):
                fastcopy.copy(dst, pool.pages(run.src_start, run.num_pages), header.kv_bytes)
            ok = True
        finally:
            sink.finish(write, ok)

    def _send_remote(self, dest: Destination, header: WriteHeader, pool: Pool,
                     runs: list[PageRun], deadline: float) -> tuple[str, str]:
        """Move the runs to another agent; returns the path taken ("shm" or the transport)
        and that agent's id."""
        a = self._agent
        for attempt in range(2):
            peer = a.peers.lookup(dest.agent_address, dest.agent_epoch)
            if a.ask_grants:
                header = replace(header, grant=a.peers.grant(
                    dest.agent_address, header.ticket, a.contact.ucx_worker_address))
            try:
                # a grant is bound to the reply_to it was asked for; without one, the
                # same-host copy has no use for it (and replace() costs on this path)
                if a.shm is not None and a.shm.usable(peer) and self._send_same_host(
                        peer, replace(header, reply_to=a.contact.ucx_worker_address)
                        if a.ask_grants else header, pool, runs, deadline):
                    return "shm", peer.agent_id
                if peer.transport != a.transport.name:
                    raise TransportMismatch(
                        f"this agent moves pages over {a.transport.name}, agent "
                        f"{peer.agent_id} at {peer.address} over {peer.transport}; run both "
                        "with the same --transport")
                views = [pool.pages(r.src_start, r.num_pages) for r in runs]
                a.transport.send(peer.contact, header, views,
                                 max(0.001, deadline - time.monotonic()),
                                 liveness=self._liveness(dest))
                return a.transport.name, peer.agent_id
            except (PeerUnavailable, StaleEpoch) as exc:
                a.peers.forget(dest.agent_address)
                a.transport.forget(peer.contact)
                if a.shm is not None:
                    a.shm.forget(dest.agent_address)
                retry = isinstance(exc, PeerUnavailable) and exc.retryable
                if attempt or not retry or time.monotonic() >= deadline:
                    raise
                log.info("handoff to %s: %s; asking the agent again", dest.agent_address, exc)
                header = replace(header, xfer_id=random.getrandbits(36))
        raise AssertionError("unreachable")

    def _send_same_host(self, peer: PeerInfo, header: WriteHeader, pool: Pool,
                        runs: list[PageRun], deadline: float) -> bool:
        """The same-host copy; False (and the peer remembered as remote) when it cannot be
        used, so the caller falls back to the network transport."""
        assert self._agent.shm is not None
        try:
            self._agent.shm.send(peer, header, pool, runs, deadline, self._liveness_of(peer))
            return True
        except SegmentUnavailable as exc:
            self._agent.shm.mark_remote(peer)
            log.info("agent %s at %s is not reachable on this host (%s): handoffs to it go "
                     "over %s", peer.agent_id, peer.address, exc, self._agent.transport.name)
            return False

    def _liveness(self, dest: Destination) -> Callable[[], None]:
        return self._check_alive(dest.agent_address, dest.agent_epoch)

    def _liveness_of(self, peer: PeerInfo) -> Callable[[], None]:
        return self._check_alive(peer.address, peer.epoch)

    def _check_alive(self, address: str, epoch: int) -> Callable[[], None]:
        """Raise StaleEpoch at once if the destination restarted, PeerUnavailable once its
        agent missed LIVENESS_FAILURES checks in a row."""
        return counted_liveness(lambda: self._agent.peers.check(address, epoch))
