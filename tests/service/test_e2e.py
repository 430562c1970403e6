"""The disaggregated path end to end: router → prefill → KV handoff → decode, over each data
path: `shm` (the default on one host: the agents find they share it) and UCX / TCP (the same
stack with the same-host copy off).

Real processes on loopback (`pdserve up`), the built-in tiny model, outputs checked token for
token against transformers.
"""

from __future__ import annotations

import secrets
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from pdserve.v1 import router_pb2, router_pb2_grpc

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.service.stack import collect, pdserve_stacks
from tests.support import samples, value, wait_for

pytestmark = pytest.mark.service

DECODE_PAGES = 200
DECODE_CONTEXT = DECODE_PAGES * 16  # what the decode pool holds: its max_model_len
WORKER_ENV = {
    "PDSERVE_PREFILL_CHUNK_SIZE": "32",  # long prompts are prefilled in chunks
    "PDSERVE_DECODE_NUM_PAGES": str(DECODE_PAGES),
    "PDSERVE_DECODE_MAX_MODEL_LEN": str(DECODE_CONTEXT),  # a small pool serves less context
    # Every prompt here runs once per test: whole prompts cross each data path. Partial
    # handoffs (the prefix cache on, its default) are tests/service/test_prefix_reuse.py's.
    "PDSERVE_PREFILL_PREFIX_CACHE": "0",
    "PDSERVE_DECODE_PREFIX_CACHE": "0",
}


TRANSPORTS = ["shm", "ucx", "tcp"]


# The routers relay tokens in C++ (router/native_relay.py): the tcp stack's runs each sequence
# on its own Decode call, as it does past 64 decode workers; the others' on the worker's shared
# DecodeMany stream, handed to the relay by the stream's reader.
OWN_CALLS = "tcp"
RELAYED = "pdserve_relayed_natively_total"


@pytest.fixture(scope="module")
def stacks(tiny_model_dir):
    """{transport: stack}, the three started side by side (their start-ups overlap)."""
    flags = {t: () if t == "shm" else ("--transport", t, "--no-same-host-copy")
             for t in TRANSPORTS}
    envs = [{"PDSERVE_ROUTER_SHARED_DECODE_STREAM": "0"} if t == OWN_CALLS else {}
            for t in TRANSPORTS]
    with pdserve_stacks(*flags.values(), env=WORKER_ENV, envs=envs) as running:
        for transport, s in zip(TRANSPORTS, running, strict=True):
            s.transport = transport
        yield dict(zip(TRANSPORTS, running, strict=True))


@pytest.fixture(scope="module", params=TRANSPORTS)
def stack(request, stacks):
    return stacks[request.param]


def _greedy(stack, prompt: str):
    return collect(stack.generate(prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0))


def _check(prompt, got_ids, text, timing, finish, reference, transport):
    tok, refs = reference
    n_prompt, ref_ids = refs[prompt]
    assert got_ids == ref_ids, f"prompt {prompt[:30]!r}"
    assert text == tok.decode([t for t in ref_ids if t not in tok.all_special_ids])
    assert finish.prompt_tokens == n_prompt and finish.completion_tokens == len(ref_ids)
    assert timing.kv_transport == transport
    assert timing.kv_transfer_ms > 0
    page_bytes = 2 * 2 * 16 * 2 * 16 * 4  # tiny: layers, K/V, block, kv heads, head dim, fp32
    assert timing.kv_pages == -(-n_prompt // 16)
    assert timing.kv_bytes == timing.kv_pages * page_bytes
    assert timing.ttft_ms >= timing.prefill_ms + timing.kv_transfer_ms


def test_greedy_output_equals_transformers_one_by_one(stack, reference):
    before = value(samples(stack.scrape("router")), RELAYED)
    for prompt in PROMPTS:
        _check(prompt, *_greedy(stack, prompt), reference, stack.transport)
    assert value(samples(stack.scrape("router")), RELAYED) - before == len(PROMPTS)


def test_a_stop_string_cuts_the_text_where_transformers_text_has_it(stack, reference):
    """The text up to the first stop string, the string itself withheld, "stop"; its tokens
    are the reference's up to the one that completed it (the same from either relay)."""
    tok, refs = reference
    for prompt in PROMPTS[:3]:
        ref_ids = refs[prompt][1]
        full = tok.decode(ref_ids, skip_special_tokens=True)
        stop = full[len(full) // 2:len(full) // 2 + 3]
        cut = full.index(stop)
        ids, text, _, finish = collect(stack.generate(prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0.0, stop=[stop]))
        assert text == full[:cut] and finish.finish_reason == "stop", (prompt, stop)
        assert ids == ref_ids[:len(ids)]
        assert stop in tok.decode(ids, skip_special_tokens=True)
        assert stop not in tok.decode(ids[:-1], skip_special_tokens=True)
    # the router ended each sequence: decode was told to free its pages
    assert wait_for(lambda: stack.decode_stats().free_pages == stack.decode_stats().num_pages)


def test_a_long_prompt_ships_chunk_by_chunk_while_prefill_runs(stack, reference):
    """Chunks of 32 tokens: the pages each chunk completes ship as their own part while the
    next chunk computes (the sending agent counts one handoff per part); tokens stay exact."""
    prompt = PROMPTS[-1]
    n_prompt = reference[1][prompt][0]
    chunks = -(-n_prompt // 32)
    assert chunks >= 4

    def parts() -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in stack.scrape("kvtransfer-a")
                   .splitlines() if line.startswith("pdserve_kv_handoff_seconds_count"))

    before = parts()
    result = _greedy(stack, prompt)
    _check(prompt, *result, reference, stack.transport)
    assert parts() - before == chunks
    timing = result[2]
    assert timing.kv_transfer_total_ms > 0  # the parts' durations, summed


def test_sixteen_concurrent_streams_equal_transformers(stack, reference):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: _greedy(stack, p), prompts))
    for prompt, result in zip(prompts, results):
        _check(prompt, *result, reference, stack.transport)
    assert stack.decode_stats().free_pages == stack.decode_stats().num_pages


def test_a_client_request_id_can_be_reused_at_once_and_concurrently(stack, reference):
    """The client's request id labels its request (responses, logs, traces); the workers and
    agents see one id per attempt, so reusing an id right after its request ended (within the
    agents' 60 s memory of closed tickets), or for two requests at once, is fine: each gets
    its own exact output under the id it sent."""
    rid = "reused-" + secrets.token_hex(4)

    def greedy(prompt: str) -> tuple[list[router_pb2.GenerateResponse], str]:
        return stack.generate(request_id=rid, prompt=prompt, max_tokens=MAX_TOKENS,
                              temperature=0.0), prompt

    runs = [greedy(PROMPTS[3]), greedy(PROMPTS[3])]  # back to back
    with ThreadPoolExecutor(2) as pool:  # at once, different prompts
        runs += list(pool.map(greedy, [PROMPTS[1], PROMPTS[2]]))
    for responses, prompt in runs:
        assert {r.request_id for r in responses} == {rid}
        _check(prompt, *collect(responses), reference, stack.transport)
    assert stack.decode_stats().free_pages == stack.decode_stats().num_pages


def test_cancelled_stream_frees_decode_pages(stack):
    start = stack.decode_stats()
    with grpc.insecure_channel(stack.router) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            prompt=PROMPTS[4], max_tokens=2000, temperature=0.0, ignore_eos=True), timeout=120)
        deltas = 0
        for msg in call:
            deltas += msg.WhichOneof("kind") == "delta"
            if deltas == 5:
                break
        during = stack.decode_stats()
        call.cancel()
    assert during.free_pages < start.free_pages
    assert wait_for(lambda: stack.decode_stats().free_pages == start.free_pages)
    assert stack.decode_stats().running_sequences == 0
    prefill = stack.prefill_stats()
    assert prefill.free_pages == prefill.num_pages


@pytest.mark.parametrize("fields, field", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1.0}, "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p"),
    ({"prompt": "hi", "model": "no-such-model"}, "model"),
    ({"prompt": "x " * 5000}, "prompt"),
    ({"messages": [router_pb2.ChatMessage(role="user", content="hi")]}, "messages"),  # no template
])
def test_invalid_input_is_invalid_argument_naming_the_field(stack, fields, field):
    with pytest.raises(grpc.RpcError) as err:
        stack.generate(**fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    _greedy(stack, "still serving")  # the service stays up


def test_past_the_decode_workers_context_is_refused_naming_it(stack):
    stats = stack.decode_stats()
    assert (stats.num_pages, stats.max_model_len) == (DECODE_PAGES, DECODE_CONTEXT)
    # Within the model's context (4096) but past what the decode worker serves (200 × 16
    # tokens): the router refuses it before any worker is asked.
    with pytest.raises(grpc.RpcError) as err:
        stack.generate(token_ids=[5] * 3500, max_tokens=4, temperature=0.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"context of {DECODE_CONTEXT} tokens (max_model_len)" in err.value.details()
    assert stack.decode_stats().free_pages == stats.num_pages
    _greedy(stack, "still serving")


def test_reservation_whose_handoff_never_comes_is_reclaimed_when_its_lease_expires(stack):
    from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

    total = stack.decode_stats().num_pages
    with grpc.insecure_channel(stack.decode[0]) as ch:
        decode = decode_pb2_grpc.DecodeStub(ch)
        reply = decode.Reserve(decode_pb2.ReserveRequest(request_id="orphan", num_prompt_tokens=100,
                                                         lease_ms=300), timeout=10)
        assert len(reply.destination.page_ids) == 7
        assert stack.decode_stats().free_pages == total - 7
        # Nobody prefills: the lease runs out and the pages come back by themselves.
        assert wait_for(lambda: stack.decode_stats().free_pages == total, timeout_s=15)
        with pytest.raises(grpc.RpcError) as err:  # a late Decode for the expired ticket
            list(decode.Decode(decode_pb2.DecodeRequest(
                ticket=reply.ticket, prompt_token_ids=[5] * 100, first_token=5,
                sampling=common_pb2.SamplingParams(max_tokens=4, top_p=1.0)), timeout=10))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "expired" in err.value.details()
