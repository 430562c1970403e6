"""The router's OpenAI-compatible HTTP API against real processes (`pdserve up`, the built-in
tiny model): the official `openai` client and plain `curl`, outputs token for token against
transformers, errors in OpenAI's shape, and a client that goes away (during prefill or
mid-stream) freeing its pages on both workers."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import urllib.parse

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import MAX_TOKENS, PROMPTS
from tests.service.stack import pdserve_stack
from tests.support import wait_for

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    # Small prefill chunks: a 3,000-token prompt takes long enough to disconnect during it.
    with pdserve_stack(env={"PDSERVE_PREFILL_CHUNK_SIZE": "8"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0,
                       timeout=120) as c:
        yield c


def total(text: str, metric: str, **labels: str) -> float:
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == metric and all(s.labels.get(k) == v for k, v in labels.items()))


def test_greedy_completions_equal_transformers(stack, client, reference):
    tok, refs = reference
    model = client.models.list().data[0].id
    for prompt in PROMPTS:
        n_prompt, ref_ids = refs[prompt]
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"return_token_ids": True})
        choice = reply.choices[0]
        assert choice.model_extra["token_ids"] == ref_ids, f"prompt {prompt[:30]!r}"
        assert choice.text == tok.decode([t for t in ref_ids if t not in tok.all_special_ids])
        assert choice.finish_reason == "length"
        assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (n_prompt,
                                                                               len(ref_ids))
        timing = reply.model_extra["pdserve"]["timing"]
        assert timing["kv_transport"] == "shm" and timing["kv_pages"] == -(-n_prompt // 16)
        assert timing["ttft_ms"] >= timing["prefill_ms"] + timing["kv_transfer_ms"] > 0


def test_a_stream_says_the_same_and_ends_with_usage_and_the_breakdown(stack, client, reference):
    tok, refs = reference
    prompt = PROMPTS[3]
    chunks = list(client.completions.create(
        model="builtin-tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    ids = [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"]]
    assert ids == refs[prompt][1]
    assert "".join(choice.text for c in chunks for choice in c.choices) == tok.decode(ids)
    *body, finish, last = chunks
    assert all(c.choices[0].finish_reason is None and c.usage is None for c in body)
    assert finish.choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage.completion_tokens == MAX_TOKENS
    assert last.model_extra["pdserve"]["timing"]["ttft_ms"] > 0


def test_curl_sees_server_sent_events_ending_with_done(stack):
    curl = shutil.which("curl")
    if curl is None:  # .ci/run installs it: CI must run this test
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("curl is not installed, and CI must run this test")
        pytest.skip("curl is not installed")
    body = json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 5, "temperature": 0,
                       "stream": True, "return_token_ids": True})
    done = subprocess.run([curl, "-sS", "-N", "-D", "-", f"{stack.http}/completions",
                           "-H", "Content-Type: application/json", "-d", body],
                          capture_output=True, timeout=60)
    assert done.returncode == 0, done.stderr
    head, _, stream = done.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"content-type: text/event-stream" in head
    events = stream.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    chunks = [json.loads(e.removeprefix(b"data: ")) for e in events[:-2]]
    assert all(e.startswith(b"data: {") for e in events[:-2])
    # One chunk per batch of tokens the router had ready (one per token unless it fell behind).
    *body_chunks, last = chunks
    assert 1 <= len(body_chunks) <= 5 and last["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in body_chunks)
    assert sum(len(c["choices"][0]["token_ids"]) for c in chunks) == 5
    assert chunks[-1]["pdserve"]["timing"]["kv_bytes"] > 0


def test_errors_come_in_openai_shape_naming_the_field(stack, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="builtin-tiny", prompt="x", n=2)
    assert info.value.status_code == 400 and info.value.param == "n"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="builtin-tiny", prompt="x", temperature=-1)
    assert info.value.param == "temperature" and "must be >= 0" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="builtin-tiny", prompt="x",
                                  extra_body={"max_tokens": "8"})
    assert info.value.param == "max_tokens" and "expected an integer" in info.value.message
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-5", prompt="x")
    assert info.value.code == "model_not_found" and "gpt-5" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:  # the tiny model has no template
        client.chat.completions.create(model="builtin-tiny",
                                       messages=[{"role": "user", "content": "hi"}])
    assert info.value.param == "messages" and "no chat template" in info.value.message
    status, body = _post(stack, "/completions", b"{not json")
    assert status == 400 and "not valid JSON" in body["error"]["message"]
    status, body = _post(stack, "/completions", json.dumps({"prompt": [10**9]}).encode())
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "outside the vocabulary" in body["error"]["message"]
    # 3 MB of prompt: refused at once, untokenized (tokenizing it held up everyone for seconds)
    huge = json.dumps({"prompt": "hello " * 500_000}).encode()
    status, body = _post(stack, "/completions", huge)
    assert status == 400 and body["error"]["param"] == "prompt"
    assert "far longer than the model's context" in body["error"]["message"]
    scraped = stack.scrape("router")
    assert total(scraped, "pdserve_requests_total", api="http", code="INVALID_ARGUMENT") >= 6
    assert total(scraped, "pdserve_requests_total", api="http", code="NOT_FOUND") == 1
    # The service keeps serving, and says so on /health.
    assert client.completions.create(model="builtin-tiny", prompt="x", max_tokens=2).usage
    # Each API's requests under its own label: every request of this module came over HTTP.
    scraped = stack.scrape("router")
    assert total(scraped, "pdserve_ttft_seconds_count", api="http") == total(
        scraped, "pdserve_requests_total", api="http", code="OK") >= 1
    assert total(scraped, "pdserve_requests_total", api="grpc") == 0
    status, body = _get(stack, "/health")
    assert (status, body) == (200, {"status": "ok"})


def test_a_client_leaving_mid_stream_frees_the_decode_pages(stack, client):
    start = stack.decode_stats()
    scraped = stack.scrape("decode-0")
    aborted = total(scraped, "pdserve_sequences_finished_total", reason="abort")
    stream = client.completions.create(model="builtin-tiny", prompt=PROMPTS[4], max_tokens=2000,
                                       temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 4:
            break
    during = stack.decode_stats()
    stream.close()
    assert during.free_pages < start.free_pages
    assert wait_for(lambda: stack.decode_stats().free_pages == start.free_pages)
    assert total(stack.scrape("decode-0"), "pdserve_sequences_finished_total",
                 reason="abort") == aborted + 1
    assert wait_for(lambda: total(stack.scrape("router"), "pdserve_requests_total", api="http",
                                  outcome="cancelled") >= 1)


def test_a_client_leaving_during_prefill_frees_pages_on_both_sides(stack):
    prefill0, decode0 = stack.prefill_stats(), stack.decode_stats()
    ok0 = total(stack.scrape("prefill-0"), "pdserve_prefill_requests_total", code="OK")
    url = urllib.parse.urlsplit(stack.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    conn.request("POST", f"{url.path}/completions", body=json.dumps({
        "prompt": [5 + i % 900 for i in range(3000)], "max_tokens": 4, "stream": True}),
        headers={"Content-Type": "application/json"})

    def prefilling() -> bool:
        s = stack.prefill_stats()
        return s.waiting_sequences == 1 and s.free_pages < prefill0.free_pages

    assert wait_for(prefilling, timeout_s=60, interval_s=0.01), "prefill never started"
    assert stack.decode_stats().free_pages < decode0.free_pages  # its reservation
    during = stack.prefill_stats()
    conn.sock.close()  # the client goes away before any response
    conn.close()
    assert during.queued_prompt_tokens > 0, "prefill had finished: the test came too late"
    assert wait_for(lambda: stack.prefill_stats().free_pages == prefill0.free_pages)
    assert wait_for(lambda: stack.decode_stats().free_pages == decode0.free_pages)
    assert stack.decode_stats().reserved_tickets == 0
    assert total(stack.scrape("prefill-0"), "pdserve_prefill_requests_total", code="OK") == ok0


def _post(stack, path: str, body: bytes) -> tuple[int, dict]:
    """POST to the API (path under /v1): (status, JSON body)."""
    return _call(stack, "POST", urllib.parse.urlsplit(stack.http).path + path, body)


def _get(stack, path: str) -> tuple[int, dict]:
    """GET a path of the HTTP port: (status, JSON body)."""
    return _call(stack, "GET", path, None)


def _call(stack, method: str, path: str, body: bytes | None) -> tuple[int, dict]:
    url = urllib.parse.urlsplit(stack.http)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    try:
        conn.request(method, path, body=body)
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read())
    finally:
        conn.close()
