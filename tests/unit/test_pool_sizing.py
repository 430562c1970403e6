"""The KV pool holds one full-context sequence: sized so by default, checked when given
(pdserve.engine.sizing, pure arithmetic)."""

from __future__ import annotations

import pytest
from pdserve.engine.sizing import (
    DEFAULT_KV_CACHE_MB,
    MIB,
    PoolPlan,
    PoolTooSmall,
    SizingError,
    longest_context,
    plan_pool,
    tokens_per_sequence,
)

pytestmark = pytest.mark.unit

# SmolLM2-135M in fp32: 30 layers x K/V x 16 tokens x 3 kv heads x 64 dims x 4 bytes.
SMOLLM2_PAGE = 30 * 2 * 16 * 3 * 64 * 4
SMOLLM2_CONTEXT = 8192


def smollm2(role: str = "decode", **flags: int) -> PoolPlan:
    return plan_pool(role=role, page_bytes=SMOLLM2_PAGE, block_size=16,
                     model_context=SMOLLM2_CONTEXT, **flags)


def test_a_prefill_pool_holds_the_prompt_only():
    assert tokens_per_sequence("decode", 100) == tokens_per_sequence("colocated", 100) == 100
    assert tokens_per_sequence("prefill", 100) == 99
    assert longest_context("decode", 4, 16) == 64 and longest_context("prefill", 4, 16) == 65
    # A 17-token context: the prompt is 16 tokens at most (1 page), prompt + output 17 (2).
    assert plan_pool(role="prefill", page_bytes=MIB, block_size=16, model_context=17,
                     num_pages=1) == PoolPlan(1, 17)
    with pytest.raises(PoolTooSmall, match="--num-pages 1 .* needs 2 pages"):
        plan_pool(role="decode", page_bytes=MIB, block_size=16, model_context=17, num_pages=1)


def test_the_default_pool_holds_the_default_models_whole_context():
    plan = smollm2()  # neither --kv-cache-mb nor --num-pages
    assert plan.max_model_len == SMOLLM2_CONTEXT and not plan.grown_to_mb
    assert plan.num_pages == DEFAULT_KV_CACHE_MB * MIB // SMOLLM2_PAGE
    assert plan.num_pages * 16 >= SMOLLM2_CONTEXT


def test_the_default_pool_grows_to_hold_a_longer_context():
    plan = plan_pool(role="decode", page_bytes=SMOLLM2_PAGE, block_size=16,
                     model_context=32768)
    assert plan == PoolPlan(2048, 32768, grown_to_mb=1440)  # 2048 pages x 720 KiB
    assert "grown from the default 512 MiB" in plan.describe(16, SMOLLM2_PAGE)


def test_an_explicit_pool_too_small_for_the_context_names_both_numbers():
    # The old default of `pdserve up` (256 MiB): 364 pages, 512 needed for 8,192 tokens.
    with pytest.raises(PoolTooSmall) as err:
        smollm2(kv_cache_mb=256)
    message = str(err.value)
    assert "--kv-cache-mb 256" in message and "max_model_len 8192" in message
    assert "needs 360 MiB (512 pages" in message and "holds 364 pages" in message
    assert "at least 360" in message and "--max-model-len to at most 5824" in message
    assert smollm2(kv_cache_mb=360) == PoolPlan(512, SMOLLM2_CONTEXT)  # exactly one sequence
    assert smollm2(role="prefill", kv_cache_mb=360).max_model_len == SMOLLM2_CONTEXT


def test_a_lower_max_model_len_serves_a_small_pool():
    pages = 32 * MIB // SMOLLM2_PAGE  # 45 pages, 720 tokens
    assert smollm2(kv_cache_mb=32, max_model_len=720) == PoolPlan(pages, 720)
    with pytest.raises(PoolTooSmall, match="max_model_len 721"):
        smollm2(kv_cache_mb=32, max_model_len=721)
    assert smollm2("prefill", kv_cache_mb=32, max_model_len=721).max_model_len == 721
    assert smollm2(num_pages=45, max_model_len=720).num_pages == 45
    with pytest.raises(PoolTooSmall, match="raise --num-pages to at least 46"):
        smollm2(num_pages=45, max_model_len=721)


def test_max_model_len_never_exceeds_the_models_context():
    with pytest.raises(SizingError, match="--max-model-len 9000 exceeds the model's context "
                                          "of 8192 tokens"):
        smollm2(max_model_len=9000)
    with pytest.raises(SizingError, match="at least 2"):
        plan_pool(role="decode", page_bytes=MIB, block_size=16, model_context=1)
