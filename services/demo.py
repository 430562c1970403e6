"""`pdserve up --demo`: one request to the stack just started, streamed with its TTFT
breakdown by `pdserve generate`.

A model with a chat template (SmolLM2, the default) is asked a question as a chat and answers
greedily until it ends its reply; a model without one (the random built-in test models) gets
a plain prompt and streams a fixed number of tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

DEMO_QUESTION = "What is the capital of France?"
DEMO_PROMPT = "def fibonacci(n):"


def has_chat_template(model_dir: Path) -> bool:
    """Whether the directory's tokenizer has a chat template (files read, nothing loaded)."""
    if any((model_dir / name).is_file() for name in ("chat_template.jinja",
                                                     "chat_template.json")):
        return True
    path = model_dir / "tokenizer_config.json"
    try:
        return bool(json.loads(path.read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


def run(router: str, model_dir: Path, random_weights: bool, text: str,
        security: list[str]) -> int:
    """Send the demo request (`text`, or the default for the model); pdserve generate's exit
    status."""
    from pdserve import client

    common = ["--address", router, "--temperature", "0", *security]
    if has_chat_template(model_dir):
        text = text or DEMO_QUESTION
        print(f"\ndemo chat: {text!r}\n", flush=True)
        return client.main([*common, "--max-tokens", "128", "--chat", text])
    text = text or DEMO_PROMPT
    note = (" (this built-in model has random weights: the text is noise, the path and the "
            "timings are real)" if random_weights else "")
    print(f"\ndemo: {text!r}{note}\n", flush=True)
    return client.main([*common, "--max-tokens", "48", "--ignore-eos", text])
