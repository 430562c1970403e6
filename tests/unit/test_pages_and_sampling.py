"""Page accounting, the shared pool across processes, and sampling parameters."""

from __future__ import annotations

import pytest
import torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model import load_model
from pdserve.engine.pool import LayoutFingerprint, OutOfPages, PageAllocator
from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.unit

FP = LayoutFingerprint("m", "r1", "float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return load_model(tiny_model_dir, dtype="float32")


def _run(engine: Engine, limit: int = 5000, out: dict[str, list[int]] | None = None
         ) -> dict[str, list[int]]:
    out = {} if out is None else out
    for _ in range(limit):
        if not engine.has_work():
            return out
        for o in engine.step():
            out.setdefault(o.seq_id, []).append(o.token)
    raise AssertionError("engine did not finish")


def test_allocator_frees_each_page_exactly_once():
    alloc = PageAllocator(10)
    a = alloc.allocate("a", 3)
    b = alloc.allocate("b", 4)
    assert len(set(a) | set(b)) == 7, "a page was handed to two owners"
    assert alloc.pages_of("a") == a and alloc.pages_of("b") == b
    assert alloc.num_free == 3 and not alloc.can_allocate(4)
    with pytest.raises(OutOfPages, match="need 4 pages, 3 of 10 free"):
        alloc.allocate("c", 4)
    assert alloc.free("a") == 3 and alloc.free("a") == 0
    assert alloc.num_free == 6 and not alloc.owns("a")
    alloc.transfer("b", "b2")
    assert alloc.pages_of("b2") == b and not alloc.owns("b")
    assert alloc.free("b") == 0 and alloc.free("b2") == 4
    assert alloc.num_free == 10
    assert sorted(alloc.allocate("d", 10)) == list(range(10))  # every id back, each once
    assert alloc.num_free == 0


def test_fingerprint_mismatch_names_the_fields():
    other = LayoutFingerprint("m", "r1", "float16", 2, 2, 8, block_size=16)
    assert FP.mismatches(other) == ["dtype: 'float32' != 'float16'", "block_size: 4 != 16"]
    assert FP.page_bytes == 2 * 2 * 4 * 2 * 8 * 4
    with pytest.raises(ValueError, match="block_size must be > 0"):
        LayoutFingerprint("m", "r", "float32", 2, 2, 8, block_size=0)


def test_free_pages_return_after_finished_and_aborted_sequences(tiny):
    engine = Engine(tiny, EngineConfig(num_pages=64, chunk_size=8), eos_token_ids=[])
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i in range(6):
            engine.add_request(f"s{i}", list(range(5, 5 + 3 * i + 1)), params)
        early: dict[str, list[int]] = {}
        for _ in range(4):
            for o in engine.step():
                early.setdefault(o.seq_id, []).append(o.token)
        assert engine.allocator.num_free < 64
        assert engine.abort("s1") and engine.abort("s4") and not engine.abort("nope")
        reserved = engine.reserve("ticket", 40)
        assert len(reserved) == 3
        out = _run(engine, out=early)
        assert set(out) >= {"s0", "s2", "s3", "s5"}
        assert all(len(out[f"s{i}"]) == 12 for i in (0, 2, 3, 5))
        assert engine.free_reservation("ticket") == 3 and engine.free_reservation("ticket") == 0
        assert engine.allocator.num_free == 64
    finally:
        engine.close()


def test_invalid_requests_are_refused_clearly(tiny):
    engine = Engine(tiny, EngineConfig(num_pages=8), eos_token_ids=[])
    try:
        with pytest.raises(ValueError, match="prompt is empty"):
            engine.add_request("a", [], SamplingParams())
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request("a", [tiny.vocab_size], SamplingParams())
        with pytest.raises(ValueError, match="context"):
            engine.add_request("a", [5] * tiny.max_context, SamplingParams())
        with pytest.raises(ValueError, match="needs 9 pages; the pool has 8"):
            engine.add_request("a", [5] * 100, SamplingParams(max_tokens=40))
    finally:
        engine.close()
    prefill = Engine(tiny, EngineConfig(role="prefill", num_pages=8), eos_token_ids=[])
    try:  # a prefill pool holds the prompt only: max_tokens does not count against it
        prefill.add_request("a", [5] * 100, SamplingParams(max_tokens=4000))
        with pytest.raises(ValueError, match="prompt needs 9 pages; the pool has 8"):
            prefill.add_request("b", [5] * 130, SamplingParams())
    finally:
        prefill.close()


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -1}, "top_k"), ({"max_tokens": 0}, "max_tokens"), ({"seed": -1}, "seed"),
    ({"temperature": float("nan")}, "temperature"),
])
def test_invalid_sampling_parameters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def _generate(tiny, params_list):
    engine = Engine(tiny, EngineConfig(num_pages=128), eos_token_ids=[])
    try:
        for i, p in enumerate(params_list):
            engine.add_request(f"s{i}", [7, 8, 9, 10, 11], p)
        out = _run(engine)
        return [out[f"s{i}"] for i in range(len(params_list))]
    finally:
        engine.close()


def test_seeded_sampling_reproduces_and_top_k_1_is_greedy(tiny):
    seeded = SamplingParams(max_tokens=16, temperature=1.3, top_p=0.95, top_k=50, seed=42,
                            ignore_eos=True)
    other = SamplingParams(
        max_tokens=16, temperature=1.3, top_p=0.95, top_k=50, seed=43, ignore_eos=True
    )
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    top1 = SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=1, ignore_eos=True)
    first = _generate(tiny, [seeded, other, greedy, top1])
    second = _generate(tiny, [seeded, other, greedy, top1])
    assert first == second
    assert first[0] != first[1]  # a different seed gives a different sample
    assert first[3] == first[2]


def test_top_p_keeps_only_the_nucleus():
    from pdserve.engine.sampling import sample

    logits = torch.tensor([[5.0, 4.0, 0.0, -1.0]])  # p ≈ 0.72, 0.26, 0.005, 0.002
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=0)
    gen = torch.Generator().manual_seed(0)
    seen = {sample(logits, [params], [gen])[0] for _ in range(200)}
    assert seen == {0, 1}
