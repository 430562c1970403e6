"""A real disaggregated stack from `pdserve up`: its workers pinned to their own cores, and
`pdserve bench serve` against it over gRPC (every request completes with exactly the asked
number of tokens, the TTFT components come back, the JSON holds every record)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from pdserve.common.cpus import parse_cpu_list

from tests.service.stack import pdserve_stack
from tests.support import pdserve_argv

pytestmark = pytest.mark.service


@pytest.fixture(scope="module")
def stack(tiny_model_dir):
    with pdserve_stack() as s:
        yield s


def cores_of(module: str, port: str) -> list[int]:
    """The cores the process running `python -m module --port port` may run on."""
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if module.encode() in argv and port.encode() in argv:
            status = (proc / "status").read_text()
            line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list"))
            return parse_cpu_list(line.split(":")[1])
    raise AssertionError(f"no process {module} --port {port}")


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="partitioning needs 2 cores")
def test_prefill_and_decode_run_on_cores_of_their_own(stack):
    prefill = cores_of("pdserve.prefill.main", stack.prefill[0].rsplit(":", 1)[1])
    decode = cores_of("pdserve.decode.main", stack.decode[0].rsplit(":", 1)[1])
    assert prefill and decode and not set(prefill) & set(decode)
    assert set(prefill) | set(decode) <= os.sched_getaffinity(0)


def test_bench_serve_measures_a_pdserve_router(stack, tiny_model_dir, tmp_path):
    out = tmp_path / "bench.json"
    done = subprocess.run(pdserve_argv(
        "bench", "serve", "--target", stack.router, "--model", str(tiny_model_dir),
        "--workload", "uniform:8-40,4-8", "--num-requests", "8", "--concurrency", "3",
        "--slo", "ttft:60000,tpot:60000", "--json", str(out), "--seed", "3"),
        capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "output tok/s" in done.stdout and "SLO attainment" in done.stdout
    assert "8/8 done, 0 failed" in done.stderr  # the progress line
    doc = json.loads(out.read_text())
    (run,) = doc["runs"]
    summary, records = run["summary"], run["records"]
    assert (summary["completed"], summary["failed"], summary["attainment"]) == (8, 0, 1.0)
    assert len(records) == 8 and all(r["ok"] for r in records)
    assert all(r["output_tokens"] == r["max_tokens"] and 4 <= r["max_tokens"] <= 8
               and 8 <= r["prompt_tokens"] <= 40 for r in records)
    assert summary["output_tokens"] == sum(r["output_tokens"] for r in records)
    # the two warm-up requests sent prompts of their own: none of these is a cache hit
    assert [r["cached_tokens"] for r in records] == [0] * 8
    for r in records:
        assert len(r["itl_ms"]) >= 1 and r["ttft_ms"] <= r["e2e_ms"]
        parts = r["components"]
        assert parts["prefill_ms"] > 0 and parts["kv_transfer_ms"] > 0
        assert parts["ttft_ms"] >= parts["queue_ms"] + parts["prefill_ms"]


def test_bench_serve_names_bad_arguments(tiny_model_dir):
    for args, message in ((["--rate", "1", "--concurrency", "2"], "exactly one"),
                          (["--concurrency", "2", "--workload", "fixed:1"], "--workload"),
                          (["--concurrency", "2", "--sweep", "1,2"], "--sweep needs --slo")):
        done = subprocess.run(pdserve_argv("bench", "serve", "--target", "127.0.0.1:1",
                                           "--model", str(tiny_model_dir), *args),
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and message in done.stderr, done.stderr


def test_bench_serve_compares_both_apis_interleaved_with_the_router_cpu(stack, tiny_model_dir,
                                                                         tmp_path):
    out = tmp_path / "compare.json"
    done = subprocess.run(pdserve_argv(
        "bench", "serve", "--target", stack.router, "--target", stack.http, "--compare",
        "--interleave", "4", "--server-cpu", stack.router, "--model", str(tiny_model_dir),
        "--workload", "uniform:8-40,4-8", "--num-requests", "8", "--concurrency", "2",
        "--json", str(out)), capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "interleaved in 4 rounds" in done.stdout and "server CPU ms/token" in done.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["target"] for r in runs] == [f"grpc://{stack.router}", stack.http]
    for run in runs:
        summary = run["summary"]
        records = run["records"]
        assert summary["completed"] == 8 and summary["server_cpu_s"] > 0
        assert summary["server_cpu_ms_per_token"] > 0
        assert [r["index"] for r in records] == list(range(8))
        assert all(r["output_tokens"] == r["max_tokens"] and r["components"]["ttft_ms"] > 0
                   for r in records)
    # The same requests went to both APIs, in the same order.
    shapes = [[(r["prompt_tokens"], r["max_tokens"]) for r in run["records"]] for run in runs]
    assert shapes[0] == shapes[1] and len(set(shapes[0])) > 1
