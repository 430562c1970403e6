"""Request validation (errors name the field and value) and placement (pure ranking)."""

from __future__ import annotations

import pytest
from pdserve.common import wire
from pdserve.common.errors import InvalidArgument
from pdserve.common.layout import pages_for_tokens
from pdserve.router.api import ChatMessage, GenerateInput
from pdserve.router.placement import (
    DecodeLoad,
    PrefillLoad,
    rank_decode,
    rank_prefill,
)
from pdserve.router.tokenizer import Tokenizer
from pdserve.router.validation import DEFAULT_MAX_TOKENS, fit_context, validate

from tests.fakes import make_model_dir

pytestmark = pytest.mark.unit

MODEL = "tiny-test"


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_model_dir(tmp_path_factory.mktemp("m"), max_context=32))


def request(**fields: object) -> GenerateInput:
    """A GenerateInput as a front door builds it (lists become tuples)."""
    return GenerateInput(**{k: tuple(v) if isinstance(v, list) else v  # type: ignore[arg-type]
                            for k, v in fields.items()})


def test_defaults(tok):
    gen = validate(request(prompt="hello world"), tok, MODEL)
    assert len(gen.request_id) == 32
    assert gen.prompt_ids == tuple(tok.encode("hello world"))
    s = gen.sampling
    assert (s.temperature, s.top_p, s.top_k, s.seed, s.ignore_eos) == (1.0, 1.0, 0, None, False)
    assert DEFAULT_MAX_TOKENS > 32 and s.max_tokens == 32 - len(gen.prompt_ids)  # clamped
    pb = wire.sampling_to_pb(s)
    assert pb.max_tokens == s.max_tokens and not pb.HasField("seed")


def test_explicit_values_kept(tok):
    req = request(token_ids=[5, 6, 7], max_tokens=4, temperature=0.0, top_p=0.5, top_k=3, seed=9,
                  stop=["\n"], ignore_eos=True, request_id="client-1", model=MODEL)
    gen = validate(req, tok, MODEL)
    assert (gen.request_id, gen.prompt_ids, gen.stop) == ("client-1", (5, 6, 7), ("\n",))
    s = gen.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed, s.ignore_eos) == \
        (4, 0.0, 0.5, 3, 9, True)
    assert wire.sampling_to_pb(s).seed == 9


@pytest.mark.parametrize("kwargs, needle", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens=0"),
    ({"prompt": "hi", "max_tokens": -5}, "max_tokens=-5"),
    ({"prompt": "hi", "temperature": -0.5}, "temperature=-0.5"),
    ({"prompt": "hi", "temperature": float("nan")}, "temperature=nan"),
    ({"prompt": "hi", "top_p": 0.0}, "top_p=0.0"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p=1.5"),
    ({"prompt": "hi", "top_k": -1}, "top_k=-1"),
    ({}, "prompt=''"),
    ({"prompt": "hi", "token_ids": [3]}, "prompt="),
    ({"token_ids": [3, 100000]}, "token_ids=100000"),
    ({"token_ids": [3, -1]}, "token_ids=-1"),
    ({"prompt": "the quick brown fox " * 20}, "prompt of "),
    ({"token_ids": list(range(2, 40))}, "token_ids of 38 tokens: the prompt must be"),
    ({"prompt": "hi", "model": "gpt-9"}, "model='gpt-9'"),
    ({"prompt": "hi", "stop": ["ok", ""]}, "stop=''"),
    ({"prompt": "hi", "stop": ["s"] * 17}, "stop of 17 strings: at most 16"),
    ({"messages": [ChatMessage("user", "hi")]},
     "messages of 1 message: the model has no chat template"),
    ({"messages": [ChatMessage("user", "hi")] * 2}, "messages of 2 messages: "),
    ({"token_ids": [3], "messages": [ChatMessage("user", "hi")]},
     "token_ids of 1 id: give only one of prompt, token_ids and messages"),
    ({"prompt": "hi", "request_id": "bad\nid"}, "request_id="),
])
def test_invalid_requests_name_the_field(tok, kwargs, needle):
    with pytest.raises(InvalidArgument) as err:
        validate(request(**kwargs), tok, MODEL)
    assert err.value.code == "INVALID_ARGUMENT"
    field = needle.split("=")[0].split(" of ")[0]
    assert err.value.message.startswith((field + "=", field + " of "))
    assert needle in err.value.message


def test_the_context_is_kept_not_clamped():
    """prompt + max_tokens up to max_model_len is admitted; one token more is refused naming
    the context; an omitted max_tokens is the default, lowered to the room left."""
    assert fit_context("prompt", 10, 22, 32) == 22  # exactly the whole context
    with pytest.raises(InvalidArgument) as err:
        fit_context("prompt", 10, 23, 32)
    assert err.value.message == ("max_tokens=23: prompt (10 tokens) + max_tokens (23) = 33 "
                                 "exceeds the model's context of 32 tokens (max_model_len)")
    with pytest.raises(InvalidArgument) as err:
        fit_context("prompt", 1, 32, 32)
    assert err.value.message.startswith("max_tokens=32: prompt (1 token) + max_tokens (32)")
    assert fit_context("prompt", 10, None, 32) == 22
    assert fit_context("prompt", 10, None, 8192) == DEFAULT_MAX_TOKENS
    assert fit_context("prompt", 10, 10**6, None) == 10**6  # no limit known
    assert fit_context("token_ids", 31, 1, 32) == 1
    with pytest.raises(InvalidArgument, match="token_ids of 32 tokens: the prompt must be "
                                              "shorter than the model's context of 32"):
        fit_context("token_ids", 32, 1, 32)


def test_validate_takes_the_context_the_workers_serve(tok):
    ids = [5] * 10
    gen = validate(request(token_ids=ids, max_tokens=22), tok, MODEL)  # the config's 32
    assert gen.sampling.max_tokens == 22
    with pytest.raises(InvalidArgument, match="context of 20 tokens"):
        validate(request(token_ids=ids, max_tokens=11), tok, MODEL, max_model_len=20)
    gen = validate(request(token_ids=ids), tok, MODEL, max_model_len=20)
    assert gen.sampling.max_tokens == 10


def test_pages_for_tokens():
    assert [pages_for_tokens(n, 16) for n in (1, 16, 17, 32, 33)] == [1, 1, 2, 2, 3]


def test_prefill_least_pending_tokens_healthy_only():
    loads = [PrefillLoad("p1", True, queued_prompt_tokens=500),
             PrefillLoad("p2", True, inflight_prompt_tokens=100),
             PrefillLoad("p3", False),
             PrefillLoad("p4", True, queued_prompt_tokens=50, inflight_prompt_tokens=200)]
    assert rank_prefill(loads) == ["p2", "p4", "p1"]
    assert rank_prefill(loads, avoid={"p2"}) == ["p4", "p1", "p2"]
    assert rank_prefill([PrefillLoad("p3", False)]) == []


def test_decode_prefers_room_then_fewer_sequences_then_free_pages():
    loads = [DecodeLoad("d1", True, free_pages=100, running_sequences=4),
             DecodeLoad("d2", True, free_pages=50, running_sequences=1),
             DecodeLoad("d3", True, free_pages=2, running_sequences=0),     # no room for 40 tokens
             DecodeLoad("d4", True, free_pages=80, running_sequences=1),
             DecodeLoad("d5", False, free_pages=1000)]
    assert rank_decode(loads, num_prompt_tokens=40) == ["d4", "d2", "d1", "d3"]
    assert rank_decode(loads, num_prompt_tokens=10) == ["d3", "d4", "d2", "d1"]
    assert rank_decode(loads, 40, avoid={"d4"}) == ["d2", "d1", "d3", "d4"]


def test_decode_unknown_stats_and_reserved_tickets_count():
    loads = [DecodeLoad("d1", True),  # no Stats yet: assumed to have room
             DecodeLoad("d2", True, free_pages=100, reserved_tickets=2),
             DecodeLoad("d3", True, free_pages=100, waiting_sequences=1)]
    assert rank_decode(loads, 16) == ["d1", "d3", "d2"]
