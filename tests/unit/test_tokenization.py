"""Tokenization exactly as transformers: prompt ids, chat ids and streamed text, for every
locally created tokenizer kind (tests/model_kinds.py)."""

from __future__ import annotations

import random

import pytest
from pdserve.common.errors import InvalidArgument
from pdserve.router.api import ChatMessage, GenerateInput
from pdserve.router.detokenizer import IncrementalDetokenizer, OutputText
from pdserve.router.tokenizer import ChatTemplateError, Tokenizer
from pdserve.router.validation import validate

from tests.fakes import make_model_dir
from tests.model_kinds import KINDS

pytestmark = pytest.mark.unit

TEXTS = [
    "def main():\n    return 0\n",
    "Hello, world",
    "  leading spaces and trailing  ",
    "日本語のテキストと emoji 🎉 mixed in; naïve café",
    "What is the capital of France?",
    "<|im_end|> and <s> as text",
    "x",
]
CHATS = [
    [("user", "What is the capital of France?")],
    [("user", "hi"), ("assistant", "Hello! 🎉"), ("user", "  def main():\n    return 0\n")],
]


@pytest.fixture(scope="module", params=KINDS)
def kind(request, model_kinds):
    """(kind, our Tokenizer, transformers' AutoTokenizer) for one model directory."""
    from transformers import AutoTokenizer

    path = model_kinds[request.param]
    return request.param, Tokenizer.from_dir(path), AutoTokenizer.from_pretrained(path)


def test_prompt_ids_equal_auto_tokenizer_with_bos_as_it_adds_it(kind):
    name, tok, hf = kind
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf(text).input_ids, (name, text)
        assert (ids[0] == hf.bos_token_id) == (name != "qwen2"), (name, text)
    gen = validate(GenerateInput(prompt=TEXTS[0]), tok, "m")
    assert list(gen.prompt_ids) == hf(TEXTS[0]).input_ids


def test_qwen2_class_pre_tokenizer_wins_over_the_file(model_kinds):
    """The reason for AutoTokenizer: the file alone gives other ids for this model."""
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import AutoTokenizer

    path = model_kinds["qwen2"]
    text = "def main():\n    return 0\n"
    raw = RawTokenizer.from_file(str(path / "tokenizer.json")).encode(text).ids
    expected = AutoTokenizer.from_pretrained(path)(text).input_ids
    assert len(raw) != len(expected)
    assert Tokenizer.from_dir(path).encode(text) == expected


def test_chat_ids_equal_apply_chat_template(kind):
    name, tok, hf = kind
    for chat in CHATS:
        conversation = [{"role": r, "content": c} for r, c in chat]
        expected = hf.apply_chat_template(conversation, add_generation_prompt=True)["input_ids"]
        assert tok.encode_chat(chat) == list(expected), name
        gen = validate(GenerateInput(messages=tuple(ChatMessage(r, c) for r, c in chat)),
                       tok, "m")
        assert list(gen.prompt_ids) == list(expected)
    assert tok.encode_chat(CHATS[0]).count(hf.bos_token_id) == (name != "qwen2")


def test_a_model_without_chat_template_refuses_messages_naming_the_field(tmp_path):
    tok = Tokenizer.from_dir(make_model_dir(tmp_path))
    assert not tok.has_chat_template
    with pytest.raises(ChatTemplateError):
        tok.encode_chat([("user", "hi")])
    with pytest.raises(InvalidArgument) as err:
        validate(GenerateInput(messages=(ChatMessage("user", "hi"),)), tok, "m")
    message = err.value.message
    assert message.startswith("messages of 1 message: ") and "chat template" in message


@pytest.mark.parametrize("fields, needle", [
    ({"messages": (ChatMessage("system", "be brief"),)}, "alternate"),
    ({"messages": (ChatMessage("", "hi"),)}, "messages[0].role=''"),
    ({"messages": (ChatMessage("robot", "hi"),)},  # as the HTTP API refuses it
     "messages[0].role='robot': expected one of system, developer, user, assistant, tool"),
    ({"messages": (ChatMessage("user", "hi"),), "prompt": "hi"}, "not prompt and messages"),
])
def test_bad_chats_are_invalid_argument(model_kinds, fields, needle):
    tok = Tokenizer.from_dir(model_kinds["mistral"])  # its template refuses a system role
    with pytest.raises(InvalidArgument) as err:
        validate(GenerateInput(**fields), tok, "m")
    assert needle in err.value.message


def test_text_far_past_the_context_is_refused_before_it_is_tokenized(tmp_path, monkeypatch):
    tok = Tokenizer.from_dir(make_model_dir(tmp_path))
    most = 64 * tok.max_token_chars * 2  # a 64-token context; twice over for normalizers
    encoded: list[int] = []
    monkeypatch.setattr(tok, "encode", lambda text: encoded.append(len(text)) or [1] * 80)
    with pytest.raises(InvalidArgument) as err:
        validate(GenerateInput(prompt="a" * (most + 1)), tok, "m", max_model_len=64)
    assert err.value.message.startswith(f"prompt of {most + 1} characters: far longer than "
                                        "the model's context of 64 tokens can hold")
    assert encoded == []  # never tokenized
    with pytest.raises(InvalidArgument) as err:  # within the bound: tokenized, then counted
        validate(GenerateInput(prompt="a" * most), tok, "m", max_model_len=64)
    assert encoded == [most] and "shorter than the model's context of 64" in err.value.message


def _random_ids(rng: random.Random, tok: Tokenizer, hf) -> list[int]:
    """Ids a model might generate: anything in the vocabulary, special tokens, byte tokens,
    and pieces of multi-byte text cut anywhere."""
    pieces = tok.encode("日本語 🎉🎉 naïve Straße", ) + tok.encode(" café\n")
    special = list(hf.all_special_ids)
    ids: list[int] = []
    for _ in range(rng.randint(1, 40)):
        pick = rng.random()
        if pick < 0.4:
            ids.append(rng.randrange(tok.vocab_size))
        elif pick < 0.55:
            ids.append(rng.choice(special))
        elif pick < 0.7 and tok.byte_token_ids:
            ids.append(rng.choice(sorted(tok.byte_token_ids)))
        else:
            start = rng.randrange(len(pieces))
            ids += pieces[start:start + rng.randint(1, 4)]
    return ids


def test_streamed_text_is_decode_of_all_ids_property(kind):
    name, tok, hf = kind
    rng = random.Random(20240607)
    for case in range(300):
        ids = _random_ids(rng, tok, hf)
        detok = IncrementalDetokenizer(tok)
        deltas = [detok.push(t) for t in ids]
        streamed = "".join(deltas) + detok.flush()
        assert streamed == hf.decode(ids, skip_special_tokens=True), (name, case, ids)


def test_decode_takes_the_rust_tokenizer_directly_and_gives_transformers_text(kind):
    """The router's per-token decode skips transformers' wrapper where it adds nothing; the
    text is still `AutoTokenizer.decode`'s, special tokens skipped or kept."""
    name, tok, hf = kind
    assert tok._backend_decode is not None, name  # every kind here is a plain fast tokenizer
    rng = random.Random(11)
    for case in range(100):
        ids = _random_ids(rng, tok, hf)
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == \
                hf.decode(ids, skip_special_tokens=skip), (name, case, skip)


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_transformers(model_kinds):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(model_kinds[KINDS[0]])
    hf.clean_up_tokenization_spaces = True
    tok = Tokenizer(hf)
    assert tok._backend_decode is None
    ids = tok.encode("a , b .")
    assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)


def test_stop_strings_cut_the_exact_text(kind):
    name, tok, hf = kind
    rng = random.Random(7)
    for case in range(100):
        ids = _random_ids(rng, tok, hf)
        full = hf.decode(ids, skip_special_tokens=True)
        stop = full[len(full) // 2:len(full) // 2 + 2] if len(full) > 3 else "zzz"
        out = OutputText(tok, [stop])
        text = ""
        for t in ids:
            text += out.push(t)
            if out.stopped:
                break
        text += out.finish()
        expected = full[:full.find(stop)] if stop in full else full
        assert text == expected, (name, case, ids, stop)
