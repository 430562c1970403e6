"""The prefill, decode and co-located workers on their own: real engines (the built-in tiny
model) stepped by their loops, plain types in and out, and an in-memory stand-in for the
hosts' agents that copies pages from one pool into the other. No sockets, no processes."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import pytest
from pdserve.colocated.worker import ColocatedWorker
from pdserve.common.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    ServiceError,
)
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.sampling import SamplingParams
from pdserve.common.tickets import TicketKey
from pdserve.decode.worker import DecodeWorker
from pdserve.engine.loop import EngineLoop
from pdserve.engine.setup import build_engine
from pdserve.prefill.worker import PrefillWorker
from pdserve.worker.leases import WindowClosed
from pdserve.worker.types import DecodeRequest, PrefillRequest

from tests.conftest import MAX_TOKENS, PROMPTS

pytestmark = pytest.mark.unit
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


@dataclass
class FakeAgents:
    """Both hosts' agents: registered pools, open write windows, and sends that copy pages."""

    tensors: dict[str, object] = field(default_factory=dict)  # worker id -> pool tensor
    windows: dict[TicketKey, tuple[str, tuple[int, ...]]] = field(default_factory=dict)
    landed: set[TicketKey] = field(default_factory=set)
    written: dict[TicketKey, set[int]] = field(default_factory=dict)  # pages landed so far
    parts: dict[TicketKey, int] = field(default_factory=dict)  # sends per ticket
    hold_sends: threading.Event | None = None
    sending: threading.Event = field(default_factory=threading.Event)
    fail_sends: ServiceError | None = None  # what every send raises (the decode side died)
    settled: int = 0  # parts whose bookkeeping ran after they were timed (Handoff.settle)

    def register_pool(self, worker_id, fd, num_pages, page_bytes, fingerprint,
                      on_registered=None):
        return worker_id, 1  # pool id = worker id, agent epoch 1

    def window(self) -> FakeWindow:
        return FakeWindow(self, "decode")  # only the decode worker opens windows

    def send(self, ticket, src_pool_id, src_page_ids, destination: Destination, timeout_s):
        return FakeSend(self, ticket, src_pool_id, list(src_page_ids), destination)

    def close(self) -> None:
        pass


@dataclass
class FakeWindow:
    agents: FakeAgents
    pool_id: str

    def open(self, key: TicketKey, page_ids: list[int], lease_s: float) -> None:
        self.agents.windows[key] = (self.pool_id, tuple(page_ids))

    def close(self, key: TicketKey) -> WindowClosed:
        self.agents.windows.pop(key, None)
        return WindowClosed(confirmed=True, landed=key in self.agents.landed)


@dataclass
class FakeSend:
    agents: FakeAgents
    ticket: TicketKey
    src_pool_id: str
    src_page_ids: list[int]
    destination: Destination
    cancelled: bool = False

    def result(self) -> TransferReport:
        self.agents.sending.set()
        if self.agents.hold_sends is not None:
            while not self.cancelled and not self.agents.hold_sends.wait(0.01):
                pass
        if self.cancelled:
            raise Aborted("the KV handoff was cancelled")
        if self.agents.fail_sends is not None:
            raise self.agents.fail_sends
        pool_id, pages = self.agents.windows[self.ticket]
        part = self.destination.page_ids  # all the reserved pages, or a prefill chunk's
        assert pool_id == self.destination.pool_id and set(part) <= set(pages)
        dst, src = self.agents.tensors[pool_id], self.agents.tensors[self.src_pool_id]
        dst[list(part)] = src[self.src_page_ids]
        written = self.agents.written.setdefault(self.ticket, set())
        assert not written & set(part), "a page written twice"
        written |= set(part)
        self.agents.parts[self.ticket] = self.agents.parts.get(self.ticket, 0) + 1
        if written == set(pages):
            self.agents.landed.add(self.ticket)
        return TransferReport(0.1, 0, len(part), "fake", 1, 0.1)

    def settle(self) -> None:
        self.agents.settled += 1

    def cancel(self) -> None:
        self.cancelled = True


@pytest.fixture
def pair(tiny_model_dir):
    """A prefill worker and a decode worker joined by the fake agents."""
    agents = FakeAgents()
    loops = []
    workers = []
    for role, make in (("prefill", PrefillWorker), ("decode", DecodeWorker)):
        engine, _ = build_engine("tiny", role=role, num_pages=64, max_model_len=1024,
                                 chunk_size=32)
        loop = EngineLoop(engine).start()
        loops.append(loop)
        # (the prefill worker's own lanes speak to real agents: off with the fakes)
        kwargs = ({"agent_address": "fake"} if role == "decode"
                  else {"same_host_lane": False, "network_lane": False})
        worker = make(loop, agents, worker_id=role, **kwargs)
        agents.tensors[role] = engine.pool.tensor
        worker.register()
        workers.append(worker)
    yield agents, workers[0], workers[1]
    for worker, loop in zip(workers, loops):
        worker.stop()
        loop.stop()
        loop.engine.close()


def prompt_ids(reference, prompt: str) -> list[int]:
    tok, _ = reference
    return tok(prompt, add_special_tokens=False)["input_ids"]


def test_prefill_then_decode_is_token_exact_and_frees_every_page(pair, reference):
    agents, prefill, decode = pair
    _, expected = reference
    for i, prompt in enumerate(PROMPTS):
        ids = prompt_ids(reference, prompt)
        reservation = decode.reserve(f"r{i}", len(ids), 0.0)
        result = prefill.prefill(PrefillRequest(f"r{i}", ids, GREEDY, reservation.ticket,
                                                reservation.destination), threading.Event())
        assert result.transfer.transport == "fake" and result.finish_reason is None
        num_pages = -(-len(ids) // 16)
        assert result.transfer.kv_pages == num_pages  # every page, in one part per chunk
        assert agents.parts[reservation.ticket] == min(-(-len(ids) // 32), num_pages)
        assert result.transfer.total_ms > 0 and result.transfer.handoff_ms > 0
        settled = agents.settled
        assert result.after_reply is not None  # the parts' bookkeeping waits for the answer
        result.after_reply()
        assert agents.settled == settled + agents.parts[reservation.ticket]
        events = list(decode.decode(DecodeRequest(reservation.ticket, ids, result.first_token,
                                                  GREEDY)))
        tokens = [result.first_token] + [t for ev in events for t in ev.token_ids]
        assert tokens == expected[prompt][1], prompt
        assert events[0].decode_start_ms > 0 and events[-1].finish_reason == "length"
    for worker in (prefill, decode):
        stats = worker.stats()
        assert stats.free_pages == stats.num_pages and stats.running_sequences == 0
    assert decode.stats().reserved_tickets == 0
    assert agents.settled == sum(agents.parts.values())  # every part's bookkeeping ran


def test_decode_refuses_a_handoff_that_did_not_land_and_frees_its_pages(pair, reference):
    agents, _, decode = pair
    reservation = decode.reserve("r", 20, 0.0)
    with pytest.raises(FailedPrecondition, match="KV handoff for r has not completed"):
        list(decode.decode(DecodeRequest(reservation.ticket, list(range(5, 25)), 7, GREEDY)))
    assert decode.stats().free_pages == 64 and reservation.ticket not in agents.windows


def test_abort_releases_a_reservation_and_a_bad_prompt_is_refused(pair):
    _, prefill, decode = pair
    reservation = decode.reserve("r", 40, 0.0)
    assert decode.stats().free_pages == 61
    assert decode.abort(reservation.ticket) and not decode.abort(reservation.ticket)
    assert decode.stats().free_pages == 64
    with pytest.raises(InvalidArgument, match="token id 100000 is outside the vocabulary"):
        prefill.prefill(PrefillRequest("bad", [5, 100000], GREEDY, reservation.ticket,
                                       reservation.destination), threading.Event())


@pytest.mark.parametrize("code", ["NOT_FOUND", "INVALID_ARGUMENT", "UNAVAILABLE"])
def test_a_failed_handoff_is_retryable_and_names_the_decode_side(pair, reference, code):
    """The decode worker died (its agent dropped its pool and tickets): whatever the agent
    answered, the prefill worker says "try again" (ABORTED, or a status that already says
    it), naming the decode side's agent, the phase and the agent's answer; its pages are
    freed."""
    agents, prefill, decode = pair
    ids = prompt_ids(reference, PROMPTS[3])
    reservation = decode.reserve("r", len(ids), 0.0)
    agents.fail_sends = ServiceError("KV handoff failed: unknown pool decode", code)
    with pytest.raises(ServiceError) as failed:
        prefill.prefill(PrefillRequest("r", ids, GREEDY, reservation.ticket,
                                       reservation.destination), threading.Event())
    assert failed.value.code == ("UNAVAILABLE" if code == "UNAVAILABLE" else "ABORTED")
    assert failed.value.message == (
        f"r: KV handoff to the decode side (agent fake, pool decode) failed: {code} "
        "KV handoff failed: unknown pool decode")
    assert prefill.stats().free_pages == prefill.stats().num_pages
    assert decode.abort(reservation.ticket) and decode.stats().free_pages == 64


@pytest.mark.parametrize("prompt", [PROMPTS[3], PROMPTS[-1]], ids=["one chunk", "chunks"])
def test_cancel_during_the_send_frees_the_prefill_pages(pair, reference, prompt):
    """A cancel while a part is in flight: with several chunks, the first chunk's pages are
    in flight while the next chunks still compute."""
    agents, prefill, decode = pair
    ids = prompt_ids(reference, prompt)
    reservation = decode.reserve("r", len(ids), 0.0)
    agents.hold_sends = threading.Event()
    cancelled = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            prefill.prefill(PrefillRequest("r", ids, GREEDY, reservation.ticket,
                                           reservation.destination), cancelled)
        except BaseException as exc:
            failure.append(exc)
    thread = threading.Thread(target=run)
    thread.start()
    assert agents.sending.wait(10)  # the send is in flight: cancel it as the servicer would
    cancelled.set()
    prefill.cancel("r")
    thread.join(10)
    assert isinstance(failure[0], Aborted), failure
    assert prefill.stats().free_pages == prefill.stats().num_pages
    assert decode.abort(reservation.ticket) and decode.stats().free_pages == 64


def test_colocated_worker_composes_both_roles(tiny_model_dir, reference):
    engine, _ = build_engine("tiny", role="colocated", num_pages=64, max_model_len=1024,
                             chunk_size=32)
    loop = EngineLoop(engine).start()
    worker = ColocatedWorker(loop, worker_id="both")
    worker.register()
    _, expected = reference
    try:
        for i, prompt in enumerate(PROMPTS[:4]):
            ids = prompt_ids(reference, prompt)
            reservation = worker.reserve(f"r{i}", len(ids), 0.0)
            result = worker.prefill(PrefillRequest(f"r{i}", ids, GREEDY, reservation.ticket,
                                                   reservation.destination), threading.Event())
            assert result.transfer.transport == "local"
            events = list(worker.decode(DecodeRequest(reservation.ticket, ids,
                                                      result.first_token, GREEDY)))
            assert [result.first_token] + [t for e in events for t in e.token_ids] == \
                expected[prompt][1]
        reservation = worker.reserve("gone", 10, 0.0)
        assert worker.abort(reservation.ticket)
        with pytest.raises(FailedPrecondition, match="no prefilled sequence nope"):
            list(worker.decode(DecodeRequest(TicketKey("nope", 0), [5], 6, GREEDY)))
        assert worker.stats().free_pages == 64 and worker.stats().role == "colocated"
    finally:
        worker.stop()
        loop.stop()
        engine.close()


def test_a_local_prefills_times_add_up_to_its_time_on_the_worker():
    """Queue + prefill + decode start = the time since the prompt reached the worker, never
    more (hand-computed, perf_counter seconds): the router adds only its own time before."""
    from pdserve.engine.sequence import StepOutput
    from pdserve.worker.early import EarlyStart
    from pdserve.worker.here import local_times

    out = StepOutput("r", 7, prefill_ms=30.0, done_at=10.050)
    early = EarlyStart(TicketKey("r", 1), None, 10.0, 0.0, 0.0, 0.0)  # type: ignore[arg-type]
    # Started at Reserve (10.000), done at 10.050, the Decode call came at 10.020: 20 ms queued
    # before its 30 ms of compute, 5 ms from the end to the first message.
    assert local_times(early, 10.020, 10.055, out) == pytest.approx((5.0, 30.0, 20.0, 0))
    # ... the Decode call came after the end (10.070): decode start counts from it.
    assert local_times(early, 10.070, 10.075, out) == pytest.approx((5.0, 30.0, 20.0, 0))
    # Not started at Reserve: the Decode call (10.010) is when the prompt arrived.
    assert local_times(None, 10.010, 10.055, out) == pytest.approx((5.0, 30.0, 10.0, 0))
