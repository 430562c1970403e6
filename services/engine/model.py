"""Loading a Hugging Face decoder-only model and running it over the paged KV pool.

Weights are loaded by transformers' own `from_pretrained` (safetensors, sharding, tied
embeddings); the forward pass is ours, so K and V go straight into pool pages and attention
reads them back through block tables. One forward serves prefill (many query tokens per
sequence, chunked) and decode (one query token per sequence), both in one batch: new tokens
are packed back to back through one q/k/v GEMM per layer and an MLP whose element-wise work
runs in its GEMMs' epilogues (one gate/up GEMM where the GEMMs are not oneDNN's), and
attention reads the pages in place (`attention.py`); the LM head runs on each sequence's last
token only.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.models import read_json
from pdserve.engine import kernels
from pdserve.engine.attention import PagedAttention
from pdserve.engine.batch import Batch
from pdserve.engine.pool import DTYPES
from pdserve.engine.tp_shard import shard
from torch import nn

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class UnsupportedModel(ValueError):
    """The model directory holds an architecture pdserve cannot run."""


class TensorParallel(Protocol):
    """What the forward pass needs of its tensor-parallel group (tp.py): rank 0 hands each
    step's batch to the other ranks before running it; every rank sums its row-parallel
    partials with the others'."""

    rank: int
    size: int

    def start_step(self, batch: Batch) -> None: ...

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor: ...


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
    return read_json(path)


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
    fused_epilogues: bool

    def __init__(self, hf_model: Any, model_id: str, revision: str,
                 tp: TensorParallel | None = None):
        """`hf_model` whole, or already cut to `tp`'s rank (tp_shard.shard)."""
        super().__init__()
        cfg = hf_model.config
        self.tp = tp
        tp_size = tp.size if tp is not None else 1
        inner = hf_model.model
        self.config = cfg
        self.embed_tokens = inner.embed_tokens
        self.layers = inner.layers
        self.norm = inner.norm
        self.rotary_emb = inner.rotary_emb
        self.lm_head = hf_model.lm_head
        self.num_layers = cfg.num_hidden_layers
        heads = cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        # This rank's heads (all of them without tensor parallelism).
        self.num_heads = heads // tp_size
        self.num_kv_heads = (getattr(cfg, "num_key_value_heads", None) or heads) // tp_size
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
        self.attention = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                        self.scaling, window)
        self._fuse_projections()
        self._pack_linears(self.embed_tokens.weight.device)

    def fingerprint(self, block_size: int) -> LayoutFingerprint:
        rank, size = (self.tp.rank, self.tp.size) if self.tp is not None else (0, 1)
        return LayoutFingerprint(self.model_id, self.revision, self.dtype_name, self.num_layers,
                                 self.num_kv_heads, self.head_dim, block_size, rank, size)

    def _fuse_projections(self) -> None:
        """One q/k/v GEMM per layer (1 instead of 3).

        The fused weight is concatenated once; each original projection's weight becomes a
        view into it, so the model holds every weight once.
        """
        self._qkv: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        layer: Any
        for layer in self.layers:
            attn = layer.self_attn
            projs = (attn.q_proj, attn.k_proj, attn.v_proj)
            weight = torch.cat([p.weight for p in projs])
            bias = None
            if attn.q_proj.bias is not None:
                bias = torch.cat([p.bias for p in projs])
            self._rebind(projs, weight, bias)
            self._qkv.append((weight, bias))

    def _pack_linears(self, device: torch.device) -> None:
        """Every GEMM of the step as a `Linear` (oneDNN with prepacked weights on CPU).

        Packed, the MLP runs as two GEMMs whose epilogues do its element-wise work (gate:
        SiLU; up: times the gate) and the o/down projections add the residual in theirs, so
        no separate pass over the activations is left for them."""
        layers: list[Any] = list(self.layers)  # transformers' decoder layers (untyped)
        self._qkv_mm = [Linear(w, b, device) for w, b in self._qkv]
        self._gate_mm = [Linear(layer.mlp.gate_proj.weight, None, device) for layer in layers]
        self._up_mm = [Linear(layer.mlp.up_proj.weight, None, device) for layer in layers]
        self._o_mm = [Linear(layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, device)
                      for layer in layers]
        self._down_mm = [Linear(layer.mlp.down_proj.weight, layer.mlp.down_proj.bias, device)
                         for layer in layers]
        self._lm_head_mm = Linear(self.lm_head.weight, self.lm_head.bias, device)
        linears = (*self._qkv_mm, *self._gate_mm, *self._up_mm, *self._o_mm, *self._down_mm,
                   self._lm_head_mm)
        self.fused_epilogues = (all(mm.packed is not None for mm in linears)
                                and getattr(self.config, "hidden_act", "") in ("silu", "swish"))
        self._gate_up_mm: list[Linear] = []
        if not self.fused_epilogues:  # one gate/up GEMM, the element-wise ops after it
            self._gate_mm, self._up_mm = [], []
            for layer in layers:
                projs = (layer.mlp.gate_proj, layer.mlp.up_proj)
                gate_up = torch.cat([p.weight for p in projs])
                self._rebind(projs, gate_up, None)  # held once: the projections are views
                self._gate_up_mm.append(Linear(gate_up, None, device))
            return
        # The step reads only the packed copies: the dense weights go (the embedding stays,
        # and with it a tied LM head's weight), so the model is held once, not twice.
        empty = nn.Parameter(torch.empty(0, device=device), requires_grad=False)
        for layer in layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj,
                         layer.self_attn.v_proj, layer.self_attn.o_proj, layer.mlp.gate_proj,
                         layer.mlp.up_proj, layer.mlp.down_proj):
                proj.weight = empty
        if self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = empty
        self._qkv = []
        for mm in linears:
            mm.weight = None

    @staticmethod
    def _rebind(projs: tuple[nn.Linear, ...], weight: torch.Tensor,
                bias: torch.Tensor | None) -> None:
        row = 0
        for p in projs:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(weight[row:row + n], requires_grad=False)
            if bias is not None:
                p.bias = nn.Parameter(bias[row:row + n], requires_grad=False)
            row += n

    @torch.inference_mode()
    def forward(self, batch: Batch, kv: torch.Tensor) -> torch.Tensor:
        """Run the batch, writing its new K/V into `kv` pages; the logits of each sequence's last
        new token [S, V]."""
        tp = self.tp
        if tp is not None and tp.rank == 0:
            tp.start_step(batch)
        N = batch.num_tokens
        H, KVH, D = self.num_heads, self.num_kv_heads, self.head_dim
        hidden = self.embed_tokens(batch.input_ids)
        cos, sin = self.rotary_emb(hidden, batch.positions[None])
        lib = self.attention.native(kv)
        if lib is None:
            cos, sin = cos[0, :, None], sin[0, :, None]  # [N, 1, D], broadcast over heads
        else:
            cos, sin = cos[0].contiguous(), sin[0].contiguous()  # [N, D]
        rows = N
        if self.fused_epilogues and lib is not None:  # oneDNN GEMMs: bucketed rows (gemm_rows)
            rows = gemm_rows(N)
            hidden = F.pad(hidden, (0, 0, 0, rows - N))
        layer: Any  # transformers' decoder layer (untyped)
        for layer_idx, layer in enumerate(self.layers):
            x = _rms_norm(layer.input_layernorm, hidden)
            qkv = self._qkv_mm[layer_idx](x)
            layer_kv = kv[:, layer_idx]  # [P, 2, block, kvh, hd], a view
            if lib is not None:  # rotary and the K/V store in one native pass
                q = kernels.rope_store(lib, qkv[:N], cos, sin, layer_kv, batch.slot_pages,
                                       batch.slot_offsets, num_heads=H, num_kv_heads=KVH,
                                       head_dim=D)
            else:
                qk, v = torch.split(qkv, [(H + KVH) * D, KVH * D], dim=-1)
                qk = qk.view(N, H + KVH, D)  # rotary on q and k heads at once
                qk = (qk * cos) + (_rotate_half(qk) * sin)
                q, k = qk[:, :H].contiguous(), qk[:, H:]
                layer_kv[batch.slot_pages, 0, batch.slot_offsets] = k
                layer_kv[batch.slot_pages, 1, batch.slot_offsets] = v.view(N, KVH, D)
            out = self.attention(q, layer_kv, batch, lib, rows).to(hidden.dtype)
            if self.fused_epilogues:  # the same sums; the GEMMs' epilogues do the rest
                hidden = self._row_parallel(self._o_mm[layer_idx], out.view(rows, H * D), hidden)
                x = _rms_norm(layer.post_attention_layernorm, hidden)
                act = self._up_mm[layer_idx].mul(x, self._gate_mm[layer_idx].silu(x))
                hidden = self._row_parallel(self._down_mm[layer_idx], act, hidden)
                continue
            hidden = hidden + self._reduce(self._o_mm[layer_idx](out.view(N, H * D)))
            x = _rms_norm(layer.post_attention_layernorm, hidden)
            gate, up = self._gate_up_mm[layer_idx](x).chunk(2, dim=-1)
            hidden = hidden + self._reduce(self._down_mm[layer_idx](layer.mlp.act_fn(gate) * up))
        if tp is not None and tp.rank != 0:  # rank 0 alone samples
            nothing: torch.Tensor = hidden[:0]
            return nothing
        last = hidden[batch.last_index]
        logits: torch.Tensor = self._lm_head_mm(_rms_norm(self.norm, last)).float()
        return logits


    def _row_parallel(self, mm: Linear, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual + x W^T (+ b), the residual added in the GEMM's epilogue; with tensor
        parallelism each rank's partial product summed, the residual (and bias) from rank 0."""
        if self.tp is None:
            return mm.add(x, residual)
        return self.tp.all_reduce(mm.add(x, residual) if self.tp.rank == 0 else mm(x))

    def _reduce(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.tp is None else self.tp.all_reduce(partial)


class Linear:
    """`F.linear(x, weight, bias)` for one weight. On CPU in fp32 / bf16 it runs oneDNN with
    the weight reordered once into oneDNN's blocked layout (`PDSERVE_ONEDNN_LINEAR=0` turns that
    off): torch's default CPU GEMM (MKL's sgemm) takes its AVX2 path on non-Intel CPUs, and
    measured on a 2-core AMD EPYC (AVX-512) the packed oneDNN GEMM was 2.3-3x faster at decode
    shapes (M=32) and 2x at prefill shapes (M=8192), as vLLM-CPU's own linears are. The packed
    copy is the one the step uses; results differ from MKL's by float rounding only."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, device: torch.device):
        self.bias = None if bias is None else bias.detach()
        self.weight: torch.Tensor | None = weight.detach()
        self.packed: torch.Tensor | None = None
        if (device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and _onednn_linear()):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, None)
            except RuntimeError:  # e.g. bf16 on a CPU without AVX-512 BW/VL/DQ or AVX-NE-CONVERT
                self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [N, in] -> [N, out]."""
        if self.packed is not None:
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, self.bias, "none", [], "")
            return out
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)

    # Packed only (the model uses these where every GEMM is packed): the element-wise op in
    # oneDNN's epilogue, on the float32 accumulators, instead of a pass of its own.
    def silu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(x W^T + b)."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x.contiguous(), self.packed, self.bias, "swish", [], "")
        return out

    def mul(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x W^T + b) * other."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
            x.contiguous(), other, self.packed, self.bias, "mul")
        return out

    def add(self, x: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
        """(x W^T + b) + other: a residual added in the epilogue."""
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise.binary(
            x.contiguous(), other, self.packed, self.bias, "add")
        return out


def gemm_rows(n: int) -> int:
    """The row count a step's GEMMs run at for n tokens: n rounded up to a bucket (exact to
    32, then multiples of 8 to 128, of 32 to 1,024, of 128 beyond; at most 24% padding).

    torch's oneDNN linear builds (JIT-compiles) a kernel per input shape and keeps ~1,000 in a
    cache; served steps see every token count from 1 to the step budget, so with exact counts
    new shapes kept arriving, each first use measured at ~1.2 ms per weight (K=256, N=1,536 on
    a 2-vCPU Zen 5: 2.1 ms against 0.93 ms once built), and the cache thrashed. Buckets keep the
    shapes to ~100 per weight. Padded rows are garbage the real rows never read: every op of
    the step is row-wise except attention, which reads only the real rows and the pages."""
    for limit, step in ((32, 1), (128, 8), (1024, 32)):
        if n <= limit:
            return -(-n // step) * step
    return -(-n // 128) * 128


def _onednn_linear() -> bool:
    if os.environ.get("PDSERVE_ONEDNN_LINEAR", "1") == "0":
        return False
    return (bool(torch.backends.mkldnn.is_available())  # type: ignore[no-untyped-call]
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def _rms_norm(norm: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama/Qwen2/Mistral RMSNorm as one fused op (bit-identical in fp32)."""
    if x.dtype != torch.float32:  # transformers normalises in fp32, then casts back
        return cast(torch.Tensor, norm(x))
    return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' rotate_half: [x1, x2] -> [-x2, x1] over the last dimension."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def load_model(model_dir: Path, *, dtype: str = "auto", device: str = "cpu",
               model_id: str | None = None, tp: TensorParallel | None = None) -> PagedCausalLM:
    """Load a local Hugging Face directory (no network) into a PagedCausalLM (with `tp`, the
    shard of its rank)."""
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    config = read_config(model_dir)
    check_architecture(config, model_dir)
    dtype = resolve_dtype(dtype, device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=DTYPES[dtype], local_files_only=True)
    cast(Any, hf).to(device).eval()
    if tp is not None and tp.size > 1:
        shard(hf, tp.rank, tp.size)
    name = model_id or model_dir.resolve().name
    return PagedCausalLM(hf, name, model_revision(model_dir), tp).eval()
