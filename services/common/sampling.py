"""How one request picks its tokens, validated once for every layer (router, workers, engine).

Standard library only: the router (which never imports torch) validates a client's request
by building one, the workers rebuild it from the wire, and the engine samples with it.
A bad value raises `ValueError` naming the field and the value.
"""

from __future__ import annotations

import dataclasses
import math

DEFAULT_MAX_TOKENS = 128
MAX_SEED = 2**64


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 is greedy; top_k 0 is off."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise SamplingError("max_tokens", self.max_tokens, "must be > 0")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SamplingError("temperature", self.temperature, "must be >= 0 (0 = greedy)")
        if not (0.0 < self.top_p <= 1.0):
            raise SamplingError("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise SamplingError("top_k", self.top_k, "must be >= 0 (0 = off)")
        if self.seed is not None and not (0 <= self.seed < MAX_SEED):
            raise SamplingError("seed", self.seed, "must be in [0, 2**64)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class SamplingError(ValueError):
    """A sampling field out of range; the message starts with `field=value`."""

    def __init__(self, field: str, value: object, rule: str):
        super().__init__(f"{field}={value!r}: {rule}")
        self.field = field
