"""The decode worker's book of sequences started at Reserve (worker/early.py), with a fake
clock: each is handed to its own Decode call once, renewed up to its lease, and ended exactly
once when its holder aborts it, its lease passes, or the worker stops."""

from __future__ import annotations

import queue

from pdserve.common.tickets import TicketKey
from pdserve.worker.early import EarlyStarts

from tests.fakes import FakeClock


def _book():
    ended: list[tuple[str, str]] = []
    clock = FakeClock(100.0)
    return EarlyStarts(lambda rid, why: ended.append((rid, why)), clock), clock, ended


def test_a_start_is_taken_once_and_only_with_its_own_ticket():
    book, _, ended = _book()
    key = TicketKey("r1", 7)
    outputs: queue.SimpleQueue = queue.SimpleQueue()
    book.add(key, outputs, received=1.0, lease_s=10.0, renew_s=0.0)
    assert book.take(TicketKey("r1", 6)) is None  # another epoch: a stale ticket
    start = book.take(key)
    assert start is not None and start.outputs is outputs and start.received == 1.0
    assert book.take(key) is None and "r1" not in book
    assert book.drop("r1") is False and ended == []  # taken: its stream owns it now


def test_a_renewed_start_lives_until_renewals_stop_but_never_past_its_lease():
    book, clock, ended = _book()
    key = TicketKey("r1", 1)
    book.add(key, queue.SimpleQueue(), 0.0, lease_s=5.0, renew_s=1.0)
    for _ in range(3):
        clock.now += 0.9
        assert book.renew([key, TicketKey("other", 1)], 0.0) == [TicketKey("other", 1)]
        assert book.expire() == []
    clock.now += 1.01  # no renewal for longer than its period
    assert book.expire() == ["r1"] and [rid for rid, _ in ended] == ["r1"]
    assert "lease passed" in ended[0][1]

    book.add(TicketKey("r2", 1), queue.SimpleQueue(), 0.0, lease_s=2.0, renew_s=1.0)
    for _ in range(4):  # renewed all along, but the lease caps it at 2 s
        clock.now += 0.6
        book.renew([TicketKey("r2", 1)], 0.0)
    assert book.expire() == ["r2"]


def test_abort_and_stop_end_each_start_once():
    book, _, ended = _book()
    for rid in ("a", "b", "c"):
        book.add(TicketKey(rid, 1), queue.SimpleQueue(), 0.0, lease_s=10.0, renew_s=0.0)
    assert book.drop("a") is True and book.drop("a") is False
    book.close()
    assert sorted(rid for rid, _ in ended) == ["a", "b", "c"]
    assert book.expire() == [] and "b" not in book
