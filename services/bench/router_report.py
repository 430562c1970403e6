"""What `pdserve bench router` reports: the measured window's figures from the client's
records, the simulated workers' ledger and /proc, as a JSON-ready dict and as text."""

from __future__ import annotations

import argparse
import os
import platform
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.loadgen.stats import percentile
from pdserve.bench.router_load import Shot


@dataclass
class Window:
    """The measured seconds of the load (from its start) and what /proc said over them."""

    start_s: float
    end_s: float
    wall_s: float = 0.0
    router_cpu_s: float = 0.0
    harness_cpu_s: float = 0.0
    router_cores: int = 1
    harness_cores: int = 1
    vanished: int = 0
    unhealthy_after_s: float | None = None
    # the router's garbage collections in the window, per generation: [collections, seconds]
    router_gc: dict[str, list[float]] = field(default_factory=dict)
    # the router's prefix-cache index at the end: workers it knows, pages (None: no /metrics)
    cache_index: dict[str, int] | None = None


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children so far (/proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return 0.0
    ticks = sum(int(f) for f in fields[11:15])  # utime stime cutime cstime
    return ticks / os.sysconf("SC_CLK_TCK")


def machine() -> dict[str, Any]:
    """The CPU the figures come from: model name, cores, the vector extensions that matter."""
    model, flags = platform.processor() or "", ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not model:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = value
    except OSError:
        pass
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    return {"cpu": model, "cores": os.cpu_count(),
            "flags": [f for f in wanted if f in flags.split()]}


def percentiles(values: list[float]) -> dict[str, float | int | None]:
    """p50/p90/p99 (as `pdserve bench serve` computes them), mean and count."""
    return {"p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99),
            "mean": sum(values) / len(values) if values else None, "n": len(values)}


def _first_all_used(shots: list[Shot], total: int) -> float | None:
    """Seconds from the load's start until every worker had served a request (by completion
    time); None if some never did."""
    seen: set[str] = set()
    for shot in sorted((s for s in shots if s.ok), key=lambda s: s.at_s + (s.e2e_ms or 0) / 1e3):
        seen.update(filter(None, (shot.prefill, shot.decode)))
        if len(seen) >= total:
            return shot.at_s + (shot.e2e_ms or 0.0) / 1e3
    return None


def summarize(shots: list[Shot], ledger: dict[str, float], stable: frozenset[str],
              window: Window, args: argparse.Namespace) -> dict[str, Any]:
    def ended_s(s: Shot) -> float:
        return s.at_s + (s.e2e_ms or 0.0) / 1e3

    # A request of the window that failed once the workers were killed counts with the kill.
    lost = [s for s in shots if window.start_s <= s.at_s < window.end_s and not s.ok
            and window.vanished and ended_s(s) >= window.end_s]
    measured = [s for s in shots if window.start_s <= s.at_s < window.end_s and s not in lost]
    before_kill = [s for s in shots if s.at_s < window.end_s]
    after_kill = [s for s in shots if s.at_s >= window.end_s] + lost
    done = [s for s in measured if s.ok]
    tokens = sum(s.tokens for s in done)
    wall = window.wall_s or (window.end_s - window.start_s)
    req_s, tok_s = len(done) / wall, tokens / wall
    added = [s.e2e_ms - ledger[s.request_id] for s in done
             if s.e2e_ms is not None and s.request_id in ledger
             and s.prefill in stable and s.decode in stable]
    seen = {w for s in before_kill if s.ok for w in (s.prefill, s.decode) if w}
    per_request = window.router_cpu_s * 1e3 / len(done) if done else None
    return {
        "workers": args.workers, "rate": args.rate, "duration_s": wall,
        "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "sent": len(measured), "completed": len(done), "failed": len(measured) - len(done),
        "errors": dict(Counter(s.error for s in measured if not s.ok).most_common(5)),
        "req_s": req_s, "tokens_s": tok_s,
        "deltas_per_request": sum(s.deltas for s in done) / len(done) if done else None,
        "router_added_ms": percentiles(added),
        "e2e_ms": percentiles([s.e2e_ms for s in done if s.e2e_ms is not None]),
        "ttft_ms": percentiles([s.ttft_ms for s in done if s.ttft_ms is not None]),
        "router_cpu": {
            "ms_per_request": per_request,
            "ms_per_token": window.router_cpu_s * 1e3 / tokens if tokens else None,
            "cores_busy": window.router_cpu_s / wall, "cores": window.router_cores},
        "router_gc": {gen: {"collections": int(n), "ms": s * 1e3}
                      for gen, (n, s) in sorted(window.router_gc.items())},
        "cache_index": window.cache_index,
        "harness": {"cores_busy": window.harness_cpu_s / wall, "cores": window.harness_cores,
                    "send_lag_ms": percentiles([s.lag_ms for s in measured])},
        "workers_seen": len(seen),
        "all_used_s": _first_all_used(before_kill, args.workers),
        "vanish": {
            "killed": window.vanished, "sent": len(after_kill), "in_flight_lost": len(lost),
            "failed": sum(1 for s in after_kill if not s.ok),
            "errors": dict(Counter(s.error for s in after_kill if not s.ok).most_common(5)),
            "e2e_ms": percentiles([s.e2e_ms for s in after_kill if s.ok and s.e2e_ms]),
            "unhealthy_after_s": window.unhealthy_after_s} if window.vanished else None,
    }


def _ms(stats: dict[str, Any], key: str) -> str:
    value = stats.get(key)
    return "-" if value is None else f"{value:.2f}"


def _gc(pauses: dict[str, dict[str, float]]) -> str:
    if not pauses:
        return "- (no /metrics)"
    return ", ".join(f"gen {gen} {p['collections']}x {p['ms']:.0f} ms" for gen, p in
                     sorted(pauses.items(), reverse=True)) + " (gen 2: full collections)"


def _cache(index: dict[str, int] | None) -> str:
    if index is None:
        return "- (no /metrics)"
    return (f"{index['workers']} workers' prefix caches known to the router at the end "
            f"({index['pages']} pages)")


def show(r: dict[str, Any]) -> None:
    cpu, harness, disc = r["router_cpu"], r["harness"], r["discovery"]
    added = r["router_added_ms"]
    lines = [
        f"router bench: {r['workers']} simulated workers, {r['rate']:g} req/s offered, "
        f"{r['prompt_tokens']} prompt / {r['output_tokens']} output tokens, "
        f"{r['duration_s']:.1f} s measured"
        + ("; over the OpenAI HTTP API" if r.get("api") == "http" else "")
        + (f"; {n} tokens a message" if (n := r.get("stream_interval", 1)) > 1 else "")
        + (f"; prompts under {t} tokens prefilled on the decode worker"
           if (t := r.get("remote_prefill_min_tokens", 0)) else "")
        + (f"; router flags {' '.join(r['router_args'])}" if r.get("router_args") else ""),
        f"  completed           {r['completed']} of {r['sent']} ({r['failed']} failed"
        + (f": {r['errors']}" if r["errors"] else "") + ")",
        f"  sustained           {r['req_s']:.1f} req/s, {r['tokens_s']:.0f} tokens/s"
        + (f" in {n:.1f} messages a request" if (n := r.get("deltas_per_request")) else ""),
        f"  router-added ms     p50 {_ms(added, 'p50')}  p99 {_ms(added, 'p99')}  "
        f"(client E2E - simulated worker time, {added['n']} requests)",
        f"  E2E ms              p50 {_ms(r['e2e_ms'], 'p50')}  p99 {_ms(r['e2e_ms'], 'p99')}",
        f"  router CPU          {_ms(cpu, 'ms_per_request')} ms/request, "
        f"{_ms(cpu, 'ms_per_token')} ms/token, {cpu['cores_busy']:.2f} of "
        f"{cpu['cores']} core(s) busy",
        f"  for pdserve plan    --router-cpu-ms {_ms(cpu, 'ms_per_request')} (requests of "
        f"{r['output_tokens']} output tokens; with a second run's other --output-tokens: "
        f"REQUEST,TOKEN)",
        f"  router GC pauses    {_gc(r.get('router_gc') or {})}",
        f"  cache index         {_cache(r.get('cache_index'))}",
        f"  harness             {harness['cores_busy']:.2f} of {harness['cores']} core(s) busy, "
        f"send lag p99 {_ms(harness['send_lag_ms'], 'p99')} ms",
        f"  workers used        {r['workers_seen']} of {r['workers']}"
        + (f" (all by {disc['all_used_s']:.1f} s into the load)" if disc["all_used_s"] else ""),
        f"  discovery           SERVING after {disc['serving_s']:.2f} s, all healthy after "
        + ("-" if disc["all_healthy_s"] is None else f"{disc['all_healthy_s']:.2f} s"),
    ]
    v = r.get("vanish")
    if v:
        after = "-" if v["unhealthy_after_s"] is None else f"{v['unhealthy_after_s']:.2f} s"
        errors = f" ({v['errors']})" if v["errors"] else ""
        lines.append(f"  {v['killed']} workers killed  {v['failed']} of {v['sent']} requests "
                     f"failed ({v['in_flight_lost']} of them in flight at the kill){errors}; "
                     f"counted unhealthy after {after}; E2E p99 {_ms(v['e2e_ms'], 'p99')} ms")
    m = r["machine"]
    lines.append(f"  machine             {m['cpu']}, {m['cores']} cores, {' '.join(m['flags'])}")
    print("\n".join(lines), flush=True)


def show_floor(r: dict[str, Any]) -> None:
    """pdserve's router beside the floors (`--floor`) in the same run."""
    ours = r["router_cpu"]["ms_per_request"]
    lines = ["router beside the least a router can do (Python gRPC: pdserve.bench.router_floor; "
             "C++ gRPC: bench/csrc/router_floor.cc), "
             "same load, each with its own simulated workers:",
             f"  {'router':<12} {'req/s':>7} {'CPU ms/req':>11} {'ms/token':>9} "
             f"{'added p50':>10} {'added p99':>10} {'pdserve / this':>15}"]
    for name, row in (("pdserve", r), *((f"floor {k}", v) for k, v in r["floor"].items())):
        cpu, added = row["router_cpu"], row["router_added_ms"]
        mine = cpu["ms_per_request"]
        ratio = f"{ours / mine:.2f}x" if ours and mine else "-"
        lines.append(f"  {name:<12} {row['req_s']:>7.1f} {_ms(cpu, 'ms_per_request'):>11} "
                     f"{_ms(cpu, 'ms_per_token'):>9} {_ms(added, 'p50'):>10} "
                     f"{_ms(added, 'p99'):>10} {ratio:>15}")
    print("\n".join(lines), flush=True)
