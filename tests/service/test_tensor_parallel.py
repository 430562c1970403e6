"""Tensor-parallel workers: a worker of TP size N runs N rank processes (the model's heads and
MLP split between them, gloo all-reduces), and a handoff between a prefill worker of TP size P
and a decode worker of TP size D moves each KV head range to the decode rank that owns it.

Real rank processes, real agents, the built-in tiny model (4 heads, 2 KV heads, MLP 128:
TP 1 and 2 divide it, 4 does not); outputs checked token for token against transformers.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from pdserve.engine.sampling import SamplingParams
from pdserve.engine.setup import build_engine
from pdserve.engine.tp_shard import ShardingError

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.service.stack import collect, pdserve_stacks
from tests.support import pdserve_argv

pytestmark = pytest.mark.service

PAGE_BYTES = 2 * 2 * 16 * 2 * 16 * 4  # tiny, all KV heads: layers, K/V, block, heads, dim, fp32
CHECKED = [PROMPTS[2], PROMPTS[4], PROMPTS[-1]]  # short, ~30 tokens, long (chunked: 32 a step)
WORKER_ENV = {"PDSERVE_PREFILL_CHUNK_SIZE": "32", "PDSERVE_DECODE_NUM_PAGES": "128",
              "PDSERVE_DECODE_MAX_MODEL_LEN": "2048"}


def _rank_processes() -> list[int]:
    """Rank processes (pdserve.engine.tp_rank) this test process started."""
    out = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "pdserve.engine.tp_rank"],
                         capture_output=True, text=True, check=False).stdout
    return [int(pid) for pid in out.split()]


def _greedy_engine(engine, prompt_ids: list[int]) -> list[int]:
    engine.add_request("r", prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
    tokens: list[int] = []
    for _ in range(10 * MAX_TOKENS):
        tokens += [o.token for o in engine.step() if o.token is not None]
        if not engine.seqs:
            return tokens
    raise AssertionError(f"no end after {10 * MAX_TOKENS} steps: {tokens}")


def test_a_tp2_engine_equals_transformers_and_stops_its_rank(reference):
    tok, refs = reference
    engine, _ = build_engine("tiny", role="colocated", num_pages=64, max_model_len=1024, tp=2)
    try:
        assert engine.pool.fingerprint.tp_size == 2 and engine.pool.fingerprint.num_kv_heads == 1
        assert [p.fingerprint.tp_rank for p in engine.rank_pools] == [0, 1]
        assert len(_rank_processes()) == 1
        for prompt in PROMPTS:
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            assert _greedy_engine(engine, ids) == refs[prompt][1], prompt[:30]
        # Each rank wrote its own heads: rank 1's pool holds K/V that rank 0's does not.
        rank0, rank1 = (p.tensor for p in engine.rank_pools)
        assert torch.count_nonzero(rank1) > 0 and not torch.equal(rank0, rank1)
    finally:
        engine.close()
    assert _rank_processes() == []


def test_a_size_that_does_not_divide_the_heads_is_refused_naming_them():
    with pytest.raises(ShardingError, match=r"does not divide the model's 2 KV heads.*"
                                            r"4 attention heads, 2 KV heads.*: 1, 2"):
        build_engine("tiny", role="colocated", num_pages=64, max_model_len=1024, tp=4)
    run = subprocess.run(pdserve_argv("colocated", "--model", "tiny", "--tp", "4", "--port", "0",
                                      "--metrics-port", "-1", "--num-pages", "64",
                                      "--max-model-len", "1024"),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stderr[-2000:]
    assert "cannot start: tensor-parallel size 4 does not divide" in run.stderr
    assert _rank_processes() == []


# P -> D over each data path: every split over the same-host copy (shm); over UCX and TCP
# (same-host copy off) the one each does not cross hosts with in tests/multihost/test_two_hosts
# (TCP 2 -> 1, UCX 1 -> 2 there), so each network transport gathers and scatters heads once.
# Every rank is a process importing torch: three stacks per transport took ~40 s on 2 cores.
SPLITS = {"shm": [(2, 1), (1, 2), (2, 2)], "tcp": [(1, 2)], "ucx": [(2, 1)]}


@pytest.fixture(scope="module", params=list(SPLITS))
def stacks(request, tiny_model_dir):
    flags = () if request.param == "shm" else ("--transport", request.param,
                                               "--no-same-host-copy")
    arg_lists = [(*flags, "--prefill-tp", str(p), "--decode-tp", str(d))
                 for p, d in SPLITS[request.param]]
    with pdserve_stacks(*arg_lists, env=WORKER_ENV) as started:
        yield request.param, started


def test_every_split_hands_off_token_exact_and_frees_its_pages(stacks, reference):
    """Each prompt twice: the first ships every page, the second only its last (the decode
    side holds the rest in its prefix cache, found by keys that ignore the TP split)."""
    transport, started = stacks
    tok, refs = reference
    for (p, d), stack in zip(SPLITS[transport], started, strict=True):
        for prompt in CHECKED:
            n_prompt, expected = refs[prompt]
            for attempt in range(2):
                ids, text, timing, finish = collect(stack.generate(
                    prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0))
                where = f"{p}->{d} over {transport}, attempt {attempt}, {prompt[:20]!r}"
                assert ids == expected, where
                assert text == tok.decode([t for t in expected if t not in tok.all_special_ids])
                assert finish.prompt_tokens == n_prompt, where
                assert timing.kv_transport == transport, where
                pages = -(-n_prompt // 16)
                if attempt == 0:
                    assert timing.kv_pages == pages, where
                elif pages > 1:  # the decode side held the full pages before the last
                    assert 1 <= timing.kv_pages < pages and timing.decode_cached_tokens, where
                assert timing.kv_bytes == timing.kv_pages * PAGE_BYTES, where  # all heads, once
                _check_rank_parts(timing, p, d, transport, where)
        stats = stack.decode_stats()
        assert stats.fingerprint.tp_size == d and stats.fingerprint.num_kv_heads == 2 // d
        assert stack.prefill_stats().fingerprint.tp_size == p
        assert stats.reserved_tickets == 0 and stats.running_sequences == 0


@pytest.mark.parametrize("arch,tp", [("llama", 4), ("qwen2", 2)])
def test_tp4_and_biased_projections_equal_transformers(arch, tp, tmp_path):
    """A model whose heads divide by 4 (8 heads, 4 KV heads) at TP 4, and Qwen2 (q/k/v biases:
    cut with their rows) at TP 2: greedy ids equal transformers' on a few prompts."""
    from transformers import (
        AutoModelForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    shape = dict(vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, intermediate_size=128, max_position_embeddings=256,
                 initializer_range=0.1)
    torch.manual_seed(0)
    model = (LlamaForCausalLM(LlamaConfig(**shape)) if arch == "llama"
             else Qwen2ForCausalLM(Qwen2Config(**shape, use_sliding_window=False)))
    if arch == "qwen2":  # random biases, so a wrongly cut one shows
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.5)
    model.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompts = [[5, 17, 42], list(range(20, 60)), [(i * 37) % 290 + 3 for i in range(70)]]
    engine, _ = build_engine(str(tmp_path), role="colocated", num_pages=64, max_model_len=256,
                             tp=tp)
    try:
        assert len(_rank_processes()) == tp - 1
        for ids in prompts:
            want = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                               min_new_tokens=MAX_TOKENS)[0, len(ids):].tolist()
            assert _greedy_engine(engine, ids) == want, (arch, tp, ids[:5])
    finally:
        engine.close()
    assert _rank_processes() == []


def _check_rank_parts(timing, p: int, d: int, transport: str, where: str) -> None:
    """Timing shows each decode rank's part: the prefill ranks its heads came from, its bytes
    (a 1/D share), and how they changed layout (on one host in the receiver's copy)."""
    relayout = "" if p == d else "receiver" if transport == "shm" else "staging"
    got = [(r.decode_rank, r.prefill_rank_first, r.prefill_rank_last, r.kv_bytes, r.transport,
            r.relayout) for r in timing.kv_ranks]
    assert got == [(k, k * p // d, ((k + 1) * p - 1) // d, timing.kv_bytes // d, transport,
                    relayout) for k in range(d)], where
    assert all(0 < r.handoff_ms <= timing.kv_transfer_ms + 1e-6 for r in timing.kv_ranks), where
