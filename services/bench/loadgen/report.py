"""A run's results as a terminal table, as JSON (every record and the summaries) and as PNG
plots (latency CDFs, the TTFT breakdown, SLO attainment against rate)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.loadgen.stats import RequestRecord

ROWS = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E"))


def _ms(value: object) -> str:
    return "-" if value is None else f"{float(value):,.1f}"  # type: ignore[arg-type]


def _spread(per_worker: dict[str, int] | None) -> str:
    """The busiest worker's requests over the mean, per role (prefill, decode)."""
    if not per_worker:
        return "-"
    out = []
    for role in ("prefill", "decode", "colocated"):
        counts = [n for w, n in per_worker.items() if w.startswith(role)]
        if len(counts) > 1:
            out.append(f"{role[0]} {max(counts) / (sum(counts) / len(counts)):.2f}x")
    return ", ".join(out) or "one worker"


def table(results: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One column per target: throughput, latency p50/p90/p99, goodput; ratios to the first."""
    names = [name for name, _ in results]
    width = max(24, *(len(n) + 2 for n in names))
    lines = ["".ljust(26) + "".join(n.rjust(width) for n in names)]

    def row(label: str, cells: list[str]) -> None:
        lines.append(label.ljust(26) + "".join(c.rjust(width) for c in cells))

    row("completed / failed", [f"{s['completed']} / {s['failed']}" for _, s in results])
    row("output tok/s", [f"{s['output_throughput']:,.1f}" for _, s in results])
    row("requests/s", [f"{s['request_throughput']:,.2f}" for _, s in results])
    for key, label in ROWS:
        for q in ("p50", "p90", "p99"):
            row(f"{label} {q} ms", [_ms(s[key][q]) for _, s in results])
    if any("components_ms" in s for _, s in results):
        for part in ("queue_ms", "prefill_ms", "kv_transfer_ms", "decode_start_ms"):
            row(f"{part.removesuffix('_ms')} p50 ms",
                [_ms(s.get("components_ms", {}).get(part, {}).get("p50")) for _, s in results])
    if any("ttft_ms" in s.get("components_ms", {}) for _, s in results):
        row("ttft (server) p50 ms", [_ms(s.get("components_ms", {}).get("ttft_ms", {})
                                         .get("p50")) for _, s in results])
    for key, label in (("server_cpu_ms_per_token", "server CPU ms/token"),
                       ("client_cpu_ms_per_token", "client CPU ms/token")):
        if any(s.get(key) is not None for _, s in results):
            row(label, ["-" if s.get(key) is None else f"{s[key]:,.3f}" for _, s in results])
    if any("cache_hit_rate" in s for _, s in results):
        row("server cache hit", ["-" if "cache_hit_rate" not in s else
                                 f"{s['cache_hit_rate']:.1%}" for _, s in results])
    if any("cache_vs_perfect" in s for _, s in results):
        row("cached / perfect cache", ["-" if "cache_vs_perfect" not in s else
                                       f"{s['cache_vs_perfect']:.1%}" for _, s in results])
    if any("requests_per_worker" in s for _, s in results):
        row("max worker / mean", [_spread(s.get("requests_per_worker")) for _, s in results])
    turns = sorted({int(t) for _, s in results for t in s.get("ttft_by_turn_ms", {})})
    for t in turns:
        row(f"TTFT p50 turn {t + 1} ms", [_ms(s.get("ttft_by_turn_ms", {}).get(t, {}).get("p50"))
                                          for _, s in results])
    if any("goodput" in s for _, s in results):
        row("SLO attainment", [f"{s.get('attainment', 0):.1%}" for _, s in results])
        row("goodput req/s", [f"{s.get('goodput', 0):,.2f}" for _, s in results])
    if len(results) > 1:
        base = results[0][1]
        lines.append("")
        lines.append(f"ratios to {names[0]}:")
        for key, label in (("output_throughput", "output tok/s"), ("goodput", "goodput")):
            if base.get(key):
                row(f"  {label}", [f"{s.get(key, 0) / base[key]:.2f}x" for _, s in results])
        for key, q, label in (("ttft_ms", "p50", "TTFT p50"), ("ttft_ms", "p99", "TTFT p99"),
                              ("itl_ms", "p99", "ITL p99")):
            b = base[key][q]
            if b:
                row(f"  {label}", ["-" if s[key][q] is None else f"{s[key][q] / b:.2f}x"
                                   for _, s in results])
        b = base["ttft_ms"]["p50"]
        if b is not None:
            row("  TTFT p50 difference ms", ["-" if s["ttft_ms"]["p50"] is None else
                                             f"{s['ttft_ms']['p50'] - b:+.2f}"
                                             for _, s in results])
        b = base.get("server_cpu_ms_per_token")
        if b:
            row("  server CPU per token", [f"{s['server_cpu_ms_per_token'] / b:.2f}x"
                                           if s.get("server_cpu_ms_per_token") else "-"
                                           for _, s in results])
    return "\n".join(lines)


def write_json(path: Path, meta: dict[str, Any],
               runs: Sequence[tuple[str, dict[str, Any], list[RequestRecord]]]) -> None:
    doc = {**meta, "runs": [{"target": name, "summary": summary,
                              "records": [dataclasses.asdict(r) for r in records]}
                             for name, summary, records in runs]}
    path.write_text(json.dumps(doc, indent=1))


def plots(prefix: Path, runs: Sequence[tuple[str, dict[str, Any], list[RequestRecord]]],
          sweep: Sequence[tuple[str, list[float], list[float]]] = ()) -> list[Path]:
    """PNG files next to `prefix`; [] (with no error) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written: list[Path] = []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, (key, label) in zip(axes, (("ttft", "TTFT"), ("itl", "ITL"), ("e2e", "E2E"))):
        for name, _, records in runs:
            if key == "itl":
                values = sorted(g for r in records if r.ok for g in r.itl_ms)
            else:
                values = sorted(v for r in records if r.ok
                                if (v := getattr(r, f"{key}_ms")) is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=name)
        ax.set_xlabel(f"{label} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    written.append(prefix.with_name(prefix.name + "-latency-cdf.png"))
    fig.savefig(written[-1], dpi=100)
    plt.close(fig)
    parts = ("queue_ms", "prefill_ms", "kv_transfer_ms", "decode_start_ms")
    with_parts = [(n, s) for n, s, _ in runs if "components_ms" in s]
    if with_parts:
        fig, ax = plt.subplots(figsize=(max(5, 2 * len(with_parts)), 4))
        bottoms = [0.0] * len(with_parts)
        for part in parts:
            heights = [s["components_ms"].get(part, {}).get("p50") or 0.0 for _, s in with_parts]
            ax.bar([n for n, _ in with_parts], heights, bottom=bottoms,
                   label=part.removesuffix("_ms"))
            bottoms = [b + h for b, h in zip(bottoms, heights)]
        ax.set_ylabel("TTFT p50 breakdown (ms)")
        ax.legend(fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        fig.tight_layout()
        written.append(prefix.with_name(prefix.name + "-ttft-breakdown.png"))
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    if sweep:
        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rates, attainment in sweep:
            ax.plot(rates, [100 * a for a in attainment], marker="o", label=name)
        ax.axhline(90, color="grey", linestyle="--", linewidth=1)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        written.append(prefix.with_name(prefix.name + "-attainment.png"))
        fig.savefig(written[-1], dpi=100)
        plt.close(fig)
    return written
