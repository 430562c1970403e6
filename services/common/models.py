"""What `--model` names, decided in one place for every command (router, workers, `up`,
benchmarks). Standard library only: the router resolves names without importing torch.

A value is either a built-in model (`tiny`, `small`, the benchmark shapes `bench-7m` and
`bench-152m`, or the served names `builtin-tiny`, ...), created on first use under the cache
directory, or a local Hugging Face
directory (served under the directory's name).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

BUILTIN_SIZES = ("tiny", "small", "bench-7m", "bench-152m")
BUILTIN_PREFIX = "builtin-"
DEFAULT_MODEL = "tiny"


@dataclass(frozen=True)
class ModelRef:
    """A resolved `--model`: its served name, and either a built-in size or a directory."""

    name: str
    builtin_size: str | None = None
    path: Path | None = None


def resolve_model_name(model: str | None) -> ModelRef:
    """`--model` -> ModelRef. Raises FileNotFoundError naming the value when it is neither a
    built-in model nor a directory with a config.json."""
    value = (model or DEFAULT_MODEL).strip()
    size = value.removeprefix(BUILTIN_PREFIX)
    if size in BUILTIN_SIZES and (value == size or value.startswith(BUILTIN_PREFIX)):
        return ModelRef(BUILTIN_PREFIX + size, builtin_size=size)
    path = Path(value).expanduser()
    if (path / "config.json").is_file():
        return ModelRef(path.resolve().name, path=path.resolve())
    raise FileNotFoundError(f"model {value!r} is neither a built-in model "
                            f"({', '.join(BUILTIN_SIZES)}) nor a local Hugging Face directory "
                            "with config.json")


def cache_dir() -> Path:
    """Where built-in models are created: `$PDSERVE_CACHE_DIR`, else `~/.cache/pdserve`."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdserve"
