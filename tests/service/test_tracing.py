"""Distributed tracing end to end: `pdserve up --otlp-endpoint` against an OTLP receiver.

The receiver is a real OTLP/gRPC TraceService (the opentelemetry-proto stubs) in this test
process; every pdserve process exports to it. One request must give one trace across every
process it passes (router, prefill, the decode side's kvtransfer agent, decode; the prefill
side's agent too when the handoff goes through it), correctly parented, with the handoff's
figures as attributes; a client's own traceparent must be continued.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent import futures

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from pdserve.v1 import kvtransfer_pb2, kvtransfer_pb2_grpc, router_pb2, router_pb2_grpc

from tests.service.stack import collect, pdserve_stack, pdserve_stacks
from tests.support import free_port, pdserve_argv, running, wait_for

pytestmark = pytest.mark.service

SPAN_WAIT_S = 30.0
REQUEST_SPANS = {"router.generate", "router.admission", "router.reserve", "router.prefill",
                 "router.decode_stream", "decode.reserve", "prefill.request", "prefill.compute",
                 "kv.send", "kv.receive", "decode.admission", "decode.stream"}


@dataclasses.dataclass
class ExportedSpan:
    service: str
    instance: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict
    status_code: int  # 0 unset, 1 ok, 2 error
    status_message: str


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects every exported span."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ExportedSpan] = []

    def Export(self, request, context):
        got = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(ExportedSpan(
                        resource.get("service.name", ""), resource.get("service.instance.id", ""),
                        s.name, s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                        {a.key: _value(a.value) for a in s.attributes}, s.status.code,
                        s.status.message))
        with self._lock:
            self._spans += got
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self, predicate: Callable[[ExportedSpan], bool] = lambda s: True
              ) -> list[ExportedSpan]:
        with self._lock:
            return [s for s in self._spans if predicate(s)]

    def wait_for(self, predicate: Callable[[list[ExportedSpan]], bool],
                 timeout_s: float = SPAN_WAIT_S) -> list[ExportedSpan]:
        """Poll until `predicate(all spans)` holds (bounded); returns the spans."""
        if wait_for(lambda: predicate(self.spans()), timeout_s=timeout_s):
            return self.spans()
        names = sorted({(s.service, s.name) for s in self.spans()})
        raise AssertionError(f"spans did not arrive in {timeout_s:.0f}s; have {names}")


@pytest.fixture(scope="module")
def receiver():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    r = Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(r, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    r.port = port
    yield r
    server.stop(0)


@pytest.fixture(scope="module")
def stack(receiver, tiny_model_dir):
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}  # export within 0.1 s
    with pdserve_stack("--otlp-endpoint", f"127.0.0.1:{receiver.port}", env=env) as s:
        yield s


def _trace_of(receiver: Receiver, request_id: str) -> list[ExportedSpan]:
    """Every span of the request's trace, once all phases have arrived."""
    def complete(spans: list[ExportedSpan]) -> bool:
        roots = [s for s in spans if s.name == "router.generate"
                 and s.attributes.get("request_id") == request_id]
        return bool(roots) and REQUEST_SPANS <= {s.name for s in spans
                                                 if s.trace_id == roots[0].trace_id}
    spans = receiver.wait_for(complete)
    root = next(s for s in spans if s.name == "router.generate"
                and s.attributes.get("request_id") == request_id)
    return [s for s in spans if s.trace_id == root.trace_id]


def _one(spans: list[ExportedSpan], name: str) -> ExportedSpan:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, f"{len(found)} spans named {name}"
    return found[0]


def test_one_request_is_one_trace_across_every_process(stack, receiver):
    # On one host the prefill worker hands its pages to the decode side's agent itself: four
    # processes, the worker's kv.send the parent of that agent's kv.receive.
    _one_trace(stack, receiver, processes=4, sender="pdserve-prefill")


def test_through_the_agents_one_trace_spans_five_processes(receiver, tiny_model_dir):
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    with pdserve_stack("--otlp-endpoint", f"127.0.0.1:{receiver.port}",
                       "--no-same-host-lane", env=env) as s:
        _one_trace(s, receiver, processes=5, sender="pdserve-kvtransfer")


def _one_trace(stack, receiver, *, processes: int, sender: str) -> None:
    rid = "trace-" + secrets.token_hex(4)
    _, _, timing, finish = collect(stack.generate(request_id=rid, prompt="def fibonacci(n):",
                                                  max_tokens=8, temperature=0.0, ignore_eos=True))
    spans = _trace_of(receiver, rid)
    by_id = {s.span_id: s for s in spans}

    # Every process took part: 4 services; the agents told apart by instance id.
    assert {s.service for s in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode",
                                          "pdserve-kvtransfer"}
    assert len({(s.service, s.instance) for s in spans}) == processes
    # Everything the workers did for this request is in this one trace.
    assert all(s.trace_id == spans[0].trace_id
               for s in receiver.spans(lambda s: s.attributes.get("request_id") == rid))

    # Parenting: one root; every other span's parent is in the trace, across processes.
    root = _one(spans, "router.generate")
    assert root.parent_span_id == ""
    assert all(s.parent_span_id in by_id for s in spans if s is not root)

    def parent(name: str) -> str:
        return by_id[_one(spans, name).parent_span_id].name

    assert parent("router.admission") == parent("router.reserve") == "router.generate"
    assert parent("router.prefill") == parent("router.decode_stream") == "router.generate"
    assert parent("decode.reserve") == "router.reserve"
    assert parent("prefill.request") == "router.prefill"
    assert parent("prefill.compute") == "prefill.request"
    assert parent("kv.send") == "prefill.request"
    assert parent("kv.receive") == "kv.send"
    assert parent("decode.admission") == parent("decode.stream") == "router.decode_stream"
    send, receive = _one(spans, "kv.send"), _one(spans, "kv.receive")
    assert (send.service, receive.service) == (sender, "pdserve-kvtransfer")
    assert send.instance != receive.instance  # the prefill side, then the decode host's agent

    # The TTFT components and the handoff as attributes.
    assert root.attributes["model"] == "builtin-tiny"
    assert root.attributes["kv_bytes"] == timing.kv_bytes > 0
    assert root.attributes["kv_transfer_ms"] == pytest.approx(timing.kv_transfer_ms, abs=1e-3)
    assert root.attributes["ttft_ms"] == pytest.approx(timing.ttft_ms, abs=1e-3)
    for key in ("queue_ms", "prefill_ms", "decode_start_ms"):
        assert key in root.attributes
    assert root.attributes["kv_transport"] == timing.kv_transport
    assert root.attributes["decode"] == timing.decode_worker
    assert root.attributes["completion_tokens"] == finish.completion_tokens == 8
    assert send.attributes["kv_bytes"] == receive.attributes["kv_bytes"] == timing.kv_bytes
    assert send.attributes["kv_pages"] == timing.kv_pages
    # The agent's part of the handoff lies within what the prefill worker measured around it.
    assert 0 < send.attributes["handoff_ms"] <= timing.kv_transfer_ms + 1e-3
    assert send.attributes["kv_transport"] == timing.kv_transport
    prefill = _one(spans, "prefill.request")
    assert prefill.attributes["kv_bytes"] == timing.kv_bytes
    assert prefill.attributes["kv_transfer_ms"] == pytest.approx(timing.kv_transfer_ms, abs=1e-3)
    assert root.attributes["kv_transfer_total_ms"] == pytest.approx(timing.kv_transfer_total_ms,
                                                                    abs=1e-3)
    assert prefill.attributes["prefill_ms"] == pytest.approx(timing.prefill_ms, abs=1e-3)
    assert _one(spans, "decode.stream").attributes["finish_reason"] == "length"
    assert all(s.status_code != 2 for s in spans), [(s.name, s.status_message) for s in spans]


def test_a_client_traceparent_is_continued(stack, receiver):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    rid = "traced-client-" + secrets.token_hex(4)
    with grpc.insecure_channel(stack.router) as ch:
        list(router_pb2_grpc.RouterStub(ch).Generate(
            router_pb2.GenerateRequest(request_id=rid, prompt="Hello", max_tokens=4,
                                       temperature=0.0),
            metadata=(("traceparent", f"00-{trace_id}-{client_span}-01"),), timeout=60))
    spans = _trace_of(receiver, rid)
    assert {s.trace_id for s in spans} == {trace_id}
    assert _one(spans, "router.generate").parent_span_id == client_span
    assert {s.service for s in spans} >= {"pdserve-router", "pdserve-prefill", "pdserve-decode",
                                          "pdserve-kvtransfer"}


def test_an_http_client_traceparent_is_continued(stack, receiver):
    trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
    rid = "traced-http-" + secrets.token_hex(4)
    request = urllib.request.Request(
        f"{stack.http}/completions", data=json.dumps({"prompt": "Hello", "max_tokens": 4}).encode(),
        headers={"traceparent": f"00-{trace_id}-{client_span}-01", "X-Request-Id": rid})
    with urllib.request.urlopen(request, timeout=60) as reply:
        assert json.loads(reply.read())["id"] == f"cmpl-{rid}"
    spans = _trace_of(receiver, rid)
    assert {s.trace_id for s in spans} == {trace_id}
    root = _one(spans, "router.generate")
    assert root.parent_span_id == client_span and root.attributes["api"] == "http"


def test_a_failed_request_records_its_status_code(stack, receiver):
    rid = "traced-bad-" + secrets.token_hex(4)
    with pytest.raises(grpc.RpcError) as failure:
        stack.generate(request_id=rid, prompt="x", max_tokens=1, temperature=-1.0)
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = receiver.wait_for(lambda spans: any(
        s.name == "router.generate" and s.attributes.get("request_id") == rid for s in spans))
    root = next(s for s in spans if s.name == "router.generate"
                and s.attributes.get("request_id") == rid)
    assert root.status_code == 2 and "INVALID_ARGUMENT" in root.status_message
    assert root.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert root.attributes["status"] == "INVALID_ARGUMENT"


def test_spans_are_flushed_when_a_process_is_stopped(receiver):
    """A long batch delay: the span can only arrive through the flush at SIGTERM."""
    port = free_port()
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
           "OTEL_BSP_SCHEDULE_DELAY": "600000", "PDSERVE_KVTRANSFER_METRICS_PORT": "-1"}
    rid = "flush-" + secrets.token_hex(4)
    argv = pdserve_argv("kvtransfer", "--port", str(port), "--transport", "tcp",
                        "--agent-id", "flush-test")
    with running(argv, f"127.0.0.1:{port}", env=env) as agent:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as failure:
                kvtransfer_pb2_grpc.KVTransferStub(ch).SendPages(kvtransfer_pb2.SendPagesRequest(
                    ticket={"request_id": rid, "epoch": 1}, src_pool_id="no-such-pool",
                    src_page_ids=[0]), timeout=10)
        assert failure.value.code() == grpc.StatusCode.NOT_FOUND
        assert not receiver.spans(lambda s: s.attributes.get("request_id") == rid)
        started = time.monotonic()
        assert agent.stop() == 0
        assert time.monotonic() - started < 10.0
    [span] = receiver.wait_for(lambda spans: any(
        s.attributes.get("request_id") == rid for s in spans), timeout_s=5.0
        ) and receiver.spans(lambda s: s.attributes.get("request_id") == rid)
    assert (span.name, span.service, span.instance) == ("kv.send", "pdserve-kvtransfer",
                                                        "flush-test")
    assert span.status_code == 2
    assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.NOT_FOUND.value[0]


def test_the_colocated_worker_is_traced_under_its_own_name(receiver, tiny_model_dir):
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    rid = "traced-colocated-" + secrets.token_hex(4)
    with pdserve_stack("--otlp-endpoint", f"127.0.0.1:{receiver.port}", colocated=True,
                       env=env) as s:
        s.generate(request_id=rid, prompt="Hello", max_tokens=4, temperature=0.0,
                   ignore_eos=True)
        # The prompt starts at Reserve: its prefill is on decode.admission (no Prefill call).
        names = {"router.generate", "decode.reserve", "decode.admission", "decode.stream"}
        spans = receiver.wait_for(lambda spans: names <= {
            x.name for x in spans if x.attributes.get("request_id") == rid})
    mine = [x for x in spans if x.attributes.get("request_id") == rid]
    (admission,) = [x for x in mine if x.name == "decode.admission"]
    assert admission.attributes["prefill_on"] == "prefill"
    assert admission.attributes["prefill_ms"] > 0
    assert {x.service for x in mine} == {"pdserve-router", "pdserve-colocated"}
    assert len({x.trace_id for x in mine}) == 1
    assert not [x for x in mine if x.name.startswith("kv.")]  # no handoff between agents


TP_SPLITS = [(2, 1), (1, 2)]


@pytest.fixture(scope="module")
def tp_stacks(receiver, tiny_model_dir):
    """{(P, D): stack} for each split, started side by side (their start-ups overlap)."""
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100"}
    with pdserve_stacks(*(("--otlp-endpoint", f"127.0.0.1:{receiver.port}", "--prefill-tp",
                           str(p), "--decode-tp", str(d)) for p, d in TP_SPLITS),
                        env=env) as running:
        yield dict(zip(TP_SPLITS, running, strict=True))


@pytest.mark.parametrize("p,d", TP_SPLITS)
def test_a_handoff_between_tp_splits_shows_each_rank_pair(receiver, tp_stacks, p, d):
    """Prefill TP P -> decode TP D on one host: a kv.rank_handoff span per decode rank under
    prefill.request names where that rank's heads came from and how (re-laid out in the
    receiving agent's copy, nothing packed); together they carry the handoff's bytes."""
    rid = "trace-tp-" + secrets.token_hex(4)
    _, _, timing, _ = collect(tp_stacks[p, d].generate(
        request_id=rid, prompt="def fibonacci(n):", max_tokens=4, temperature=0.0,
        ignore_eos=True))
    spans = _trace_of(receiver, rid)
    by_id = {sp.span_id: sp for sp in spans}
    ranks = sorted((sp for sp in spans if sp.name == "kv.rank_handoff"),
                   key=lambda sp: sp.attributes["decode_rank"])
    assert [sp.attributes["decode_rank"] for sp in ranks] == list(range(d))
    for rank in ranks:
        assert by_id[rank.parent_span_id].name == "prefill.request"
        assert rank.attributes["prefill_tp"] == p and rank.attributes["decode_tp"] == d
        first = rank.attributes["decode_rank"] * p // d
        last = ((rank.attributes["decode_rank"] + 1) * p - 1) // d
        assert rank.attributes["source"] == \
            f"prefill ranks {first}..{last}, re-laid out in the receiver's copy"
        assert rank.attributes["pack_ms"] == 0 and rank.attributes["kv_transport"] == "shm"
    assert sum(sp.attributes["kv_bytes"] for sp in ranks) == timing.kv_bytes > 0
