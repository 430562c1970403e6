"""Attention over pages read in place (the C kernel) against the gather + SDPA path and plain
math, on mixed batches: decode rows, prefill chunks longer than a tile, sliding windows, GQA."""

from __future__ import annotations

import os

import pytest
import torch
from pdserve.bench.engine_vllm import agreement
from pdserve.engine import kernels
from pdserve.engine.attention import PagedAttention
from pdserve.engine.batch import Batch

pytestmark = pytest.mark.unit
BLOCK = 16


@pytest.fixture(scope="module")
def lib(cache_dir):
    found = kernels.library()
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("the paged attention kernel did not build (is a C compiler installed?)")
        pytest.skip("no C compiler: the engine uses the gather path")
    return found


@pytest.fixture(autouse=True)
def prefill_kernel_on(monkeypatch):
    """The prefill kernel is checked on every machine, also where prompts take SDPA for speed
    (no AVX-512: test_the_prefill_kernel_is_chosen_where_it_is_fast)."""
    monkeypatch.setenv("PDSERVE_PREFILL_KERNEL", "1")


def test_the_prefill_kernel_is_chosen_where_it_is_fast(monkeypatch):
    monkeypatch.delenv("PDSERVE_PREFILL_KERNEL")
    for flags, chosen in (("flags : fpu avx2 fma avx512f avx512bw", True),
                          ("flags : fpu avx2 fma", False)):
        monkeypatch.setattr(kernels, "_cpu_flags", lambda f=flags: f)
        assert kernels.prefill_kernel_suits_cpu() is chosen
        assert PagedAttention(8, 2, 32, 32 ** -0.5, None).prefill_kernel is chosen
    for forced in ("0", "1"):
        monkeypatch.setenv("PDSERVE_PREFILL_KERNEL", forced)
        assert kernels.prefill_kernel_suits_cpu() is (forced == "1")


def _reference(q: torch.Tensor, layer_kv: torch.Tensor, seqs: list[tuple[int, int, list[int]]],
               num_kv_heads: int, window: int | None) -> torch.Tensor:
    """Plain softmax(q k^T) v per sequence, keys read page by page."""
    out = torch.empty_like(q, dtype=torch.float64)
    row = 0
    group = q.shape[1] // num_kv_heads
    for qlen, context, pages in seqs:
        keys = torch.cat([layer_kv[p, 0] for p in pages])[:context].double()  # [ctx, kvh, D]
        values = torch.cat([layer_kv[p, 1] for p in pages])[:context].double()
        for i in range(qlen):
            pos = context - qlen + i
            lo = max(0, pos - window + 1) if window else 0
            for h in range(q.shape[1]):
                k, v = keys[lo:pos + 1, h // group], values[lo:pos + 1, h // group]
                scores = (k @ q[row + i, h].double()) * q.shape[2] ** -0.5
                out[row + i, h] = scores.softmax(0) @ v
        row += qlen
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [
    (8, 2, 32, None), (4, 4, 64, None), (6, 2, 24, None), (8, 2, 32, 20), (4, 2, 16, None),
    (16, 4, 64, 70), (4, 1, 128, None)])
def test_kernel_matches_gather_and_plain_math(lib, heads, kv_heads, head_dim, window):
    """Decode rows take the row kernel; prompt chunks the flash-style prefill kernel where
    it is built for the head size (24 is not: those chunks run through SDPA)."""
    attention = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, window)
    assert attention.prefill_kernel == (head_dim != 24)
    _check_against_plain_math(lib, heads, kv_heads, head_dim, window)


@pytest.mark.parametrize("heads,kv_heads,head_dim,window", [
    (8, 2, 32, None), (16, 4, 64, 70), (6, 2, 24, None)])
def test_kernel_reads_a_bfloat16_pool(lib, heads, kv_heads, head_dim, window):
    """A bf16 model's pool: the kernels widen K/V as they read them and compute in float32,
    so they agree with float64 math over the same bf16 values to the output's bf16 rounding."""
    _check_against_plain_math(lib, heads, kv_heads, head_dim, window, torch.bfloat16)


def test_a_portable_prebuilt_kernel_is_used_where_there_is_no_compiler(lib, tmp_path,
                                                                       monkeypatch):
    """What an image without a C compiler does: the x86-64-v3/v4 builds made ahead of time
    (`python -m pdserve.engine.kernels prebuild`) load instead, and compute the same."""
    built = kernels.prebuild(tmp_path / "kernels")
    levels = [level for level, _ in kernels.PORTABLE_LEVELS]
    assert levels == ["x86-64-v4", "x86-64-v3"]
    assert [p.name.removesuffix(".so").endswith(level) for p, level in zip(built, levels)] \
        == [True, True]
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(kernels, "compiler", lambda: None)
    monkeypatch.setattr(kernels, "_tried", False)
    monkeypatch.setattr(kernels, "_lib", None)
    portable = kernels.library()
    flags = set(kernels._cpu_flags().split())
    usable = [p for p, (_, needs) in zip(built, kernels.PORTABLE_LEVELS) if needs <= flags]
    if not usable:
        assert portable is None  # an x86-64 older than v3 (or not x86): the gather path
        return
    assert portable is not None and portable._name == str(usable[0])
    _check_against_plain_math(portable, 8, 2, 32, 20)
    (tmp_path / "kernels" / usable[0].name).unlink()  # only the lower level left (or none)
    monkeypatch.setattr(kernels, "_tried", False)
    fallback = kernels.library()
    assert (fallback._name if fallback else None) == (str(usable[1]) if len(usable) > 1
                                                      else None)


def _check_against_plain_math(lib, heads: int, kv_heads: int, head_dim: int,
                              window: int | None, dtype: torch.dtype = torch.float32) -> None:
    gen = torch.Generator().manual_seed(3)
    num_pages, layers = 60, 2
    pool = torch.randn(num_pages, layers, 2, BLOCK, kv_heads, head_dim, generator=gen).to(dtype)
    order = torch.randperm(num_pages, generator=gen).tolist()
    # (new tokens, context incl. them): decode rows, a chunk over two tiles, a fresh prompt,
    # a chunk after cached context spanning several key blocks (and window edges)
    shapes = [(1, 1), (1, 37), (33, 50), (5, 5), (1, 129), (17, 100), (70, 230), (9, 9)]
    seqs, at = [], 0
    for qlen, context in shapes:
        n = -(-context // BLOCK)
        seqs.append((qlen, context, order[at:at + n]))
        at += n
    batch = Batch.build([[0] * qlen for qlen, _, _ in seqs], [c - q for q, c, _ in seqs],
                        [pages for _, _, pages in seqs], BLOCK, torch.device("cpu"))
    q = torch.randn(batch.num_tokens, heads, head_dim, generator=gen).to(dtype)
    attention = PagedAttention(heads, kv_heads, head_dim, head_dim ** -0.5, window)
    layer_kv = pool[:, 1]  # a strided view, as the model passes it
    native = attention(q, layer_kv, batch, lib)
    gathered = attention(q, layer_kv, batch, None)
    expected = _reference(q, layer_kv, seqs, kv_heads, window)
    assert native.dtype == gathered.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps  # |outputs| < 4
    assert (native.double() - expected).abs().max().item() < tol
    assert (gathered.double() - expected).abs().max().item() < 4 * tol


def test_agreement_counts_identical_sequences_and_common_prefixes():
    result = agreement([[1, 2, 3], [4, 5, 6], [7]], [[1, 2, 3], [4, 9, 6], [8]])
    assert (result.exact, result.total) == (1, 3)
    assert result.mean_common_prefix == pytest.approx((3 + 1 + 0) / 3)
