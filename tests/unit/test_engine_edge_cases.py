"""Edge cases of admission, chunking, reservations and the engine loop (found in review)."""

from __future__ import annotations

import pytest
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.loop import EngineLoop, SequenceAborted
from pdserve.engine.model import load_model
from pdserve.engine.pool import OutOfPages
from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.unit
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32")


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**kw), eos_token_ids=[])


def _step_until(engine: Engine, done, limit: int = 500) -> list:
    outs = []
    for _ in range(limit):
        outs += [o for o in engine.step() if not o.progress]  # tokens only, not chunks' pages
        if done(outs):
            return outs
    raise AssertionError(f"not done after {limit} steps: {outs}")


def test_colocated_prompt_longer_than_a_chunk_fills_its_reservation(tiny):
    engine = _engine(tiny, num_pages=16, chunk_size=16)
    try:
        engine.reserve("ticket", 40)
        engine.add_request("s", list(range(5, 45)), GREEDY, reservation="ticket")
        outs = _step_until(engine, lambda o: any(x.finish_reason for x in o))
        assert len([o for o in outs if o.seq_id == "s"]) == 4
        assert engine.allocator.num_free == 16
    finally:
        engine.close()


def test_chunked_prompts_that_do_not_fit_together_take_turns_instead_of_deadlocking(tiny):
    # 4 pages of 16 tokens; prompts of 3 and 4 pages (no page in common), chunked by 16:
    # each alone fits.
    engine = _engine(tiny, role="prefill", num_pages=4, chunk_size=16)
    try:
        engine.add_request("a", list(range(5, 53)), GREEDY)
        engine.add_request("b", list(range(6, 69)), GREEDY)
        first = _step_until(engine, lambda o: len(o) == 1)
        assert first[0].seq_id == "a" and not engine.stalled
        engine.step()
        assert engine.stalled  # b waits for a's pages, without holding any of its own
        assert engine.release_prefilled("a") == 3
        second = _step_until(engine, lambda o: len(o) == 1)
        assert second[0].seq_id == "b" and len(second[0].page_ids) == 4
        engine.release_prefilled("b")
        assert engine.allocator.num_free == 4
    finally:
        engine.close()


def test_decode_refuses_a_sequence_that_could_never_finish_in_its_pool(tiny):
    engine = _engine(tiny, role="decode", num_pages=4)
    try:
        engine.reserve("t", 20)
        with pytest.raises(ValueError, match="prompt \\+ max_tokens needs 8 pages; the pool has 4"):
            engine.add_prefilled("s", "t", list(range(5, 25)), 7,
                                 SamplingParams(max_tokens=100, temperature=0.0))
        assert engine.free_reservation("t") == 2 and engine.allocator.num_free == 4
    finally:
        engine.close()


def test_decode_reservations_respect_max_num_seqs(tiny):
    engine = _engine(tiny, role="decode", num_pages=64, max_num_seqs=2)
    try:
        engine.reserve("t1", 10)
        engine.reserve("t2", 10)
        with pytest.raises(OutOfPages, match="max_num_seqs 2"):
            engine.reserve("t3", 10)
        engine.free_reservation("t1")
        engine.reserve("t3", 10)
    finally:
        engine.close()


def test_loop_refuses_a_duplicate_sequence_and_wakes_the_reader_of_an_aborted_one(tiny):
    engine = _engine(tiny, role="prefill", num_pages=64)
    loop = EngineLoop(engine)  # not started: nothing steps, so the sequence stays queued
    try:
        _, q = loop.start_sequence("s", lambda e: e.add_request("s", [5, 6, 7], GREEDY))
        with pytest.raises(ValueError, match="already exists"):
            loop.start_sequence("s", lambda e: e.add_request("s", [5, 6, 7], GREEDY))
        assert "s" in engine.seqs  # the first one is untouched
        assert loop.abort("s", "cancelled by the caller")
        woke = q.get(timeout=5)
        assert isinstance(woke, SequenceAborted) and "cancelled" in str(woke)
        assert "s" not in engine.seqs and engine.allocator.num_free == 64
    finally:
        engine.close()


@pytest.mark.parametrize("role", ["colocated", "decode"])
def test_a_prompt_that_ends_at_its_first_token_finishes_cleanly(tiny, role):
    """max_tokens=1 where the engine prefills and decodes: the prefill step ends the sequence
    (it once failed the whole step, every sequence in it with it)."""
    engine = _engine(tiny, role=role, num_pages=16)
    try:
        engine.add_request("one", list(range(5, 40)), SamplingParams(max_tokens=1,
                                                                     temperature=0.0))
        engine.add_request("more", list(range(50, 60)), SamplingParams(max_tokens=3,
                                                                       temperature=0.0))
        outs = _step_until(engine, lambda o: any(x.seq_id == "one" for x in o))
        one = [o for o in outs if o.seq_id == "one"][0]
        assert one.finish_reason == "length" and one.token is not None
        _step_until(engine, lambda o: any(x.finish_reason for x in o if x.seq_id == "more"))
        assert not engine.seqs and engine.allocator.num_free == 16
    finally:
        engine.close()


class _Hooks:
    """HandoffHooks recording what the engine told, with the step's state at that moment."""

    def __init__(self, engine: Engine):
        self.engine, self.calls = engine, []

    def planned(self, seq_id, pages):
        seq = self.engine.seqs[seq_id]
        self.calls.append(("planned", seq_id, pages, seq.num_cached))

    def prefilled(self, seq_id, pages):
        self.calls.append(("prefilled", seq_id, pages, len(self.engine.seqs[seq_id].token_ids)))


def test_a_prefill_engine_tells_its_handoff_before_the_last_chunk_and_once_its_kv_is_ready(tiny):
    """The prefill worker starts a handoff early from these: `planned` with every page of the
    prompt before the forward of its last chunk (none for earlier chunks), `prefilled` with the
    same pages once that chunk's first token is sampled; neither for a prompt whose first token
    is its last by max_tokens (no handoff follows)."""
    engine = _engine(tiny, role="prefill", num_pages=32, chunk_size=16)
    hooks = engine.handoff = _Hooks(engine)
    try:
        prompt = list(range(5, 45))  # 40 tokens: chunks of 16, 16, 8; three pages of 16
        engine.add_request("long", prompt, GREEDY)
        engine.add_request("short", list(range(50, 60)), SamplingParams(max_tokens=1))
        _step_until(engine, lambda o: {x.seq_id for x in o} >= {"long", "short"})
        pages = engine.allocator.pages_of("long")
        assert len(pages) == 3
        assert hooks.calls == [("planned", "long", pages, 32),  # before the 8-token chunk
                               ("prefilled", "long", pages, len(prompt) + 1)]
    finally:
        engine.close()


def test_every_step_is_reported_with_what_it_computed(tiny):
    engine = _engine(tiny, num_pages=16)
    steps = []
    engine.on_step = steps.append
    try:
        engine.add_request("a", list(range(5, 25)), GREEDY)
        engine.step()                       # a's whole prompt
        engine.add_request("b", list(range(5, 15)), GREEDY)
        engine.step()                       # a decodes beside b's prompt
        engine.step()                       # both decode
        assert [(s.kind, s.decodes, s.prompt_tokens) for s in steps] == [
            ("prefill", 0, 20), ("mixed", 1, 10), ("decode", 2, 0)]
        assert all(s.seconds > 0 for s in steps)
    finally:
        engine.close()
