"""Every RPC of the four services, fuzzed with malformed and extreme requests (hypothesis,
derandomized) against one real stack, while a canary streams greedy requests alongside.

Each request must get an answer or a named status with a message, never UNKNOWN / INTERNAL
(an exception nobody mapped) and never a hang; afterwards (the `guarded` fixture) every
process is alive and SERVING, the canary's every output was exact, and every page and
reservation is back. Requests are sent as raw bytes (see protofuzz), so they include bytes
that do not parse, invalid UTF-8, unknown fields and truncated messages.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pdserve.v1 import common_pb2, decode_pb2, kvtransfer_pb2, prefill_pb2, router_pb2

from tests.faults.protofuzz import (
    BAD_CODES,
    FUZZ,
    TEXT,
    check_outcome,
    raw_stream,
    raw_unary,
    wire_requests,
)
from tests.faults.stack import FaultStack

pytestmark = pytest.mark.faults

DEADLINE_S = 5.0


def _addresses(fs: FaultStack) -> st.SearchStrategy[str]:
    return st.sampled_from(["", "127.0.0.1:1", "nonsense", "[::1", fs.nodes["agent-b"].address,
                            fs.nodes["agent-a"].address])


def _agent_info(fs: FaultStack, name: str) -> kvtransfer_pb2.AgentInfo:
    stub = raw_unary(fs.channel(name), "/pdserve.v1.KVTransfer/GetAgentInfo")
    return kvtransfer_pb2.AgentInfo.FromString(stub(b"", timeout=5))


def _kv_overrides(fs: FaultStack) -> dict[str, st.SearchStrategy]:
    pools = [*_agent_info(fs, "agent-a").pool_ids, *_agent_info(fs, "agent-b").pool_ids]
    epochs = [_agent_info(fs, "agent-a").epoch, _agent_info(fs, "agent-b").epoch]
    page_ids = st.lists(st.integers(-2, 100), max_size=8) | st.just(list(range(96)) * 2)
    return {
        "KVDestination.agent_address": _addresses(fs),
        "KVDestination.pool_id": st.sampled_from(pools) | TEXT,
        "KVDestination.agent_epoch": st.sampled_from(epochs) | st.integers(0, 2**64 - 1),
        "KVDestination.page_ids": page_ids,
        "SendPagesRequest.src_pool_id": st.sampled_from(pools) | TEXT,
        "SendPagesRequest.src_page_ids": page_ids,
        "SendPagesRequest.timeout_ms": st.sampled_from([-1.0, 0.0, 1.0, 500.0, float("nan"),
                                                        float("inf"), 1e300]),
        "ExpectTransferRequest.pool_id": st.sampled_from(pools) | TEXT,
        "ExpectTransferRequest.page_ids": page_ids,
        "RegisterPoolRequest.worker_id": TEXT.map(lambda s: f"fuzz-{s}"),
        "PrefillRequest.token_ids": st.lists(st.integers(-5, 1100), max_size=40)
        | st.just([7] * 5000),
        "Ticket.request_id": TEXT.map(lambda s: f"fuzz-{s}"),
    }


def _templates(fs: FaultStack) -> dict[str, object]:
    """A valid request per message type: the fuzzers mostly send these with one field bent."""
    a, b = _agent_info(fs, "agent-a"), _agent_info(fs, "agent-b")
    fingerprint = fs.stats("decode-0").fingerprint
    ticket = common_pb2.Ticket(request_id="fuzz-t", epoch=1)
    destination = common_pb2.KVDestination(
        agent_address=fs.nodes["agent-b"].address, agent_epoch=b.epoch, pool_id=b.pool_ids[0],
        page_ids=[94, 95], fingerprint=fingerprint)
    sampling = common_pb2.SamplingParams(temperature=0.0, top_p=1.0, max_tokens=4)
    return {
        "GenerateRequest": router_pb2.GenerateRequest(prompt="def fibonacci(n):", max_tokens=4,
                                                      temperature=0.0),
        "PrefillRequest": prefill_pb2.PrefillRequest(
            request_id="fuzz-p", token_ids=list(range(5, 25)), sampling=sampling, ticket=ticket,
            destination=destination),
        "ReserveRequest": decode_pb2.ReserveRequest(request_id="fuzz-r", num_prompt_tokens=20),
        "DecodeRequest": decode_pb2.DecodeRequest(ticket=ticket, prompt_token_ids=[5, 6, 7],
                                                  first_token=9, sampling=sampling),
        "AbortRequest": decode_pb2.AbortRequest(ticket=ticket, reason="fuzz"),
        "RenewRequest": decode_pb2.RenewRequest(tickets=[ticket], renew_lease_ms=1000),
        "ExpectTransferRequest": kvtransfer_pb2.ExpectTransferRequest(
            ticket=ticket, pool_id=b.pool_ids[0], page_ids=[94, 95], lease_ms=1000),
        "CancelTransferRequest": kvtransfer_pb2.CancelTransferRequest(ticket=ticket),
        "TransferStatusRequest": kvtransfer_pb2.TransferStatusRequest(ticket=ticket),
        "SendPagesRequest": kvtransfer_pb2.SendPagesRequest(
            ticket=ticket, src_pool_id=a.pool_ids[0], src_page_ids=[94, 95],
            destination=destination, timeout_ms=2000),
        "GrantWriteRequest": kvtransfer_pb2.GrantWriteRequest(ticket=ticket),
    }


def _fuzz_unary(fs: FaultStack, node: str, method: str, request_cls, overrides,
                max_examples: int, on_ok=None) -> None:
    stub = raw_unary(fs.channel(node), method)
    template = _templates(fs).get(request_cls.DESCRIPTOR.name)

    @settings(FUZZ, max_examples=max_examples)
    @given(wire_requests(request_cls, overrides, template))
    def run(request: bytes) -> None:
        reply: list[bytes] = []
        check_outcome(method, request, lambda: reply.append(stub(request, timeout=DEADLINE_S)))
        if reply and on_ok is not None:
            on_ok(request, reply[0])

    run()


def _fuzz_stream(fs: FaultStack, node: str, method: str, request_cls, overrides,
                 max_examples: int) -> None:
    stub = raw_stream(fs.channel(node), method)
    template = _templates(fs).get(request_cls.DESCRIPTOR.name)

    @settings(FUZZ, max_examples=max_examples)
    @given(wire_requests(request_cls, overrides, template))
    def run(request: bytes) -> None:
        check_outcome(method, request, lambda: list(stub(request, timeout=DEADLINE_S)),
                      allow_deadline=True)  # our own deadline on a long generation

    run()


def test_router_generate(guarded):
    overrides = {"GenerateRequest.max_tokens": st.sampled_from([-1, 0, 1, 8, 2**31 - 1]),
                 "GenerateRequest.token_ids": st.lists(st.integers(-5, 1100), max_size=30)
                 | st.just([3] * 10_000),
                 "GenerateRequest.request_id": TEXT.map(lambda s: f"fuzz-{s}")}
    _fuzz_stream(guarded, "router", "/pdserve.v1.Router/Generate", router_pb2.GenerateRequest,
                 overrides, max_examples=40)


def test_prefill_rpcs(guarded):
    overrides = _kv_overrides(guarded)
    _fuzz_unary(guarded, "prefill-0", "/pdserve.v1.Prefill/Prefill", prefill_pb2.PrefillRequest,
                overrides, max_examples=40)
    _fuzz_unary(guarded, "prefill-0", "/pdserve.v1.Prefill/Stats", common_pb2.StatsRequest,
                {}, max_examples=5)


def test_decode_rpcs(guarded):
    fs = guarded
    overrides = {**_kv_overrides(fs), "ReserveRequest.request_id": TEXT.map(lambda s: f"fuzz-{s}"),
                 "DecodeRequest.prompt_token_ids": st.lists(st.integers(-5, 1100), max_size=30)}
    abort = raw_unary(fs.channel("decode-0"), "/pdserve.v1.Decode/Abort")
    granted: list[common_pb2.Ticket] = []

    def keep(_: bytes, reply: bytes) -> None:  # a Reserve that worked: its pages back after
        granted.append(decode_pb2.ReserveResponse.FromString(reply).ticket)

    _fuzz_unary(fs, "decode-0", "/pdserve.v1.Decode/Reserve", decode_pb2.ReserveRequest,
                overrides, max_examples=40, on_ok=keep)
    for method, cls in (("Abort", decode_pb2.AbortRequest), ("Renew", decode_pb2.RenewRequest),
                        ("Stats", common_pb2.StatsRequest)):
        _fuzz_unary(fs, "decode-0", f"/pdserve.v1.Decode/{method}", cls, overrides,
                    max_examples=25)
    _fuzz_stream(fs, "decode-0", "/pdserve.v1.Decode/Decode", decode_pb2.DecodeRequest,
                 overrides, max_examples=25)
    _fuzz_decode_many(fs, overrides, max_examples=25)
    for ticket in granted:
        abort(decode_pb2.AbortRequest(ticket=ticket).SerializeToString(), timeout=10)


def _fuzz_decode_many(fs: FaultStack, overrides, max_examples: int) -> None:
    """One bent message on a DecodeMany stream: the stream ends with a named status, or each
    sequence's update names its own (never UNKNOWN / INTERNAL, always with a message)."""
    method = "/pdserve.v1.Decode/DecodeMany"
    stub = fs.channel("decode-0").stream_stream(
        method, request_serializer=lambda b: b,
        response_deserializer=decode_pb2.DecodeManyResponse.FromString)
    template = decode_pb2.DecodeManyRequest(start=_templates(fs)["DecodeRequest"])

    def updates(request: bytes) -> None:
        for response in stub(iter([request]), timeout=DEADLINE_S):
            for u in response.updates:
                assert u.error_code not in BAD_CODES, f"{u.error_code} {u.error_message!r}"
                assert not u.error_code or u.error_message.strip(), u

    @settings(FUZZ, max_examples=max_examples)
    @given(wire_requests(decode_pb2.DecodeManyRequest, overrides, template))
    def run(request: bytes) -> None:
        check_outcome(method, request, lambda: updates(request), allow_deadline=True)

    run()


@pytest.mark.parametrize("agent", ["agent-a", "agent-b"])
def test_kvtransfer_rpcs(guarded, agent):
    overrides = _kv_overrides(guarded)
    cancel = raw_unary(guarded.channel(agent), "/pdserve.v1.KVTransfer/CancelTransfer")

    def close(request: bytes, _: bytes) -> None:  # a window that opened: closed again after
        ticket = kvtransfer_pb2.ExpectTransferRequest.FromString(request).ticket
        cancel(kvtransfer_pb2.CancelTransferRequest(ticket=ticket).SerializeToString(),
               timeout=10)

    for method, cls, n in (
            ("RegisterPool", kvtransfer_pb2.RegisterPoolRequest, 20),
            ("GetAgentInfo", kvtransfer_pb2.GetAgentInfoRequest, 5),
            ("ExpectTransfer", kvtransfer_pb2.ExpectTransferRequest, 25),
            ("CancelTransfer", kvtransfer_pb2.CancelTransferRequest, 15),
            ("TransferStatus", kvtransfer_pb2.TransferStatusRequest, 15),
            ("SendPages", kvtransfer_pb2.SendPagesRequest, 30),
            ("GrantWrite", kvtransfer_pb2.GrantWriteRequest, 10)):
        _fuzz_unary(guarded, agent, f"/pdserve.v1.KVTransfer/{method}", cls, overrides,
                    max_examples=n, on_ok=close if method == "ExpectTransfer" else None)
