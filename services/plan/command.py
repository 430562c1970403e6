"""`pdserve plan`: size prefill and decode pools before deploying them.

From a profile (the engine's step times and the handoff's, as `pdserve profile` measures them
on the hardware at hand), a workload (rate process, prompt and output lengths, prefix reuse)
and SLOs (TTFT, TPOT), simulate co-located and disaggregated configurations with a
discrete-event model of the engine's scheduling and the router's placement, and rank them by
goodput per worker: the highest request rate at which at least --attainment of requests meet
both SLOs, divided by the workers it takes.

    pdserve plan --workload fixed:256,128 --ttft-slo-ms 500 --tpot-slo-ms 50 --max-workers 4
    pdserve plan --profile my.json --workload chat --prefix-share 0.5 --chunk-sizes 256,512 \\
        --json plan.json --plot plan.png

Every line of the table is a prediction; docs/planning.md says what the model includes and
what it leaves out.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.config import option, parse_config, require
from pdserve.plan import signals
from pdserve.plan.cluster import MODES, Deployment, Profiles
from pdserve.plan.report import RANK_BY, Ranked, plot, rank, table, tp_note, write_json
from pdserve.plan.search import Goodput, Slo, deployments, find_goodput, plan, predict
from pdserve.plan.workload import ARRIVALS_HELP, Workload
from pdserve.sim.profile import SimProfile

WORKLOAD_HELP = ("prompt and output lengths, as pdserve bench serve --workload: fixed:IN,OUT | "
                 "uniform:IN_LO-IN_HI,OUT_LO-OUT_HI | chat[:IN_MEDIAN,OUT_MEDIAN] | "
                 "mixed:SHORT,LONG,SHARE,OUT")
CURVE = (0.25, 0.5, 0.75, 0.9, 1.0, 1.1, 1.2, 1.35, 1.5)  # x each configuration's goodput


def _ints(text: tuple[str, ...]) -> list[int]:
    return [int(part) for part in text]


@dataclass(frozen=True)
class PlanConfig:
    """Options of `pdserve plan` (each also PDSERVE_PLAN_<NAME>)."""

    profile: str = option("", "profile JSON (pdserve profile writes one; any fields of "
                              "pdserve.sim.profile.SimProfile); default: the built-in profile "
                              "(bench-7m on a 2-vCPU Zen 5)")
    prefill_profile: str = option("", "profile of the prefill workers, where it differs from "
                                      "--profile (other hardware, or other cores)")
    decode_profile: str = option("", "profile of the decode workers, where it differs from "
                                     "--profile")
    workload: str = option("fixed:256,128", WORKLOAD_HELP)
    arrivals: str = option("poisson", f"arrival process: {ARRIVALS_HELP}")
    prefix_share: float = option(0.0, "share of every prompt's tokens found in the prefix "
                                      "cache (0 <= share < 1)")
    num_requests: int = option(1000, "requests simulated per worker at each rate (a deployment "
                                       "of N workers: N times as many)")
    seed: int = option(0, "seed of lengths and arrivals (pdserve bench serve's --seed sends "
                          "the same requests)")
    ttft_slo_ms: float = option(500.0, "TTFT objective, ms (0: none)")
    tpot_slo_ms: float = option(50.0, "TPOT objective, ms (0: none)")
    attainment: float = option(0.9, "share of requests that must meet both objectives")
    max_workers: int = option(4, "configurations up to this many workers (prefill + decode)")
    modes: tuple[str, ...] = option(MODES, "which kinds of configuration: colocated, "
                                           "disaggregated")
    chunk_sizes: tuple[str, ...] = option(("512",), "prefill (and co-located) --chunk-size "
                                                    "values to try")
    tp: tuple[str, ...] = option(("1",), "tensor-parallel degrees to try (not modelled unless "
                                         "the profile has tp_efficiency; see docs/planning.md)")
    max_prefill_tokens: int = option(2048, "workers' --max-prefill-tokens")
    max_num_seqs: int = option(256, "workers' --max-num-seqs")
    decode_chunk_size: int = option(64, "decode workers' --chunk-size")
    remote_prefill_min_tokens: int = option(256, "the router's --remote-prefill-min-tokens")
    routers: int = option(1, "router replicas in front of every configuration, one core each: "
                             "where the router's CPU is priced (--router-cpu-ms), requests "
                             "wait for a free one")
    router_cpu_ms: str = option("", "REQUEST[,TOKEN]: one router core's CPU per request and "
                                    "per streamed token, ms (pdserve bench router's 'router "
                                    "CPU' line); default: the profile's router_ms_per_request "
                                    "and router_ms_per_token (0: routers not modelled)")
    rates: tuple[str, ...] = option((), "rates (req/s) at which the configurations shown are "
                                        "also simulated in full, for --plot and --json "
                                        "(default: 0.25x to 1.5x each one's goodput)")
    need_rate: float = option(0.0, "the rate the deployment must serve (req/s): the table "
                                   "says which configurations reach it")
    rank_by: str = option("worker", "rank by goodput per worker, per device (worker x TP x "
                                    "the profile's devices_per_worker) or in total",
                          choices=RANK_BY)
    top: int = option(10, "configurations shown, plotted and given curves (0: all)")
    json: str = option("", "write the ranking, each configuration's prediction and curve here")
    plot: str = option("", "PNG of predicted SLO attainment vs rate (matplotlib)")
    progress: bool = option(True, "one line per configuration on stderr as it is searched")
    validate: bool = option(False, "instead of ranking: run co-located x1 and 1P+1D for real "
                                   "on this machine (pdserve up + pdserve bench serve, the "
                                   "same requests) and report predicted vs measured TTFT and "
                                   "TPOT p50 (--json: 'validation')")
    model: str = option("bench-7m", "--validate: the model the stacks serve (and, without "
                                    "--profile, the one profiled first)")
    validate_rate: float = option(0.0, "--validate: request rate (0: half the lower predicted "
                                       "goodput of the two configurations)")
    validate_requests: int = option(100, "--validate: requests per measured run")
    validate_repeats: int = option(3, "--validate: measured runs per configuration, each of "
                                      "its own requests; their medians are compared (one "
                                      "run's p50 moves 10-30% on a shared machine)")
    signals: bool = option(False, "also print the autoscaling signals (the HPA's metrics) of "
                                  "the best configuration at 0.25x to 1.5x its goodput, beside "
                                  "the HPA's thresholds (--json: 'signals')")
    signals_config: str = option("", "--signals: that configuration instead, by its name in "
                                     "the table (e.g. '1P+1D chunk 512')")
    hpa: str = option("", "--signals: the HPA manifest whose thresholds to read (default: "
                          "deploy/k8s/components/autoscaling/hpa.yaml)")

    def __post_init__(self) -> None:
        for name in ("num_requests", "max_workers", "max_prefill_tokens", "max_num_seqs",
                     "decode_chunk_size", "validate_requests", "routers"):
            require(getattr(self, name) > 0, name, getattr(self, name), "> 0")
        for name in ("ttft_slo_ms", "tpot_slo_ms", "need_rate", "remote_prefill_min_tokens",
                     "top", "validate_rate"):
            require(getattr(self, name) >= 0, name, getattr(self, name), ">= 0")
        require(self.ttft_slo_ms > 0 or self.tpot_slo_ms > 0, "ttft_slo_ms",
                self.ttft_slo_ms, "> 0 where --tpot-slo-ms is 0")
        require(bool(self.modes) and set(self.modes) <= set(MODES), "modes", self.modes,
                " and/or ".join(MODES))
        for name in ("chunk_sizes", "tp", "rates"):
            values = getattr(self, name)
            require(all(_positive(v) for v in values) and (name == "rates" or bool(values)),
                    name, values, "positive numbers, comma-separated")


def _positive(text: str) -> bool:
    try:
        return float(text) > 0
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(PlanConfig, "plan", argv, prog="pdserve plan", description=__doc__)
    try:
        profile = SimProfile.load(cfg.profile) if cfg.profile else SimProfile()
        if cfg.router_cpu_ms:
            profile = _router_cpu(profile, cfg.router_cpu_ms)
        profiles = Profiles(profile,
                            SimProfile.load(cfg.prefill_profile) if cfg.prefill_profile else None,
                            SimProfile.load(cfg.decode_profile) if cfg.decode_profile else None)
        workload = Workload(cfg.workload, cfg.arrivals, cfg.prefix_share, cfg.num_requests,
                            cfg.seed, profile.block_size)
        slo = Slo(cfg.ttft_slo_ms or None, cfg.tpot_slo_ms or None, cfg.attainment)
        chunk_sizes, tps = _ints(cfg.chunk_sizes), _ints(cfg.tp)
        configs = _configs(cfg, chunk_sizes, tps)
    except ValueError as exc:
        print(f"pdserve plan: {exc}", file=sys.stderr)
        return 2
    if cfg.validate:
        return _validate(cfg, workload, slo, profiles if cfg.profile else None)
    started = time.perf_counter()

    def progress(i: int, result: Goodput) -> None:
        if cfg.progress:
            print(f"[{i + 1}/{len(configs)}] {result.deployment.name}: {result.rate:.2f} req/s "
                  f"({len(result.points)} runs, {time.perf_counter() - started:.1f} s)",
                  file=sys.stderr, flush=True)

    found = plan(configs, workload, profiles, slo, progress)
    results = [Ranked(g.deployment, g.rate, profiles.devices(g.deployment)) for g in found]
    for r in results:
        if r.goodput_rps > 0:
            r.at_goodput = predict(r.deployment, workload, profiles, r.goodput_rps, slo)
    ranked = rank(results, cfg.rank_by)
    shown = ranked[:cfg.top] if cfg.top else ranked
    fallback = max((r.goodput_rps for r in shown), default=0.0) or 1.0
    if cfg.plot or cfg.json:
        for r in shown:
            rates = [float(x) for x in cfg.rates] or \
                [k * (r.goodput_rps or fallback) for k in CURVE]  # around its own cliff
            r.curve = [predict(r.deployment, workload, profiles, rate, slo) for rate in rates]
    notes = [n for n in (tp_note(profile, tps),) if n]
    print(f"pdserve plan: {len(configs)} configurations, up to {cfg.max_workers} workers")
    print(f"workload: {workload.describe()}")
    print(f"SLO: {slo.describe()}")
    print(f"profile: {cfg.profile or 'built-in (bench-7m, 2-vCPU Zen 5)'}"
          + (f"; prefill workers: {cfg.prefill_profile}" if cfg.prefill_profile else "")
          + (f"; decode workers: {cfg.decode_profile}" if cfg.decode_profile else ""))
    if profile.router_ms_per_request or profile.router_ms_per_token:
        print(_routers_line(profile, workload, cfg.routers))
    for note in notes:
        print(note)
    print(f"ranked by goodput per {cfg.rank_by}" if cfg.rank_by != "total" else
          "ranked by goodput")
    print()
    print(table(shown, cfg.need_rate or None))
    if cfg.json:
        write_json(Path(cfg.json), ranked, profiles=profiles,
                   profile_paths={"profile": cfg.profile, "prefill": cfg.prefill_profile,
                                  "decode": cfg.decode_profile},
                   workload=workload, slo=slo, rank_by=cfg.rank_by, notes=notes)
        print(f"wrote {cfg.json}")
    if cfg.plot:
        print(f"wrote {cfg.plot}" if plot(Path(cfg.plot), shown, slo) else
              "no plot: matplotlib is not installed")
    if cfg.signals:
        try:
            print("\n" + signals.report(ranked, cfg.signals_config, workload, profiles, slo,
                                         Path(cfg.hpa) if cfg.hpa else signals.HPA_PATH,
                                         Path(cfg.json) if cfg.json else None))
        except (ValueError, OSError) as exc:
            print(f"pdserve plan --signals: {exc}", file=sys.stderr)
            return 1
    return 0


def _validate(cfg: PlanConfig, workload: Workload, slo: Slo, profiles: Profiles | None) -> int:
    from pdserve.plan import stacks, validate

    logs = stacks.log_dir()
    try:
        if profiles is None:  # each kind profiled with the cores pdserve up will give it
            profiles = stacks.measure_profiles(cfg.model, cfg.progress)
        rate = cfg.validate_rate or 0.5 * min(
            find_goodput(dep, workload, profiles, slo).rate for dep in validate.CONFIGS)
        if not rate > 0:
            raise ValueError("no rate meets the SLOs in the plan: give --validate-rate")
        runner = stacks.StackRunner(cfg.model, workload, cfg.validate_requests, logs,
                                    repeats=cfg.validate_repeats)
        rows = validate.validate(validate.CONFIGS, workload, profiles, rate,
                                 cfg.validate_requests, runner, stacks.machine_cores(),
                                 repeats=cfg.validate_repeats)
    except (ValueError, RuntimeError, OSError) as exc:
        print(f"pdserve plan --validate: {exc}\n(the runs' logs: {logs})", file=sys.stderr)
        return 1
    shutil.rmtree(logs, ignore_errors=True)
    print(f"pdserve plan --validate: {workload.describe()}, {cfg.validate_repeats} x "
          f"{cfg.validate_requests} requests per configuration at {rate:.2f} req/s, model "
          f"{cfg.model}")
    print(validate.table(rows))
    if cfg.json:
        Path(cfg.json).write_text(json.dumps({
            "validation": rows, "model": cfg.model, "workload": workload.spec,
            "arrivals": workload.arrivals, "seed": workload.seed,
            "profile": dataclasses.asdict(profiles.default),
            "prefill_profile": dataclasses.asdict(profiles.role("prefill")),
            "decode_profile": dataclasses.asdict(profiles.role("decode"))}, indent=1))
        print(f"wrote {cfg.json}")
    return 0


def _configs(cfg: PlanConfig, chunk_sizes: list[int], tps: list[int]) -> list[Deployment]:
    return deployments(cfg.max_workers, cfg.modes, chunk_sizes, tps,
                       max_prefill_tokens=cfg.max_prefill_tokens, max_num_seqs=cfg.max_num_seqs,
                       decode_chunk_size=cfg.decode_chunk_size,
                       remote_prefill_min_tokens=cfg.remote_prefill_min_tokens,
                       routers=cfg.routers)


def _router_cpu(profile: SimProfile, text: str) -> SimProfile:
    """`profile` with --router-cpu-ms's REQUEST[,TOKEN] as its router fields."""
    parts = text.split(",")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        values = []
    if not 1 <= len(values) <= 2 or not all(v >= 0 for v in values):
        raise ValueError(f"--router-cpu-ms={text!r}: expected REQUEST[,TOKEN], ms >= 0 "
                         f"(e.g. 5.4 or 2.9,0.3)")
    return dataclasses.replace(profile, router_ms_per_request=values[0],
                               router_ms_per_token=values[1] if len(values) == 2 else 0.0)


def _routers_line(profile: SimProfile, workload: Workload, routers: int) -> str:
    """What the routers cost a request of this workload and where they saturate (for a
    profile that prices them: every request has an output token, so the cost is > 0)."""
    sample = workload.requests(1.0, count=200)
    ms = sum(profile.router_ms(r.output_tokens) for r in sample) / len(sample)
    return (f"routers: {routers} x 1 core, {profile.router_ms_per_request:g} ms per request + "
            f"{profile.router_ms_per_token:g} per token = {ms:.2f} ms of a core per request "
            f"of this workload: they saturate at {1e3 * routers / ms:,.0f} req/s")


if __name__ == "__main__":
    sys.exit(main())
