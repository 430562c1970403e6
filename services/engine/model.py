"""Loading a Hugging Face decoder-only model and running it over the paged KV pool.

Weights are loaded by transformers' own `from_pretrained` (safetensors, sharding, tied
embeddings); the forward pass is ours, so K and V go straight into pool pages and attention
reads them back through block tables. One forward serves prefill (many query tokens per
sequence, chunked) and decode (one query token per sequence): sequences of any lengths share
a batch, padded on the query side, masked on the key side.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from pdserve.common.layout import LayoutFingerprint
from pdserve.engine.pool import DTYPES
from torch import nn

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class UnsupportedModel(ValueError):
    """The model directory holds an architecture pdserve cannot run."""


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` is bfloat16 on CUDA and float32 on CPU (bf16 without native support is ~4x slower)."""
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of auto, {', '.join(DTYPES)}")
    return dtype


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir} is not a Hugging Face model directory (no config.json)"
        )
    config: dict[str, Any] = json.loads(path.read_text())
    return config


def check_architecture(config: dict[str, Any], model_dir: Path) -> str:
    archs = config.get("architectures") or [config.get("model_type", "?")]
    arch = str(archs[0])
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModel(
            f"architecture {arch!r} in {model_dir} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return arch


def model_revision(model_dir: Path) -> str:
    """A short hash of the config and the weight files' names and sizes (cheap, no reading)."""
    model_dir = Path(model_dir)
    h = hashlib.sha256((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:12]


@dataclasses.dataclass
class Batch:
    """Tensors for one forward over S sequences with up to T new (query) tokens each.

    input_ids, positions: [S, T] (padded); query_lens, context_lens: [S] (context = cached
    tokens + new ones); block_tables: [S, max_pages] page ids in token order (padded with 0).
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor

    @classmethod
    def build(cls, new_tokens: list[list[int]], start_positions: list[int],
              page_tables: list[list[int]], device: torch.device) -> Batch:
        T = max(len(t) for t in new_tokens)
        max_pages = max(len(p) for p in page_tables)
        # Pad in Python, convert once: a tensor per row costs more than the decode step itself
        # on small models.
        ids = torch.tensor([t + [0] * (T - len(t)) for t in new_tokens])
        tables = torch.tensor([p + [0] * (max_pages - len(p)) for p in page_tables])
        starts = torch.tensor(start_positions)
        qlens = torch.tensor([len(t) for t in new_tokens])
        pos = starts[:, None] + torch.arange(T)[None, :]
        return cls(ids.to(device), pos.to(device), qlens.to(device), (starts + qlens).to(device),
                   tables.to(device))


class PagedCausalLM(nn.Module):
    """A Llama-family decoder whose attention reads and writes the paged KV pool."""

    # Plain attributes (nn.Module's __getattr__ would type them Tensor | Module).
    embed_tokens: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    rotary_emb: nn.Module
    lm_head: nn.Linear
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    vocab_size: int
    max_context: int

    def __init__(self, hf_model: Any, model_id: str, revision: str):
        super().__init__()
        cfg = hf_model.config
        inner = hf_model.model
        self.config = cfg
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.num_layers = cfg.num_hidden_layers
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        window = getattr(cfg, "sliding_window", None)
        if getattr(cfg, "use_sliding_window", True) is False:
            window = None
        self.sliding_window: int | None = window
        self.vocab_size = cfg.vocab_size
        self.max_context = cfg.max_position_embeddings
        self.model_id = model_id
        self.revision = revision
        self.dtype_name = {v: k for k, v in DTYPES.items()}[self.embed_tokens.weight.dtype]

    def fingerprint(self, block_size: int) -> LayoutFingerprint:
        return LayoutFingerprint(self.model_id, self.revision, self.dtype_name, self.num_layers,
                                 self.num_kv_heads, self.head_dim, block_size)

    @torch.inference_mode()
    def forward(self, batch: Batch, kv: torch.Tensor) -> torch.Tensor:
        """Run the batch, writing its new K/V into `kv` pages; the logits of each sequence's last
        new token [S, V]."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        S, T = batch.input_ids.shape
        block = kv.shape[3]
        hidden = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary_emb(hidden, batch.positions)
        mask = self._attention_mask(batch, block)
        slot_pages, slot_offsets, valid = self._write_slots(batch, block)
        pages = batch.block_tables.flatten()
        key_buf, value_buf = self._workspace(pages.numel(), kv.shape[3:], kv.dtype, kv.device)
        layer: Any  # transformers' decoder layer (untyped)
        for layer_idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q = attn.q_proj(x).view(S, T, self.num_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(x).view(S, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = attn.v_proj(x).view(S, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            layer_kv = kv[:, layer_idx]  # [P, 2, block, kvh, hd], a view
            new_k = k.transpose(1, 2).reshape(S * T, self.num_kv_heads, self.head_dim)
            new_v = v.transpose(1, 2).reshape(S * T, self.num_kv_heads, self.head_dim)
            layer_kv[slot_pages, 0, slot_offsets] = new_k[valid]
            layer_kv[slot_pages, 1, slot_offsets] = new_v[valid]
            keys = self._gather(layer_kv[:, 0], pages, key_buf, S)
            values = self._gather(layer_kv[:, 1], pages, value_buf, S)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                                 scale=self.scaling,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
            out = attn.o_proj(out.transpose(1, 2).reshape(S, T, -1))
            hidden = hidden + out
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        last = hidden[torch.arange(S, device=hidden.device), batch.query_lens - 1]
        logits: torch.Tensor = self.lm_head(self.norm(last)).float()
        return logits

    def _workspace(self, num_pages: int, page_shape: torch.Size, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Two reusable buffers for one layer's gathered K and V pages.

        Reused across layers and steps (grown when a batch needs more): a fresh multi-MB
        allocation per layer costs page faults that were measured at ~4x the copy itself.
        """
        need = 2 * num_pages * page_shape.numel()
        ws = getattr(self, "_ws", None)
        if ws is None or ws.numel() < need or ws.dtype != dtype or ws.device != device:
            ws = torch.empty(need, dtype=dtype, device=device)
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
        """[S, 1, T, K] boolean: key j visible to query t iff j <= pos(t) (and inside the
        window)."""
        K = batch.block_tables.shape[1] * block
        key_pos = torch.arange(K, device=batch.positions.device)
        q_pos = batch.positions[:, :, None]
        mask = key_pos[None, None, :] <= q_pos
        if self.sliding_window is not None:
            mask &= key_pos[None, None, :] > q_pos - self.sliding_window
        return mask[:, None]

    def _write_slots(self, batch: Batch, block: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Page and in-page offset for every real (unpadded) new token, and their flat indices."""
        S, T = batch.input_ids.shape
        real = torch.arange(T, device=batch.positions.device)[None, :] < batch.query_lens[:, None]
        valid = real.flatten().nonzero().squeeze(1)
        pos = batch.positions.flatten()[valid]
        seq = valid // T
        pages = batch.block_tables[seq, pos // block]
        return pages, pos % block, valid


def load_model(model_dir: Path, *, dtype: str = "auto", device: str = "cpu",
               model_id: str | None = None) -> PagedCausalLM:
    """Load a local Hugging Face directory (no network) into a PagedCausalLM."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    check_architecture(config, model_dir)
    dtype = resolve_dtype(dtype, device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], local_files_only=True)
    cast(Any, hf).to(device).eval()
    name = model_id or model_dir.resolve().name
    return PagedCausalLM(hf, name, model_revision(model_dir)).eval()
