"""Sequences a decode worker started at Reserve: the part of the prompt it lacked was short
(below the router's `prefill_here_below_tokens`), so it began computing it at once instead of
reserving pages for a handoff. Each waits here for its Decode call, which streams it from the
first token on.

Until that call comes, a started sequence is held like a reservation: its holder renews it
(`renew`), aborts it (`drop`), or it is ended when its lease passes (`expire`), so a router
that died between Reserve and Decode leaves nothing running. Thread-safe; `clock` is monotonic
seconds.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.common.tickets import TicketKey
from pdserve.engine.loop import Outputs
from pdserve.worker.leases import renewed


@dataclass
class EarlyStart:
    key: TicketKey
    outputs: Outputs
    received: float  # time.perf_counter() when its Reserve arrived (the queue time's start)
    deadline: float  # ended here unless renewed or taken
    cap: float  # renewals never move the deadline past this (lease_s after Reserve)
    renew_s: float  # a renewal moves the deadline this far ahead (0: not renewable)


class EarlyStarts:
    def __init__(self, end: Callable[[str, str], object],
                 clock: Callable[[], float] = time.monotonic):
        self._end = end  # (request id, reason): abort the sequence, drop its outputs
        self._clock = clock
        self._lock = threading.Lock()
        self._starts: dict[str, EarlyStart] = {}

    def add(self, key: TicketKey, outputs: Outputs, received: float, lease_s: float,
            renew_s: float) -> None:
        now = self._clock()
        with self._lock:
            self._starts[key.request_id] = EarlyStart(key, outputs, received,
                                                      now + (renew_s or lease_s),
                                                      now + lease_s, renew_s)

    def take(self, key: TicketKey) -> EarlyStart | None:
        """The start for `key`, handed to its Decode call (None: there is none)."""
        with self._lock:
            start = self._starts.get(key.request_id)
            if start is None or start.key != key:
                return None
            return self._starts.pop(key.request_id)

    def drop(self, request_id: str, reason: str = "aborted") -> bool:
        """End a start nobody streams yet (its holder aborted it); False when there is none."""
        with self._lock:
            start = self._starts.pop(request_id, None)
        if start is None:
            return False
        self._end(request_id, reason)
        return True

    def renew(self, keys: list[TicketKey], renew_s: float) -> list[TicketKey]:
        """Move the deadlines of the starts among `keys` (as `LeaseBook.renew`); returns the
        other keys."""
        now = self._clock()
        rest: list[TicketKey] = []
        with self._lock:
            for key in keys:
                start = self._starts.get(key.request_id)
                if start is None or start.key != key:
                    rest.append(key)
                    continue
                start.deadline = renewed(start.deadline, start.cap, start.renew_s, renew_s, now)
        return rest

    def expire(self) -> list[str]:
        """End the starts whose lease passed before their Decode call came; their ids."""
        now = self._clock()
        with self._lock:
            due = [rid for rid, start in self._starts.items() if start.deadline <= now]
            for rid in due:
                del self._starts[rid]
        for rid in due:
            self._end(rid, "its Decode call did not come before the lease passed")
        return due

    def close(self) -> None:
        """End every start (the worker is stopping)."""
        with self._lock:
            rids = list(self._starts)
            self._starts.clear()
        for rid in rids:
            self._end(rid, "the decode worker is stopping")

    def __contains__(self, request_id: object) -> bool:
        with self._lock:
            return request_id in self._starts
