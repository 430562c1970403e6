"""The lease book: the one owner of a decode worker's reservations.

A reservation holds pages of the local pool for a prompt whose KV is being prefilled
elsewhere; the router only holds its ticket, the engine only holds the pages, the host's
agent only the write window this book opens and closes. Its states:

    RESERVED --window opened--> WRITING --window closed, write landed--> LANDED --> ADOPTED
        |                          |
        |                          +-- release / lease passed --> RELEASED / EXPIRED
        +-- the agent refused -------> RELEASED

- RESERVED: pages taken from the pool, the agent not yet told.
- WRITING: the agent accepts writes for the ticket into exactly these pages (until the lease).
- LANDED: the window is closed and the agent confirmed the whole handoff arrived.
- ADOPTED: a sequence owns the pages now (the book forgets the lease).
- RELEASED / EXPIRED: the window is closed and the pages are back in the pool.

A lease has two clocks. `lease_s` is the longest the pages wait for their handoff, whatever
happens (the agent's write window is opened for that long). A renewable lease (`renew_s` > 0)
also lapses when its holder (the router) has not renewed it for `renew_s`: the router renews
the tickets it holds while their requests are alive (`renew`), so a long prefill keeps its
pages and a dead router's reservations come back within `renew_s`, not after `lease_s`.

Pages return to the pool only after the agent confirmed that no write can land in them any
more; when it cannot confirm (it timed out), the lease stays WRITING with its release pending
and `tick()` asks again. Every page is freed exactly once: by `release`, by expiry, or by a
failed adoption. Thread-safe; `clock` is monotonic seconds (a fake one in tests).
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pdserve.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from pdserve.common.tickets import TicketKey

log = logging.getLogger("pdserve.leases")
T = TypeVar("T")


class LeaseState(enum.Enum):
    RESERVED = "reserved"
    WRITING = "writing"
    LANDED = "landed"
    ADOPTED = "adopted"
    RELEASED = "released"
    EXPIRED = "expired"


class NoRoom(Exception):
    """Raised by a `PageStore` that cannot hold the pages (or the sequence) now."""


@dataclass(frozen=True)
class WindowClosed:
    """The agent's answer to closing a write window."""

    confirmed: bool  # no write for the ticket can land any more
    landed: bool     # the whole handoff had arrived before it closed


class WriteWindow(Protocol):
    """The host agent's side of a lease (None for a co-located worker, which writes its own
    pages)."""

    def open(self, key: TicketKey, page_ids: list[int], lease_s: float) -> None:
        """Accept writes for `key` into `page_ids` until the lease passes; raise on refusal."""

    def close(self, key: TicketKey) -> WindowClosed:
        """Stop accepting writes for `key`; return once none is in flight (or say it could
        not confirm that)."""


@dataclass(frozen=True)
class ReservedPages:
    """What a reservation took: new pages for the handoff to fill, after `cached_pages`
    leading pages of the prompt that the pool already held (pinned, not written again)."""

    page_ids: list[int]
    cached_pages: int = 0
    boundary_key: int = 0  # the prefix-cache key of the last cached page (0: none)


class PageStore(Protocol):
    """The engine's pool as the book sees it."""

    def reserve(self, key: TicketKey, num_prompt_tokens: int,
                prompt_ids: list[int] | None = None) -> ReservedPages:
        """Pages for the prompt, held under `key` (with `prompt_ids`, its cached leading
        pages pinned first); raise NoRoom when they cannot be had."""

    def free(self, key: TicketKey) -> None:
        """Return every page held under `key` (a no-op when it holds none)."""


@dataclass
class Lease:
    key: TicketKey
    page_ids: list[int]  # the new pages, the only ones the handoff writes
    deadline: float  # expires here unless renewed (renewable leases) or released
    cap: float = math.inf  # renewals never move the deadline past this (lease_s after reserve)
    renew_s: float = 0.0  # a renewal moves the deadline this far ahead (0: not renewable)
    state: LeaseState = LeaseState.RESERVED
    pending_release: LeaseState | None = None  # RELEASED or EXPIRED once the window closes
    busy: bool = False  # a thread is closing its window right now (tick leaves it alone)
    cached_pages: int = 0  # leading prompt pages held from the prefix cache (not written)
    boundary_key: int = 0


class LeaseBook:
    def __init__(self, worker_id: str, epoch: int, pages: PageStore,
                 window: WriteWindow | None, *, default_lease_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_expired: Callable[[TicketKey], None] | None = None):
        self.worker_id = worker_id
        self.epoch = epoch
        self._pages = pages
        self._window = window
        self._default_lease_s = default_lease_s
        self._clock = clock
        self._on_expired = on_expired or (lambda key: None)
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}  # by request id: live (RESERVED, WRITING) or pending
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None

    # ---- the request path ---------------------------------------------------------------
    def reserve(self, request_id: str, num_prompt_tokens: int, lease_s: float = 0.0,
                renew_s: float = 0.0, prompt_ids: list[int] | None = None) -> Lease:
        """Take pages for a prompt and open the agent's write window for them. The pages wait
        at most `lease_s` (0: the default); with `renew_s` > 0 also only until no renewal came
        for `renew_s`. With `prompt_ids` the leading pages the pool already holds are pinned
        instead, and the window covers only the rest."""
        lease_s, renew_s = self.terms(request_id, num_prompt_tokens, lease_s, renew_s,
                                      prompt_ids)
        key = TicketKey(request_id, self.epoch)
        with self._lock:
            if request_id in self._leases:
                raise FailedPrecondition(f"request {request_id} already has pages on "
                                         f"{self.worker_id}")
            try:
                taken = self._pages.reserve(key, num_prompt_tokens, prompt_ids or None)
            except NoRoom as exc:
                raise ResourceExhausted(f"decode worker {self.worker_id}: no room for "
                                        f"{num_prompt_tokens} prompt tokens ({exc})") from None
            now = self._clock()
            page_ids = taken.page_ids
            lease = Lease(key, page_ids, now + (renew_s or lease_s), cap=now + lease_s,
                          renew_s=renew_s, busy=True, cached_pages=taken.cached_pages,
                          boundary_key=taken.boundary_key)
            self._leases[request_id] = lease
        if self._window is not None:
            try:
                self._window.open(key, page_ids, lease_s)
            except Exception as exc:
                self._forget(lease, LeaseState.RELEASED)  # nothing can write: no window
                raise Unavailable(f"the kvtransfer agent refused the reservation of "
                                  f"{request_id}: {exc}") from None
        with self._lock:
            lease.state = LeaseState.WRITING
            lease.busy = False
        return lease

    def terms(self, request_id: str, num_prompt_tokens: int, lease_s: float, renew_s: float,
              prompt_ids: list[int] | None = None) -> tuple[float, float]:
        """Check a reservation's arguments; returns its (lease_s, renew_s) with the defaults
        applied. Raises InvalidArgument naming the bad field."""
        if not request_id:
            raise InvalidArgument("request_id is empty")
        if num_prompt_tokens <= 0:
            raise InvalidArgument(f"num_prompt_tokens={num_prompt_tokens}: must be > 0")
        if prompt_ids and len(prompt_ids) != num_prompt_tokens:
            raise InvalidArgument(f"prompt_token_ids has {len(prompt_ids)} tokens, "
                                  f"num_prompt_tokens is {num_prompt_tokens}")
        _check_duration("lease_ms", lease_s)
        _check_duration("renew_lease_ms", renew_s)
        lease_s = lease_s or self._default_lease_s
        return lease_s, min(renew_s, lease_s)

    def adopt(self, key: TicketKey, into: Callable[[Lease], T], *,
              handoff: bool = True) -> T:
        """Close the window, check the handoff landed, and run `into(lease)`, which must move
        the pages to a sequence. When anything fails the pages are freed and it re-raises.
        `handoff=False`: no handoff was sent (the worker computes the prompt itself); the
        window is closed all the same, so nothing can land in the pages from now on."""
        if key.epoch != self.epoch:
            raise FailedPrecondition(f"stale ticket for {key.request_id}: epoch {key.epoch}, "
                                     f"decode worker {self.worker_id} is at epoch {self.epoch} "
                                     "(restarted)")
        with self._lock:
            lease = self._leases.get(key.request_id)
            if lease is None or lease.key != key or lease.pending_release is not None \
                    or lease.busy:
                raise FailedPrecondition(f"no reservation for {key.request_id} on "
                                         f"{self.worker_id}: its lease expired or it was aborted")
            lease.pending_release = LeaseState.RELEASED  # from now on nobody else takes it
            lease.busy = True
        closed = self._close(lease)
        if not closed.confirmed:
            self._idle(lease)  # tick retries the close, then frees the pages
            raise Unavailable(f"the kvtransfer agent could not close the write window of "
                              f"{key.request_id}; its pages stay held until it does")
        if handoff and not closed.landed:
            self._forget(lease, LeaseState.RELEASED)
            raise FailedPrecondition(f"KV handoff for {key.request_id} has not completed on "
                                     f"{self.worker_id}")
        lease.state = LeaseState.LANDED
        try:
            result = into(lease)
        except BaseException:
            self._forget(lease, LeaseState.RELEASED)
            raise
        with self._lock:
            del self._leases[key.request_id]
            lease.state = LeaseState.ADOPTED
            lease.busy = False
        return result

    def release(self, request_id: str) -> bool:
        """Close the window and free the pages of a reservation not yet adopted (the router
        gave up on it). False when there is none (already adopted, released or expired)."""
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.pending_release is not None or lease.busy:
                return False
            lease.pending_release = LeaseState.RELEASED
            lease.busy = True
        self._finish_release(lease)
        return True

    def renew(self, keys: list[TicketKey], renew_s: float = 0.0) -> list[str]:
        """The holder's heartbeat: move each renewable lease's deadline to `renew_s` from now
        (0: its own renewal period), never past its cap. Returns the request ids of the keys
        that hold no reservation here (released, expired, adopted, another epoch, unknown)."""
        _check_duration("renew_lease_ms", renew_s)
        now = self._clock()
        not_held: list[str] = []
        with self._lock:
            for key in keys:
                lease = self._leases.get(key.request_id)
                if lease is None or lease.key != key or lease.pending_release is not None:
                    not_held.append(key.request_id)
                    continue
                lease.deadline = renewed(lease.deadline, lease.cap, lease.renew_s, renew_s, now)
        return not_held

    # ---- upkeep -------------------------------------------------------------------------
    def tick(self) -> None:
        """Expire passed leases and retry releases whose window could not be closed."""
        now = self._clock()
        with self._lock:
            due = [lease for lease in self._leases.values() if not lease.busy and (
                lease.pending_release is not None or lease.deadline <= now)]
            for lease in due:
                lease.pending_release = lease.pending_release or LeaseState.EXPIRED
                lease.busy = True
        for lease in due:
            if self._finish_release(lease) and lease.state is LeaseState.EXPIRED:
                log.info("lease expired for %s: pages reclaimed", lease.key.request_id)
                self._on_expired(lease.key)

    def start_reaper(self, interval_s: float = 0.2,
                     also: Callable[[], object] = lambda: None) -> None:
        """Call `tick` (then `also`) every `interval_s` in a daemon thread until `close`."""
        def run() -> None:
            while not self._stop.wait(interval_s):
                self.tick()
                also()
        self._reaper = threading.Thread(target=run, name="lease-reaper", daemon=True)
        self._reaper.start()

    def close(self) -> None:
        """Stop the reaper and release every reservation (worker shutdown)."""
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(timeout=5.0)
        for request_id in self.request_ids():
            self.release(request_id)

    # ---- reading ------------------------------------------------------------------------
    def __len__(self) -> int:
        """Reservations holding pages that no sequence owns yet."""
        with self._lock:
            return len(self._leases)

    def request_ids(self) -> list[str]:
        with self._lock:
            return list(self._leases)

    def lease(self, request_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(request_id)

    # ---- internals ----------------------------------------------------------------------
    def _close(self, lease: Lease) -> WindowClosed:
        if self._window is None:  # co-located: this process writes the pages itself
            return WindowClosed(confirmed=True, landed=True)
        try:
            return self._window.close(lease.key)
        except Exception as exc:
            log.warning("could not close the KV write window of %s (%s); pages held",
                        lease.key.request_id, exc)
            return WindowClosed(confirmed=False, landed=False)

    def _finish_release(self, lease: Lease) -> bool:
        """Close the window, then free the pages (True); False when the agent could not
        confirm the close, so the lease waits for the next `tick`."""
        if self._close(lease).confirmed:
            self._forget(lease, lease.pending_release or LeaseState.RELEASED)
            return True
        self._idle(lease)
        return False

    def _idle(self, lease: Lease) -> None:
        with self._lock:
            lease.busy = False

    def _forget(self, lease: Lease, state: LeaseState) -> None:
        with self._lock:
            if self._leases.get(lease.key.request_id) is not lease:
                return  # already freed or adopted
            del self._leases[lease.key.request_id]
            lease.state = state
            lease.busy = False
        self._pages.free(lease.key)


def renewed(deadline: float, cap: float, own_renew_s: float, renew_s: float, now: float
            ) -> float:
    """A renewable hold's deadline after a renewal at `now`: `renew_s` ahead (0: its own
    period), never past `cap` nor earlier than it was; unchanged when not renewable."""
    if own_renew_s <= 0:
        return deadline
    return max(deadline, now + min(renew_s or own_renew_s, cap - now))


def _check_duration(field: str, seconds: float) -> None:
    if not math.isfinite(seconds) or seconds < 0:
        raise InvalidArgument(f"{field}={seconds * 1e3:g}: must be a finite number >= 0 "
                              "(0 = default)")
