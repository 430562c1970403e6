"""The request lifecycle against scripted in-process Prefill/Decode servers (loopback gRPC).

The fakes only speak the pdserve.v1 contract; real workers are exercised by service tests.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2
from pdserve.common import errors, server
from pdserve.router.lifecycle import Lifecycle
from pdserve.router.pool import WorkerPool
from pdserve.router.servicer import RouterServicer
from pdserve.router.tokenizer import Tokenizer
from pdserve.v1 import (
    common_pb2,
    decode_pb2,
    decode_pb2_grpc,
    prefill_pb2,
    prefill_pb2_grpc,
    router_pb2,
    router_pb2_grpc,
)

from tests.unit.test_router_text import make_model_dir

pytestmark = pytest.mark.unit

TEXT = "hello world, the quick brown fox jumps over the lazy dog"
EOS = 1


@dataclass
class Script:
    """What the fake workers do; what they saw."""

    tokens: list[int] = field(default_factory=list)  # first token, then what decode streams
    decode_finish: str = "length"
    prefill_failures: list[grpc.StatusCode] = field(default_factory=list)
    decode_fail_after: int | None = None
    decode_start_failures: list[grpc.StatusCode] = field(default_factory=list)
    exhausted: bool = False
    block_prefill: threading.Event | None = None
    block_decode_after: int | None = None
    reserves: list[str] = field(default_factory=list)
    prefills: list[str] = field(default_factory=list)
    decodes: list[decode_pb2.DecodeRequest] = field(default_factory=list)
    aborts: list[tuple[str, str]] = field(default_factory=list)
    aborted_tickets: set[tuple[str, int]] = field(default_factory=set)
    cancelled: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)


class FakePrefill(prefill_pb2_grpc.PrefillServicer):
    def __init__(self, script: Script, name: str):
        self.script, self.name = script, name

    def Prefill(self, request, context):
        with self.script.lock:
            self.script.prefills.append(self.name)
            failure = self.script.prefill_failures.pop(0) if self.script.prefill_failures else None
        if failure is not None:
            context.abort(failure, f"{self.name} failed on purpose")
        if self.script.block_prefill is not None:
            while context.is_active() and not self.script.block_prefill.wait(0.02):
                pass
            if not context.is_active():
                self.script.cancelled.set()
                return prefill_pb2.PrefillResponse()
        report = common_pb2.TransferReport(handoff_ms=2.5, kv_bytes=4096,
                                           kv_pages=len(request.destination.page_ids),
                                           transport="local")
        return prefill_pb2.PrefillResponse(first_token=self.script.tokens[0], queue_ms=1.0,
                                           prefill_ms=3.0, transfer=report, worker_id=self.name)

    def Stats(self, request, context):
        return common_pb2.WorkerStats(worker_id=self.name, role="prefill")


class FakeDecode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, script: Script, name: str):
        self.script, self.name = script, name

    def Reserve(self, request, context):
        self.script.reserves.append(self.name)
        if self.script.exhausted:
            raise errors.ResourceExhausted(f"{self.name} has no free pages")
        ticket = common_pb2.Ticket(request_id=request.request_id, epoch=len(self.script.reserves),
                                   decode_worker=self.name)
        pages = list(range(-(-request.num_prompt_tokens // 16)))
        return decode_pb2.ReserveResponse(ticket=ticket, destination=common_pb2.KVDestination(
            agent_address="agent:1", pool_id="pool", page_ids=pages))

    def Decode(self, request, context):
        self.script.decodes.append(request)
        with self.script.lock:
            failure = (self.script.decode_start_failures.pop(0)
                       if self.script.decode_start_failures else None)
        if failure is not None:
            context.abort(failure, f"{self.name} could not start the sequence")
        yield decode_pb2.DecodeResponse(decode_start_ms=1.5)
        rest = self.script.tokens[1:]
        for i, token in enumerate(rest):
            if self.script.decode_fail_after == i:
                raise errors.Unavailable(f"{self.name} died")
            if self.script.block_decode_after == i:
                while context.is_active():
                    time.sleep(0.02)
                self.script.cancelled.set()
                return
            if (request.ticket.request_id, request.ticket.epoch) in self.script.aborted_tickets:
                return
            last = i == len(rest) - 1
            yield decode_pb2.DecodeResponse(token_ids=[token],
                                            finish_reason=self.script.decode_finish if last else "")
            time.sleep(0.005)

    def Abort(self, request, context):
        self.script.aborts.append((request.ticket.request_id, request.reason))
        self.script.aborted_tickets.add((request.ticket.request_id, request.ticket.epoch))
        return decode_pb2.AbortResponse(found=True)

    def Stats(self, request, context):
        return common_pb2.WorkerStats(worker_id=self.name, role="decode", num_pages=100,
                                      free_pages=100)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_model_dir(tmp_path_factory.mktemp("m"), max_context=256))


@pytest.fixture
def stack(tok):
    """Two prefill and one decode fake, and a router in front; yields (script, stub, lifecycle)."""
    script = Script(tokens=tok.encode(TEXT))
    handles = [
        server.start("p0", 0, lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(
            FakePrefill(script, "p0"), s), host="127.0.0.1"),
        server.start("p1", 0, lambda s: prefill_pb2_grpc.add_PrefillServicer_to_server(
            FakePrefill(script, "p1"), s), host="127.0.0.1"),
        server.start("d0", 0, lambda s: decode_pb2_grpc.add_DecodeServicer_to_server(
            FakeDecode(script, "d0"), s), host="127.0.0.1"),
    ]
    addresses = [f"127.0.0.1:{h.port}" for h in handles]
    pool = WorkerPool(addresses[:2], addresses[2:], interval_s=60)
    assert not pool.ready()
    pool.check_now()
    assert pool.ready()
    lifecycle = Lifecycle(pool, tok, "tiny-test", max_retries=1)
    router = server.start("router", 0, lambda s: router_pb2_grpc.add_RouterServicer_to_server(
        RouterServicer(lifecycle), s), host="127.0.0.1", ready=pool.ready)
    channel = grpc.insecure_channel(f"127.0.0.1:{router.port}")
    yield script, router_pb2_grpc.RouterStub(channel), lifecycle
    channel.close()
    pool.close()
    for h in (router, *handles):
        h.server.stop(0)


def run(stub, **kwargs) -> list[router_pb2.GenerateResponse]:
    return list(stub.Generate(router_pb2.GenerateRequest(**kwargs), timeout=20))


def kinds(responses) -> str:
    return "".join({"delta": "d", "timing": "t", "finish": "f"}[r.WhichOneof("kind")]
                   for r in responses)


def text_of(responses) -> str:
    return "".join(r.delta.text for r in responses if r.HasField("delta"))


def test_stream_order_text_timing_and_finish(stack, tok):
    script, stub, _ = stack
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
    assert script.decodes[0].ticket.request_id == out[0].request_id + "#2"  # one id per attempt


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


def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_client_cancel_during_prefill_cancels_it_and_frees_pages(stack):
    script, stub, _ = stack
    script.block_prefill = threading.Event()
    call = stub.Generate(router_pb2.GenerateRequest(prompt="x"), timeout=20)
    wait_for(lambda: script.prefills)
    call.cancel()
    assert script.cancelled.wait(5)            # the Prefill call itself was cancelled
    wait_for(lambda: len(script.aborts) == 1)  # and the reservation released
    assert script.decodes == []


def test_client_cancel_during_decode_stops_stream_and_aborts(stack):
    script, stub, _ = stack
    script.block_decode_after = 3
    call = stub.Generate(router_pb2.GenerateRequest(prompt="x"), timeout=20)
    got = [next(call) for _ in range(5)]       # first delta, timing, three more deltas
    assert kinds(got) == "dtddd"
    call.cancel()
    assert script.cancelled.wait(5)
    wait_for(lambda: len(script.aborts) == 1)


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
    assert [d.ticket.request_id for d in script.decodes] == ["r", "r#2"]
    assert [rid for rid, _ in script.aborts] == ["r"]


def test_decode_start_retries_are_bounded(stack):
    script, stub, _ = stack
    script.decode_start_failures = [grpc.StatusCode.UNAVAILABLE] * 5
    with pytest.raises(grpc.RpcError) as err:
        run(stub, prompt="x")
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "after 2 attempts" in err.value.details()
    assert len(script.decodes) == 2 and len(script.aborts) == 2
