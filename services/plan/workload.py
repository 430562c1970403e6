"""The requests a plan simulates: the same shapes and arrival times `pdserve bench serve` sends.

Prompt and output lengths come from `pdserve bench serve --workload`'s spec and seed
(`fixed:IN,OUT`, `uniform:IN_LO-IN_HI,OUT_LO-OUT_HI`, `chat[:IN_MEDIAN,OUT_MEDIAN]`,
`mixed:SHORT,LONG,SHARE,OUT`), the arrival times from its open loop (`--rate R --burstiness B`,
seed + 1), so a plan's prediction and a bench run at the same rate see the same requests.
`constant` arrivals are evenly spaced instead.

Prefix reuse: a share of every prompt's tokens is found in the prefix cache of whichever worker
gets it, rounded down to whole pages and never the page of the last token (the engine always
computes that one). The cache is assumed warm: the first request of a prefix is not modelled
as a miss.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from pdserve.bench.loadgen.arrivals import Arrivals
from pdserve.bench.loadgen.workload import parse_workload, shapes

ARRIVALS_HELP = "poisson | constant | gamma:SHAPE (SHAPE < 1 burstier than Poisson)"


@dataclass(frozen=True)
class Request:
    index: int
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int  # prompt tokens the serving worker's prefix cache holds


def parse_arrivals(text: str) -> float:
    """The gamma shape of an arrival process: poisson 1, constant 0 (evenly spaced)."""
    kind, _, shape = text.partition(":")
    if kind == "poisson" and not shape:
        return 1.0
    if kind == "constant" and not shape:
        return 0.0
    if kind == "gamma":
        try:
            value = float(shape)
        except ValueError:
            value = -1.0
        if value > 0:
            return value
    raise ValueError(f"arrivals={text!r}: expected {ARRIVALS_HELP}")


@dataclass(frozen=True)
class Workload:
    spec: str = "fixed:256,128"
    arrivals: str = "poisson"
    prefix_share: float = 0.0
    num_requests: int = 1000
    seed: int = 0
    block_size: int = 16

    def __post_init__(self) -> None:
        parse_workload(self.spec)  # raises ValueError naming the spec
        parse_arrivals(self.arrivals)
        if not 0 <= self.prefix_share < 1:
            raise ValueError(f"prefix_share={self.prefix_share!r}: expected 0 <= share < 1")
        if self.num_requests <= 0 or self.block_size <= 0:
            raise ValueError(f"num_requests={self.num_requests!r}, block_size="
                             f"{self.block_size!r}: expected > 0")

    def cached_tokens(self, prompt_tokens: int) -> int:
        """Prompt tokens the cache holds: whole pages, never the last token's page."""
        share = int(self.prefix_share * prompt_tokens) // self.block_size
        return min(share, (prompt_tokens - 1) // self.block_size) * self.block_size

    def _base(self, count: int) -> list[tuple[int, int, float]]:
        """(prompt, output, gap at 1 req/s) of the first `count` requests. Lengths and gaps
        are drawn one request after another, so the first n are the same whatever the count;
        at rate R the gaps are these / R (gamma variates scale exactly: every rate replays
        the same arrivals, compressed)."""
        if len(self._cache) < count:
            shape = parse_arrivals(self.arrivals)
            gaps = [1.0] * count if shape == 0 else \
                Arrivals(rate=1.0, burstiness=shape).gaps_s(count, self.seed + 1)
            self._cache[:] = [(s.prompt_tokens, s.output_tokens, gap) for s, gap in
                              zip(shapes(self.spec, count, self.seed), gaps)]
        return self._cache[:count]

    @cached_property
    def _cache(self) -> list[tuple[int, int, float]]:
        return []

    def requests(self, rate: float, workers: int = 1, count: int | None = None
                 ) -> list[Request]:
        """`num_requests` per worker (or `count` in all) arriving at `rate` per second, the
        first after one gap (as `pdserve bench serve --rate` sends them)."""
        if not rate > 0:
            raise ValueError(f"rate={rate!r}: expected > 0 requests per second")
        out: list[Request] = []
        at_s = 0.0
        for i, (prompt, output, gap) in enumerate(self._base(count or
                                                             self.num_requests * workers)):
            at_s += gap / rate
            out.append(Request(i, at_s * 1e3, prompt, output, self.cached_tokens(prompt)))
        return out

    def describe(self) -> str:
        share = f", prefix reuse {self.prefix_share:.0%}" if self.prefix_share else ""
        return f"{self.spec}, {self.arrivals} arrivals{share}, {self.num_requests} requests " \
               f"per worker per rate, seed {self.seed}"
