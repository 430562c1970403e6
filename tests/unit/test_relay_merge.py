"""A relay that fell behind its decode worker sends what has piled up as one message: the
tokens that arrived on the shared decode stream behind the one being relayed are appended to
it, in order; an error or a delegation waiting behind them is raised or followed only after
those tokens went out, and the finish ends the merged message."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry import trace
from pdserve.router.mux import SequenceFailed, SequenceStream
from pdserve.router.started import DecodeStream, Parked
from pdserve.v1 import decode_pb2


def _seq() -> SequenceStream:
    return SequenceStream(None, decode_pb2.DecodeRequest(), None)  # type: ignore[arg-type]


def _update(*tokens: int, finish: str = "", error: str = "") -> decode_pb2.SequenceUpdate:
    last = bool(finish or error)
    if error:
        return decode_pb2.SequenceUpdate(request_id="r", error_code=error,
                                         error_message="worker failed", last=True)
    return decode_pb2.SequenceUpdate(request_id="r", last=last, message=decode_pb2.DecodeResponse(
        token_ids=list(tokens), finish_reason=finish))


def _stream(seq: SequenceStream) -> DecodeStream:
    return DecodeStream(seq, decode_pb2.DecodeResponse(token_ids=[1], decode_start_ms=2.0),
                        trace.INVALID_SPAN)


def test_tokens_that_piled_up_go_out_as_one_message_and_the_finish_ends_it():
    seq = _seq()
    for update in (_update(2), _update(3), _update(4, 5), _update(6, finish="length")):
        seq.put(update)
    merged: list[int] = []
    messages = list(_stream(seq).messages(on_merged=merged.append))
    assert [list(m.token_ids) for m in messages] == [[1], [2, 3, 4, 5, 6]]
    assert messages[-1].finish_reason == "length"
    assert merged == [3]  # three messages went out inside the one ahead of them


def test_a_relay_that_keeps_up_sends_each_message_as_it_came():
    seq = _seq()
    merged: list[int] = []
    out = _stream(seq).messages(on_merged=merged.append)
    assert list(next(out).token_ids) == [1]
    seq.put(_update(2))
    assert list(next(out).token_ids) == [2]
    seq.put(_update(3, finish="stop"))
    assert list(next(out).token_ids) == [3]
    assert next(out, None) is None
    assert merged == []


def test_an_error_behind_tokens_is_raised_after_they_went_out():
    seq = _seq()
    for update in (_update(2), _update(3), _update(error="INTERNAL")):
        seq.put(update)
    out = _stream(seq).messages()
    assert list(next(out).token_ids) == [1]
    assert list(next(out).token_ids) == [2, 3]
    with pytest.raises(SequenceFailed) as failed:
        next(out)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert failed.value.details() == "worker failed"


def test_a_cancel_behind_tokens_ends_the_stream_after_them():
    seq = _seq()
    seq.put(_update(2))
    seq.put(SequenceFailed(grpc.StatusCode.CANCELLED, "Locally cancelled by application!"))
    out = _stream(seq).messages()
    next(out)
    assert list(next(out).token_ids) == [2]
    with pytest.raises(SequenceFailed):
        next(out)


def test_a_parking_relay_parks_only_when_nothing_is_there_and_merges_what_is():
    seq = _seq()
    out = _stream(seq).messages(parking=True)
    assert list(next(out).token_ids) == [1]
    parked = next(out)
    assert isinstance(parked, Parked)
    resumed: list[bool] = []
    assert parked.park(resumed.append)
    seq.put(_update(2), inline=True)
    seq.put(_update(3))
    assert resumed == [True]
    assert list(next(out).token_ids) == [2, 3]
    assert isinstance(next(out), Parked)


def test_a_delegated_sequence_follows_its_own_call_after_the_tokens_before_it():
    seq = _seq()
    seq.put(_update(2))
    seq.delegate(iter([decode_pb2.DecodeResponse(token_ids=[3]),
                       decode_pb2.DecodeResponse(token_ids=[4], finish_reason="stop")]))
    assert [list(m.token_ids) for m in _stream(seq).messages()] == [[1], [2], [3], [4]]
