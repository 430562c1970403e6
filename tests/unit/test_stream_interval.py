"""A sequence's Decode messages N tokens to a message: the first goes out as it comes, then
the tokens wait for N or the finish, which carries what is left; nothing is lost or reordered,
and an interval of 0 or 1 (or one out of range) is what the worker's Decode call checks."""

from __future__ import annotations

import asyncio

import pytest
from pdserve.common.errors import InvalidArgument
from pdserve.common.stream_interval import MAX_INTERVAL, checked, every_n, every_n_async
from pdserve.v1 import decode_pb2


def _messages(n: int, finish: str = "length") -> list[decode_pb2.DecodeResponse]:
    """A decode start (no token), then n tokens one a message, the last finishing."""
    out = [decode_pb2.DecodeResponse(decode_start_ms=1.5)]
    out += [decode_pb2.DecodeResponse(token_ids=[100 + i],
                                      finish_reason=finish if i == n - 1 else "")
            for i in range(n)]
    return out


def _shape(messages) -> list[list[int]]:
    return [list(m.token_ids) for m in messages]


def test_tokens_go_n_to_a_message_after_the_first_and_the_finish_takes_the_rest():
    out = list(every_n(iter(_messages(11)), 4))
    assert _shape(out) == [[], [100, 101, 102, 103], [104, 105, 106, 107], [108, 109, 110]]
    assert out[0].decode_start_ms == 1.5
    assert [m.finish_reason for m in out] == ["", "", "", "length"]


def test_steps_that_came_at_once_keep_every_message_n_aligned():
    """A reader that fell behind gets several engine steps in one message (3, 2, then 8
    tokens): whole multiples of N go out, the odd rest waits, the finish takes what is left."""
    steps = [[], [100, 101, 102], [103, 104], list(range(105, 113)), [113]]

    def messages(finish: str) -> list[decode_pb2.DecodeResponse]:
        out = [decode_pb2.DecodeResponse(token_ids=ids) for ids in steps]
        out[-1].finish_reason = finish
        return out

    aligned = [[], [100, 101, 102, 103], list(range(104, 112)), [112, 113]]
    out = list(every_n(iter(messages("length")), 4))
    assert _shape(out) == aligned and out[-1].finish_reason == "length"
    assert _shape(every_n(iter(messages("")), 4)) == aligned  # no finish: the rest still comes


def test_a_finish_before_n_tokens_goes_out_at_once():
    out = list(every_n(iter(_messages(2, finish="stop")), 8))
    assert _shape(out) == [[], [100, 101]] and out[-1].finish_reason == "stop"


def test_an_interval_of_one_or_zero_changes_nothing():
    for interval in (0, 1):
        assert _shape(every_n(iter(_messages(5)), interval)) == _shape(_messages(5))


def test_held_tokens_are_not_lost_when_the_messages_end_without_a_finish():
    messages = _messages(3, finish="")
    assert _shape(every_n(iter(messages), 8)) == [[], [100, 101, 102]]


def test_the_async_form_streams_the_same():
    async def source():
        for message in _messages(11):
            yield message

    async def collect():
        return [m async for m in every_n_async(source(), 4)]

    assert _shape(asyncio.run(collect())) == _shape(every_n(iter(_messages(11)), 4))


def test_an_interval_out_of_range_is_refused_by_name():
    assert checked(0) == 0 and checked(MAX_INTERVAL) == MAX_INTERVAL
    with pytest.raises(InvalidArgument, match=r"stream_interval=4097: must be 0\.\.4096"):
        checked(MAX_INTERVAL + 1)
