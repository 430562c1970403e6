"""`pdserve bench handoff` end to end, as a user runs it: real `pdserve up` stacks, requests
through the router, the kv_transfer figures read from each request's Timing, every target
printed with its figure."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import pdserve_argv

pytestmark = pytest.mark.service


def test_bench_handoff_reports_the_router_figures_and_targets(tmp_path) -> None:
    out = tmp_path / "handoff.json"
    done = subprocess.run(pdserve_argv(
        "bench", "handoff", "--model", "tiny", "--paths", "shm", "--short-reps", "3",
        "--long-tokens", "96", "--long-reps", "1", "--chunk-size", "32", "--warmup", "1",
        "--json", str(out)), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {(r["path"], r["prompt_tokens"]): r for r in json.loads(out.read_text())}
    assert set(rows) == {("shm", 8), ("shm", 96)}
    for (_, tokens), r in rows.items():
        assert len(r["samples"]) == (3 if tokens == 8 else 1)
        for s in r["samples"]:
            assert s["kv_transport"] == "shm"  # one host: the same-host copy, found unasked
            assert 0 < s["kv_transfer_ms"] <= s["ttft_ms"]
            assert s["kv_transfer_total_ms"] > 0
            assert s["kv_pages"] == 1 if tokens == 8 else s["kv_pages"] > 1
    assert "target one-page kv_transfer_ms p50 <= 1 ms (shm, shm)" in done.stdout
    assert "target 96-token prompts: exposed handoff <= 20% of the whole transfer (shm)" \
        in done.stdout
