"""`pdserve plan --validate`'s bookkeeping, with the real stacks replaced by a fake run: the
same requests predicted for each configuration, the relative errors, the table and the JSON
(`validation`: config, predicted and measured TTFT / TPOT p50)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from pdserve.plan import command, stacks, validate
from pdserve.plan.cluster import Deployment, Profiles
from pdserve.plan.search import predict
from pdserve.plan.steps import StepTotals, parse, split_overheads
from pdserve.plan.validate import Latencies
from pdserve.plan.workload import Workload
from pdserve.sim.profile import SimProfile

pytestmark = pytest.mark.unit

PROFILE = SimProfile(prefill_base_ms=2.0, prefill_ms_per_token=0.1, decode_base_ms=5.0,
                     decode_ms_per_seq=1.0, handoff_base_ms=1.0, handoff_gb_s=1.0,
                     kv_bytes_per_token=1000)


def test_each_configuration_is_predicted_on_the_requests_the_real_run_gets():
    w = Workload("fixed:300,10", num_requests=1000)
    seen: list[tuple[str, float]] = []

    def fake(dep: Deployment, rate: float) -> tuple[Latencies, list[Latencies]]:
        seen.append((dep.name, rate))
        return Latencies(None, None), [Latencies(40.0, 6.0)]  # no calibration: no overheads

    rows = validate.validate(validate.CONFIGS, w, Profiles(PROFILE), 2.0, 30, fake)
    assert seen == [("colocated x1 chunk 512", 2.0), ("1P+1D chunk 512", 2.0)]
    for row, dep in zip(rows, validate.CONFIGS):
        want = predict(dep, w, PROFILE, 2.0, count=30)  # 30 requests, as bench serve sends
        assert row["predicted"]["ttft_p50_ms"] == want.ttft_p50_ms  # type: ignore[index]
        assert row["measured"] == {"ttft_p50_ms": 40.0, "tpot_p50_ms": 6.0,
                                   "ttft_p99_ms": None, "tpot_p99_ms": None,
                                   "cpu_ms_per_token": None, "shared": None,
                                   "prefill_p50_ms": None, "steps": None}
        assert row["error"]["ttft_p50"] == pytest.approx(  # type: ignore[index]
            want.ttft_p50_ms / 40.0 - 1)
    # alone at 2 req/s: TTFT 32 ms co-located, 33.3 ms through the handoff; TPOT 6 ms
    assert rows[0]["error"]["tpot_p50"] == pytest.approx(0.0)  # type: ignore[index]
    assert rows[0]["within_target"] is True  # -20% TTFT, 0% TPOT
    text = validate.table(rows)
    assert "colocated x1 chunk 512" in text and "(-20%)" in text


def test_repeated_runs_are_each_predicted_and_their_medians_compared():
    w = Workload("fixed:300,10", num_requests=1000, seed=5)
    measured = [Latencies(40.0, 6.0), Latencies(400.0, 60.0), Latencies(30.0, 5.0)]
    dep = Deployment("colocated", 0, 1)
    (row,) = validate.validate([dep], w, Profiles(PROFILE), 4.0, 30,
                               lambda d, r: (Latencies(None, None), measured), repeats=3)
    seeds = validate.repeat_seeds(5, 3)
    assert seeds == [5, 4006, 4007] and [r["seed"] for r in row["runs"]] == seeds
    each = [predict(dep, replace(w, seed=s), PROFILE, 4.0, count=30).ttft_p50_ms
            for s in seeds]
    assert [r["predicted"]["ttft_p50_ms"] for r in row["runs"]] == each
    assert row["predicted"]["ttft_p50_ms"] == sorted(each)[1]
    assert row["measured"]["ttft_p50_ms"] == 40.0 and row["measured"]["tpot_p50_ms"] == 6.0
    with pytest.raises(ValueError, match="1 measured runs for 3 seeds"):
        validate.validate([dep], w, Profiles(PROFILE), 4.0, 30,
                          lambda d, r: (Latencies(None, None), measured[:1]), repeats=3)


def test_a_prediction_off_by_more_than_20_percent_is_flagged():
    rows = validate.validate([Deployment("colocated", 0, 1)], Workload("fixed:300,10"),
                             Profiles(PROFILE), 1.0, 10,
                             lambda d, r: (Latencies(None, None), [Latencies(20.0, 6.0)]))
    assert rows[0]["within_target"] is False  # TTFT 32 predicted, 20 measured: +60%


def test_constant_arrivals_cannot_be_sent_by_bench_serve(tmp_path):
    with pytest.raises(ValueError, match="constant"):
        stacks.StackRunner("tiny", Workload(arrivals="constant"), 10, tmp_path)


def test_plan_validate_writes_the_validation_json(tmp_path, monkeypatch, capsys):
    class FakeRunner:
        def __init__(self, model: str, workload: Workload, count: int, log_dir: object,
                     repeats: int):
            assert model == "tiny" and count == 20 and repeats == 2

        def __call__(self, dep: Deployment, rate: float) -> tuple[Latencies, list[Latencies]]:
            return Latencies(35.0, 6.5), [Latencies(35.0, 6.5, 50.0, 7.0),
                                          Latencies(45.0, 7.5, 60.0, 8.0)]

    monkeypatch.setattr(stacks, "StackRunner", FakeRunner)
    logs = tmp_path / "logs"
    monkeypatch.setattr(stacks, "log_dir", lambda: logs.mkdir() or logs)
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(PROFILE.__dict__))
    out = tmp_path / "v.json"
    args = ["--validate", "--model", "tiny", "--profile", str(profile), "--workload",
            "fixed:300,10", "--validate-requests", "20", "--validate-rate", "1.5",
            "--validate-repeats", "2", "--json", str(out)]
    assert command.main(args) == 0
    assert not logs.exists()  # the runs' logs go with a validation that succeeded
    doc = json.loads(out.read_text())
    assert [v["config"] for v in doc["validation"]] == ["colocated x1 chunk 512",
                                                        "1P+1D chunk 512"]
    for v in doc["validation"]:
        assert v["rate"] == 1.5 and v["requests"] == 20
        assert set(v["predicted"]) >= {"ttft_p50_ms", "tpot_p50_ms"}
        assert v["measured"]["ttft_p50_ms"] == 40.0  # the median of the two runs
        assert [r["seed"] for r in v["runs"]] == [0, 4001]
        assert [r["measured"]["tpot_p50_ms"] for r in v["runs"]] == [6.5, 7.5]
        assert v["calibration"]["step_overhead_ms"] == pytest.approx(0.5)  # 6.5 - 6 alone
    printed = capsys.readouterr().out
    assert "TTFT p50 pred/meas" in printed and "2 x 20 requests" in printed
    assert "2 runs, TTFT p50 measured 35.0-45.0 ms" in printed

    def failing(dep: Deployment, rate: float) -> tuple[Latencies, list[Latencies]]:
        raise RuntimeError("pdserve up exited (1) before it was ready")

    monkeypatch.setattr(stacks, "StackRunner", lambda *a, **k: failing)
    assert command.main(args) == 1  # and stay, named, with one that failed
    assert f"before it was ready\n(the runs' logs: {logs})" in capsys.readouterr().err
    assert logs.is_dir()


def test_calibration_turns_what_requests_alone_took_beyond_the_model_into_overheads():
    w = Workload("fixed:300,10")
    profiles = Profiles(PROFILE)
    # alone: co-located TTFT 32 (one prefill step), TPOT 6; measured 3 ms and 0.5 ms more
    calibrated, found = validate.calibrate(Deployment("colocated", 0, 1), w, profiles,
                                           Latencies(35.0, 6.5))
    assert found["step_overhead_ms"] == pytest.approx(0.5)
    assert found["request_overhead_ms"] == pytest.approx(2.5)  # the prefill step has 0.5 too
    assert calibrated.default.step_overhead_ms == pytest.approx(0.5)
    alone = predict(Deployment("colocated", 0, 1), w, calibrated, 1e-3, count=8)
    assert alone.ttft_p50_ms == pytest.approx(35.0) and alone.tpot_p50_ms == pytest.approx(6.5)
    # disaggregated: the decode worker's profile takes them; the prefill worker's is untouched
    calibrated, found = validate.calibrate(Deployment("disaggregated", 1, 1), w, profiles,
                                           Latencies(36.3, 7.0))
    assert found == {"step_overhead_ms": pytest.approx(1.0), "seq_overhead_ms": 0.0,
                     "request_overhead_ms": pytest.approx(3.0)}
    assert calibrated.role("decode").step_overhead_ms == pytest.approx(1.0)
    assert calibrated.role("prefill").step_overhead_ms == 0.0
    # never negative: a stack faster than the model leaves the profile as it was
    _, found = validate.calibrate(Deployment("colocated", 0, 1), w, profiles,
                                  Latencies(20.0, 5.0))
    assert found == {"step_overhead_ms": 0.0, "seq_overhead_ms": 0.0, "request_overhead_ms": 0.0}


def test_the_steps_at_the_rate_split_the_gap_alone_into_per_step_and_per_sequence():
    w = Workload("fixed:300,10")
    dep = Deployment("colocated", 0, 1)
    # 10 decode steps of 10 sequences: 200 ms of steps + 50 between them, 50 of it the other
    # processes' 0.5 ms per token streamed; the profile prices them at 10 x 5 + 100 x 1
    loaded = StepTotals(steps={"decode": 10}, decoded={"decode": 100}, seconds=0.2, held_s=0.05)
    assert loaded.engine_ms(PROFILE) == pytest.approx(150.0)
    # alone one sequence's step took 1 ms more: o + s = 1 and 10 o + 100 s = 50
    assert split_overheads(loaded, PROFILE, 1.0, 0.5) == (pytest.approx(5 / 9),
                                                          pytest.approx(4 / 9))
    # alone 0.2 ms more: per sequence alone already more than that, so nothing per step
    assert split_overheads(loaded, PROFILE, 0.2, 0.5) == (0.0, pytest.approx(0.5))
    # steps of one sequence cannot tell them apart: all of it per step
    single = StepTotals(steps={"decode": 10}, decoded={"decode": 10}, seconds=0.2)
    assert split_overheads(single, PROFILE, 1.0, 0.0) == (1.0, 0.0)
    # calibrated: TPOT alone still what it measured (6 + 1: o + s), a loaded step dearer
    calibrated, found = validate.calibrate(dep, w, Profiles(PROFILE),
                                           Latencies(35.0, 7.0, steps=loaded))
    assert found["step_overhead_ms"] + found["seq_overhead_ms"] == pytest.approx(1.0)
    assert found["seq_overhead_ms"] == pytest.approx((100 - 10) / 90)  # no contention: R = 100
    assert predict(dep, w, calibrated, 1e-3, count=8).tpot_p50_ms == pytest.approx(7.0)
    assert calibrated.default.decode_step_ms(10) == pytest.approx(5 + 10 * 2)
    # a profile that already has a cost per sequence: the gap alone is beyond it too
    priced = Profiles(replace(PROFILE, seq_overhead_ms=0.2))
    calibrated, _ = validate.calibrate(dep, w, priced, Latencies(35.0, 7.0, steps=replace(
        loaded, held_s=0.0)))  # 10 o + 100 s = 50 and o + s = 1
    assert predict(dep, w, calibrated, 1e-3, count=8).tpot_p50_ms == pytest.approx(7.0)


def test_a_workers_step_totals_are_read_from_its_metrics_text():
    text = "\n".join([
        'pdserve_engine_step_seconds_count{kind="decode"} 10.0',
        'pdserve_engine_step_seconds_sum{kind="decode"} 0.05',
        'pdserve_engine_step_seconds_count{kind="mixed"} 2.0',
        'pdserve_engine_step_seconds_sum{kind="mixed"} 0.03',
        'pdserve_engine_decoded_tokens_total{kind="decode"} 40.0',
        'pdserve_engine_decoded_tokens_total{kind="mixed"} 6.0',
        'pdserve_engine_context_tokens_total{kind="decode"} 4000.0',
        'pdserve_engine_prompt_tokens_total{kind="mixed"} 64.0',
        'pdserve_engine_prompt_attended_pairs_total{kind="mixed"} 2080.0',
        "pdserve_engine_held_seconds_total 0.01", ""])
    totals = parse(text)
    assert totals.num_steps == 12 and totals.num_decoded == 46
    assert totals.seconds == pytest.approx(0.08) and totals.held_s == pytest.approx(0.01)
    p = SimProfile(**{**PROFILE.__dict__, "decode_ms_per_attended_token": 0.001,
                      "prefill_ms_per_attended_token": 0.01, "step_overhead_ms": 0.5})
    # decode: 10 x (5 + 0.5) + 40 x 1 + 4000 x 0.001; mixed: 2 x (5 + 0.5) + 6 x 1 + 64 x 0.1
    # + 2080 x 0.01
    assert totals.engine_ms(p) == pytest.approx(55 + 40 + 4 + 11 + 6 + 6.4 + 20.8)
    later = replace(totals, steps={"decode": 15, "mixed": 2}, seconds=0.1)
    gone = later.minus(totals)
    assert gone.steps == {"decode": 5, "prefill": 0, "mixed": 0} and gone.num_decoded == 0
    assert gone.seconds == pytest.approx(0.02)


def test_step_overhead_is_paid_once_by_every_step():
    p = SimProfile(**{**PROFILE.__dict__, "step_overhead_ms": 0.7})
    assert p.prefill_ms(300) == pytest.approx(32.7)
    assert p.decode_step_ms(2) == pytest.approx(7.7)
    assert p.step_ms(2, 0, [(0, 100)]) == pytest.approx(5 + 10 + 2 + 0.7)


def test_the_routers_and_clients_cpu_slows_the_workers_on_a_shared_machine():
    w = Workload("fixed:300,10", arrivals="constant", num_requests=200)
    dep = Deployment("colocated", 0, 1)
    calibrated, found = validate.calibrate(dep, w, Profiles(PROFILE),
                                           Latencies(32.0, 6.0, cpu_ms_per_token=0.5), 2.0)
    assert found["shared_cpu_ms_per_token"] == 0.5 and found["shared_cores"] == 2.0
    # 10 req/s x 10 tokens x 0.5 ms of CPU = 50 ms per s of 2 cores: 2.5% (a prefill
    # worker's steps / 0.975); a decoding worker pays it per token: 0.25 ms a sequence a step
    assert calibrated.default.contention(100.0) == pytest.approx(0.025)
    assert calibrated.streaming_ms("colocated") == 0.25
    alone = predict(dep, w, PROFILE, 1.0)
    shared = predict(dep, w, calibrated, 1.0)  # one request at a time: steps of one sequence
    assert shared.tpot_p50_ms == pytest.approx(alone.tpot_p50_ms + 0.25)
    assert SimProfile().contention(1e6) == 0.0  # not modelled without shared_cores
    assert SimProfile(shared_cores=1, shared_cpu_ms_per_token=1).contention(1e6) == 0.9


def test_cpu_measured_beside_each_worker_slows_that_worker_only():
    """1P+1D pinned one core each: what the router, agents and client took on the prefill
    worker's core slows its prefills, what they took on the decode worker's its steps."""
    w = Workload("fixed:300,10", arrivals="constant", num_requests=200)
    dep = Deployment("disaggregated", 1, 1)
    profiles = Profiles(PROFILE, PROFILE, PROFILE)
    measured = Latencies(None, None, shared={"prefill": [2.0, 1.0], "decode": [0.5, 1.0]})
    calibrated, found = validate.calibrate(dep, w, profiles, measured, 2.0)
    assert found["prefill_shared_cpu_ms_per_token"] == 2.0
    assert found["decode_shared_cores"] == 1.0 and "shared_cores" not in found
    # 100 tokens per s: 200 ms of CPU per s on the prefill core, 50 on the decode core
    assert calibrated.contention("prefill", 100.0) == pytest.approx(0.2)
    assert calibrated.contention("decode", 100.0) == pytest.approx(0.05)
    assert calibrated.default.shared_cores == 0.0
    base = predict(dep, w, profiles, 10.0)
    slowed = predict(dep, w, calibrated, 10.0)
    # the decode worker's steps (one sequence each: a request is done before the next) pay
    # 0.5 ms a token; the prefill worker's core loses a share at the mean rate (100.5 tokens/s)
    assert slowed.tpot_p50_ms == pytest.approx(base.tpot_p50_ms + 0.5)
    # the prompt alone (32 ms) is computed 1 / 0.8 times slower; the handoff is not
    assert slowed.ttft_p50_ms - base.ttft_p50_ms == pytest.approx(32.0 / 0.8 - 32.0, rel=0.05)
    assert "beside the prefill worker 2.00 ms per token on its 1 core(s)" in validate.table(
        [{"config": "1P+1D", "rate": 10.0, "predicted": {"ttft_p50_ms": 1.0,
                                                          "tpot_p50_ms": 1.0},
          "measured": {"ttft_p50_ms": 1.0, "tpot_p50_ms": 1.0},
          "error": {"ttft_p50": 0.0, "tpot_p50": 0.0}, "within_target": True,
          "calibration": {"requests": 8, **found}}])


def test_on_shared_cores_a_requests_own_serving_time_stretches_with_the_workers_busy_share():
    from pdserve.plan.cluster import simulate
    from pdserve.plan.workload import Request

    dep = Deployment("colocated", 0, 1)
    requests = [Request(0, 0.0, 300, 10, 0), Request(1, 1000.0, 300, 10, 0)]
    own = replace(PROFILE, request_overhead_ms=10.0)
    apart = simulate(dep, requests, own)
    assert [o.ttft_ms for o in apart] == [pytest.approx(42.0)] * 2  # prompt 32 + overhead 10
    shared = simulate(dep, requests, replace(own, shared_cores=2.0))
    # the first token of the first: the worker busy all 32 ms so far, the overhead doubled;
    # of the second: busy 32 + 9 x 6 + 32 ms of 1,032, the overhead x (1 + 118 / 1032)
    assert shared[0].ttft_ms == pytest.approx(52.0)
    assert shared[1].ttft_ms == pytest.approx(42.0 + 10.0 * 118 / 1032)
    # the rest of the request comes as much later: TPOT as before
    assert [o.tpot_ms for o in shared] == [pytest.approx(o.tpot_ms) for o in apart]


def test_a_kind_without_its_own_shared_cpu_keeps_the_default_profiles():
    shared = SimProfile(shared_cpu_ms_per_token=1.0, shared_cores=2.0)
    profiles = Profiles(shared, PROFILE, None)
    assert profiles.contention("prefill", 100.0) == pytest.approx(0.05)
    assert profiles.contention("decode", 100.0) == pytest.approx(0.05)
    assert Profiles(PROFILE, shared).contention("prefill", 100.0) == pytest.approx(0.05)
    assert Profiles(PROFILE, shared).contention("decode", 100.0) == 0.0


def test_the_prefill_workers_own_time_alone_beyond_the_profile_is_their_step_overhead():
    w = Workload("fixed:300,10", num_requests=1000)
    dep = Deployment("disaggregated", 1, 1, chunk_size=128)  # 300 tokens: 3 steps
    profiles = Profiles(PROFILE)
    calibrated, found = validate.calibrate(dep, w, profiles,
                                           Latencies(45.0, 7.0, prefill_p50_ms=41.0))
    # the profile: 3 steps of 2 ms + 0.1 ms per token = 36 ms; 5 ms more: 5 / 3 per step
    assert found["prefill_step_overhead_ms"] == pytest.approx(5.0 / 3)
    assert calibrated.role("prefill").step_overhead_ms == pytest.approx(5.0 / 3)
    assert calibrated.role("decode").step_overhead_ms == pytest.approx(found["step_overhead_ms"])
    alone = predict(dep, replace(w, seed=w.seed + validate.CALIBRATION_SEED), calibrated,
                    validate.IDLE_RATE, count=validate.CALIBRATION_REQUESTS)
    assert alone.ttft_p50_ms == pytest.approx(45.0)  # the rest is the request overhead
    assert "prefill step 1.67 ms" in validate.table([{
        "config": "1P+1D", "rate": 1.0, "predicted": {"ttft_p50_ms": 1.0, "tpot_p50_ms": 1.0},
        "measured": {"ttft_p50_ms": 1.0, "tpot_p50_ms": 1.0},
        "error": {"ttft_p50": 0.0, "tpot_p50": 0.0}, "within_target": True,
        "calibration": {"requests": 8, **found}}])


def test_the_stacks_are_predicted_without_the_wake_the_engine_alone_showed():
    waking = replace(PROFILE, idle_wake_ms=4.0, idle_wake_half_ms=10.0)
    still = validate.without_wake(Profiles(waking, waking, None))
    assert still.default.idle_wake_ms == still.prefill.idle_wake_ms == 0.0
    assert still.decode is None and still.default.prefill_base_ms == PROFILE.prefill_base_ms
    alone = Latencies(20.0, 7.0)

    def run(dep, rate):
        return alone, [Latencies(30.0, 8.0)]

    dep, w, rate = Deployment("colocated", 0, 1), Workload("fixed:100,10"), 20.0
    out = validate.validate([dep], w, Profiles(waking), rate, 40, run)

    def predicted(profiles: Profiles) -> float | None:
        calibrated, _ = validate.calibrate(dep, w, profiles, alone)
        return predict(dep, w, calibrated, rate, count=40).ttft_p50_ms

    assert out[0]["predicted"]["ttft_p50_ms"] == pytest.approx(predicted(still))
    # charged, the wake would have changed the prediction (the calibration's requests wake
    # fully, the measured ones, arriving while others run, not all)
    assert abs(predicted(Profiles(waking)) - predicted(still)) > 0.5
