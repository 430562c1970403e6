"""The co-located worker: one engine doing both phases, behind the Prefill and Decode APIs.

It exists for comparison with the disaggregated path: the router drives it exactly as it
drives a prefill/decode pair (reserve, prefill, decode stream). It is composed of the same
parts as the two roles: a lease book without a write window (this process writes its own
pages: the prompt's KV goes straight into the reserved pages), the first-token wait of the
prefill role and the token stream of the decode role. The handoff is `local` and moves no
bytes; the sequence keeps decoding in the same batch.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from pdserve.common.errors import FailedPrecondition, InvalidArgument, Unavailable
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.metrics import WorkerMetrics, count_outcome
from pdserve.common.tickets import TicketKey
from pdserve.engine.loop import EngineLoop, Outputs
from pdserve.engine.sampling import SamplingParams
from pdserve.worker.cache_feed import CacheFeed
from pdserve.worker.here import LocalPrefill
from pdserve.worker.leases import Lease, LeaseBook
from pdserve.worker.pages import EnginePages
from pdserve.worker.streams import first_output, token_events
from pdserve.worker.types import (
    DecodeEvent,
    DecodeRequest,
    PrefillHere,
    PrefillRequest,
    PrefillResult,
    Reservation,
    WorkerStats,
)


class ColocatedWorker:
    role = "colocated"

    def __init__(self, loop: EngineLoop, *, worker_id: str, default_lease_s: float = 30.0,
                 prefill_wait_s: float = 300.0, token_wait_s: float = 120.0):
        self.loop = loop
        self.engine = loop.engine
        self.worker_id = worker_id
        self.model_id = self.engine.pool.fingerprint.model_id
        self.prefill_wait_s = prefill_wait_s
        self.token_wait_s = token_wait_s
        self.epoch = time.time_ns() // 1000
        self.pool_id = "local"
        self.admitting = True
        self.serving: Callable[[], bool] | None = None  # the server's health, once started
        self.metrics = WorkerMetrics(self.role, self.stats)
        self.cache_feed = CacheFeed(loop)
        self.leases = LeaseBook(worker_id, self.epoch, EnginePages(loop), None,
                                default_lease_s=default_lease_s,
                                on_expired=lambda key: self.metrics.lease_expiries.inc())
        self.here = LocalPrefill(worker_id, "co-located", loop, self.metrics, token_wait_s)
        self._streams: dict[str, Outputs] = {}  # prefilled, waiting for their Decode call
        self._lock = threading.Lock()

    def register(self) -> None:
        self.leases.start_reaper(also=self.here.expire)

    # ---- the Decode API's reservation, then the Prefill API ---------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int, lease_s: float,
                renew_s: float = 0.0, prompt_ids: list[int] | None = None,
                prefill_here: PrefillHere | None = None) -> Reservation:
        """Pages for the prompt; with `prefill_here` (any length: every prompt is computed
        here) the prompt is queued at once for the Decode call, else for a Prefill call."""
        if not self.admitting:
            raise Unavailable(f"co-located worker {self.worker_id} is draining")
        if prefill_here is not None and prompt_ids:
            started = self.here.reserve(
                self.leases, TicketKey(request_id, self.epoch), lease_s, renew_s, prompt_ids,
                prefill_here.params, len(prompt_ids) + 1,  # more than it lacks: always started
                lambda cached_pages: self._destination((), cached_pages, 0))
            assert started is not None
            return started
        lease = self.leases.reserve(request_id, num_prompt_tokens, lease_s, renew_s,
                                    prompt_ids)
        return Reservation(lease.key, self._destination(tuple(lease.page_ids),
                                                        lease.cached_pages, lease.boundary_key),
                           lease.renew_s, lease.cached_pages * self.engine.config.block_size)

    def _destination(self, page_ids: tuple[int, ...], cached_pages: int,
                     boundary_key: int) -> Destination:
        return Destination("local", 0, self.pool_id, page_ids, self.engine.pool.fingerprint,
                           cached_pages, boundary_key)

    def renew(self, keys: list[TicketKey], renew_s: float) -> list[str]:
        return self.leases.renew(self.here.renew(keys, renew_s), renew_s)

    def prefill(self, request: PrefillRequest, cancelled: threading.Event) -> PrefillResult:
        with count_outcome(self.metrics.prefills):
            return self._prefill(request)

    def _prefill(self, request: PrefillRequest) -> PrefillResult:
        received = time.perf_counter()
        rid = request.request_id
        outputs = self._adopt(request.ticket, request.token_ids, request.params)
        try:
            out = first_output(outputs, rid, self.prefill_wait_s, lambda: None)
        except BaseException:
            self._forget(rid)
            raise
        if out.finish_reason:
            self.loop.unsubscribe(rid)
        else:
            with self._lock:
                self._streams[rid] = outputs
        queue_ms = max(0.0, (time.perf_counter() - received) * 1e3 - out.prefill_ms)
        self.metrics.note_prompt(len(request.token_ids), out.cached_tokens)
        return PrefillResult(out.token or 0, out.finish_reason, queue_ms, out.prefill_ms,
                             TransferReport(transport="local"), out.cached_tokens)

    def _adopt(self, ticket: TicketKey, prompt_ids: list[int], params: SamplingParams
               ) -> Outputs:
        """Queue a reserved prompt (its KV goes straight into the reserved pages)."""
        rid = ticket.request_id

        def into_queue(lease: Lease) -> Outputs:
            try:
                _, outputs = self.loop.start_sequence(rid, lambda e: e.add_request(
                    rid, prompt_ids, params, reservation=lease.key))
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            return outputs

        return self.leases.adopt(ticket, into_queue)

    def decode(self, request: DecodeRequest) -> Iterator[DecodeEvent]:
        rid = request.ticket.request_id
        if request.local_prefill:  # queued at Reserve (or, from an older router, now)
            yield from self.here.stream(request, time.perf_counter(), lambda: self._adopt(
                request.ticket, request.prompt_ids, request.params))
            return
        with self._lock:
            outputs = self._streams.pop(rid, None)
        if outputs is None:
            raise FailedPrecondition(f"no prefilled sequence {rid} on {self.worker_id}")
        try:
            yield DecodeEvent([], "", 0.0)
            yield from token_events(outputs, rid, self.token_wait_s,
                                    lambda why: self.metrics.finished.labels(why).inc())
        finally:
            self._forget(rid)

    # ---- cancellation -----------------------------------------------------------------
    def cancel(self, request_id: str) -> None:
        self._forget(request_id)

    def abort(self, ticket: TicketKey) -> bool:
        if self.leases.release(ticket.request_id) or self.here.drop(ticket.request_id):
            return True
        return self._forget(ticket.request_id)

    def _forget(self, rid: str) -> bool:
        """End the sequence (waking a prefill still waiting on it) and drop its stream."""
        found = self.loop.abort(rid)
        if found:
            self.metrics.finished.labels("abort").inc()
        with self._lock:
            self._streams.pop(rid, None)
        self.loop.unsubscribe(rid)
        return found

    def stats(self) -> WorkerStats:
        e = self.engine
        return WorkerStats(self.worker_id, self.role, e.allocator.num_pages, e.allocator.num_free,
                           len(e.running), len(e.waiting), e.queued_prompt_tokens,
                           e.pool.fingerprint, reserved_tickets=len(self.leases),
                           cached_pages=e.allocator.num_cached,
                           max_model_len=e.max_model_len)

    def stop(self) -> None:
        self.admitting = False
        self.here.close()
        self.cache_feed.close()
        self.leases.close()
