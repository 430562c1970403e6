"""The agent's ticket book with a pipelined handoff: the pages of a ticket land in parts, one
write at a time; it is complete only once every reserved page landed; a part may not rewrite a
landed page or touch a page not reserved; a failed part can be sent again; a cancel waits for
the part in flight and closes the ticket for good; a renewal keeps what landed."""

from __future__ import annotations

import threading

import pytest
from pdserve.common.kv.errors import BadRequest, TicketBusy, TicketCancelled
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.tickets import TicketBook

pytestmark = pytest.mark.unit
KEY = TicketKey("r", 1)


def test_a_ticket_completes_only_when_every_reserved_page_landed() -> None:
    book = TicketBook()
    book.expect(KEY, "pool", [10, 11, 12, 13, 14], lease_s=10)
    part = book.begin_write(KEY, "pool", [10, 11])
    with pytest.raises(TicketBusy, match="already in flight"):
        book.begin_write(KEY, "pool", [12])  # one write at a time
    book.finish_write(part, True, 200)
    assert not book.status(KEY).complete
    with pytest.raises(TicketBusy, match=r"pages \[11\] .* have already landed"):
        book.begin_write(KEY, "pool", [11, 12])
    with pytest.raises(BadRequest, match="not the pages reserved"):
        book.begin_write(KEY, "pool", [12, 15])
    failed = book.begin_write(KEY, "pool", [12, 13])
    book.finish_write(failed, False, 0)  # stopped midway: may be sent again
    book.expect(KEY, "pool", [14, 13, 12, 11, 10], lease_s=10)  # renewal keeps what landed
    book.finish_write(book.begin_write(KEY, "pool", [12, 13]), True, 200)
    assert not book.status(KEY).complete
    book.finish_write(book.begin_write(KEY, "pool", [14]), True, 100)
    status = book.status(KEY)
    assert status.complete and status.kv_bytes == 500
    with pytest.raises(TicketBusy, match="already landed"):
        book.begin_write(KEY, "pool", [10])
    assert book.cancel(KEY, 1.0) == (False, True)


def test_a_cancel_waits_for_the_part_in_flight_and_closes_the_ticket() -> None:
    book = TicketBook()
    book.expect(KEY, "pool", [1, 2, 3], lease_s=10)
    book.finish_write(book.begin_write(KEY, "pool", [1]), True, 100)
    part = book.begin_write(KEY, "pool", [2])
    answered: list[tuple[bool, bool]] = []
    cancel = threading.Thread(target=lambda: answered.append(book.cancel(KEY, 10.0)))
    cancel.start()
    assert part.abort.wait(10)  # the writer is told to stop ...
    assert not answered  # ... and the cancel has not returned while it writes
    with pytest.raises(TicketCancelled):
        book.finish_write(part, False, 0)
    cancel.join(10)
    assert answered == [(True, False)]
    with pytest.raises(TicketCancelled):
        book.begin_write(KEY, "pool", [3])
    with pytest.raises(BadRequest, match="same pages only"):
        other = TicketKey("s", 1)
        book.expect(other, "pool", [7, 8], lease_s=10)
        book.finish_write(book.begin_write(other, "pool", [7]), True, 100)
        book.expect(other, "pool", [7, 9], lease_s=10)


def test_a_write_given_as_spans_lands_like_one_given_as_pages() -> None:
    """Agents hand the book a write's destination runs: exactly the reserved spans before
    anything landed is the whole handoff (one compare, no per-page sets); any other spans are
    checked page by page, with the same refusals."""
    book = TicketBook()
    book.expect(KEY, "pool", [4, 5, 6, 9, 10], lease_s=10)
    whole = book.begin_write(KEY, "pool", spans=((4, 3), (9, 2)))
    assert whole.writing_pages == {4, 5, 6, 9, 10}
    book.finish_write(whole, True, 500)
    assert book.status(KEY).complete
    with pytest.raises(TicketBusy, match="already landed"):
        book.begin_write(KEY, "pool", spans=((4, 3), (9, 2)))

    other = TicketKey("s", 1)
    book.expect(other, "pool", [4, 5, 6, 9, 10], lease_s=10)
    with pytest.raises(BadRequest, match="not the pages reserved"):
        book.begin_write(other, "pool", spans=((5, 3),))
    book.finish_write(book.begin_write(other, "pool", spans=((9, 2),)), True, 200)
    with pytest.raises(TicketBusy, match=r"pages \[9, 10\] .* have already landed"):
        book.begin_write(other, "pool", spans=((4, 3), (9, 2)))  # the reserved spans, late
    book.finish_write(book.begin_write(other, "pool", spans=((4, 3),)), True, 300)
    status = book.status(other)
    assert status.complete and status.kv_bytes == 500
