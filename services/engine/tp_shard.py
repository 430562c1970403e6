"""Cutting a loaded Hugging Face decoder into one tensor-parallel rank's shard (Megatron-style).

Rank r of N keeps attention heads `r*H/N .. (r+1)*H/N - 1` and KV heads `r*KVH/N ..`: the
rows of q/k/v (column-parallel), the matching columns of o (row-parallel); and MLP channels
`r*I/N ..`: the rows of gate/up, the columns of down. Each rank's o and down give a partial
sum of the full projection; the all-reduce after each (model.py) adds them. A row-parallel
projection's bias is added once, by rank 0. Embedding, norms and the LM head stay whole on
every rank (the LM head runs on rank 0 only).

Heads are cut whole, so rotary (within a head) and grouped-query attention (query head h reads
KV head h // (H/KVH), and a rank's query heads read exactly its KV heads) need no change.
"""

from __future__ import annotations

from typing import Any

from torch import nn


class ShardingError(ValueError):
    """The model cannot be split into this many ranks."""


def check_divisible(config: dict[str, Any], tp_size: int) -> None:
    """Raise ShardingError naming the counts (of a config.json) that `tp_size` does not
    divide."""
    if tp_size < 1:
        raise ShardingError(f"tensor-parallel size must be >= 1, got {tp_size}")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    channels = int(config["intermediate_size"])
    counts = {"attention heads": heads, "KV heads": kv_heads,
              "MLP channels (intermediate_size)": channels}
    bad = [f"{n} {name}" for name, n in counts.items() if n % tp_size]
    if bad:
        raise ShardingError(
            f"tensor-parallel size {tp_size} does not divide the model's {' and '.join(bad)} "
            f"(the model has {heads} attention heads, {kv_heads} KV heads); use a size that "
            f"divides them{_sizes_hint(heads, kv_heads, channels)}")


def _sizes_hint(heads: int, kv_heads: int, channels: int) -> str:
    sizes = [n for n in range(2, kv_heads + 1)
             if heads % n == 0 and kv_heads % n == 0 and channels % n == 0]
    return f": {', '.join(map(str, [1, *sizes]))}" if sizes else " (only 1 does)"


def shard(hf_model: Any, tp_rank: int, tp_size: int) -> None:
    """Cut `hf_model`'s decoder layers in place to rank `tp_rank`'s shard (tp_size > 1)."""
    cfg = hf_model.config
    check_divisible(cfg.to_dict(), tp_size)
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    q_rows = _part(heads * head_dim, tp_rank, tp_size)
    kv_rows = _part(kv_heads * head_dim, tp_rank, tp_size)
    channels = _part(cfg.intermediate_size, tp_rank, tp_size)
    for layer in hf_model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _rows(attn.q_proj, q_rows)
        _rows(attn.k_proj, kv_rows)
        _rows(attn.v_proj, kv_rows)
        _columns(attn.o_proj, q_rows, keep_bias=tp_rank == 0)
        _rows(mlp.gate_proj, channels)
        _rows(mlp.up_proj, channels)
        _columns(mlp.down_proj, channels, keep_bias=tp_rank == 0)


def _part(total: int, rank: int, size: int) -> slice:
    n = total // size
    return slice(rank * n, (rank + 1) * n)


def _rows(proj: nn.Linear, part: slice) -> None:
    proj.weight = nn.Parameter(proj.weight.data[part].clone(), requires_grad=False)
    if proj.bias is not None:
        proj.bias = nn.Parameter(proj.bias.data[part].clone(), requires_grad=False)


def _columns(proj: nn.Linear, part: slice, *, keep_bias: bool) -> None:
    proj.weight = nn.Parameter(proj.weight.data[:, part].contiguous(), requires_grad=False)
    if proj.bias is not None and not keep_bias:
        proj.bias = None  # type: ignore[assignment]  # (nn.Linear's bias is optional)
