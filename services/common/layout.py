"""The KV page layout and its fingerprint, shared by the engine and the kvtransfer agents.

Standard library only: the engine builds its pool from it, the agents compare the pools of
both ends of a handoff with it, and neither has to import the other.
"""

from __future__ import annotations

import dataclasses
import math

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclasses.dataclass(frozen=True)
class LayoutFingerprint:
    """Everything that decides whether two pools hold pages of the same shape and meaning.

    A page is `[num_layers, 2, block_size, num_kv_heads, head_dim]` of `dtype`, contiguous.
    """

    model_id: str
    model_revision: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * DTYPE_BYTES[self.dtype]

    def mismatches(self, other: LayoutFingerprint) -> list[str]:
        """`field: mine != theirs` for every field that differs (empty when compatible)."""
        return [
            f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


def pages_for_tokens(num_tokens: int, block_size: int) -> int:
    """Pages that hold `num_tokens` tokens at `block_size` tokens a page (rounded up)."""
    return -(-num_tokens // block_size)
