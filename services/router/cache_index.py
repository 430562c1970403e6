"""The router's index of which worker holds which prefix-cache pages.

Soft state built from the workers' cache events (`cache_feed.py` keeps one stream per
worker): a snapshot replaces what was known of a worker, change batches add and remove keys,
a new epoch (the worker restarted) or a gap in the batch numbers drops the worker's entries
until the next snapshot, and a worker that left discovery or whose stream broke is dropped at
once. Right after a request is placed, its prompt's keys are recorded for the chosen worker
for `speculative_s` (a burst with one prefix lands together before the events arrive).

The index holds at most `max_pages` (worker, page) entries: past that, the workers holding
the most lose their least recently used pages (by what their events stored and this router
placed on them) a little below the cap, so a large pool with deep caches costs the router a
bounded ~110 bytes a page, and what goes first is what placement would weigh last.

The index is never trusted for correctness: the worker looks up its own cache at Reserve, so
a stale entry costs only a worse placement.
"""

from __future__ import annotations

import itertools
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


GUESSED_PURGE_AT = 100_000  # first keys of speculative entries kept before expired ones go
MAX_PAGES = 4_000_000  # (worker, page) entries held by default: ~0.45 GB of router memory
TRIM_BY = 5_000  # past the cap, entries evicted at once (at most 5% of it): ~5 ms held


class CacheIndex:
    def __init__(self, *, speculative_s: float = 2.0, max_pages: int = MAX_PAGES,
                 clock: Callable[[], float] = time.monotonic):
        if max_pages <= 0:
            raise ValueError(f"max_pages={max_pages}: must be > 0")
        self.speculative_s = speculative_s  # how long a placement counts as held from now on
        self.max_pages = max_pages
        self.evicted = 0  # (worker, page) entries dropped to stay under max_pages
        self._clock = clock
        self._lock = threading.Lock()
        # worker -> keys it announced, least recently stored or placed on first
        self._keys: dict[str, dict[int, None]] = {}
        self._total = 0  # sum of len(self._keys[w])
        self._epoch: dict[str, tuple[int, int]] = {}    # worker -> (epoch, last sequence)
        self._seen: dict[str, float] = {}               # worker -> clock of its last batch
        self._guess: dict[str, tuple[float, set[int]]] = {}  # worker -> (until, keys)
        # The other way round, so placement need not ask every worker of a large pool:
        # key -> the worker that announced it, or the workers when more than one did (a set
        # per key would more than double what a key costs; most keys have one holder)
        self._holders: dict[int, str | set[str]] = {}
        self._guessed: dict[int, dict[str, float]] = {}  # key -> {worker: until}

    # ---- events ---------------------------------------------------------------------------
    def apply(self, worker: str, epoch: int, sequence: int, snapshot: bool,
              stored: Iterable[int], removed: Iterable[int], since: int | None = None) -> bool:
        """One batch from `worker`'s stream (or, with `since`, the changes after batch `since`
        read through Stats); False when it cannot be applied (a gap, or a change batch for an
        epoch without its snapshot): the worker's entries are dropped and the caller
        resubscribes for a snapshot."""
        with self._lock:
            self._seen[worker] = self._clock()
            if snapshot:
                old = self._keys.get(worker, {})
                self._unhold_locked(worker, old)
                self._keys[worker] = keys = dict.fromkeys(stored)
                self._total += len(keys) - len(old)
                self._hold_locked(worker, keys)
                self._epoch[worker] = (epoch, sequence)
                self._trim_locked()
                return True
            known = self._epoch.get(worker)
            if since is None:  # a stream's next batch
                follows = known is not None and sequence == known[1] + 1
            else:  # what came after the batch it saw last
                follows = known is not None and since == known[1] <= sequence
            if known is None or known[0] != epoch or not follows:
                self._drop_locked(worker)
                return False
            keys = self._keys[worker]
            before = len(keys)
            stored, removed = set(stored), set(removed)
            for key in stored:  # a page stored again counts as new: to the recent end
                keys.pop(key, None)
                keys[key] = None
            for key in removed:
                keys.pop(key, None)
            self._total += len(keys) - before
            self._hold_locked(worker, stored - removed)
            self._unhold_locked(worker, removed)
            self._epoch[worker] = (epoch, sequence)
            self._trim_locked()
            return True

    def drop(self, worker: str) -> None:
        """Forget a worker (it left, its stream broke, or it restarted)."""
        with self._lock:
            self._drop_locked(worker)

    def _hold_locked(self, worker: str, keys: Iterable[int]) -> None:
        all_holders = self._holders
        for key in keys:
            holders = all_holders.setdefault(key, worker)
            if holders == worker:
                continue
            if isinstance(holders, str):
                all_holders[key] = {holders, worker}
            else:
                holders.add(worker)

    def _unhold_locked(self, worker: str, keys: Iterable[int]) -> None:
        all_holders = self._holders
        for key in keys:
            holders = all_holders.get(key)
            if holders is None:
                continue
            if isinstance(holders, str):
                if holders == worker:
                    del all_holders[key]
                continue
            holders.discard(worker)
            if len(holders) == 1:
                all_holders[key] = next(iter(holders))
            elif not holders:
                del all_holders[key]

    def _drop_locked(self, worker: str) -> None:
        keys = self._keys.pop(worker, {})
        self._unhold_locked(worker, keys)
        self._total -= len(keys)
        self._epoch.pop(worker, None)
        self._guess.pop(worker, None)

    def _trim_locked(self) -> None:
        """Past max_pages, take the least recently used pages of the workers holding the most
        (levelling them down) until TRIM_BY (or 5%) below the cap: placement waits on the lock
        meanwhile, so each pass is short."""
        if self._total <= self.max_pages:
            return
        excess = self._total - self.max_pages + min(TRIM_BY, self.max_pages // 20)
        sizes = sorted(((len(keys), w) for w, keys in self._keys.items()), reverse=True)
        # the level L that the k largest come down to: sum(size - L) over them >= excess
        top, k = 0, 0
        for k, (size, _) in enumerate(sizes, 1):
            top += size
            below = sizes[k][0] if k < len(sizes) else 0
            if top - k * below >= excess:
                break
        level = max(0, (top - excess) // k)
        for size, worker in sizes[:k]:
            keys = self._keys[worker]
            gone = list(itertools.islice(keys, max(0, size - level)))
            for key in gone:
                del keys[key]
            self._unhold_locked(worker, gone)
            self._total -= len(gone)
            self.evicted += len(gone)

    def speculate(self, worker: str, keys: Sequence[int]) -> None:
        """`worker` was just given a prompt with these page keys: count them as held there
        for a short while, until its own events say so; those it holds already are now its
        most recently used (the worker's own cache touches them too)."""
        if not keys:
            return
        with self._lock:
            known = self._keys.get(worker)
            if known:
                for key in keys:
                    if key not in known:
                        break
                    del known[key]
                    known[key] = None
            until = self._clock() + self.speculative_s
            old = self._guess.get(worker)
            held = old[1] if old and old[0] > self._clock() else set()
            held.update(keys)
            self._guess[worker] = (until, held)
            self._guessed.setdefault(keys[0], {})[worker] = until
            if len(self._guessed) > GUESSED_PURGE_AT:  # keys no prompt asked for again
                now = self._clock()
                self._guessed = {k: live for k, ws in self._guessed.items()
                                 if (live := {w: t for w, t in ws.items() if t > now})}

    # ---- queries --------------------------------------------------------------------------
    def cached_pages(self, worker: str, keys: Sequence[int]) -> int:
        """How many leading pages of a prompt (its page keys, in order) `worker` holds."""
        with self._lock:
            return self._match_locked(worker, keys)

    def match(self, workers: Iterable[str], keys: Sequence[int]) -> dict[str, int]:
        with self._lock:
            return {w: self._match_locked(w, keys) for w in workers}

    def _match_locked(self, worker: str, keys: Sequence[int]) -> int:
        held = self._keys.get(worker, {})
        guess = self._guess.get(worker)
        extra = guess[1] if guess and guess[0] > self._clock() else set()
        n = 0
        for key in keys:
            if key not in held and key not in extra:
                break
            n += 1
        return n

    def holders(self, key: int) -> set[str]:
        """The workers that hold the page of `key` (announced, or given a prompt starting
        with it lately): with a prompt's first key, every worker whose cached_pages > 0."""
        with self._lock:
            holders = self._holders.get(key, ())
            found = {holders} if isinstance(holders, str) else set(holders)
            guessed = self._guessed.get(key)
            if guessed:
                now = self._clock()
                found.update(w for w, until in guessed.items() if until > now)
            return found

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

    def total(self) -> int:
        """(worker, page) entries held, at most max_pages."""
        with self._lock:
            return self._total

    def sizes(self) -> dict[str, int]:
        """Keys held per worker (what its last events said)."""
        with self._lock:
            return {w: len(keys) for w, keys in self._keys.items()}
