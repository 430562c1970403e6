"""Checks that need a fresh interpreter (what a process imports and sets up at start), and a
KV pool shared with a second process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.shm import leftover_segments
from pdserve.engine.pool import KVPool

from tests.support import free_port

pytestmark = pytest.mark.service

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
FP = LayoutFingerprint("m", "r", "float32", num_layers=2, num_kv_heads=2, head_dim=8,
                       block_size=4)


def _run(script: str, **env: str) -> str:
    """Run `script` in a fresh interpreter with only these OTEL_* variables; its stdout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env={**clean, **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_without_an_endpoint_tracing_is_a_no_op():
    out = _run("""
        import sys, threading
        from pdserve.common import tracing
        assert tracing.setup_tracing("pdserve-test") is False
        assert not tracing.enabled()
        assert not [m for m in sys.modules if m.startswith("opentelemetry.sdk")]
        assert not [t.name for t in threading.enumerate() if t.name.startswith("Otel")]
        with tracing.span("x", request_id="r") as s:
            assert not s.is_recording()
            assert tracing.outgoing_metadata() is None and tracing.traceparent() == ""
        assert tracing.start_span("y") is tracing.start_span("z")  # the one shared no-op span
        assert tracing.log_fields(s) == {}
        tracing.shutdown_tracing()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_with_an_endpoint_spans_are_batched_sampled_and_shut_down_in_bounded_time():
    # Nothing listens on the port: export fails in the background, never in the caller.
    out = _run(f"""
        import threading, time
        from pdserve.common import tracing
        assert tracing.setup_tracing("pdserve-test", instance_id="t-1") is True
        assert [t.name for t in threading.enumerate() if t.name.startswith("OtelBatch")]
        root = tracing.start_span("root")  # ratio 0: a new trace is not sampled
        assert not root.is_recording()
        parent = tracing.context_from_traceparent("{TRACEPARENT}")
        child = tracing.start_span("child", context=parent)  # the caller sampled it: recorded
        assert child.is_recording()
        with tracing.current(child):
            md = dict(tracing.outgoing_metadata())
        assert md["traceparent"].split("-")[1] == "{TRACEPARENT.split('-')[1]}"
        assert tracing.traceparent(child) == md["traceparent"]
        assert tracing.log_fields(child) == {{"trace_id": "{TRACEPARENT.split('-')[1]}"}}
        child.end()
        started = time.monotonic()
        tracing.shutdown_tracing(timeout_s=2.0)
        assert time.monotonic() - started < 4.0
        assert not tracing.enabled()
        print("ok")
    """, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}",
        OTEL_TRACES_SAMPLER_ARG="0")
    assert out.strip().splitlines()[-1] == "ok"


def test_two_processes_see_the_same_pool_bytes():
    pool = KVPool(FP, num_pages=8)
    try:
        pool.tensor[3] = torch.arange(FP.page_bytes // 4, dtype=torch.float32).view(FP.page_shape)
        code = (
            "import sys, torch\n"
            "from pdserve.engine.pool import KVPool, LayoutFingerprint\n"
            f"fp = LayoutFingerprint(**{FP.__dict__!r})\n"
            f"pool = KVPool(fp, 8, attach_fd={pool.fd})\n"
            "assert float(pool.tensor[3].flatten()[5]) == 5.0, 'reader saw other bytes'\n"
            "pool.tensor[6].fill_(2.5)\n"
            "pool.close()\n"
        )
        subprocess.run([sys.executable, "-c", code], check=True, timeout=60, pass_fds=[pool.fd])
        assert torch.all(pool.tensor[6] == 2.5)  # the other process's write, no copy
        assert leftover_segments(os.getpid()) == []  # nameless: nothing in /dev/shm, ever
    finally:
        pool.close()


def test_router_never_imports_torch():
    code = ("import sys, pdserve.router.main, pdserve.router.lifecycle; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; "
            "sys.exit(f'router imported {bad}' if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


ROUTER_TOKENIZER = """
    import json, sys
    from pdserve.router.tokenizer import Tokenizer, hide_torch
    hide_torch()  # what the router process does first
    out = {}
    for path in sys.argv[1:]:
        tok = Tokenizer.from_dir(path)
        ids = [tok.encode(t) for t in TEXTS]
        chat = tok.encode_chat([("user", TEXTS[0])]) if tok.has_chat_template else None
        out[path] = {"ids": ids, "chat": chat, "text": [tok.decode(i) for i in ids]}
    assert sys.modules.get("torch") is None, "torch was imported"
    assert not any(m.startswith("torch.") for m in sys.modules), "a torch module was imported"
    print(json.dumps(out))
"""


def test_router_tokenizes_with_transformers_without_torch(model_kinds, tiny_model_dir):
    """In a fresh interpreter set up as the router's, AutoTokenizer loads without torch and
    gives the ids, chat ids and text transformers gives in this process (with torch)."""
    import json

    from transformers import AutoTokenizer

    texts = ["What is the capital of France?", "def main():\n    return 0\n", "日本語 🎉"]
    paths = [str(p) for p in (*model_kinds.values(), tiny_model_dir)]
    script = f"TEXTS = {texts!r}\n" + textwrap.dedent(ROUTER_TOKENIZER)
    done = subprocess.run([sys.executable, "-c", script, *paths], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "PyTorch was not found" not in done.stderr  # the advisory warning is silenced
    got = json.loads(done.stdout)
    for path in paths:
        hf = AutoTokenizer.from_pretrained(path)
        ids = [hf(t).input_ids for t in texts]
        assert got[path]["ids"] == ids, path
        assert got[path]["text"] == [hf.decode(i, skip_special_tokens=True) for i in ids]
        if hf.chat_template:
            chat = hf.apply_chat_template([{"role": "user", "content": texts[0]}],
                                          add_generation_prompt=True)["input_ids"]
            assert got[path]["chat"] == list(chat), path
        else:
            assert got[path]["chat"] is None
