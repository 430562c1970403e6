"""The decode worker: reservations (leases) on a paged pool, then continuous-batched decoding.

Request path on this side: `reserve` takes pages for a prompt before its prefill runs and
tells the host's agent to accept writes for the ticket into exactly those pages until the
lease ends. `decode` checks the handoff landed, closes the write window, and puts the
sequence into the running batch; tokens stream back as steps produce them. A reservation
whose handoff never comes (router or prefill died) is reclaimed when its lease expires: the
agent stops accepting writes for it first, then the pages are freed.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Iterator

import grpc
from pdserve.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from pdserve.common.kvclient import AgentClient, fingerprint_pb
from pdserve.common.metrics import WorkerMetrics
from pdserve.engine.loop import EngineLoop, SequenceAborted
from pdserve.engine.pool import OutOfPages
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.sequence import StepOutput
from pdserve.v1 import common_pb2

log = logging.getLogger("pdserve.decode")
REAP_INTERVAL_S = 0.2
TOKEN_WAIT_S = 120.0


@dataclasses.dataclass
class Reservation:
    ticket: common_pb2.Ticket
    page_ids: list[int]
    deadline: float  # time.monotonic()


@dataclasses.dataclass
class DecodeEvent:
    """One message of a decode stream: tokens, and on the first message the start latency."""

    token_ids: list[int]
    finish_reason: str = ""
    decode_start_ms: float = 0.0


class DecodeWorker:
    role = "decode"

    def __init__(self, loop: EngineLoop, agent: AgentClient | None, *, worker_id: str, agent_address: str,
                 default_lease_ms: float = 30_000.0):
        self.loop = loop
        self.engine = loop.engine
        self.agent = agent
        self.worker_id = worker_id
        self.agent_address = agent_address
        self.default_lease_ms = default_lease_ms
        self.epoch = time.time_ns() // 1000  # tickets from before a restart are recognisably stale
        self.fingerprint = fingerprint_pb(self.engine.pool.fingerprint)
        self.pool_id = ""
        self.agent_epoch = 0
        self.admitting = True
        self._lock = threading.Lock()
        self._reservations: dict[str, Reservation] = {}
        self._quarantine: dict[str, Reservation] = {}  # pages a write may still be landing in
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name="lease-reaper", daemon=True)
        self.metrics = WorkerMetrics(self.role, self.stats)

    def register(self) -> None:
        if self.agent is not None:
            pool = self.engine.pool
            reply = self.agent.register_pool(self.worker_id, pool.shm_name, pool.num_pages,
                                             pool.page_bytes, self.fingerprint)
            self.pool_id, self.agent_epoch = reply.pool_id, reply.agent_epoch
        self._reaper.start()

    # ---- reservations ----------------------------------------------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int, lease_ms: float) -> tuple[
            common_pb2.Ticket, common_pb2.KVDestination]:
        if not self.admitting:
            raise Unavailable(f"decode worker {self.worker_id} is draining")
        if not request_id:
            raise InvalidArgument("request_id is empty")
        if num_prompt_tokens <= 0:
            raise InvalidArgument(f"num_prompt_tokens must be > 0, got {num_prompt_tokens}")
        lease_ms = lease_ms or self.default_lease_ms
        ticket = common_pb2.Ticket(request_id=request_id, epoch=self.epoch, decode_worker=self.worker_id)
        key = (request_id, self.epoch)
        with self._lock:
            if request_id in self._reservations or request_id in self.engine.seqs:
                raise FailedPrecondition(f"request {request_id} already has pages on {self.worker_id}")
            try:
                pages = self.loop.submit(lambda e: e.reserve(key, num_prompt_tokens))
            except OutOfPages as exc:
                raise ResourceExhausted(f"decode worker {self.worker_id}: no room for "
                                        f"{num_prompt_tokens} prompt tokens ({exc})") from None
            self._reservations[request_id] = Reservation(ticket, pages, time.monotonic() + lease_ms / 1e3)
        try:
            if self.agent is not None:
                self.agent.expect(ticket, self.pool_id, pages, lease_ms)
        except Exception as exc:
            self._drop_reservation(request_id)
            raise Unavailable(f"kvtransfer agent {self.agent_address} refused the reservation: {exc}") from None
        dest = common_pb2.KVDestination(agent_address=self.agent_address, agent_epoch=self.agent_epoch,
                                        pool_id=self.pool_id, page_ids=pages, fingerprint=self.fingerprint)
        return ticket, dest

    def _take_reservation(self, ticket: common_pb2.Ticket) -> Reservation:
        if ticket.epoch != self.epoch:
            raise FailedPrecondition(f"stale ticket for {ticket.request_id}: epoch {ticket.epoch}, "
                                     f"decode worker {self.worker_id} is at epoch {self.epoch} (restarted)")
        with self._lock:
            res = self._reservations.pop(ticket.request_id, None)
        if res is None:
            raise FailedPrecondition(f"no reservation for {ticket.request_id} on {self.worker_id}: "
                                     "its lease expired or it was aborted")
        return res

    def _drop_reservation(self, request_id: str) -> bool:
        """Close the agent's write window, then free the pages (in this order).

        When the agent cannot confirm that no write is in flight, the pages are quarantined
        (neither free nor reserved) and the reaper retries, so they are never handed to
        another request while bytes may still land in them.
        """
        with self._lock:
            res = self._reservations.pop(request_id, None)
        if res is None:
            return False
        self._release_when_closed(request_id, res)
        return True

    def _release_when_closed(self, request_id: str, res: Reservation) -> None:
        if self._close_window(res.ticket):
            self.loop.submit(lambda e: e.release((request_id, self.epoch)))
        else:
            with self._lock:
                self._quarantine[request_id] = res

    def _close_window(self, ticket: common_pb2.Ticket) -> bool:
        """True once the agent accepts no more writes for the ticket (or is gone)."""
        if self.agent is None:
            return True
        try:
            self.agent.cancel(ticket)
            return True
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:  # no agent: nothing can write
                return True
            log.warning("could not close the KV write window of %s (%s: %s); pages quarantined",
                        ticket.request_id, exc.code().name, exc.details())
            return False

    def _reap_loop(self) -> None:
        while not self._stop.wait(REAP_INTERVAL_S):
            with self._lock:
                quarantined = list(self._quarantine.items())
                self._quarantine.clear()
            for rid, res in quarantined:
                self._release_when_closed(rid, res)
            now = time.monotonic()
            with self._lock:
                expired = [rid for rid, r in self._reservations.items() if r.deadline <= now]
            for rid in expired:
                if self._drop_reservation(rid):
                    log.info("lease expired for %s: pages reclaimed", rid)
                    self.metrics.lease_expiries.inc()

    # ---- decoding --------------------------------------------------------------------
    def decode(self, ticket: common_pb2.Ticket, prompt_ids: list[int], first_token: int,
               params: SamplingParams) -> Iterator[DecodeEvent]:
        received = time.perf_counter()
        res = self._take_reservation(ticket)
        key = (ticket.request_id, self.epoch)
        rid = ticket.request_id
        try:
            status = self.agent.status(ticket)
        except BaseException:
            self._release_when_closed(rid, res)
            raise
        if not self._close_window(ticket):  # the handoff is over: no write may land after this
            with self._lock:
                self._quarantine[rid] = res
            raise Unavailable(f"the kvtransfer agent could not close the write window of {rid}")
        try:
            if not status.complete:
                raise FailedPrecondition(f"KV handoff for {rid} has not completed on {self.worker_id}")
            reason, q = self.loop.start_sequence(
                rid, lambda e: e.add_prefilled(rid, key, prompt_ids, first_token, params))
        except ValueError as exc:
            self.loop.submit(lambda e: e.release(key))
            raise InvalidArgument(str(exc)) from None
        except BaseException:
            self.loop.submit(lambda e: e.release(key))
            raise
        try:
            yield DecodeEvent([], reason or "", (time.perf_counter() - received) * 1e3)
            if reason:
                self.metrics.finished.labels(reason).inc()
                return
            yield from self._stream(q, rid)
        finally:
            self.loop.unsubscribe(rid)
            self._abort_sequence(rid)  # no-op when it finished

    def _stream(self, q: queue.SimpleQueue, rid: str) -> Iterator[DecodeEvent]:
        while True:
            try:
                item = q.get(timeout=TOKEN_WAIT_S)
            except queue.Empty:
                raise Unavailable(f"decode of {rid} produced nothing for {TOKEN_WAIT_S:.0f}s") from None
            items = [item]
            while not q.empty():  # coalesce what a slow reader missed into one message
                items.append(q.get_nowait())
            tokens: list[int] = []
            for it in items:
                if isinstance(it, SequenceAborted):  # Abort from the router, or a drain
                    yield DecodeEvent(tokens, "abort")
                    return
                if isinstance(it, BaseException):
                    raise Unavailable(str(it))
                out: StepOutput = it
                if out.token is not None:
                    tokens.append(out.token)
                if out.finish_reason:
                    self.metrics.finished.labels(out.finish_reason).inc()
                    yield DecodeEvent(tokens, out.finish_reason)
                    return
            yield DecodeEvent(tokens)

    def abort(self, ticket: common_pb2.Ticket) -> bool:
        if self._drop_reservation(ticket.request_id):
            return True
        return self._abort_sequence(ticket.request_id)

    def _abort_sequence(self, rid: str) -> bool:
        """End a live sequence now (False when it already ended), counted as finished by abort."""
        found = self.loop.abort(rid)
        if found:
            self.metrics.finished.labels("abort").inc()
        return found

    def stats(self) -> dict:
        e = self.engine
        with self._lock:
            reserved = len(self._reservations)
        return dict(worker_id=self.worker_id, role="decode", num_pages=e.allocator.num_pages,
                    free_pages=e.allocator.num_free, running_sequences=len(e.running),
                    waiting_sequences=len(e.waiting), reserved_tickets=reserved,
                    queued_prompt_tokens=e.queued_prompt_tokens, fingerprint=self.fingerprint)

    def idle(self) -> bool:
        with self._lock:
            return not self._reservations and not self.engine.has_work()

    def stop(self) -> None:
        self._stop.set()
        for rid in list(self._reservations):
            self._drop_reservation(rid)
