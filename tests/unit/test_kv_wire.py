"""The write header's destination runs on the wire: little-endian int32 pairs after the JSON,
read back exactly, and a header whose runs are cut short or out of range is refused."""

from __future__ import annotations

import random
import struct

import pytest
from pdserve.common.kv.errors import BadRequest
from pdserve.common.kv.wire import PREFIX_BYTES, WriteHeader
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey

pytestmark = pytest.mark.unit
FP = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 16)


def _header(runs: tuple[tuple[int, int], ...]) -> WriteHeader:
    return WriteHeader(xfer_id=7, ticket=TicketKey("req", 3), dst_agent_epoch=9,
                       dst_pool_id="p", fingerprint=FP, page_bytes=4096, dst_runs=runs,
                       timeout_ms=1000.0, reply_to=b"\x00\x01", sender="a")


def test_runs_round_trip_as_little_endian_int32_pairs() -> None:
    rng = random.Random(5)
    for n in (0, 1, 2, 7, 1000):
        runs = tuple((rng.randint(-2**31, 2**31 - 1), rng.randint(-2**31, 2**31 - 1))
                     for _ in range(n))
        data = _header(runs).encode()
        assert WriteHeader.decode(data) == _header(runs)
        tail = data[len(data) - 8 * n:]
        assert struct.unpack(f"<{2 * n}i", tail) == tuple(x for run in runs for x in run)


def test_a_header_with_runs_cut_short_or_too_wide_is_refused() -> None:
    data = _header(((0, 2), (5, 1))).encode()
    for cut in (1, 4, 8, 15):
        with pytest.raises(BadRequest, match="malformed KV write header"):
            WriteHeader.decode(data[:-cut])
    with pytest.raises(BadRequest):
        WriteHeader.decode(data[:PREFIX_BYTES - 1])
    with pytest.raises(OverflowError):
        _header(((2**31, 1),)).encode()
