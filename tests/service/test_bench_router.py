"""`pdserve bench router`: a real router process in front of simulated workers, an open-loop
load, the figures an operator sizes a router by, and workers vanishing at once.

Small here (140 workers, a few seconds; 70 decode workers is past the size where the router
stops sharing one decode stream per worker, so the call-per-sequence path runs): it checks
that every figure is measured and that the run behaves (all requests of the window served,
every worker used and seen healthy, the killed ones noticed, nothing left running); the
figures themselves come from `pdserve bench router --workers 1000` on a quiet machine
(docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.support import cannot_run, pdserve_argv

pytestmark = pytest.mark.service


def _ours_running(marker: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in text and "pytest" not in text:
            found.append(text)
    return found


def test_bench_router_measures_a_simulated_pool_and_survives_workers_vanishing(tmp_path):
    out = tmp_path / "router.json"
    run = subprocess.run(pdserve_argv(
        "bench", "router", "--workers", "140", "--rate", "60", "--duration", "4", "--warmup",
        "1", "--vanish", "0.2", "--vanish-seconds", "3", "--router-arg=--placement-sample=4",
        "--json", str(out)), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert r["completed"] == r["sent"] > 100 and r["failed"] == 0, r["errors"]
    assert 45 < r["req_s"] < 75 and r["tokens_s"] == pytest.approx(8 * r["req_s"], rel=0.01)
    assert r["stream_interval"] == 1 and r["deltas_per_request"] == 8  # a message a token
    added, e2e = r["router_added_ms"], r["e2e_ms"]
    assert added["n"] > 50 and 0 < added["p50"] < e2e["p50"] and added["p50"] <= added["p99"]
    assert r["router_cpu"]["ms_per_request"] > 0 and r["router_cpu"]["ms_per_token"] > 0
    assert r["workers_seen"] == 140  # a sample of 4 of 70 per role: everyone is drawn
    disc = r["discovery"]
    assert 0 < disc["serving_s"] <= disc["all_healthy_s"] and disc["all_used_s"] > 0
    v = r["vanish"]
    assert v["killed"] == 28 and v["sent"] > 90
    assert v["unhealthy_after_s"] is not None  # the router counted them out
    # Requests sent after the kill go to the survivors (a retry at worst): only those the
    # dead workers were streaming may fail.
    assert v["failed"] <= v["in_flight_lost"] + 2, v["errors"]
    assert "router-added ms" in run.stdout and "workers used        140 of 140" in run.stdout
    assert r["router_args"] == ["--placement-sample=4"]  # the figures name what they ran with
    assert "s measured; router flags --placement-sample=4" in run.stdout
    # from the router's /metrics, over the window: the router collects rarely (a young
    # threshold of 20,000), so a few seconds may see none; a count and its time go together
    gc_ = r["router_gc"]
    assert set(gc_) == {"0", "1", "2"}
    assert all(g["collections"] >= 0 and (g["ms"] > 0) == (g["collections"] > 0)
               for g in gc_.values()), gc_
    assert "router GC pauses    gen 2 " in run.stdout
    # 140 workers: past the streams' limit, their caches come with their Stats reads; those
    # alive at the end are known, with the pages of the prompts they computed or hold
    cache = r["cache_index"]
    assert 112 <= cache["workers"] <= 140 and cache["pages"] > 100, cache
    assert f"cache index         {cache['workers']} workers' prefix caches" in run.stdout
    # what to give pdserve plan for the routers' cores: this run's CPU per request
    assert f"for pdserve plan    --router-cpu-ms {r['router_cpu']['ms_per_request']:.2f} " \
        "(requests of 8 output tokens;" in run.stdout
    assert _ours_running("pdserve-bench-router-") == []  # sims and router are gone


def test_bench_router_floor_runs_the_same_load_through_the_least_a_router_does(tmp_path):
    """The Python floors (aio, sync) and the native one (C++ gRPC, built on first use) relay
    every token of the same arrivals, N to a message as pdserve does; where the native one
    cannot be built (no libgrpc++) the bench says so and runs the others (and this test then
    skips, except in CI)."""
    from pdserve.bench.native_floor import binary

    try:
        binary()  # built before the bench (not against its timeout)
        native = ""
    except RuntimeError as exc:
        native = str(exc)
    out = tmp_path / "router.json"
    run = subprocess.run(pdserve_argv(
        "bench", "router", "--workers", "8", "--rate", "30", "--duration", "2", "--warmup",
        "0.5", "--vanish", "0", "--floor", "--stream-interval", "4", "--json", str(out)),
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    kinds = ["aio", "sync"] + ([] if native else ["native"])
    assert r["router"] == "pdserve" and list(r["floor"]) == kinds
    # the prefill's token, then the decode worker's 4 and the 3 left: every router asked for 4
    assert r["deltas_per_request"] == 3 and "; 4 tokens a message" in run.stdout
    for kind, f in r["floor"].items():
        assert f["router"] == kind and f["sent"] == r["sent"] > 30, kind  # the same arrivals
        assert f["completed"] == f["sent"] and f["failed"] == 0, f["errors"]
        assert f["tokens_s"] == pytest.approx(8 * f["req_s"], rel=0.01)  # every token relayed
        assert f["stream_interval"] == 4 and f["deltas_per_request"] == 3, kind
        assert f["workers_seen"] == 8  # workers in turn; Timing names both of each request
        assert f["router_cpu"]["ms_per_request"] > 0 and f["router_added_ms"]["n"] > 20
        assert f["discovery"]["all_healthy_s"] is None  # a floor checks no health
        assert f["router_gc"] == {} and f["cache_index"] is None  # nor serves /metrics
    rows = [line.split() for line in run.stdout.splitlines()
            if line.startswith(("  pdserve ", "  floor "))]
    assert [row[1] if row[0] == "floor" else row[0] for row in rows] == ["pdserve", *kinds]
    assert rows[0][-1] == "1.00x" and all(row[-1].endswith("x") for row in rows)
    assert _ours_running("pdserve-bench-router-") == []
    assert _ours_running("pdserve.bench.router_floor") == []
    assert _ours_running("router_floor-") == []  # the native one
    if native:
        assert "the native floor is left out" in run.stdout
        cannot_run(native)


def test_bench_router_drives_the_openai_http_api(tmp_path):
    """--api http: the same load as streamed /v1/completions on keep-alive connections; every
    token arrives, each request's workers come from its `pdserve` object, the ledger matches
    the requests by their X-Request-Id."""
    out = tmp_path / "router.json"
    run = subprocess.run(pdserve_argv(
        "bench", "router", "--workers", "8", "--rate", "30", "--duration", "2", "--warmup",
        "0.5", "--vanish", "0", "--output-tokens", "16", "--api", "http", "--json", str(out)),
        capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    r = json.loads(out.read_text())
    assert r["api"] == "http" and r["completed"] == r["sent"] > 30 and r["failed"] == 0, r
    assert r["tokens_s"] == pytest.approx(16 * r["req_s"], rel=0.01)
    assert r["workers_seen"] == 8
    added, ttft = r["router_added_ms"], r["ttft_ms"]
    assert added["n"] > 20 and 0 < added["p50"] <= added["p99"] and ttft["p50"] > 0
    assert r["router_cpu"]["ms_per_request"] > 0
    assert "s measured; over the OpenAI HTTP API" in run.stdout
    assert _ours_running("pdserve-bench-router-") == []


def test_bench_router_floor_kinds_are_named():
    run = subprocess.run(pdserve_argv("bench", "router", "--floor", "aio,rust"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--floor rust: not a floor (aio, sync, native)" in run.stderr


def test_bench_router_refuses_bad_flags_by_name():
    run = subprocess.run(pdserve_argv("bench", "router", "--workers", "1"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--workers 1: at least 2" in run.stderr
    run = subprocess.run(pdserve_argv("bench", "router", "--vanish", "1.5"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--vanish 1.5" in run.stderr
    run = subprocess.run(pdserve_argv("bench", "router", "--harness-cpus", "0,4096"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--harness-cpus 0,4096: not all of [" in run.stderr
    run = subprocess.run(pdserve_argv("bench", "router", "--stream-interval", "5000"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "--stream-interval 5000: must be 0..4096" in run.stderr
    run = subprocess.run(pdserve_argv("bench", "router", "--router-arg=--stream-interval=8"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "give the bench's --stream-interval" in run.stderr
    run = subprocess.run(pdserve_argv("bench", "router", "--api", "http", "--floor"),
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "the floor routers serve gRPC only" in run.stderr
