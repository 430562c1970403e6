"""The served model's tokenizer: transformers' own `AutoTokenizer`, so a prompt gives the ids
transformers (and vLLM) give, and chat messages render with the model's chat template.

`AutoTokenizer.from_pretrained(model_dir)` picks the tokenizer class from the model's type and
applies that class's pre-tokenizer and special-token rules (BOS) on top of `tokenizer.json`;
reading the file with the `tokenizers` library alone can give other ids. Prompts are encoded as
`tokenizer(text).input_ids`, chats as `apply_chat_template(messages,
add_generation_prompt=True)["input_ids"]`, and text is `decode(ids, skip_special_tokens=True)`.

The router never loads torch. transformers decides whether torch exists once, with
`importlib.util.find_spec("torch")` (`transformers.utils.is_torch_available`; no environment
setting turns it off in transformers 5), and without torch it runs in its documented
tokenizers-only mode ("only tokenizers, configuration and file/data utilities can be used").
`hide_torch()`, called first thing by the router process, makes torch unimportable in that
process the way Python's import system documents: `sys.modules["torch"] = None` makes `import
torch` raise ModuleNotFoundError and `find_spec("torch")` return None. transformers itself is
imported only when a tokenizer is loaded.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pdserve.common.models import read_json

_CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # byte-fallback tokens (sentencepiece style)


class ChatTemplateError(ValueError):
    """The messages cannot be rendered: the model has no chat template, or its template
    refused them (e.g. roles that do not alternate)."""


def hide_torch() -> None:
    """Make `torch` unimportable in this process (the router's), so transformers loads in its
    tokenizer-only mode; silence its advisory warning that torch is missing. A no-op when
    torch is already imported (tests that load a router tokenizer next to an engine)."""
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    return read_json(path)


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def load_auto_tokenizer(model_dir: str | Path) -> Any:
    """`AutoTokenizer.from_pretrained(model_dir)` from local files only."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


class Tokenizer:
    """Text <-> token ids for the served model (a transformers tokenizer), plus its EOS/BOS
    ids and limits."""

    def __init__(self, tokenizer: Any, *, eos_token_ids: Iterable[int] = (),
                 vocab_size: int | None = None, max_context: int | None = None):
        self._tok = tokenizer
        self._lock = threading.Lock()  # encode may reset the Rust tokenizer's truncation once
        self.eos_token_ids: frozenset[int] = frozenset(eos_token_ids)
        self.bos_token_id: int | None = tokenizer.bos_token_id
        self.vocab_size: int = vocab_size or len(tokenizer)
        self.max_context = max_context  # None: the model states no limit
        self.has_chat_template = bool(getattr(tokenizer, "chat_template", None))
        vocab: dict[str, int] = tokenizer.get_vocab()
        # No token spans more characters than its vocabulary entry has (a byte-level entry has
        # a character per byte): a prompt needs at least len(text) / this many tokens.
        self.max_token_chars = max((len(t) for t in vocab), default=1)
        # Tokens whose text depends on the tokens after them (bytes grouped into characters).
        self.byte_token_ids = frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t))
        self.special_token_ids = frozenset(
            i for i, added in tokenizer.added_tokens_decoder.items() if added.special)
        self._backend_decode = _plain_backend_decode(tokenizer)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """The tokenizer of a model directory (transformers' `AutoTokenizer`), with EOS ids
        as `generate()` uses them (generation_config.json, then config.json, then the
        tokenizer's), the vocabulary size and the context length from config.json."""
        root = Path(model_dir)
        if not root.is_dir():
            raise FileNotFoundError(f"model directory {str(root)!r} does not exist")
        if not any((root / name).is_file() for name in
                   ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")):
            raise FileNotFoundError(f"no tokenizer (tokenizer.json) in model directory "
                                    f"{str(root)!r}")
        tok = load_auto_tokenizer(root)
        config = _read_json(root / "config.json")
        generation = _read_json(root / "generation_config.json")
        eos = next((found for found in (_ids(generation.get("eos_token_id")),
                                        _ids(config.get("eos_token_id")),
                                        _ids(tok.eos_token_id)) if found), [])
        max_context = next((config[k] for k in _CONTEXT_KEYS if isinstance(config.get(k), int)),
                           None)
        vocab_size = config.get("vocab_size") if isinstance(config.get("vocab_size"), int) else None
        return cls(tok, eos_token_ids=eos, vocab_size=vocab_size, max_context=max_context)

    def encode(self, text: str) -> list[int]:
        """`tokenizer(text).input_ids`: special tokens (BOS) added as the tokenizer adds them."""
        with self._lock:
            return list(self._tok(text)["input_ids"])

    def encode_chat(self, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The ids of `apply_chat_template(messages, add_generation_prompt=True)`.
        Raises ChatTemplateError when the model has none or its template refuses them."""
        if not self.has_chat_template:
            raise ChatTemplateError("the model has no chat template; send a prompt instead")
        conversation = [{"role": role, "content": content} for role, content in messages]
        from jinja2 import TemplateError

        try:
            with self._lock:
                rendered = self._tok.apply_chat_template(conversation,
                                                         add_generation_prompt=True)
        except TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused them: {exc}") from None
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered  # BatchEncoding
        return [int(i) for i in ids]

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """`tokenizer.decode(ids)` (U+FFFD where bytes are not valid UTF-8)."""
        if self._backend_decode is not None:
            return str(self._backend_decode(list(token_ids),
                                            skip_special_tokens=skip_special_tokens))
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def plain_backend(self) -> Any:
        """The Rust tokenizer whose `decode` is this `decode` (None: transformers' own)."""
        return getattr(self._backend_decode, "__self__", None)


def _plain_backend_decode(tokenizer: Any) -> Any:
    """The Rust tokenizer's own `decode` where transformers' `decode` would only wrap it:
    a fast tokenizer class that overrides neither `decode` nor `_decode`, with no space
    clean-up. The router decodes a window of text per streamed token, and the wrapper (input
    conversion, keyword plumbing) costs ~7x the decode itself. None: use `decode`."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # another transformers layout: the plain path
        return None
    cls = type(tokenizer)
    backend = getattr(tokenizer, "_tokenizer", None)
    if (not isinstance(tokenizer, TokenizersBackend) or backend is None
            or cls.decode is not PreTrainedTokenizerBase.decode
            or cls._decode is not TokenizersBackend._decode
            or getattr(tokenizer, "clean_up_tokenization_spaces", True)):
        return None
    return backend.decode
