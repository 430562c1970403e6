"""A client that cancels while its prompt is still being prefilled, against real processes:
the Prefill call is cancelled, the sequence leaves the prefill engine, the pages of its
finished chunks that were already shipping stop there, and every page is back on both the
prefill and the decode side. (Cancelling during the KV send, which needs a slow
link, is in tests/multihost/test_cancellation.py.)"""

from __future__ import annotations

import threading

import grpc
import pytest
from pdserve.v1 import router_pb2, router_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.service.stack import pdserve_stack
from tests.support import wait_for

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    # 4-token chunks: a 3,000-token prompt takes hundreds of prefill steps.
    with pdserve_stack(env={"PDSERVE_PREFILL_CHUNK_SIZE": "4"}) as s:
        yield s


def _counters(stack) -> tuple[float, float]:
    """(KV bytes host A's agent has sent, Prefill calls that ended OK), from /metrics."""
    def total(name: str, metric: str, **labels: str) -> float:
        return sum(s.value for f in text_string_to_metric_families(stack.scrape(name))
                   for s in f.samples if s.name == metric
                   and all(s.labels.get(k) == v for k, v in labels.items()))
    return (total("kvtransfer-a", "pdserve_kv_transfer_bytes_total", direction="send"),
            total("prefill-0", "pdserve_prefill_requests_total", code="OK"))


def test_cancel_during_prefill_frees_pages_on_both_sides(stack):
    prefill0, decode0, counters0 = stack.prefill_stats(), stack.decode_stats(), _counters(stack)
    received: list[str] = []
    codes: list[grpc.StatusCode] = []
    with grpc.insecure_channel(stack.router) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            token_ids=[5 + i % 900 for i in range(3000)], max_tokens=4, temperature=0.0),
            timeout=120)
        reader = threading.Thread(target=_read, args=(call, received, codes))
        reader.start()

        def prefilling() -> bool:
            s = stack.prefill_stats()
            return s.waiting_sequences == 1 and s.free_pages < prefill0.free_pages

        assert wait_for(prefilling, timeout_s=60, interval_s=0.01), "prefill never started"
        assert stack.decode_stats().free_pages < decode0.free_pages  # its reservation
        during = stack.prefill_stats()
        call.cancel()
        reader.join(30)
    assert not reader.is_alive()
    assert during.waiting_sequences == 1 and during.queued_prompt_tokens > 0, \
        "prefill had finished before the cancel: this run did not test cancelling during it"
    assert received == [] and codes == [grpc.StatusCode.CANCELLED]  # nothing was streamed
    assert wait_for(lambda: stack.prefill_stats().free_pages == prefill0.free_pages)
    assert wait_for(lambda: stack.decode_stats().free_pages == decode0.free_pages)
    after = stack.prefill_stats()
    assert (after.waiting_sequences, after.running_sequences) == (0, 0)
    assert stack.decode_stats().reserved_tickets == 0
    # The cancel landed in prefill: no Prefill call ended OK, and of the prompt's pages only
    # those of chunks prefilled before the cancel had left host A (shipped while prefill ran).
    sent, ok = _counters(stack)
    assert ok == counters0[1]
    prompt_bytes = -(-3000 // 16) * 2 * 2 * 16 * 2 * 16 * 4  # pages x tiny's page bytes
    assert sent - counters0[0] < prompt_bytes


def _read(call, received: list[str], codes: list[grpc.StatusCode]) -> None:
    """Collect the stream's message kinds and how it ended (asserted by the test's thread)."""
    try:
        received.extend(m.WhichOneof("kind") for m in call)
        codes.append(grpc.StatusCode.OK)
    except grpc.RpcError as exc:
        codes.append(exc.code())


def test_cancel_during_the_handoff_of_a_partly_cached_prompt(stack):
    """Its first pages are held on both sides already: the cancel frees what the request took
    and unpins what it shared, and the cached pages still give the same tokens after it."""
    prefix = [7 + i % 800 for i in range(800)]
    with grpc.insecure_channel(stack.router) as ch:
        stub = router_pb2_grpc.RouterStub(ch)

        def tokens(prompt: list[int]) -> tuple[list[int], router_pb2.Timing]:
            ids: list[int] = []
            timing = router_pb2.Timing()
            for m in stub.Generate(router_pb2.GenerateRequest(
                    token_ids=prompt, max_tokens=4, temperature=0.0, ignore_eos=True),
                    timeout=120):
                ids += m.delta.token_ids
                if m.WhichOneof("kind") == "timing":
                    timing = m.timing
            return ids, timing

        first, _ = tokens(prefix)
        prefill0, decode0 = stack.prefill_stats(), stack.decode_stats()
        received: list[str] = []
        codes: list[grpc.StatusCode] = []
        call = stub.Generate(router_pb2.GenerateRequest(
            token_ids=prefix + [3 + i % 700 for i in range(2400)], max_tokens=4,
            temperature=0.0), timeout=120)
        reader = threading.Thread(target=_read, args=(call, received, codes))
        reader.start()

        def prefilling() -> bool:
            return stack.prefill_stats().waiting_sequences == 1
        assert wait_for(prefilling, timeout_s=60, interval_s=0.01), "prefill never started"
        call.cancel()
        reader.join(30)
        assert not reader.is_alive() and codes == [grpc.StatusCode.CANCELLED]
        assert wait_for(lambda: stack.prefill_stats().free_pages == prefill0.free_pages)
        assert wait_for(lambda: stack.decode_stats().free_pages == decode0.free_pages)
        assert stack.decode_stats().reserved_tickets == 0
        again, timing = tokens(prefix)
    assert again == first
    assert timing.decode_cached_tokens == timing.prefill_cached_tokens == 49 * 16
