"""A worker's numbered log of prefix-cache changes, for routers that read them through Stats.

Routers in front of a pool too large for a CacheEvents stream per worker ask each worker's
Stats for the changes after the batch they saw last (their cursor). One log serves all of
them: batches numbered without gaps from 1, the newest `max_batches` kept. A cursor the log
still reaches gets those batches merged into one (a key stored and then removed is only
removed, and the other way round); any other cursor needs a snapshot, which takes a number of
its own so that what follows it comes after it. Real workers (pdserve.worker.cache_feed) and
simulated ones (pdserve.sim.cache) keep one each; neither locks it for the other.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence

MAX_BATCHES = 4096  # change batches kept: a reader further behind gets a snapshot


class ChangeLog:
    def __init__(self, max_batches: int = MAX_BATCHES):
        self._batches: deque[tuple[int, Sequence[int], Sequence[int]]] = \
            deque(maxlen=max_batches)
        self.sequence = 0  # the newest number handed out
        self._floor = 0  # every change after this number is in the log

    def append(self, stored: Sequence[int], removed: Sequence[int]) -> None:
        self.sequence += 1
        if len(self._batches) == self._batches.maxlen:
            self._floor = self._batches[0][0]  # dropped: older cursors need a snapshot
        self._batches.append((self.sequence, stored, removed))

    def reaches(self, since: int) -> bool:
        """Whether every change after cursor `since` is here (0: a first read, never)."""
        return 0 < since and self._floor <= since <= self.sequence

    def snapshot(self) -> int:
        """The number of a snapshot taken now (what is appended later comes after it)."""
        self.sequence += 1
        return self.sequence

    def merged(self, since: int) -> tuple[list[int], list[int]]:
        """(stored, removed): the changes after `since`, merged, in order of arrival."""
        newer = list(itertools.takewhile(lambda b: b[0] > since, reversed(self._batches)))
        stored: dict[int, None] = {}
        removed: dict[int, None] = {}
        for _, added, gone in reversed(newer):
            for key in added:
                stored[key] = None
                removed.pop(key, None)
            for key in gone:
                removed[key] = None
                stored.pop(key, None)
        return list(stored), list(removed)

    def clear(self) -> None:
        """Forget every batch: no cursor handed out so far is reached any more."""
        self._batches.clear()
        self.sequence += 1
        self._floor = self.sequence
