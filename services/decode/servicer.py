"""pdserve.v1.Decode over gRPC: protos in, DecodeWorker calls, protos out.

Traced as decode.reserve (Reserve), decode.admission (Decode until the sequence is live in
the batch: decode_start_ms) and decode.stream (from then until the stream ends: tokens, finish
reason); one span per phase, never per token.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from pdserve.common import tracing
from pdserve.common.convert import sampling_from_pb
from pdserve.decode.worker import DecodeWorker
from pdserve.v1 import decode_pb2, decode_pb2_grpc


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker

    def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext):
        with tracing.span("decode.reserve", kind=tracing.SERVER, request_id=request.request_id,
                          worker_id=self.worker.worker_id, model=self.worker.fingerprint.model_id,
                          prompt_tokens=request.num_prompt_tokens) as span:
            ticket, dest = self.worker.reserve(request.request_id, request.num_prompt_tokens, request.lease_ms)
            span.set_attribute("kv_pages", len(dest.page_ids))
        if not context.is_active():  # the caller gave up (cancelled, timed out): nobody will use them
            self.worker.abort(ticket)
        return decode_pb2.ReserveResponse(ticket=ticket, destination=dest)

    def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
               ) -> Iterator[decode_pb2.DecodeResponse]:
        params = sampling_from_pb(request.sampling)
        attrs = {"request_id": request.ticket.request_id, "worker_id": self.worker.worker_id,
                 "model": self.worker.fingerprint.model_id}
        spans = [tracing.start_span("decode.admission", kind=tracing.SERVER, **attrs)]
        tokens, reason = 0, ""
        try:
            for ev in self.worker.decode(request.ticket, list(request.prompt_token_ids),
                                         request.first_token, params):
                if len(spans) == 1:  # the first message: the sequence is live in the batch
                    spans[0].set_attribute("decode_start_ms", ev.decode_start_ms)
                    spans[0].end()
                    spans.append(tracing.start_span("decode.stream", kind=tracing.SERVER, **attrs))
                tokens += len(ev.token_ids)
                reason = ev.finish_reason or reason
                yield decode_pb2.DecodeResponse(token_ids=ev.token_ids, finish_reason=ev.finish_reason,
                                                decode_start_ms=ev.decode_start_ms)
        except BaseException as exc:
            tracing.record_error(spans[-1], exc)
            raise
        finally:
            spans[-1].set_attributes({"completion_tokens": tokens, "finish_reason": reason})
            spans[-1].end()

    def Abort(self, request: decode_pb2.AbortRequest, context: grpc.ServicerContext):
        return decode_pb2.AbortResponse(found=self.worker.abort(request.ticket))

    def Stats(self, request: decode_pb2.StatsRequest, context: grpc.ServicerContext):
        return decode_pb2.WorkerStats(**self.worker.stats())

