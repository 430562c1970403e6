"""`pdserve plan --validate`: the plan's predictions set against real stacks on this machine.

For each configuration (co-located x1 and 1 prefill + 1 decode, the two this machine can
run), `pdserve up` runs it for real and `pdserve bench serve` sends it these runs
(`pdserve.plan.stacks`), each with prompts of its own:

1. calibration: `CALIBRATION_REQUESTS` requests one at a time (seed + 1000). What a serving
   stack adds to the engine's own times at no load (router, RPCs, streaming, the worker's loop)
   is what they took beyond the simulator's prediction for the same requests alone: the TPOT
   gap becomes the decode (or co-located) worker's `step_overhead_ms`, the prefill worker's
   own time per prompt (server-side `prefill_ms`) beyond the profile its `step_overhead_ms`,
   the TTFT gap left after them the `request_overhead_ms`. Then a closed-loop burst
   (`CPU_CONCURRENCY` in flight) gives the router's and the client's CPU per output token;
   and a run at the validated rate, as long as a measured one (seed + CORES_SEED), sampled
   (`pdserve.plan.cores`): how much CPU the processes beside the workers (router, agents,
   client) took from each worker's cores per output token (on this machine that comes out of
   the workers' cores, and from which worker's depends on the load: `SimProfile.contention`,
   per kind of worker), and what the decode (co-located) worker's steps took beyond the
   profile and that CPU (`pdserve.plan.steps`): the TPOT gap alone is split into its
   `step_overhead_ms` and a `seq_overhead_ms` per sequence in a step, which only steps of many
   sequences tell apart (the run is as long as a measured one so that its batches grow as
   theirs do; 50 requests at 25 req/s saw a mean batch of 8 where the measured runs reached 20
   and more, and found no cost per sequence);
2. the measured runs: `count` requests of the workload at `rate`, once per `repeat_seeds`
   (same spec, seed, rate and count as each prediction, so the same lengths and arrival
   times), predicted with those overheads; the medians of the runs' percentiles are compared.

Reported side by side per configuration: TTFT and TPOT p50 (and p99), with the relative error
of each prediction (the target: p50 within 20%), and the overheads found (put them in the
profile to plan with them).

Which profile predicts each stack matters: `pdserve up` gives a co-located worker every core
and, in disaggregated mode, the prefill and the decode worker half each, so each kind should be
profiled with the threads it will have (the command measures them when no profile is given).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import cast

from pdserve.plan.cluster import Deployment, Profiles
from pdserve.plan.search import predict
from pdserve.plan.steps import StepTotals, split_overheads
from pdserve.plan.workload import Workload
from pdserve.sim.profile import SimProfile

CONFIGS = (Deployment("colocated", 0, 1), Deployment("disaggregated", 1, 1))
CALIBRATION_REQUESTS = 8
# Added to the workload's seed: each run before the measured one draws prompts of its own. A
# prompt sent twice is a prefix-cache hit the second time (prefilled on the decode worker, no
# handoff): with one seed for all three, 16 of the 50 sampled requests were.
CALIBRATION_SEED = 1000
CPU_SEED = 2000
CORES_SEED = 3000
REPEAT_SEED = 4000  # the measured runs after the first: seed + REPEAT_SEED + r
# The router's and the client's CPU per token is measured with this many requests in flight:
# one at a time, the router's fixed background work (health checks, Stats) over a slow run
# doubled it (1.0 ms per token against ~0.5)
CPU_CONCURRENCY = 8
TARGET_ERROR = 0.2
IDLE_RATE = 1e-3  # req/s: requests 1,000 s apart, each alone


@dataclass(frozen=True)
class Latencies:
    ttft_p50_ms: float | None
    tpot_p50_ms: float | None
    ttft_p99_ms: float | None = None
    tpot_p99_ms: float | None = None
    cpu_ms_per_token: float | None = None  # measured: the router's and the client's CPU
    # measured (`pdserve.plan.cores`): per worker role, [ms per output token that the
    # router, the KV agents, `pdserve up` and the client spent on that worker's cores, cores]
    shared: dict[str, list[float]] | None = None
    prefill_p50_ms: float | None = None  # the prefill worker's own time (server-side)
    # measured: the decode (or co-located) worker's engine steps over the run at the rate
    # whose CPU was sampled (`pdserve.plan.steps`)
    steps: StepTotals | None = None


# A configuration run for real: (its calibration, its runs at the rate, one per seed)
Runner = Callable[[Deployment, float], tuple[Latencies, list[Latencies]]]


def repeat_seeds(seed: int, repeats: int) -> list[int]:
    """The measured runs' seeds: the plan's own first, then seeds no other run draws (a prompt
    sent again would be a prefix-cache hit)."""
    return [seed] + [seed + REPEAT_SEED + r for r in range(1, repeats)]


def _medians(runs: Sequence[Latencies]) -> Latencies:
    """Each latency the median over `runs` (the first run's CPU figures)."""
    def median(key: str) -> float | None:
        known = [v for r in runs if (v := getattr(r, key)) is not None]
        return statistics.median(known) if known else None

    return replace(runs[0], ttft_p50_ms=median("ttft_p50_ms"), tpot_p50_ms=median("tpot_p50_ms"),
                   ttft_p99_ms=median("ttft_p99_ms"), tpot_p99_ms=median("tpot_p99_ms"),
                   prefill_p50_ms=median("prefill_p50_ms"))


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def calibrate(dep: Deployment, workload: Workload, profiles: Profiles, alone: Latencies,
              shared_cores: float = 0.0) -> tuple[Profiles, dict[str, float]]:
    """`profiles` with the serving overheads that make the calibration requests, one at a
    time, take what they measured (`alone`); and those overheads. The CPU that the processes
    beside the workers (router, KV agents, client) spend per output token is taken from the
    workers' cores (`SimProfile.contention`): with `alone.shared`, from each worker's own
    cores as much as was measured on them; else, with `shared_cores`, the router's and the
    client's (`alone.cpu_ms_per_token`) spread over all of them."""
    if alone.shared:
        profiles = _charge_shared(dep, profiles, alone.shared)
    elif shared_cores and alone.cpu_ms_per_token is not None:
        profiles = replace(profiles, default=replace(
            profiles.default, shared_cpu_ms_per_token=alone.cpu_ms_per_token,
            shared_cores=shared_cores))
    requests = replace(workload, seed=workload.seed + CALIBRATION_SEED)
    role = "colocated" if dep.mode == "colocated" else "decode"
    prefill_step = None
    if dep.mode != "colocated" and alone.prefill_p50_ms:
        profiles, prefill_step = _prefill_overhead(dep, requests, profiles, alone.prefill_p50_ms)

    def with_overheads(step_ms: float, request_ms: float, seq_ms: float = 0.0) -> Profiles:
        own = replace(profiles.role(role), step_overhead_ms=step_ms,
                      request_overhead_ms=request_ms, seq_overhead_ms=seq_ms)
        return replace(profiles, default=own) if role == "colocated" else \
            replace(profiles, decode=own)

    base = profiles.role(role)
    first = predict(dep, requests, profiles, IDLE_RATE, count=CALIBRATION_REQUESTS)
    step = max(0.0, base.step_overhead_ms + (alone.tpot_p50_ms or 0.0)
               - (first.tpot_p50_ms or 0.0)) if alone.tpot_p50_ms else base.step_overhead_ms
    per_seq = base.seq_overhead_ms
    if alone.steps is not None:  # the TPOT gap alone, split by the steps at the rate
        step, per_seq = split_overheads(alone.steps, base, step + per_seq,
                                        profiles.streaming_ms(role))
    second = predict(dep, requests, with_overheads(step, base.request_overhead_ms, per_seq),
                     IDLE_RATE, count=CALIBRATION_REQUESTS)
    request = max(0.0, base.request_overhead_ms + (alone.ttft_p50_ms or 0.0)
                  - (second.ttft_p50_ms or 0.0)) if alone.ttft_p50_ms \
        else base.request_overhead_ms
    found = {"step_overhead_ms": step, "seq_overhead_ms": per_seq,
             "request_overhead_ms": request}
    if prefill_step is not None:
        found["prefill_step_overhead_ms"] = prefill_step
    if alone.shared:
        for role, (ms, cores) in alone.shared.items():
            found[f"{role}_shared_cpu_ms_per_token"], found[f"{role}_shared_cores"] = ms, cores
    elif shared_cores and alone.cpu_ms_per_token is not None:
        found.update(shared_cpu_ms_per_token=alone.cpu_ms_per_token, shared_cores=shared_cores)
    return with_overheads(step, request, per_seq), found


def _prefill_overhead(dep: Deployment, requests: Workload, profiles: Profiles,
                      measured_ms: float) -> tuple[Profiles, float]:
    """The prefill workers' `step_overhead_ms`: what their own time per prompt alone (the
    stack's server-side `prefill_ms` p50) took beyond the profile's steps, per step."""
    own = profiles.role("prefill")
    times = []
    for r in requests.requests(IDLE_RATE, count=CALIBRATION_REQUESTS):
        left, steps, ms = r.prompt_tokens - r.cached_tokens, 0, 0.0
        while left > 0:
            n = min(left, dep.chunk_size)
            ms += own.step_ms(0, 0, [(r.prompt_tokens - left, n)]) - own.step_overhead_ms
            left, steps = left - n, steps + 1
        times.append((ms, max(1, steps)))
    ms, steps = sorted(times)[len(times) // 2]
    step = max(0.0, (measured_ms - ms) / steps)
    return replace(profiles, prefill=replace(own, step_overhead_ms=step)), step


def _charge_shared(dep: Deployment, profiles: Profiles,
                   shared: dict[str, list[float]]) -> Profiles:
    """Each worker role's profile charged the CPU measured beside it on its own cores."""
    def charged(role: str) -> SimProfile:
        ms, cores = shared.get(role, (0.0, 0.0))
        return replace(profiles.role(role), shared_cpu_ms_per_token=ms, shared_cores=cores)

    if dep.mode == "colocated":
        return replace(profiles, default=charged("colocated"))
    return replace(profiles, prefill=charged("prefill"), decode=charged("decode"))


def without_wake(profiles: Profiles) -> Profiles:
    """`profiles` with no wake after idleness (`SimProfile.wake_ms`). The stacks are predicted
    without it: the wake is timed on the engine alone, and in a stack the router, the agents
    and the client run on a worker's cores while it idles. Charged, it took its share of the
    calibration's TTFT from the request overhead and 1P+1D's TTFT p50 came out -27% and -25%
    against -16% and -4% without it (alternated runs at 16 req/s, docs/planning.md)."""
    def still(p: SimProfile) -> SimProfile:
        return replace(p, idle_wake_ms=0.0)

    return Profiles(still(profiles.default), profiles.prefill and still(profiles.prefill),
                    profiles.decode and still(profiles.decode))


def validate(configs: Sequence[Deployment], workload: Workload, profiles: Profiles, rate: float,
             count: int, run: Runner, shared_cores: float = 0.0, repeats: int = 1
             ) -> list[dict[str, object]]:
    """Per configuration: `{config, rate, requests, predicted, measured, error,
    within_target, calibration, runs}`. With `repeats` > 1 the workload is run (and predicted)
    once per `repeat_seeds`, and the medians of the runs' percentiles are set side by side:
    one run's p50 moves by 10-30% on a shared machine (`runs` holds each)."""
    seeds = repeat_seeds(workload.seed, repeats)
    profiles = without_wake(profiles)
    out: list[dict[str, object]] = []
    for dep in configs:
        alone, measured_runs = run(dep, rate)
        if len(measured_runs) != len(seeds):
            raise ValueError(f"{dep.name}: {len(measured_runs)} measured runs for "
                             f"{len(seeds)} seeds")
        calibrated, overheads = calibrate(dep, workload, profiles, alone, shared_cores)
        predicted_runs = []
        for seed in seeds:
            point = predict(dep, replace(workload, seed=seed), calibrated, rate, count=count)
            predicted_runs.append(Latencies(point.ttft_p50_ms, point.tpot_p50_ms,
                                            point.ttft_p99_ms, point.tpot_p99_ms))
        predicted, measured = _medians(predicted_runs), _medians(measured_runs)
        errors = {"ttft_p50": _error(predicted.ttft_p50_ms, measured.ttft_p50_ms),
                  "tpot_p50": _error(predicted.tpot_p50_ms, measured.tpot_p50_ms)}
        runs = [{"seed": seed, "predicted": {"ttft_p50_ms": p.ttft_p50_ms,
                                             "tpot_p50_ms": p.tpot_p50_ms},
                 "measured": {"ttft_p50_ms": m.ttft_p50_ms, "tpot_p50_ms": m.tpot_p50_ms}}
                for seed, p, m in zip(seeds, predicted_runs, measured_runs)]
        out.append({"config": dep.name, "deployment": asdict(dep), "rate": rate,
                    "requests": count, "predicted": asdict(predicted),
                    "measured": asdict(measured), "error": errors,
                    "within_target": all(e is not None and abs(e) <= TARGET_ERROR
                                         for e in errors.values()),
                    "calibration": {"requests": CALIBRATION_REQUESTS, "measured": asdict(alone),
                                    **overheads},
                    "runs": runs})
    return out


def table(rows: Sequence[dict[str, object]]) -> str:
    lines = [f"{'config':<24} {'rate':>6}  {'TTFT p50 pred/meas ms':>22}  "
             f"{'TPOT p50 pred/meas ms':>22}  within {TARGET_ERROR:.0%}"]

    def cell(row: dict[str, object], key: str) -> str:
        p = row["predicted"][key]  # type: ignore[index]
        m = row["measured"][key]  # type: ignore[index]
        e = row["error"][key.removesuffix("_ms")]  # type: ignore[index]
        if p is None or m is None:
            return "-"
        return f"{p:.1f} / {m:.1f} ({e:+.0%})" if e is not None else f"{p:.1f} / {m:.1f}"

    for row in rows:
        lines.append(f"{row['config']:<24} {row['rate']:>6.2f}  "
                     f"{cell(row, 'ttft_p50_ms'):>22}  {cell(row, 'tpot_p50_ms'):>22}  "
                     f"{'yes' if row['within_target'] else 'no'}")
    for row in rows:
        runs = cast(list[dict[str, dict[str, float | None]]], row.get("runs") or [])
        if len(runs) > 1:
            lines.append(f"{row['config']}: {len(runs)} runs, " + "; ".join(
                f"{name} p50 measured {_span([r['measured'][key] for r in runs])} ms, "
                f"predicted {_span([r['predicted'][key] for r in runs])}"
                for name, key in (("TTFT", "ttft_p50_ms"), ("TPOT", "tpot_p50_ms"))))
    for row in rows:
        cal = cast(dict[str, float], row["calibration"])
        shared = f", router + client CPU {cal['shared_cpu_ms_per_token']:.2f} ms per token " \
            f"on {cal['shared_cores']:g} shared cores" if "shared_cores" in cal else ""
        prefill = f", prefill step {cal['prefill_step_overhead_ms']:.2f} ms" \
            if "prefill_step_overhead_ms" in cal else ""
        shared += "".join(
            f", beside the {role} worker {cal[f'{role}_shared_cpu_ms_per_token']:.2f} ms per "
            f"token on its {cal[f'{role}_shared_cores']:g} core(s)"
            for role in ("colocated", "prefill", "decode") if f"{role}_shared_cores" in cal)
        lines.append(f"{row['config']}: serving overheads from {cal['requests']:.0f} requests "
                     f"alone: request {cal['request_overhead_ms']:.2f} ms, step "
                     f"{cal['step_overhead_ms']:.2f} ms, sequence in a step (at the rate) "
                     f"{cal.get('seq_overhead_ms', 0.0):.2f} ms{prefill}{shared}")
    return "\n".join(lines)


def _span(values: Sequence[float | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{min(known):.1f}-{max(known):.1f}" if known else "-"
