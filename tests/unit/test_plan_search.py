"""`pdserve plan`'s workload, goodput search and command: the same requests as `pdserve bench
serve`, a goodput found where a hand-computed capacity says it must be, monotone in the SLO
and the pool, and the ranking and JSON an operator (or `plan --validate`) reads."""

from __future__ import annotations

import json

import pytest
from pdserve.bench.loadgen.arrivals import Arrivals
from pdserve.bench.loadgen.workload import shapes
from pdserve.plan import command
from pdserve.plan.cluster import Deployment
from pdserve.plan.search import Slo, deployments, find_goodput, predict
from pdserve.plan.workload import Workload, parse_arrivals
from pdserve.sim.profile import SimProfile

pytestmark = pytest.mark.unit

PROFILE = SimProfile(prefill_base_ms=2.0, prefill_ms_per_token=0.1, decode_base_ms=5.0,
                     decode_ms_per_seq=1.0, handoff_base_ms=1.0, handoff_gb_s=1.0,
                     kv_bytes_per_token=1000)


def test_requests_are_bench_serves_shapes_and_arrivals():
    w = Workload("uniform:10-500,5-50", num_requests=50, seed=3)
    got = w.requests(4.0)
    want = shapes("uniform:10-500,5-50", 50, 3)
    assert [(r.prompt_tokens, r.output_tokens) for r in got] == \
        [(s.prompt_tokens, s.output_tokens) for s in want]
    gaps = Arrivals(rate=4.0).gaps_s(50, 4)  # bench serve's open loop: seed + 1
    at = 0.0
    for r, gap in zip(got, gaps):
        at += gap
        assert r.arrival_ms == pytest.approx(at * 1e3)
    # a rate replays the same arrivals, compressed; more workers: more of the same requests
    assert [r.arrival_ms / 2 for r in got] == pytest.approx([r.arrival_ms for r in
                                                             w.requests(8.0)])
    assert [r.prompt_tokens for r in w.requests(4.0, workers=2)][:50] == \
        [r.prompt_tokens for r in got]
    assert len(w.requests(4.0, workers=2)) == 100 and len(w.requests(4.0, count=7)) == 7


def test_constant_arrivals_and_prefix_reuse_in_whole_pages():
    w = Workload("fixed:100,10", arrivals="constant", prefix_share=0.5, num_requests=3)
    assert [r.arrival_ms for r in w.requests(10.0)] == pytest.approx([100.0, 200.0, 300.0])
    assert w.cached_tokens(100) == 48  # 50 tokens: 3 whole pages
    assert Workload(prefix_share=0.99).cached_tokens(20) == 16  # never the last token's page
    assert Workload(prefix_share=0.99).cached_tokens(16) == 0
    assert parse_arrivals("gamma:0.5") == 0.5 and parse_arrivals("poisson") == 1.0
    for bad in ("gamma:-1", "burst", "constant:2"):
        with pytest.raises(ValueError, match="arrivals"):
            parse_arrivals(bad)
    with pytest.raises(ValueError, match="prefix_share"):
        Workload(prefix_share=1.0)


def test_goodput_is_the_prefill_workers_capacity_when_prefill_is_the_bottleneck():
    # one prompt per step (max_prefill_tokens 300): 32 ms each, so at most 31.25 req/s; TTFT
    # alone 33.3 ms, so with an SLO of 40 ms a queue of a fraction of a prompt is tolerated
    dep = Deployment("disaggregated", 1, 1, max_prefill_tokens=300)
    w = Workload("fixed:300,1", arrivals="constant", num_requests=1000)
    found = find_goodput(dep, w, PROFILE, Slo(ttft_ms=40.0))
    assert found.rate == pytest.approx(31.25, rel=0.02)
    assert predict(dep, w, PROFILE, found.rate, Slo(ttft_ms=40.0)).good(Slo(ttft_ms=40.0))
    assert not predict(dep, w, PROFILE, 33.0, Slo(ttft_ms=40.0)).good(Slo(ttft_ms=40.0))


def test_goodput_grows_with_a_looser_slo_and_with_more_workers():
    w = Workload("uniform:100-600,10-60", num_requests=200)
    tight, loose = Slo(200.0, 20.0), Slo(1000.0, 60.0)
    one = find_goodput(Deployment("colocated", 0, 1), w, PROFILE, tight).rate
    assert find_goodput(Deployment("colocated", 0, 1), w, PROFILE, loose).rate > one > 0
    assert find_goodput(Deployment("colocated", 0, 2), w, PROFILE, tight).rate > 1.5 * one
    assert find_goodput(Deployment("disaggregated", 1, 2), w, PROFILE, tight).rate >= \
        find_goodput(Deployment("disaggregated", 1, 1), w, PROFILE, tight).rate
    # the rates tried bracket the answer: one above it, within 1%, failed
    found = find_goodput(Deployment("colocated", 0, 1), w, PROFILE, tight)
    above = [p.rate for p in found.points if p.rate > found.rate]
    assert above and min(above) <= found.rate * 1.0101


def test_goodput_is_zero_when_no_rate_meets_the_slo():
    found = find_goodput(Deployment("colocated", 0, 1), Workload("fixed:300,4",
                                                                 num_requests=50),
                         PROFILE, Slo(ttft_ms=10.0))  # a prompt alone takes 32 ms
    assert found.rate == 0.0


def test_tp_is_a_speedup_only_when_the_profile_models_it():
    w = Workload("fixed:300,20", num_requests=100)
    base = predict(Deployment("colocated", 0, 1), w, PROFILE, 5.0)
    same = predict(Deployment("colocated", 0, 1, tp=2), w, PROFILE, 5.0)
    assert same.ttft_p50_ms == base.ttft_p50_ms
    fast = SimProfile(**{**PROFILE.__dict__, "tp_efficiency": 1.0})
    faster = predict(Deployment("colocated", 0, 1, tp=2), w, fast, 5.0)
    assert faster.ttft_p50_ms is not None and base.ttft_p50_ms is not None
    assert faster.ttft_p50_ms < 0.6 * base.ttft_p50_ms


def test_predictions_are_deterministic_for_a_seed():
    dep = Deployment("disaggregated", 2, 1)
    a = predict(dep, Workload("chat", num_requests=300, seed=1), PROFILE, 20.0)
    b = predict(dep, Workload("chat", num_requests=300, seed=1), PROFILE, 20.0)
    c = predict(dep, Workload("chat", num_requests=300, seed=2), PROFILE, 20.0)
    assert a == b and a != c


def test_configurations_enumerated():
    configs = deployments(3, ("colocated", "disaggregated"), [256, 512], [1])
    names = [d.name for d in configs]
    assert len(configs) == 2 * (3 + 3)
    assert "colocated x3 chunk 256" in names and "2P+1D chunk 512" in names
    assert all(d.workers <= 3 for d in configs)


def test_plan_command_ranks_by_goodput_per_worker_and_writes_json(tmp_path, capsys):
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({k: v for k, v in PROFILE.__dict__.items()}))
    out = tmp_path / "plan.json"
    assert command.main(["--profile", str(profile), "--workload", "fixed:300,20",
                         "--num-requests", "100", "--max-workers", "2", "--json", str(out),
                         "--no-progress", "--ttft-slo-ms", "300", "--tpot-slo-ms", "30",
                         "--rates", "1,5"]) == 0
    printed = capsys.readouterr().out
    assert "colocated x1 chunk 512" in printed and "1P+1D chunk 512" in printed
    doc = json.loads(out.read_text())
    configs = doc["configs"]
    assert {c["config"] for c in configs} == {"colocated x1 chunk 512",
                                              "colocated x2 chunk 512", "1P+1D chunk 512"}
    per_worker = [c["goodput_per_worker"] for c in configs]
    assert per_worker == sorted(per_worker, reverse=True) and per_worker[0] > 0
    for c in configs:
        assert c["predicted"]["ttft_p50_ms"] > 0 and c["predicted"]["tpot_p50_ms"] > 0
        assert [p["rate"] for p in c["curve"]] == [1.0, 5.0]
    assert doc["workload"]["workload"] == "fixed:300,20" and doc["slo"]["ttft_ms"] == 300


def test_plan_help_shows_its_examples_as_written(capsys):
    with pytest.raises(SystemExit):
        command.main(["--help"])
    text = capsys.readouterr().out
    # one example a line, as the docstring has them (argparse's default reflowed them into
    # the paragraphs around)
    assert "\n    pdserve plan --workload fixed:256,128 --ttft-slo-ms 500 --tpot-slo-ms 50 " \
        "--max-workers 4\n" in text
    assert "--validate-repeats" in text


def test_plan_command_refuses_bad_options(capsys):
    with pytest.raises(SystemExit) as exc:
        command.main(["--chunk-sizes", "0"])
    assert exc.value.code == 2
    assert command.main(["--workload", "zipf:3", "--no-progress"]) == 2
    assert "zipf" in capsys.readouterr().err


def test_plan_command_takes_a_profile_per_worker_kind(tmp_path):
    prefill = tmp_path / "prefill.json"
    prefill.write_text(json.dumps({"devices_per_worker": 2}))
    out = tmp_path / "plan.json"
    assert command.main(["--prefill-profile", str(prefill), "--modes", "disaggregated",
                         "--max-workers", "2", "--num-requests", "50", "--no-progress",
                         "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [(c["config"], c["devices"]) for c in doc["configs"]] == [("1P+1D chunk 512", 3.0)]
    assert doc["prefill_profile"]["devices_per_worker"] == 2 and doc["decode_profile"] is None


def test_plan_command_plots_attainment_around_each_goodput(tmp_path):
    png, out = tmp_path / "plan.png", tmp_path / "plan.json"
    assert command.main(["--modes", "colocated", "--max-workers", "1", "--num-requests", "50",
                         "--no-progress", "--plot", str(png), "--json", str(out)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (config,) = json.loads(out.read_text())["configs"]
    rates = [p["rate"] for p in config["curve"]]
    assert rates == pytest.approx([k * config["goodput_rps"] for k in command.CURVE])
    attainment = [p["attainment"] for p in config["curve"]]
    assert attainment[0] >= 0.9 > attainment[-1]  # the cliff is inside the curve


def test_goodput_stops_where_the_routers_saturate(capsys):
    # fast workers (a prompt of 10 tokens in 3 ms), routers of 20 ms a request: one router
    # core serves at most 50 req/s whatever the pool, two 100
    w = Workload("fixed:10,1", arrivals="constant", num_requests=300)
    slo = Slo(ttft_ms=100.0)
    unpriced = find_goodput(Deployment("colocated", 0, 4), w, PROFILE, slo).rate
    routed = SimProfile(**{**PROFILE.__dict__, "router_ms_per_request": 20.0})
    one = find_goodput(Deployment("colocated", 0, 4), w, routed, slo).rate
    two = find_goodput(Deployment("colocated", 0, 4, routers=2), w, routed, slo).rate
    assert unpriced > 200
    assert one == pytest.approx(50.0, rel=0.05) and two == pytest.approx(100.0, rel=0.05)
    assert command.main(["--workload", "fixed:10,1", "--router-cpu-ms", "2,0.5", "--routers",
                         "3", "--max-workers", "1", "--modes", "colocated", "--num-requests",
                         "50", "--no-progress"]) == 0
    # 2 + 0.5 x 1 token = 2.5 ms of a core a request: three cores saturate at 1,200 req/s
    assert "routers: 3 x 1 core, 2 ms per request + 0.5 per token = 2.50 ms of a core per " \
        "request of this workload: they saturate at 1,200 req/s" in capsys.readouterr().out
    assert command.main(["--router-cpu-ms", "2,x", "--no-progress"]) == 2
    assert "--router-cpu-ms='2,x': expected REQUEST[,TOKEN]" in capsys.readouterr().err
