"""Prefix reuse end to end (real processes, `pdserve up`, the tiny model): a conversation's
second turn ships only the pages the decode worker lacks, both sides report what their caches
held, tokens stay equal to transformers, and the counters say what was not sent. Co-located
serving reuses its cache the same way."""

from __future__ import annotations

import json
import time
import urllib.request

import grpc
import pytest
import torch

from tests.service.stack import collect, pdserve_stack
from tests.support import wait_for

pytestmark = pytest.mark.service

BS = 16
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference(hf, prompt: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_TOKENS,
                      min_new_tokens=MAX_TOKENS, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _generate(stack, prompt: list[int]):
    return collect(stack.generate(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                  ignore_eos=True))


def _metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    # Every uncached part goes to the prefill pool here (tests/conftest.py), whatever its
    # length; prefill on the decode worker has its own test below.
    with pdserve_stack(env={"PDSERVE_PREFILL_CHUNK_SIZE": "32"}) as s:
        yield s


def test_a_second_turn_ships_only_the_pages_decode_lacks(stack, hf):
    turn1 = _tokens(1, 70)
    ids1, _, timing1, _ = _generate(stack, turn1)
    assert ids1 == _reference(hf, turn1)
    assert (timing1.decode_cached_tokens, timing1.prefill_cached_tokens) == (0, 0)
    assert timing1.kv_pages == timing1.prompt_pages == -(-70 // BS)
    assert timing1.prefill_on == "prefill"

    # Turn 2 re-sends turn 1 and its answer, plus new tokens. Decode wrote KV for the prompt
    # and every output token but the last: 77 tokens, 4 full pages; prefill holds turn 1's
    # 4 full prompt pages.
    turn2 = turn1 + ids1 + _tokens(2, 40)
    not_sent = _metric(stack.scrape("prefill-0"), "pdserve_kv_pages_not_sent_total")
    ids2, _, timing2, finish2 = _generate(stack, turn2)
    assert ids2 == _reference(hf, turn2)
    assert timing2.decode_cached_tokens == 4 * BS and timing2.prefill_cached_tokens == 4 * BS
    assert timing2.cached_tokens == 4 * BS
    assert timing2.prompt_pages == -(-len(turn2) // BS) == 8
    new_pages = -(-(len(turn2) - len(turn1)) // BS)
    assert timing2.kv_pages == timing2.prompt_pages - 4 <= new_pages + 1
    assert timing2.kv_bytes == timing2.kv_pages * (timing1.kv_bytes // timing1.kv_pages)
    assert _metric(stack.scrape("prefill-0"), "pdserve_kv_pages_not_sent_total") \
        == not_sent + 4
    decode = stack.scrape("decode-0")
    assert _metric(decode, "pdserve_prefix_cache_hit_tokens_total") >= 4 * BS
    assert _metric(decode, "pdserve_prefix_cache_pages") > 0
    assert finish2.prompt_tokens == len(turn2)

    # The same prompt again: everything but the last page is held on both sides.
    ids3, _, timing3, _ = _generate(stack, turn2)
    assert ids3 == ids2 and timing3.kv_pages == 1
    assert timing3.decode_cached_tokens == timing3.prefill_cached_tokens == 7 * BS


def test_the_http_usage_reports_cached_tokens(stack, hf):
    prompt = _tokens(3, 50)
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0, "ignore_eos": True}

    def complete() -> dict:
        req = urllib.request.Request(stack.http + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as reply:
            return json.loads(reply.read())

    first, second = complete(), complete()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}
    assert second["pdserve"]["timing"]["decode_cached_tokens"] == 48
    assert first["choices"][0]["text"] == second["choices"][0]["text"]


def test_colocated_serving_reuses_its_cache(tiny_model_dir, hf):
    """A co-located worker starts every prompt at Reserve, whatever its length (no Prefill
    call: the router streams it from the Decode call), and reuses its cache."""
    from pdserve.v1 import decode_pb2, decode_pb2_grpc

    prompt = _tokens(4, 60)
    with pdserve_stack(colocated=True) as s:
        ids1, _, timing1, _ = _generate(s, prompt)
        ids2, _, timing2, _ = _generate(s, prompt + [7, 8, 9])
        assert _metric(s.scrape("colocated"), "pdserve_prefill_requests_total") == 0
        with grpc.insecure_channel(s.decode[0]) as channel:
            worker = decode_pb2_grpc.DecodeStub(channel)
            total = s.decode_stats().num_pages
            long = _tokens(6, 100)  # far above the offer's 8 tokens: started all the same
            reply = _reserve(worker, "co-1", long, below=8)
            assert reply.prefilling_here and reply.destination.agent_address == "local"
            messages = _local_decode(worker, reply, long)
            assert [t for m in messages for t in m.token_ids] == _reference(hf, long)
            reply = _reserve(worker, "co-2", _tokens(7, 30), max_tokens=4000)
            assert worker.Abort(decode_pb2.AbortRequest(ticket=reply.ticket), timeout=10).found
            assert wait_for(lambda: s.decode_stats().free_pages == total, timeout_s=15)
    assert ids1 == _reference(hf, prompt)
    assert ids2 == _reference(hf, prompt + [7, 8, 9])
    assert timing1.cached_tokens == 0 and timing2.cached_tokens == 48
    assert timing1.prefill_on == timing2.prefill_on == "prefill"
    assert timing1.kv_transport == "local" and timing1.prefill_ms > 0


def test_a_short_uncached_part_is_prefilled_on_the_decode_worker(tiny_model_dir, hf):
    """Below --remote-prefill-min-tokens the decode worker computes what it lacks itself: no
    prefill call, no handoff; a long uncached part still goes to the prefill pool."""
    prompt = _tokens(5, 60)
    # 300 ms between each Reserve and what follows it: while the prompt computes at Reserve.
    with pdserve_stack(env={"PDSERVE_ROUTER_REMOTE_PREFILL_MIN_TOKENS": "40",
                            "PDSERVE_FAILPOINTS": "router.reserved=sleep:300"}) as s:
        prefills = _metric(s.scrape("prefill-0"), "pdserve_prefill_requests_total")
        ids1, _, timing1, _ = _generate(s, prompt)  # 60 uncached: the prefill pool
        assert timing1.prefill_on == "prefill" and timing1.kv_pages == 4
        turn2 = prompt + ids1 + [9] * 5
        ids2, _, timing2, finish2 = _generate(s, turn2)  # 73 tokens, 64 held: 9 uncached
        assert (timing2.prefill_on, timing2.kv_pages, timing2.kv_bytes) == ("decode", 0, 0)
        assert timing2.cached_tokens == timing2.decode_cached_tokens == 64
        assert timing2.prefill_worker == timing2.decode_worker and timing2.prefill_ms > 0
        # Each part counted once: the decode worker's queue runs from Reserve, where the
        # router's own part ends (it used to run on to the Decode call: the 300 ms twice).
        parts = (timing2.queue_ms + timing2.prefill_ms + timing2.kv_transfer_ms
                 + timing2.decode_start_ms)
        assert parts <= timing2.ttft_ms, timing2
        assert _metric(s.scrape("prefill-0"), "pdserve_prefill_requests_total") == prefills + 1
        # A first token that ends the request there (max_tokens 1) frees the pages too.
        one = collect(s.generate(token_ids=turn2 + [4], max_tokens=1, temperature=0.0))
        assert one[3].completion_tokens == 1 and one[2].prefill_on == "decode"
        stats = s.decode_stats()
        assert stats.free_pages == stats.num_pages and stats.reserved_tickets == 0
    assert ids1 == _reference(hf, prompt) and ids2 == _reference(hf, turn2)
    assert finish2.completion_tokens == MAX_TOKENS


# ---- decode-first: Reserve starts a short uncached part on the decode worker -----------------

def _reserve(decode, rid: str, prompt: list[int], *, below: int = 64, max_tokens: int = MAX_TOKENS,
             **fields):
    from pdserve.v1 import common_pb2, decode_pb2

    return decode.Reserve(decode_pb2.ReserveRequest(
        request_id=rid, num_prompt_tokens=len(prompt), prompt_token_ids=prompt,
        prefill_here_below_tokens=below, sampling=common_pb2.SamplingParams(
            max_tokens=max_tokens, top_p=1.0, ignore_eos=True), **fields), timeout=30)


def _local_decode(decode, reply, prompt: list[int]):
    from pdserve.v1 import common_pb2, decode_pb2

    return list(decode.Decode(decode_pb2.DecodeRequest(
        ticket=reply.ticket, prompt_token_ids=prompt, local_prefill=True,
        sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, top_p=1.0, ignore_eos=True)),
        timeout=60))


@pytest.fixture
def decode(stack):
    from pdserve.v1 import decode_pb2_grpc

    with grpc.insecure_channel(stack.decode[0]) as channel:
        yield decode_pb2_grpc.DecodeStub(channel)


def test_reserve_starts_a_short_uncached_part_and_decode_streams_it(stack, decode, hf):
    total = stack.decode_stats().num_pages
    prompt = _tokens(11, 40)  # 40 uncached tokens < 64: started at Reserve, no pages to fill
    reply = _reserve(decode, "early-1", prompt)
    assert reply.prefilling_here and list(reply.destination.page_ids) == []
    assert reply.cached_tokens == 0
    messages = _local_decode(decode, reply, prompt)
    first = messages[0]
    assert first.prefill_ms > 0 and first.queue_ms >= 0 and first.decode_start_ms >= 0
    assert [t for m in messages for t in m.token_ids] == _reference(hf, prompt)
    assert messages[-1].finish_reason == "length"
    # The same prompt plus a few tokens: two pages held, 8 tokens computed here.
    longer = prompt + [9] * 8
    again = _reserve(decode, "early-2", longer)
    assert again.prefilling_here and again.cached_tokens == 2 * BS
    messages = _local_decode(decode, again, longer)
    assert messages[0].cached_tokens == 2 * BS
    assert [t for m in messages for t in m.token_ids] == _reference(hf, longer)
    stats = stack.decode_stats()
    assert stats.free_pages == total and stats.reserved_tickets == 0


def test_a_long_uncached_part_still_gets_pages_for_a_handoff(stack, decode):
    from pdserve.v1 import common_pb2, decode_pb2

    total = stack.decode_stats().num_pages
    prompt = _tokens(12, 100)
    reply = _reserve(decode, "early-long", prompt)  # 100 uncached >= 64: a reservation
    assert not reply.prefilling_here and len(reply.destination.page_ids) == 7
    assert decode.Abort(decode_pb2.AbortRequest(
        ticket=common_pb2.Ticket(request_id="early-long")), timeout=10).found
    assert stack.decode_stats().free_pages == total


def test_a_started_sequence_aborted_before_its_decode_call_frees_its_pages(stack, decode):
    from pdserve.v1 import decode_pb2

    total = stack.decode_stats().num_pages
    prompt = _tokens(13, 30)
    reply = _reserve(decode, "early-abort", prompt, max_tokens=4000)
    assert reply.prefilling_here
    assert decode.Abort(decode_pb2.AbortRequest(ticket=reply.ticket), timeout=10).found
    assert wait_for(lambda: stack.decode_stats().free_pages == total, timeout_s=15)
    with pytest.raises(grpc.RpcError) as err:  # a late Decode finds nothing to stream
        _local_decode(decode, reply, prompt)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "expired or it was aborted" in err.value.details()


def test_a_started_sequence_whose_decode_call_never_comes_ends_with_its_lease(stack, decode):
    from pdserve.v1 import decode_pb2

    total = stack.decode_stats().num_pages
    expired = _metric(stack.scrape("decode-0"), "pdserve_lease_expiries_total")
    prompt = _tokens(14, 30)
    # Renewed while its holder is alive: still held after several renewal periods.
    reply = _reserve(decode, "early-lease", prompt, max_tokens=4000, lease_ms=20000,
                     renew_lease_ms=300)
    assert reply.prefilling_here and reply.renew_lease_ms == 300
    for _ in range(5):  # 1 s in all, over three renewal periods: the lease clock must run
        renewed = decode.Renew(decode_pb2.RenewRequest(tickets=[reply.ticket]), timeout=10)
        assert list(renewed.not_held) == []
        time.sleep(0.2)
    # The holder went away: the sequence is ended and its pages come back.
    assert wait_for(lambda: stack.decode_stats().free_pages == total, timeout_s=15)
    assert wait_for(lambda: _metric(stack.scrape("decode-0"), "pdserve_lease_expiries_total")
                    == expired + 1, timeout_s=15)
    renewed = decode.Renew(decode_pb2.RenewRequest(tickets=[reply.ticket]), timeout=10)
    assert list(renewed.not_held) == ["early-lease"]


@pytest.mark.parametrize("fields, message", [
    ({"below": -1}, "prefill_here_below_tokens=-1: must be >= 0"),
    ({"below": 64, "sampling": None}, "prefill_here_below_tokens needs sampling"),
])
def test_a_bad_prefill_here_offer_is_refused_naming_it(stack, decode, fields, message):
    from pdserve.v1 import common_pb2, decode_pb2

    prompt = _tokens(15, 20)
    sampling = fields.get("sampling", common_pb2.SamplingParams(max_tokens=4, top_p=1.0))
    with pytest.raises(grpc.RpcError) as err:
        decode.Reserve(decode_pb2.ReserveRequest(
            request_id="bad-offer", num_prompt_tokens=len(prompt), prompt_token_ids=prompt,
            prefill_here_below_tokens=fields["below"], sampling=sampling), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in err.value.details()
    assert stack.decode_stats().reserved_tickets == 0
