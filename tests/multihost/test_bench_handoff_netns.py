"""`pdserve bench handoff --netns`: the ucx and tcp stacks with their prefill and decode sides
in two network namespaces; every request's handoff crosses the veth (the prompt prefilled on
the prefill side however short), the figures come from the router's Timing, and the
namespaces and processes are gone afterwards."""

from __future__ import annotations

import json
import signal
import subprocess
import time

from tests.multihost.conftest import require_root
from tests.support import pdserve_argv


def _leftovers() -> str:
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                timeout=30).stdout
    procs = subprocess.run(["pgrep", "-af", "pdserve.(router|prefill|decode|kvtransfer).main"],
                           capture_output=True, text=True, timeout=30).stdout
    return "\n".join(line for line in (namespaces + procs).splitlines()
                     if "pdkv" in line or "--advertise-host 10.206." in line)


def test_bench_handoff_across_two_hosts_measures_each_transport_and_cleans_up(tmp_path):
    require_root()
    out = tmp_path / "handoff.json"
    done = subprocess.run(pdserve_argv(
        "bench", "handoff", "--netns", "--model", "tiny", "--short-reps", "3",
        "--long-tokens", "64", "--long-reps", "1", "--chunk-size", "32", "--warmup", "1",
        "--json", str(out)), capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "two hosts (network namespaces joined by a veth; " in done.stdout
    rows = {(r["path"], r["prompt_tokens"]): r for r in json.loads(out.read_text())}
    # tcp: the prefill worker's own lane; tcp-agent: through its agent (--no-network-lane)
    transports = {"ucx": "ucx", "tcp": "tcp", "tcp-agent": "tcp"}
    assert set(rows) == {(p, n) for p in transports for n in (8, 64)}
    for (path, tokens), r in rows.items():
        for s in r["samples"]:
            assert s["kv_transport"] == transports[path]  # never the same-host copy
            assert s["kv_pages"] == (1 if tokens == 8 else 4)
            assert 0 < s["kv_transfer_ms"] <= s["ttft_ms"]
    for path, transport in transports.items():
        assert f"target one-page kv_transfer_ms p50 <= 1 ms ({path}, {transport})" in done.stdout
    assert _leftovers() == ""


def test_bench_handoff_netns_refuses_same_host_paths() -> None:
    done = subprocess.run(pdserve_argv("bench", "handoff", "--netns", "--paths", "shm"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "bad --paths ['shm']" in done.stderr


def test_bench_handoff_netns_interrupted_leaves_nothing_behind(tmp_path) -> None:
    require_root()
    bench = subprocess.Popen(pdserve_argv(
        "bench", "handoff", "--netns", "--model", "tiny", "--paths", "tcp", "--short-reps",
        "100000", "--long-tokens", "0"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    try:
        deadline = time.monotonic() + 120
        # both agents and both workers started, in both namespaces
        while _leftovers().count("--advertise-host 10.206.") < 4:
            assert bench.poll() is None, bench.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the two-host stack never started"
            time.sleep(0.2)  # bounded poll of the process table
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=150)
    finally:
        if bench.poll() is None:
            bench.kill()
            bench.wait()
    assert bench.returncode == 130, err[-3000:]
    assert "interrupted; its processes and namespaces are removed" in err
    assert _leftovers() == ""
