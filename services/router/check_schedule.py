"""How often each worker's health and Stats are read: every member each `interval_s` in a
pool small enough, a rolling slice of a large one.

Reading every member at once each second costs the router two calls per worker per second:
with a thousand workers, 2,000 calls a second and half a core (measured: 200 workers read a
second cost 0.2 of a core). Above `CHECKS_PER_S * interval_s` members the checker runs every
`TICK_S` and reads the next slice of the members in turn (`CHECKS_PER_S * TICK_S` of them), so
each is read every `members / CHECKS_PER_S` seconds (10 s with 1,000 workers) and the calls
are spread out instead of arriving in bursts: slices of 25 every 0.25 s left router-added p99
at 25-30 ms with 1,000 workers at 100 req/s, slices of 5 every 0.05 s at 20-25 (the router's
own CPU the same; docs/benchmarks.md, session 40).
Between reads the router keeps loads current itself (what it sends each worker), and a worker
that fails a call, or that just joined, is read in the next tick, not at its turn; so are the
`DOWN_PER_TICK` workers down the longest (a worker still starting joins within seconds, a
hundred dead ones cost at most that many reads a tick).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

CHECKS_PER_S = 100   # workers read per second at most, once the pool is large
TICK_S = 0.05        # how often a large pool's next slice is read (5 workers a tick)
DOWN_PER_TICK = 25   # unhealthy workers read again each tick besides (longest down first)

W = TypeVar("W")


@dataclass(frozen=True)
class Round:
    """One tick's work: the workers to read (None: every member) and the rotation's next
    start."""

    workers: list[W] | None  # type: ignore[valid-type]
    next_start: int


def plan_round(members: Sequence[W], start: int, interval_s: float, urgent: Sequence[W] = ()
               ) -> Round:
    """The members to read this tick: all of them in a small pool; else the slice of the
    rotation from `start` plus the `urgent` ones (suspected, new), each once."""
    if len(members) <= CHECKS_PER_S * interval_s:
        return Round(None, 0)
    size = math.ceil(CHECKS_PER_S * TICK_S)
    start %= len(members)
    picked = list(members[start:start + size])
    picked += members[:max(0, start + size - len(members))]
    seen = {id(w) for w in picked}
    picked += [w for w in urgent if id(w) not in seen]
    return Round(picked, (start + size) % len(members))


def tick_s(members: int, interval_s: float, all_healthy: bool, recheck_down_s: float) -> float:
    """The wait before the next tick: a large pool's TICK_S; in a small one, the interval, or
    `recheck_down_s` while some member is down (so it joins quickly)."""
    if members > CHECKS_PER_S * interval_s:
        return TICK_S
    return interval_s if all_healthy else min(interval_s, recheck_down_s)
