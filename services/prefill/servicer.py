"""pdserve.v1.Prefill over gRPC: protos in, PrefillWorker calls, protos out.

Traced as prefill.request (the whole call: queue, compute, KV handoff; the agent's kv.send is
its child) with prefill.compute, the engine's part, as a child.
"""

from __future__ import annotations

import threading
import time

import grpc
from pdserve.common import tracing
from pdserve.common.convert import sampling_from_pb
from pdserve.prefill.worker import PrefillWorker
from pdserve.v1 import decode_pb2, prefill_pb2, prefill_pb2_grpc


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker

    def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext):
        rid = request.request_id
        finished, cancelled = threading.Event(), threading.Event()

        def on_done() -> None:  # runs when the call ends for any reason
            if not finished.is_set():  # the caller left before the answer
                cancelled.set()
                self.worker.cancel(rid)

        context.add_callback(on_done)
        with tracing.span("prefill.request", kind=tracing.SERVER, request_id=rid,
                          worker_id=self.worker.worker_id, prompt_tokens=len(request.token_ids),
                          model=self.worker.fingerprint.model_id) as span:
            started_ns = time.time_ns()
            try:
                result = self.worker.prefill(rid, list(request.token_ids),
                                             sampling_from_pb(request.sampling), request.ticket,
                                             request.destination, cancelled)
            finally:
                finished.set()
            tracing.record_phase("prefill.compute", span, started_ns + int(result.queue_ms * 1e6),
                                 result.prefill_ms, prompt_tokens=len(request.token_ids))
            t = result.transfer
            span.set_attributes({"queue_ms": result.queue_ms, "prefill_ms": result.prefill_ms,
                                 "kv_transfer_ms": t.handoff_ms, "kv_bytes": t.kv_bytes,
                                 "kv_pages": t.kv_pages, "kv_transport": t.transport})
        return prefill_pb2.PrefillResponse(first_token=result.first_token, queue_ms=result.queue_ms,
                                           prefill_ms=result.prefill_ms, transfer=result.transfer,
                                           worker_id=self.worker.worker_id)

    def Stats(self, request: decode_pb2.StatsRequest, context: grpc.ServicerContext):
        return decode_pb2.WorkerStats(**self.worker.stats())
