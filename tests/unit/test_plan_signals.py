"""`pdserve plan --signals`: the HPA's metrics as the simulator predicts them. They grow with
the rate, all sit under the HPA's thresholds at low load, and past goodput the pool that is the
bottleneck shows it (the prefill queue or TTFT for long prompts, the decode batch or its pages
for long outputs); the thresholds are the real hpa.yaml's, and its metrics are pdserve's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from pdserve.plan import command, signals
from pdserve.plan.cluster import Deployment, Profiles, simulate
from pdserve.plan.search import Slo, find_goodput
from pdserve.plan.signals import KV_RATIO, QUEUED, RUNNING, TTFT, WAITING, Signals
from pdserve.plan.workload import Workload
from pdserve.sim.profile import SimProfile

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
HPA = ROOT / "deploy" / "k8s" / "components" / "autoscaling" / "hpa.yaml"
ADAPTER = HPA.parent / "prometheus-adapter-rules.yaml"
PROFILES = Profiles(SimProfile())  # the built-in profile: bench-7m, 2-vCPU Zen 5
SLO = Slo(500.0, 50.0, 0.9)
DEP = Deployment("disaggregated", 1, 1)
PREFILL_BOUND = "fixed:1024,16"   # long prompts, a few tokens out
DECODE_BOUND = "fixed:256,1024"   # long outputs: hundreds of sequences decode at once


def ladder(spec: str) -> list[Signals]:
    workload = Workload(spec, num_requests=200)
    goodput = find_goodput(DEP, workload, PROFILES, SLO).rate
    assert goodput > 0
    return signals.ladder(DEP, workload, PROFILES, goodput, SLO)


@pytest.fixture(scope="module")
def prefill_bound() -> list[Signals]:
    return ladder(PREFILL_BOUND)


@pytest.fixture(scope="module")
def decode_bound() -> list[Signals]:
    return ladder(DECODE_BOUND)


@pytest.fixture(scope="module")
def target() -> dict[str, float]:
    return {t.metric: t.target for t in signals.read_thresholds()}


def first_miss(rows: list[Signals]) -> Signals:
    missed = [r for r in rows if r.attainment < SLO.attainment]
    assert missed, "the ladder goes past goodput: attainment falls below the target"
    assert missed[0].factor > 1.0 - 1e-9
    return missed[0]


def test_quantities():
    assert signals.quantity("500m") == pytest.approx(0.5)
    assert signals.quantity("2") == 2.0
    assert signals.quantity("4096") == 4096.0
    assert signals.quantity("1Ki") == 1024.0
    assert signals.quantity(64) == 64.0


def test_thresholds_are_the_real_hpa_yamls():
    got = signals.read_thresholds()
    want = []
    for doc in yaml.safe_load_all(HPA.read_text()):
        for m in doc["spec"]["metrics"]:
            body = m["pods"] if m["type"] == "Pods" else m["external"]
            value = body["target"].get("averageValue", body["target"].get("value"))
            want.append((doc["spec"]["scaleTargetRef"]["name"], body["metric"]["name"],
                         signals.quantity(value)))
    assert [(t.pool, t.metric, t.target) for t in got] == want
    assert signals.HPA_PATH == HPA
    # every metric the HPAs read is one the simulator predicts, for the pool it scales
    assert {t.metric: t.pool for t in got} == signals.POOL


def test_hpa_metrics_are_exported_by_pdserve():
    """Each HPA metric is a gauge of services/common/metrics.py, or a prometheus-adapter rule's
    name for a query over such metrics."""
    source = (ROOT / "services" / "common" / "metrics.py").read_text()
    defined = set(re.findall(r'"(pdserve_[a-z0-9_]+)"', source))
    rules = yaml.safe_load(ADAPTER.read_text())["rules"]
    derived: dict[str, set[str]] = {}
    for rule in rules["custom"] + rules["external"]:
        base = set(re.findall(r"\bpdserve_[a-z0-9_]+", rule["seriesQuery"]
                              + rule["metricsQuery"]))
        name = rule["name"]["as"]
        derived[base.pop() if name == "${1}" and len(base) == 1 else name] = base
    for t in signals.read_thresholds():
        if t.metric in defined:
            continue
        assert t.metric in derived, f"{t.metric}: neither exported nor served by the adapter"
        histograms = {re.sub(r"_bucket$", "", s) for s in derived[t.metric]}
        assert histograms <= defined, f"{t.metric}: from {histograms - defined}, not exported"


def test_signals_grow_with_the_rate(prefill_bound, decode_bound):
    def rising(rows: list[Signals], metric: str) -> None:
        values = [r.value(metric) for r in rows]
        assert all(b >= a * 0.97 for a, b in zip(values, values[1:])), (metric, values)
        assert values[-1] > 2 * values[0], (metric, values)

    for metric in (WAITING, QUEUED, TTFT):
        rising(prefill_bound, metric)
    for metric in (RUNNING, KV_RATIO):
        rising(decode_bound, metric)
    for rows in (prefill_bound, decode_bound):  # up to goodput, every signal grows
        for metric in signals.SIGNALS:
            values = [r.value(metric) for r in rows if r.factor <= 1.0]
            assert all(b >= a * 0.97 for a, b in zip(values, values[1:])), (metric, values)


def test_low_load_is_under_every_threshold(prefill_bound, decode_bound, target):
    for rows in (prefill_bound, decode_bound):
        low = rows[0]
        assert low.factor == 0.25 and low.attainment == 1.0
        for metric, limit in target.items():
            assert low.value(metric) < limit, (metric, low.value(metric), limit)


def test_prefill_bound_crosses_the_prefill_thresholds(prefill_bound, target):
    miss = first_miss(prefill_bound)
    assert any(miss.value(m) > target[m] for m in (WAITING, QUEUED, TTFT)), miss
    assert miss.value(RUNNING) < target[RUNNING]  # decode has little to do
    assert max(r.value(RUNNING) for r in prefill_bound) < target[RUNNING]


def test_decode_bound_crosses_the_decode_thresholds(decode_bound, target):
    miss = first_miss(decode_bound)
    assert miss.value(RUNNING) > target[RUNNING] or miss.value(KV_RATIO) > target[KV_RATIO]
    for metric in (WAITING, QUEUED, TTFT):  # prefill keeps up: no prefill pod is added
        assert max(r.value(metric) for r in decode_bound) < target[metric], metric


def test_kv_pages_count_reservations_and_contexts():
    """One sequence of 256 + 1024 tokens alone on a pool of 100 pages of 16 tokens: its pages
    are the prompt's 16 from its reservation on, and grow one page per 16 tokens decoded to 80
    (256 + 1023 tokens: its last one has no KV yet); no sequence waits for prefill then."""
    requests = Workload("fixed:256,1024", arrivals="constant", num_requests=2).requests(0.1)
    sampler = signals._Sampler(0.0, requests[0].arrival_ms + 10_000.0, 20_000, 100, 16,
                               {r.index: r.prompt_tokens for r in requests})
    simulate(DEP, requests[:1], PROFILES, watch=sampler)
    kv = sampler.series[KV_RATIO]
    busy = [v for v in kv if v > 0]
    assert busy[0] == pytest.approx(0.16) and max(kv) == pytest.approx(0.80)
    assert all(b >= a for a, b in zip(busy, busy[1:])) and len(set(busy)) == 80 - 16 + 1
    assert max(sampler.series[RUNNING]) == 1.0 and max(sampler.series[WAITING]) == 1.0
    assert max(sampler.series[QUEUED]) == 256.0
    assert kv[-1] == 0.0  # ended: its pages are free again


def test_plan_signals_prints_and_writes_json(tmp_path, capsys):
    hpa = tmp_path / "hpa.yaml"
    hpa.write_text(HPA.read_text().replace('averageValue: "64"', 'averageValue: "7"'))
    out = tmp_path / "plan.json"
    argv = ["--workload", "fixed:256,64", "--max-workers", "2", "--modes", "disaggregated",
            "--num-requests", "100", "--no-progress", "--signals", "--hpa", str(hpa),
            "--json", str(out)]
    assert command.main(argv) == 0
    text = capsys.readouterr().out
    assert "autoscaling signals of 1P+1D chunk 512" in text
    assert "pdserve_running_sequences: crosses 7 at" in text
    doc = json.loads(out.read_text())["signals"]
    assert doc["config"] == "1P+1D chunk 512" and doc["hpa"] == str(hpa)
    assert [r["x_goodput"] for r in doc["rates"]] == list(signals.LADDER)
    running = next(t for t in doc["thresholds"] if t["metric"] == RUNNING)
    assert running["target"] == 7.0 and running["crosses_at_x_goodput"] is not None
    assert command.main(argv + ["--signals-config", "2P+9D chunk 512"]) == 1
    assert "no configuration '2P+9D chunk 512'" in capsys.readouterr().err


def test_sampling_leaves_the_prediction_unchanged():
    workload = Workload("fixed:256,512", num_requests=100)
    for rate in (5.0, 40.0):
        requests = workload.requests(rate, DEP.workers)
        plain = simulate(DEP, requests, PROFILES)
        sampler = signals._Sampler(requests[0].arrival_ms, requests[-1].arrival_ms, 500,
                                   4096, 16, {r.index: r.prompt_tokens for r in requests})
        watched = simulate(DEP, requests, PROFILES, watch=sampler)
        assert [(o.ok, o.workers) for o in watched] == [(o.ok, o.workers) for o in plain]
        assert [o.ttft_ms for o in watched] == pytest.approx([o.ttft_ms for o in plain])
        assert [o.e2e_ms for o in watched] == pytest.approx([o.e2e_ms for o in plain])
        assert len(sampler.series[RUNNING]) == 500
