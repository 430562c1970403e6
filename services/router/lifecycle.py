"""Everything the router does for one Generate call.

    validate + tokenize -> reserve on decode D + prefill on P (handoff.py, retried there)
    -> D.Decode(ticket, prompt ids, first token): its first message says the sequence is live
    -> first token (sampled by prefill) sent as the first delta, then Timing
    -> D streams tokens 2..n
    -> detokenize, stop strings, max_tokens -> deltas -> Finish

Stream order, always: delta(first token), Timing, deltas..., Finish. The first delta and
Timing are sent when decode's first DecodeResponse arrives (it carries decode_start_ms), so
TTFT = queue + prefill + kv_transfer + decode_start + the router's own time; when the request ends at the first token (EOS, stop string, max_tokens=1) decode is
never started, its reservation is released, and Timing follows the first delta with
decode_start_ms 0. The first delta's text may be "" (a partial character, or text held back as
a possible stop string) but it always carries the token id, so TTFT is the first token's.

After the first delta, a failure ends the stream with an error status (no retry: output is
never repeated). Client cancellation cancels the in-flight Prefill or Decode call and aborts
the ticket on D. A stop string (or EOS / max_tokens seen first by the router) aborts the
ticket at once so D frees its pages. One log line per request outcome (with its trace_id when
traced).

Tracing: one server span router.generate per request (continuing the client's traceparent),
with router.admission, router.reserve / router.prefill per attempt (handoff.py) and
router.decode_stream as children; the outcome's fields become its attributes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from pdserve.common import tracing
from pdserve.common.errors import Aborted, ServiceError, Unavailable
from pdserve.common.logs import outcome
from pdserve.common.metrics import RouterMetrics
from pdserve.router.cancel import CallScope, ClientCancelled
from pdserve.router.detokenizer import OutputText
from pdserve.router.handoff import Handoff, HandoffRunner, Reservation
from pdserve.router.pool import WorkerPool
from pdserve.router.timing import TokenClock, queue_ms
from pdserve.router.tokenizer import Tokenizer
from pdserve.router.validation import Generation, validate
from pdserve.v1 import decode_pb2, router_pb2

log = logging.getLogger("pdserve.router")


# Decode failing before its first message: the worker died, or the handoff's lease or data
# did not hold. Nothing was streamed, so another attempt is still allowed.
DECODE_START_RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                                    grpc.StatusCode.ABORTED, grpc.StatusCode.FAILED_PRECONDITION})


class DecodeDidNotStart(Exception):
    """Decode failed before the sequence was live: no token has been sent to the client."""


class Completion:
    """The generated tokens of one request: counts them, turns them into text, and decides
    when it is finished ("stop": EOS or a stop string; "length": max_tokens)."""

    def __init__(self, gen: Generation, tokenizer: Tokenizer):
        self._gen = gen
        self._eos = frozenset() if gen.sampling.ignore_eos else tokenizer.eos_token_ids
        self._text = OutputText(tokenizer, gen.prompt_ids, gen.stop)
        self.tokens = 0
        self.finish_reason = ""

    def accept(self, token_ids: Any) -> tuple[list[int], str]:
        """Take tokens until finished; return those taken and the text to send for them."""
        taken: list[int] = []
        pieces: list[str] = []
        for token in token_ids:
            if self.finish_reason:
                break
            taken.append(token)
            self.tokens += 1
            if token in self._eos:
                self.finish_reason = "stop"
            else:
                pieces.append(self._text.push(token))
                if self._text.stopped:
                    self.finish_reason = "stop"
            if not self.finish_reason and self.tokens >= self._gen.sampling.max_tokens:
                self.finish_reason = "length"
        if self.finish_reason:
            pieces.append(self._text.finish())
        return taken, "".join(pieces)

    def end(self, reason: str) -> str:
        """The decode worker finished the sequence: the text still held back."""
        self.finish_reason = reason
        return self._text.finish()


class Lifecycle:
    """Runs Generate calls against a worker pool; `stop_admitting` starts a drain."""

    def __init__(self, pool: WorkerPool, tokenizer: Tokenizer, model_name: str, *,
                 max_retries: int = 1, prefill_timeout_s: float = 120.0,
                 reserve_timeout_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 metrics: RouterMetrics | None = None):
        self.model_name = model_name
        self.metrics = metrics or RouterMetrics()
        self._tokenizer = tokenizer
        self._clock = clock
        self._runner = HandoffRunner(pool, max_retries=max_retries, clock=clock,
                                     reserve_timeout_s=reserve_timeout_s,
                                     prefill_timeout_s=prefill_timeout_s)
        self._draining = False

    def stop_admitting(self) -> None:
        """Refuse new requests (UNAVAILABLE); those in flight continue."""
        self._draining = True

    def generate(self, request: router_pb2.GenerateRequest, scope: CallScope,
                 received: float | None = None) -> Iterator[router_pb2.GenerateResponse]:
        """The response stream of one request. Raises `ServiceError` for a failed request;
        ends quietly when the client cancelled."""
        received = self._clock() if received is None else received
        span = tracing.start_span("router.generate", kind=tracing.SERVER, model=self.model_name)
        fields: dict[str, Any] = {"request_id": request.request_id or "-", "status": "OK",
                                  **tracing.log_fields(span)}
        self.metrics.started()
        try:
            with tracing.current(span):  # no yield inside: children of router.generate
                with tracing.span("router.admission"):
                    if self._draining:
                        raise Unavailable("the router is draining; send the request to another "
                                          "replica")
                    gen = validate(request, self._tokenizer, self.model_name)
                fields.update(request_id=gen.request_id, prompt_tokens=len(gen.prompt_ids))
                handoff = self._runner.run(gen, scope)
            while True:
                try:
                    with scope.guard(handoff.reservation.release_nowait):
                        yield from self._stream(gen, handoff, scope, received, fields, span)
                    break
                except DecodeDidNotStart as failure:
                    # No token reached the client yet: the whole handoff may go elsewhere.
                    log.info("request %s: %s; retrying", gen.request_id, failure)
                    fields.pop("completion_tokens", None)  # nothing of that attempt was sent
                    with tracing.current(span):
                        handoff = self._runner.run(gen, scope, first_attempt=handoff.attempts + 1,
                                                   avoid_decode={handoff.reservation.address},
                                                   earlier=[str(failure)])
        except (ClientCancelled, GeneratorExit) as exc:
            fields["status"] = "CANCELLED"
            tracing.record_error(span, exc)
            if isinstance(exc, GeneratorExit):
                raise
        except ServiceError as exc:
            fields.update(status=exc.code, error=exc.message)
            tracing.record_error(span, exc)
            raise
        except Exception as exc:
            fields.update(status="INTERNAL", error=repr(exc))
            tracing.record_error(span, exc)
            raise
        finally:
            fields["e2e_ms"] = round((self._clock() - received) * 1000.0, 3)
            span.set_attributes(fields)
            span.end()
            level = logging.INFO if fields["status"] in ("OK", "CANCELLED") else logging.WARNING
            outcome(log, "generate", level=level, **fields)
            self.metrics.finished(fields["status"], fields["e2e_ms"] / 1e3,
                                  fields.get("prompt_tokens", 0), fields.get("completion_tokens", 0),
                                  fields.get("tpot_ms", 0.0))

    def _stream(self, gen: Generation, handoff: Handoff, scope: CallScope, received: float,
                fields: dict[str, Any], span: tracing.Span
                ) -> Iterator[router_pb2.GenerateResponse]:
        rid = gen.request_id
        reservation = handoff.reservation
        clock = TokenClock(received)
        completion = Completion(gen, self._tokenizer)
        timing = _timing(handoff, received)
        fields.update(prefill=timing.prefill_worker, decode=timing.decode_worker,
                      attempts=timing.attempts)
        span.set_attributes({"kv_pages": timing.kv_pages, "kv_transport": timing.kv_transport})
        decode_finished = False
        try:
            first = handoff.prefill.first_token
            taken, text = completion.accept([first])
            first_delta = _delta(rid, text, taken)
            if completion.finish_reason:
                yield first_delta
                self._first_sent(clock, timing, fields)
                reservation.release(f"finished at the first token ({completion.finish_reason})")
                yield router_pb2.GenerateResponse(request_id=rid, timing=timing)
            else:
                scope.check()
                call_span = tracing.start_span("router.decode_stream", kind=tracing.CLIENT,
                                               parent=span, worker=reservation.address,
                                               request_id=reservation.ticket.request_id)
                call = reservation.stub.Decode(decode_pb2.DecodeRequest(
                    ticket=reservation.ticket, prompt_token_ids=gen.prompt_ids, first_token=first,
                    sampling=gen.sampling.to_proto()), metadata=tracing.outgoing_metadata(call_span))
                with scope.guard(call.cancel), tracing.ending(call_span):
                    try:
                        decode_finished = yield from self._decode(
                            call, first_delta, completion, timing, clock, handoff, fields)
                    except grpc.RpcError as exc:
                        if scope.cancelled:
                            raise ClientCancelled() from None
                        if clock.first_at is None and exc.code() in DECODE_START_RETRYABLE:
                            raise DecodeDidNotStart(
                                f"decode {reservation.address} did not start the sequence: "
                                f"{exc.code().name} {exc.details()}") from None
                        raise ServiceError(
                            f"decode {reservation.address} failed after {completion.tokens} "
                            f"tokens were streamed: {exc.code().name} {exc.details()}",
                            code=exc.code().name) from None
                    finally:
                        call.cancel()  # no-op once the stream has ended
                        call_span.set_attributes({
                            "decode_start_ms": timing.decode_start_ms,
                            "completion_tokens": completion.tokens,
                            "finish_reason": completion.finish_reason})
                self._settle(reservation, decode_finished, completion, scope)
            fields.update(finish_reason=completion.finish_reason,
                          completion_tokens=completion.tokens, tpot_ms=round(clock.tpot_ms, 3),
                          decode_start_ms=round(timing.decode_start_ms, 3))
            yield router_pb2.GenerateResponse(request_id=rid, finish=router_pb2.Finish(
                finish_reason=completion.finish_reason, prompt_tokens=len(gen.prompt_ids),
                completion_tokens=completion.tokens, e2e_ms=clock.e2e_ms(self._clock()),
                tpot_ms=clock.tpot_ms, itl_mean_ms=clock.itl_mean_ms, itl_max_ms=clock.itl_max_ms))
        finally:
            fields.setdefault("completion_tokens", completion.tokens)
            self._settle(reservation, decode_finished, completion, scope)

    @staticmethod
    def _settle(reservation: Reservation, decode_finished: bool, completion: Completion,
                scope: CallScope) -> None:
        """Before Finish is sent: when decode did not end the sequence itself (a stop string,
        cancellation, failure), abort it so D frees its pages now. Idempotent."""
        if decode_finished:
            reservation.settle()
            return
        reservation.release("client cancelled" if scope.cancelled else
                            f"router finished the request ({completion.finish_reason})"
                            if completion.finish_reason else "router-side failure")

    def _first_sent(self, clock: TokenClock, timing: router_pb2.Timing,
                    fields: dict[str, Any]) -> None:
        clock.sent(1, self._clock())
        timing.ttft_ms = clock.ttft_ms
        fields.update(ttft_ms=round(timing.ttft_ms, 3), queue_ms=round(timing.queue_ms, 3),
                      prefill_ms=round(timing.prefill_ms, 3),
                      kv_transfer_ms=round(timing.kv_transfer_ms, 3), kv_bytes=timing.kv_bytes)
        self.metrics.first_token(timing.queue_ms, timing.prefill_ms, timing.kv_transfer_ms,
                                 timing.ttft_ms, timing.kv_bytes, timing.kv_transport,
                                 timing.attempts)

    def _decode(self, call: Any, first_delta: router_pb2.GenerateResponse, completion: Completion,
                timing: router_pb2.Timing, clock: TokenClock, handoff: Handoff,
                fields: dict[str, Any]) -> Iterator[router_pb2.GenerateResponse]:
        """Relay decode's stream; returns True when decode itself finished the sequence.

        The first token (sampled by prefill) goes out when decode's first message says the
        sequence is live in its batch, so TTFT includes decode_start_ms.
        """
        rid = first_delta.request_id
        first = True
        for message in call:
            if first:
                first = False
                timing.decode_start_ms = message.decode_start_ms
                self.metrics.decode_start.observe(message.decode_start_ms / 1e3)
                yield first_delta
                self._first_sent(clock, timing, fields)
                yield router_pb2.GenerateResponse(request_id=rid, timing=timing)
            taken, text = completion.accept(message.token_ids)
            if message.finish_reason and not completion.finish_reason:
                if message.finish_reason == "abort":
                    raise Aborted(f"decode {handoff.reservation.address} aborted the sequence "
                                  f"after {completion.tokens} tokens")
                text += completion.end(message.finish_reason)
            if taken or text:
                yield _delta(rid, text, taken)
                gap_s = clock.sent(len(taken), self._clock())
                if gap_s is not None:
                    self.metrics.itl.observe(gap_s)
            if completion.finish_reason:
                return bool(message.finish_reason)
        raise Unavailable(f"decode {handoff.reservation.address}: stream ended without a finish "
                          f"reason after {completion.tokens} tokens")


def _delta(rid: str, text: str, token_ids: list[int]) -> router_pb2.GenerateResponse:
    return router_pb2.GenerateResponse(
        request_id=rid, delta=router_pb2.TokenDelta(text=text, token_ids=token_ids))


def _timing(handoff: Handoff, received: float) -> router_pb2.Timing:
    reply = handoff.prefill
    return router_pb2.Timing(
        queue_ms=queue_ms(received, handoff.prefill_sent, reply.queue_ms),
        prefill_ms=reply.prefill_ms, kv_transfer_ms=reply.transfer.handoff_ms,
        kv_bytes=reply.transfer.kv_bytes, kv_pages=reply.transfer.kv_pages,
        kv_transport=reply.transfer.transport, prefill_worker=handoff.prefill_worker,
        decode_worker=handoff.reservation.worker, attempts=handoff.attempts)
