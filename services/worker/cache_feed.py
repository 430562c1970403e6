"""A worker's prefix-cache events, fanned out to every subscribed router.

Each subscriber's stream starts with a snapshot (every key the cache holds) taken under the
engine lock at the moment it is registered, so no change falls between the snapshot and the
first change batch; then the changes the allocator recorded (stored, removed), gathered every
`period_s`, numbered per stream without gaps; an empty batch every `heartbeat_s` tells an
idle worker from a dead one. The allocator records only while someone subscribes, so a worker
without routers keeps nothing. `epoch` is new at every start: a router that sees another epoch
for the same worker drops what it had and takes the new snapshot.

Routers in front of a pool too large for a stream per worker read the same changes through
Stats instead (`poll`): the feed then keeps one numbered log of change batches
(pdserve.common.cache_log), shared by every such router, each asking for what came after the
batch it saw last. The log runs from the first such read and stops, keeping nothing, once no
router has read it for POLL_IDLE_S.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time
from collections.abc import Generator
from dataclasses import dataclass, field

from pdserve.common.cache_log import MAX_BATCHES, ChangeLog
from pdserve.engine.allocator import CacheEvents
from pdserve.engine.engine import Engine
from pdserve.engine.loop import EngineLoop

POLL_IDLE_S = 120.0  # no such read for this long: the log stops


@dataclass(frozen=True)
class CacheBatch:
    """One message of a subscriber's stream (the wire's CacheEventBatch, as plain types);
    read through Stats, the changes after batch `since`."""

    sequence: int
    snapshot: bool = False
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    since: int = 0


class CacheFeed:
    def __init__(self, loop: EngineLoop, *, period_s: float = 0.02,
                 log_batches: int = MAX_BATCHES):
        self._loop = loop
        self._period_s = period_s
        self._subs: dict[int, queue.SimpleQueue[CacheEvents | None]] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._log = ChangeLog(log_batches)  # what routers reading Stats get
        self._polled_at: float | None = None  # monotonic time of the last read; None: off
        self._thread = threading.Thread(target=self._run, name="cache-feed", daemon=True)
        self._thread.start()

    @property
    def num_subscribers(self) -> int:
        with self._lock:
            return len(self._subs)

    def stream(self, heartbeat_s: float) -> Generator[CacheBatch, None, None]:
        """A snapshot, then change batches (an empty one every `heartbeat_s` at least), until
        the worker stops or the caller closes the generator."""
        sub_id = next(self._ids)
        q: queue.SimpleQueue[CacheEvents | None] = queue.SimpleQueue()

        def register(engine: Engine) -> list[int]:
            self._deliver(engine)  # earlier changes go to the earlier subscribers only
            engine.allocator.recording = True
            with self._lock:
                self._subs[sub_id] = q
            return engine.allocator.keys()

        keys = self._loop.submit(register)
        try:
            yield CacheBatch(0, snapshot=True, stored=keys)
            for seq in itertools.count(1):
                try:
                    events = q.get(timeout=heartbeat_s)
                except queue.Empty:
                    yield CacheBatch(seq)
                    continue
                if events is None or self._stop.is_set():
                    return
                yield CacheBatch(seq, stored=[k for k, _ in events.stored],
                                 removed=list(events.removed))
        finally:
            with self._lock:
                self._subs.pop(sub_id, None)

    def poll(self, since: int) -> CacheBatch:
        """For a router reading Stats: the changes after log batch `since`, merged into one
        batch, or a snapshot when `since` is 0 or the log no longer reaches back to it. The
        log runs (and the allocator records for it) from the first read on."""
        with self._lock:
            self._polled_at = time.monotonic()
            if self._log.reaches(since):
                stored, removed = self._log.merged(since)
                return CacheBatch(self._log.sequence, stored=stored, removed=removed,
                                  since=since)

        def snapshot(engine: Engine) -> CacheBatch:
            self._deliver(engine)  # what came before goes into the log (if it ran) first
            engine.allocator.recording = True
            with self._lock:
                return CacheBatch(self._log.snapshot(), snapshot=True,
                                  stored=engine.allocator.keys())

        return self._loop.submit(snapshot)

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for q in self._subs.values():
                q.put(None)
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        while not self._stop.wait(self._period_s):
            with self._lock:
                if self._polled_at is not None and \
                        time.monotonic() - self._polled_at > POLL_IDLE_S:
                    self._stop_log_locked()
                if not self._subs and self._polled_at is None:
                    continue
            try:
                self._loop.submit(self._deliver)
            except Exception:  # the loop is stopping
                return

    def _deliver(self, engine: Engine) -> None:
        """Under the engine lock: hand the changes recorded so far to every subscriber."""
        with self._lock:
            if not self._subs and self._polled_at is None:
                engine.allocator.recording = False
                engine.allocator.take_events()
                return
            events = engine.allocator.take_events()
            if events:
                for q in self._subs.values():
                    q.put(events)
                if self._polled_at is not None:
                    self._log.append([k for k, _ in events.stored], list(events.removed))

    def _stop_log_locked(self) -> None:
        """No router reads the log any more: forget it (a later read starts with a snapshot;
        no old cursor fits)."""
        self._polled_at = None
        self._log.clear()
