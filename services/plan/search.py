"""Goodput of a deployment: the highest request rate at which enough requests meet both SLOs.

A rate is *good* when at least `attainment` of the workload's requests (failed ones count as
misses) have TTFT <= `ttft_ms` and TPOT <= `tpot_ms` (a request of one output token has no
TPOT), and so do the later half of them alone (a deployment that falls behind, its queues
growing, would miss more the longer it ran). A run has `num_requests` per worker, so every
worker sees as many whatever the deployment's size.

The search doubles (or halves) the rate from a start until it brackets the crossing, then
bisects; every rate replays the same requests (`Workload.requests`), so attainment falls
smoothly as the rate grows. Runs that cannot reach the target any more stop early.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field

from pdserve.plan.cluster import Deployment, EarlyStop, Outcome, Profiles, Stop, simulate
from pdserve.plan.workload import Workload
from pdserve.sim.profile import SimProfile


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    attainment: float = 0.9

    def __post_init__(self) -> None:
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"{name}={value!r}: expected > 0 ms (or none)")
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment={self.attainment!r}: expected 0 < share <= 1")

    def met(self, outcome: Outcome) -> bool:
        if not outcome.ok or outcome.ttft_ms is None:
            return False
        if self.ttft_ms is not None and outcome.ttft_ms > self.ttft_ms:
            return False
        tpot = outcome.tpot_ms
        return self.tpot_ms is None or tpot is None or tpot <= self.tpot_ms

    def describe(self) -> str:
        parts = [f"{name} <= {value:g} ms" for name, value in
                 (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)) if value is not None]
        return f"{' and '.join(parts) or 'no latency objective'} for >= " \
               f"{self.attainment:.0%} of requests"


@dataclass(frozen=True)
class Point:
    """A deployment's predicted behaviour at one rate (complete: the run was not cut short)."""

    rate: float
    attainment: float
    complete: bool = True
    late_attainment: float | None = None  # of the later half of the requests (by arrival)
    ttft_p50_ms: float | None = None
    ttft_p99_ms: float | None = None
    tpot_p50_ms: float | None = None
    tpot_p99_ms: float | None = None
    failed: int = 0

    def as_dict(self) -> dict[str, object]:
        return asdict(self)

    def good(self, slo: Slo) -> bool:
        """The target is met by all requests and by the later half alone: a rate the
        deployment cannot keep up with fails the later half first, its queue still growing
        when the run ends."""
        return self.attainment >= slo.attainment and \
            (self.late_attainment is None or self.late_attainment >= slo.attainment)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear between closest ranks (as `pdserve bench serve` computes them)."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summarize(rate: float, outcomes: Sequence[Outcome], slo: Slo) -> Point:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft_ms for o in ok if o.ttft_ms is not None]
    tpot = [t for o in ok if (t := o.tpot_ms) is not None]
    met = [slo.met(o) for o in outcomes]
    late = met[len(met) // 2:]
    return Point(rate, sum(met) / len(met) if met else 0.0, True,
                 sum(late) / len(late) if late else 0.0, percentile(ttft, 50),
                 percentile(ttft, 99), percentile(tpot, 50), percentile(tpot, 99),
                 len(outcomes) - len(ok))


def predict(dep: Deployment, workload: Workload, profile: SimProfile | Profiles,
            rate: float, slo: Slo | None = None, count: int | None = None) -> Point:
    """The whole run at `rate`: attainment against `slo` (none: every completed request
    counts) and the TTFT / TPOT percentiles, of `num_requests` per worker or `count` in all
    (what a `pdserve bench serve --num-requests` run would send)."""
    outcomes = simulate(dep, workload.requests(rate, dep.workers, count), profile)
    return summarize(rate, outcomes, slo or Slo(attainment=1.0))


def attempt(dep: Deployment, workload: Workload, profile: SimProfile | Profiles,
            rate: float, slo: Slo) -> Point:
    """Like `predict`, but a run stops as soon as the target is out of reach (then
    `complete` is False and `attainment` an upper bound below the target)."""
    requests = workload.requests(rate, dep.workers)
    allowed = int(math.floor(len(requests) * (1 - slo.attainment) + 1e-9))
    try:
        outcomes = simulate(dep, requests, profile, EarlyStop(slo.ttft_ms, slo.tpot_ms, allowed))
    except Stop:
        return Point(rate, (len(requests) - allowed - 1) / len(requests), False, None)
    return summarize(rate, outcomes, slo)


@dataclass
class Goodput:
    deployment: Deployment
    rate: float                 # req/s; 0.0 when even the lowest rate tried misses the target
    points: list[Point] = field(default_factory=list)  # every rate tried, in order tried


def find_goodput(dep: Deployment, workload: Workload, profile: SimProfile | Profiles,
                 slo: Slo, *, start: float = 1.0, step: float = 2.0, lowest: float = 1e-3,
                 highest: float = 1e6, rel_tol: float = 0.01) -> Goodput:
    """The highest good rate, to `rel_tol` of itself (see the module's docstring): from
    `start`, up or down by factors of `step` until it is bracketed (a `start` near the answer
    wants a small step), then bisected."""
    tried: list[Point] = []

    def good(rate: float) -> bool:
        point = attempt(dep, workload, profile, rate, slo)
        tried.append(point)
        return point.good(slo)

    rate = start
    if good(rate):
        low, high = rate, math.inf
        while high == math.inf and low < highest:
            if good(low * step):
                low *= step
            else:
                high = low * step
        if high == math.inf:
            return Goodput(dep, low, tried)
    else:
        low, high = 0.0, rate
        while low == 0.0 and high > lowest:
            if good(high / step):
                low = high / step
            else:
                high /= step
        if low == 0.0:
            return Goodput(dep, 0.0, tried)
    while high - low > rel_tol * low:
        middle = (low + high) / 2
        if good(middle):
            low = middle
        else:
            high = middle
    return Goodput(dep, low, tried)


def deployments(max_workers: int, modes: Iterable[str], chunk_sizes: Iterable[int],
                tps: Iterable[int], **common: int) -> list[Deployment]:
    """Every co-located (1..max_workers workers) and disaggregated (P + D <= max_workers)
    configuration for each chunk size and TP degree."""
    out: list[Deployment] = []
    modes = list(modes)
    for tp in tps:
        for chunk in chunk_sizes:
            if "colocated" in modes:
                out += [Deployment("colocated", 0, n, chunk, tp, **common)
                        for n in range(1, max_workers + 1)]
            if "disaggregated" in modes:
                out += [Deployment("disaggregated", p, d, chunk, tp, **common)
                        for p in range(1, max_workers) for d in range(1, max_workers - p + 1)]
    return out


def plan(configs: Sequence[Deployment], workload: Workload, profile: SimProfile | Profiles,
         slo: Slo, progress: Callable[[int, Goodput], None] | None = None) -> list[Goodput]:
    """Each configuration's goodput, in the order given. The search of each starts from the
    previous one's goodput per worker times its workers (where it usually ends)."""
    results: list[Goodput] = []
    previous: Goodput | None = None
    for i, dep in enumerate(configs):
        start = previous.rate * dep.workers / previous.deployment.workers if previous else 1.0
        result = find_goodput(dep, workload, profile, slo, start=start,
                              step=1.25 if previous else 2.0)
        if result.rate > 0:
            previous = result
        results.append(result)
        if progress is not None:
            progress(i, result)
    return results
