"""The router's index of which worker holds which prefix-cache pages.

Soft state built from the workers' cache events (`cache_feed.py` keeps one stream per
worker): a snapshot replaces what was known of a worker, change batches add and remove keys,
a new epoch (the worker restarted) or a gap in the batch numbers drops the worker's entries
until the next snapshot, and a worker that left discovery or whose stream broke is dropped at
once. Right after a request is placed, its prompt's keys are recorded for the chosen worker
for `speculative_s` (a burst with one prefix lands together before the events arrive).

The index is never trusted for correctness: the worker looks up its own cache at Reserve, so
a stale entry costs only a worse placement.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Snapshot:
    """What the index knows of one worker (for /debug and tests)."""

    epoch: int
    sequence: int
    num_keys: int
    fresh_s: float  # seconds since its last batch


class CacheIndex:
    def __init__(self, *, speculative_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic):
        self._speculative_s = speculative_s
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: dict[str, set[int]] = {}            # worker -> keys it announced
        self._epoch: dict[str, tuple[int, int]] = {}    # worker -> (epoch, last sequence)
        self._seen: dict[str, float] = {}               # worker -> clock of its last batch
        self._guess: dict[str, tuple[float, set[int]]] = {}  # worker -> (until, keys)

    # ---- events ---------------------------------------------------------------------------
    def apply(self, worker: str, epoch: int, sequence: int, snapshot: bool,
              stored: Iterable[int], removed: Iterable[int]) -> bool:
        """One batch from `worker`'s stream; False when it cannot be applied (a gap, or a
        change batch for an epoch without its snapshot): the worker's entries are dropped
        and the caller resubscribes for a snapshot."""
        with self._lock:
            self._seen[worker] = self._clock()
            if snapshot:
                self._keys[worker] = set(stored)
                self._epoch[worker] = (epoch, sequence)
                return True
            known = self._epoch.get(worker)
            if known is None or known[0] != epoch or sequence != known[1] + 1:
                self._drop_locked(worker)
                return False
            keys = self._keys[worker]
            keys.update(stored)
            keys.difference_update(removed)
            self._epoch[worker] = (epoch, sequence)
            return True

    def drop(self, worker: str) -> None:
        """Forget a worker (it left, its stream broke, or it restarted)."""
        with self._lock:
            self._drop_locked(worker)

    def _drop_locked(self, worker: str) -> None:
        self._keys.pop(worker, None)
        self._epoch.pop(worker, None)
        self._guess.pop(worker, None)

    def speculate(self, worker: str, keys: Sequence[int]) -> None:
        """`worker` was just given a prompt with these page keys: count them as held there
        for a short while, until its own events say so."""
        if not keys:
            return
        with self._lock:
            until = self._clock() + self._speculative_s
            old = self._guess.get(worker)
            held = old[1] if old and old[0] > self._clock() else set()
            held.update(keys)
            self._guess[worker] = (until, held)

    # ---- queries --------------------------------------------------------------------------
    def cached_pages(self, worker: str, keys: Sequence[int]) -> int:
        """How many leading pages of a prompt (its page keys, in order) `worker` holds."""
        with self._lock:
            return self._match_locked(worker, keys)

    def match(self, workers: Iterable[str], keys: Sequence[int]) -> dict[str, int]:
        with self._lock:
            return {w: self._match_locked(w, keys) for w in workers}

    def _match_locked(self, worker: str, keys: Sequence[int]) -> int:
        held = self._keys.get(worker, set())
        guess = self._guess.get(worker)
        extra = guess[1] if guess and guess[0] > self._clock() else set()
        n = 0
        for key in keys:
            if key not in held and key not in extra:
                break
            n += 1
        return n

    def known(self, worker: str) -> Snapshot | None:
        with self._lock:
            if worker not in self._epoch:
                return None
            epoch, seq = self._epoch[worker]
            return Snapshot(epoch, seq, len(self._keys.get(worker, ())),
                            self._clock() - self._seen.get(worker, self._clock()))

    def workers(self) -> list[str]:
        with self._lock:
            return list(self._keys)

    def sizes(self) -> dict[str, int]:
        """Keys held per worker (what its last events said)."""
        with self._lock:
            return {w: len(keys) for w, keys in self._keys.items()}
