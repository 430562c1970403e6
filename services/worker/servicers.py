"""pdserve.v1.Prefill and pdserve.v1.Decode over gRPC: protos in, plain types to the worker,
protos out. Domain errors become status codes in the server bootstrap's interceptor.

Any worker with the `PrefillBackend` / `DecodeBackend` methods can be served: the prefill and
decode workers serve one API each, the co-located worker both.

Tracing: prefill.request (the whole Prefill call; the agent's kv.send is its child) with
prefill.compute as a child; decode.reserve (Reserve), decode.admission (Decode until the
sequence is live in the batch) and decode.stream (from then until the stream ends). One span
per phase, never per token.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import grpc
from pdserve.common import stream_interval, tracing, wire
from pdserve.common.errors import InvalidArgument
from pdserve.common.metrics import WorkerMetrics
from pdserve.common.tickets import TicketKey
from pdserve.engine.engine import Engine
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
)
from pdserve.worker.cache_feed import CacheBatch, CacheFeed
from pdserve.worker.mux import DecodeMux
from pdserve.worker.types import (
    DecodeEvent,
    DecodeRequest,
    PrefillHere,
    PrefillRequest,
    PrefillResult,
    Reservation,
    WorkerStats,
)


class CacheSource(Protocol):
    """A worker whose prefix-cache events routers can subscribe to."""

    worker_id: str
    epoch: int
    cache_feed: CacheFeed
    engine: Engine


class PrefillBackend(CacheSource, Protocol):
    model_id: str
    serving: Callable[[], bool] | None  # the server's health, once started (for Stats)

    def prefill(self, request: PrefillRequest, cancelled: threading.Event) -> PrefillResult: ...

    def cancel(self, request_id: str) -> None: ...

    def stats(self) -> WorkerStats: ...


class DecodeBackend(CacheSource, Protocol):
    model_id: str
    role: str  # "decode" or "colocated"
    admitting: bool  # False once draining
    serving: Callable[[], bool] | None  # the server's health, once started (for Stats)
    metrics: WorkerMetrics

    def reserve(self, request_id: str, num_prompt_tokens: int, lease_s: float,
                renew_s: float = 0.0, prompt_ids: list[int] | None = None,
                prefill_here: PrefillHere | None = None) -> Reservation: ...

    def renew(self, keys: list[TicketKey], renew_s: float) -> list[str]: ...

    def decode(self, request: DecodeRequest) -> Iterator[DecodeEvent]: ...

    def abort(self, ticket: TicketKey) -> bool: ...

    def stats(self) -> WorkerStats: ...


class PrefillServicer(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, worker: PrefillBackend):
        self.worker = worker

    def Prefill(self, request: prefill_pb2.PrefillRequest, context: grpc.ServicerContext
                ) -> prefill_pb2.PrefillResponse:
        rid = request.request_id
        finished, cancelled = threading.Event(), threading.Event()

        def on_done() -> None:  # runs when the call ends for any reason
            if not finished.is_set():  # the caller left before the answer
                cancelled.set()
                self.worker.cancel(rid)

        context.add_callback(on_done)
        domain = PrefillRequest(rid, list(request.token_ids),
                                wire.sampling_from_pb(request.sampling),
                                wire.ticket_from_pb(request.ticket),
                                wire.destination_from_pb(request.destination))
        with tracing.span("prefill.request", kind=tracing.SERVER, request_id=rid,
                          worker_id=self.worker.worker_id, prompt_tokens=len(domain.token_ids),
                          model=self.worker.model_id) as span:
            started_ns = time.time_ns()
            try:
                result = self.worker.prefill(domain, cancelled)
            finally:
                finished.set()
            tracing.record_phase("prefill.compute", span, started_ns + int(result.queue_ms * 1e6),
                                 result.prefill_ms, prompt_tokens=len(domain.token_ids))
            t = result.transfer
            span.set_attributes({"queue_ms": result.queue_ms, "prefill_ms": result.prefill_ms,
                                 "kv_transfer_ms": t.handoff_ms,
                                 "kv_transfer_total_ms": t.total_ms, "kv_bytes": t.kv_bytes,
                                 "kv_pages": t.kv_pages, "kv_transport": t.transport,
                                 "cached_tokens": result.cached_tokens})
        if result.after_reply is not None and not context.add_callback(result.after_reply):
            result.after_reply()  # the call has ended already
        return prefill_pb2.PrefillResponse(first_token=result.first_token,
                                           queue_ms=result.queue_ms, prefill_ms=result.prefill_ms,
                                           transfer=wire.report_to_pb(result.transfer),
                                           worker_id=self.worker.worker_id,
                                           cached_tokens=result.cached_tokens)

    def Stats(self, request: common_pb2.StatsRequest, context: grpc.ServicerContext
              ) -> common_pb2.WorkerStats:
        return _stats(self.worker, request)

    def CacheEvents(self, request: common_pb2.CacheEventsRequest, context: grpc.ServicerContext
                    ) -> Iterator[common_pb2.CacheEventBatch]:
        return _cache_events(self.worker, request, context)


class DecodeServicer(decode_pb2_grpc.DecodeServicer):
    def __init__(self, worker: DecodeBackend):
        self.worker = worker

    def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.ServicerContext
                ) -> decode_pb2.ReserveResponse:
        with tracing.span("decode.reserve", kind=tracing.SERVER, request_id=request.request_id,
                          worker_id=self.worker.worker_id, model=self.worker.model_id,
                          prompt_tokens=request.num_prompt_tokens) as span:
            reservation = self.worker.reserve(request.request_id, request.num_prompt_tokens,
                                              request.lease_ms / 1e3,
                                              request.renew_lease_ms / 1e3,
                                              list(request.prompt_token_ids) or None,
                                              _prefill_here(request))
            span.set_attributes({"kv_pages": len(reservation.destination.page_ids),
                                 "cached_tokens": reservation.cached_tokens,
                                 "prefilling_here": reservation.prefilling_here})
        if not context.is_active():  # the caller gave up (cancelled, timed out): free them
            self.worker.abort(reservation.ticket)
        return decode_pb2.ReserveResponse(
            ticket=wire.ticket_to_pb(reservation.ticket, self.worker.worker_id),
            destination=wire.destination_to_pb(reservation.destination),
            renew_lease_ms=reservation.renew_s * 1e3,
            cached_tokens=reservation.cached_tokens,
            prefilling_here=reservation.prefilling_here,
        )

    def Decode(
        self, request: decode_pb2.DecodeRequest, context: grpc.ServicerContext
    ) -> Iterator[decode_pb2.DecodeResponse]:
        self.worker.metrics.decode_starts.labels("own").inc()
        return decode_messages(self.worker, request)

    def DecodeMany(self, requests: Iterator[decode_pb2.DecodeManyRequest],
                   context: grpc.ServicerContext) -> Iterator[decode_pb2.DecodeManyResponse]:
        def messages(request: decode_pb2.DecodeRequest) -> Iterator[decode_pb2.DecodeResponse]:
            self.worker.metrics.decode_starts.labels("shared").inc()
            return decode_messages(self.worker, request)

        return DecodeMux(self.worker, messages, requests, context).serve()

    def Renew(self, request: decode_pb2.RenewRequest, context: grpc.ServicerContext
              ) -> decode_pb2.RenewResponse:
        keys = [wire.ticket_from_pb(ticket) for ticket in request.tickets]
        return decode_pb2.RenewResponse(not_held=self.worker.renew(keys,
                                                                   request.renew_lease_ms / 1e3))

    def Abort(self, request: decode_pb2.AbortRequest, context: grpc.ServicerContext
              ) -> decode_pb2.AbortResponse:
        return decode_pb2.AbortResponse(found=self.worker.abort(
            wire.ticket_from_pb(request.ticket)))

    def Stats(self, request: common_pb2.StatsRequest, context: grpc.ServicerContext
              ) -> common_pb2.WorkerStats:
        return _stats(self.worker, request)

    def CacheEvents(self, request: common_pb2.CacheEventsRequest, context: grpc.ServicerContext
                    ) -> Iterator[common_pb2.CacheEventBatch]:
        return _cache_events(self.worker, request, context)


def decode_messages(worker: DecodeBackend, request: decode_pb2.DecodeRequest
                    ) -> Iterator[decode_pb2.DecodeResponse]:
    """One sequence's Decode messages (the Decode call's, and each sequence's on DecodeMany),
    `request.stream_interval` tokens to a message after the first."""
    interval = stream_interval.checked(request.stream_interval)
    yield from stream_interval.every_n(_decode_messages(worker, request), interval)


def _decode_messages(worker: DecodeBackend, request: decode_pb2.DecodeRequest
                     ) -> Iterator[decode_pb2.DecodeResponse]:
    domain = DecodeRequest(
        wire.ticket_from_pb(request.ticket),
        list(request.prompt_token_ids),
        request.first_token,
        wire.sampling_from_pb(request.sampling),
        request.local_prefill,
    )
    attrs: dict[str, Any] = {
        "request_id": request.ticket.request_id,
        "worker_id": worker.worker_id,
        "model": worker.model_id,
    }
    spans = [tracing.start_span("decode.admission", kind=tracing.SERVER, **attrs)]
    tokens, reason = 0, ""
    try:
        for ev in worker.decode(domain):
            if len(spans) == 1:  # the first message: the sequence is live in the batch
                spans[0].set_attributes({"decode_start_ms": ev.decode_start_ms,
                                         # as Timing says it (co-located: "prefill")
                                         "prefill_on": "decode" if domain.local_prefill
                                         and worker.role == "decode" else "prefill",
                                         "prefill_ms": ev.prefill_ms,
                                         "cached_tokens": ev.cached_tokens})
                spans[0].end()
                spans.append(tracing.start_span("decode.stream", kind=tracing.SERVER, **attrs))
            tokens += len(ev.token_ids)
            reason = ev.finish_reason or reason
            yield decode_pb2.DecodeResponse(token_ids=ev.token_ids,
                                            finish_reason=ev.finish_reason,
                                            decode_start_ms=ev.decode_start_ms,
                                            prefill_ms=ev.prefill_ms, queue_ms=ev.queue_ms,
                                            cached_tokens=ev.cached_tokens)
    except BaseException as exc:
        tracing.record_error(spans[-1], exc)
        raise
    finally:
        spans[-1].set_attributes({"completion_tokens": tokens, "finish_reason": reason})
        spans[-1].end()


def _prefill_here(request: decode_pb2.ReserveRequest) -> PrefillHere | None:
    below = request.prefill_here_below_tokens
    if below < 0:
        raise InvalidArgument(f"prefill_here_below_tokens={below}: must be >= 0 (0 = off)")
    if below == 0:
        return None
    if not request.HasField("sampling"):
        raise InvalidArgument("prefill_here_below_tokens needs sampling (the parameters of "
                              "the sequence it may start)")
    return PrefillHere(below, wire.sampling_from_pb(request.sampling))


def _cache_events(worker: CacheSource, request: common_pb2.CacheEventsRequest,
                  context: grpc.ServicerContext) -> Iterator[common_pb2.CacheEventBatch]:
    """The worker's cache feed on the wire; ends when the caller goes away."""
    if not 0 <= request.heartbeat_ms < 1e9:  # NaN too
        context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                      f"heartbeat_ms={request.heartbeat_ms}: must be >= 0 (0: the default)")
    heartbeat_s = min(request.heartbeat_ms / 1e3 or 1.0, 60.0)
    stream = worker.cache_feed.stream(max(heartbeat_s, 0.01))
    try:
        for batch in stream:
            if not context.is_active():
                return
            yield _batch_to_pb(worker, batch)
    finally:
        stream.close()


def _batch_to_pb(worker: CacheSource, batch: CacheBatch) -> common_pb2.CacheEventBatch:
    """One batch of the worker's cache feed on the wire (a snapshot names its layout)."""
    fingerprint = worker.engine.pool.fingerprint
    pb = common_pb2.CacheEventBatch(worker_id=worker.worker_id, epoch=worker.epoch,
                                    sequence=batch.sequence, snapshot=batch.snapshot,
                                    stored=batch.stored, removed=batch.removed,
                                    block_size=fingerprint.block_size, since=batch.since)
    if batch.snapshot:
        pb.fingerprint.CopyFrom(wire.fingerprint_to_pb(fingerprint))
    return pb


def _stats(worker: PrefillBackend | DecodeBackend, request: common_pb2.StatsRequest
           ) -> common_pb2.WorkerStats:
    """Stats, with the cache's changes since the caller's cursor when it asks for them."""
    pb = _stats_to_pb(worker.stats(), worker.serving)
    if request.cache_events:
        since = request.cache_sequence if request.cache_epoch == worker.epoch else 0
        pb.cache.CopyFrom(_batch_to_pb(worker, worker.cache_feed.poll(since)))
    return pb


def _stats_to_pb(stats: WorkerStats, serving: Callable[[], bool] | None = None
                 ) -> common_pb2.WorkerStats:
    """`serving`: the server's health (set once it started); before that, not reported."""
    fields = dataclasses.asdict(stats)
    fields["fingerprint"] = wire.fingerprint_to_pb(stats.fingerprint)
    if serving is not None:
        fields["serving"] = serving()
    return common_pb2.WorkerStats(**fields)
