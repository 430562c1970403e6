"""What `pdserve plan` prints and writes: the ranking table, its JSON and the attainment plot."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.plan.cluster import Deployment, Profiles
from pdserve.plan.search import Point, Slo
from pdserve.plan.workload import Workload
from pdserve.sim.profile import SimProfile

RANK_BY = ("worker", "device", "total")


@dataclass
class Ranked:
    """One configuration's result: goodput, the prediction at it, attainment by rate."""

    deployment: Deployment
    goodput_rps: float
    devices: float
    at_goodput: Point | None = None  # the whole run at the goodput rate
    curve: list[Point] = field(default_factory=list)  # at the rates asked for, or a grid

    @property
    def per_worker(self) -> float:
        return self.goodput_rps / self.deployment.workers

    @property
    def per_device(self) -> float:
        return self.goodput_rps / self.devices

    def as_dict(self) -> dict[str, object]:
        at = self.at_goodput
        return {
            "config": self.deployment.name,
            "deployment": dataclasses.asdict(self.deployment),
            "workers": self.deployment.workers, "devices": self.devices,
            "goodput_rps": self.goodput_rps, "goodput_per_worker": self.per_worker,
            "goodput_per_device": self.per_device,
            "predicted": at.as_dict() if at is not None else None,
            "curve": [p.as_dict() for p in self.curve],
        }


def rank(results: Sequence[Ranked], by: str) -> list[Ranked]:
    """Best first: goodput per worker (or per device, or in all), then more goodput, then
    fewer workers."""
    def key(r: Ranked) -> tuple[float, float, int]:
        score = {"worker": r.per_worker, "device": r.per_device, "total": r.goodput_rps}[by]
        return -score, -r.goodput_rps, r.deployment.workers
    return sorted(results, key=key)


def tp_note(profile: SimProfile, tps: Sequence[int]) -> str:
    if all(tp == 1 for tp in tps):
        return ""
    if profile.tp_efficiency == 0:
        return "TP: not modelled (the profile's tp_efficiency is 0): a worker of TP N steps as " \
               "fast as one of TP 1 and counts N times the devices; pdserve has no tensor " \
               "parallelism yet"
    return f"TP: modelled as a speedup of 1 + {profile.tp_efficiency:g} (N - 1) on every step " \
           "(the profile's tp_efficiency), handoffs unchanged; pdserve has no tensor " \
           "parallelism yet"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def table(ranked: Sequence[Ranked], need_rps: float | None = None) -> str:
    header = ["rank", "config", "workers", "devices", "goodput req/s", "/worker", "/device",
              "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    if need_rps:
        header.append(f">= {need_rps:g} req/s")
    rows = [header]
    for i, r in enumerate(ranked, 1):
        at = r.at_goodput
        row = [str(i), r.deployment.name, str(r.deployment.workers), f"{r.devices:g}",
               f"{r.goodput_rps:.2f}", f"{r.per_worker:.2f}", f"{r.per_device:.2f}",
               _ms(at.ttft_p50_ms if at else None), _ms(at.ttft_p99_ms if at else None),
               _ms(at.tpot_p50_ms if at else None), _ms(at.tpot_p99_ms if at else None)]
        if need_rps:
            row.append("yes" if r.goodput_rps >= need_rps else "no")
        rows.append(row)
    widths = [max(len(row[c]) for row in rows) for c in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if c == 1 else cell.rjust(w)
                       for c, (cell, w) in enumerate(zip(row, widths))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines) + "\n(latencies in ms, predicted at each configuration's goodput)"


def write_json(path: Path, ranked: Sequence[Ranked], *, profiles: Profiles,
               profile_paths: dict[str, str], workload: Workload, slo: Slo, rank_by: str,
               notes: Sequence[str]) -> None:
    doc = {
        "profile": dataclasses.asdict(profiles.default),
        "prefill_profile": dataclasses.asdict(profiles.prefill) if profiles.prefill else None,
        "decode_profile": dataclasses.asdict(profiles.decode) if profiles.decode else None,
        "profile_paths": {k: v for k, v in profile_paths.items() if v},
        "workload": {"workload": workload.spec, "arrivals": workload.arrivals,
                     "prefix_share": workload.prefix_share,
                     "num_requests": workload.num_requests, "seed": workload.seed},
        "slo": dataclasses.asdict(slo), "rank_by": rank_by, "notes": list(notes),
        "configs": [r.as_dict() for r in ranked],
    }
    path.write_text(json.dumps(doc, indent=1))


def plot(path: Path, ranked: Sequence[Ranked], slo: Slo) -> bool:
    """Attainment vs rate of each ranked configuration's curve; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in ranked:
        if r.curve:
            ax.plot([p.rate for p in r.curve], [100 * p.attainment for p in r.curve],
                    marker="o", markersize=3, label=f"{r.deployment.name} "
                    f"({r.goodput_rps:.2f} req/s)")
    ax.axhline(100 * slo.attainment, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%), predicted")
    ax.set_title(slo.describe(), fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
