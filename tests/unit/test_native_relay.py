"""The router's token relay in C++ (router/native_relay.py, common/csrc/token_relay.cc): for
the same Decode messages it sends what the Python relay (lifecycle.Completion) sends, message
for message: tokens, text (partial characters held, invalid bytes replaced), stop strings,
EOS, max_tokens and decode's own finish; from the first token, or taken over mid-stream; and
only tokenizers whose text is their bytes qualify."""

from __future__ import annotations

import random

import pytest
from pdserve.common import native_grpc
from pdserve.common.sampling import SamplingParams
from pdserve.router.lifecycle import Completion
from pdserve.router.native_relay import Relay, Relayer, token_bytes
from pdserve.router.tokenizer import Tokenizer
from pdserve.router.validation import Generation

from tests.fakes import make_model_dir

TRIALS = 400


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_model_dir(tmp_path_factory.mktemp("m")))


@pytest.fixture(scope="module")
def relayer(tok) -> Relayer:
    table, why = token_bytes(tok)
    assert table is not None, why
    return Relayer(native_grpc.library(), table)


def _generation(max_tokens: int, stops: list[str], ignore_eos: bool = False) -> Generation:
    return Generation("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens,
                                                    ignore_eos=ignore_eos), tuple(stops))


def _messages(rng: random.Random, tok: Tokenizer, n: int) -> list[list[int]]:
    """Token ids of random Decode messages: ASCII words and lone bytes (partial characters,
    invalid UTF-8), now and then an EOS or another special token."""
    ids = []
    for _ in range(n):
        roll = rng.random()
        if roll < 0.35:  # a single byte >= 0x80: a piece of a character, or an invalid one
            ids.append(tok.encode(bytes([rng.randrange(0x80, 0x100)]).decode("latin-1"))[0])
        elif roll < 0.38:
            ids.append(rng.choice(sorted(tok.special_token_ids)))
        else:
            ids.extend(tok.encode(rng.choice([" fox", "é", "€", " the", ",", "\n", "a"])))
    messages, i = [], 0
    while i < len(ids):
        k = rng.randrange(1, 5)
        messages.append(ids[i:i + k])
        i += k
    return messages


def _python(completion: Completion, messages: list[list[int]], decode_finish: str
            ) -> list[tuple[list[int], str]]:
    """What the Python relay sends for each message, up to the one that finishes."""
    out = []
    for i, message in enumerate(messages):
        taken, text = completion.accept(message)
        if i == len(messages) - 1 and decode_finish and not completion.finish_reason:
            text += completion.end(decode_finish)
        out.append((taken, text))
        if completion.finish_reason:
            break
    return out


def _native(relay: Relay, messages: list[list[int]], decode_finish: str
            ) -> list[tuple[list[int], str]]:
    """What the native relay sends for each message, up to the one that finishes."""
    out = []
    for i, message in enumerate(messages):
        result = relay.accept(message, decode_finish if i == len(messages) - 1 else "")
        assert result is not None
        out.append(result)
        if relay.finish_reason:
            break
    return out


@pytest.mark.parametrize("handover", [0, 3], ids=["from-the-first-token", "mid-stream"])
def test_the_native_relay_sends_what_the_python_relay_sends(tok, relayer, handover):
    """Random messages, stop strings (one spanning messages, one a multi-byte character),
    max_tokens and decode's finish: the same tokens and text, message for message. Mid-stream,
    Python relays the first messages and the native relay takes the state on from there."""
    rng = random.Random(7 + handover)
    eos = tok.eos_token_ids
    compared, ends = 0, set()
    for _ in range(TRIALS):
        stops = rng.choice([[], [" the"], ["x", "ox,"], ["€"], ["é\n", " fox f"]])
        messages = _messages(rng, tok, rng.randrange(1, 16))
        finish = rng.choice(["", "stop", "length"])
        gen = _generation(rng.randrange(1, 30), stops)
        reference = Completion(gen, tok)
        expected = _python(reference, messages, finish)
        completion = Completion(gen, tok)
        got = _python(completion, messages[:handover], "") if handover else []
        if completion.finish_reason or len(got) == len(messages):
            continue
        relay = completion.native(relayer, "r")
        if relay is None:  # a partial character held in Python: it goes on relaying
            continue
        with relay:
            got += _native(relay, messages[len(got):], finish)
            assert relay.finish_reason == reference.finish_reason
        assert got == expected, (stops, gen.sampling.max_tokens, messages, finish)
        compared += 1
        last = expected[-1][0][-1:] if expected[-1][0] else []
        ends.add("eos" if any(t in eos for t in last) else reference.finish_reason)
    assert compared > TRIALS // 8  # the rest finished, or held a partial character, first
    assert ends >= {"eos", "stop", "length", ""}  # a stop string ends some ("stop", no EOS)


def test_decode_aborting_the_sequence_is_said(tok, relayer):
    with relayer.relay("r", 10, 0, sorted(tok.eos_token_ids), [], "") as relay:
        assert relay.accept(tok.encode(" fox")) == (tok.encode(" fox"), " fox")
        assert relay.accept(tok.encode(" the"), "abort") is None


def test_only_a_tokenizer_whose_text_is_its_bytes_qualifies(model_kinds):
    qwen, why = token_bytes(Tokenizer.from_dir(model_kinds["qwen2"]))
    assert qwen is not None, why
    mistral, why = token_bytes(Tokenizer.from_dir(model_kinds["mistral"]))
    assert mistral is None and why == "not a byte-level BPE tokenizer"
