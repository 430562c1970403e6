"""Deadlines for waits that gRPC cannot bound by itself (the first message of a stream whose
whole call has no deadline): one thread for all of them, so arming one costs a heap push,
not a thread.

Arming wakes the thread only when the new deadline is the soonest. With one timeout for
every request that is almost never (each deadline comes after those armed before it), so a
request costs no thread hand-off here; the thread sleeps until the oldest deadline and then
drops, at once, the disarmed entries in front of the first one still armed (a heap of about
rate x timeout entries between its wake-ups)."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("pdserve.router")


class Watchdog:
    """Runs a callback when its deadline passes, unless it was disarmed first."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int]] = []
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._ids = itertools.count()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="router-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def armed(self, timeout_s: float, on_timeout: Callable[[], None]) -> Iterator[None]:
        """`on_timeout` runs (on the watchdog's thread; it must not block) if the block is
        still running `timeout_s` from now."""
        key = next(self._ids)
        with self._cond:
            self._callbacks[key] = on_timeout
            heapq.heappush(self._heap, (self._clock() + timeout_s, key))
            if self._heap[0][1] == key:  # sooner than the thread's wake-up: wake it now
                self._cond.notify()
        try:
            yield
        finally:
            with self._cond:
                self._callbacks.pop(key, None)

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop:
                    while self._heap and self._heap[0][1] not in self._callbacks:
                        heapq.heappop(self._heap)  # disarmed
                    wait = self._heap[0][0] - self._clock() if self._heap else None
                    if wait is not None and wait <= 0:
                        break
                    self._cond.wait(wait)
                if self._stop:
                    return
                _, key = heapq.heappop(self._heap)
                callback = self._callbacks.pop(key)
            try:
                callback()
            except Exception:
                log.exception("watchdog callback failed")
