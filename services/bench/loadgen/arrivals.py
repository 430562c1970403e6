"""When requests are sent: a fixed number in flight (closed loop), or an open loop at a rate
with Poisson or gamma (bursty) inter-arrival times, seeded."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Arrivals:
    concurrency: int | None = None  # closed loop
    rate: float | None = None       # open loop, requests per second
    burstiness: float = 1.0         # gamma shape: 1 = Poisson, < 1 burstier, > 1 smoother

    @classmethod
    def parse(cls, concurrency: int | None, rate: float | None, burstiness: float) -> Arrivals:
        if (concurrency is None) == (rate is None):
            raise ValueError("give exactly one of --concurrency N or --rate R")
        if concurrency is not None and concurrency <= 0:
            raise ValueError(f"--concurrency={concurrency}: must be > 0")
        if rate is not None and rate <= 0:
            raise ValueError(f"--rate={rate}: must be > 0 (requests per second)")
        if burstiness <= 0:
            raise ValueError(f"--burstiness={burstiness}: must be > 0")
        return cls(concurrency, rate, burstiness)

    def gaps_s(self, count: int, seed: int) -> list[float]:
        """Inter-arrival gaps of an open loop (mean 1/rate); gamma with shape `burstiness`."""
        assert self.rate is not None
        rng = random.Random(seed)
        theta = 1.0 / (self.rate * self.burstiness)
        return [rng.gammavariate(self.burstiness, theta) for _ in range(count)]

    def __str__(self) -> str:
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        kind = "poisson" if self.burstiness == 1.0 else f"gamma(shape {self.burstiness:g})"
        return f"{self.rate:g} req/s {kind}"
