"""Every process of `pdserve up` serves Prometheus text on its own port, and the numbers move
by exactly what the requests did: counted once, bytes as reported, pages back to all free."""

from __future__ import annotations

import grpc
import pytest
from pdserve.v1 import router_pb2, router_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.service.stack import collect, pdserve_stack
from tests.support import wait_for

pytestmark = pytest.mark.service

N = 3
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with pdserve_stack() as s:  # both agents on this host: the handoffs take the same-host copy
        yield s


class Scrape:
    """One scrape of one process: {(sample name, labels): value}."""

    def __init__(self, text: str):
        self.families = list(text_string_to_metric_families(text))
        self.values = {(s.name, frozenset(s.labels.items())): s.value
                       for f in self.families for s in f.samples}

    def __call__(self, name: str, **labels: str) -> float:
        return self.values.get((name, frozenset(labels.items())), 0.0)


def scrape_all(stack) -> dict[str, Scrape]:
    return {name: Scrape(stack.scrape(name)) for name in stack.metrics}


def pages_all_free(stack, name: str) -> bool:
    now = Scrape(stack.scrape(name))
    role = name.split("-")[0]
    return (now("pdserve_kv_pages_free", role=role) == now("pdserve_kv_pages_capacity", role=role)
            > 0 and now("pdserve_kv_pages_used", role=role) == 0)


def test_every_process_serves_only_pdserve_metrics(stack):
    assert set(stack.metrics) == {"router", "prefill-0", "decode-0", "kvtransfer-a",
                                  "kvtransfer-b"}
    assert len({url for url in stack.metrics.values()}) == 5
    for name, scrape in scrape_all(stack).items():
        assert scrape.families, name
        assert all(f.name.startswith("pdserve_") for f in scrape.families), name


def test_every_process_froze_its_start_up_heap_and_reports_its_collection_pauses(stack):
    for name, scrape in scrape_all(stack).items():
        # what start-up built (a worker's model and engine, the router's pool and tokenizer)
        # is out of the collector's sight: a full collection no longer walks it
        assert scrape("pdserve_gc_frozen_objects") > 10_000, name
        for gen in "012":
            assert scrape("pdserve_gc_pause_seconds_count", generation=gen) >= 0, name
            assert scrape("pdserve_gc_pause_seconds_bucket", generation=gen, le="+Inf") == \
                scrape("pdserve_gc_pause_seconds_count", generation=gen), name
        assert scrape("pdserve_gc_pause_seconds_count", generation="0") > 0, name


def test_every_worker_says_in_its_stats_that_it_is_serving(stack):
    # what grpc.health.v1 Check says, so that the router reads one call per worker, not two
    for stats in (stack.prefill_stats(), stack.decode_stats()):
        assert stats.HasField("serving") and stats.serving, stats


def test_requests_move_each_metric_by_exactly_what_they_did(stack):
    before = scrape_all(stack)
    timings = []
    for _ in range(N):
        ids, _text, timing, finish = collect(stack.generate(
            prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
        assert len(ids) == MAX_TOKENS and finish.finish_reason == "length"
        timings.append(timing)
    with pytest.raises(grpc.RpcError) as err:
        stack.generate(prompt="", max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert wait_for(lambda: pages_all_free(stack, "decode-0"))
    assert pages_all_free(stack, "prefill-0")
    after = scrape_all(stack)
    kv_bytes = sum(t.kv_bytes for t in timings)
    assert kv_bytes > 0 and {t.kv_transport for t in timings} == {"shm"}

    def moved(name: str, metric: str, **labels: str) -> float:
        return after[name](metric, **labels) - before[name](metric, **labels)

    # router: each request counted once, by outcome and code; the TTFT breakdown per request
    assert moved("router", "pdserve_requests_total", outcome="ok", code="OK", api="grpc") == N
    assert moved("router", "pdserve_requests_total", outcome="error",
                 code="INVALID_ARGUMENT", api="grpc") == 1
    assert after["router"]("pdserve_requests_in_flight") == 0
    for metric in ("queue", "prefill", "decode_start", "tpot"):
        assert moved("router", f"pdserve_{metric}_seconds_count") == N, metric
    assert moved("router", "pdserve_ttft_seconds_count", api="grpc") == N
    assert moved("router", "pdserve_kv_transfer_seconds_count", transport="shm") == N
    assert moved("router", "pdserve_kv_transfer_total_seconds_count", transport="shm") == N
    ttft_s = sum(t.ttft_ms for t in timings) / 1e3
    assert moved("router", "pdserve_ttft_seconds_sum", api="grpc") == pytest.approx(ttft_s,
                                                                                  rel=1e-6)
    assert moved("router", "pdserve_e2e_seconds_count", outcome="ok", api="grpc") == N
    assert moved("router", "pdserve_e2e_seconds_count", outcome="error", api="grpc") == 1
    assert N <= moved("router", "pdserve_itl_seconds_count") <= N * (MAX_TOKENS - 1)
    assert moved("router", "pdserve_itl_seconds_sum") > 0
    assert moved("router", "pdserve_kv_bytes_total", transport="shm") == kv_bytes
    assert moved("router", "pdserve_completion_tokens_total") == N * MAX_TOKENS
    # agents: host A (prefill) sent the bytes the Timing messages reported to host B's agent,
    # and host B received them from host A's (peer: the other agent's --agent-id). The prefill
    # worker copied to host B itself and told its agent afterwards, in a note nobody waits for:
    # counted once it has been read.
    def sent_by_a() -> float:
        after["kvtransfer-a"] = Scrape(stack.scrape("kvtransfer-a"))
        return moved("kvtransfer-a", "pdserve_kv_transfer_bytes_total", transport="shm",
                     direction="send", peer="host-b")

    assert wait_for(lambda: sent_by_a() >= kv_bytes)
    assert moved("kvtransfer-a", "pdserve_kv_transfer_bytes_total", transport="shm",
                 direction="send", peer="host-b") == kv_bytes
    assert moved("kvtransfer-b", "pdserve_kv_transfer_bytes_total", transport="shm",
                 direction="receive", peer="host-a") == kv_bytes
    assert moved("kvtransfer-a", "pdserve_kv_transfer_pages_total", transport="shm",
                 direction="send", peer="host-b") == sum(t.kv_pages for t in timings)
    assert moved("kvtransfer-a", "pdserve_kv_handoff_seconds_count", transport="shm") == N
    assert moved("kvtransfer-a", "pdserve_kv_transfer_gb_per_second_count", transport="shm") == N
    assert moved("kvtransfer-a", "pdserve_kv_transfer_gb_per_second_sum", transport="shm") > 0
    for agent in ("kvtransfer-a", "kvtransfer-b"):
        failures = [s for f in after[agent].families if f.name == "pdserve_kv_transfer_failures"
                    for s in f.samples if s.name.endswith("_total") and s.value]
        assert failures == [], agent
    # workers: one prefill each, N sequences finished by length, nothing left running
    assert moved("prefill-0", "pdserve_prefill_requests_total", code="OK") == N
    assert moved("decode-0", "pdserve_sequences_finished_total", reason="length") == N
    for name in ("prefill-0", "decode-0"):
        role = name.split("-")[0]
        assert after[name]("pdserve_running_sequences", role=role) == 0
        assert after[name]("pdserve_waiting_sequences", role=role) == 0
    assert after["decode-0"]("pdserve_reserved_tickets", role="decode") == 0
    # engine steps: one prompt step per request on the prefill worker; on the decode worker a
    # step of one sequence per token after the first (the prefill worker sampled that one)
    assert moved("prefill-0", "pdserve_engine_step_seconds_count", kind="prefill") == N
    assert moved("prefill-0", "pdserve_engine_step_seconds_sum", kind="prefill") > 0
    decode_steps = N * (MAX_TOKENS - 1)
    assert moved("decode-0", "pdserve_engine_step_seconds_count", kind="decode") == decode_steps
    assert moved("decode-0", "pdserve_engine_step_sequences_count") == decode_steps
    assert moved("decode-0", "pdserve_engine_step_sequences_sum") == decode_steps
    for kind in ("prefill", "mixed"):
        assert moved("decode-0", "pdserve_engine_step_seconds_count", kind=kind) == 0, kind
    # what those steps computed: each prompt of P tokens in one chunk from 0 (P (P + 1) / 2
    # pairs attended; no page cached, the prompt is shorter than a page); then the decode
    # steps' sequences of P + 1, ..., P + MAX_TOKENS - 1 tokens
    prompt = moved("router", "pdserve_prompt_tokens_total") / N
    assert prompt < 16 and moved("prefill-0", "pdserve_prefix_cache_hit_tokens_total") == 0
    assert moved("prefill-0", "pdserve_engine_prompt_tokens_total", kind="prefill") == N * prompt
    assert moved("prefill-0", "pdserve_engine_prompt_attended_pairs_total", kind="prefill") \
        == N * prompt * (prompt + 1) / 2
    assert moved("decode-0", "pdserve_engine_decoded_tokens_total", kind="decode") == decode_steps
    assert moved("decode-0", "pdserve_engine_context_tokens_total", kind="decode") == \
        N * sum(prompt + k for k in range(1, MAX_TOKENS))
    # between a sequence's steps the loop hands its token over: some time, less than the run
    assert 0 < moved("decode-0", "pdserve_engine_held_seconds_total") < \
        moved("router", "pdserve_e2e_seconds_sum", outcome="ok", api="grpc")


def test_cancelled_stream_is_counted_once_and_frees_its_pages(stack):
    before = scrape_all(stack)
    with grpc.insecure_channel(stack.router) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            prompt=PROMPT, max_tokens=2000, temperature=0.0, ignore_eos=True), timeout=120)
        deltas = 0
        for msg in call:
            deltas += msg.WhichOneof("kind") == "delta"
            if deltas == 3:
                break
        during = Scrape(stack.scrape("decode-0"))
        call.cancel()
    assert during("pdserve_running_sequences", role="decode") == 1
    assert during("pdserve_kv_pages_used", role="decode") > 0

    def counted() -> bool:
        now = Scrape(stack.scrape("router"))
        cancelled = {"outcome": "cancelled", "code": "CANCELLED", "api": "grpc"}
        return now("pdserve_requests_in_flight") == 0 and now(
            "pdserve_requests_total", **cancelled) > before["router"](
            "pdserve_requests_total", **cancelled)

    assert wait_for(counted)
    assert wait_for(lambda: pages_all_free(stack, "decode-0"))
    after = scrape_all(stack)
    for outcome, code, n in (("cancelled", "CANCELLED", 1), ("ok", "OK", 0)):
        labels = {"outcome": outcome, "code": code, "api": "grpc"}
        assert (after["router"]("pdserve_requests_total", **labels)
                - before["router"]("pdserve_requests_total", **labels)) == n
    assert (after["decode-0"]("pdserve_sequences_finished_total", reason="abort")
            - before["decode-0"]("pdserve_sequences_finished_total", reason="abort")) == 1
