"""An engine's configuration (pdserve.engine.engine)."""

from __future__ import annotations

import dataclasses

ROLES = ("colocated", "prefill", "decode")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    role: str = "colocated"
    block_size: int = 16
    num_pages: int = 4096
    max_num_seqs: int = 256        # running sequences in one decode batch
    chunk_size: int = 512          # prompt tokens of one sequence per step beside decodes
    max_prefill_tokens: int = 2048  # prompt tokens of all sequences per prefill step
    max_model_len: int = 0         # prompt + output tokens of one sequence (0: the model's)
    prefix_caching: bool = True    # keep full pages for reuse by later prompts
    # Prompts one step computes while sequences decode (0: as many as the budget holds). A
    # step that packs several prompts gives each its first token only at its end, and holds
    # every running sequence's next token as long.
    prompts_beside_decodes: int = 0
    # Prefill role: prompts waiting longer than this go first, oldest first (see prefill_order).
    prefill_age_s: float = 1.0

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        for name in ("block_size", "num_pages", "max_num_seqs", "chunk_size", "max_prefill_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be >= 0, got {self.max_model_len}")
        if not self.prefill_age_s >= 0:
            raise ValueError(f"prefill_age_s must be >= 0, got {self.prefill_age_s}")
        if self.prompts_beside_decodes < 0:
            raise ValueError(f"prompts_beside_decodes must be >= 0, got "
                             f"{self.prompts_beside_decodes}")
