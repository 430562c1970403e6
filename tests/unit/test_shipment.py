"""A prefill's last part started early (pdserve.prefill.shipment): `prepare` on the request's
thread while the last chunk computes, `begin` on the engine's thread once its KV is ready,
`finish` completing it. The part is made and sent exactly once whatever the order of events;
`begin` starts nothing while an earlier part is in flight or after a cancel; a cancel reaches
a prepared part that nobody finishes; a failure to prepare leaves the part to `finish`."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from pdserve.common.errors import Aborted
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.tickets import TicketKey
from pdserve.prefill.shipment import Shipment

pytestmark = pytest.mark.unit
DEST = Destination("agent:1", 1, "pool", tuple(range(100, 104)), None)


class _Part:
    def __init__(self, log: list[tuple[str, list[int]]], pages: list[int], *,
                 fail_prepare: bool = False, hold: threading.Event | None = None):
        self.log, self.pages = log, pages
        self.fail_prepare, self.hold = fail_prepare, hold
        self.cancelled = False

    def prepare(self) -> None:
        self.log.append(("prepare", self.pages))
        if self.fail_prepare:
            raise RuntimeError("a bug in the lane")

    def begin(self) -> bool:
        self.log.append(("begin", self.pages))
        return True

    def result(self) -> TransferReport:
        if self.hold is not None:
            assert self.hold.wait(10)
        if self.cancelled:
            raise Aborted("cancelled")
        self.log.append(("result", self.pages))
        return TransferReport(1.0, 4096 * len(self.pages), len(self.pages), "tcp", 1, 1.0)

    def settle(self) -> None:
        pass

    def cancel(self) -> None:
        self.cancelled = True
        self.log.append(("cancel", self.pages))


class _Sends:
    def __init__(self, **part_kw: object):
        self.log: list[tuple[str, list[int]]] = []
        self.parts: list[_Part] = []
        self._kw = part_kw

    def send(self, ticket: TicketKey, src_pool_id: str, src_page_ids: list[int],
             destination: Destination, timeout_s: float) -> _Part:
        assert list(destination.page_ids) == [100 + p - 10 for p in src_page_ids]
        part = _Part(self.log, src_page_ids, **self._kw)  # type: ignore[arg-type]
        self.parts.append(part)
        return part


@pytest.fixture
def executor():
    with ThreadPoolExecutor(2) as pool:
        yield pool


def _shipment(sends: _Sends, executor: ThreadPoolExecutor) -> Shipment:
    return Shipment(sends, TicketKey("r", 1), "src", DEST, 5.0, executor)  # type: ignore[arg-type]


def test_a_prepared_part_is_begun_then_finished_once(executor) -> None:
    sends = _Sends()
    shipment = _shipment(sends, executor)
    shipment.prepare([10, 11, 12, 13])
    shipment.begin()
    report = shipment.finish([10, 11, 12, 13], 0.0)
    assert sends.log == [("prepare", [10, 11, 12, 13]), ("begin", [10, 11, 12, 13]),
                         ("result", [10, 11, 12, 13])]
    assert report.kv_pages == 4 and report.transport == "tcp"


def test_the_last_part_is_only_the_pages_earlier_chunks_did_not_ship(executor) -> None:
    sends = _Sends()
    shipment = _shipment(sends, executor)
    shipment.ship([10, 11])
    shipment.prepare([10, 11, 12, 13])
    report = shipment.finish([10, 11, 12, 13], 0.0)
    assert sorted(p for what, p in sends.log if what == "result") == [[10, 11], [12, 13]]
    assert report.kv_pages == 4


def test_begin_starts_nothing_while_an_earlier_part_is_in_flight(executor) -> None:
    hold = threading.Event()
    sends = _Sends(hold=hold)
    shipment = _shipment(sends, executor)
    shipment.ship([10, 11])  # in flight until `hold`
    shipment.prepare([10, 11, 12, 13])
    shipment.begin()
    assert ("begin", [12, 13]) not in sends.log  # parts go one at a time
    hold.set()
    assert shipment.finish([10, 11, 12, 13], 0.0).kv_pages == 4


def test_without_a_prepared_part_finish_sends_the_rest_itself(executor) -> None:
    sends = _Sends()
    shipment = _shipment(sends, executor)
    shipment.begin()  # the request's thread had not prepared it yet: nothing to start
    assert shipment.finish([10, 11, 12, 13], 0.0).kv_pages == 4
    assert sends.log == [("result", [10, 11, 12, 13])]


def test_a_cancel_reaches_a_prepared_part_nobody_finishes(executor) -> None:
    sends = _Sends()
    shipment = _shipment(sends, executor)
    shipment.prepare([10, 11, 12, 13])
    shipment.cancel()  # the request failed or ended at its first token
    shipment.begin()
    assert sends.log == [("prepare", [10, 11, 12, 13]), ("cancel", [10, 11, 12, 13])]
    with pytest.raises(Aborted):
        shipment.finish([10, 11, 12, 13], 0.0)


def test_a_part_that_failed_to_prepare_is_still_sent_by_finish(executor) -> None:
    sends = _Sends(fail_prepare=True)
    shipment = _shipment(sends, executor)
    shipment.prepare([10, 11, 12, 13])  # logged, not raised: not the request's failure
    assert shipment.finish([10, 11, 12, 13], 0.0).kv_pages == 4
    assert [what for what, _ in sends.log] == ["prepare", "result"]
    assert len(sends.parts) == 1
