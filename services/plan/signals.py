"""The autoscaling signals a deployment would show: what the HPAs of
`deploy/k8s/components/autoscaling/hpa.yaml` read, predicted by `pdserve plan`'s simulator.

Every signal is the pool's average per pod, as an HPA's `AverageValue` target reads it, sampled
at `samples` evenly spaced times between the first and the last arrival (the open loop's steady
load; the drain after the last arrival is left out), then averaged over time (`mean`) and its
p90 over time (`p90`):

- prefill pool (the prefill workers; co-located: every worker): `pdserve_waiting_sequences`
  (prompts not fully computed) and `pdserve_queued_prompt_tokens` (their tokens still to
  compute);
- decode pool (decode or co-located workers): `pdserve_running_sequences` (the running batch,
  those joining it included) and `pdserve_kv_pages_used_ratio` (pages of the running and
  waiting sequences' tokens and of the reservations' prompts, over the profile's `num_pages`;
  the simulator does not run out of pages, so above 1 means a real worker would have refused
  or preempted);
- `pdserve_ttft_p90_seconds`: the p90 TTFT of the requests served (the router's histogram).

A gauge is compared with its threshold by its time average, the TTFT by its p90; `crossing`
is the first rate of a ladder at which a signal is above its threshold, beside the first one
at which SLO attainment falls below its target.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.plan.cluster import Deployment, Profiles, _Router, simulate
from pdserve.plan.engine_model import EngineSim, Events
from pdserve.plan.report import Ranked
from pdserve.plan.search import Slo, percentile, summarize
from pdserve.plan.workload import Workload

HPA_PATH = Path(__file__).resolve().parents[2] / "deploy/k8s/components/autoscaling/hpa.yaml"
LADDER = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.25, 1.5)  # x the configuration's goodput
WAITING, QUEUED, TTFT = ("pdserve_waiting_sequences", "pdserve_queued_prompt_tokens",
                         "pdserve_ttft_p90_seconds")
RUNNING, KV_RATIO = "pdserve_running_sequences", "pdserve_kv_pages_used_ratio"
SIGNALS = (WAITING, QUEUED, TTFT, RUNNING, KV_RATIO)
POOL = {WAITING: "prefill", QUEUED: "prefill", TTFT: "prefill", RUNNING: "decode",
        KV_RATIO: "decode"}
SHORT = {WAITING: "waiting seqs", QUEUED: "queued tokens", TTFT: "TTFT p90 s",
         RUNNING: "running seqs", KV_RATIO: "KV pages used"}


@dataclass(frozen=True)
class Threshold:
    """One metric of one HPA: scale `pool` up when `metric` is above `target`."""

    pool: str     # the Deployment the HPA scales
    metric: str
    kind: str     # Pods (a per-pod average) or External
    target: float


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity as a number: '500m' 0.5, '2' 2, '4k' 4000, '1Ki' 1024."""
    s = str(text).strip()
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "Ki": 1024.0, "Mi": 1024.0 ** 2,
                "Gi": 1024.0 ** 3}
    for suffix in sorted(suffixes, key=len, reverse=True):
        if s.endswith(suffix):
            return float(s[:-len(suffix)]) * suffixes[suffix]
    return float(s)


def read_thresholds(path: Path = HPA_PATH) -> list[Threshold]:
    """Every metric target of the HorizontalPodAutoscalers in `path`, in file order."""
    import yaml

    out: list[Threshold] = []
    for doc in yaml.safe_load_all(path.read_text()):
        if not doc or doc.get("kind") != "HorizontalPodAutoscaler":
            continue
        pool = doc["spec"]["scaleTargetRef"]["name"]
        for metric in doc["spec"].get("metrics", []):
            kind = metric["type"]
            body = metric[kind[0].lower() + kind[1:]]
            target = body["target"]
            value = target.get("averageValue", target.get("value"))
            if value is None:
                raise ValueError(f"{path}: {pool}: {body['metric']['name']}: no averageValue "
                                 "or value target")
            out.append(Threshold(pool, body["metric"]["name"], kind, quantity(value)))
    return out


def _p90(values: Sequence[float]) -> float:
    return percentile(values, 90) or 0.0


class _Sampler:
    """Reads the pools' gauges at evenly spaced times. The events are not quiet, though they
    touch no engine: a decode engine's steps taken ahead (`EngineSim._decode_ahead`) stop at
    each, so its sequences' lengths are the ones of the sample's time."""

    def __init__(self, start_ms: float, end_ms: float, samples: int, num_pages: int,
                 block_size: int, prompts: dict[int, int]):
        self.times = [start_ms + (end_ms - start_ms) * (i + 0.5) / samples
                      for i in range(samples)] if end_ms > start_ms else []
        self.num_pages, self.block_size, self.prompts = num_pages, block_size, prompts
        self.series: dict[str, list[float]] = {name: [] for name in SIGNALS if name != TTFT}

    def __call__(self, events: Events, router: _Router) -> None:
        for t in self.times:
            events.at(t, self._sample, router)

    def _pages(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _sample(self, router: _Router) -> None:
        decoders = list(router.decoders.values())
        prefillers = list(router.prefillers.values()) or decoders
        reserved = dict.fromkeys(router.decoders, 0)
        for index in router.prefiller_of:  # reserved on a decode worker, prompt not landed yet
            reserved[router.decoder_of[index].name] += self._pages(self.prompts[index])
        self.series[WAITING].append(sum(len(e.waiting) for e in prefillers) / len(prefillers))
        self.series[QUEUED].append(sum(e.queued_prompt_tokens for e in prefillers)
                                   / len(prefillers))
        self.series[RUNNING].append(sum(len(e.running) + len(e.joining) for e in decoders)
                                    / len(decoders))
        self.series[KV_RATIO].append(sum(self._used(e) + reserved[e.name] for e in decoders)
                                     / (len(decoders) * self.num_pages))

    def _used(self, engine: EngineSim) -> int:
        pages = 0
        for job in engine.running:  # tokens so far: its last step gives the last one
            left = max(0, job.finish_step - engine.steps)
            pages += self._pages(job.prompt_tokens + max(1, job.output_tokens - 1 - left))
        pages += sum(self._pages(job.prompt_tokens + 1) for job in engine.joining)
        pages += sum(self._pages(job.computed) for job in engine.waiting)
        return pages


@dataclass(frozen=True)
class Signals:
    """One rate's signals: `mean` (time average; TTFT: its p90) and `p90` over time."""

    rate: float
    factor: float                  # rate / the configuration's goodput
    attainment: float
    mean: dict[str, float] = field(default_factory=dict)
    p90: dict[str, float] = field(default_factory=dict)

    def value(self, metric: str) -> float:
        return self.mean[metric]

    def as_dict(self) -> dict[str, Any]:
        return {"rate": self.rate, "x_goodput": self.factor, "attainment": self.attainment,
                "mean": self.mean, "p90": self.p90}


def measure(dep: Deployment, workload: Workload, profile: Profiles, rate: float, slo: Slo,
            factor: float = 0.0, samples: int = 200) -> Signals:
    """The signals of `dep` serving `workload` at `rate` (one full run)."""
    requests = workload.requests(rate, dep.workers)
    decode = profile.role("colocated" if dep.mode == "colocated" else "decode")
    sampler = _Sampler(requests[0].arrival_ms, requests[-1].arrival_ms, samples,
                       decode.num_pages, decode.block_size,
                       {r.index: r.prompt_tokens for r in requests})
    outcomes = simulate(dep, requests, profile, watch=sampler)
    point = summarize(rate, outcomes, slo)
    ttfts = [o.ttft_ms / 1e3 for o in outcomes if o.ok and o.ttft_ms is not None]
    mean = {name: sum(v) / len(v) if v else 0.0 for name, v in sampler.series.items()}
    p90 = {name: _p90(v) for name, v in sampler.series.items()}
    mean[TTFT] = p90[TTFT] = _p90(ttfts)
    return Signals(rate, factor, point.attainment, mean, p90)


def ladder(dep: Deployment, workload: Workload, profile: Profiles, goodput: float, slo: Slo,
           factors: Sequence[float] = LADDER, samples: int = 200) -> list[Signals]:
    return [measure(dep, workload, profile, k * goodput, slo, k, samples) for k in factors]


def crossings(rows: Sequence[Signals], thresholds: Sequence[Threshold]
              ) -> dict[str, Signals | None]:
    """Each threshold's metric: the first row whose signal is above the target (None: none)."""
    out: dict[str, Signals | None] = {}
    for t in thresholds:
        if t.metric in SIGNALS:
            out[t.metric] = next((r for r in rows if r.value(t.metric) > t.target), None)
    return out


def _cell(value: float) -> str:
    return f"{value:.3g}" if value < 10 else f"{value:.0f}"


def table(dep: Deployment, goodput: float, rows: Sequence[Signals],
          thresholds: Sequence[Threshold], slo: Slo) -> str:
    """The signals by rate, each above its HPA threshold marked `*`, and where each crosses."""
    target = {t.metric: t.target for t in thresholds}
    metrics = [m for m in SIGNALS if m in target]
    header = ["x goodput", "req/s", "SLO met"] + \
        [f"{SHORT[m]} ({POOL[m][0].upper()})" for m in metrics]
    lines = [header, ["HPA target", "", f">= {slo.attainment:.0%}"] +
             [_cell(target[m]) for m in metrics]]
    for r in rows:
        lines.append([f"{r.factor:g}x", f"{r.rate:.2f}", f"{r.attainment:.0%}"] +
                     [_cell(r.value(m)) + ("*" if r.value(m) > target[m] else " ")
                      for m in metrics])
    widths = [max(len(row[c]) for row in lines) for c in range(len(header))]
    text = ["  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in lines]
    text.insert(1, "-" * len(text[0]))
    missed = next((r for r in rows if r.attainment < slo.attainment), None)
    out = [f"autoscaling signals of {dep.name} (goodput {goodput:.2f} req/s), per pod: "
           "gauges averaged over the run, TTFT its p90; * above the HPA's target", *text, ""]
    for metric, row in crossings(rows, thresholds).items():
        at = f"crosses {target[metric]:g} at {row.factor:g}x goodput" if row else \
            f"stays under {target[metric]:g} up to {rows[-1].factor:g}x goodput"
        out.append(f"{metric}: {at}")
    out.append(f"SLO attainment below {slo.attainment:.0%}: " +
               (f"from {missed.factor:g}x goodput" if missed else "not in this range"))
    return "\n".join(out)


def as_json(dep: Deployment, goodput: float, rows: Sequence[Signals],
            thresholds: Sequence[Threshold], hpa: Path) -> dict[str, Any]:
    cross = crossings(rows, thresholds)
    return {"config": dep.name, "goodput_rps": goodput, "hpa": str(hpa),
            "thresholds": [{"pool": t.pool, "metric": t.metric, "kind": t.kind,
                            "target": t.target, "crosses_at_x_goodput":
                            row.factor if (row := cross.get(t.metric)) else None}
                           for t in thresholds],
            "rates": [r.as_dict() for r in rows]}


def add_to_json(path: Path, doc: dict[str, Any]) -> None:
    """Put the signals into `plan --json`'s file (written already) under 'signals'."""
    data = json.loads(path.read_text())
    data["signals"] = doc
    path.write_text(json.dumps(data, indent=1))


def report(ranked: Sequence[Ranked], config: str, workload: Workload, profile: Profiles,
           slo: Slo, hpa: Path = HPA_PATH, json_path: Path | None = None) -> str:
    """`pdserve plan --signals`: the ladder of the best configuration of `ranked` (or the one
    named `config`) as a table; added to `json_path` when given."""
    thresholds = read_thresholds(hpa)
    chosen = [r for r in ranked if r.goodput_rps > 0 and (not config or
                                                          r.deployment.name == config)]
    if not chosen:
        names = ", ".join(repr(r.deployment.name) for r in ranked)
        raise ValueError(f"no configuration {config!r} with a goodput among {names}" if config
                         else "no configuration meets the SLOs at any rate")
    best = chosen[0]
    rows = ladder(best.deployment, workload, profile, best.goodput_rps, slo)
    if json_path is not None:
        add_to_json(json_path, as_json(best.deployment, best.goodput_rps, rows, thresholds, hpa))
    return table(best.deployment, best.goodput_rps, rows, thresholds, slo)
