"""One request's KV shipped to decode, chunk by chunk while prefill still runs.

With chunked prefill the KV of a page is final once every token in it has been through the
model (a token's K/V depend only on the tokens before it). After each chunk the engine says
which pages are complete (`ship`); they go to the decode side's reserved pages as one part
(a SendPages of those pages only) while the next chunk computes. Parts go one at a time, in
order, on a background thread. When the last chunk has sampled the first token (`finish`) the
rest, including a last partly filled page, is sent from the calling thread, and `finish`
returns once every page is resident: what that wait costs after the KV was ready is the
exposed handoff (`handoff_ms`, the router's kv_transfer_ms). `total_ms` is the whole transfer's
duration: the time spent moving pages, each part from its send to its pages resident, summed
(what the handoff would cost if none of it overlapped prefill; the gaps while the next chunk
computes are not in it). Unpipelined (a prompt of one chunk) it is the one part's send ->
resident, a little less than `handoff_ms`, which also counts getting from the engine's step
to the send.

Prefix reuse: when the decode side already holds the prompt's first `destination.first_page`
pages, those are never sent; the destination's pages receive the prompt's pages from there on.

The last part starts early where its path allows (a worker's own TCP lane, eager sizes): the
engine says when the prompt's last chunk is planned, and the request's thread makes that part
ready while the chunk computes (`prepare`: route, header, a connection); the engine's thread
writes it the moment the KV is ready (`begin`: one non-blocking write, before the request's
thread is even woken); `finish` completes it. On a 2-vCPU VM across a veth that took SmolLM2's
one-page handoff from 1.10-1.17 to 0.83-0.85 ms (docs/kv-transfer.md).

The decode side's agent counts the ticket complete only once every reserved page landed, so a
decode never starts on a partial handoff. A failed or cancelled part ends the shipment: later
parts are not sent and `finish` raises its error.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Executor, Future
from dataclasses import replace
from typing import Protocol

from pdserve.common.errors import Aborted
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.tickets import TicketKey

log = logging.getLogger("pdserve.prefill.shipment")


class Handoff(Protocol):
    def prepare(self) -> None:
        """Make ready what `begin` needs, where the path can start without waiting (the
        request's thread, while the prompt's last chunk computes)."""

    def begin(self) -> bool:
        """Put the bytes on the wire now where that needs no waiting (the engine's thread,
        as the KV becomes ready; True if it wrote); `result` finishes the handoff either
        way."""

    def result(self) -> TransferReport: ...

    def settle(self) -> None:
        """Bookkeeping that moves no pages (the lane's note to its agent), after the part's
        end was taken: it is not part of the handoff's time."""

    def cancel(self) -> None: ...


class Sends(Protocol):
    """Where parts go: the agent (`AgentClient`), or the worker's same-host lane."""

    def send(self, ticket: TicketKey, src_pool_id: str, src_page_ids: list[int],
             destination: Destination, timeout_s: float) -> Handoff: ...


class Shipment:
    def __init__(self, agent: Sends, ticket: TicketKey, pool_id: str,
                 destination: Destination, timeout_s: float, executor: Executor):
        self._agent = agent
        self._ticket = ticket
        self._pool_id = pool_id
        self._destination = destination
        self._timeout_s = timeout_s
        self._executor = executor
        self._lock = threading.Lock()
        self._queued: list[tuple[list[int], int]] = []  # (src pages, offset in the prompt)
        self._skip = destination.first_page  # the decode side holds these already
        self._shipped = self._skip  # prompt pages handed to a part (or held there) so far
        self._drain: Future[None] | None = None
        self._current: Handoff | None = None
        self._next: Handoff | None = None  # the last part, made ready by `prepare`
        self._begun_at = 0.0  # when `begin` started it
        self._reports: list[TransferReport] = []
        self._unsettled: list[Handoff] = []  # parts whose bookkeeping waits for `settle`
        self._busy_s = 0.0  # the parts' durations, summed
        self._last_done = 0.0
        self._error: BaseException | None = None
        self._cancelled = False

    def ship(self, complete_pages: list[int]) -> None:
        """The pages complete so far (a prefix of the prompt's pages): queue the new ones."""
        with self._lock:
            if self._cancelled or self._error is not None \
                    or len(complete_pages) <= self._shipped:
                return
            self._queued.append((complete_pages[self._shipped:], self._shipped))
            self._shipped = len(complete_pages)
            if self._drain is None or self._drain.done():
                self._drain = self._executor.submit(self._send_queued)

    def prepare(self, all_pages: list[int]) -> None:
        """The prompt's last chunk is computing (the request's thread): make the part of the
        rest of its pages ready, for `begin` to start and `finish` to complete."""
        with self._lock:
            if self._cancelled or self._error is not None or self._next is not None \
                    or len(all_pages) <= self._shipped:
                return
            offset = self._shipped
            self._shipped = len(all_pages)
        send = self._part(all_pages[offset:], offset)
        with self._lock:
            self._next = send  # `finish` completes it, whatever `prepare` does
        try:
            send.prepare()
        except Exception:  # not this request's failure: `finish` sends it the usual way
            log.exception("preparing the KV handoff of %s", self._ticket.request_id)

    def begin(self) -> bool:
        """The last chunk's KV is ready (the engine's thread, inside its step): start the
        prepared part where no earlier part is in flight. True if it wrote."""
        with self._lock:
            send = self._next
            if send is None or self._cancelled or self._error is not None \
                    or (self._drain is not None and not self._drain.done()):
                return False
            self._begun_at = time.perf_counter()
        return send.begin()

    def finish(self, all_pages: list[int], kv_ready: float) -> TransferReport:
        """Ship the rest and wait until every page is resident; `kv_ready` (perf_counter) is
        when the last chunk's KV was ready. Raises the first part's error, or Aborted."""
        with self._lock:
            drain, rest, offset = self._drain, all_pages[self._shipped:], self._shipped
            self._shipped = len(all_pages)
            prepared, self._next = self._next, None
        if drain is not None:
            drain.result()  # a failure is recorded in self._error, not raised here
        if prepared is not None:
            with self._lock:
                self._current = prepared
            self._complete(prepared, self._begun_at or time.perf_counter())
        elif rest and self._error is None:
            self._send(rest, offset)
        if self._cancelled:
            raise Aborted("the KV handoff was cancelled")
        if self._error is not None:
            raise self._error
        reports = self._reports
        return TransferReport(
            max(0.0, self._last_done - kv_ready) * 1e3, sum(r.kv_bytes for r in reports),
            sum(r.kv_pages for r in reports), reports[-1].transport if reports else "",
            sum(r.num_runs for r in reports), self._busy_s * 1e3)

    def cancel(self) -> None:
        """Give up (any thread): the part in flight is abandoned, no other is sent."""
        with self._lock:
            self._cancelled = True
            sends = [s for s in (self._current, self._next) if s is not None]
        for send in sends:
            send.cancel()

    # ---- internals ----------------------------------------------------------------------
    def _send_queued(self) -> None:
        while True:
            with self._lock:
                if not self._queued or self._cancelled or self._error is not None:
                    return
                pages, offset = self._queued.pop(0)
            self._send(pages, offset)

    def _send(self, pages: list[int], offset: int) -> None:
        send = self._start(pages, offset)
        if send is not None:
            self._complete(send, time.perf_counter())

    def _start(self, pages: list[int], offset: int) -> Handoff | None:
        """The part's handoff, made current (None once cancelled)."""
        with self._lock:
            if self._cancelled:
                return None
            self._current = self._part(pages, offset)
            return self._current

    def _part(self, pages: list[int], offset: int) -> Handoff:
        """The handoff of `pages`, the prompt's pages from `offset` on."""
        start, dest = offset - self._skip, self._destination
        if start or len(pages) != len(dest.page_ids):  # a part: the pages it fills
            dest = replace(dest, first_page=offset,
                           page_ids=dest.page_ids[start:start + len(pages)])
        return self._agent.send(self._ticket, self._pool_id, pages, dest, self._timeout_s)

    def _complete(self, send: Handoff, started: float) -> None:
        try:
            report = send.result()
        except BaseException as exc:
            with self._lock:
                self._error = self._error or exc
            return
        finally:
            with self._lock:
                self._current = None
        with self._lock:
            self._last_done = time.perf_counter()
            self._busy_s += self._last_done - started
            self._reports.append(report)
            self._unsettled.append(send)

    def settle(self) -> None:
        """The finished parts' bookkeeping (Handoff.settle), left for after the answer: the
        caller runs it once the Prefill reply is on its way."""
        with self._lock:
            sends, self._unsettled = self._unsettled, []
        for send in sends:
            try:
                send.settle()
            except Exception:  # bookkeeping only: never the request's outcome
                log.exception("settling a finished KV handoff part")
