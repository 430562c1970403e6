"""The write header on the wire: every field read back exactly (binary body, runs as
little-endian int32 pairs at the end), and a header cut short, with lengths that do not add
up, of the old JSON version, or with a field out of range is refused with BadRequest."""

from __future__ import annotations

import random
import struct

import pytest
from pdserve.common.kv.errors import BadRequest
from pdserve.common.kv.wire import MAGIC, PREFIX_BYTES, WriteHeader
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
    with pytest.raises(BadRequest, match="out of range"):  # runs are int32 on the wire
        _header(((2**31, 1),)).encode()


def test_every_field_round_trips_with_text_and_bytes_of_any_content() -> None:
    header = WriteHeader(xfer_id=2**36 - 1, ticket=TicketKey("req-é🎉", 2**64 - 1),
                         dst_agent_epoch=2**63, dst_pool_id="decode@10.0.0.1:50051/3",
                         fingerprint=LayoutFingerprint("m/ü", "rev", "bfloat16", 30, 3, 64, 16,
                                                       1, 2),
                         page_bytes=-1, dst_runs=((5, 1), (0, 2)), timeout_ms=float("inf"),
                         reply_to=bytes(range(256)), traceparent="00-" + "a" * 32 + "-" +
                         "b" * 16 + "-01", grant=b"\0grant\xff", sender="agent-ä")
    assert WriteHeader.decode(header.encode()) == header
    assert WriteHeader.decode(memoryview(header.encode())) == header  # as UCX hands it over
    assert WriteHeader.size(header.encode()[:PREFIX_BYTES]) == len(header.encode())


def test_a_body_whose_lengths_do_not_add_up_is_refused() -> None:
    data = bytearray(_header(((0, 1),)).encode())
    body_len = struct.unpack_from("<I", data, 8)[0]
    for wrong in (body_len - 1, body_len + 1):
        bad = bytearray(data)
        struct.pack_into("<I", bad, 8, wrong)
        with pytest.raises(BadRequest, match="malformed KV write header"):
            WriteHeader.decode(bytes(bad))


def test_a_version_1_json_header_is_refused_by_name() -> None:
    old = struct.pack("<4sBxxxII", MAGIC, 1, 2, 0) + b"{}"
    with pytest.raises(BadRequest, match="not a pdserve KV header .* version 1"):
        WriteHeader.decode(old)
    with pytest.raises(BadRequest, match="version 1"):
        WriteHeader.size(old[:PREFIX_BYTES])


def test_a_field_out_of_range_is_refused_when_encoding() -> None:
    with pytest.raises(BadRequest, match="out of range"):
        WriteHeader(xfer_id=-1, ticket=TicketKey("r", 1), dst_agent_epoch=1, dst_pool_id="p",
                    fingerprint=FP, page_bytes=4096, dst_runs=((0, 1),),
                    timeout_ms=1.0).encode()
