"""The lease book (the one owner of a decode reservation) against a fake agent window, a fake
page store and a fake clock: every path frees each page exactly once, and never while a write
may still land in it."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from pdserve.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from pdserve.common.tickets import TicketKey
from pdserve.worker.leases import LeaseBook, LeaseState, NoRoom, ReservedPages, WindowClosed

from tests.fakes import FakeClock

pytestmark = pytest.mark.unit

EPOCH = 7


@dataclass
class FakePages:
    num_pages: int = 8
    held: dict[TicketKey, list[int]] = field(default_factory=dict)
    freed: list[TicketKey] = field(default_factory=list)

    @property
    def num_free(self) -> int:
        return self.num_pages - sum(len(p) for p in self.held.values())

    def reserve(self, key: TicketKey, num_prompt_tokens: int,
                prompt_ids: list[int] | None = None) -> ReservedPages:
        need = -(-num_prompt_tokens // 16)
        if need > self.num_free:
            raise NoRoom(f"need {need} pages, {self.num_free} free")
        used = {p for pages in self.held.values() for p in pages}
        self.held[key] = [p for p in range(self.num_pages) if p not in used][:need]
        return ReservedPages(list(self.held[key]))

    def free(self, key: TicketKey) -> None:
        assert key in self.held, f"{key} freed twice or never held"
        del self.held[key]
        self.freed.append(key)


@dataclass
class FakeWindow:
    """The agent: open windows, which ones got their whole write, and whether closing works."""

    open_windows: dict[TicketKey, list[int]] = field(default_factory=dict)
    landed: set[TicketKey] = field(default_factory=set)
    refuse_open: bool = False
    cannot_close: bool = False
    closes: list[TicketKey] = field(default_factory=list)

    def open(self, key: TicketKey, page_ids: list[int], lease_s: float) -> None:
        if self.refuse_open:
            raise RuntimeError("pool not registered")
        self.open_windows[key] = page_ids

    def close(self, key: TicketKey) -> WindowClosed:
        self.closes.append(key)
        if self.cannot_close:
            raise TimeoutError("the write in flight did not stop")
        self.open_windows.pop(key, None)
        return WindowClosed(confirmed=True, landed=key in self.landed)


@pytest.fixture
def parts() -> tuple[LeaseBook, FakePages, FakeWindow, FakeClock, list[TicketKey]]:
    pages, window, clock, expired = FakePages(), FakeWindow(), FakeClock(100.0), []
    book = LeaseBook("decode-0", EPOCH, pages, window, default_lease_s=10.0, clock=clock,
                     on_expired=expired.append)
    return book, pages, window, clock, expired


def test_reserve_opens_the_window_for_exactly_its_pages(parts):
    book, pages, window, _, _ = parts
    lease = book.reserve("r1", 40)
    assert lease.state is LeaseState.WRITING and lease.key == TicketKey("r1", EPOCH)
    assert window.open_windows == {lease.key: lease.page_ids} and len(lease.page_ids) == 3
    assert len(book) == 1 and pages.num_free == 5


def test_landed_handoff_is_adopted_and_the_book_forgets_it(parts):
    book, pages, window, _, _ = parts
    lease = book.reserve("r1", 20)
    window.landed.add(lease.key)
    adopted = book.adopt(lease.key, lambda lease_: ("seq", lease_.page_ids))
    assert adopted == ("seq", lease.page_ids) and lease.state is LeaseState.ADOPTED
    assert window.closes == [lease.key] and len(book) == 0
    assert pages.freed == []  # the sequence owns the pages now
    assert not book.release("r1")


def test_incomplete_handoff_frees_the_pages_after_closing_the_window(parts):
    book, pages, window, _, _ = parts
    lease = book.reserve("r1", 20)
    with pytest.raises(FailedPrecondition, match="KV handoff for r1 has not completed"):
        book.adopt(lease.key, lambda _: pytest.fail("adopted an incomplete handoff"))
    assert lease.state is LeaseState.RELEASED and pages.freed == [lease.key]
    assert lease.key not in window.open_windows


def test_failed_adoption_frees_the_pages_once(parts):
    book, pages, window, _, _ = parts
    lease = book.reserve("r1", 20)
    window.landed.add(lease.key)

    def broken(_):
        raise InvalidArgument("prompt + max_tokens needs 9 pages; the pool has 8")
    with pytest.raises(InvalidArgument):
        book.adopt(lease.key, broken)
    assert pages.freed == [lease.key] and pages.num_free == 8 and len(book) == 0


def test_stale_and_unknown_tickets_are_refused(parts):
    book, _, window, _, _ = parts
    lease = book.reserve("r1", 20)
    window.landed.add(lease.key)
    with pytest.raises(FailedPrecondition, match="stale ticket for r1: epoch 6"):
        book.adopt(TicketKey("r1", EPOCH - 1), lambda _: None)
    with pytest.raises(FailedPrecondition, match="no reservation for r2"):
        book.adopt(TicketKey("r2", EPOCH), lambda _: None)
    assert lease.state is LeaseState.WRITING  # untouched


def test_release_closes_then_frees_and_is_idempotent(parts):
    book, pages, window, _, _ = parts
    lease = book.reserve("r1", 20)
    assert book.release("r1") and not book.release("r1")
    assert lease.state is LeaseState.RELEASED and pages.freed == [lease.key]
    assert window.closes == [lease.key]
    with pytest.raises(FailedPrecondition, match="expired or it was aborted"):
        book.adopt(lease.key, lambda _: None)


def test_pages_stay_held_until_the_agent_confirms_the_close(parts):
    book, pages, window, clock, _ = parts
    lease = book.reserve("r1", 20)
    window.cannot_close = True
    assert book.release("r1")  # accepted, but the pages must not be reused yet
    assert pages.freed == [] and lease.state is LeaseState.WRITING
    with pytest.raises(FailedPrecondition):  # nobody can adopt it meanwhile
        book.adopt(lease.key, lambda _: None)
    book.tick()
    assert pages.freed == []
    window.cannot_close = False
    book.tick()
    assert pages.freed == [lease.key] and lease.state is LeaseState.RELEASED and len(book) == 0


def test_adoption_that_cannot_close_the_window_is_unavailable_and_retried_by_tick(parts):
    book, pages, window, _, _ = parts
    lease = book.reserve("r1", 20)
    window.landed.add(lease.key)
    window.cannot_close = True
    with pytest.raises(Unavailable, match="could not close the write window of r1"):
        book.adopt(lease.key, lambda _: pytest.fail("adopted without a closed window"))
    assert pages.freed == []
    window.cannot_close = False
    book.tick()
    assert pages.freed == [lease.key] and lease.state is LeaseState.RELEASED


def test_lease_expires_with_the_clock(parts):
    book, pages, window, clock, expired = parts
    short = book.reserve("short", 20, lease_s=1.0)
    long = book.reserve("long", 20)  # the default, 10 s
    clock.now += 1.0
    book.tick()
    assert short.state is LeaseState.EXPIRED and expired == [short.key]
    assert pages.freed == [short.key] and long.state is LeaseState.WRITING
    with pytest.raises(FailedPrecondition, match="no reservation for short"):
        book.adopt(short.key, lambda _: None)
    clock.now += 9.0
    book.tick()
    assert expired == [short.key, long.key] and pages.num_free == 8


def test_refused_window_or_no_room_leaves_nothing_held(parts):
    book, pages, window, _, _ = parts
    window.refuse_open = True
    with pytest.raises(Unavailable, match="refused the reservation of r1: pool not registered"):
        book.reserve("r1", 20)
    assert pages.num_free == 8 and len(book) == 0 and pages.freed == [TicketKey("r1", EPOCH)]
    window.refuse_open = False
    with pytest.raises(ResourceExhausted, match="no room for 200 prompt tokens"):
        book.reserve("r2", 200)
    assert pages.num_free == 8 and len(book) == 0


def test_bad_requests_and_duplicates(parts):
    book, _, _, _, _ = parts
    with pytest.raises(InvalidArgument, match="request_id is empty"):
        book.reserve("", 4)
    with pytest.raises(InvalidArgument, match="num_prompt_tokens=0"):
        book.reserve("r1", 0)
    book.reserve("r1", 4)
    with pytest.raises(FailedPrecondition, match="r1 already has pages on decode-0"):
        book.reserve("r1", 4)


def test_close_releases_everything(parts):
    book, pages, _, _, _ = parts
    for i in range(3):
        book.reserve(f"r{i}", 16)
    book.close()
    assert pages.num_free == 8 and len(book) == 0


def test_without_a_window_the_pages_are_written_locally(parts):
    _, pages, _, clock, _ = parts
    book = LeaseBook("colocated-0", EPOCH, pages, None, clock=clock)
    lease = book.reserve("r1", 20)
    assert book.adopt(lease.key, lambda lease_: len(lease_.page_ids)) == 2
    assert lease.state is LeaseState.ADOPTED


# ---- leases that follow the work: renewal by the holder ---------------------------------

def test_a_renewed_lease_outlives_its_renewal_period_while_renewed(parts):
    book, pages, _, clock, expired = parts
    lease = book.reserve("r1", 20, lease_s=60.0, renew_s=2.0)
    assert lease.deadline == clock.now + 2.0 and lease.renew_s == 2.0
    for _ in range(10):  # 15 s of heartbeats every 1.5 s: far past the 2 s period
        clock.now += 1.5
        assert book.renew([lease.key]) == []
        book.tick()
    assert lease.state is LeaseState.WRITING and expired == [] and pages.freed == []


def test_a_lease_nobody_renews_lapses_after_its_renewal_period_not_its_cap(parts):
    book, pages, window, clock, expired = parts
    lease = book.reserve("r1", 20, lease_s=60.0, renew_s=2.0)
    clock.now += 1.9
    book.tick()
    assert lease.state is LeaseState.WRITING
    clock.now += 0.1
    book.tick()
    assert lease.state is LeaseState.EXPIRED and expired == [lease.key]
    assert pages.freed == [lease.key] and lease.key in window.closes


def test_renewals_never_move_a_lease_past_its_cap(parts):
    book, _, _, clock, expired = parts
    lease = book.reserve("r1", 20, lease_s=5.0, renew_s=2.0)
    for _ in range(4):
        clock.now += 1.0
        book.renew([lease.key])
    assert lease.deadline == lease.cap == 105.0  # reserved at 100 with a 5 s cap
    clock.now = 105.0
    book.tick()
    assert expired == [lease.key]


def test_renew_names_what_it_does_not_hold(parts):
    book, _, window, clock, _ = parts
    held = book.reserve("held", 20, renew_s=2.0)
    released = book.reserve("released", 20, renew_s=2.0)
    adopted = book.reserve("adopted", 20, renew_s=2.0)
    book.release("released")
    window.landed.add(adopted.key)
    book.adopt(adopted.key, lambda _: None)
    forged = TicketKey("held", EPOCH + 1)  # the right request id, another epoch
    not_held = book.renew([held.key, released.key, adopted.key, forged,
                           TicketKey("unknown", EPOCH)])
    assert not_held == ["released", "adopted", "held", "unknown"]
    assert held.deadline == clock.now + 2.0


def test_renewal_period_is_bounded_by_the_lease_and_bad_durations_are_refused(parts):
    book, _, _, clock, _ = parts
    lease = book.reserve("r1", 20, lease_s=1.0, renew_s=30.0)
    assert lease.renew_s == 1.0 and lease.deadline == lease.cap == clock.now + 1.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument, match="renew_lease_ms=.*finite number >= 0"):
            book.reserve("r2", 20, renew_s=bad)
        with pytest.raises(InvalidArgument, match="lease_ms=.*finite number >= 0"):
            book.reserve("r2", 20, lease_s=bad)
        with pytest.raises(InvalidArgument, match="renew_lease_ms"):
            book.renew([lease.key], bad)
    assert len(book) == 1


def test_an_unrenewable_lease_is_held_but_not_extended(parts):
    book, _, _, clock, _ = parts
    lease = book.reserve("r1", 20, lease_s=3.0)
    clock.now += 2.0
    assert book.renew([lease.key], 10.0) == [] and lease.deadline == 103.0
