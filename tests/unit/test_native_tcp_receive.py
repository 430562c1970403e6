"""The receiving agent's native TCP write (pdserve.kvtransfer.native `recv`, csrc/kvcopy.c's
pdserve_kv_recv) on a real socket with the ticket book it answers to: an armed handoff's bytes
land byte-exact straight from the socket, "ready" goes out only above the eager size and "done"
at the end, and the ticket completes in the book; a header that differs from what was armed is
declined with nothing read; a cancel stops it with the bytes read so far reported (the stream
can be put back in step); a sender that hangs up or goes quiet past its timeout ends it with
nothing counted as landed, and the ticket can be written again. `recv_rest` reads the rest of
the header itself (the wait for it stays in Python): a handoff whose header arrives in pieces
lands; a declined header is left whole in the caller's buffer; a prefix that is not a pdserve
header is declined with nothing more read; a sender gone mid-header ends it with nothing
read."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest
from pdserve.common.kv.wire import PREFIX_BYTES, WriteHeader
from pdserve.kvtransfer import native

from tests.unit.test_native_receive import KEY, Rig

pytestmark = pytest.mark.unit
READY, DONE = b"<ready>", b"<done>"  # what the transport passes: the wire's encoded replies
LOWAT = 64 << 10


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def _recv(rig: Rig, header: WriteHeader, eager_bytes: int, outcome: list[int]) -> None:
    outcome.append(rig.native.recv(header.encode(), rig.ours.fileno(), eager_bytes, READY, DONE,
                                   LOWAT, 20, rig.out))


def _started(rig: Rig, header: WriteHeader) -> tuple[threading.Thread, list[int]]:
    """The native read of `header` on its own thread, once it has sent "ready"."""
    outcome: list[int] = []
    receiver = threading.Thread(target=_recv, args=(rig, header, 0, outcome))
    receiver.start()
    assert _read_exactly(rig, len(READY)) == READY
    return receiver, outcome


def _read_exactly(rig: Rig, n: int) -> bytes:
    rig.theirs.settimeout(5)
    got = b""
    while len(got) < n:
        chunk = rig.theirs.recv(n - len(got))
        assert chunk, "the receiver closed its end"
        got += chunk
    return got


def _pages(rig: Rig, start: int, n: int) -> bytes:
    b = rig.fp.page_bytes
    return rig.src[start * b:(start + n) * b].tobytes()


def test_an_eager_handoff_lands_from_the_socket_and_completes_the_ticket(rig: Rig) -> None:
    rig.expect([3, 4, 5, 9])
    header = rig.header(((3, 3), (9, 1)))
    rig.theirs.sendall(_pages(rig, 0, 3) + _pages(rig, 10, 1))  # the bytes behind the header
    outcome: list[int] = []
    _recv(rig, header, header.kv_bytes, outcome)  # at most the eager size: no "ready"
    assert outcome == [native.REPLIED] and int(rig.out[0]) == header.kv_bytes
    assert _read_exactly(rig, len(DONE)) == DONE
    assert rig.landed(0, 3, 3) and rig.landed(10, 9, 1)
    assert not rig.dst[:3 * rig.fp.page_bytes].any()  # nothing outside the runs
    assert rig.book.status(KEY).complete


def test_a_larger_handoff_waits_for_ready_then_lands_across_many_reads(rig: Rig) -> None:
    pages = list(range(40))
    rig.expect(pages)
    receiver, outcome = _started(rig, rig.header(((0, 40),)))
    data = _pages(rig, 0, 40)
    for at in range(0, len(data), 5000):  # in pieces smaller than the wake-up mark
        rig.theirs.sendall(data[at:at + 5000])
    receiver.join(10)
    assert outcome == [native.REPLIED] and _read_exactly(rig, len(DONE)) == DONE
    assert rig.landed(0, 0, 40) and rig.book.status(KEY).complete


def test_a_header_that_differs_from_what_was_armed_is_declined_with_nothing_read(
        rig: Rig) -> None:
    rig.expect([0, 1])
    rig.theirs.sendall(b"payload")
    outcome: list[int] = []
    _recv(rig, rig.header(((0, 1),)), 1 << 20, outcome)  # armed for two pages
    assert outcome == [native.DECLINED] and int(rig.out[0]) == 0
    rig.ours.settimeout(5)
    assert rig.ours.recv(7) == b"payload"  # left for the Python path
    assert not rig.book.status(KEY).complete


def test_a_cancel_stops_the_read_and_reports_what_arrived(rig: Rig) -> None:
    rig.expect(list(range(40)))
    receiver, outcome = _started(rig, rig.header(((0, 40),)))
    half = _pages(rig, 0, 20)
    rig.theirs.sendall(half)
    deadline = time.monotonic() + 10
    while rig.dst[len(half) - 1] != rig.src[len(half) - 1] and time.monotonic() < deadline:
        time.sleep(0.005)  # bounded: until the receiver has read the first half
    was_pending, was_complete = rig.book.cancel(KEY, 5.0)
    receiver.join(10)
    assert outcome == [native.STOPPED] and int(rig.out[0]) == len(half)
    assert was_pending and not was_complete


@pytest.mark.parametrize("how", ["hang-up", "quiet"])
def test_a_sender_gone_or_quiet_ends_it_and_the_ticket_can_be_written_again(
        rig: Rig, how: str) -> None:
    rig.expect(list(range(8)))
    header = rig.header(((0, 8),), timeout_ms=300.0)
    started = time.monotonic()
    receiver, outcome = _started(rig, header)
    rig.theirs.sendall(_pages(rig, 0, 2))
    if how == "hang-up":
        rig.theirs.close()
    receiver.join(10)
    assert outcome == [native.BROKEN if how == "hang-up" else native.TIMED_OUT]
    if how == "quiet":
        assert 0.3 <= time.monotonic() - started < 5.0  # the sender's timeout, not longer
    assert np.array_equal(rig.dst[:2 * rig.fp.page_bytes], rig.src[:2 * rig.fp.page_bytes])
    assert not rig.book.status(KEY).complete  # nothing counts as landed
    again = rig.book.begin_write(KEY, rig.pool.pool_id, list(range(8)))  # a retry may write it
    rig.book.finish_write(again, True, 8 * rig.fp.page_bytes)
    assert rig.book.status(KEY).complete


def _rest(rig: Rig, prefix: bytes, eager: int, buf_bytes: int = 4096) -> tuple[int, bytearray]:
    buf = bytearray(buf_bytes)
    buf[:len(prefix)] = prefix
    done = rig.native.recv_rest(buf, rig.ours.fileno(), eager, READY, DONE, LOWAT, 20, rig.out)
    return done, buf


def test_a_header_arriving_in_pieces_is_read_in_c_and_its_handoff_lands(rig: Rig) -> None:
    rig.expect([2, 3])
    header = rig.header(((2, 2),)).encode()
    rig.theirs.sendall(header[PREFIX_BYTES:PREFIX_BYTES + 5])  # the rest comes later
    outcome: list[tuple[int, bytearray]] = []
    receiver = threading.Thread(target=lambda: outcome.append(
        _rest(rig, header[:PREFIX_BYTES], 1 << 20)))
    receiver.start()
    rig.theirs.sendall(header[PREFIX_BYTES + 5:] + _pages(rig, 0, 2))
    receiver.join(10)
    assert outcome and outcome[0][0] == native.REPLIED
    assert int(rig.out[1]) == len(header) and int(rig.out[0]) == 2 * rig.fp.page_bytes
    assert _read_exactly(rig, len(DONE)) == DONE
    assert rig.landed(0, 2, 2) and rig.book.status(KEY).complete


def test_a_declined_header_is_left_whole_in_the_buffer(rig: Rig) -> None:
    rig.expect([0, 1])
    header = rig.header(((0, 1),)).encode()  # armed for two pages
    rig.theirs.sendall(header[PREFIX_BYTES:] + b"payload")
    done, buf = _rest(rig, header[:PREFIX_BYTES], 1 << 20)
    assert done == native.DECLINED and int(rig.out[1]) == len(header)
    assert bytes(buf[:len(header)]) == header
    rig.ours.settimeout(5)
    assert rig.ours.recv(7) == b"payload"  # the bytes left for the Python path


@pytest.mark.parametrize("prefix", [b"GET / HTTP/1.1\r\n\r\n"[:PREFIX_BYTES], "long"])
def test_what_is_not_a_header_it_reads_is_declined_with_nothing_more_read(
        rig: Rig, prefix: bytes | str) -> None:
    if prefix == "long":  # a pdserve header longer than the buffer
        prefix = rig.header(tuple((i, 1) for i in range(0, 40, 2))).encode()[:PREFIX_BYTES]
    rig.theirs.sendall(b"rest")
    done, _ = _rest(rig, prefix, 1 << 20, buf_bytes=64)
    assert done == native.DECLINED and int(rig.out[1]) == 0
    rig.ours.settimeout(5)
    assert rig.ours.recv(4) == b"rest"


def test_a_sender_gone_mid_header_ends_it_with_nothing_read(rig: Rig) -> None:
    rig.expect([0])
    header = rig.header(((0, 1),)).encode()
    rig.theirs.sendall(header[PREFIX_BYTES:-3])
    rig.theirs.close()
    done, _ = _rest(rig, header[:PREFIX_BYTES], 1 << 20)
    assert done == native.BROKEN and int(rig.out[1]) == 0
    assert not rig.book.status(KEY).complete

