"""Attention over the paged pool for a packed batch: in place, or by gathering pages.

`PagedAttention.__call__(q, layer_kv, batch)` returns [N, H, D] for the packed queries
q [N, H, D], whose K/V (new ones included) are already in the pages of `layer_kv`
(`pool[:, layer]`, [P, 2, block, kvh, D]). Two ways, same results up to float rounding:

- native (float32 or bfloat16 pools on CPU, when the C kernels build; the kernels widen bf16
  K/V as they read them and compute in float32): for sequences with a few new tokens
  (decode), `kernels.paged_attention` walks each block table and reads K/V where they lie,
  the query heads of one KV head together; longer prompt chunks go to
  `kernels.prefill_attention`, flash-style causal attention over the pages in place (no
  score matrix, no mask, keys past a row never visited). Where that kernel does not fit the
  head shape, a chunk gathers its own pages once and runs torch's SDPA;
- gather (any dtype, any device): every page of the batch copied into a workspace per layer
  (`index_select`), queries padded to [S, T], torch's SDPA with a [S, 1, T, K] mask.
"""

from __future__ import annotations

import ctypes
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from pdserve.engine import kernels
from pdserve.engine.batch import Batch

KERNEL_MAX_QUERY = 8  # sequences with more new tokens than this run through SDPA


@dataclasses.dataclass
class _Plan:
    # (q_starts, q_ends, context_lens, block_tables, max_context) of the kernel's sequences
    kernel: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int] | None
    # (q_starts, q_ends, context_lens, block_tables) of the prefill kernel's sequences
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None
    # (first row, end row, page ids, mask or None for plain causal) of each long chunk that
    # runs through SDPA instead
    chunks: list[tuple[int, int, torch.Tensor, torch.Tensor | None]]


class PagedAttention:
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.window = sliding_window
        self._ws: torch.Tensor | None = None
        self._mask_for: Any = None  # (batch, mask): the mask is built once per forward
        self._mask: torch.Tensor | None = None
        self._rows = torch.empty(0, dtype=torch.int64)
        self._plan_for: Any = None
        self._last_plan: _Plan | None = None
        self.prefill_kernel = (head_dim in kernels.PREFILL_HEAD_DIMS
                               and num_heads // num_kv_heads <= kernels.PREFILL_MAX_GROUP
                               and kernels.prefill_kernel_suits_cpu())

    def native(self, kv: torch.Tensor) -> ctypes.CDLL | None:
        if kv.device.type != "cpu" or kv.dtype not in kernels.KV_DTYPES:
            return None
        if self.num_heads // self.num_kv_heads > 16:
            return None
        return kernels.library()

    def __call__(self, q: torch.Tensor, layer_kv: torch.Tensor, batch: Batch,
                 lib: ctypes.CDLL | None, rows: int = 0) -> torch.Tensor:
        """[max(rows, N), H, D]: rows past the batch's N tokens are left unwritten (the
        model's padded GEMM rows)."""
        if lib is None:
            return self._gathered(q, layer_kv, batch)
        plan = self._plan(batch)
        q32 = q.float()  # the kernels take float32 queries (a no-op for a float32 model)
        out = torch.empty(max(rows, q.shape[0]), *q.shape[1:], dtype=torch.float32)
        if plan.kernel is not None:
            starts, ends, context, tables, max_context = plan.kernel
            kernels.paged_attention(lib, q32, out, layer_kv, starts, ends, context, tables,
                                    num_kv_heads=self.num_kv_heads, window=self.window or 0,
                                    scale=self.scale, max_context=max_context)
        if plan.prefill is not None:
            kernels.prefill_attention(lib, q32, out, layer_kv, *plan.prefill,
                                      num_kv_heads=self.num_kv_heads, window=self.window or 0,
                                      scale=self.scale)
        for first, last, pages, mask in plan.chunks:
            out[first:last] = self._chunk(q[first:last].to(layer_kv.dtype), layer_kv, pages, mask)
        return out.to(q.dtype)

    def _plan(self, batch: Batch) -> _Plan:
        """Which sequences the kernel takes (few new tokens: decode), which run as chunks
        through SDPA; built once per forward and reused by every layer."""
        if self._plan_for is batch and self._last_plan is not None:
            return self._last_plan
        qs, context = batch.query_starts, batch.context_lens
        qlens = (qs[1:] - qs[:-1]).tolist()
        short = [i for i, n in enumerate(qlens) if n <= KERNEL_MAX_QUERY]
        kernel = None
        if short:
            idx = torch.tensor(short, device=qs.device)
            kernel = (qs[:-1][idx].contiguous(), qs[1:][idx].contiguous(),
                      context[idx].contiguous(), batch.block_tables[idx].contiguous(),
                      int(context[idx].max()))
        long = [i for i, n in enumerate(qlens) if n > KERNEL_MAX_QUERY]
        if long and self.prefill_kernel:
            idx = torch.tensor(long, device=qs.device)
            prefill = (qs[:-1][idx].contiguous(), qs[1:][idx].contiguous(),
                       context[idx].contiguous(), batch.block_tables[idx].contiguous())
            self._plan_for, self._last_plan = batch, _Plan(kernel, prefill, [])
            return self._last_plan
        chunks = []
        block = batch.block_size
        for i in long:
            n = qlens[i]
            ctx = int(context[i])
            pages = batch.block_tables[i, :-(-ctx // block)]
            mask = None  # a whole prompt in one chunk: plain causal
            if ctx != n or self.window is not None:
                key_pos = torch.arange(ctx, device=qs.device)
                q_pos = torch.arange(ctx - n, ctx, device=qs.device)[:, None]
                mask = key_pos <= q_pos
                if self.window is not None:
                    mask &= key_pos > q_pos - self.window
            first = int(qs[i])
            chunks.append((first, first + n, pages, mask))
        self._plan_for, self._last_plan = batch, _Plan(kernel, None, chunks)
        return self._last_plan

    def _chunk(self, q: torch.Tensor, layer_kv: torch.Tensor, pages: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """A prompt chunk [n, H, D] against its sequence's keys: gathered once for n rows,
        then torch's SDPA (GEMM-based, far faster than row-by-row for long chunks)."""
        ctx = mask.shape[1] if mask is not None else q.shape[0]
        kv = layer_kv.index_select(0, pages)  # [pages, 2, block, kvh, D]
        keys = kv[:, 0].reshape(-1, self.num_kv_heads, self.head_dim)[:ctx]
        values = kv[:, 1].reshape(-1, self.num_kv_heads, self.head_dim)[:ctx]
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
            attn_mask=mask, is_causal=mask is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return out[0].transpose(0, 1)

    def _gathered(self, q: torch.Tensor, layer_kv: torch.Tensor, batch: Batch) -> torch.Tensor:
        S, T = batch.num_seqs, batch.max_query_len
        H, D = self.num_heads, self.head_dim
        if self._mask_for is not batch:
            self._mask_for, self._mask = batch, self._attention_mask(batch, layer_kv.shape[2])
            self._rows = batch.padded_rows()
        rows = self._rows
        padded = q.new_zeros(S * T, H, D)
        padded[rows] = q
        pages = batch.block_tables.flatten()
        key_buf, value_buf = self._workspace(pages.numel(), layer_kv.shape[2:], layer_kv)
        keys = self._gather(layer_kv[:, 0], pages, key_buf, S)
        values = self._gather(layer_kv[:, 1], pages, value_buf, S)
        out = F.scaled_dot_product_attention(
            padded.view(S, T, H, D).transpose(1, 2), keys, values, attn_mask=self._mask,
            scale=self.scale, enable_gqa=H != self.num_kv_heads)
        return out.transpose(1, 2).reshape(S * T, H, D)[rows]

    def _workspace(self, num_pages: int, page_shape: torch.Size, like: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reusable buffers for one layer's gathered K and V pages.

        Reused across layers and steps (grown when a batch needs more): a fresh multi-MB
        allocation per layer costs page faults that were measured at ~4x the copy itself.
        """
        need = 2 * num_pages * page_shape.numel()
        ws = self._ws
        if ws is None or ws.numel() < need or ws.dtype != like.dtype or ws.device != like.device:
            ws = torch.empty(need, dtype=like.dtype, device=like.device)
            self._ws = ws
        half = need // 2
        return (ws[:half].view(num_pages, *page_shape), ws[half:need].view(num_pages, *page_shape))

    @staticmethod
    def _gather(pages_kv: torch.Tensor, pages: torch.Tensor, out: torch.Tensor,
                S: int) -> torch.Tensor:
        """[S, kv_heads, tokens, head_dim] view of the pages' K (or V), copied into `out`."""
        torch.index_select(pages_kv, 0, pages, out=out)
        return out.view(S, -1, *out.shape[2:]).transpose(1, 2)

    def _attention_mask(self, batch: Batch, block: int) -> torch.Tensor:
        """[S, 1, T, K] boolean: key j visible to padded query t iff j <= pos(t) (and inside
        the window); pos(t) = context_len - query_len + t."""
        qs = batch.query_starts
        device = qs.device
        K = batch.block_tables.shape[1] * block
        first = batch.context_lens - (qs[1:] - qs[:-1])
        q_pos = (first[:, None] + torch.arange(batch.max_query_len, device=device))[:, :, None]
        key_pos = torch.arange(K, device=device)[None, None, :]
        mask = key_pos <= q_pos
        if self.window is not None:
            mask &= key_pos > q_pos - self.window
        return mask[:, None]
