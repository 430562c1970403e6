"""A client that cancels while its prompt is still being prefilled, against real processes:
the Prefill call is cancelled, the sequence leaves the prefill engine, and every page is back
on both the prefill and the decode side. (Cancelling during the KV send, which needs a slow
link, is in tests/multihost/test_cancellation.py.)"""

from __future__ import annotations

import threading

import grpc
import pytest
from pdserve.v1 import router_pb2, router_pb2_grpc

from tests.service.stack import pdserve_stack
from tests.support import wait_for

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    # 4-token chunks: a 3,000-token prompt takes hundreds of prefill steps.
    with pdserve_stack(env={"PDSERVE_PREFILL_CHUNK_SIZE": "4"}) as s:
        yield s


def test_cancel_during_prefill_frees_pages_on_both_sides(stack):
    prefill0, decode0 = stack.prefill_stats(), stack.decode_stats()
    received: list[str] = []
    with grpc.insecure_channel(stack.router) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            token_ids=[5 + i % 900 for i in range(3000)], max_tokens=4, temperature=0.0),
            timeout=120)
        reader = threading.Thread(target=lambda: received.extend(
            m.WhichOneof("kind") for m in _until_cancelled(call)))
        reader.start()

        def prefilling() -> bool:
            s = stack.prefill_stats()
            return s.waiting_sequences == 1 and s.free_pages < prefill0.free_pages

        assert wait_for(prefilling, timeout_s=60, interval_s=0.01), "prefill never started"
        assert stack.decode_stats().free_pages < decode0.free_pages  # its reservation
        call.cancel()
        reader.join(30)
    assert received == []  # nothing was streamed
    assert wait_for(lambda: stack.prefill_stats().free_pages == prefill0.free_pages)
    assert wait_for(lambda: stack.decode_stats().free_pages == decode0.free_pages)
    after = stack.prefill_stats()
    assert (after.waiting_sequences, after.running_sequences) == (0, 0)


def _until_cancelled(call):
    try:
        yield from call
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.CANCELLED
