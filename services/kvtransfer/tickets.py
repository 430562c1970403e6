"""Expected writes: which ticket may write which pages of which pool, until when.

A ticket (request id + decode allocator epoch) moves through

    EXPECTED --begin_write--> WRITING --finish ok, every reserved page landed--> COMPLETE
        |  lease passes           | finish ok, pages still to come -> EXPECTED
        |                         | finish failed -> EXPECTED (a retry may land)
        v                         v cancel: abort the write, wait until it stopped
     EXPIRED                  CANCELLED

A write is accepted only in EXPECTED, with the lease not passed, for reserved pages that have
not landed yet: all of them at once, or a part (a pipelined handoff ships the pages of each
prefill chunk as it completes), one write at a time. The ticket is COMPLETE once every
reserved page has landed. Cancel (and expiry) close the ticket for good; cancel returns only
once no write for it is in flight. Closed tickets are remembered for `retention_s` so a late
write is refused with the precise reason, then forgotten (unknown ticket).

A ticket may also be armed for the native same-host write (pdserve.kvtransfer.native), which
serves a write of exactly its reserved pages without this book. The book stays the authority:
before it decides anything about an armed ticket it takes it back (`_settle`), applying what
the native write did (every page landed, or nothing) or learning that one is in flight (then
the ticket is WRITING as far as anyone asking can tell).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.common.kv.errors import (
    BadRequest,
    TicketBusy,
    TicketCancelled,
    TicketExpired,
    TransferTimeout,
    UnknownTicket,
)
from pdserve.common.kv.runs import expand, spans_of
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer import native


class State(enum.Enum):
    EXPECTED = "expected"
    WRITING = "writing"
    COMPLETE = "complete"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


@dataclass
class Expectation:
    key: TicketKey
    pool_id: str
    page_ids: tuple[int, ...]
    lease_deadline: float
    state: State = State.EXPECTED
    kv_bytes: int = 0
    completed_unix_ms: float = 0.0
    forget_at: float = float("inf")
    writing: bool = False  # a write is in flight (its transport holds views of the pages)
    abort: threading.Event = field(default_factory=threading.Event)
    landed: frozenset[int] = frozenset()  # pages whose write completed
    writing_pages: frozenset[int] = frozenset()  # the pages of the write in flight
    armed: bool = False  # the native same-host write may serve it (see the module docstring)
    reserved: frozenset[int] = field(init=False)  # page_ids as a set, for each write's check
    spans: tuple[tuple[int, int], ...] = field(init=False)  # page_ids as (start, n) spans

    def __post_init__(self) -> None:
        self.reserved = frozenset(self.page_ids)
        # A write of exactly these spans before anything landed is the whole handoff in one
        # (the usual case): accepted by one tuple compare instead of set work per page.
        self.spans = spans_of(self.page_ids) if len(self.reserved) == len(self.page_ids) \
            else ()

    @property
    def complete(self) -> bool:
        return self.state is State.COMPLETE


@dataclass(frozen=True)
class Status:
    complete: bool
    kv_bytes: int
    completed_unix_ms: float


class TicketBook:
    """Thread-safe registry of expected writes. `clock` is monotonic seconds."""

    def __init__(self, *, retention_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 native_writes: native.NativeReceiver | None = None):
        self._retention_s = retention_s
        self._clock = clock
        self._native = native_writes  # arming needs leases on time.monotonic (the C clock)
        self._cond = threading.Condition()
        self._tickets: dict[TicketKey, Expectation] = {}

    def expect(self, key: TicketKey, pool_id: str, page_ids: Sequence[int], lease_s: float,
               arm: Callable[[Expectation], bool] | None = None) -> None:
        """Open (or, while still EXPECTED, renew) the write window for `key`. `arm(exp)`
        arms it for the native write (the caller knows the pool); True when armed."""
        if not key.request_id:
            raise BadRequest("ticket.request_id is empty")
        if not page_ids:
            raise BadRequest(f"ticket {key}: page_ids is empty")
        if lease_s <= 0:
            raise BadRequest(f"ticket {key}: lease_ms must be > 0, got {lease_s * 1e3:g}")
        with self._cond:
            old = self._tickets.get(key)
            if old is not None:
                if self._settle(old):
                    raise TicketBusy(f"ticket {key}: a write for it is already in flight")
                self._expire_locked(old, self._clock())
            if old is not None and old.state is not State.EXPECTED:
                self._raise_state(old)
            exp = Expectation(key, pool_id, tuple(page_ids), self._clock() + lease_s)
            if old is not None and old.landed:  # a renewal keeps what has landed already
                if (old.pool_id, sorted(old.page_ids)) != (pool_id, sorted(page_ids)):
                    raise BadRequest(f"ticket {key}: part of its handoff has landed; it can "
                                     "be renewed for the same pages only")
                exp.landed, exp.kv_bytes = old.landed, old.kv_bytes
            self._tickets[key] = exp
            if arm is not None and self._native is not None and exp.spans and not exp.landed:
                exp.armed = arm(exp)

    def begin_write(self, key: TicketKey, pool_id: str, page_ids: Sequence[int] = (), *,
                    spans: Sequence[tuple[int, int]] = ()) -> Expectation:
        """Accept a write of `page_ids` (all the reserved pages, or some that have not landed
        yet) into `pool_id` for `key`: EXPECTED -> WRITING. The pages may come as `spans`
        instead ((start, n), checked in the pool and not overlapping by the caller)."""
        with self._cond:
            exp, busy = self._live(key)
            if busy:
                raise TicketBusy(f"ticket {key}: a write for it is already in flight")
            if exp.state is not State.EXPECTED:
                self._raise_state(exp)
            if pool_id != exp.pool_id:
                raise BadRequest(f"ticket {key} reserved pages in pool {exp.pool_id}, "
                                 f"not {pool_id}")
            if spans and tuple(spans) == exp.spans and not exp.landed:
                exp.state, exp.writing, exp.writing_pages = State.WRITING, True, exp.reserved
                return exp
            if spans:
                page_ids = expand(spans)
            pages = frozenset(page_ids)
            if not pages or not pages <= exp.reserved:
                raise BadRequest(f"ticket {key}: pages {_short(sorted(page_ids))} are not the "
                                 f"pages reserved for it {_short(sorted(exp.page_ids))}")
            if pages & exp.landed:
                raise TicketBusy(f"ticket {key}: pages {_short(sorted(pages & exp.landed))} "
                                 "have already landed")
            exp.state = State.WRITING
            exp.writing = True
            exp.writing_pages = pages
            return exp  # its abort event is set only by a cancel, which ends the ticket

    def finish_write(self, exp: Expectation, ok: bool, kv_bytes: int) -> None:
        """End a write. Raises TicketCancelled if the ticket was cancelled meanwhile."""
        with self._cond:
            exp.writing = False
            self._cond.notify_all()
            if exp.state is State.CANCELLED:
                raise TicketCancelled(f"ticket {exp.key} was cancelled during its write")
            if exp.state is not State.WRITING:
                return
            exp.state = State.EXPECTED  # failed: pages may hold part of it; a retry overwrites
            if ok:
                exp.landed = exp.landed | exp.writing_pages if exp.landed else \
                    exp.writing_pages
                exp.kv_bytes += kv_bytes
                if len(exp.landed) == len(exp.page_ids):
                    exp.state = State.COMPLETE
                    exp.completed_unix_ms = time.time() * 1e3
                    exp.forget_at = self._clock() + self._retention_s
            exp.writing_pages = frozenset()

    def cancel(self, key: TicketKey, wait_s: float) -> tuple[bool, bool]:
        """Close the ticket for good; return (was_pending, was_complete) once no write for it
        is in flight. Unknown tickets are fine (idempotent). Raises TransferTimeout if an
        aborted write did not stop within `wait_s`."""
        with self._cond:
            exp = self._tickets.get(key)
            if exp is None:
                return False, False
            if self._settle(exp, abort=True, wait_s=wait_s):
                raise TransferTimeout(f"ticket {key}: the write in flight did not stop "
                                      f"within {wait_s:.1f}s of the cancel")
            self._expire_locked(exp, self._clock())
            was_pending = exp.state in (State.EXPECTED, State.WRITING)
            was_complete = exp.state is State.COMPLETE
            if exp.state is not State.EXPIRED:
                exp.state = State.CANCELLED
            exp.forget_at = self._clock() + self._retention_s
            if exp.writing:
                exp.abort.set()
                if not self._cond.wait_for(lambda: not exp.writing, timeout=wait_s):
                    raise TransferTimeout(f"ticket {key}: the write in flight did not stop "
                                          f"within {wait_s:.1f}s of the cancel")
            return was_pending, was_complete

    def status(self, key: TicketKey) -> Status:
        """Whether the ticket's write fully landed. Raises for unknown or closed tickets."""
        with self._cond:
            exp, busy = self._live(key)
            if busy:
                return Status(False, exp.kv_bytes, exp.completed_unix_ms)
            if exp.state in (State.CANCELLED, State.EXPIRED):
                self._raise_state(exp)
            return Status(exp.state is State.COMPLETE, exp.kv_bytes, exp.completed_unix_ms)

    def sweep(self) -> None:
        """Expire passed leases and forget closed tickets after their retention (every call
        site also expires the one ticket it touches, so this only bounds memory)."""
        with self._cond:
            self._sweep_locked()

    def __len__(self) -> int:
        with self._cond:
            return len(self._tickets)

    # ---- internals (lock held) --------------------------------------------------------
    def _live(self, key: TicketKey) -> tuple[Expectation, bool]:
        """The ticket, brought up to date; True with it while a native write is in flight."""
        exp = self._tickets.get(key)
        if exp is None:
            raise UnknownTicket(f"unknown ticket {key} (never expected here, or long closed)")
        if self._settle(exp):
            return exp, True
        self._expire_locked(exp, self._clock())
        return exp, False

    def _settle(self, exp: Expectation, *, abort: bool = False, wait_s: float = 0.0) -> bool:
        """Take an armed ticket back from the native write path and apply what it did; True
        (and still armed) while a native write is in flight after `wait_s` (`abort`: stop it
        at its next slice)."""
        if not exp.armed or self._native is None:
            return False
        state, kv_bytes, done_unix_ms = self._native.take(exp.key, abort, wait_s)
        if state == native.WRITING:
            return True
        exp.armed = False
        if state == native.DONE and exp.state is State.EXPECTED:
            exp.landed, exp.kv_bytes = exp.reserved, exp.kv_bytes + kv_bytes
            exp.state, exp.completed_unix_ms = State.COMPLETE, done_unix_ms
            exp.forget_at = self._clock() + self._retention_s
        return False  # ARMED, ABORTED (a cancel stopped it: nothing counts as landed), ABSENT

    def _expire_locked(self, exp: Expectation, now: float) -> None:
        if exp.state is State.EXPECTED and now >= exp.lease_deadline:
            exp.state = State.EXPIRED
            exp.forget_at = now + self._retention_s

    def _raise_state(self, exp: Expectation) -> None:
        if exp.state is State.CANCELLED:
            raise TicketCancelled(f"ticket {exp.key} was cancelled")
        if exp.state is State.EXPIRED:
            raise TicketExpired(f"ticket {exp.key}: its lease expired")
        if exp.state is State.WRITING:
            raise TicketBusy(f"ticket {exp.key}: a write for it is already in flight")
        if exp.state is State.COMPLETE:
            raise TicketBusy(f"ticket {exp.key}: its pages have already landed")

    def _sweep_locked(self) -> None:
        now = self._clock()
        for key, exp in list(self._tickets.items()):
            if exp.armed and (now < exp.lease_deadline or self._settle(exp)):
                continue  # armed and live, or a native write in flight
            self._expire_locked(exp, now)
            if now >= exp.forget_at and not exp.writing:
                del self._tickets[key]


def _short(pages: Sequence[int], limit: int = 8) -> str:
    shown = ", ".join(str(p) for p in pages[:limit])
    return f"[{shown}{', ...' if len(pages) > limit else ''}] ({len(pages)} pages)"
