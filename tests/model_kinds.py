"""Model directories of the supported architectures with tokenizers of several kinds, made
here (no downloads): a tokenizer trained on a small corpus, random weights (fixed seed), tiny
shapes. Each tokenizer is one transformers treats in its own way:

- `qwen2`: a byte-level BPE `tokenizer.json` whose pre-tokenizer is plain ByteLevel, while
  transformers' `Qwen2Tokenizer` (chosen from the model type) splits with its own regex
  first, so the `tokenizers` library alone gives other ids; ChatML template; no BOS.
- `llama`: Llama 3 style: byte-level BPE whose post-processor adds `<|begin_of_text|>` (BOS);
  the chat template writes `{{ bos_token }}` too.
- `mistral`: sentencepiece style (`LlamaTokenizer`): Metaspace, byte-fallback tokens
  `<0x00>`..`<0xFF>` for characters the vocabulary lacks, BOS added, `[INST]` template that
  refuses roles other than alternating user/assistant; sliding-window attention.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

KINDS = ("qwen2", "llama", "mistral")
CORPUS = [
    "def main():\n    return 0\n",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
    "fibonacci(n - 2)\n",
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? Answer in one word, please.",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self):\n        self.x = 1\n",
    "Hello, world! Numbers 0 1 2 3 42 100 3.14 and naïve café Straße.",
]
SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=128, max_position_embeddings=512, initializer_range=0.1)
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
          "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\\n' }}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + "
          "'<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
MISTRAL = ("{{ bos_token }}{% for message in messages %}"
           "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
           "{{ raise_exception('Conversation roles must alternate user/assistant/user/...') }}"
           "{% endif %}{% if message['role'] == 'user' %}"
           "{{ '[INST] ' + message['content'] + ' [/INST]' }}"
           "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
           "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}"
           "{% endif %}{% endfor %}")


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _byte_level_bpe(specials: list[str], vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS * 10, trainer)
    return tok


def _qwen2_tokenizer(out: Path) -> None:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    _byte_level_bpe(specials, 600).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "Qwen2Tokenizer", "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "chat_template": CHATML,
        "model_max_length": SHAPE["max_position_embeddings"]})


def _llama_tokenizer(out: Path) -> None:
    from tokenizers import processors

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>"]
    tok = _byte_level_bpe(specials, 600)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "chat_template": LLAMA3,
        "model_max_length": SHAPE["max_position_embeddings"]})


def _mistral_tokenizer(out: Path) -> None:
    from tokenizers import SentencePieceBPETokenizer
    from transformers import LlamaTokenizer

    trained = SentencePieceBPETokenizer(add_prefix_space=True)
    trained.train_from_iterator(CORPUS * 10, vocab_size=400, show_progress=False)
    model = json.loads(trained.to_str())["model"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab |= {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for token in sorted(model["vocab"], key=model["vocab"].get):
        vocab.setdefault(token, len(vocab))
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tok = LlamaTokenizer(vocab=vocab, merges=merges, add_bos_token=True, add_eos_token=False)
    tok.chat_template = MISTRAL
    tok.model_max_length = SHAPE["max_position_embeddings"]
    tok.save_pretrained(out)


def make_model(root: Path, kind: str, *, weights: bool = True) -> Path:
    """`root/kind`: tokenizer files, config.json, generation_config.json and (with `weights`)
    random weights (seed fixed)."""
    import torch
    from transformers import (
        AutoTokenizer,
        GenerationConfig,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    out = root / kind
    out.mkdir(parents=True)
    {"qwen2": _qwen2_tokenizer, "llama": _llama_tokenizer, "mistral": _mistral_tokenizer}[kind](out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = dict(vocab_size=len(tok), eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
               pad_token_id=tok.pad_token_id)
    config, model_class = {
        "qwen2": (lambda: Qwen2Config(**SHAPE, **ids, tie_word_embeddings=False),
                  Qwen2ForCausalLM),
        "llama": (lambda: LlamaConfig(**SHAPE, **ids, tie_word_embeddings=True),
                  LlamaForCausalLM),
        "mistral": (lambda: MistralConfig(**SHAPE, **ids, sliding_window=48), MistralForCausalLM),
    }[kind]
    cfg = config()
    cfg.architectures = [model_class.__name__]
    if weights:
        torch.manual_seed(20240607)
        model = model_class(cfg).eval()
        model.generation_config = GenerationConfig(**{k: v for k, v in ids.items()
                                                      if k != "vocab_size"})
        model.save_pretrained(out)
    else:
        cfg.save_pretrained(out)
    return out
