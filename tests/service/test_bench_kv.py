"""`pdserve bench kv` end to end on this host, as a user runs it: real agents driven the way
workers drive them, every transport's bytes verified on the first round (the run fails
otherwise), each row next to both bounds, the bound check and the targets printed."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.support import pdserve_argv

pytestmark = pytest.mark.service


def test_bench_kv_reports_each_transport_next_to_its_bounds(tmp_path) -> None:
    out = tmp_path / "kv.json"
    done = subprocess.run(pdserve_argv("bench", "kv", "--transports", "shm,tcp", "--prompts",
                                       "16,1024", "--reps", "2", "--json", str(out)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["transport"], r["prompt_tokens"]) for r in rows] == [
        ("shm", 16), ("tcp", 16), ("shm", 1024), ("tcp", 1024)]
    for r in rows:
        assert r["gb_s"] > 0 and r["raw_tcp_gb_s"] > 0 and r["memcpy_gb_s"] > 0
        assert r["bound"] == ("memcpy" if r["transport"] == "shm" else "raw TCP")
        assert r["kv_bytes"] == r["kv_pages"] * 12 * 2 * 16 * 4 * 64 * 4  # the small model's
    assert "bounds hold" in done.stdout or "BOUND VIOLATED" in done.stdout
    # The memcpy bound includes a streaming-store copy: glibc's memcpy is no bound on machines
    # whose CPUID reports a huge cache (it then never streams), and the same-host copy streams.
    assert "libc memcpy and streaming stores (" in done.stdout
    assert "target one host >= 16 MiB: shm >= 0.80x memcpy at 1024 tokens" in done.stdout
