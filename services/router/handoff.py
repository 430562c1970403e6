"""Steps 2 and 3 of a request: reserve pages on a decode worker, run prefill, with retries.

`HandoffRunner.run` returns a `Handoff`: the reservation on decode worker D (whose pages now
hold the prompt's KV) and prefill's answer (the first token, its timings, the transfer report).
A failure that looks like a dead or unreachable worker (UNAVAILABLE, DEADLINE_EXCEEDED,
ABORTED) releases the reservation and tries again, preferring other workers, at most
`max_retries` more times. Nothing has reached the client yet, so a retry is always safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from pdserve.common import tracing
from pdserve.common.errors import ResourceExhausted, ServiceError, Unavailable
from pdserve.router.cancel import CallScope, ClientCancelled
from pdserve.router.placement import rank_decode, rank_prefill
from pdserve.router.pool import WorkerPool
from pdserve.router.validation import Generation
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2

log = logging.getLogger("pdserve.router")

RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.ABORTED})
LEASE_MARGIN_S = 10.0  # decode leases = the prefill deadline + this


class Reservation:
    """Pages held for one request on a decode worker. `release` (Decode.Abort) runs at most
    once; `settle` marks the sequence finished by decode itself, so nothing is left to free."""

    def __init__(self, stub: decode_pb2_grpc.DecodeStub, address: str,
                 reply: decode_pb2.ReserveResponse, abort_timeout_s: float):
        self.stub = stub
        self.address = address
        self.ticket: common_pb2.Ticket = reply.ticket
        self.destination: common_pb2.KVDestination = reply.destination
        self._abort_timeout_s = abort_timeout_s
        self._lock = threading.Lock()
        self._done = False

    @property
    def worker(self) -> str:
        """The decode worker's own name when it gave one, else its address."""
        return self.ticket.decode_worker or self.address

    def settle(self) -> None:
        with self._lock:
            self._done = True

    def release(self, reason: str, *, wait: bool = True) -> None:
        """Abort the ticket on the decode worker (frees its pages). Errors are logged only."""
        with self._lock:
            if self._done:
                return
            self._done = True
        future = self.stub.Abort.future(decode_pb2.AbortRequest(ticket=self.ticket, reason=reason),
                                        timeout=self._abort_timeout_s)
        if wait:
            _log_abort(self, future)
        else:
            future.add_done_callback(lambda f: _log_abort(self, f))

    def release_nowait(self) -> None:
        self.release("client cancelled", wait=False)


def _log_abort(reservation: Reservation, future: grpc.Future) -> None:
    try:
        future.result()
    except grpc.RpcError as exc:
        log.warning("Abort of %s on decode %s failed: %s %s", reservation.ticket.request_id,
                    reservation.address, exc.code().name, exc.details())


@dataclass
class Handoff:
    """A prefilled request, ready to decode."""

    reservation: Reservation
    prefill_address: str
    prefill: prefill_pb2.PrefillResponse
    prefill_sent: float  # clock() when the successful Prefill call went out
    attempts: int

    @property
    def prefill_worker(self) -> str:
        return self.prefill.worker_id or self.prefill_address


def attempt_id(request_id: str, attempt: int) -> str:
    """The request id the workers see: the client's on the first attempt, `<id>#<n>` on the
    n-th, so a late Abort of a failed attempt can never hit the retry's reservation."""
    return request_id if attempt == 1 else f"{request_id}#{attempt}"


class _Retry(Exception):
    """One attempt failed in a way another attempt may not."""

    def __init__(self, message: str, prefill: str | None = None, decode: str | None = None,
                 code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE):
        super().__init__(message)
        self.prefill = prefill
        self.decode = decode
        self.code = code  # the status the attempt's span records


class HandoffRunner:
    """Reserve + prefill for one request, with bounded retries on other workers."""

    def __init__(self, pool: WorkerPool, *, max_retries: int = 1, reserve_timeout_s: float = 5.0,
                 prefill_timeout_s: float = 120.0, abort_timeout_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        self._pool = pool
        self._max_retries = max_retries
        self._reserve_timeout_s = reserve_timeout_s
        self._prefill_timeout_s = prefill_timeout_s
        self._abort_timeout_s = abort_timeout_s
        self._clock = clock

    def run(self, gen: Generation, scope: CallScope, *, first_attempt: int = 1,
            avoid_decode: set[str] | None = None, earlier: list[str] | None = None) -> Handoff:
        """Return the handoff, or raise `ServiceError` / `ClientCancelled`.

        A request gets at most `max_retries + 1` attempts in all: a caller whose handoff failed
        later (decode did not start) calls again with the next `first_attempt`.
        """
        avoid_prefill: set[str] = set()
        avoid_decode = set(avoid_decode or ())
        failures: list[str] = list(earlier or ())
        for attempt in range(first_attempt, self._max_retries + 2):
            try:
                return self._attempt(gen, scope, attempt, avoid_prefill, avoid_decode)
            except _Retry as failure:
                failures.append(str(failure))
                log.info("request %s attempt %d failed: %s", gen.request_id, attempt, failure)
                avoid_prefill.update(filter(None, [failure.prefill]))
                avoid_decode.update(filter(None, [failure.decode]))
        raise Unavailable(f"request {gen.request_id} failed before its first token after "
                          f"{self._max_retries + 1} attempts: " + "; ".join(failures))

    def _attempt(self, gen: Generation, scope: CallScope, attempt: int,
                 avoid_prefill: set[str], avoid_decode: set[str]) -> Handoff:
        worker_request_id = attempt_id(gen.request_id, attempt)
        reservation = self._reserve(gen, worker_request_id, scope, avoid_decode)
        try:
            ranked = rank_prefill(self._pool.prefill_loads(), avoid_prefill)
            if not ranked:
                raise Unavailable("no healthy prefill worker")
            address = ranked[0]
            request = prefill_pb2.PrefillRequest(
                request_id=worker_request_id, token_ids=gen.prompt_ids,
                sampling=gen.sampling.to_proto(), ticket=reservation.ticket,
                destination=reservation.destination)
            sent = self._clock()
            with self._pool.prefill_work(address, len(gen.prompt_ids)):
                reply = self._call(scope, self._pool.prefill_stub(address).Prefill, request,
                                   self._prefill_timeout_s, "prefill", address,
                                   decode=reservation.address)
            return Handoff(reservation, address, reply, sent, attempt)
        except _Retry:
            reservation.release("prefill failed; retrying")
            raise
        except BaseException:
            reservation.release("client cancelled" if scope.cancelled else "prefill failed")
            raise

    def _reserve(self, gen: Generation, worker_request_id: str, scope: CallScope,
                 avoid: set[str]) -> Reservation:
        num_tokens = len(gen.prompt_ids)
        ranked = rank_decode(self._pool.decode_loads(), num_tokens, avoid)
        if not ranked:
            raise Unavailable("no healthy decode worker")
        # The lease must outlive the longest prefill this router waits for; it only matters
        # when nobody releases the pages (this router died), and then they come back after it.
        request = decode_pb2.ReserveRequest(request_id=worker_request_id,
                                            num_prompt_tokens=num_tokens,
                                            lease_ms=(self._prefill_timeout_s + LEASE_MARGIN_S) * 1e3)
        full: list[str] = []
        down: list[str] = []
        for address in ranked:
            stub = self._pool.decode_stub(address)
            try:
                reply = self._call(scope, stub.Reserve, request, self._reserve_timeout_s,
                                   "decode", address, decode=address)
            except (ClientCancelled, _Retry) as failure:
                # The worker may still have granted it after we stopped waiting: release it
                # (by request id) so the pages do not sit out the whole lease.
                stub.Abort.future(decode_pb2.AbortRequest(
                    ticket=common_pb2.Ticket(request_id=worker_request_id),
                    reason="reserve abandoned by the router"), timeout=self._abort_timeout_s)
                if isinstance(failure, ClientCancelled):
                    raise
                down.append(str(failure))
                continue
            except ResourceExhausted:
                full.append(address)
                continue
            self._pool.note_reserved(address, len(reply.destination.page_ids))
            return Reservation(stub, address, reply, self._abort_timeout_s)
        if full:  # every reachable decode worker said it has no room: tell the client now
            raise ResourceExhausted(f"no decode worker has room for {num_tokens} prompt tokens "
                                    f"(full: {', '.join(full)})")
        raise _Retry("no decode worker reachable: " + "; ".join(down))

    def _call(self, scope: CallScope, method: grpc.UnaryUnaryMultiCallable, request: object,
              timeout_s: float, role: str, address: str, *, decode: str | None) -> object:
        """One unary call that client cancellation interrupts; errors sorted by what to do.

        Traced as a client span (router.reserve on decode, router.prefill) whose context the
        call carries, so the worker's span is its child."""
        with tracing.span("router.reserve" if role == "decode" else "router.prefill",
                          kind=tracing.CLIENT, worker=address,
                          request_id=getattr(request, "request_id", "")):
            scope.check()
            future = method.future(request, timeout=timeout_s,
                                   metadata=tracing.outgoing_metadata())
            with scope.guard(future.cancel):
                try:
                    return future.result()
                except grpc.FutureCancelledError:
                    raise ClientCancelled() from None
                except grpc.RpcError as exc:
                    if scope.cancelled:
                        raise ClientCancelled() from None
                    code, details = exc.code(), exc.details()
            where = f"{role} {address}"
            if code == grpc.StatusCode.UNAVAILABLE:
                self._pool.suspect(address)  # re-check its health now, not at the next round
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise ResourceExhausted(f"{where}: {details}")
            if code in RETRYABLE:
                raise _Retry(f"{where}: {code.name} {details}",
                             prefill=address if role == "prefill" else None, decode=decode,
                             code=code)
            raise ServiceError(f"{where}: {details}", code=code.name)
