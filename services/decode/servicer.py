"""pdserve.v1.Decode over gRPC: protos in, DecodeWorker calls, protos out."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from pdserve.common.convert import sampling_from_pb
from pdserve.decode.worker import DecodeWorker
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker

    def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext):
        ticket, dest = self.worker.reserve(request.request_id, request.num_prompt_tokens, request.lease_ms)
        return decode_pb2.ReserveResponse(ticket=ticket, destination=dest)

    def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
               ) -> Iterator[decode_pb2.DecodeResponse]:
        params = sampling_from_pb(request.sampling)
        for ev in self.worker.decode(request.ticket, list(request.prompt_token_ids),
                                     request.first_token, params):
            yield decode_pb2.DecodeResponse(token_ids=ev.token_ids, finish_reason=ev.finish_reason,
                                            decode_start_ms=ev.decode_start_ms)

    def Abort(self, request: decode_pb2.AbortRequest, context: grpc.ServicerContext):
        return decode_pb2.AbortResponse(found=self.worker.abort(request.ticket))

    def Stats(self, request: decode_pb2.StatsRequest, context: grpc.ServicerContext):
        return decode_pb2.WorkerStats(**self.worker.stats())


__all__ = ["DecodeServicer", "common_pb2"]
