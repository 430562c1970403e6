"""The request lifecycle against scripted in-process Prefill/Decode servers (loopback gRPC).

The fakes (tests/fakes.py) only speak the pdserve.v1 contract; real workers are exercised by
the other service tests.
"""

from __future__ import annotations

import re
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2
from pdserve.common import server
from pdserve.router.pool import WorkerPool
from pdserve.v1 import router_pb2

from tests.fakes import TEXT, kinds, run, text_of
from tests.support import wait_for

pytestmark = pytest.mark.service

EOS = 1
# the tests of the decode stream's relay run on both relays (conftest.py's `stack`)
RELAYS = pytest.mark.parametrize("stack", ["python", "native"], indirect=True)


@RELAYS
def test_stream_order_text_timing_and_finish(request, stack, tok):
    script, stub, lifecycle = stack
    n = len(script.tokens)
    out = run(stub, prompt="the fox", max_tokens=n, request_id="req-1")
    assert kinds(out) == "dt" + "d" * (n - 1) + "f"
    assert {r.request_id for r in out} == {"req-1"}
    assert out[0].delta.token_ids == [script.tokens[0]]
    assert text_of(out) == TEXT
    timing, finish = out[1].timing, out[-1].finish
    assert (timing.prefill_ms, timing.kv_transfer_ms, timing.decode_start_ms) == (3.0, 2.5, 1.5)
    assert (timing.kv_bytes, timing.kv_transport, timing.attempts) == (4096, "local", 1)
    assert timing.queue_ms >= 1.0 and timing.ttft_ms > 0 and timing.decode_worker == "d0"
    assert (finish.finish_reason, finish.completion_tokens) == ("length", n)
    assert finish.prompt_tokens == len(tok.encode("the fox"))
    native = request.node.callspec.params["stack"] == "native"
    assert lifecycle.metrics.relayed_natively._value.get() == (1 if native else 0)
    assert finish.e2e_ms >= timing.ttft_ms and finish.tpot_ms > 0 and finish.itl_max_ms > 0
    request = script.decodes[0]
    assert request.first_token == script.tokens[0]
    assert list(request.prompt_token_ids) == tok.encode("the fox")
    assert script.aborts == []  # decode finished the sequence itself


def test_router_enforces_max_tokens_and_aborts(stack):
    script, stub, _ = stack
    out = run(stub, prompt="the fox", max_tokens=3)
    assert sum(len(r.delta.token_ids) for r in out) == 3
    assert out[-1].finish.finish_reason == "length"
    assert len(script.aborts) == 1


def test_eos_from_decode_finishes_with_stop(stack, tok):
    script, stub, _ = stack
    script.tokens = tok.encode("hello world") + [EOS]
    script.decode_finish = "stop"
    out = run(stub, prompt="x")
    assert text_of(out) == "hello world"
    assert out[-1].finish.finish_reason == "stop"
    assert out[-1].finish.completion_tokens == len(script.tokens)


def test_stop_string_cuts_text_and_aborts_before_finish(stack):
    script, stub, _ = stack
    stream = stub.Generate(router_pb2.GenerateRequest(prompt="x", stop=["brown"]), timeout=20)
    out = []
    for r in stream:
        if r.HasField("finish"):
            assert len(script.aborts) == 1  # D was told before the client saw Finish
        out.append(r)
    assert text_of(out) == "hello world, the quick "
    assert out[-1].finish.finish_reason == "stop"


def test_finish_at_first_token_never_starts_decode(stack):
    script, stub, _ = stack
    out = run(stub, prompt="x", max_tokens=1)
    assert kinds(out) == "dtf"
    assert out[1].timing.decode_start_ms == 0 and out[-1].finish.finish_reason == "length"
    assert script.decodes == [] and len(script.aborts) == 1
    script.tokens = [EOS]
    out = run(stub, prompt="x")
    assert out[-1].finish.finish_reason == "stop" and text_of(out) == ""


def test_retry_before_first_token_on_another_prefill(stack):
    script, stub, _ = stack
    script.prefill_failures = [grpc.StatusCode.UNAVAILABLE]
    out = run(stub, prompt="x", max_tokens=4)
    assert out[1].timing.attempts == 2
    assert len(set(script.prefills)) == 2          # the retry went to the other worker
    assert len(script.reserves) == 2                # the first reservation was released
    reason = [reason for _, reason in script.aborts][0]
    assert reason.startswith("attempt 1 failed (prefill ") and reason.endswith("; retrying")
    assert out[-1].finish.completion_tokens == 4
    # one id per attempt, starting with the client's
    assert script.decodes[0].ticket.request_id.startswith(out[0].request_id + "#2.")
    assert script.aborts[0][0].startswith(out[0].request_id + "#1.")


def test_retries_are_bounded(stack):
    script, stub, _ = stack
    script.prefill_failures = [grpc.StatusCode.UNAVAILABLE] * 3
    with pytest.raises(grpc.RpcError) as err:
        run(stub, prompt="x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "2 attempts" in err.value.details()
    assert len(script.prefills) == 2 and len(script.aborts) == 2


def test_non_retryable_prefill_error_passes_through(stack):
    script, stub, _ = stack
    script.prefill_failures = [grpc.StatusCode.FAILED_PRECONDITION]
    with pytest.raises(grpc.RpcError) as err:
        run(stub, prompt="x")
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert len(script.prefills) == 1 and len(script.aborts) == 1


def test_no_room_on_any_decode_is_resource_exhausted_at_once(stack):
    script, stub, _ = stack
    script.exhausted = True
    with pytest.raises(grpc.RpcError) as err:
        run(stub, prompt="x")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert script.prefills == []


@RELAYS
def test_failure_after_tokens_ends_stream_with_error_no_repeat(stack):
    script, stub, _ = stack
    script.decode_fail_after = 2
    got = []
    with pytest.raises(grpc.RpcError) as err:
        for r in stub.Generate(router_pb2.GenerateRequest(prompt="x"), timeout=20):
            got.append(r)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "after 3 tokens" in err.value.details()
    assert kinds(got) == "dtdd" and len(script.prefills) == 1


def test_invalid_request_and_draining(stack):
    _, stub, lifecycle = stack
    with pytest.raises(grpc.RpcError) as err:
        run(stub, prompt="x", top_p=2.0)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "top_p=2.0" in err.value.details()
    lifecycle.stop_admitting()
    with pytest.raises(grpc.RpcError) as err:
        run(stub, prompt="x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_cancel_during_prefill_cancels_it_and_frees_pages(stack):
    script, stub, _ = stack
    script.block_prefill = threading.Event()
    call = stub.Generate(router_pb2.GenerateRequest(prompt="x"), timeout=20)
    assert wait_for(lambda: script.prefills)
    call.cancel()
    assert script.cancelled.wait(5)            # the Prefill call itself was cancelled
    assert wait_for(lambda: len(script.aborts) == 1)  # and the reservation released
    assert script.decodes == []


@RELAYS
def test_client_cancel_during_decode_stops_stream_and_aborts(stack):
    script, stub, _ = stack
    script.block_decode_after = 3
    call = stub.Generate(router_pb2.GenerateRequest(prompt="x"), timeout=20)
    got = [next(call) for _ in range(5)]       # first delta, timing, three more deltas
    assert kinds(got) == "dtddd"
    call.cancel()
    assert script.cancelled.wait(5)
    assert wait_for(lambda: len(script.aborts) == 1)


def test_router_health_needs_both_roles(tok):
    dead = "127.0.0.1:1"
    pool = WorkerPool([dead], [dead + "0"], interval_s=60, timeout_s=0.5)
    handle = server.start("router", 0, lambda s: None, host="127.0.0.1", ready=pool.ready)
    try:
        pool.check_now()
        assert not pool.ready()
        with grpc.insecure_channel(f"127.0.0.1:{handle.port}") as channel:
            from grpc_health.v1 import health_pb2_grpc
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                              timeout=2)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        pool.close()
        handle.server.stop(0)


def test_decode_failing_to_start_retries_the_whole_handoff(stack, tok):
    """Decode failed before its first message: no token was sent, so reserve + prefill +
    decode run again (bounded), and the failed reservation is released."""
    script, stub, _ = stack
    script.decode_start_failures = [grpc.StatusCode.FAILED_PRECONDITION]
    n = len(script.tokens)
    out = run(stub, prompt="the fox", max_tokens=n, request_id="r")
    assert kinds(out) == "dt" + "d" * (n - 1) + "f" and text_of(out) == TEXT
    assert out[1].timing.attempts == 2
    first, second = (d.ticket.request_id for d in script.decodes)
    assert re.fullmatch(r"r#1\.[0-9a-f]{8}", first) and second == "r#2." + first[-8:]
    assert [rid for rid, _ in script.aborts] == [first]


def test_decode_start_retries_are_bounded(stack):
    script, stub, _ = stack
    script.decode_start_failures = [grpc.StatusCode.UNAVAILABLE] * 5
    with pytest.raises(grpc.RpcError) as err:
        run(stub, prompt="x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "after 2 attempts" in err.value.details()
    assert len(script.decodes) == 2 and len(script.aborts) == 2
