"""`pdserve bench serve`'s arithmetic: percentiles, SLOs and goodput, the interpolated highest
rate at 90% attainment, seeded workloads of exact token counts, and arrival processes."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics

import pytest
from pdserve.bench.loadgen import sessions
from pdserve.bench.loadgen.arrivals import Arrivals
from pdserve.bench.loadgen.interleave import measure
from pdserve.bench.loadgen.runner import Plan, run
from pdserve.bench.loadgen.stats import RequestRecord, Slo, max_rate_at, percentile, summarize
from pdserve.bench.loadgen.targets import Target
from pdserve.bench.loadgen.workload import Vocabulary, shapes

pytestmark = pytest.mark.unit


def record(i: int, ttft: float, e2e: float, tokens: int, ok: bool = True) -> RequestRecord:
    return RequestRecord(i, 10, tokens, output_tokens=tokens, ok=ok, ttft_ms=ttft, e2e_ms=e2e,
                         error="" if ok else "UNAVAILABLE: gone")


def test_percentiles_interpolate_between_ranks():
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99


def test_tpot_and_slo_checks():
    r = record(0, ttft=100, e2e=1000, tokens=10)
    assert r.tpot_ms == 100.0
    assert Slo(ttft_ms=100, tpot_ms=100).met(r)
    assert not Slo(ttft_ms=99).met(r) and not Slo(tpot_ms=99.9).met(r)
    assert not Slo(e2e_ms=999).met(r)
    assert Slo(tpot_ms=1).met(record(1, 10, 10, 1))  # one token: no TPOT to violate
    assert not Slo(ttft_ms=1e9).met(record(2, 1, 1, 5, ok=False))


@pytest.mark.parametrize("text, message", [
    ("", "needs at least one"), ("ttft", "is not ttft:MS"), ("itl:5", "is not ttft:MS"),
    ("ttft:fast", "'fast' is not a number"), ("tpot:0", "must be > 0")])
def test_bad_slos_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        Slo.parse(text)


def test_summary_counts_goodput_and_failures():
    records = [record(0, 50, 500, 10), record(1, 400, 900, 10), record(2, 60, 3000, 10),
               record(3, 10, 10, 0, ok=False)]
    s = summarize(records, duration_s=2.0, slo=Slo.parse("ttft:100,tpot:100"))
    assert (s["completed"], s["failed"], s["output_tokens"]) == (3, 1, 30)
    assert s["output_throughput"] == 15.0 and s["request_throughput"] == 1.5
    assert s["attainment"] == 0.25 and s["goodput"] == 0.5  # only request 0 meets both
    assert s["errors"] == {"UNAVAILABLE": 1}
    assert s["ttft_ms"]["p50"] == 60


def test_highest_rate_at_90_percent_is_interpolated():
    assert max_rate_at([1, 2, 4], [1.0, 0.95, 0.5]) == pytest.approx(2 + 2 * 0.05 / 0.45)
    assert max_rate_at([1, 2], [0.95, 0.92]) == 2  # never crossed: the highest measured
    assert max_rate_at([1, 2], [0.5, 0.4]) is None
    assert max_rate_at([4, 1, 2], [0.5, 1.0, 0.95]) == pytest.approx(2 + 2 * 0.05 / 0.45)


def test_workloads_are_seeded_and_shaped():
    assert shapes("fixed:256,128", 3, seed=1) == shapes("fixed:256,128", 3, seed=2)
    a, b = shapes("uniform:10-20,5-6", 50, seed=7), shapes("uniform:10-20,5-6", 50, seed=7)
    assert a == b and all(10 <= s.prompt_tokens <= 20 and 5 <= s.output_tokens <= 6 for s in a)
    mixed = shapes("mixed:128,2048,0.1,64", 2000, seed=3)
    share = sum(s.prompt_tokens == 2048 for s in mixed) / len(mixed)
    assert 0.07 < share < 0.13 and {s.output_tokens for s in mixed} == {64}
    chat = shapes("chat", 500, seed=4)
    lengths = [s.prompt_tokens for s in chat]
    assert max(lengths) > 3 * statistics.median(lengths)  # a long tail
    clipped = shapes("fixed:900,200", 2, seed=0, max_context=1024)
    assert all(s.prompt_tokens + s.output_tokens < 1024 for s in clipped)
    for bad in ("fixed:1", "zipf:1,2", "mixed:128,2048,2,64", "fixed:a,b"):
        with pytest.raises(ValueError, match="--workload"):
            shapes(bad, 1, seed=0)


def test_prompts_have_exact_lengths_and_no_special_tokens(tmp_path):
    (tmp_path / "tokenizer.json").write_text(json.dumps({
        "model": {"vocab": {f"t{i}": i for i in range(3, 50)}},
        "added_tokens": [{"id": 0, "special": True}, {"id": 1, "special": True},
                         {"id": 2, "special": False}]}))
    vocab = Vocabulary.from_model_dir(tmp_path)
    assert vocab.size == 50 and vocab.special_ids == {0, 1}
    prompt = vocab.prompt(300, random.Random(0))
    assert len(prompt) == 300 and not {0, 1} & set(prompt) and max(prompt) < 50


def test_arrivals():
    gaps = Arrivals.parse(None, 20.0, 1.0).gaps_s(4000, seed=1)
    assert statistics.mean(gaps) == pytest.approx(1 / 20, rel=0.05)
    assert gaps == Arrivals(rate=20.0).gaps_s(4000, seed=1)
    bursty = Arrivals(rate=20.0, burstiness=0.25).gaps_s(4000, seed=1)
    assert statistics.mean(bursty) == pytest.approx(1 / 20, rel=0.1)
    assert statistics.pstdev(bursty) > 1.5 * statistics.pstdev(gaps)
    for args, message in (((None, None, 1.0), "exactly one"), ((4, 2.0, 1.0), "exactly one"),
                          ((0, None, 1.0), "--concurrency=0"), ((None, -1.0, 1.0), "--rate=-1.0"),
                          ((None, 1.0, 0.0), "--burstiness=0.0")):
        with pytest.raises(ValueError, match=message):
            Arrivals.parse(*args)


class _Instant(Target):
    """Answers at once: the pacing of the arrivals is what is measured."""

    name = "instant"

    def send(self, record: RequestRecord, prompt_ids: list[int], max_tokens: int,
             timeout_s: float) -> None:
        record.ok, record.output_tokens, record.ttft_ms, record.e2e_ms = True, 1, 0.1, 0.1


def test_open_loop_arrivals_left_when_the_time_runs_out_are_not_sent_in_a_burst():
    # 40 req/s for 0.6 s: about 24 arrivals are due; the other 176 must not be sent at once.
    plan = Plan(shapes("fixed:4,1", 200, seed=0), Vocabulary(50, frozenset()),
                Arrivals(rate=40.0), warmup=0, max_duration_s=0.6)
    records, _ = run(_Instant(), plan, progress=False)
    sent = [r for r in records if r.ok]
    skipped = [r for r in records if r.error == "not sent: --max-duration reached"]
    assert len(sent) + len(skipped) == 200
    assert 5 <= len(sent) <= 60, f"{len(sent)} of 200 sent in 0.6 s at 40 req/s"
    assert all(r.sent_at_s < 0.6 for r in sent)


# ---- workloads that repeat themselves (prefix reuse) ------------------------------------
class _Echo(Target):
    """Answers with `max_tokens` ids, says it had everything but the new tokens cached, and
    keeps each prompt it got."""

    name = "echo"

    def __init__(self) -> None:
        self.prompts: list[list[int]] = []

    def send(self, record: RequestRecord, prompt_ids: list[int], max_tokens: int,
             timeout_s: float) -> None:
        self.prompts.append(list(prompt_ids))
        record.ok, record.ttft_ms, record.e2e_ms = True, 1.0 + record.turn, 2.0 + record.turn
        record.output_ids = [900 + len(self.prompts)] * max_tokens
        record.output_tokens = max_tokens
        record.cached_tokens = record.reusable_tokens


@pytest.mark.parametrize("rounds", [0, 1, 2])
def test_warm_up_prompts_are_not_the_measured_ones(rounds):
    # A warm-up that sent the first measured prompts put them in the server's prefix cache:
    # those requests then measured a cache hit. Same lengths, none of the same prompts.
    plan = Plan(shapes("fixed:64,2", 6, seed=3), Vocabulary(5000, frozenset()),
                Arrivals(concurrency=1), seed=3, warmup=2)
    echo = _Echo()
    if rounds:
        measure([echo], plan, rounds=rounds)
    else:
        run(echo, plan, progress=False)
    warm, measured = echo.prompts[:2], echo.prompts[2:]
    assert len(measured) == 6 and all(len(p) == 64 for p in echo.prompts)
    assert not [p for p in warm if p in measured]
    if rounds <= 1:  # and the measured prompts are the seed's, warm-up or not
        again = _Echo()
        run(again, dataclasses.replace(plan, warmup=0), progress=False)
        assert again.prompts == measured


@pytest.mark.parametrize("text, message", [("prefix:1,2", "3 or 4 numbers"),
                                           ("multiturn:2,x,3,4", "integers"),
                                           ("multiturn:0,1,2,3", "> 0")])
def test_reuse_workloads_name_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        sessions.parse(text)


def test_shared_prefix_requests_share_their_prefix_only():
    vocab = Vocabulary(500, frozenset())
    plan = sessions.sessions("prefix:64,8,4,2", 6, 0, vocab)
    prompts = [s.turns[0].new_ids for s in plan]
    assert len(plan) == 6 and all(len(p) == 72 for p in prompts)
    assert prompts[0][:64] == prompts[2][:64] != prompts[1][:64]
    assert len({tuple(p[64:]) for p in prompts}) == 6


def test_multi_turn_resends_the_history_with_the_answers_in_order():
    vocab = Vocabulary(500, frozenset())
    plan = sessions.sessions("multiturn:3,40,20,5", 6, 1, vocab)
    assert len(plan) == 2 and [len(t.new_ids) for t in plan[0].turns] == [40, 20, 20]
    target = _Echo()
    records, _ = sessions.run_sessions(target, plan, 1, 10.0, 60.0)
    assert [r.turn for r in records] == [0, 1, 2, 0, 1, 2]
    first, second, third = target.prompts[:3]
    assert second[:40] == first and second[40:45] == [901] * 5 and len(second) == 65
    assert third[:65] == second and len(third) == 90
    # A perfect cache: turn 2 shares 44 computed tokens (2 pages), turn 3 69 (4 pages).
    assert [r.reusable_tokens for r in records[:3]] == [0, 32, 64]
    summary = summarize(records, 1.0)
    assert summary["cache_vs_perfect"] == 1.0
    assert summary["ttft_by_turn_ms"][2]["p50"] == 3.0
    assert summary["cache_hit_rate"] == pytest.approx(192 / (2 * (40 + 65 + 90)))
