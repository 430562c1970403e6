"""Shared fixtures: the built-in tiny model (created once per session in a private cache) and
transformers' reference outputs on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Every process a test starts serves the tiny built-in model unless the test names another
# (--model): the default model, SmolLM2 converted from GGUF, is for users and for the one
# real-model test, which asks for it.
for _service in ("UP", "ROUTER", "PREFILL", "DECODE", "COLOCATED"):
    os.environ.setdefault(f"PDSERVE_{_service}_MODEL", "tiny")
# Every router a test starts serves its HTTP API on a free port unless the test names one
# (the default, 8000, would collide between tests and stacks running at once).
for _var in ("PDSERVE_ROUTER_HTTP_PORT", "PDSERVE_UP_HTTP_PORT"):
    os.environ.setdefault(_var, "0")
# Every router a test starts sends each prompt through the prefill pool and a KV handoff (the
# path most tests are about): prefilling a short uncached part on the decode worker instead,
# the router's default, is tests/service/test_prefix_reuse.py's, which asks for it.
os.environ.setdefault("PDSERVE_ROUTER_REMOTE_PREFILL_MIN_TOKENS", "0")


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pdserve-cache")
    os.environ["PDSERVE_CACHE_DIR"] = str(path)  # inherited by every process a test starts
    from pdserve.common import native_grpc

    # The routers' native gRPC library (~10 s to build) once here, not in a router's start-up.
    native_grpc.library()
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(cache_dir: Path) -> Path:
    from pdserve.engine import builtin, kernels

    # The attention kernel's first-use build (~18 s on a Zen 3) here, once, not inside the
    # first test whose forward pass waits on it with a timeout; later processes find it built.
    kernels.library()
    return builtin.ensure("tiny", cache_dir=cache_dir)


PROMPTS = [
    "a",
    "Hello, world",
    "def fibonacci(n):",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self):",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "for i in range(10):\n    if i % 2 == 0:\n        print(i, 'is even')\n",
    "日本語のテキストと emoji 🎉 mixed in",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor "
    "incididunt ut labore et dolore magna aliqua. Ut enim ad minim veniam, quis nostrud "
    "exercitation ullamco laboris nisi ut aliquip ex ea commodo consequat. " * 2,
]
MAX_TOKENS = 20


@pytest.fixture(scope="session")
def reference(tiny_model_dir):
    """(tokenizer, {prompt: (prompt tokens, transformers' greedy output ids)}) in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    out = {}
    for prompt in PROMPTS:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        gen = hf.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_TOKENS,
                          pad_token_id=tok.pad_token_id)
        out[prompt] = (len(ids), gen[0, len(ids):].tolist())
    return tok, out


@pytest.fixture(scope="session")
def model_kinds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """{kind: model directory} for the tokenizer kinds of tests/model_kinds.py (random
    weights, created once per session)."""
    from tests.model_kinds import KINDS, make_model

    root = tmp_path_factory.mktemp("kinds")
    return {kind: make_model(root, kind) for kind in KINDS}


_FIGURES: list[str] = []


@pytest.fixture(scope="session")
def figures() -> list[str]:
    """Lines a test wants read (e.g. the logit margins behind an exactness check), printed in
    the summary at the end of the run."""
    return _FIGURES


def pytest_terminal_summary(terminalreporter) -> None:
    if _FIGURES:
        terminalreporter.section("pdserve figures")
        for line in _FIGURES:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def smollm2_dir(cache_dir: Path, figures: list[str]) -> Path:
    """SmolLM2-135M-Instruct converted from GGUF, once per session, in the session's cache
    (where the processes of `pdserve up --model smollm2` find it)."""
    import time

    from pdserve.engine import builtin

    started = time.monotonic()
    path = builtin.ensure("smollm2", cache_dir=cache_dir)
    figures.append(f"SmolLM2 conversion from GGUF: {time.monotonic() - started:.1f} s")
    return path
