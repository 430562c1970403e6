"""Per-request latency arithmetic at the router (pure; times are `time.monotonic()` seconds).

- TTFT: request received -> first token sent to the client.
- queue_ms: request received -> prefill started computing = the router's own time before the
  Prefill call (validation, tokenization, Reserve, failed attempts) + the prefill worker's
  reported queue time.
- TPOT: (last token sent - first token sent) / (completion tokens - 1), per token.
- ITL: the gaps between consecutive deltas the client receives (one delta per decode message;
  several tokens in one message count as one arrival), mean and max.
"""

from __future__ import annotations

from dataclasses import dataclass


def ms(seconds: float) -> float:
    """Seconds -> milliseconds."""
    return seconds * 1000.0


def queue_ms(received: float, prefill_sent: float, worker_queue_ms: float) -> float:
    """Request received -> prefill compute started."""
    return ms(prefill_sent - received) + max(0.0, worker_queue_ms)


@dataclass
class TokenClock:
    """When each delta with tokens went to the client."""

    received: float
    first_at: float | None = None
    last_at: float | None = None
    tokens: int = 0
    gaps: int = 0
    gap_sum_s: float = 0.0
    gap_max_s: float = 0.0

    def sent(self, num_tokens: int, now: float) -> float | None:
        """Record a delta carrying `num_tokens` tokens sent at `now`; returns its gap to the
        previous delta (an ITL sample, seconds), None for the first or an empty delta."""
        if num_tokens <= 0:
            return None
        gap: float | None = None
        if self.first_at is None:
            self.first_at = now
        elif self.last_at is not None:
            gap = now - self.last_at
            self.gaps += 1
            self.gap_sum_s += gap
            self.gap_max_s = max(self.gap_max_s, gap)
        self.last_at = now
        self.tokens += num_tokens
        return gap

    @property
    def ttft_ms(self) -> float:
        return 0.0 if self.first_at is None else ms(self.first_at - self.received)

    @property
    def tpot_ms(self) -> float:
        if self.tokens < 2 or self.first_at is None or self.last_at is None:
            return 0.0
        return ms(self.last_at - self.first_at) / (self.tokens - 1)

    @property
    def itl_mean_ms(self) -> float:
        return ms(self.gap_sum_s / self.gaps) if self.gaps else 0.0

    @property
    def itl_max_ms(self) -> float:
        return ms(self.gap_max_s)

    def e2e_ms(self, now: float) -> float:
        """Request received -> `now`."""
        return ms(now - self.received)
