"""The prefill worker: prompt → KV pages + first token, then the pages shipped to decode.

Latency first: prompts are batched only as far as the engine's per-step token budget, long
ones are chunked. After the first token is sampled the pages stay held until the host's
agent has shipped them to the decode side's reserved pages; then they are freed. A request
cancelled while queued is dropped; one cancelled while running or shipping frees its pages.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time

import grpc
from pdserve.common.errors import (
    Aborted,
    DeadlineExceeded,
    InvalidArgument,
    ServiceError,
    Unavailable,
)
from pdserve.common.kvclient import AgentClient, fingerprint_pb
from pdserve.common.metrics import WorkerMetrics, count_outcome
from pdserve.engine.loop import EngineLoop, SequenceAborted
from pdserve.engine.sampling import SamplingParams
from pdserve.v1 import common_pb2

log = logging.getLogger("pdserve.prefill")
PREFILL_WAIT_S = 300.0


@dataclasses.dataclass
class PrefillResult:
    first_token: int
    finish_reason: str | None
    queue_ms: float
    prefill_ms: float
    transfer: common_pb2.TransferReport


class PrefillWorker:
    role = "prefill"

    def __init__(self, loop: EngineLoop, agent: AgentClient, *, worker_id: str,
                 transfer_timeout_s: float = 30.0):
        self.loop = loop
        self.engine = loop.engine
        self.agent = agent
        self.worker_id = worker_id
        self.transfer_timeout_s = transfer_timeout_s
        self.fingerprint = fingerprint_pb(self.engine.pool.fingerprint)
        self.pool_id = ""
        self.admitting = True
        self._sends: dict[str, grpc.Future] = {}
        self._lock = threading.Lock()
        self.metrics = WorkerMetrics(self.role, self.stats)

    def register(self) -> None:
        pool = self.engine.pool
        reply = self.agent.register_pool(self.worker_id, pool.shm_name, pool.num_pages,
                                         pool.page_bytes, self.fingerprint)
        self.pool_id = reply.pool_id

    def prefill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                ticket: common_pb2.Ticket, destination: common_pb2.KVDestination,
                cancelled: threading.Event | None = None) -> PrefillResult:
        with count_outcome(self.metrics.prefills):
            return self._prefill(request_id, token_ids, params, ticket, destination,
                                 cancelled or threading.Event())

    def _prefill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 ticket: common_pb2.Ticket, destination: common_pb2.KVDestination,
                 cancelled: threading.Event) -> PrefillResult:
        if not self.admitting:
            raise Unavailable(f"prefill worker {self.worker_id} is draining")
        received = time.perf_counter()
        try:
            _, q = self.loop.start_sequence(
                request_id, lambda e: e.add_request(request_id, token_ids, params))
        except ValueError as exc:  # bad prompt, or this request id is already being prefilled
            raise InvalidArgument(str(exc)) from None
        try:
            try:
                out = q.get(timeout=PREFILL_WAIT_S)
            except queue.Empty:
                self.loop.abort(request_id, "timed out")
                raise DeadlineExceeded(f"prefill of {request_id} did not finish in {PREFILL_WAIT_S:.0f}s") from None
            if isinstance(out, SequenceAborted):
                raise Aborted(f"prefill of {request_id} was cancelled")
            if isinstance(out, BaseException):
                raise Unavailable(str(out))
            done = time.perf_counter()
            queue_ms = max(0.0, (done - received) * 1e3 - out.prefill_ms)
            report = common_pb2.TransferReport()
            if not out.finish_reason:  # a request that ends at its first token needs no handoff
                report = self._ship(request_id, ticket, out.page_ids, destination, cancelled)
            return PrefillResult(out.token, out.finish_reason, queue_ms, out.prefill_ms, report)
        finally:
            self.loop.unsubscribe(request_id)
            self.loop.submit(lambda e: e.release(request_id) if request_id in e.seqs else 0)

    def _ship(self, request_id: str, ticket: common_pb2.Ticket, page_ids: list[int],
              destination: common_pb2.KVDestination, cancelled: threading.Event
              ) -> common_pb2.TransferReport:
        with self._lock:
            if cancelled.is_set():
                raise Aborted(f"{request_id} was cancelled")
            fut = self.agent.send_async(ticket, self.pool_id, page_ids, destination,
                                        self.transfer_timeout_s)
            self._sends[request_id] = fut
        try:
            return fut.result().report
        except grpc.FutureCancelledError:
            raise Aborted(f"{request_id} was cancelled during its KV handoff") from None
        except grpc.RpcError as exc:
            raise ServiceError(f"KV handoff of {request_id} failed: {exc.details()}", exc.code().name) from None
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

    def stats(self) -> dict:
        e = self.engine
        return dict(worker_id=self.worker_id, role="prefill", num_pages=e.allocator.num_pages,
                    free_pages=e.allocator.num_free, running_sequences=len(e.running),
                    waiting_sequences=len(e.waiting), queued_prompt_tokens=e.queued_prompt_tokens,
                    fingerprint=self.fingerprint)

    def stop(self) -> None:
        self.admitting = False
