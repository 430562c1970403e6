"""The served model's tokenizer and the facts the router needs from its directory.

Reads a Hugging Face model directory with the `tokenizers` library (never transformers):
`tokenizer.json` for the vocabulary, and `config.json`, `generation_config.json`,
`tokenizer_config.json` for the EOS/BOS ids, the vocabulary size and the context length.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    """Text <-> token ids for the served model, plus its EOS/BOS ids and limits."""

    def __init__(self, tokenizer: HFTokenizer, *, eos_token_ids: Iterable[int] = (),
                 bos_token_id: int | None = None, vocab_size: int | None = None,
                 max_context: int | None = None):
        self._tok = tokenizer
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.bos_token_id = bos_token_id
        self.vocab_size: int = vocab_size or tokenizer.get_vocab_size(with_added_tokens=True)
        self.max_context = max_context  # None: the model states no limit

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `tokenizer.json` and the special-token ids and limits of a model directory."""
        root = Path(model_dir)
        path = root / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in model directory {str(root)!r}")
        tok = HFTokenizer.from_file(str(path))
        config = _read_json(root / "config.json")
        generation = _read_json(root / "generation_config.json")
        tok_config = _read_json(root / "tokenizer_config.json")

        def special(key: str) -> list[int]:
            for source in (generation, config):  # generate() prefers generation_config
                found = _ids(source.get(f"{key}_token_id"))
                if found:
                    return found
            text = _token_text(tok_config.get(f"{key}_token"))
            token_id = tok.token_to_id(text) if text else None
            return [token_id] if token_id is not None else []

        bos = special("bos")
        max_context = next((config[k] for k in _CONTEXT_KEYS if isinstance(config.get(k), int)),
                           None)
        vocab_size = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
        return cls(tok, eos_token_ids=special("eos"), bos_token_id=bos[0] if bos else None,
                   vocab_size=vocab_size, max_context=max_context)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, with no special tokens added."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of `token_ids` (may end in U+FFFD when the last character is incomplete)."""
        return self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
