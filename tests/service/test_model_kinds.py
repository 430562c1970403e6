"""Each locally created tokenizer kind (tests/model_kinds.py: Qwen2 whose class pre-tokenizer
differs from its tokenizer.json, Llama 3 style adding BOS, sentencepiece-style Mistral) served
disaggregated by real processes: prompt ids are AutoTokenizer's, greedy tokens equal
transformers `generate(do_sample=False)`, the text is `decode(ids, skip_special_tokens=True)`,
for plain prompts and for chats (apply_chat_template)."""

from __future__ import annotations

import subprocess

import pytest
import torch

from tests.model_kinds import KINDS
from tests.service.stack import collect, pdserve_stacks
from tests.support import pdserve_argv

pytestmark = pytest.mark.service

MAX_TOKENS = 12
PROMPTS = ["def main():\n    return 0\n", "What is the capital of France?", "日本語 🎉 naïve"]
CHATS = [[{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
          {"role": "user", "content": "def main():\n    return 0\n"}]]


@pytest.fixture(scope="module")
def stacks(model_kinds):
    """{kind: stack}, the three started side by side; prefill chunks of 16 tokens."""
    with pdserve_stacks(*(("--model", str(model_kinds[k])) for k in KINDS),
                        env={"PDSERVE_PREFILL_CHUNK_SIZE": "16"}) as running:
        yield dict(zip(KINDS, running))


@pytest.fixture(params=KINDS)
def served(request, model_kinds, stacks):
    """(tokenizer, model, stack) of one kind."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = model_kinds[request.param]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return tok, hf, stacks[request.param]


def _reference(hf, ids: list[int]) -> list[int]:
    out = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                      pad_token_id=hf.generation_config.eos_token_id)
    return out[0, len(ids):].tolist()


def _check(tok, hf, prompt_ids, responses):
    got, text, _, finish = collect(responses)
    assert got == _reference(hf, prompt_ids)
    assert text == tok.decode(got, skip_special_tokens=True)
    assert finish.prompt_tokens == len(prompt_ids)
    assert finish.completion_tokens == len(got)


def test_prompts_token_exact(served):
    tok, hf, stack = served
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        _check(tok, hf, ids, stack.generate(prompt=prompt, max_tokens=MAX_TOKENS,
                                            temperature=0.0))


def test_chats_token_exact(served):
    from pdserve.v1 import router_pb2

    tok, hf, stack = served
    for chat in CHATS:
        ids = list(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
        messages = [router_pb2.ChatMessage(**m) for m in chat]
        _check(tok, hf, ids, stack.generate(messages=messages, max_tokens=MAX_TOKENS,
                                            temperature=0.0))


def test_chats_over_http_with_the_openai_client(served):
    """/v1/chat/completions, streamed and not: the chat template's ids, transformers' tokens,
    decode's text, usage and the TTFT breakdown."""
    import openai

    tok, hf, stack = served
    with openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0) as client:
        model = client.models.list().data[0].id
        for chat in CHATS:
            ids = list(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
            expected = _reference(hf, ids)
            reply = client.chat.completions.create(
                model=model, messages=chat, max_completion_tokens=MAX_TOKENS, temperature=0,
                extra_body={"return_token_ids": True})
            choice = reply.choices[0]
            assert choice.model_extra["token_ids"] == expected
            assert choice.message.role == "assistant"
            assert choice.message.content == tok.decode(expected, skip_special_tokens=True)
            assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (
                len(ids), len(expected))
            assert reply.model_extra["pdserve"]["timing"]["ttft_ms"] > 0
            chunks = list(client.chat.completions.create(
                model=model, messages=chat, max_tokens=MAX_TOKENS, temperature=0, stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == \
                choice.message.content
            assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_pdserve_generate_sends_a_chat(model_kinds, stacks):
    """`pdserve generate --system ... --chat PROMPT` streams what the chat template gives."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, stack = model_kinds["qwen2"], stacks["qwen2"]
    tok = AutoTokenizer.from_pretrained(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    ids = list(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"])
    done = subprocess.run(pdserve_argv("generate", "--address", stack.router, "--system",
                                       "Be brief.", "--chat", "--max-tokens", str(MAX_TOKENS),
                                       "--temperature", "0", "hi"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    expected = _reference(hf, ids)
    assert done.stdout.startswith(tok.decode(expected, skip_special_tokens=True) + "\n\nTTFT")
    assert f"{len(ids)} prompt + {len(expected)} completion tokens" in done.stdout
