"""`pdserve bench kv --netns`: the agents in two network namespaces joined by a veth, every
byte across it next to raw TCP on the same link; the namespaces are gone afterwards."""

from __future__ import annotations

import json
import os
import subprocess

from tests.multihost.conftest import require_root
from tests.support import pdserve_argv


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=30).stdout


def test_bench_kv_across_a_veth_link_cleans_up_its_namespaces(tmp_path) -> None:
    require_root()
    out = tmp_path / "kv.json"
    done = subprocess.run(pdserve_argv("bench", "kv", "--netns", "--transports", "tcp",
                                       "--prompts", "16,1024", "--reps", "2", "--json",
                                       str(out)),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "two network namespaces joined by a veth" in done.stdout
    if len(os.sched_getaffinity(0)) >= 2:  # each host on its own CPUs, as two hosts are
        assert "host a on CPU " in done.stdout
    rows = json.loads(out.read_text())["results"]
    assert [r["transport"] for r in rows] == ["tcp", "tcp"]
    assert all(r["bound"] == "raw TCP" and r["raw_tcp_gb_s"] > 0 for r in rows)
    # the first handoff of a round, and raw TCP's, beside the back-to-back one held to the bound
    assert all(r["first_ms"] > 0 and r["raw_first_ms"] > 0 and r["handoff_ms"] > 0 for r in rows)
    assert "first handoff of a round at 1024 tokens (ms): raw TCP " in done.stdout
    assert "target cross-host >= 16 MiB: tcp >= 0.90x raw TCP on the link" in done.stdout
    assert "pdkv" not in _namespaces()
