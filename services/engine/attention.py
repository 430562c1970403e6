"""Attention over the paged pool for a packed batch: in place, or by gathering pages.

`PagedAttention.__call__(q, layer_kv, batch)` returns [N, H, D] for the packed queries
q [N, H, D], whose K/V (new ones included) are already in the pages of `layer_kv`
(`pool[:, layer]`, [P, 2, block, kvh, D]). Two ways, same results up to float rounding:

- native (float32 on CPU, when the C kernel builds): `kernels.paged_attention` walks each
  sequence's block table and reads K/V where they lie, query heads of one KV head together;
- gather (any dtype, any device): every page of the batch copied into a workspace per layer
  (`index_select`), queries padded to [S, T], torch's SDPA with a [S, 1, T, K] mask.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch
import torch.nn.functional as F
from pdserve.engine import kernels
from pdserve.engine.batch import Batch


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

    def native(self, kv: torch.Tensor) -> ctypes.CDLL | None:
        if kv.device.type != "cpu" or kv.dtype != torch.float32:
            return None
        if self.num_heads // self.num_kv_heads > 16:
            return None
        return kernels.library()

    def __call__(self, q: torch.Tensor, layer_kv: torch.Tensor, batch: Batch,
                 lib: ctypes.CDLL | None) -> torch.Tensor:
        if lib is not None:
            out = torch.empty_like(q)
            kernels.paged_attention(lib, q, out, layer_kv, batch.query_starts,
                                    batch.context_lens, batch.block_tables,
                                    num_kv_heads=self.num_kv_heads, window=self.window or 0,
                                    scale=self.scale, max_context=batch.max_context)
            return out
        return self._gathered(q, layer_kv, batch)

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
