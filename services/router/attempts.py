"""Everything before a request's first token, with retries: the one retry loop of the router.

One attempt is: reserve pages on a decode worker D, run prefill on a prefill worker P (which
ships the KV into D's pages), then, unless the first token already ends the request, open
D's Decode stream and read its first message (the sequence is live in D's batch). The
result, `Started`, is what the lifecycle streams to the client.

An attempt that fails in a way another worker may not (UNAVAILABLE, DEADLINE_EXCEEDED,
ABORTED anywhere; FAILED_PRECONDITION when decode starts, i.e. the handoff's lease or data did
not hold) releases its reservation and the next attempt avoids the workers that failed, at
most `max_retries` more times. Nothing has reached the client yet, so a retry is always safe.
Each attempt's workers see their own request id, `<client id>#<n>.<nonce>` (common/requestids.py):
a late Abort of a failed attempt can never hit the retry's reservation, and a client may reuse
its id at once or for two requests at the same time.

The reservation's state lives on the decode worker (its lease book); the router holds only a
`ReservationHandle` (reservation.py) to release it, and, from Reserve until the decode stream
has started, keeps its lease alive with a heartbeat (renewal.py): a long prefill keeps its
pages, and when this router dies they come back within one `renew_lease_s`.

Every wait on a peer is bounded and its error names the peer and the phase: Reserve
(`reserve_timeout_s`), Prefill: queue, compute and KV handoff (`prefill_timeout_s`), the
decode stream's first message: the sequence joins D's batch (`decode_start_timeout_s`). Later
tokens are bounded by the decode worker's wait for its next token and the channel keepalive.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable

import grpc
from pdserve.common import failpoints, tracing, wire
from pdserve.common.errors import ResourceExhausted, ServiceError, Unavailable
from pdserve.common.requestids import attempt_id, new_nonce
from pdserve.router.cache_feed import CacheFeeds
from pdserve.router.calls import DECODE_START_RETRYABLE, Retry, unary_call
from pdserve.router.cancel import CallScope, ClientCancelled
from pdserve.router.candidates import candidates
from pdserve.router.placement import (
    DEFAULT_WEIGHTS,
    Placement,
    Weights,
    place_decode,
    place_prefill,
)
from pdserve.router.pool import WorkerPool
from pdserve.router.renewal import LeaseKeeper
from pdserve.router.reservation import ReservationHandle
from pdserve.router.started import DecodeStream, Started
from pdserve.router.validation import Generation
from pdserve.router.watchdog import Watchdog
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2

log = logging.getLogger("pdserve.router")

LEASE_MARGIN_S = 10.0  # decode leases = the prefill deadline + this
MAX_REFUSED = 3  # prefill workers refusing the connection tried within one attempt
# Decode pools up to this size share one DecodeMany stream per worker; in a larger one each
# stream sits idle, closes and reopens (three router threads each time): a call per sequence
# costs less (1,000 simulated workers, docs/benchmarks.md: 23 req/s shared, 99 per call).
SHARED_STREAM_MAX_WORKERS = 64


class AttemptRunner:
    """Reserve + prefill + decode start for one request, with bounded retries."""

    def __init__(self, pool: WorkerPool, *, max_retries: int = 1, reserve_timeout_s: float = 5.0,
                 prefill_timeout_s: float = 120.0, abort_timeout_s: float = 5.0,
                 decode_start_timeout_s: float = 30.0, renew_lease_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic,
                 cache: CacheFeeds | None = None, weights: Weights = DEFAULT_WEIGHTS,
                 remote_prefill_min_tokens: int = 0, stream_interval: int = 1):
        self._pool = pool
        self._stream_interval = stream_interval  # tokens per decode message after the first
        self._cache = cache  # None: placement by load only
        self._weights = weights
        # An uncached part shorter than this is prefilled by the decode worker (0: never).
        self._remote_prefill_min_tokens = remote_prefill_min_tokens
        self._placing = threading.Lock()
        self._max_retries = max_retries
        self._reserve_timeout_s = reserve_timeout_s
        self._prefill_timeout_s = prefill_timeout_s
        self._abort_timeout_s = abort_timeout_s
        self._decode_start_timeout_s = decode_start_timeout_s
        self._clock = clock
        # renew_lease_s 0: leases are not renewed and last the longest prefill (+ a margin)
        self._keeper = LeaseKeeper(renew_lease_s) if renew_lease_s else None
        self._watchdog = Watchdog()

    def close(self) -> None:
        """Stop the lease heartbeat and the watchdog (the router is stopping)."""
        if self._keeper is not None:
            self._keeper.close()
        self._watchdog.close()

    def run(self, gen: Generation, scope: CallScope,
            ends_at_first_token: Callable[[int], bool]) -> Started:
        """Return the started request, or raise `ServiceError` / `ClientCancelled`.

        `ends_at_first_token(token)` (called once per attempt that reaches its first token)
        says whether the request is over at that token, so decode need not start.
        """
        avoid_prefill: set[str] = set()
        avoid_decode: set[str] = set()
        failures: list[str] = []
        nonce = new_nonce()
        for attempt in range(1, self._max_retries + 2):
            try:
                return self._attempt(gen, scope, attempt_id(gen.request_id, attempt, nonce),
                                     attempt, avoid_prefill, avoid_decode, ends_at_first_token)
            except Retry as failure:
                failures.append(str(failure))
                log.info("request %s attempt %d failed: %s", gen.request_id, attempt, failure)
                avoid_prefill.update(filter(None, [failure.prefill]))
                avoid_decode.update(filter(None, [failure.decode]))
            except ServiceError as exc:
                if not failures:
                    raise
                # A retry that found no worker left: say what failed first (peer and phase).
                raise ServiceError(f"{exc.message} (retrying after: {'; '.join(failures)})",
                                   exc.code) from None
        raise Unavailable(f"request {gen.request_id} failed before its first token after "
                          f"{self._max_retries + 1} attempts: " + "; ".join(failures))

    def _attempt(self, gen: Generation, scope: CallScope, worker_request_id: str, attempt: int,
                 avoid_prefill: set[str], avoid_decode: set[str],
                 ends_at_first_token: Callable[[int], bool]) -> Started:
        failpoints.hit("router.queued", worker_request_id)
        reservation = self._reserve(gen, worker_request_id, scope, avoid_decode)
        try:
            failpoints.hit("router.reserved", worker_request_id)
            uncached = len(gen.prompt_ids) - reservation.cached_tokens
            if reservation.prefilling_here or (  # started at Reserve, or an older worker:
                    uncached < self._remote_prefill_min_tokens
                    and reservation.destination.agent_address != "local"):  # not co-located
                return self._prefill_on_decode(gen, reservation, scope, attempt,
                                               ends_at_first_token)
            address, reply, sent, why = self._prefill(gen, worker_request_id, reservation,
                                                      scope, avoid_prefill)
            stream = None
            if not ends_at_first_token(reply.first_token):
                stream = self._start_decode(gen, reservation, reply.first_token, scope)
                reservation.stop_renewing()  # the sequence owns the pages now
            return Started(reservation, address, reply, sent, attempt, stream,
                           placement=f"decode {reservation.placement}; prefill {why}")
        except Retry as failure:
            reservation.release(f"attempt {attempt} failed ({failure}); retrying")
            raise
        except BaseException:
            reservation.release("client cancelled" if scope.cancelled else "attempt failed")
            raise

    def _reserve(self, gen: Generation, worker_request_id: str, scope: CallScope,
                 avoid: set[str]) -> ReservationHandle:
        num_tokens = len(gen.prompt_ids)
        with self._placing:  # a burst's placements each see the calls the others took
            placement = self._place_decode(gen, avoid)
            ranked = placement.ranked
            first = self._pool.acquire("decode", ranked[0]) if ranked else None
        if not ranked:
            raise Unavailable("no healthy decode worker")
        # The lease must outlive the longest prefill this router waits for; it only matters
        # when nobody releases the pages (this router died), and then they come back after it.
        lease_s = self._prefill_timeout_s + LEASE_MARGIN_S
        request = decode_pb2.ReserveRequest(
            request_id=worker_request_id, num_prompt_tokens=num_tokens, lease_ms=lease_s * 1e3,
            renew_lease_ms=self._keeper.renew_lease_s * 1e3 if self._keeper else 0.0,
            prompt_token_ids=gen.prompt_ids,
            # A short uncached part: the decode worker starts it at once (decode-first), one
            # engine admission instead of a reservation, a window and a second admission. At
            # least 1, an offer no decode worker can take (a prompt computes at least its last
            # token), so that a co-located worker, which starts every prompt, is offered it.
            prefill_here_below_tokens=max(1, self._remote_prefill_min_tokens),
            sampling=wire.sampling_to_pb(gen.sampling))
        full: list[str] = []
        down: list[str] = []
        for address in ranked:
            worker = first if first is not None else self._pool.acquire("decode", address)
            first = None
            if worker is None:  # it left the pool since the ranking
                continue
            stub = worker.decode
            sent = self._clock()
            try:
                reply = unary_call(self._pool, scope, "router.reserve", worker.unary.reserve,
                                   request, self._reserve_timeout_s, f"decode {address}",
                                   "reserve", address, decode=address,
                                   placement=placement.explain())
            except (ClientCancelled, Retry) as failure:
                # The worker may still have granted it after we stopped waiting: release it
                # (by request id) so the pages do not sit out the whole lease.
                stub.Abort.future(decode_pb2.AbortRequest(
                    ticket=common_pb2.Ticket(request_id=worker_request_id),
                    reason="reserve abandoned by the router"), timeout=self._abort_timeout_s
                ).add_done_callback(lambda _call, w=worker: self._pool.release(w))
                if isinstance(failure, ClientCancelled):
                    raise
                down.append(str(failure))
                continue
            except BaseException as failure:
                self._pool.release(worker)
                if isinstance(failure, ResourceExhausted):
                    full.append(address)
                    continue
                raise
            self._pool.note_reserved(worker, len(reply.destination.page_ids))
            if self._cache is not None:
                self._cache.speculate(address, gen.prompt_ids)
            handle = ReservationHandle(stub, address, reply, self._abort_timeout_s,
                                       on_done=functools.partial(self._pool.release, worker),
                                       keeper=self._keeper)
            handle.placement, handle.sent_at = placement.explain(), sent
            handle.decode_call = worker.unary.decode
            if len(self._pool.healthy("decode")) <= SHARED_STREAM_MAX_WORKERS:
                handle.streams = worker.streams
            return handle
        if full:  # every reachable decode worker said it has no room: tell the client now
            raise ResourceExhausted(f"no decode worker has room for {num_tokens} prompt tokens "
                                    f"(full: {', '.join(full)})")
        raise Retry("no decode worker reachable: " + "; ".join(down))

    def _prefill(self, gen: Generation, worker_request_id: str, reservation: ReservationHandle,
                 scope: CallScope, avoid: set[str]
                 ) -> tuple[str, prefill_pb2.PrefillResponse, float, str]:
        num_tokens = len(gen.prompt_ids)
        loads = self._pool.prefill_loads(candidates(self._pool, "prefill", self._weights.sample,
                                                    self._cache, gen.prompt_ids))
        cached = self._cache.cached_pages([w.address for w in loads], gen.prompt_ids) \
            if self._cache is not None else {}
        placement = place_prefill(loads, num_tokens, cached, self._weights, avoid)
        # What it will compute, not the whole prompt, is the load it adds (its cache has the rest).
        lacks = {w.address: num_tokens - cached.get(w.address, 0) * w.block_size for w in loads}
        request = prefill_pb2.PrefillRequest(
            request_id=worker_request_id, token_ids=gen.prompt_ids,
            sampling=wire.sampling_to_pb(gen.sampling), ticket=reservation.ticket,
            destination=reservation.destination)
        refused: list[Retry] = []
        for address in placement.ranked:
            adds = lacks.get(address, num_tokens)
            worker = self._pool.acquire("prefill", address, adds)
            if worker is None:  # it left the pool since the ranking
                continue
            sent = self._clock()
            try:
                reply = unary_call(self._pool, scope, "router.prefill", worker.unary.prefill,
                                   request, self._prefill_timeout_s, f"prefill {address}",
                                   f"prefill + KV handoff to decode {reservation.address}",
                                   address, prefill=address, decode=reservation.address,
                                   placement=placement.explain())
                break
            except Retry as failure:  # a worker that refused the connection got nothing:
                refused.append(failure)  # the next one may take the same reservation
                if not failure.refused or len(refused) >= MAX_REFUSED:
                    raise
            finally:
                self._pool.release(worker, adds)
        else:
            if refused:
                raise refused[-1]
            raise Unavailable("no healthy prefill worker")
        if self._cache is not None:
            self._cache.speculate(address, gen.prompt_ids)
        return address, reply, sent, placement.explain()

    def _place_decode(self, gen: Generation, avoid: set[str]) -> Placement:
        loads = self._pool.decode_loads(candidates(self._pool, "decode", self._weights.sample,
                                                   self._cache, gen.prompt_ids))
        cached = self._cache.cached_pages([w.address for w in loads], gen.prompt_ids) \
            if self._cache is not None else {}
        return place_decode(loads, len(gen.prompt_ids), cached, self._weights, avoid)

    def _prefill_on_decode(self, gen: Generation, reservation: ReservationHandle,
                           scope: CallScope, attempt: int,
                           ends_at_first_token: Callable[[int], bool]) -> Started:
        """The decode worker computes the prompt's short uncached part itself (a co-located
        worker: every prompt), started at Reserve: no prefill call, no handoff. Its first
        message carries the first token and the prefill's times, counted from Reserve when
        the prompt started there (so the router's own part ends when that went out)."""
        sent = reservation.sent_at if reservation.prefilling_here else self._clock()
        stream = self._start_decode(gen, reservation, 0, scope, local=True)
        reservation.stop_renewing()
        first = stream.first
        if not first.token_ids:
            stream.call.cancel()
            stream.span.end()
            raise Retry(f"decode {reservation.address} prefilled without a first token",
                         decode=reservation.address)
        reply = prefill_pb2.PrefillResponse(
            first_token=first.token_ids[0], queue_ms=first.queue_ms, prefill_ms=first.prefill_ms,
            worker_id=reservation.ticket.decode_worker or reservation.address,
            cached_tokens=first.cached_tokens)
        rest = decode_pb2.DecodeResponse(decode_start_ms=first.decode_start_ms,
                                         token_ids=first.token_ids[1:],
                                         finish_reason=first.finish_reason)
        started: DecodeStream | None = DecodeStream(stream.call, rest, stream.span)
        ends = ends_at_first_token(reply.first_token)  # always asked: it counts the attempt
        if ends or first.finish_reason:
            stream.call.cancel()
            stream.span.end()
            started = None
        uncached = len(gen.prompt_ids) - reservation.cached_tokens
        if reservation.destination.agent_address == "local":  # a co-located worker: all here
            reply.transfer.transport = "local"  # as its Prefill call reported it (no bytes)
            return Started(reservation, reservation.address, reply, sent, attempt, started,
                           placement=f"co-located {reservation.placement}; prefill started at "
                           f"Reserve ({uncached} uncached tokens)")
        return Started(reservation, reservation.address, reply, sent, attempt, started,
                       prefill_on="decode", placement=f"decode {reservation.placement}; "
                       f"prefill on decode ({uncached} uncached tokens < "
                       f"{self._remote_prefill_min_tokens})")

    def _start_decode(self, gen: Generation, reservation: ReservationHandle, first_token: int,
                      scope: CallScope, local: bool = False) -> DecodeStream:
        """Open D's Decode stream and wait for its first message (the sequence is live)."""
        scope.check()
        span = tracing.start_span("router.decode_stream", kind=tracing.CLIENT,
                                  worker=reservation.address,
                                  request_id=reservation.ticket.request_id)
        call = reservation.open_decode(decode_pb2.DecodeRequest(
            ticket=reservation.ticket, prompt_token_ids=gen.prompt_ids, first_token=first_token,
            sampling=wire.sampling_to_pb(gen.sampling), local_prefill=local,
            stream_interval=self._stream_interval), span)
        timed_out = threading.Event()

        def give_up() -> None:
            timed_out.set()
            call.cancel()

        try:
            with scope.guard(call.cancel), \
                    self._watchdog.armed(self._decode_start_timeout_s, give_up):
                first = next(call)
        except StopIteration:
            call.cancel()
            tracing.record_error(span, "decode stream ended before its first message")
            span.end()
            raise Retry(f"decode {reservation.address} ended the stream before starting the "
                         "sequence", decode=reservation.address) from None
        except grpc.RpcError as exc:
            call.cancel()
            tracing.record_error(span, exc)
            span.end()
            if scope.cancelled:
                raise ClientCancelled() from None
            where = f"decode {reservation.address} did not start the sequence (decode start)"
            code, details = exc.code().name, exc.details()
            if timed_out.is_set():
                code, details = "DEADLINE_EXCEEDED", (f"no first message within "
                                                      f"{self._decode_start_timeout_s:g} s")
            if reservation.not_held:
                details += "; its reservation had already lapsed there"
            if code in DECODE_START_RETRYABLE:
                raise Retry(f"{where}: {code} {details}", decode=reservation.address,
                             code=code) from None
            raise ServiceError(f"{where}: {details}", code) from None
        except BaseException:
            call.cancel()
            span.end()
            raise
        return DecodeStream(call, first, span)
