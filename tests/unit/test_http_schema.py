"""OpenAI request bodies -> GenerateInput (strict types, each refusal naming its field), and the
lifecycle's events -> OpenAI responses and Server-Sent Events."""

from __future__ import annotations

import json

import pytest
from pdserve.router.api import ChatMessage, Delta, Finish, GenerateInput, Timing
from pdserve.router.http_format import Answer, error_body, service_error_body
from pdserve.router.http_schema import BadRequest, parse_chat, parse_completion, parse_json

pytestmark = pytest.mark.unit


def refusal(parse, body) -> BadRequest:
    with pytest.raises(BadRequest) as info:
        parse(body)
    return info.value


def test_a_completion_body_becomes_a_generate_input():
    got = parse_completion({"model": "m", "prompt": "hi", "max_tokens": 5, "temperature": 0,
                            "top_p": 0.9, "top_k": 4, "seed": 7, "stop": "\n",
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}}, "rid-1")
    assert got.input == GenerateInput(prompt="hi", max_tokens=5, temperature=0.0, top_p=0.9,
                                      top_k=4, seed=7, stop=("\n",), ignore_eos=True,
                                      request_id="rid-1", model="m")
    assert (got.chat, got.model, got.stream, got.include_usage) == (False, "m", True, True)
    # Token ids, one-element batches, max_completion_tokens over max_tokens, top_k -1 = off.
    assert parse_completion({"prompt": [1, 2, 3]}).input.token_ids == (1, 2, 3)
    assert parse_completion({"prompt": ["x"]}).input.prompt == "x"
    assert parse_completion({"prompt": [[4, 5]]}).input.token_ids == (4, 5)
    both = parse_completion({"prompt": "x", "max_tokens": 3, "max_completion_tokens": 9,
                             "top_k": -1, "stop": ["a", "b"], "n": 1, "echo": False})
    assert (both.input.max_tokens, both.input.top_k, both.input.stop) == (9, None, ("a", "b"))
    assert parse_completion({"prompt": "x", "stop": None, "seed": None}).input.stop == ()


def test_a_chat_body_becomes_messages():
    got = parse_chat({"messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hel"},
                                     {"type": "text", "text": "lo"}]}]})
    assert got.chat and got.input.messages == (ChatMessage("system", "be brief"),
                                               ChatMessage("user", "hello"))


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"prompt": "x", "max_tokens": "8"}, "max_tokens", "expected an integer, got a string"),
    ({"prompt": "x", "max_tokens": 8.0}, "max_tokens", "expected an integer, got a number"),
    ({"prompt": "x", "max_tokens": True}, "max_tokens", "expected an integer, got a boolean"),
    ({"prompt": "x", "temperature": "0"}, "temperature", "expected a number"),
    ({"prompt": "x", "temperature": False}, "temperature", "expected a number"),
    ({"prompt": "x", "temperature": 10**400}, "temperature", "a finite number"),
    ({"prompt": "x", "top_p": [1]}, "top_p", "expected a number, got a list"),
    ({"prompt": "x", "temperature": 1e39}, "temperature", "a finite number"),
    ({"prompt": "x", "top_k": 2**31}, "top_k", "out of range"),
    ({"prompt": "x", "max_tokens": -(2**40)}, "max_tokens", "out of range"),
    ({"prompt": "x", "seed": 1.5}, "seed", "expected an integer"),
    ({"prompt": "x", "stop": 3}, "stop", "a string or a list of strings"),
    ({"prompt": "x", "stop": ["a", 1]}, "stop", "a string or a list of strings"),
    ({"prompt": "x", "n": 2}, "n", "only n=1 is supported"),
    ({"prompt": "x", "n": "1"}, "n", "expected an integer"),
    ({"prompt": "x", "stream": "yes"}, "stream", "expected true or false"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
     "only allowed with stream=true"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage", "expected true or false"),
    ({"prompt": "x", "ignore_eos": 1}, "ignore_eos", "expected true or false"),
    ({"prompt": "x", "model": 5}, "model", "expected a string"),
    ({"prompt": "x", "echo": True}, "echo", "not supported"),
    ({"prompt": "x", "logprobs": 3}, "logprobs", "not supported"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "not supported"),
    ({}, "prompt", "required"),
    ({"prompt": None}, "prompt", "required"),
    ({"prompt": 5}, "prompt", "got an integer"),
    ({"prompt": []}, "prompt", "empty list"),
    ({"prompt": [1, "a"]}, "prompt", "expected a string or a list of integer token ids"),
    ({"prompt": [1, True]}, "prompt", "expected a string or a list of integer token ids"),
    ({"prompt": ["a", "b"]}, "prompt", "a batch of 2 prompts is not supported"),
    ({"prompt": {"text": "x"}}, "prompt", "got an object"),
])
def test_wrong_types_are_refused_naming_the_field(body, param, words):
    exc = refusal(parse_completion, body)
    assert (exc.status, exc.param) == (400, param) and words in exc.message, exc.message


@pytest.mark.parametrize(("messages", "words"), [
    (None, "messages: required"),
    ([], "an empty list"),
    ("hi", "expected a non-empty list"),
    (["hi"], "messages[0]: expected an object"),
    ([{"role": "robot", "content": "x"}], "messages[0].role='robot'"),
    ([{"role": "user"}], "messages[0].content: expected a string or a list of text parts"),
    ([{"role": "user", "content": [{"type": "image_url"}]}], "only text is supported"),
])
def test_bad_messages_are_refused_naming_where(messages, words):
    exc = refusal(parse_chat, {"messages": messages} if messages is not None else {})
    assert exc.param == "messages" and words in exc.message, exc.message


@pytest.mark.parametrize(("raw", "words"), [
    (b"{", "not valid JSON"), (b"[1, 2]", "must be a JSON object, not a list"),
    (b'{"temperature": NaN}', "NaN is not a number"), (b"\xff\xfe", "not valid JSON"),
    (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"), (b"1" * 5000, "not valid JSON"),
    (b'"x"', "must be a JSON object, not a string"),
])
def test_bodies_that_are_not_a_json_object_are_refused(raw, words):
    exc = refusal(parse_json, raw)
    assert exc.status == 400 and words in exc.message, exc.message


def test_lifecycle_errors_map_to_http_statuses_naming_the_field():
    status, body = service_error_body("INVALID_ARGUMENT", "token_ids=99999: token id outside")
    assert status == 400 and body["error"]["param"] == "prompt"
    _, body = service_error_body("INVALID_ARGUMENT", "messages of 1 message: no chat template")
    assert body["error"]["param"] == "messages"
    assert body["error"]["code"] == "invalid_argument"
    assert service_error_body("RESOURCE_EXHAUSTED", "no pages")[0] == 429
    assert service_error_body("UNAVAILABLE", "draining")[0] == 503
    assert service_error_body("UNAUTHENTICATED", "no key")[0] == 401
    assert service_error_body("DEADLINE_EXCEEDED", "slow")[0] == 504
    assert service_error_body("INTERNAL", "bug") == (500, {"error": {
        "message": "bug", "type": "server_error", "param": None, "code": "internal"}})


@pytest.mark.parametrize("status, kind", [(404, "invalid_request_error"),
                                          (405, "invalid_request_error"),
                                          (422, "invalid_request_error"),
                                          (429, "rate_limit_error"), (500, "server_error"),
                                          (503, "server_error")])
def test_client_errors_are_typed_as_the_clients(status, kind):
    assert error_body(status, "no")["error"]["type"] == kind


EVENTS = [Delta("r1", "Hel", (5,)), Timing("r1", queue_ms=1.0, ttft_ms=9.0, kv_bytes=64,
                                             kv_pages=1, kv_transport="ucx", cached_tokens=2),
          Delta("r1", "", (6,)), Delta("r1", "lo", (7,)),
          Finish("r1", "length", 4, 3, e2e_ms=20.0, tpot_ms=2.0, itl_mean_ms=2.0,
                 itl_max_ms=3.0)]


def events_of(stream: bytes) -> list[object]:
    assert stream.endswith(b"\n\n") and all(e.startswith(b"data: ")
                                           for e in stream.split(b"\n\n")[:-1])
    return [e[6:] if e[6:] == b"[DONE]" else json.loads(e[6:])
            for e in stream.split(b"\n\n")[:-1]]


def test_a_stream_coalesces_each_batch_and_ends_with_usage_timing_and_done():
    answer = Answer(False, "m", include_usage=True, return_token_ids=True)
    out = b"".join(answer.chunks(EVENTS[:2])) + b"".join(answer.chunks(EVENTS[2:]))
    out += b"".join(answer.end())
    first, second, last, usage, done = events_of(out)
    assert first["choices"] == [{"index": 0, "text": "Hel", "logprobs": None,
                                 "finish_reason": None, "token_ids": [5]}]
    assert first["id"] == "cmpl-r1" and first["usage"] is None
    assert second["choices"][0]["text"] == "lo" and second["choices"][0]["token_ids"] == [6, 7]
    assert last["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 4,
                                                         "completion_tokens": 3,
                                                         "total_tokens": 7,
                                                         "prompt_tokens_details": {
                                                             "cached_tokens": 2}}
    timing = usage["pdserve"]["timing"]
    assert (timing["ttft_ms"], timing["kv_bytes"], timing["kv_transport"]) == (9.0, 64, "ucx")
    assert usage["pdserve"]["latency"]["e2e_ms"] == 20.0 and done == b"[DONE]"


def test_a_chat_answer_says_assistant_once_and_carries_the_breakdown():
    streamed = Answer(True, "m")
    chunks = events_of(b"".join(streamed.chunks(EVENTS)) + b"".join(streamed.end()))
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "Hello"}
    assert chunks[1]["choices"][0]["delta"] == {"content": ""}
    assert "pdserve" in chunks[1] and "usage" not in chunks[1] and chunks[2] == b"[DONE]"
    whole = Answer(True, "m")
    whole.feed(EVENTS[:1])
    whole.feed(EVENTS[1:])
    body = whole.body()
    assert body["id"] == "chatcmpl-r1" and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello"}
    assert body["usage"]["total_tokens"] == 7 and body["pdserve"]["timing"]["queue_ms"] == 1.0


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("token_ids", [False, True])
def test_the_fast_path_of_a_delta_chunk_writes_what_the_object_would(chat, include_usage,
                                                                     token_ids):
    answer = Answer(chat, "tiny \"model\"", include_usage=include_usage,
                    return_token_ids=token_ids)
    first = json.loads(b"".join(answer.chunks([Delta("r1", "Hé", (1,))]))[6:])
    for text, ids in ((" member", (952,)), ('"\\\n🙂\x00', (3, 4)), ("", (5,))):
        fast = b"".join(answer.chunks([Delta("r1", text, ids)]))
        expected = {**first, "choices": [{"index": 0, **({"delta": {"content": text}} if chat
                                                         else {"text": text}),
                                          "logprobs": None, "finish_reason": None,
                                          **({"token_ids": list(ids)} if token_ids else {})}]}
        assert fast.startswith(b"data: ") and fast.endswith(b"\n\n")
        assert json.loads(fast[6:]) == expected


def test_lone_surrogate_escapes_are_refused_naming_where_pairs_are_text():
    for raw, param, where in ((rb'{"prompt": "a\ud800b"}', "prompt", "prompt:"),
                              (rb'{"stop": ["x", "\uDFFF"]}', "stop", "stop[1]:"),
                              (rb'{"messages": [{"role": "user", "content": "\udc00"}]}',
                               "messages", "messages[0].content:"),
                              (rb'{"model": "\ud800"}', "model", "model:")):
        exc = refusal(parse_json, raw)
        assert (exc.status, exc.param) == (400, param) and exc.message.startswith(where), \
            exc.message
        assert "lone surrogate" in exc.message
    assert parse_json(rb'{"prompt": "\ud83d\ude00"}') == {"prompt": "\U0001f600"}
