"""Per-request state inside an engine."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Protocol

import torch
from pdserve.engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"      # has tokens whose KV is not in pages yet (new, or preempted)
    RUNNING = "running"      # in the decode batch
    PREFILLED = "prefilled"  # prefill role: prompt KV in pages, first token out, before handoff
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    num_cached: int = 0          # tokens whose K/V are written into pages
    status: Status = Status.WAITING
    finish_reason: str | None = None
    prefill_started_at: float | None = None  # perf_counter when its first prompt chunk ran
    page_keys: list[int] = dataclasses.field(default_factory=list)  # prefix-cache keys so far
    num_keyed: int = 0           # leading pages already offered to the prefix cache
    num_prefix_hit: int = 0      # prompt tokens found in the prefix cache at admission
    queued_at: float = dataclasses.field(default_factory=time.perf_counter)  # when it came

    @property
    def num_uncomputed(self) -> int:
        """Tokens whose K/V are still to be computed (the rest of the prompt, when waiting)."""
        return len(self.token_ids) - self.num_cached

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclasses.dataclass
class StepOutput:
    """What one step did for one sequence: a new token and/or its end. Prefill role: also
    after each chunk that does not end the prompt, with no token and `page_ids` the pages
    whose KV is complete so far (they can ship while the next chunk runs)."""

    seq_id: str
    token: int | None
    finish_reason: str | None = None   # "stop", "length" or "abort" when the sequence ended
    page_ids: list[int] | None = None  # prefill role: the pages holding the prompt's KV
    compute_ms: float = 0.0
    prefill_ms: float = 0.0            # on a prefill's output: first chunk start -> token sampled
    done_at: float = 0.0               # prefill role: perf_counter when the step ended (KV ready)
    cached_tokens: int = 0             # on a prefill's output: prompt tokens the cache supplied
    planned: bool = False              # prefill role: page_ids are the prompt's, its last chunk
    #                                    computing (PrefillWorker.planned)

    @property
    def progress(self) -> bool:
        """A prefill chunk's pages, not a token."""
        return self.token is None and self.finish_reason is None


class HandoffHooks(Protocol):
    """Prefill role: the engine's thread tells whoever ships a sequence's KV (PrefillWorker)
    what a step does for it, inside the step (under the engine lock). Must not raise."""

    def planned(self, seq_id: str, pages: list[int]) -> None:
        """Before the forward of the chunk that ends the prompt: all its pages."""

    def prefilled(self, seq_id: str, pages: list[int]) -> None:
        """That chunk's KV is in pages and its first token sampled (the sequence goes on to
        decode), before the step's outputs go out."""
