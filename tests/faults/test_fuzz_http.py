"""Every endpoint of the router's OpenAI-compatible HTTP API, fuzzed (hypothesis, derandomized)
while a canary streams greedy requests alongside: valid bodies with one field bent (wrong
types, huge and negative numbers, empty and giant strings), arbitrary JSON, bodies that are
not JSON or not UTF-8, oversized bodies, unknown paths and methods.

Each answer is a success or an HTTP error in OpenAI's shape with a message (never a 500, never
a dropped connection, never a hang); afterwards (`guarded`) the canary was exact and every
page is back, every process SERVING.
"""

from __future__ import annotations

import http.client
import json
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.faults.protofuzz import FUZZ, OUTCOMES, TEXT

pytestmark = pytest.mark.faults

TIMEOUT_S = 8.0
SCALARS = st.one_of(st.none(), st.booleans(),
                    st.sampled_from([0, -1, 1, 2**31, 10**30, -10**30]), st.integers(),
                    st.floats(allow_nan=False), TEXT)
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
COMPLETION = {"prompt": "def fibonacci(n):", "max_tokens": 4, "temperature": 0}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n", "logprobs",
          "ignore_eos", "echo", "user", "response_format", "tools", "x-unknown"]


def _encode(value: object) -> bytes:
    return json.dumps(value).encode()


def bent(template: dict) -> st.SearchStrategy[bytes]:
    """The template with one field set to any JSON value (or removed)."""
    def with_value(field: str, value: object) -> bytes:
        body = dict(template)
        if value == "<remove>":
            body.pop(field, None)
        else:
            body[field] = value
        return json.dumps(body).encode()
    return st.builds(with_value, st.sampled_from(FIELDS), JSON | st.just("<remove>"))


BODIES = st.one_of(
    bent(COMPLETION), bent(CHAT), bent({**COMPLETION, "stream": True}),
    bent({**CHAT, "stream": True}),
    st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6).map(_encode),
    JSON.map(_encode),
    st.sampled_from([b"", b"{", b"\xff\xfe{}", b'{"prompt": "\xc3\x28"}', b"NaN",
                     b'{"prompt": "a", "max_tokens": NaN}', b"[" * 100_000,
                     b'{"prompt": "' + b"x" * 3_000_000 + b'"}']),
    st.binary(max_size=64),
)
PATHS = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
OTHER = st.tuples(st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
                  st.sampled_from(["/v1/models", "/v1/models/builtin-tiny-v1", "/v1/models/x",
                                   "/health", "/metrics", "/", "/v1", "/v1/completions",
                                   "/v1/models/" + "x" * 5000, "/v1/../etc/passwd"]))


def _request(address: str, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
    host, _, port = address.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=TIMEOUT_S)
    try:
        conn.request(method, path, body=body, headers={"content-type": "application/json"})
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def _check(tally: Counter, method: str, path: str, body: bytes | None, status: int,
           data: bytes) -> None:
    tally[str(status)] += 1
    assert status < 500 or status == 503, f"{method} {path} {body!r:.200} -> {status} {data!r:.300}"
    if status >= 400:
        error = json.loads(data)["error"]
        assert error["message"].strip(), f"{status} without a message: {data!r:.300}"


def test_http_endpoints(guarded):
    address = guarded.http
    tally = OUTCOMES.setdefault("HTTP POST completions/chat", Counter())
    others = OUTCOMES.setdefault("HTTP other paths and methods", Counter())

    @settings(FUZZ, max_examples=80)
    @given(PATHS, BODIES)
    def posts(path: str, body: bytes) -> None:
        try:
            status, data = _request(address, "POST", path, body)
        except TimeoutError:  # our own deadline on a long generation (the router cancels it)
            tally["client timeout"] += 1
            return
        _check(tally, "POST", path, body, status, data)

    @settings(FUZZ, max_examples=30)
    @given(OTHER, st.none() | st.binary(max_size=32))
    def other(call: tuple[str, str], body: bytes | None) -> None:
        status, data = _request(address, *call, body)
        _check(others, *call, body, status, data)

    posts()
    other()
    assert tally["200"] and tally["400"], tally
