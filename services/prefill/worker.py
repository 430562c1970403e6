"""The prefill worker: prompt -> KV pages + first token, then the pages shipped to decode.

Latency first: prompts are batched only as far as the engine's per-step token budget, long
ones are chunked. After the first token is sampled the pages stay held until the host's
agent has shipped them to the decode side's reserved pages; then they are freed. A request
cancelled while queued is dropped; one cancelled while running or shipping frees its pages.
"""

from __future__ import annotations

import threading
import time

from pdserve.common import failpoints
from pdserve.common.errors import Aborted, InvalidArgument, ServiceError, Unavailable
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.metrics import WorkerMetrics, count_outcome
from pdserve.common.tickets import TicketKey
from pdserve.engine.loop import EngineLoop
from pdserve.worker.agent_client import AgentClient, Send
from pdserve.worker.streams import first_output
from pdserve.worker.types import PrefillRequest, PrefillResult, WorkerStats


class PrefillWorker:
    role = "prefill"

    def __init__(self, loop: EngineLoop, agent: AgentClient, *, worker_id: str,
                 transfer_timeout_s: float = 30.0, prefill_wait_s: float = 300.0):
        self.loop = loop
        self.engine = loop.engine
        self.agent = agent
        self.worker_id = worker_id
        self.model_id = self.engine.pool.fingerprint.model_id
        self.transfer_timeout_s = transfer_timeout_s
        self.prefill_wait_s = prefill_wait_s
        self.pool_id = ""
        self.admitting = True
        self._sends: dict[str, Send] = {}
        self._lock = threading.Lock()
        self.metrics = WorkerMetrics(self.role, self.stats)

    def register(self) -> None:
        pool = self.engine.pool
        self.pool_id, _ = self.agent.register_pool(
            self.worker_id, pool.fd, pool.num_pages, pool.page_bytes, pool.fingerprint,
            on_registered=self._registered)

    def _registered(self, pool_id: str, agent_epoch: int) -> None:
        self.pool_id = pool_id  # again after an agent restart

    def prefill(self, request: PrefillRequest, cancelled: threading.Event) -> PrefillResult:
        with count_outcome(self.metrics.prefills):
            return self._prefill(request, cancelled)

    def _prefill(self, request: PrefillRequest, cancelled: threading.Event) -> PrefillResult:
        if not self.admitting:
            raise Unavailable(f"prefill worker {self.worker_id} is draining")
        rid = request.request_id
        received = time.perf_counter()
        failpoints.hit("prefill.queued", rid)
        try:
            _, outputs = self.loop.start_sequence(
                rid, lambda e: e.add_request(rid, request.token_ids, request.params))
        except ValueError as exc:  # bad prompt, or this request id is already being prefilled
            raise InvalidArgument(str(exc)) from None
        try:
            out = first_output(outputs, rid, self.prefill_wait_s,
                               lambda: self.loop.abort(rid, "timed out"))
            queue_ms = max(0.0, (time.perf_counter() - received) * 1e3 - out.prefill_ms)
            report = TransferReport()
            if not out.finish_reason:  # a request that ends at its first token needs no handoff
                failpoints.hit("prefill.handoff", rid)
                report = self._ship(rid, request.ticket, out.page_ids or [],
                                    request.destination, cancelled)
            return PrefillResult(out.token or 0, out.finish_reason, queue_ms, out.prefill_ms,
                                 report)
        finally:
            self.loop.unsubscribe(rid)
            self.loop.submit(lambda e: e.release_prefilled(rid))

    def _ship(self, request_id: str, ticket: TicketKey, page_ids: list[int],
              destination: Destination, cancelled: threading.Event) -> TransferReport:
        with self._lock:
            if cancelled.is_set():
                raise Aborted(f"{request_id} was cancelled")
            fut = self.agent.send(ticket, self.pool_id, page_ids, destination,
                                  self.transfer_timeout_s)
            self._sends[request_id] = fut
        try:
            return fut.result()
        except Aborted:
            raise Aborted(f"{request_id} was cancelled during its KV handoff") from None
        except ServiceError as exc:
            raise ServiceError(f"{request_id}: {exc.message}", exc.code) from None
        finally:
            with self._lock:
                self._sends.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """The caller went away: drop queued work, free running work's pages, stop a send."""
        with self._lock:
            fut = self._sends.get(request_id)
        if fut is not None:
            fut.cancel()
        self.loop.abort(request_id, "cancelled by the caller")

    def stats(self) -> WorkerStats:
        e = self.engine
        return WorkerStats(self.worker_id, self.role, e.allocator.num_pages, e.allocator.num_free,
                           len(e.running), len(e.waiting), e.queued_prompt_tokens,
                           e.pool.fingerprint)

    def stop(self) -> None:
        self.admitting = False
        self.agent.close()
