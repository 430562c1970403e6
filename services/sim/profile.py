"""What a simulated worker's times are made of: linear models a real run can calibrate.

    prefill_ms(n)      = prefill_base_ms + prefill_ms_per_token * n      (one prompt at a time)
    decode_step_ms(b)  = decode_base_ms + decode_ms_per_seq * b          (b sequences per step)
    handoff_ms(bytes)  = handoff_base_ms + bytes / (handoff_gb_s * 1e9) * 1e3

The defaults are the bench-7m model's on a 2-vCPU AMD EPYC (Zen 5) with both cores: ~60 ms
for a 960-token prompt, ~4 ms for a decode step of a few sequences, the same-host handoff.
A profile file is JSON with any of the fields below; the others keep their defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SimProfile:
    prefill_base_ms: float = 2.0
    prefill_ms_per_token: float = 0.06
    decode_base_ms: float = 3.0
    decode_ms_per_seq: float = 0.1
    handoff_base_ms: float = 0.5
    handoff_gb_s: float = 3.0
    kv_bytes_per_token: int = 2048  # bench-7m: 4 layers x (K, V) x 2 KV heads x 32 x fp32
    block_size: int = 16
    num_pages: int = 4096
    max_model_len: int = 4096

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"profile field {f.name}={value!r}: expected a number >= 0")
        for name in ("handoff_gb_s", "block_size", "num_pages", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile field {name}={getattr(self, name)!r}: expected > 0")

    def prefill_ms(self, num_tokens: int) -> float:
        return self.prefill_base_ms + self.prefill_ms_per_token * num_tokens

    def decode_step_ms(self, batch: int) -> float:
        return self.decode_base_ms + self.decode_ms_per_seq * batch

    def handoff_ms(self, num_bytes: int) -> float:
        return self.handoff_base_ms + num_bytes / (self.handoff_gb_s * 1e9) * 1e3

    def pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @classmethod
    def load(cls, path: str | Path) -> SimProfile:
        """A profile from a JSON file of field values; unknown fields are refused by name."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"profile {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"profile {path}: expected a JSON object of field values")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"profile {path}: unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        return cls(**data)
