"""Which workers one request weighs: in a large pool, a sample, so placement costs the same
with ten workers or a thousand.

Weighing every worker costs the router time per request in proportion to the pool (building
each worker's load, asking the cache index about each). In a pool larger than the sample
size k, a request weighs k workers drawn at random plus those the cache index says hold its
prompt's first page (at most k of them): two or more random choices already balance load
nearly as well as all of them (the "power of d choices"), the holders keep locality, and
every worker is drawn in turn, so all are used. A pool no larger than k is weighed whole,
exactly as before.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

_RNG = random.Random()


class Members(Protocol):
    def healthy(self, role: str) -> list[str]: ...


class Holders(Protocol):
    def holders(self, prompt_ids: Sequence[int]) -> set[str]: ...


def candidates(pool: Members, role: str, k: int, cache: Holders | None,
               prompt_ids: Sequence[int], rng: random.Random = _RNG) -> list[str] | None:
    """The addresses of `role` to weigh; None: every worker (k <= 0, or a pool of at most
    k healthy workers). `cache`: who holds the prompt's first page (any role: the caller
    skips the other role's)."""
    healthy = pool.healthy(role) if k > 0 else []
    if len(healthy) <= k:
        return None
    picks = set(rng.sample(healthy, k))
    if cache is not None:
        held = list(cache.holders(prompt_ids))
        picks.update(held if len(held) <= k else rng.sample(held, k))
    return list(picks)
