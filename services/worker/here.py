"""Prompts a worker computes into its own pages, started at Reserve: a decode worker's short
uncached parts (decode-first), and every prompt of a co-located worker.

`start` takes the pages and queues the prompt for the worker's next step under one engine
lock hold, at Reserve; the Decode call that follows (`local_prefill`) gets the sequence from
`stream`, first token first, then its tokens. In between the sequence waits in an
`EarlyStarts` book (renewed, dropped or expired like the reservation it stands in for).

For a co-located worker this replaces a Reserve, a Prefill call and a Decode call, each
waiting for the engine lock (a step long under load), with a Reserve and a Decode call: at 32
concurrent streams the Prefill call's lock wait alone was ~70 ms of a ~240 ms TTFT p50.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from pdserve.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from pdserve.common.handoff import Destination
from pdserve.common.metrics import WorkerMetrics
from pdserve.common.tickets import TicketKey
from pdserve.engine.engine import Engine
from pdserve.engine.loop import EngineLoop, Outputs
from pdserve.engine.pool import OutOfPages
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import StepOutput
from pdserve.worker.early import EarlyStart, EarlyStarts
from pdserve.worker.leases import LeaseBook
from pdserve.worker.streams import first_output, token_events
from pdserve.worker.types import DecodeEvent, DecodeRequest, Reservation

log = logging.getLogger("pdserve.worker")


class LocalPrefill:
    def __init__(self, worker_id: str, role: str, loop: EngineLoop, metrics: WorkerMetrics,
                 token_wait_s: float):
        self.worker_id = worker_id
        self.role = role  # "decode", "co-located": how errors name this worker
        self.loop = loop
        self.metrics = metrics
        self.token_wait_s = token_wait_s
        self.early = EarlyStarts(self._end)

    def reserve(self, leases: LeaseBook, key: TicketKey, lease_s: float, renew_s: float,
                prompt_ids: list[int], params: SamplingParams, below_tokens: int,
                destination: Callable[[int], Destination]) -> Reservation | None:
        """`start`, answered as Reserve answers it: `destination(cached_pages)` names no pages
        to fill, and `prefilling_here` is set; None when nothing was started."""
        started = self.start(leases, key, lease_s, renew_s, prompt_ids, params, below_tokens)
        if started is None:
            return None
        cached_pages, renew_s = started
        cached_tokens = cached_pages * self.loop.engine.config.block_size
        self.metrics.note_prompt(len(prompt_ids), cached_tokens)
        return Reservation(key, destination(cached_pages), renew_s, cached_tokens,
                           prefilling_here=True)

    def start(self, leases: LeaseBook, key: TicketKey, lease_s: float, renew_s: float,
              prompt_ids: list[int], params: SamplingParams,
              below_tokens: int) -> tuple[int, float] | None:
        """Take the prompt's pages and queue it now when this worker lacks fewer than
        `below_tokens` of it: (cached pages, the lease's renewal period); None (nothing
        taken) when it lacks more."""
        rid = key.request_id
        lease_s, renew_s = leases.terms(rid, len(prompt_ids), lease_s, renew_s, prompt_ids)
        if leases.lease(rid) is not None:
            raise FailedPrecondition(f"request {rid} already has pages on {self.worker_id}")
        received = time.perf_counter()

        def start(e: Engine) -> int | None:
            taken = e.reserve_prompt(key, prompt_ids, uncached_below=below_tokens)
            if taken is None:
                return None
            try:
                e.add_request(rid, prompt_ids, params, reservation=key)
            except BaseException:
                e.free_reservation(key)
                raise
            return taken[0]

        try:
            cached_pages, outputs = self.loop.start_sequence(rid, start)
        except OutOfPages as exc:
            raise ResourceExhausted(f"{self.role} worker {self.worker_id}: no room for "
                                    f"{len(prompt_ids)} prompt tokens ({exc})") from None
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        if cached_pages is None:
            self.loop.unsubscribe(rid)
            return None
        self.early.add(key, outputs, received, lease_s, renew_s)
        return cached_pages, renew_s

    def stream(self, request: DecodeRequest, received: float,
               adopt: Callable[[], Outputs]) -> Iterator[DecodeEvent]:
        """The Decode call of a prompt computed here: the sequence started at Reserve, or (no
        start: an older router, or the part was long) the one `adopt()` queues now. The first
        event carries the first token and the prefill's timing."""
        rid = request.ticket.request_id
        early = self.early.take(request.ticket)
        outputs = early.outputs if early is not None else adopt()
        try:
            out = first_output(outputs, rid, self.token_wait_s,
                               lambda: self.loop.abort(rid, "timed out"))
            now = time.perf_counter()
            if out.finish_reason:
                self.metrics.finished.labels(out.finish_reason).inc()
            yield DecodeEvent([out.token] if out.token is not None else [],
                              out.finish_reason or "", *local_times(early, received, now, out))
            if out.finish_reason:
                return
            yield from token_events(outputs, rid, self.token_wait_s,
                                    lambda why: self.metrics.finished.labels(why).inc())
        finally:
            self.loop.unsubscribe(rid)
            if self.loop.abort(rid):  # still live: its reader went away
                self.metrics.finished.labels("abort").inc()

    def drop(self, request_id: str) -> bool:
        """End a start no Decode call streams yet (aborted); False when there is none."""
        if self.early.drop(request_id):
            self.metrics.finished.labels("abort").inc()
            return True
        return False

    def renew(self, keys: list[TicketKey], renew_s: float) -> list[TicketKey]:
        return self.early.renew(keys, renew_s)

    def expire(self) -> None:
        """End the starts whose lease passed before their Decode call (the lease reaper's)."""
        for _ in self.early.expire():  # counted as the reservation it stood in for would be
            self.metrics.lease_expiries.inc()

    def close(self) -> None:
        self.early.close()

    def _end(self, rid: str, reason: str) -> None:
        """A sequence started at Reserve that no Decode call streams: end it, drop its outputs."""
        self.loop.abort(rid, reason)
        self.loop.unsubscribe(rid)
        log.info("sequence %s started at Reserve ended before its Decode call: %s", rid, reason)


def local_times(early: EarlyStart | None, received: float, now: float,
                out: StepOutput) -> tuple[float, float, float, int]:
    """(decode_start_ms, prefill_ms, queue_ms, cached_tokens) of a local prefill's first
    message, adding up to the time since the prompt reached this worker: at Reserve when it
    started there (`early`), else at the Decode call (`received`). Queue is that arrival to the
    prefill's end less its compute; decode start only what follows the later of the Decode call
    and the prefill's end."""
    arrived = early.received if early is not None else received
    done = out.done_at or now
    return ((now - max(received, done)) * 1e3, out.prefill_ms,
            max(0.0, (done - arrived) * 1e3 - out.prefill_ms), out.cached_tokens)
