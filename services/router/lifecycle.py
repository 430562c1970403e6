"""Everything the router does for one Generate call, whatever the front door.

    validate + tokenize -> AttemptRunner (attempts.py): reserve on decode D, prefill on P,
    and, unless the first token ends the request, D's Decode stream open and live
    -> first token (sampled by prefill) sent as the first Delta, then Timing
    -> D streams tokens 2..n -> detokenize, stop strings, max_tokens -> Deltas -> Finish

Stream order, always: Delta(first token), Timing, Deltas..., Finish. The first Delta and
Timing are sent once decode says the sequence is live (its first message carries
decode_start_ms), so TTFT = queue + prefill + kv_transfer + decode_start + the router's own
time; when the request ends at the first token (EOS, stop string, max_tokens=1) decode is never
started, its reservation is released, and Timing has decode_start_ms 0. The first Delta's text
may be "" (a partial character, or text held back as a possible stop string) but it always
carries the token id, so TTFT is the first token's.

After the first Delta, a failure ends the stream with an error (no retry: output is never
repeated). Client cancellation cancels the in-flight call and aborts the ticket on D. A stop
string (or EOS / max_tokens seen first by the router) aborts the ticket at once so D frees its
pages. One log line per request outcome, with its trace_id when traced, from the typed
`RequestRecord` that the span and the metrics read too.

Tracing: one server span router.generate per request (continuing the client's traceparent),
with router.admission, router.reserve / router.prefill / router.decode_stream per attempt as
children.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterable, Iterator

import grpc
from pdserve.common import failpoints, tracing
from pdserve.common.errors import Aborted, ServiceError, Unavailable
from pdserve.common.logs import outcome
from pdserve.common.metrics import RouterMetrics
from pdserve.common.wire import rank_from_pb
from pdserve.router import native_relay
from pdserve.router.api import Delta, Finish, GenerateInput, StreamEvent, Timing
from pdserve.router.attempts import AttemptRunner
from pdserve.router.cache_feed import CacheFeeds
from pdserve.router.cancel import CallScope, ClientCancelled
from pdserve.router.detokenizer import OutputText
from pdserve.router.mux import SequenceStream
from pdserve.router.native_relay import Outcome, Relay, Relayer
from pdserve.router.placement import DEFAULT_WEIGHTS, Weights
from pdserve.router.pool import WorkerPool
from pdserve.router.record import RequestRecord
from pdserve.router.started import DecodeStream, Parked, Started
from pdserve.router.timing import TokenClock, queue_ms
from pdserve.router.tokenizer import Tokenizer
from pdserve.router.validation import Generation, validate

log = logging.getLogger("pdserve.router")


class Completion:
    """The generated tokens of one request: counts them, turns them into text, and decides
    when it is finished ("stop": EOS or a stop string; "length": max_tokens)."""

    def __init__(self, gen: Generation, tokenizer: Tokenizer):
        self._gen = gen
        self._eos = frozenset() if gen.sampling.ignore_eos else tokenizer.eos_token_ids
        self._text = OutputText(tokenizer, gen.stop)
        self.tokens = 0
        self.finish_reason = ""
        self.first_text = ""  # what the first token's Delta carries

    def accept_first(self, token: int) -> bool:
        """Take the first token (sampled by prefill); True when it already ends the request."""
        _, self.first_text = self.accept([token])
        return bool(self.finish_reason)

    def accept(self, token_ids: Iterable[int]) -> tuple[list[int], str]:
        """Take tokens until finished; return those taken and the text to send for them."""
        taken: list[int] = []
        pieces: list[str] = []
        for token in token_ids:
            if self.finish_reason:
                break
            taken.append(token)
            self.tokens += 1
            pieces.append(self._text.push(token))  # EOS too: decode() skips special tokens
            if token in self._eos or self._text.stopped:
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

    def native(self, relayer: Relayer, request_id: str) -> Relay | None:
        """This completion's state in a native relay, from here on (None: the detokenizer
        holds part of a character now, so the Python relay goes on)."""
        held = self._text.held_if_settled()
        if held is None or self.finish_reason:
            return None
        return relayer.relay(request_id, self._gen.sampling.max_tokens, self.tokens,
                             sorted(self._eos), self._gen.stop, held)


class Lifecycle:
    """Runs Generate calls against a worker pool; `stop_admitting` starts a drain."""

    def __init__(self, pool: WorkerPool, tokenizer: Tokenizer, model_name: str, *,
                 max_retries: int = 1, prefill_timeout_s: float = 120.0,
                 reserve_timeout_s: float = 5.0, decode_start_timeout_s: float = 30.0,
                 renew_lease_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 metrics: RouterMetrics | None = None, cache: CacheFeeds | None = None,
                 weights: Weights = DEFAULT_WEIGHTS, remote_prefill_min_tokens: int = 0,
                 stream_interval: int = 1, relayer: Relayer | None = None):
        self.model_name = model_name
        # decode tokens relayed in C++ where the call and the tokenizer allow (native_relay.py)
        self._relayer = relayer if clock is time.monotonic and not failpoints.active() else None
        self.metrics = metrics or RouterMetrics()
        self._pool = pool
        self._tokenizer = tokenizer
        self._clock = clock
        self._runner = AttemptRunner(pool, max_retries=max_retries, clock=clock,
                                     reserve_timeout_s=reserve_timeout_s,
                                     prefill_timeout_s=prefill_timeout_s,
                                     decode_start_timeout_s=decode_start_timeout_s,
                                     renew_lease_s=renew_lease_s, cache=cache,
                                     weights=weights,
                                     remote_prefill_min_tokens=remote_prefill_min_tokens,
                                     stream_interval=stream_interval)
        self._draining = False

    def close(self) -> None:
        """Stop the background threads (lease heartbeat, watchdog)."""
        self._runner.close()

    def stop_admitting(self) -> None:
        """Refuse new requests (UNAVAILABLE); those in flight continue."""
        self._draining = True

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def max_model_len(self) -> int | None:
        """The context served, prompt + output tokens: the least of the model's own (its
        config) and what the workers report (a worker may serve less); None: no limit known."""
        limits = [n for n in (self._tokenizer.max_context, self._pool.max_model_len()) if n]
        return min(limits, default=None)

    def generate(self, request: GenerateInput, scope: CallScope,
                 received: float | None = None, *, api: str = "grpc", parking: bool = False,
                 server_call: int | None = None) -> Iterator[StreamEvent | Parked]:
        """The event stream of one request. Raises `ServiceError` for a failed request; ends
        quietly when the client cancelled. `api` names the front door in metrics and logs.

        `parking`: yield `Parked` instead of waiting for the decode worker's next message on
        a shared stream (the caller parks the stream and goes; see http_bridge).
        `server_call`: the client's call on the native server, where the deltas after the
        first decode message may be written from C++ (native_relay.py) instead of yielded."""
        received = self._clock() if received is None else received
        span = tracing.start_span("router.generate", kind=tracing.SERVER, model=self.model_name)
        record = RequestRecord(request_id=request.request_id or "-", api=api,
                               trace_id=tracing.log_fields(span).get("trace_id", ""))
        self.metrics.started()
        try:
            with tracing.current(span):  # no yield inside: children of router.generate
                with tracing.span("router.admission"):
                    if self._draining:
                        raise Unavailable("the router is draining; send the request to another "
                                          "replica")
                    gen = validate(request, self._tokenizer, self.model_name,
                                   max_model_len=self.max_model_len)
                record.request_id, record.prompt_tokens = gen.request_id, len(gen.prompt_ids)
                completions: list[Completion] = []

                def ends_at_first_token(token: int) -> bool:  # a fresh count per attempt
                    completions.append(Completion(gen, self._tokenizer))
                    return completions[-1].accept_first(token)

                started = self._runner.run(gen, scope, ends_at_first_token)
            with scope.guard(started.reservation.release_nowait):
                yield from self._stream(gen, started, completions[-1], scope, received, record,
                                        span, parking, None if parking else server_call)
        except (ClientCancelled, GeneratorExit) as exc:
            record.status = "CANCELLED"
            tracing.record_error(span, exc)
            if isinstance(exc, GeneratorExit):
                raise
        except ServiceError as exc:
            record.status, record.error = exc.code, exc.message
            tracing.record_error(span, exc)
            raise
        except Exception as exc:
            record.status, record.error = "INTERNAL", repr(exc)
            tracing.record_error(span, exc)
            raise
        finally:
            record.e2e_ms = (self._clock() - received) * 1000.0
            fields = record.fields()
            span.set_attributes(fields)
            span.end()
            level = logging.INFO if record.status in ("OK", "CANCELLED") else logging.WARNING
            outcome(log, "generate", level=level, **fields)
            self.metrics.finished(record.status, record.e2e_ms / 1e3, record.prompt_tokens,
                                  record.completion_tokens, record.tpot_ms, record.api)

    def _stream(self, gen: Generation, started: Started, completion: Completion,
                scope: CallScope, received: float, record: RequestRecord,
                span: tracing.Span, parking: bool, server_call: int | None
                ) -> Iterator[StreamEvent | Parked]:
        rid = gen.request_id
        reservation = started.reservation
        clock = TokenClock(received)
        timing = _timing(rid, started, received)
        record.prefill, record.decode = timing.prefill_worker, timing.decode_worker
        record.attempts = timing.attempts
        record.placement = started.placement
        record.prefill_on, record.cached_tokens = timing.prefill_on, timing.cached_tokens
        span.set_attributes({"kv_pages": timing.kv_pages, "kv_transport": timing.kv_transport,
                             "prompt_pages": timing.prompt_pages,
                             "cached_tokens": timing.cached_tokens,
                             "prefill_cached_tokens": timing.prefill_cached_tokens,
                             "decode_cached_tokens": timing.decode_cached_tokens,
                             "prefill_on": timing.prefill_on,
                             "placement": started.placement})
        first_delta = Delta(rid, completion.first_text, (started.prefill.first_token,))
        decode_finished = False
        try:
            if started.decode is None:  # the first token ended the request
                yield first_delta
                yield self._first_sent(clock, timing, record)
                reservation.release(f"finished at the first token ({completion.finish_reason})")
            else:
                decode_finished = yield from self._relay(started.decode, first_delta, completion,
                                                         timing, clock, record, scope,
                                                         reservation.address, parking,
                                                         server_call)
            self._settle(started, decode_finished, completion, scope)
            record.finish_reason = completion.finish_reason
            record.completion_tokens = completion.tokens
            record.tpot_ms = clock.tpot_ms
            yield Finish(rid, completion.finish_reason, len(gen.prompt_ids), completion.tokens,
                         clock.e2e_ms(self._clock()), clock.tpot_ms, clock.itl_mean_ms,
                         clock.itl_max_ms)
        finally:
            record.completion_tokens = completion.tokens
            self._settle(started, decode_finished, completion, scope)

    def _relay(
        self,
        stream: DecodeStream,
        first_delta: Delta,
        completion: Completion,
        timing: Timing,
        clock: TokenClock,
        record: RequestRecord,
        scope: CallScope,
        address: str,
        parking: bool,
        server_call: int | None,
    ) -> Generator[StreamEvent | Parked, None, bool]:
        """Relay decode's stream; returns True when decode itself finished the sequence."""
        timing.decode_start_ms = stream.first.decode_start_ms
        record.decode_start_ms = timing.decode_start_ms
        self.metrics.decode_start.observe(timing.decode_start_ms / 1e3)
        rid = first_delta.request_id
        try:
            with scope.guard(stream.call.cancel), tracing.ending(stream.span):
                yield first_delta
                yield self._first_sent(clock, timing, record)
                try:
                    for message in stream.messages(parking, self.metrics.relay_merged.inc):
                        if isinstance(message, Parked):
                            yield message
                            continue
                        failpoints.hit("router.decoding", rid)
                        taken, text = completion.accept(message.token_ids)
                        if message.finish_reason and not completion.finish_reason:
                            if message.finish_reason == "abort":
                                raise Aborted(f"decode {address} aborted the sequence after "
                                              f"{completion.tokens} tokens")
                            text += completion.end(message.finish_reason)
                        if taken or text:
                            yield Delta(rid, text, tuple(taken))
                            gap_s = clock.sent(len(taken), self._clock())
                            if gap_s is not None:
                                self.metrics.itl.observe(gap_s)
                        if completion.finish_reason:
                            if parking and not message.finish_reason:  # the router ends it:
                                yield Parked(None)  # its release blocks, not on the reader
                            return bool(message.finish_reason)
                        relayed = self._native(stream, completion, rid, server_call)
                        if relayed is not None:
                            self.metrics.relayed_natively.inc()
                            return native_relay.settle(relayed, completion, clock,
                                                       self.metrics.itl.observe, scope, address)
                except grpc.RpcError as exc:
                    if scope.cancelled:
                        raise ClientCancelled() from None
                    raise ServiceError(
                        f"decode {address} (decoding) failed after {completion.tokens} tokens "
                        f"were streamed: {exc.code().name} {exc.details()}",
                        exc.code().name) from None
                raise Unavailable(f"decode {address} (decoding): stream ended without a finish "
                                  f"reason after {completion.tokens} tokens")
        finally:
            stream.call.cancel()  # no-op once the stream has ended
            stream.span.set_attributes({"decode_start_ms": timing.decode_start_ms,
                                        "completion_tokens": completion.tokens,
                                        "finish_reason": completion.finish_reason})

    def _native(self, stream: DecodeStream, completion: Completion, rid: str,
                server_call: int | None) -> Outcome | None:
        """The rest of the stream relayed in C++, where it can be (the client's call on the
        native server, a qualifying tokenizer; the sequence's own native Decode call, or a
        shared stream): how it ended; None: the Python relay goes on."""
        if self._relayer is None or server_call is None:
            return None
        call = stream.call
        handle: int | None = getattr(call, "native_handle", None)
        if handle is None and not isinstance(call, SequenceStream):  # a grpcio call
            return None
        relay = completion.native(self._relayer, rid)
        if relay is None:
            return None
        with relay:
            if handle is None:  # a shared stream
                return call.relay_natively(relay, server_call)  # type: ignore[no-any-return]
            return relay.run(server_call, handle)

    @staticmethod
    def _settle(started: Started, decode_finished: bool, completion: Completion,
                scope: CallScope) -> None:
        """Before Finish is sent: when decode did not end the sequence itself (a stop string,
        cancellation, failure), abort it so D frees its pages now. Idempotent."""
        if decode_finished:
            started.reservation.settle()
            return
        started.reservation.release("client cancelled" if scope.cancelled else
                                    f"router finished the request ({completion.finish_reason})"
                                    if completion.finish_reason else "router-side failure")

    def _first_sent(self, clock: TokenClock, timing: Timing, record: RequestRecord) -> Timing:
        clock.sent(1, self._clock())
        timing.ttft_ms = clock.ttft_ms
        record.ttft_ms, record.queue_ms = timing.ttft_ms, timing.queue_ms
        record.prefill_ms, record.kv_transfer_ms = timing.prefill_ms, timing.kv_transfer_ms
        record.kv_transfer_total_ms = timing.kv_transfer_total_ms
        record.kv_bytes = timing.kv_bytes
        self.metrics.first_token(timing.queue_ms, timing.prefill_ms, timing.kv_transfer_ms,
                                 timing.ttft_ms, timing.kv_bytes, timing.kv_transport,
                                 timing.attempts, record.api, timing.kv_transfer_total_ms)
        return timing


def _timing(rid: str, started: Started, received: float) -> Timing:
    reply = started.prefill
    dest = started.reservation.destination
    return Timing(rid, queue_ms=queue_ms(received, started.prefill_sent, reply.queue_ms),
                  prefill_ms=reply.prefill_ms, kv_transfer_ms=reply.transfer.handoff_ms,
                  kv_bytes=reply.transfer.kv_bytes, kv_pages=reply.transfer.kv_pages,
                  kv_transport=reply.transfer.transport, prefill_worker=started.prefill_worker,
                  decode_worker=started.reservation.worker, attempts=started.attempts,
                  # 0 from a prefill worker that predates the field: it did not pipeline
                  kv_transfer_total_ms=reply.transfer.kv_transfer_total_ms
                  or reply.transfer.handoff_ms,
                  cached_tokens=reply.cached_tokens,
                  prefill_cached_tokens=reply.cached_tokens if started.prefill_on == "prefill"
                  else 0, decode_cached_tokens=started.reservation.cached_tokens,
                  prompt_pages=dest.first_page + len(dest.page_ids),
                  prefill_on=started.prefill_on,
                  kv_ranks=tuple(rank_from_pb(r) for r in reply.transfer.ranks))
