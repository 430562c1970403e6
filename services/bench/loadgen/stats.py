"""Per-request records and what a run adds up to: percentiles, throughput, goodput under SLOs,
and SLO attainment over a sweep of rates (DistServe's definition of the highest rate with at
least 90% attainment, interpolated between the measured rates). Pure arithmetic."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass
class RequestRecord:
    """One request as the client saw it (times in ms from its send)."""

    index: int
    prompt_tokens: int
    max_tokens: int = 0  # asked for (EOS ignored, so a full answer has exactly this many)
    output_tokens: int = 0
    ok: bool = False
    error: str = ""
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)  # gaps between chunks that carried tokens
    components: dict[str, float] = field(default_factory=dict)  # server-reported TTFT parts
    sent_at_s: float = 0.0  # since the run started
    turn: int = 0  # multi-turn workloads: the turn's index in its conversation
    cached_tokens: int | None = None  # prompt tokens the server said its cache held
    output_ids: list[int] = field(default_factory=list, repr=False)  # when the server says
    reusable_tokens: int = 0  # multi-turn: what a perfect cache could skip (full pages shared)
    workers: str = ""  # pdserve: "prefill worker -> decode worker" that served it

    @property
    def tpot_ms(self) -> float | None:
        """(last token - first token) / (output tokens - 1); None with fewer than 2 tokens."""
        if self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Slo:
    """Latency objectives in ms; None = not constrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    @classmethod
    def parse(cls, text: str) -> Slo:
        """`ttft:200,tpot:50[,e2e:5000]` (ms)."""
        values: dict[str, float] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, number = part.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2e"):
                raise ValueError(f"--slo: {part!r} is not ttft:MS, tpot:MS or e2e:MS")
            try:
                values[f"{name}_ms"] = float(number)
            except ValueError:
                raise ValueError(f"--slo: {part!r}: {number!r} is not a number of ms") from None
            if values[f"{name}_ms"] <= 0:
                raise ValueError(f"--slo: {part!r}: must be > 0")
        if not values:
            raise ValueError("--slo needs at least one of ttft:MS, tpot:MS, e2e:MS")
        return cls(**values)

    def met(self, r: RequestRecord) -> bool:
        """A completed request within every given objective (one with a single output token
        has no TPOT, so only its TTFT and E2E count)."""
        if not r.ok or r.ttft_ms is None or r.e2e_ms is None:
            return False
        if self.ttft_ms is not None and r.ttft_ms > self.ttft_ms:
            return False
        if self.e2e_ms is not None and r.e2e_ms > self.e2e_ms:
            return False
        tpot = r.tpot_ms
        return self.tpot_ms is None or tpot is None or tpot <= self.tpot_ms

    def __str__(self) -> str:
        parts = [f"{n}:{v:g}" for n, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms),
                                           ("e2e", self.e2e_ms)) if v is not None]
        return ",".join(parts)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def distribution(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None}


def summarize(records: Sequence[RequestRecord], duration_s: float,
              slo: Slo | None = None) -> dict[str, object]:
    """Totals, rates and latency distributions of one run (failed requests count only as
    failures); goodput and attainment when an SLO is given."""
    ok = [r for r in records if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    summary: dict[str, object] = {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "duration_s": duration_s,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "output_tokens": out_tokens,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else 0.0,
        "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot_ms) is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl_ms]),
        "e2e_ms": distribution([r.e2e_ms for r in ok if r.e2e_ms is not None]),
    }
    reported = [r for r in ok if r.cached_tokens is not None]
    if reported:
        prompt_tokens = sum(r.prompt_tokens for r in reported)
        summary["cached_tokens"] = sum(r.cached_tokens or 0 for r in reported)
        summary["cache_hit_rate"] = summary["cached_tokens"] / prompt_tokens  # type: ignore[operator]
        reusable = sum(r.reusable_tokens for r in reported)
        if reusable:
            summary["cache_vs_perfect"] = summary["cached_tokens"] / reusable  # type: ignore[operator]
    served: dict[str, int] = {}
    for r in ok:
        for worker in set(filter(None, r.workers.split(" -> "))):
            served[worker] = served.get(worker, 0) + 1
    if served:
        summary["requests_per_worker"] = served
    turns = sorted({r.turn for r in ok})
    if len(turns) > 1:
        summary["ttft_by_turn_ms"] = {t: distribution([r.ttft_ms for r in ok if r.turn == t
                                                       and r.ttft_ms is not None])
                                      for t in turns}
    names = sorted({k for r in ok for k in r.components})
    if names:
        summary["components_ms"] = {k: distribution([r.components[k] for r in ok
                                                     if k in r.components]) for k in names}
    if slo is not None:
        good = sum(1 for r in records if slo.met(r))
        summary["slo"] = str(slo)
        summary["attainment"] = good / len(records) if records else 0.0
        summary["goodput"] = good / duration_s if duration_s > 0 else 0.0
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            kind = r.error.split(":")[0] or "error"
            errors[kind] = errors.get(kind, 0) + 1
    if errors:
        summary["errors"] = errors
    return summary


def max_rate_at(rates: Sequence[float], attainments: Sequence[float],
                target: float = 0.9) -> float | None:
    """The highest request rate whose SLO attainment is still >= `target`, interpolated
    linearly where attainment crosses it between two measured rates (DistServe). None when
    even the lowest rate misses it; the highest rate when none does."""
    points = sorted(zip(rates, attainments))
    if not points or points[0][1] < target:
        return None
    best = points[0][0]
    for (r0, a0), (r1, a1) in zip(points, points[1:]):
        if a1 >= target:
            best = r1
            continue
        if a0 >= target > a1:  # crossing between r0 and r1
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
        break
    return best
