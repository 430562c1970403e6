"""The prefix cache: page keys, the allocator's reference counts and LRU, and the engine's
greedy output with the cache on against transformers and against the cache off, on every
hit pattern (none, all but the last token, partial, a prompt that is whole pages, a second
turn over generated tokens, after eviction, under pool pressure with requests in flight)."""

from __future__ import annotations

import pytest
import torch
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.prefix import page_keys, root_key
from pdserve.engine.allocator import OutOfPages, PageAllocator
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model import load_model
from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.unit

BS = 16
GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
FP = LayoutFingerprint("m", "r", "float32", 2, 2, 8, BS)


# ---- keys -------------------------------------------------------------------------------
def test_keys_chain_and_depend_on_the_layout():
    tokens = list(range(100, 164))
    root = root_key(FP)
    keys = page_keys(root, tokens, BS, 4)
    assert len(set(keys)) == 4
    # A page's key names its whole prefix: the same page after another first page differs.
    other = page_keys(root, [7] * BS + tokens[BS:], BS, 4)
    assert other[0] != keys[0] and other[1] != keys[1]
    assert page_keys(root, tokens, BS, 2) == keys[:2]  # stable, and extendable in place
    known = keys[:1]
    assert page_keys(root, tokens, BS, 3, known) is known and known == keys[:3]
    for changed in (dict(dtype="bfloat16"), dict(block_size=32), dict(model_id="n")):
        fp = LayoutFingerprint(**{**FP.__dict__, **changed})
        assert root_key(fp) != root, changed
    # Ranks of any tensor-parallel split hold the same tokens' KV, cut by heads: one chain, so
    # a handoff from TP 2 to TP 1 checks its prefix boundary by the same keys.
    split = LayoutFingerprint(**{**FP.__dict__, "num_kv_heads": FP.num_kv_heads // 2,
                                 "tp_rank": 1, "tp_size": 2})
    assert root_key(split) == root


# ---- the allocator ----------------------------------------------------------------------
def _cached(alloc: PageAllocator, owner: str, keys: list[int]) -> list[int]:
    pages = alloc.allocate(owner, len(keys))
    for i, (page, key) in enumerate(zip(pages, keys)):
        assert alloc.cache(page, key, keys[i - 1] if i else 0, [key] * BS)
    return pages


def test_freed_cached_pages_stay_until_room_is_needed_tail_first():
    alloc = PageAllocator(4, caching=True)
    alloc.recording = True
    pages = _cached(alloc, "a", [11, 12, 13])
    assert alloc.free("a") == 3 and alloc.num_free == 4 and alloc.num_cached == 3
    assert alloc.lookup([11, 12, 13], [11] * BS + [12] * BS + [13] * BS, BS) == pages
    alloc.allocate("b", 2)  # one truly free page, then the LRU's oldest: the chain's tail
    assert alloc.num_cached == 2 and alloc.lookup([11, 12, 13], [11] * BS + [12] * BS, BS) \
        == pages[:2]
    events = alloc.take_events()
    assert events.stored == [(11, 0), (12, 11), (13, 12)] and events.removed == [13]
    assert not alloc.take_events()


def test_a_shared_page_is_never_evicted_and_returns_once():
    alloc = PageAllocator(3, caching=True)
    pages = _cached(alloc, "a", [1, 2])
    alloc.free("a")
    alloc.share("b", pages[:1])  # pinned by b
    assert alloc.can_take(pages[:1], 2) and not alloc.can_take(pages, 3)
    alloc.allocate("c", 2)  # the free page and the unpinned cached one
    with pytest.raises(OutOfPages):
        alloc.allocate("c", 1)
    assert alloc.pages_of("b") == pages[:1] and alloc.num_cached == 1
    alloc.free("b"), alloc.free("b"), alloc.free("c")
    assert alloc.num_free == 3


def test_a_key_collision_is_a_miss_not_wrong_pages():
    alloc = PageAllocator(2, caching=True)
    page = alloc.allocate("a", 1)[0]
    alloc.cache(page, 99, 0, [5] * BS)
    assert alloc.lookup([99], [5] * BS, BS) == [page]
    assert alloc.lookup([99], [6] * BS, BS) == []


def test_caching_off_keeps_nothing():
    alloc = PageAllocator(2)
    page = alloc.allocate("a", 1)[0]
    assert not alloc.cache(page, 1, 0, [1] * BS)
    alloc.free("a")
    assert alloc.lookup([1], [1] * BS, BS) == [] and alloc.num_cached == 0


# ---- the engine against transformers -----------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32")


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference(hf, prompt: list[int], n: int = GREEDY.max_tokens) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                      min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**{"num_pages": 64, "chunk_size": 32, **kw}))


def _run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams = GREEDY
         ) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Generate every prompt (together); returns tokens and cached tokens per sequence."""
    tokens: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for sid, prompt in prompts.items():
        engine.add_request(sid, prompt, params)
    for _ in range(5000):
        if not engine.has_work():
            break
        for out in engine.step():
            if out.token is not None:
                tokens.setdefault(out.seq_id, []).append(out.token)
            if out.prefill_ms:
                cached[out.seq_id] = out.cached_tokens
    assert not engine.has_work()
    return tokens, cached


IGNORE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny) -> list[int]:
    gen = torch.Generator().manual_seed(3)
    return torch.randint(3, tiny.vocab_size, (70,), generator=gen).tolist()


@pytest.mark.parametrize("pattern", ["none", "all-but-last", "whole-pages", "partial"])
def test_hit_patterns_give_the_tokens_transformers_gives(tiny, hf, base, pattern):
    first = {"none": base[:40], "all-but-last": base[:50], "whole-pages": base[:64],
             "partial": base[:40]}[pattern]
    second = {"none": [t + 1 for t in base[:50]], "all-but-last": base[:50],
              "whole-pages": base[:64], "partial": base[:40] + [9, 8, 7, 6, 5] * 4}[pattern]
    expect_cached = {"none": 0, "all-but-last": 48, "whole-pages": 48, "partial": 32}[pattern]
    engine = _engine(tiny)
    try:
        _run(engine, {"a": first}, IGNORE)
        tokens, cached = _run(engine, {"b": second}, IGNORE)
        assert cached["b"] == expect_cached
        assert tokens["b"] == _reference(hf, second)
        assert engine.allocator.num_free == 64 and not engine.seqs
    finally:
        engine.close()


def test_second_turn_reuses_the_generated_tokens_and_matches_cache_off(tiny, hf, base):
    """A conversation re-sends its history: turn 2 = turn 1's prompt + its output + more."""
    on, off = _engine(tiny), _engine(tiny, prefix_caching=False)
    try:
        turn1 = base[:30]
        out1, _ = _run(on, {"t1": turn1}, IGNORE)
        turn2 = turn1 + out1["t1"] + base[40:60]
        out2, cached = _run(on, {"t2": turn2}, IGNORE)
        # Turn 1 wrote 30 + 11 tokens of KV (its last sampled token never ran): 2 pages.
        assert cached["t2"] == 32
        ref2, cached_off = _run(off, {"t2": turn2}, IGNORE)
        assert cached_off["t2"] == 0 and out2["t2"] == ref2["t2"] == _reference(hf, turn2)
    finally:
        on.close(), off.close()


def test_sequences_sharing_a_prefix_in_one_batch(tiny, hf, base):
    engine = _engine(tiny)
    try:
        _run(engine, {"warm": base[:40]}, IGNORE)
        prompts = {f"s{i}": base[:40] + [3 + i] * (i + 1) for i in range(4)}
        tokens, cached = _run(engine, prompts, IGNORE)
        assert all(cached[s] == 32 for s in prompts)
        for sid, prompt in prompts.items():
            assert tokens[sid] == _reference(hf, prompt), sid
    finally:
        engine.close()


def test_eviction_under_pressure_with_requests_in_flight(tiny, hf, base):
    """A pool of 12 pages: unreferenced cached pages make room for new prompts while others
    run; the pages in use are never taken, and every output stays exact."""
    engine = _engine(tiny, num_pages=12)
    gen = torch.Generator().manual_seed(5)
    others = [torch.randint(3, tiny.vocab_size, (40,), generator=gen).tolist()
              for _ in range(3)]
    try:
        _run(engine, {"a": base[:50]}, IGNORE)  # 3 cached pages left behind
        assert engine.allocator.num_cached >= 3
        tokens, cached = _run(engine, {"x": others[0], "y": others[1], "a2": base[:50]},
                              IGNORE)
        assert tokens["a2"] == _reference(hf, base[:50])
        for sid, prompt in (("x", others[0]), ("y", others[1])):
            assert tokens[sid] == _reference(hf, prompt)
        # Fill the pool again so a's pages are evicted, then a hit after eviction.
        _run(engine, {"z": others[2] + others[0][:30]}, IGNORE)
        tokens, cached = _run(engine, {"a3": base[:50]}, IGNORE)
        assert tokens["a3"] == _reference(hf, base[:50])
        assert engine.allocator.num_evictions > 0
        assert engine.allocator.num_free == 12 and not engine.seqs
    finally:
        engine.close()


def test_decode_reservation_pins_the_pages_it_holds(tiny, hf, base):
    """Decode role: a prompt whose leading pages are cached reserves only the rest; the pinned
    pages survive pressure, and the adopted sequence decodes exactly."""
    prefill, decode = _engine(tiny, role="prefill"), _engine(tiny, role="decode", num_pages=8)
    try:
        # Turn 1 lands on decode (written by "the handoff": copied here from prefill's pool).
        prompt = base[:50]
        first = _handoff(prefill, decode, "r1", prompt, skip=0)
        assert first == 0
        tokens = _decode_all(decode, "r1")
        # Turn 2 shares 3 pages: decode reserves one new page and holds 3.
        cached_pages, new, _ = decode.reserve_prompt("t2", prompt + [4, 5])
        assert cached_pages == 3 and len(new) == 1
        with pytest.raises(OutOfPages):
            decode.reserve("t3", 16 * 8)  # the pinned pages are not evictable
        decode.free_reservation("t2")
        assert decode.allocator.num_free == 8
        assert tokens == _reference(hf, prompt)
    finally:
        prefill.close(), decode.close()


def _handoff(prefill: Engine, decode: Engine, rid: str, prompt: list[int], skip: int) -> int:
    prefill.add_request(rid, prompt, IGNORE)
    out = None
    for _ in range(100):
        outs = [o for o in prefill.step() if o.token is not None]
        if outs:
            out = outs[0]
            break
    assert out is not None and out.page_ids
    cached, new, _ = decode.reserve_prompt(("key", rid), prompt)
    for src, dst in zip(out.page_ids[cached:], new):
        decode.pool.tensor[dst] = prefill.pool.tensor[src]
    prefill.release_prefilled(rid)
    decode.add_prefilled(rid, ("key", rid), prompt, out.token, IGNORE)
    decode._first = out.token  # type: ignore[attr-defined]
    return cached


def _decode_all(engine: Engine, rid: str) -> list[int]:
    tokens = [engine._first]  # type: ignore[attr-defined]
    for _ in range(100):
        if not engine.has_work():
            break
        tokens += [o.token for o in engine.step() if o.seq_id == rid and o.token is not None]
    return tokens


def test_pages_being_shipped_are_never_evicted(tiny, base):
    """Prefill role: a prefilled sequence holds its pages (shared cached ones too) until its
    handoff is done; a prompt that needs the whole pool waits for them instead of evicting
    pages an agent may be reading."""
    engine = _engine(tiny, role="prefill", num_pages=8)
    try:
        _handoff_free = engine.release_prefilled
        engine.add_request("warm", base[:50], IGNORE)
        _prefill(engine, "warm")
        _handoff_free("warm")  # 3 full pages cached, unreferenced
        engine.add_request("a", base[:60], IGNORE)  # shares them: 3 cached + 1 new page
        out = _prefill(engine, "a")
        assert out.cached_tokens == 48
        held = engine.allocator.pages_of("a")
        before = engine.pool.tensor[held].clone()
        engine.add_request("b", [t + 1 for t in base] + base[:50], IGNORE)  # 120: 8 pages
        for _ in range(3):
            assert not [o for o in engine.step() if o.seq_id == "b"]
        assert engine.stalled and torch.equal(engine.pool.tensor[held], before)
        _handoff_free("a")  # shipped: now b may evict them
        assert _prefill(engine, "b").token is not None
        assert engine.allocator.num_evictions >= 3
    finally:
        engine.close()


def _prefill(engine: Engine, rid: str):
    for _ in range(100):
        done = [o for o in engine.step() if o.seq_id == rid and o.token is not None]
        if done:
            return done[0]
    raise AssertionError(f"{rid} was not prefilled")
