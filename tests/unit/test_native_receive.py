"""The receiving agent's native same-host write (pdserve.kvtransfer.native, csrc/kvcopy.c) with
the ticket book it answers to: a write of exactly an armed ticket's pages lands byte-exact,
is answered on the socket and completes the ticket in the book; anything that differs from
what was armed is declined untouched (the Python path then refuses it by name); a cancel, a
renewal, a Python-path write, an expired lease and a closed pool all take the ticket back
first; a cancel racing a write always agrees with the write's answer."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from dataclasses import replace

import numpy as np
import pytest
from pdserve.common.kv.wire import WriteHeader, fingerprint_bytes
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.shm import SharedSegment
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer import native
from pdserve.kvtransfer.native import NativeReceiver
from pdserve.kvtransfer.pool import Pool
from pdserve.kvtransfer.tickets import TicketBook

pytestmark = pytest.mark.unit
FP = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 4)
PAGES = 64
EPOCH = 7
KEY = TicketKey("req-1", 3)
SLICE = 1 << 20


class Rig:
    """A decode agent's book, pool and native table; a sender's pool; one local connection."""

    def __init__(self, fp: LayoutFingerprint = FP, pages: int = PAGES) -> None:
        self.fp, self.pages = fp, pages
        made = NativeReceiver.create()
        assert made is not None, "a C compiler is on this machine: the library must build"
        self.native = made
        self.book = TicketBook(native_writes=self.native)
        self.segment = SharedSegment.create(pages * fp.page_bytes, "test")
        self.pool = Pool("decode/1", "decode", self.segment, pages, fp.page_bytes, fp,
                         self.native)
        self.dst = self.pool.pages(0, pages)
        self.dst[:] = 0
        self.src = np.random.default_rng(1).integers(0, 256, pages * fp.page_bytes,
                                                     dtype=np.uint8)
        self.ours, self.theirs = socket.socketpair()
        self.out = native.out_buffer()

    def expect(self, pages: list[int], lease_s: float = 30.0, key: TicketKey = KEY) -> None:
        self.book.expect(key, self.pool.pool_id, pages, lease_s, arm=lambda exp: self.native.arm(
            exp.key, self.pool.native_handle, self.pool.pool_id, EPOCH, fingerprint_bytes(self.fp),
            self.fp.page_bytes, exp.spans, exp.lease_deadline))

    def header(self, runs: tuple[tuple[int, int], ...], **changes: object) -> WriteHeader:
        header = WriteHeader(xfer_id=1, ticket=KEY, dst_agent_epoch=EPOCH,
                             dst_pool_id=self.pool.pool_id, fingerprint=self.fp,
                             page_bytes=self.fp.page_bytes, dst_runs=runs, timeout_ms=1000.0)
        return replace(header, **changes)  # type: ignore[arg-type]

    def write(self, header: WriteHeader, src_runs: list[list[int]], src_pages: int = 0) -> int:
        return self.native.write(header.encode(), self.src.ctypes.data,
                                 (src_pages or self.pages) * self.fp.page_bytes, src_runs,
                                 self.ours.fileno(), SLICE, self.out)

    def reply(self) -> bytes:
        self.theirs.settimeout(5)
        return self.theirs.recv(64)

    def landed(self, src_start: int, dst_start: int, n: int) -> bool:
        b = FP.page_bytes
        return np.array_equal(self.dst[dst_start * b:(dst_start + n) * b],
                              self.src[src_start * b:(src_start + n) * b])

    def close(self) -> None:
        self.ours.close()
        self.theirs.close()
        del self.dst
        self.pool.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.close()


def test_an_armed_write_lands_is_answered_and_completes_the_ticket(rig: Rig) -> None:
    rig.expect([10, 11, 12, 40, 41])  # two spans, written from two source runs
    done = rig.write(rig.header(((10, 3), (40, 2))), [[0, 3], [20, 2]])
    assert done == native.REPLIED and rig.out[0] == 5 * FP.page_bytes
    assert rig.reply() == b"\x02\0\0\0\0\0\0\0{}"  # localsock's frame of {}
    assert rig.landed(0, 10, 3) and rig.landed(20, 40, 2)
    assert not rig.dst[:10 * FP.page_bytes].any()  # nothing else touched
    status = rig.book.status(KEY)
    assert status.complete and status.kv_bytes == 5 * FP.page_bytes
    assert status.completed_unix_ms > 0
    assert rig.book.cancel(KEY, 1.0) == (False, True)  # decode adopting a landed handoff
    assert rig.write(rig.header(((10, 3), (40, 2))), [[0, 3], [20, 2]]) == native.DECLINED


@pytest.mark.parametrize("change", [
    {"dst_agent_epoch": EPOCH + 1}, {"dst_pool_id": "decode/2"}, {"page_bytes": 2 * FP.page_bytes},
    {"fingerprint": replace(FP, num_layers=3)}, {"dst_runs": ((10, 1),)},
    {"dst_runs": ((10, 1), (11, 1))}, {"dst_runs": ((11, 2),)}, {"ticket": TicketKey("req-1", 4)},
    {"ticket": TicketKey("req-2", 3)},
])
def test_a_write_that_differs_from_what_was_armed_is_declined_untouched(rig: Rig, change) -> None:
    rig.expect([10, 11])
    header = rig.header(((10, 2),), **change)
    runs = [[0, n] for _, n in header.dst_runs]
    assert rig.write(header, runs) == native.DECLINED
    assert not rig.dst.any()
    assert rig.write(rig.header(((10, 2),)), [[0, 2]]) == native.REPLIED  # still armed


@pytest.mark.parametrize("src_runs", [[[0, 3]], [[PAGES - 1, 2]], [[-1, 2]], [[0, 1], [1, 1]],
                                      [[0, 2.0]], [["0", 2]], [], [[0, 2, 9]], None])
def test_source_runs_that_do_not_fit_are_declined_untouched(rig: Rig, src_runs) -> None:
    rig.expect([10, 11])
    assert rig.write(rig.header(((10, 2),)), src_runs) == native.DECLINED
    assert not rig.dst.any()


def test_source_runs_past_the_senders_pool_as_mapped_here_are_declined(rig: Rig) -> None:
    """The mapping's size in bytes bounds the source, whatever page size a header claims."""
    rig.expect([10, 11])
    assert rig.write(rig.header(((10, 2),)), [[3, 2]], src_pages=4) == native.DECLINED
    assert not rig.dst.any()
    assert rig.write(rig.header(((10, 2),)), [[2, 2]], src_pages=4) == native.REPLIED


def test_a_cancelled_expired_closed_or_python_served_ticket_is_not_written_natively(
        rig: Rig) -> None:
    header = rig.header(((10, 2),))
    rig.expect([10, 11])
    assert rig.book.cancel(KEY, 1.0) == (True, False)
    assert rig.write(header, [[0, 2]]) == native.DECLINED

    key = TicketKey("req-2", 1)
    rig.expect([10, 11], lease_s=1e-6, key=key)
    assert rig.write(replace(header, ticket=key), [[0, 2]]) == native.DECLINED  # lease passed
    rig.book.sweep()

    key = TicketKey("req-3", 1)
    rig.expect([10, 11], key=key)
    part = rig.book.begin_write(key, rig.pool.pool_id, [10, 11])  # the Python path took it
    assert rig.write(replace(header, ticket=key), [[0, 2]]) == native.DECLINED
    rig.book.finish_write(part, True, 2 * FP.page_bytes)
    assert not rig.dst.any()

    key = TicketKey("req-4", 1)
    rig.expect([10, 11], key=key)
    rig.native.close_pool(rig.pool.native_handle[0])  # the pool going away
    assert rig.write(replace(header, ticket=key), [[0, 2]]) == native.DECLINED
    assert not rig.dst.any()


def test_a_renewal_rearms_and_an_unasked_ticket_completes_at_the_sweep(rig: Rig) -> None:
    rig.expect([10, 11])
    rig.expect([10, 11], lease_s=60)  # renewal: taken back, armed again
    assert rig.write(rig.header(((10, 2),)), [[0, 2]]) == native.REPLIED
    with pytest.raises(Exception, match="already landed"):
        rig.expect([10, 11])
    key = TicketKey("req-2", 1)
    rig.expect([20], lease_s=0.05, key=key)
    assert rig.write(rig.header(((20, 1),), ticket=key), [[5, 1]]) == native.REPLIED
    rig.book._clock = lambda: 1e12  # the lease long passed: the sweep settles it as landed
    rig.book.sweep()
    assert rig.book.status(key).complete


def test_a_cancel_racing_a_native_write_agrees_with_its_answer() -> None:
    """Whichever wins, the sender's answer and the book agree: the write answered done and the
    ticket was complete, or it stopped (the sender hears TicketCancelled) and it was not.
    Pages of 1 MiB copied a page per slice, the cancel let go as the write starts."""
    rig = Rig(LayoutFingerprint("m", "r", "float32", 16, 8, 128, 16), 24)
    seen = set()
    for i in range(12):
        key = TicketKey(f"race-{i}", 1)
        rig.expect(list(range(rig.pages)), key=key)
        outcome: list[int] = []
        started = threading.Event()

        def write(k: TicketKey = key, started: threading.Event = started,
                  outcome: list[int] = outcome) -> None:
            header = rig.header(((0, rig.pages),), ticket=k).encode()
            started.set()
            outcome.append(rig.native.write(header, rig.src.ctypes.data, rig.src.nbytes,
                                            [[0, rig.pages]], rig.ours.fileno(),
                                            rig.fp.page_bytes, rig.out))
        writer = threading.Thread(target=write)
        writer.start()
        started.wait(10)
        was_pending, was_complete = rig.book.cancel(key, 5.0)
        writer.join(10)
        assert outcome and outcome[0] in (native.REPLIED, native.STOPPED, native.DECLINED)
        if outcome[0] == native.REPLIED:
            assert was_complete and not was_pending
            assert rig.reply().endswith(b"{}")
        else:  # stopped midway, or the cancel came first: nothing counts as landed
            assert was_pending and not was_complete
        seen.add(outcome[0])
    rig.close()


def test_arming_stops_quietly_when_the_table_is_full(rig: Rig) -> None:
    armed = [rig.native.arm(TicketKey(f"t{i}", 1), rig.pool.native_handle, rig.pool.pool_id, EPOCH,
                            fingerprint_bytes(FP), FP.page_bytes, ((i % PAGES, 1),), 1e12)
             for i in range(1100)]
    assert all(armed[:1024]) and not any(armed[1024:])
    for i in range(1024):
        state, _, _ = rig.native.take(TicketKey(f"t{i}", 1))
        assert state == native.ARMED
    assert rig.native.arm(TicketKey("again", 1), rig.pool.native_handle, rig.pool.pool_id, EPOCH,
                          fingerprint_bytes(FP), FP.page_bytes, ((0, 1),), 1e12)
