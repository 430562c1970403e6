"""`pdserve.v1.Router` over gRPC: a GenerateRequest becomes a `GenerateInput`, the lifecycle's
events become GenerateResponses (errors become statuses in the server bootstrap's
interceptor). The only place the router's public protobuf is read or written."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
from pdserve.common.errors import ResourceExhausted
from pdserve.common.native_server import Context as NativeContext
from pdserve.common.wire import rank_to_pb
from pdserve.router.api import ChatMessage, Delta, Finish, GenerateInput, StreamEvent, Timing
from pdserve.router.cancel import CallScope
from pdserve.router.lifecycle import Lifecycle
from pdserve.router.started import Parked
from pdserve.v1 import router_pb2, router_pb2_grpc


def input_from_pb(req: router_pb2.GenerateRequest) -> GenerateInput:
    def optional(name: str) -> object:
        return getattr(req, name) if req.HasField(name) else None

    messages = tuple(ChatMessage(m.role, m.content) for m in req.messages)
    return GenerateInput(
        prompt=req.prompt, token_ids=tuple(req.token_ids), messages=messages,
        max_tokens=optional("max_tokens"), temperature=optional("temperature"),  # type: ignore[arg-type]
        top_p=optional("top_p"), top_k=optional("top_k"), seed=optional("seed"),  # type: ignore[arg-type]
        stop=tuple(req.stop), ignore_eos=req.ignore_eos, request_id=req.request_id,
        model=req.model)


def event_to_pb(event: StreamEvent) -> router_pb2.GenerateResponse:
    rid = event.request_id
    if isinstance(event, Delta):
        return router_pb2.GenerateResponse(request_id=rid, delta=router_pb2.TokenDelta(
            text=event.text, token_ids=event.token_ids))
    if isinstance(event, Timing):
        return router_pb2.GenerateResponse(request_id=rid, timing=router_pb2.Timing(
            queue_ms=event.queue_ms, prefill_ms=event.prefill_ms,
            kv_transfer_ms=event.kv_transfer_ms, decode_start_ms=event.decode_start_ms,
            ttft_ms=event.ttft_ms, kv_bytes=event.kv_bytes, kv_pages=event.kv_pages,
            kv_transport=event.kv_transport, prefill_worker=event.prefill_worker,
            decode_worker=event.decode_worker, attempts=event.attempts,
            kv_transfer_total_ms=event.kv_transfer_total_ms, cached_tokens=event.cached_tokens,
            prefill_cached_tokens=event.prefill_cached_tokens,
            decode_cached_tokens=event.decode_cached_tokens, prompt_pages=event.prompt_pages,
            prefill_on=event.prefill_on, kv_ranks=[rank_to_pb(r) for r in event.kv_ranks]))
    assert isinstance(event, Finish)
    return router_pb2.GenerateResponse(request_id=rid, finish=router_pb2.Finish(
        finish_reason=event.finish_reason, prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens, e2e_ms=event.e2e_ms, tpot_ms=event.tpot_ms,
        itl_mean_ms=event.itl_mean_ms, itl_max_ms=event.itl_max_ms))


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Generate: hand the request and its cancellation to the lifecycle, relay its stream.

    At most `max_streams` at once (0: no limit): one more is refused at once with
    RESOURCE_EXHAUSTED instead of waiting for a server thread. An overloaded router then keeps
    serving what it can at its usual latency and tells the rest to go elsewhere, where an
    unbounded queue made every request wait until its deadline (docs/benchmarks.md, issue 24).
    The server has a few threads beyond the limit for these answers and health checks."""

    def __init__(self, lifecycle: Lifecycle, max_streams: int = 0):
        self._lifecycle = lifecycle
        self._max_streams = max_streams
        self._slots = threading.BoundedSemaphore(max_streams) if max_streams else None

    def Generate(self, request: router_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[router_pb2.GenerateResponse]:
        if self._slots is not None and not self._slots.acquire(blocking=False):
            raise ResourceExhausted(f"the router is serving its limit of {self._max_streams} "
                                    "Generate streams (--max-streams); retry shortly or on "
                                    "another replica")
        try:
            scope = CallScope()
            if not context.add_callback(scope.cancel):  # the call already ended
                scope.cancel()
            server_call = context.native_call if isinstance(context, NativeContext) else None
            for event in self._lifecycle.generate(input_from_pb(request), scope,
                                                  server_call=server_call):
                assert not isinstance(event, Parked)  # only with parking=True
                yield event_to_pb(event)
        finally:
            if self._slots is not None:
                self._slots.release()
