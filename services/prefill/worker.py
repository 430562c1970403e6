"""The prefill worker: prompt -> KV pages + first token, then the pages shipped to decode.

Latency first: prompts are batched only as far as the engine's per-step token budget, long
ones are chunked. The pages each chunk completes ship to the decode side's reserved pages
while the next chunk computes (shipment.py; `--no-pipeline-handoff` ships everything after
the last chunk); after the first token is sampled the rest ships, and the pages stay held
until every page is resident there; then they are freed. The report's `handoff_ms` is what
the handoff added after the KV was ready (measured here, so the call to the agent counts),
`total_ms` the whole transfer. A request cancelled while queued is dropped; one cancelled
while running or shipping frees its pages and stops its shipment.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from pdserve.common import failpoints
from pdserve.common.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    ServiceError,
    Unavailable,
)
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.metrics import WorkerMetrics, count_outcome
from pdserve.common.tickets import TicketKey
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sequence import StepOutput
from pdserve.prefill.ranks import RankShipments, Source, Sources
from pdserve.prefill.shipment import Shipment
from pdserve.worker.agent_client import AgentClient
from pdserve.worker.cache_feed import CacheFeed
from pdserve.worker.samehost import LaneOptions, SameHostLane
from pdserve.worker.streams import first_output
from pdserve.worker.types import PrefillRequest, PrefillResult, WorkerStats

log = logging.getLogger("pdserve.prefill.worker")


class PrefillWorker:
    role = "prefill"

    def __init__(self, loop: EngineLoop, agent: AgentClient, *, worker_id: str,
                 transfer_timeout_s: float = 30.0, prefill_wait_s: float = 300.0,
                 pipeline_handoff: bool = True, same_host_lane: bool = True,
                 network_lane: bool = True, connect: Callable[[], AgentClient] | None = None):
        """`connect`: another client of the same agent (for the pools of tensor-parallel ranks
        and of handoffs to another TP size, each registered on a connection of its own)."""
        self.loop = loop
        self.engine = loop.engine
        self.agent = agent
        self.worker_id = worker_id
        self.model_id = self.engine.pool.fingerprint.model_id
        self.transfer_timeout_s = transfer_timeout_s
        self.prefill_wait_s = prefill_wait_s
        self.pipeline_handoff = pipeline_handoff
        self.lane: SameHostLane | None = None
        self.pool_id = ""
        self.epoch = time.time_ns() // 1000  # new at every start (cache events)
        self.admitting = True
        self.serving: Callable[[], bool] | None = None  # the server's health, once started
        self._shipments: dict[str, Shipment | RankShipments] = {}
        self._lock = threading.Lock()
        self._parts = ThreadPoolExecutor(8, thread_name_prefix="kv-parts")
        self._connect = connect
        self.sources: Sources | None = None  # made at register: ranks and staging pools
        self._finishers = ThreadPoolExecutor(8, thread_name_prefix="kv-rank-finish")
        self.metrics = WorkerMetrics(self.role, self.stats)
        self.lanes = (LaneOptions(same_host_lane, network_lane, self._count_lane_handoff)
                      if same_host_lane or network_lane else None)
        self.cache_feed = CacheFeed(loop)
        self.engine.handoff = self

    def register(self) -> None:
        pool = self.engine.pool
        self.pool_id, _ = self.agent.register_pool(
            self.worker_id, pool.fd, pool.num_pages, pool.page_bytes, pool.fingerprint,
            on_registered=self._registered)
        if self.lanes is not None:
            self.lane = SameHostLane(self.agent, pool.fd, pool.num_pages, pool.page_bytes,
                                     pool.fingerprint, self.worker_id, options=self.lanes)
        if self._connect is not None:
            self.sources = Sources(self.worker_id, Source(pool, self.agent, self.pool_id,
                                                          self.lane),
                                   self.engine.rank_pools[1:], self._connect,
                                   self.lanes)

    def _count_lane_handoff(self, transport: str) -> None:
        self.metrics.lane_handoffs.labels(transport=transport).inc()

    def _registered(self, pool_id: str, agent_epoch: int) -> None:
        self.pool_id = pool_id  # again after an agent restart
        if self.sources is not None:
            self.sources.ranks[0].pool_id = pool_id

    def prefill(self, request: PrefillRequest, cancelled: threading.Event) -> PrefillResult:
        with count_outcome(self.metrics.prefills):
            return self._prefill(request, cancelled)

    def _prefill(self, request: PrefillRequest, cancelled: threading.Event) -> PrefillResult:
        if not self.admitting:
            raise Unavailable(f"prefill worker {self.worker_id} is draining")
        rid = request.request_id
        received = time.perf_counter()
        failpoints.hit("prefill.queued", rid)
        self._check_boundary(request)
        shipment = self._shipment(rid, request.ticket, request.destination, cancelled)
        try:
            _, outputs = self.loop.start_sequence(
                rid, lambda e: e.add_request(rid, request.token_ids, request.params))
        except ValueError as exc:  # bad prompt, or this request id is already being prefilled
            self._forget(rid)
            raise InvalidArgument(str(exc)) from None
        if cancelled.is_set():  # cancelled while it was being queued: drop it now
            self.loop.abort(rid, "cancelled by the caller")
        try:
            out = first_output(outputs, rid, self.prefill_wait_s,
                               lambda: self.loop.abort(rid, "timed out"),
                               self._progress(shipment))
            queue_ms = max(0.0, (time.perf_counter() - received) * 1e3 - out.prefill_ms)
            report = TransferReport()
            if not out.finish_reason:  # a request that ends at its first token needs no handoff
                failpoints.hit("prefill.handoff", rid)
                report = self._finish(rid, shipment, out, request.destination)
            self.metrics.note_prompt(len(request.token_ids), out.cached_tokens)
            if report.transport:
                skipped = request.destination.first_page
                self.metrics.pages_not_sent.inc(skipped)
                self.metrics.bytes_not_sent.inc(skipped * self.engine.pool.page_bytes)
            return PrefillResult(out.token or 0, out.finish_reason, queue_ms, out.prefill_ms,
                                 report, out.cached_tokens, after_reply=shipment.settle)
        except BaseException:
            shipment.settle()  # no answer to wait for
            raise
        finally:
            shipment.cancel()  # no-op once finished; stops parts of a failed or ended request
            self._forget(rid)
            self.loop.unsubscribe(rid)
            self.loop.submit(lambda e: e.release_prefilled(rid))

    def _check_boundary(self, request: PrefillRequest) -> None:
        """The decode side holds the prompt's first `first_page` pages: they must be this
        prompt's (same keys here), and the prompt's last page must still be shipped."""
        dest = request.destination
        if not dest.first_page:
            return
        bs = self.engine.config.block_size
        if dest.first_page * bs >= len(request.token_ids):
            raise InvalidArgument(f"destination.first_page={dest.first_page}: the decode side "
                                  f"cannot hold the page of the prompt's last token (prompt "
                                  f"of {len(request.token_ids)} tokens, {bs} a page)")
        mine = self.engine.prefix.boundary_key(request.token_ids, dest.first_page)
        if mine != dest.boundary_key:
            raise FailedPrecondition(
                f"{request.request_id}: the decode side's cached prefix ends at page "
                f"{dest.first_page - 1} with key {dest.boundary_key:#018x}, this prompt's page "
                f"has key {mine:#018x} (a different prompt or layout): nothing was shipped")

    def _shipment(self, rid: str, ticket: TicketKey, destination: Destination,
                  cancelled: threading.Event) -> Shipment | RankShipments:
        shipment: Shipment | RankShipments
        if self.sources is not None and self.sources.needs_ranks(destination):
            shipment = RankShipments(self.sources, ticket, destination, self.transfer_timeout_s,
                                     self._parts, self._finishers)
        elif len(self.engine.rank_pools) > 1:
            raise FailedPrecondition(f"{rid}: this tensor-parallel prefill worker cannot "
                                     f"reach its ranks' pools (started without `connect`)")
        else:
            shipment = Shipment(self.lane or self.agent, ticket, self.pool_id, destination,
                                self.transfer_timeout_s, self._parts)
        with self._lock:
            if cancelled.is_set():
                raise Aborted(f"{rid} was cancelled")
            self._shipments[rid] = shipment
        return shipment

    def _progress(self, shipment: Shipment | RankShipments) -> Callable[[StepOutput], None]:
        def progress(out: StepOutput) -> None:
            if out.planned:
                if isinstance(shipment, Shipment):
                    shipment.prepare(out.page_ids or [])
            elif self.pipeline_handoff:
                shipment.ship(out.page_ids or [])
        return progress

    def _finish(self, rid: str, shipment: Shipment | RankShipments, out: StepOutput,
                destination: Destination) -> TransferReport:
        try:
            return shipment.finish(out.page_ids or [], out.done_at or time.perf_counter())
        except Aborted:
            raise Aborted(f"{rid} was cancelled during its KV handoff") from None
        except ServiceError as exc:
            raise handoff_failed(rid, destination, exc) from None

    # ---- HandoffHooks: the engine's thread, inside a step ----------------------------------
    def planned(self, rid: str, pages: list[int]) -> None:
        """The prompt's last chunk is about to compute: its request's thread prepares the
        handoff of the pages not shipped yet meanwhile (Shipment.prepare)."""
        self.loop.publish(rid, StepOutput(rid, None, page_ids=pages, planned=True))

    def prefilled(self, rid: str, pages: list[int]) -> None:
        """The KV is ready: start the prepared handoff at once (Shipment.begin), before the
        request's thread is woken; `_finish` completes it, or sends it if nothing was
        prepared."""
        with self._lock:
            shipment = self._shipments.get(rid)
        if isinstance(shipment, Shipment):
            try:
                if shipment.begin():
                    self.metrics.handoffs_begun.inc()
            except Exception:  # never the engine's step: `_finish` completes it or says why not
                log.exception("starting the KV handoff of %s on the engine's thread", rid)

    def _forget(self, rid: str) -> None:
        with self._lock:
            self._shipments.pop(rid, None)

    def cancel(self, request_id: str) -> None:
        """The caller went away: drop queued work, free running work's pages, stop shipping."""
        with self._lock:
            shipment = self._shipments.get(request_id)
        if shipment is not None:
            shipment.cancel()
        self.loop.abort(request_id, "cancelled by the caller")

    def stats(self) -> WorkerStats:
        e = self.engine
        return WorkerStats(self.worker_id, self.role, e.allocator.num_pages, e.allocator.num_free,
                           len(e.running), len(e.waiting), e.queued_prompt_tokens,
                           e.pool.fingerprint, cached_pages=e.allocator.num_cached,
                           max_model_len=e.max_model_len)

    def stop(self) -> None:
        self.admitting = False
        self.cache_feed.close()
        self._parts.shutdown(wait=False, cancel_futures=True)
        self._finishers.shutdown(wait=False, cancel_futures=True)
        if self.sources is not None:
            self.sources.close()
        if self.lane is not None:
            self.lane.close()
        self.agent.close()


def handoff_failed(rid: str, destination: Destination, exc: ServiceError) -> ServiceError:
    """The KV handoff to decode failed (not a cancellation: that is `Aborted`, raised only when
    the caller went away). Whatever the agent answered (NOT_FOUND: the decode pool or ticket
    is gone, the decode worker died; INVALID_ARGUMENT: its pages went with it; ...), nothing
    reached the client yet, so the status says "try again" (ABORTED; a timeout or an
    unreachable agent keep theirs, also retryable): the router retries the whole attempt on
    another decode worker, or the same one restarted. The message names the decode side and
    the phase, with the agent's own status and reason."""
    code = exc.code if exc.code in ("UNAVAILABLE", "DEADLINE_EXCEEDED") else "ABORTED"
    return ServiceError(f"{rid}: KV handoff to the decode side (agent "
                        f"{destination.agent_address}, pool {destination.pool_id}) failed: "
                        f"{exc.code} {exc.message}", code)
