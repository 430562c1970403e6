"""Mixed steps: prompt chunks ride along with decode tokens in one forward, so running
sequences keep getting a token at every step while a long prompt is chunked in (a prompt with
nothing running beside it takes one step); the prefill role packs several waiting prompts
into one step under the token budget. Greedy output stays equal to transformers'."""

from __future__ import annotations

import pytest
import torch
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model import load_model
from pdserve.engine.sampling import SamplingParams

pytestmark = pytest.mark.unit
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    return hf, load_model(tiny_model_dir, dtype="float32")


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 1000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _reference(hf, prompt: list[int], max_tokens: int = 24) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_tokens,
                      min_new_tokens=max_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_decodes_keep_stepping_while_a_long_prompt_is_chunked_in(models):
    hf, model = models
    engine = Engine(model, EngineConfig(num_pages=64, chunk_size=32, max_prefill_tokens=64),
                    eos_token_ids=[])
    short, long = _prompt(10, 1), _prompt(150, 2)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    try:
        engine.add_request("a", short, GREEDY)
        for out in engine.step():  # a's prompt: its first token, then it is running
            tokens[out.seq_id].append(out.token or 0)
        engine.add_request("b", long, GREEDY)
        steps_until_b = 0
        while not tokens["b"]:
            outs = engine.step()
            steps_until_b += 1
            assert [o.seq_id for o in outs if o.seq_id == "a"] == ["a"], \
                f"step {steps_until_b} of b's prompt gave a no token"
            for out in outs:
                tokens[out.seq_id].append(out.token or 0)
        assert steps_until_b == 5  # 150 prompt tokens in chunks of 32, beside a's decode token
        while engine.has_work():
            for out in engine.step():
                tokens[out.seq_id].append(out.token or 0)
        assert tokens["a"] == _reference(hf, short)
        assert tokens["b"] == _reference(hf, long)
        assert engine.allocator.num_free == engine.config.num_pages
    finally:
        engine.close()


def test_prefill_role_packs_waiting_prompts_into_one_step(models):
    hf, model = models
    engine = Engine(model, EngineConfig(role="prefill", num_pages=64, chunk_size=32,
                                        max_prefill_tokens=64), eos_token_ids=[])
    prompts = {"p0": _prompt(5, 3), "p1": _prompt(40, 4), "p2": _prompt(17, 5)}
    try:
        for rid, prompt in prompts.items():
            engine.add_request(rid, prompt, GREEDY)
        first = engine.step()  # 5 + 17 + 32 tokens (shortest first): one forward, no padding
        assert [(o.seq_id, o.page_ids) for o in first if o.progress] == [("p1", [3, 4])]
        first = [o for o in first if not o.progress]  # p1's first 2 pages are complete
        assert sorted(o.seq_id for o in first) == ["p0", "p2"]
        second = engine.step()  # p1's last 8 tokens
        assert [o.seq_id for o in second] == ["p1"]
        for out in first + second:
            assert out.token == _reference(hf, prompts[out.seq_id], 1)[0]
            assert engine.release_prefilled(out.seq_id) > 0
        assert engine.allocator.num_free == engine.config.num_pages
    finally:
        engine.close()


def test_a_prompt_alone_takes_the_whole_budget_in_one_step(models):
    """Chunks exist for the running sequences' sake: with none running, a co-located prompt
    longer than chunk_size runs in one forward (up to max_prefill_tokens), and the one after
    it, arriving while the first decodes, is chunked again."""
    hf, model = models
    engine = Engine(model, EngineConfig(num_pages=64, chunk_size=32, max_prefill_tokens=128),
                    eos_token_ids=[])
    first, second = _prompt(100, 6), _prompt(100, 7)
    tokens: dict[str, list[int]] = {"a": [], "b": []}
    try:
        engine.add_request("a", first, GREEDY)
        assert [o.seq_id for o in engine.step()] == ["a"]  # 100 tokens, one step
        engine.add_request("b", second, GREEDY)
        steps_until_b = 0
        while not tokens["b"]:
            for out in engine.step():
                tokens[out.seq_id].append(out.token or 0)
            steps_until_b += 1
        assert steps_until_b == 4  # 100 tokens in chunks of 32 beside a's decode
        while engine.has_work():
            for out in engine.step():
                tokens[out.seq_id].append(out.token or 0)
        assert tokens["b"] == _reference(hf, second)
        assert engine.allocator.num_free == engine.config.num_pages
    finally:
        engine.close()


def test_one_prompt_per_step_beside_decodes_gives_each_its_first_token_a_step_sooner(models):
    """`prompts_beside_decodes=1` (the decode worker's default): while a sequence decodes,
    waiting prompts take one step each instead of sharing one, so the first finishes a step
    earlier; with nothing decoding the limit does not apply. Tokens stay exact."""
    hf, model = models
    engine = Engine(model, EngineConfig(role="decode", num_pages=64, chunk_size=64,
                                        prompts_beside_decodes=1), eos_token_ids=[])
    prompts = {"a": _prompt(10, 3), "b": _prompt(20, 4), "c": _prompt(30, 5)}
    tokens: dict[str, list[int]] = {k: [] for k in prompts}
    firsts: list[list[str]] = []
    try:
        engine.add_request("a", prompts["a"], GREEDY)
        for out in engine.step():  # nothing decoding yet: a prompt step alone
            tokens[out.seq_id].append(out.token or 0)
        engine.add_request("b", prompts["b"], GREEDY)
        engine.add_request("c", prompts["c"], GREEDY)
        while engine.has_work():
            outs = engine.step()
            firsts.append([o.seq_id for o in outs if o.seq_id != "a" and not tokens[o.seq_id]])
            for out in outs:
                tokens[out.seq_id].append(out.token or 0)
        assert firsts[:2] == [["b"], ["c"]]  # one prompt per step, in arrival order
        for seq_id, prompt in prompts.items():
            assert tokens[seq_id] == _reference(hf, prompt), seq_id
        assert engine.allocator.num_free == engine.config.num_pages
    finally:
        engine.close()

    with pytest.raises(ValueError, match="prompts_beside_decodes must be >= 0"):
        EngineConfig(prompts_beside_decodes=-1)


def test_a_decode_workers_defaults_chunk_its_own_prompts_beside_the_batch(models):
    """The decode worker's defaults (`pdserve decode`: --chunk-size 64, one prompt per step):
    a prompt it computes itself while a sequence decodes rides in 64-token chunks, so the
    decoding sequence gets a token at every step and the prompt its first token at its third
    step (150 tokens); with nothing decoding, a prompt takes one step. Tokens stay exact."""
    from pdserve.decode.main import DecodeConfig

    hf, model = models
    defaults = DecodeConfig()
    assert defaults.chunk_size == 64
    engine = Engine(model, EngineConfig(role="decode", num_pages=64,
                                        chunk_size=defaults.chunk_size,
                                        prompts_beside_decodes=defaults.prompts_beside_decodes),
                    eos_token_ids=[])
    prompts = {"a": _prompt(150, 6), "b": _prompt(150, 7)}
    tokens: dict[str, list[int]] = {k: [] for k in prompts}
    try:
        engine.add_request("a", prompts["a"], GREEDY)
        first = engine.step()  # alone: the whole prompt in one step
        assert [o.seq_id for o in first] == ["a"]
        tokens["a"].append(first[0].token or 0)
        engine.add_request("b", prompts["b"], GREEDY)
        steps_to_b = 0
        while not tokens["b"]:
            outs = {o.seq_id: o.token or 0 for o in engine.step()}
            steps_to_b += 1
            assert "a" in outs  # a token for the decoding sequence at every step
            for seq_id, token in outs.items():
                tokens[seq_id].append(token)
        assert steps_to_b == 3  # 64 + 64 + 22
        while engine.has_work():
            for out in engine.step():
                tokens[out.seq_id].append(out.token or 0)
        assert tokens["b"] == _reference(hf, prompts["b"])
        assert tokens["a"] == _reference(hf, prompts["a"])
        assert engine.allocator.num_free == engine.config.num_pages
    finally:
        engine.close()


def test_prefill_role_finishes_one_long_prompt_before_the_next_and_lets_short_ones_pass(models):
    """Shortest remaining first, at most one unfinished prompt per step: two long prompts run
    one after the other (not side by side, which finishes both late), and a short prompt that
    arrives behind them goes into the next step. Past the ageing bound, arrival order."""
    hf, model = models
    engine = Engine(model, EngineConfig(role="prefill", num_pages=64, chunk_size=32,
                                        max_prefill_tokens=64), eos_token_ids=[])
    prompts = {"long-a": _prompt(90, 6), "long-b": _prompt(80, 7), "short": _prompt(9, 8)}
    done: dict[str, list[int]] = {}

    def step() -> list[tuple[str, bool]]:
        outs = engine.step()
        for o in outs:
            if not o.progress:
                done[o.seq_id] = [o.token]
                assert engine.release_prefilled(o.seq_id) > 0
        return sorted((o.seq_id, o.progress) for o in outs)

    try:
        engine.add_request("long-a", prompts["long-a"], GREEDY)
        engine.add_request("long-b", prompts["long-b"], GREEDY)
        assert step() == [("long-b", True)]  # 32 of the shorter one; long-a waits
        engine.add_request("short", prompts["short"], GREEDY)
        assert step() == [("long-b", True), ("short", False)]  # 9 + 32; long-a waits
        assert step() == [("long-a", True), ("long-b", False)]  # long-b's last 16, then 32
        assert [step(), step()] == [[("long-a", True)], [("long-a", False)]]
        for rid, prompt in prompts.items():
            assert done[rid] == _reference(hf, prompt, 1)
        assert engine.allocator.num_free == engine.config.num_pages
    finally:
        engine.close()
    aged = Engine(model, EngineConfig(role="prefill", num_pages=64, chunk_size=32,
                                      max_prefill_tokens=64, prefill_age_s=0.0),
                  eos_token_ids=[])
    try:  # every prompt past the bound: oldest first, still one unfinished per step
        aged.add_request("long-a", prompts["long-a"], GREEDY)
        aged.add_request("long-b", prompts["long-b"], GREEDY)
        assert [o.seq_id for o in aged.step()] == ["long-a"]
    finally:
        aged.close()
