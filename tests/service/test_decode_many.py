"""Decode/DecodeMany end to end (real processes, `pdserve up`, the tiny model): sequences
sharing one stream get exactly the tokens transformers gives, in fewer messages than a Decode
call each would send; a bad start fails alone with its Decode call's status; cancelling one
sequence, and closing the stream, free the pages; the router runs its sequences on one
shared stream per worker, and on a call each with --no-shared-decode-stream; a router relay
that fell behind sends the tokens that piled up as one message; a stream interval sends tokens
N to a message, from the worker through the router."""

from __future__ import annotations

import queue
import threading

import grpc
import pytest
import torch

from tests.service.stack import collect, pdserve_stack
from tests.support import samples, value, wait_for

pytestmark = pytest.mark.service

MAX_TOKENS = 12
INTERVAL = 4  # the stack's router --stream-interval
STARTS = "pdserve_decode_sequences_started_total"


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def _reference(hf, prompt: list[int], n: int = MAX_TOKENS) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n,
                      min_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _tokens(seed: int, n: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def pause(tmp_path_factory):
    return tmp_path_factory.mktemp("failpoints") / "relay"


@pytest.fixture(scope="module")
def stack(tiny_model_dir, pause):
    # The router holds a request named behind-* before relaying each decode message until
    # `relay.go` exists: what the worker streams meanwhile piles up in the router.
    # Its router asks for tokens 4 to a message after the first (--stream-interval 4).
    with pdserve_stack(env={"PDSERVE_FAILPOINTS": f"router.decoding@behind-=pause:{pause}",
                            "PDSERVE_ROUTER_STREAM_INTERVAL": str(INTERVAL)}) as s:
        yield s


@pytest.fixture
def decode(stack):
    from pdserve.v1 import decode_pb2_grpc

    with grpc.insecure_channel(stack.decode[0]) as channel:
        yield decode_pb2_grpc.DecodeStub(channel)


def _sampling(max_tokens: int = MAX_TOKENS):
    from pdserve.v1 import common_pb2

    return common_pb2.SamplingParams(max_tokens=max_tokens, top_p=1.0, ignore_eos=True)


def _started(decode, rid: str, prompt: list[int], max_tokens: int = MAX_TOKENS,
             interval: int = 0):
    """A sequence the decode worker computes itself (decode-first), ready for its start."""
    from pdserve.v1 import decode_pb2

    reply = decode.Reserve(decode_pb2.ReserveRequest(
        request_id=rid, num_prompt_tokens=len(prompt), prompt_token_ids=prompt,
        prefill_here_below_tokens=64, sampling=_sampling(max_tokens)), timeout=30)
    assert reply.prefilling_here
    return decode_pb2.DecodeManyRequest(start=decode_pb2.DecodeRequest(
        ticket=reply.ticket, prompt_token_ids=prompt, local_prefill=True,
        sampling=_sampling(max_tokens), stream_interval=interval))


class Stream:
    """A DecodeMany call fed from a queue; its responses read on a thread."""

    def __init__(self, decode):
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.call = decode.DecodeMany(iter(self.requests.get, None), timeout=120)
        self.responses: list = []
        self.updates: dict[str, list] = {}
        self.ended: dict[str, object] = {}  # request id -> its last update
        self._changed = threading.Condition()
        self.error: grpc.RpcError | None = None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for response in self.call:
                with self._changed:
                    self.responses.append(response)
                    for u in response.updates:
                        self.updates.setdefault(u.request_id, []).append(u)
                        if u.last:
                            self.ended[u.request_id] = u
                    self._changed.notify_all()
        except grpc.RpcError as exc:
            self.error = exc

    def send(self, request) -> None:
        self.requests.put(request)

    def wait(self, predicate, timeout_s: float = 60.0) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout=timeout_s)

    def tokens(self, rid: str) -> list[int]:
        return [t for u in self.updates.get(rid, []) for t in u.message.token_ids]

    def close(self) -> None:
        self.requests.put(None)
        self._reader.join(timeout=30)


def test_sequences_on_one_stream_get_their_tokens_in_fewer_messages(stack, decode, hf):
    total = stack.decode_stats().num_pages
    prompts = {f"many-{i}": _tokens(20 + i, 20 + 7 * i) for i in range(4)}
    stream = Stream(decode)
    try:
        for rid, prompt in prompts.items():
            stream.send(_started(decode, rid, prompt))
        assert stream.wait(lambda s: len(s.ended) == len(prompts)), stream.error
        for rid, prompt in prompts.items():
            assert stream.tokens(rid) == _reference(hf, prompt), rid
            first, last = stream.updates[rid][0], stream.ended[rid]
            assert first.message.prefill_ms > 0 and first.message.decode_start_ms >= 0
            assert last.message.finish_reason == "length" and not last.error_code
        # The sequences stepped together: their tokens came batched, not one message each.
        updates = sum(len(r.updates) for r in stream.responses)
        assert len(stream.responses) < updates
        assert max(len(r.updates) for r in stream.responses) >= 2
    finally:
        stream.close()
    assert stream.error is None  # the caller closed its side: the stream ended cleanly
    assert wait_for(lambda: stack.decode_stats().free_pages == total, timeout_s=15)


def test_a_bad_start_fails_alone_with_its_decode_calls_status(stack, decode, hf):
    from pdserve.v1 import decode_pb2

    aborted = _started(decode, "many-aborted", _tokens(30, 25), max_tokens=4000)
    assert decode.Abort(decode_pb2.AbortRequest(ticket=aborted.start.ticket), timeout=10).found
    good_prompt = _tokens(31, 33)
    stream = Stream(decode)
    try:
        stream.send(aborted)
        stream.send(_started(decode, "many-good", good_prompt))
        duplicate = decode_pb2.DecodeManyRequest()
        duplicate.CopyFrom(aborted)
        duplicate.start.ticket.request_id = "many-good"
        stream.send(duplicate)  # the name of a sequence already on the stream
        assert stream.wait(lambda s: "many-good" in s.ended and "many-aborted" in s.ended)
        bad = stream.ended["many-aborted"]
        assert bad.error_code == "FAILED_PRECONDITION"
        assert "expired or it was aborted" in bad.error_message
        assert stream.tokens("many-good") == _reference(hf, good_prompt)
        refused = [u for u in stream.updates["many-good"] if u.error_code]
        assert [(u.error_code, u.last) for u in refused] == [("INVALID_ARGUMENT", False)]
        assert "already on this stream" in refused[0].error_message
    finally:
        stream.close()


def test_cancel_and_closing_the_stream_abort_and_free_the_pages(stack, decode):
    from pdserve.v1 import decode_pb2

    total = stack.decode_stats().num_pages
    stream = Stream(decode)
    try:
        first = _started(decode, "many-cancel", _tokens(40, 30), max_tokens=4000)
        second = _started(decode, "many-left", _tokens(41, 30), max_tokens=4000)
        stream.send(first)
        stream.send(second)
        assert stream.wait(lambda s: len(s.tokens("many-cancel")) >= 3
                           and len(s.tokens("many-left")) >= 3)
        stream.send(decode_pb2.DecodeManyRequest(cancel=first.start.ticket))
        assert stream.wait(lambda s: "many-cancel" in s.ended)
        assert stream.ended["many-cancel"].message.finish_reason == "abort"
        assert "many-left" not in stream.ended  # the other goes on
        assert stack.decode_stats().running_sequences == 1
        stream.call.cancel()  # the caller goes away: what is left on the stream is aborted
    finally:
        stream.close()
    assert wait_for(lambda: stack.decode_stats().free_pages == total, timeout_s=15)
    assert stack.decode_stats().running_sequences == 0


def test_the_router_runs_its_sequences_on_one_shared_stream(stack, hf, tiny_model_dir):
    from pdserve.router.api import Finish, GenerateInput
    from pdserve.router.cancel import CallScope
    from pdserve.router.lifecycle import Lifecycle
    from pdserve.router.pool import WorkerPool
    from pdserve.router.tokenizer import Tokenizer

    def starts() -> tuple[float, float]:
        found = samples(stack.scrape("decode-0"))
        return value(found, STARTS, stream="shared"), value(found, STARTS, stream="own")

    before = starts()
    prompts = [_tokens(50 + i, 24) for i in range(3)]
    for prompt in prompts:
        ids, _, _, finish = collect(stack.generate(token_ids=prompt, max_tokens=MAX_TOKENS,
                                                   temperature=0.0, ignore_eos=True))
        assert ids == _reference(hf, prompt) and finish.completion_tokens == MAX_TOKENS
    assert starts() == (before[0] + 3, before[1])
    # --no-shared-decode-stream: the same tokens over a Decode call per sequence.
    pool = WorkerPool(stack.prefill, stack.decode, interval_s=60, shared_decode_stream=False)
    pool.check_now()
    lifecycle = Lifecycle(pool, Tokenizer.from_dir(tiny_model_dir), "tiny")
    try:
        events = list(lifecycle.generate(GenerateInput(
            token_ids=tuple(prompts[0]), max_tokens=MAX_TOKENS, temperature=0.0,
            ignore_eos=True), CallScope()))
    finally:
        lifecycle.close()
        pool.close()
    assert [t for e in events for t in getattr(e, "token_ids", ())] == _reference(hf, prompts[0])
    assert isinstance(events[-1], Finish) and events[-1].finish_reason == "length"
    assert starts() == (before[0] + 3, before[1] + 1)


def test_a_relay_that_fell_behind_sends_what_piled_up_as_one_message(stack, hf, pause):
    from pdserve.v1 import router_pb2, router_pb2_grpc

    def merged() -> float:
        return value(samples(stack.scrape("router")), "pdserve_relay_merged_messages_total")

    prompt = _tokens(60, 24)
    before = merged()
    with grpc.insecure_channel(stack.router) as channel:
        call = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
            request_id="behind-1", token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            ignore_eos=True), timeout=120)
        responses: list = []
        reader = threading.Thread(target=lambda: responses.extend(call), daemon=True)
        reader.start()
        hit = pause.with_name("relay.hit")
        assert wait_for(hit.exists, timeout_s=60), "the router never reached its relay"
        # The worker finishes the sequence while the router's relay waits.
        assert wait_for(lambda: stack.decode_stats().running_sequences == 0, timeout_s=60)
        pause.with_name("relay.go").touch()
        reader.join(timeout=60)
    assert not reader.is_alive()
    ids, text, _, finish = collect(responses)
    assert ids == _reference(hf, prompt) and finish.completion_tokens == MAX_TOKENS
    deltas = [r.delta for r in responses if r.WhichOneof("kind") == "delta"]
    # The first token went out before the pause; the eleven behind it in one or two messages
    # (the last may reach the router after the worker's Stats said it was done), not eleven.
    assert len(deltas) <= 3, [list(d.token_ids) for d in deltas]
    assert "".join(d.text for d in deltas) == text
    # The router counts what it merged: an operator's sign of a router core near saturation.
    assert merged() - before >= 1


def test_a_stream_interval_sends_tokens_n_to_a_message(stack, decode, hf):
    prompt = _tokens(70, 26)
    stream = Stream(decode)
    try:
        stream.send(_started(decode, "many-interval", prompt, interval=INTERVAL))
        assert stream.wait(lambda s: "many-interval" in s.ended), stream.error
    finally:
        stream.close()
    assert stream.tokens("many-interval") == _reference(hf, prompt)
    # The first token as it came (the sequence is live), then 4 at a time (a multiple of 4
    # when this reader fell behind and several steps came at once), and the 3 left.
    sizes = [len(u.message.token_ids) for u in stream.updates["many-interval"]]
    assert sizes[0] == 1 and sum(sizes) == 12 and sizes[-1] % INTERVAL == 3, sizes
    assert all(n and n % INTERVAL == 0 for n in sizes[1:-1]), sizes
    assert stream.ended["many-interval"].message.finish_reason == "length"


def test_a_stream_interval_out_of_range_is_refused_by_name(stack, decode):
    start = _started(decode, "many-bad-interval", _tokens(71, 20), interval=5000)
    with pytest.raises(grpc.RpcError) as refused:
        list(decode.Decode(start.start, timeout=30))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "stream_interval=5000: must be 0..4096" in refused.value.details()
    from pdserve.v1 import decode_pb2

    decode.Abort(decode_pb2.AbortRequest(ticket=start.start.ticket), timeout=10)


def test_the_routers_stream_interval_reaches_the_client(stack, hf):
    prompt = _tokens(72, 24)
    responses = stack.generate(token_ids=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                               ignore_eos=True)
    ids, text, _, finish = collect(responses)
    assert ids == _reference(hf, prompt) and finish.completion_tokens == MAX_TOKENS
    sizes = [len(r.delta.token_ids) for r in responses if r.WhichOneof("kind") == "delta"]
    # The prefill's token, the decode stream's first message, then INTERVAL at a time (a relay
    # that fell behind may send several of those at once); the last takes what is left.
    assert sizes[0] == 1 and len(sizes) < MAX_TOKENS // 2, sizes
    assert all(n % INTERVAL == 0 for n in sizes[2:-1]), sizes
