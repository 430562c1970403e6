"""The decode worker: reservations on a paged pool, then continuous-batched decoding.

Request path on this side: `reserve` asks the lease book (worker/leases.py, the one owner of
a reservation) for pages and a write window on the host's agent; `decode` has the book close
the window, check the handoff landed and adopt the pages into a sequence of the running
batch; tokens stream back as steps produce them. `abort` releases a reservation or ends a
live sequence. A reservation whose handoff never comes expires with its lease.

When the router offers it (`PrefillHere`) and the part of the prompt this pool lacks is short,
`reserve` skips the handoff: it takes the pages and queues the prompt for this worker's own
next step at once, and the Decode call that follows (local_prefill) streams the sequence from
its first token (worker/here.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from pdserve.common import failpoints
from pdserve.common.errors import InvalidArgument, Unavailable
from pdserve.common.handoff import Destination
from pdserve.common.metrics import WorkerMetrics
from pdserve.common.tickets import TicketKey
from pdserve.engine.loop import EngineLoop, Outputs
from pdserve.worker.agent_client import AgentClient
from pdserve.worker.cache_feed import CacheFeed
from pdserve.worker.here import LocalPrefill
from pdserve.worker.leases import Lease, LeaseBook, WriteWindow
from pdserve.worker.pages import EnginePages
from pdserve.worker.ranks import RankPools, RankWindows, rank_destination
from pdserve.worker.streams import token_events
from pdserve.worker.types import (
    DecodeEvent,
    DecodeRequest,
    PrefillHere,
    Reservation,
    WorkerStats,
)

log = logging.getLogger("pdserve.decode")


class DecodeWorker:
    role = "decode"

    def __init__(self, loop: EngineLoop, agent: AgentClient, *, worker_id: str,
                 agent_address: str, default_lease_s: float = 30.0, token_wait_s: float = 120.0,
                 connect: Callable[[], AgentClient] | None = None):
        """`connect`: another client of the same agent, one per tensor-parallel rank > 0."""
        self.loop = loop
        self.engine = loop.engine
        self.agent = agent
        pools = self.engine.rank_pools[1:]
        if pools and connect is None:
            raise ValueError("a tensor-parallel decode worker needs `connect` (a client of its "
                             "agent per rank pool)")
        self.ranks = RankPools(worker_id, pools, connect) if pools and connect else None
        self.worker_id = worker_id
        self.model_id = self.engine.pool.fingerprint.model_id
        self.agent_address = agent_address
        self.default_lease_s = default_lease_s
        self.token_wait_s = token_wait_s
        self.epoch = time.time_ns() // 1000  # tickets from before a restart are recognisably stale
        self.pool_id = ""
        self.agent_epoch = 0
        self.admitting = True
        self.serving: Callable[[], bool] | None = None  # the server's health, once started
        self.metrics = WorkerMetrics(self.role, self.stats)
        self.cache_feed = CacheFeed(loop)
        self.leases: LeaseBook | None = None
        self.here = LocalPrefill(worker_id, self.role, loop, self.metrics, token_wait_s)

    def register(self) -> None:
        """Register the pool with the agent, then accept reservations."""
        pool = self.engine.pool
        self.pool_id, self.agent_epoch = self.agent.register_pool(
            self.worker_id, pool.fd, pool.num_pages, pool.page_bytes, pool.fingerprint,
            on_registered=self._registered)
        window: WriteWindow = self.agent.window()
        if self.ranks is not None:  # one window per rank's pool, opened and closed together
            self.ranks.register()
            window = RankWindows([window, *(a.window() for a in self.ranks.agents)])
        self.leases = LeaseBook(self.worker_id, self.epoch, EnginePages(self.loop), window,
                                default_lease_s=self.default_lease_s,
                                on_expired=lambda key: self.metrics.lease_expiries.inc())
        self.leases.start_reaper(also=self.here.expire)

    def _registered(self, pool_id: str, agent_epoch: int) -> None:
        # Again after an agent restart: reservations from now on name the new pool and epoch.
        self.pool_id, self.agent_epoch = pool_id, agent_epoch

    def reserve(self, request_id: str, num_prompt_tokens: int, lease_s: float,
                renew_s: float = 0.0, prompt_ids: list[int] | None = None,
                prefill_here: PrefillHere | None = None) -> Reservation:
        if not self.admitting or self.leases is None:
            raise Unavailable(f"decode worker {self.worker_id} is "
                              f"{'draining' if self.leases else 'starting'}")
        if request_id in self.engine.seqs:
            raise InvalidArgument(f"request {request_id} is already decoding on {self.worker_id}")
        if prefill_here is not None and prompt_ids and prefill_here.below_tokens > 1:
            started = self.here.reserve(  # (below 1 token: nothing can start)
                self.leases, TicketKey(request_id, self.epoch), lease_s, renew_s, prompt_ids,
                prefill_here.params, prefill_here.below_tokens,
                lambda cached_pages: self._destination([], cached_pages, 0))
            if started is not None:
                return started
        lease = self.leases.reserve(request_id, num_prompt_tokens, lease_s, renew_s,
                                    prompt_ids)
        cached_tokens = lease.cached_pages * self.engine.config.block_size
        if prompt_ids:
            self.metrics.note_prompt(num_prompt_tokens, cached_tokens)
        return Reservation(lease.key, self._destination(lease.page_ids, lease.cached_pages,
                                                        lease.boundary_key),
                           lease.renew_s, cached_tokens)

    def _destination(self, page_ids: list[int], cached_pages: int,
                     boundary_key: int) -> Destination:
        return rank_destination(
            Destination(self.agent_address, self.agent_epoch, self.pool_id, tuple(page_ids),
                        self.engine.pool.fingerprint, cached_pages, boundary_key), self.ranks)

    def renew(self, keys: list[TicketKey], renew_s: float) -> list[str]:
        """The router's heartbeat for the reservations it holds; returns those not held."""
        keys = self.here.renew(keys, renew_s)
        if self.leases is None:
            return [key.request_id for key in keys]
        return self.leases.renew(keys, renew_s)

    def decode(self, request: DecodeRequest) -> Iterator[DecodeEvent]:
        received = time.perf_counter()
        if self.leases is None:
            raise Unavailable(f"decode worker {self.worker_id} is starting")
        rid = request.ticket.request_id
        failpoints.hit("decode.start", rid)

        if request.local_prefill:
            yield from self.here.stream(request, received, lambda: self._adopt_here(request))
            return

        def into_batch(lease: Lease) -> tuple[str | None, object]:
            try:
                return self.loop.start_sequence(rid, lambda e: e.add_prefilled(
                    rid, lease.key, request.prompt_ids, request.first_token, request.params))
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None

        reason, outputs = self.leases.adopt(request.ticket, into_batch)
        try:
            yield DecodeEvent([], reason or "", (time.perf_counter() - received) * 1e3)
            if reason:
                self.metrics.finished.labels(reason).inc()
                return
            for event in token_events(outputs, rid, self.token_wait_s,  # type: ignore[arg-type]
                                      lambda why: self.metrics.finished.labels(why).inc()):
                failpoints.hit("decode.token", rid)
                yield event
        finally:
            self.loop.unsubscribe(rid)
            self._abort_sequence(rid)  # no-op when it finished

    def _adopt_here(self, request: DecodeRequest) -> Outputs:
        """A reservation (no start at Reserve) whose prompt this worker computes: close its
        window and queue the prompt into its pages."""
        rid = request.ticket.request_id

        def into_queue(lease: Lease) -> Outputs:
            try:
                return self.loop.start_sequence(rid, lambda e: e.add_request(
                    rid, request.prompt_ids, request.params, reservation=lease.key))[1]
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None

        assert self.leases is not None  # decode() checked it
        return self.leases.adopt(request.ticket, into_queue, handoff=False)

    def abort(self, ticket: TicketKey) -> bool:
        """Release the request's reservation, or end its live sequence."""
        if self.leases is not None and self.leases.release(ticket.request_id):
            return True
        if self.here.drop(ticket.request_id):
            return True
        return self._abort_sequence(ticket.request_id)

    def _abort_sequence(self, rid: str) -> bool:
        """End a live sequence now (False when it already ended), counted as finished by abort."""
        found = self.loop.abort(rid)
        if found:
            self.metrics.finished.labels("abort").inc()
        return found

    def stats(self) -> WorkerStats:
        e = self.engine
        return WorkerStats(self.worker_id, self.role, e.allocator.num_pages, e.allocator.num_free,
                           len(e.running), len(e.waiting), e.queued_prompt_tokens,
                           e.pool.fingerprint, reserved_tickets=len(self.leases or ()),
                           cached_pages=e.allocator.num_cached,
                           max_model_len=e.max_model_len)

    def stop(self) -> None:
        self.admitting = False
        self.here.close()
        self.cache_feed.close()
        if self.leases is not None:
            self.leases.close()
        if self.ranks is not None:
            self.ranks.close()
        self.agent.close()

