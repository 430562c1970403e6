"""The context limit, stated and kept: /v1/models reports `max_model_len`, the router admits a
request that uses exactly the whole context and refuses one token more naming the context,
and a worker whose explicit pool cannot hold one full-context sequence refuses to start.

The stack's decode worker serves a shorter context than the model's (--max-model-len): the
router learns it from the workers' Stats, not from the model's config.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

import grpc
import pytest
from pdserve.common.shm import leftover_segments

from tests.service.stack import collect, pdserve_stack
from tests.support import ServiceProcess, free_port

pytestmark = pytest.mark.service

CONTEXT = 200  # the decode worker's max_model_len (the tiny model's own is 4096)


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with pdserve_stack(env={"PDSERVE_DECODE_MAX_MODEL_LEN": str(CONTEXT)}) as s:
        yield s


def _http(url: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _completion(stack, prompt_tokens: int, max_tokens: int | None) -> tuple[int, dict]:
    body: dict = {"prompt": [5 + i % 900 for i in range(prompt_tokens)], "temperature": 0,
                  "ignore_eos": True}
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return _http(f"{stack.http}/completions", body)


def test_models_reports_the_context_the_workers_serve(stack):
    status, models = _http(f"{stack.http}/models")
    assert status == 200 and [m["max_model_len"] for m in models["data"]] == [CONTEXT]
    status, card = _http(f"{stack.http}/models/builtin-tiny")
    assert status == 200 and card["max_model_len"] == CONTEXT
    assert stack.decode_stats().max_model_len == CONTEXT
    assert stack.prefill_stats().max_model_len == 4096


def test_the_whole_context_is_admitted_and_one_token_more_is_refused_naming_it(stack):
    status, reply = _completion(stack, CONTEXT - 10, 10)
    assert status == 200, reply
    usage = {k: reply["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    assert usage == {"prompt_tokens": CONTEXT - 10, "completion_tokens": 10,
                     "total_tokens": CONTEXT}
    assert reply["choices"][0]["finish_reason"] == "length"

    status, reply = _completion(stack, CONTEXT - 10, 11)
    assert status == 400
    assert reply["error"]["param"] == "max_tokens"
    assert reply["error"]["message"] == (
        f"max_tokens=11: prompt ({CONTEXT - 10} tokens) + max_tokens (11) = {CONTEXT + 1} "
        f"exceeds the model's context of {CONTEXT} tokens (max_model_len)")

    status, reply = _completion(stack, CONTEXT, 1)  # no room for a single output token
    assert status == 400 and reply["error"]["param"] == "prompt"
    assert f"context of {CONTEXT} tokens" in reply["error"]["message"]

    # Omitted, max_tokens is the default (128) lowered to the room left.
    status, reply = _completion(stack, CONTEXT - 7, None)
    assert status == 200 and reply["usage"]["completion_tokens"] == 7

    # The gRPC API keeps the same limit.
    ids, _, _, finish = collect(stack.generate(token_ids=[5] * (CONTEXT - 3), max_tokens=3,
                                               temperature=0.0, ignore_eos=True))
    assert len(ids) == 3 and finish.finish_reason == "length"
    with pytest.raises(grpc.RpcError) as err:
        stack.generate(token_ids=[5] * (CONTEXT - 3), max_tokens=4)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"exceeds the model's context of {CONTEXT} tokens" in err.value.details()
    assert stack.decode_stats().free_pages == stack.decode_stats().num_pages


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_an_explicit_pool_too_small_for_the_context_is_refused_at_start(tiny_model_dir, role):
    # The tiny model: 4096 tokens of context, 512 bytes of fp32 KV a token: 2 MiB a sequence.
    worker = ServiceProcess([sys.executable, "-m", f"pdserve.{role}.main", "--model", "tiny",
                             "--port", str(free_port()), "--metrics-port", "-1",
                             "--kv-agent", f"127.0.0.1:{free_port()}", "--kv-cache-mb", "1"])
    try:
        assert worker.proc.wait(timeout=120) == 1, worker.output()[-3000:]
        out = worker.output()
        assert "--kv-cache-mb 1 is too small for the context" in out, out[-3000:]
        assert "max_model_len 4096 tokens) needs 2 MiB (256 pages" in out
        assert "the pool holds 128 pages" in out and "Traceback" not in out
        assert not [s for s in leftover_segments() if f"-{worker.proc.pid}-" in s]
    finally:
        worker.stop()
