"""What the Python floor routers send, message by message, for the two request shapes `pdserve
bench router` gives them: a prompt prefilled on a prefill worker (Reserve, Prefill, Decode) and
one prefilled on the decode worker (Reserve, Decode with local_prefill: the first token comes
on the Decode stream, and the Timing after it names the decode worker for both)."""

from __future__ import annotations

from pdserve.bench.router_floor import Shape, _Request
from pdserve.v1 import common_pb2, decode_pb2, prefill_pb2, router_pb2


def _held(here: bool) -> decode_pb2.ReserveResponse:
    return decode_pb2.ReserveResponse(ticket=common_pb2.Ticket(request_id="r1",
                                                               decode_worker="decode-7"),
                                      prefilling_here=here)


def _kinds(messages: list[router_pb2.GenerateResponse]) -> list[str]:
    return [str(m.WhichOneof("kind")) for m in messages]


def test_a_prompt_prefilled_on_the_decode_worker_gets_its_timing_after_the_first_token():
    r = _Request(router_pb2.GenerateRequest(token_ids=[11, 12, 13], max_tokens=4,
                                            request_id="r1"), 0, Shape(interval=4, here_below=8))
    assert r.reserve.prefill_here_below_tokens == 8
    decode = r.local(_held(True))
    assert decode.local_prefill and decode.stream_interval == 4 and not decode.first_token
    assert r.relay(decode_pb2.DecodeResponse(decode_start_ms=1.0)) == []  # no token yet
    first = r.relay(decode_pb2.DecodeResponse(token_ids=[40], prefill_ms=2.5))
    assert _kinds(first) == ["delta", "timing"]
    assert first[1].timing.prefill_worker == first[1].timing.decode_worker == "decode-7"
    assert first[1].timing.prefill_ms == 2.5
    rest = r.relay(decode_pb2.DecodeResponse(token_ids=[41, 42, 43], finish_reason="length"))
    assert _kinds(rest) == ["delta"] and r.reason == "length"  # one Timing only
    assert r.finish().finish.completion_tokens == 4


def test_a_prompt_prefilled_remotely_sends_its_timing_with_the_prefills_token():
    r = _Request(router_pb2.GenerateRequest(token_ids=[11, 12, 13], max_tokens=4), 3, Shape())
    assert r.rid == "floor3" and r.reserve.prefill_here_below_tokens == 0
    held = _held(False)
    assert r.prefill(held).ticket.decode_worker == "decode-7"
    sent, decode = r.started(held, prefill_pb2.PrefillResponse(first_token=40,
                                                               worker_id="prefill-2"))
    assert _kinds(sent) == ["delta", "timing"] and sent[1].timing.prefill_worker == "prefill-2"
    assert decode is not None and decode.first_token == 40 and not decode.local_prefill
    assert _kinds(r.relay(decode_pb2.DecodeResponse(token_ids=[41]))) == ["delta"]
