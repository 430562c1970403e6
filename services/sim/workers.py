"""Simulated prefill and decode workers: the real pdserve.v1 Prefill and Decode services with
times from a `SimProfile` instead of a model, so one process hosts hundreds of them.

What a router sees is what a real pool gives it: health, Stats (pages, running and waiting
sequences, queued prompt tokens), Reserve with leases, Renew and Abort, decode-first
(`prefill_here_below_tokens`), Prefill with its queue and its handoff report, Decode and
DecodeMany streams with one token per sequence per simulated engine step, errors with the real
codes. A prefill worker computes one prompt at a time; a decode worker steps all its live
sequences together, each step taking `decode_step_ms(live)`. Each worker keeps a prefix cache
of the prompts it computed or holds and announces it on CacheEvents (pdserve.sim.cache); a
prefill worker computes only the part of a prompt its cache lacks.

Tokens are the prompt's own, cycled (token k of the output is prompt[k % len(prompt)]), so they
detokenize and a test can predict them. Everything runs on one asyncio loop (`grpc.aio`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
from pdserve.common.stream_interval import every_n_async
from pdserve.sim.cache import SimCache
from pdserve.sim.profile import SimProfile
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc

IDLE_CHECK_S = 0.25  # an idle DecodeMany stream looks this often at whether its caller left


class Ledger(dict[str, float]):
    """Milliseconds the simulated workers spent on each client request (Prefill call and
    Decode sequence, received to answered), keyed by the client's request id (the part of the
    router's attempt id before `#`): what `pdserve bench router` subtracts from the client's
    E2E to get the time the router added."""

    def charge(self, request_id: str, since: float) -> None:
        key = request_id.partition("#")[0]
        self[key] = self.get(key, 0.0) + (time.monotonic() - since) * 1e3


class Refused(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _cache_events(cache: SimCache, request: common_pb2.StatsRequest
                  ) -> dict[str, common_pb2.CacheEventBatch]:
    """Stats' `cache` field, when the router asks for it."""
    return {"cache": cache.poll(request)} if request.cache_events else {}


@dataclass
class _Held:
    """Pages a Reserve granted: waiting for their sequence until `expires`, or live."""

    epoch: int
    pages: int
    expires: float
    reserved_at: float
    prefill_here: bool
    renew_s: float = 0.0
    started: bool = False  # its Decode call came: no lease any more
    aborted: bool = False
    live: asyncio.Queue[bool] | None = None  # in the batch: a step's token (True), abort (False)


@dataclass
class SimDecode(decode_pb2_grpc.DecodeServicer):
    name: str
    profile: SimProfile
    free_pages: int = 0
    held: dict[str, _Held] = field(default_factory=dict)
    epoch: int = 0
    stepper: asyncio.Task[None] | None = None
    ledger: Ledger | None = None  # None: worker times are not kept
    cache: SimCache = field(init=False)

    def __post_init__(self) -> None:
        self.free_pages = self.profile.num_pages
        self.cache = SimCache(self.name, self.profile)

    def _sweep(self) -> None:
        now = time.monotonic()
        for rid, held in list(self.held.items()):
            if not held.started and held.expires < now:
                self._release(rid)

    def _release(self, rid: str) -> None:
        held = self.held.pop(rid, None)
        if held is not None:
            self.free_pages += held.pages

    async def Reserve(self, request: decode_pb2.ReserveRequest, context: grpc.aio.ServicerContext
                      ) -> decode_pb2.ReserveResponse:
        self._sweep()
        rid, n = request.request_id, request.num_prompt_tokens
        if not rid or n <= 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "a reservation needs a request_id and num_prompt_tokens > 0")
        if rid in self.held:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"{rid} is already reserved here")
        pages = self.profile.pages(n)
        if pages > self.free_pages:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.name} has {self.free_pages} free pages, {pages} needed")
        self.free_pages -= pages
        self.epoch += 1
        here = 0 < n < request.prefill_here_below_tokens
        now = time.monotonic()
        self.held[rid] = _Held(self.epoch, pages, now + (request.lease_ms or 30_000.0) / 1e3, now,
                               here, renew_s=request.renew_lease_ms / 1e3)
        return decode_pb2.ReserveResponse(
            ticket=common_pb2.Ticket(request_id=rid, epoch=self.epoch, decode_worker=self.name),
            destination=common_pb2.KVDestination(agent_address=f"sim:{self.name}",
                                                 pool_id=self.name, page_ids=range(pages)),
            renew_lease_ms=request.renew_lease_ms, prefilling_here=here,
            cached_tokens=self.cache.cached_tokens(request.prompt_token_ids))

    async def Renew(self, request: decode_pb2.RenewRequest, context: grpc.aio.ServicerContext
                    ) -> decode_pb2.RenewResponse:
        now, not_held = time.monotonic(), []
        for ticket in request.tickets:
            held = self.held.get(ticket.request_id)
            if held is None or held.epoch != ticket.epoch:
                not_held.append(ticket.request_id)
            elif not held.started:
                held.expires = now + (request.renew_lease_ms / 1e3 or held.renew_s or 30.0)
        return decode_pb2.RenewResponse(not_held=not_held)

    async def Abort(self, request: decode_pb2.AbortRequest, context: grpc.aio.ServicerContext
                    ) -> decode_pb2.AbortResponse:
        found = self.abort(request.ticket.request_id, request.ticket.epoch)
        return decode_pb2.AbortResponse(found=found)

    def abort(self, rid: str, epoch: int = 0) -> bool:
        """End a reservation (pages back now) or a sequence (its stream ends with "abort")."""
        held = self.held.get(rid)
        if held is None or (epoch and held.epoch != epoch):
            return False
        if held.live is not None:
            held.live.put_nowait(False)
        elif held.started:  # still computing its prompt: it stops when that is done
            held.aborted = True
        else:
            self._release(rid)
        return True

    async def Stats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.WorkerStats:
        self._sweep()
        live = sum(1 for h in self.held.values() if h.started)
        return common_pb2.WorkerStats(worker_id=self.name, role="decode", serving=True,
                                      num_pages=self.profile.num_pages,
                                      free_pages=self.free_pages, running_sequences=live,
                                      reserved_tickets=len(self.held) - live,
                                      max_model_len=self.profile.max_model_len,
                                      **_cache_events(self.cache, request))

    async def CacheEvents(self, request: common_pb2.CacheEventsRequest,
                          context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[common_pb2.CacheEventBatch]:
        async for batch in self.cache.events(request, context):
            yield batch

    async def Decode(self, request: decode_pb2.DecodeRequest, context: grpc.aio.ServicerContext
                     ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        try:
            async for message in every_n_async(self.sequence(request),
                                               request.stream_interval):
                yield message
        except Refused as exc:
            await context.abort(exc.code, exc.message)

    async def DecodeMany(self, requests: AsyncIterator[decode_pb2.DecodeManyRequest],
                         context: grpc.aio.ServicerContext
                         ) -> AsyncIterator[decode_pb2.DecodeManyResponse]:
        mux = _Mux(self)
        reader = asyncio.ensure_future(mux.read(requests))
        try:
            while not (reader.done() and not mux.tasks and mux.out.empty()):
                try:
                    updates = [await asyncio.wait_for(mux.out.get(), IDLE_CHECK_S)]
                except asyncio.TimeoutError:
                    continue
                while not mux.out.empty():
                    updates.append(mux.out.get_nowait())
                yield decode_pb2.DecodeManyResponse(updates=updates)
        finally:
            reader.cancel()
            for task in list(mux.tasks.values()):
                task.cancel()

    async def sequence(self, request: decode_pb2.DecodeRequest
                       ) -> AsyncIterator[decode_pb2.DecodeResponse]:
        """One sequence's Decode messages; raises `Refused` before the first."""
        rid, received = request.ticket.request_id, time.monotonic()
        held = self.held.get(rid)
        if held is None or held.epoch != request.ticket.epoch or held.started:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                          f"ticket {rid} (epoch {request.ticket.epoch}) expired or it was aborted")
        prompt = list(request.prompt_token_ids) or [request.first_token]
        max_tokens = request.sampling.max_tokens or 16
        held.started = True
        self.cache.add(prompt)  # its pages are in this pool now
        try:
            if request.local_prefill or held.prefill_here:  # computing since Reserve
                prefill_ms = self.profile.prefill_ms(len(prompt))
                await asyncio.sleep(max(0.0, held.reserved_at + prefill_ms / 1e3 - received))
                if held.aborted:
                    yield decode_pb2.DecodeResponse(finish_reason="abort")
                    return
                yield decode_pb2.DecodeResponse(
                    token_ids=[prompt[0]], finish_reason="length" if max_tokens == 1 else "",
                    prefill_ms=prefill_ms, decode_start_ms=0.1,
                    queue_ms=max(0.0, (received - held.reserved_at) * 1e3 - prefill_ms))
            else:
                yield decode_pb2.DecodeResponse(decode_start_ms=0.1)
            held.live = asyncio.Queue()
            if self.stepper is None:
                self.stepper = asyncio.ensure_future(self._step())
            for k in range(1, max_tokens):
                if not await held.live.get():
                    yield decode_pb2.DecodeResponse(finish_reason="abort")
                    return
                yield decode_pb2.DecodeResponse(token_ids=[prompt[k % len(prompt)]],
                                                finish_reason="length" if k == max_tokens - 1
                                                else "")
        finally:
            self._release(rid)
            if self.ledger is not None:
                self.ledger.charge(rid, received)

    async def _step(self) -> None:
        """The simulated engine: every live sequence gets a token per step."""
        try:
            while live := [h.live for h in self.held.values() if h.live is not None]:
                await asyncio.sleep(self.profile.decode_step_ms(len(live)) / 1e3)
                for queue in live:
                    queue.put_nowait(True)
        finally:
            self.stepper = None


class _Mux:
    """One DecodeMany stream's sequences and the updates they produce."""

    def __init__(self, worker: SimDecode):
        self.worker = worker
        self.out: asyncio.Queue[decode_pb2.SequenceUpdate] = asyncio.Queue()
        self.tasks: dict[str, asyncio.Task[None]] = {}

    async def read(self, requests: AsyncIterator[decode_pb2.DecodeManyRequest]) -> None:
        async for request in requests:
            if request.WhichOneof("kind") == "start":
                rid = request.start.ticket.request_id
                if not rid or rid in self.tasks:
                    self.out.put_nowait(decode_pb2.SequenceUpdate(
                        request_id=rid, error_code="INVALID_ARGUMENT",
                        error_message=f"sequence {rid!r} is already on this stream" if rid
                        else "the start names no ticket request_id"))
                    continue
                self.tasks[rid] = asyncio.ensure_future(self._run(rid, request.start))
            elif request.WhichOneof("kind") == "cancel" and request.cancel.request_id in self.tasks:
                self.worker.abort(request.cancel.request_id, request.cancel.epoch)

    async def _run(self, rid: str, start: decode_pb2.DecodeRequest) -> None:
        last = decode_pb2.SequenceUpdate(request_id=rid, last=True)
        try:
            async for message in every_n_async(self.worker.sequence(start),
                                               start.stream_interval):
                if message.finish_reason:
                    last.message.CopyFrom(message)
                else:
                    self.out.put_nowait(decode_pb2.SequenceUpdate(request_id=rid, message=message))
        except Refused as exc:
            last.error_code, last.error_message = exc.code.name, exc.message
        finally:
            self.tasks.pop(rid, None)
            self.out.put_nowait(last)


@dataclass
class SimPrefill(prefill_pb2_grpc.PrefillServicer):
    name: str
    profile: SimProfile
    waiting: int = 0
    queued_tokens: int = 0
    computing: asyncio.Lock = field(default_factory=asyncio.Lock)
    ledger: Ledger | None = None  # None: worker times are not kept
    cache: SimCache = field(init=False)

    def __post_init__(self) -> None:
        self.cache = SimCache(self.name, self.profile)

    async def CacheEvents(self, request: common_pb2.CacheEventsRequest,
                          context: grpc.aio.ServicerContext
                          ) -> AsyncIterator[common_pb2.CacheEventBatch]:
        async for batch in self.cache.events(request, context):
            yield batch

    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        n = len(request.token_ids)
        if n == 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the prompt has no tokens")
        received = time.monotonic()
        self.waiting, self.queued_tokens = self.waiting + 1, self.queued_tokens + n
        try:
            await self.computing.acquire()  # one prompt at a time, in arrival order
        finally:  # computing now, or the caller went away while it waited
            self.waiting, self.queued_tokens = self.waiting - 1, self.queued_tokens - n
        try:
            started = time.monotonic()
            cached = self.cache.cached_tokens(request.token_ids)  # computes only the rest
            prefill_ms = self.profile.prefill_ms(n - cached)
            await asyncio.sleep(prefill_ms / 1e3)
            self.cache.add(request.token_ids)
        finally:
            self.computing.release()
        kv_bytes = n * self.profile.kv_bytes_per_token
        handoff_ms = self.profile.handoff_ms(kv_bytes)
        await asyncio.sleep(handoff_ms / 1e3)  # the handoff overlaps the next prompt's compute
        report = common_pb2.TransferReport(handoff_ms=handoff_ms, kv_bytes=kv_bytes,
                                           kv_pages=len(request.destination.page_ids),
                                           transport="sim", kv_transfer_total_ms=handoff_ms)
        if self.ledger is not None:
            self.ledger.charge(request.request_id, received)
        return prefill_pb2.PrefillResponse(first_token=request.token_ids[0],
                                           queue_ms=(started - received) * 1e3,
                                           prefill_ms=prefill_ms, transfer=report,
                                           worker_id=self.name, cached_tokens=cached)

    async def Stats(self, request: common_pb2.StatsRequest, context: grpc.aio.ServicerContext
                    ) -> common_pb2.WorkerStats:
        return common_pb2.WorkerStats(worker_id=self.name, role="prefill", serving=True,
                                      num_pages=self.profile.num_pages,
                                      free_pages=self.profile.num_pages,
                                      running_sequences=int(self.computing.locked()),
                                      waiting_sequences=self.waiting,
                                      queued_prompt_tokens=self.queued_tokens,
                                      max_model_len=self.profile.max_model_len,
                                      **_cache_events(self.cache, request))
