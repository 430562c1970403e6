"""Router text handling: model-directory loading, incremental detokenization, stop strings."""

from __future__ import annotations

import json

import pytest
from pdserve.router.detokenizer import IncrementalDetokenizer, OutputText, StopMatcher
from pdserve.router.tokenizer import Tokenizer

from tests.fakes import make_model_dir

pytestmark = pytest.mark.unit

SAMPLES = ["héllo 中文 🙂 ok", "Straße 🚀🚀 日本語のテキスト", "plain ascii text", "🙂"]


@pytest.fixture(scope="module", params=[True, False], ids=["bpe", "bytes"])
def tokenizer(request, tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_dir(make_model_dir(tmp_path_factory.mktemp("m"), merges=request.param))


def test_loads_special_ids_and_limits(tokenizer):
    assert tokenizer.eos_token_ids == {1}
    assert tokenizer.bos_token_id == 0
    assert tokenizer.max_context == 64
    assert tokenizer.encode("hello")[0] not in (0, 1)  # no special tokens added


def test_eos_from_tokenizer_config_when_configs_lack_it(tmp_path):
    root = make_model_dir(tmp_path)
    (root / "config.json").write_text(json.dumps({"n_positions": 99}))
    (root / "generation_config.json").unlink()
    tok = Tokenizer.from_dir(root)
    assert tok.eos_token_ids == {1} and tok.max_context == 99


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


@pytest.mark.parametrize("text", SAMPLES)
def test_incremental_detokenizer_never_emits_partial_characters(tokenizer, text):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text
    if any(len(c.encode()) > 1 for c in text) and len(ids) > len(text):
        assert "" in deltas  # some character really was split across tokens


def test_bytes_tokenizer_splits_every_multibyte_character(tmp_path):
    tok = Tokenizer.from_dir(make_model_dir(tmp_path, merges=False))
    ids = tok.encode("🙂")
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tok)
    assert [detok.push(t) for t in ids] == ["", "", "", "🙂"]


def test_text_is_the_decode_of_the_generated_ids_alone(tokenizer):
    ids = tokenizer.encode(" world, the fox")
    detok = IncrementalDetokenizer(tokenizer)
    text = "".join(detok.push(t) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids) == " world, the fox"


def test_stop_string_spanning_pushes_is_cut_and_not_emitted():
    stops = StopMatcher(["###"])
    assert stops.push("ab#") == "ab"     # "#" could start the stop: held back
    assert stops.push("#") == ""
    assert stops.push("#cd") == ""
    assert stops.stopped and stops.flush() == ""
    assert stops.push("more") == ""


def test_held_back_text_released_when_not_a_stop():
    stops = StopMatcher(["abc", "xyz"])
    assert stops.push("12ab") == "12"
    assert stops.push("d") == "abd"
    assert stops.push("x") == ""
    assert stops.flush() == "x"          # the stream ended: nothing can complete it now
    assert not stops.stopped


def test_earliest_stop_wins_and_overlapping_prefixes():
    stops = StopMatcher(["world", "lo w"])
    assert stops.push("hello world") == "hel"
    stops = StopMatcher(["aab"])
    assert stops.push("aaa") == "a"      # the tail "aa" may still become "aab"
    assert stops.push("b!") == ""       # "aaab!" cut at "aab": only the first "a" was text
    assert stops.stopped


def test_output_text_stop_across_two_tokens(tmp_path):
    tok = Tokenizer.from_dir(make_model_dir(tmp_path, merges=False))  # one token per byte
    text = OutputText(tok, ["STOP"])
    out = [text.push(t) for t in tok.encode("go 中 STOP here")]
    assert text.stopped
    assert "".join(out) + text.finish() == "go 中 "
    assert out.index("") < len(out)      # "S", "T", "O" were held back


def test_output_text_releases_partial_stop_at_end(tokenizer):
    text = OutputText(tokenizer, ["END."])
    out = "".join(text.push(t) for t in tokenizer.encode("the END"))
    assert out == "the "
    assert text.finish() == "END" and not text.stopped


