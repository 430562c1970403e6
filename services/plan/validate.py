"""`pdserve plan --validate`: the plan's predictions set against real stacks on this machine.

For each configuration (co-located x1 and 1 prefill + 1 decode, the two this machine can
run), `pdserve up` runs it for real and `pdserve bench serve` sends it these runs:

1. calibration: `CALIBRATION_REQUESTS` requests one at a time (seed + 1000). What a serving
   stack adds to the engine's own times at no load (router, RPCs, streaming, the worker's loop)
   is what they took beyond the simulator's prediction for the same requests alone: the TPOT
   gap becomes the decode (or co-located) worker's `step_overhead_ms`, the prefill worker's
   own time per prompt (server-side `prefill_ms`) beyond the profile its `step_overhead_ms`,
   the TTFT gap left after them the `request_overhead_ms`. Then a closed-loop burst
   (`CPU_CONCURRENCY` in flight) gives the router's and the client's CPU per output token;
   and `SHARED_REQUESTS` at the validated rate, sampled (`pdserve.plan.cores`), how much CPU
   the processes beside the workers (router, agents, client) took from each worker's cores
   per output token: on this machine that comes out of the workers' cores, and from which
   worker's depends on the load (`SimProfile.contention`, per kind of worker);
2. the measured run: `count` requests of the workload at `rate` (same spec, seed, rate and
   count as the prediction, so the same lengths and arrival times), predicted with those
   overheads.

Reported side by side per configuration: TTFT and TPOT p50 (and p99), with the relative error
of each prediction (the target: p50 within 20%), and the overheads found (put them in the
profile to plan with them).

Which profile predicts each stack matters: `pdserve up` gives a co-located worker every core
and, in disaggregated mode, the prefill and the decode worker half each, so each kind should be
profiled with the threads it will have (the command measures them when no profile is given).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

from pdserve.plan.cluster import Deployment, Profiles
from pdserve.plan.search import predict
from pdserve.plan.workload import Workload, parse_arrivals
from pdserve.sim.profile import SimProfile

if TYPE_CHECKING:
    from pdserve.plan.cores import CoreSampler

CONFIGS = (Deployment("colocated", 0, 1), Deployment("disaggregated", 1, 1))
CALIBRATION_REQUESTS = 8
# Added to the workload's seed: each run before the measured one draws prompts of its own. A
# prompt sent twice is a prefix-cache hit the second time (prefilled on the decode worker, no
# handoff): with one seed for all three, 16 of the 50 sampled requests were.
CALIBRATION_SEED = 1000
CPU_SEED = 2000
CORES_SEED = 3000
# The router's and the client's CPU per token is measured with this many requests in flight:
# one at a time, the router's fixed background work (health checks, Stats) over a slow run
# doubled it (1.0 ms per token against ~0.5)
CPU_CONCURRENCY = 8
# Requests (at the validated rate, seed + CORES_SEED) during which where the router,
# the agents and the client run, and how much, is sampled (`pdserve.plan.cores`)
SHARED_REQUESTS = 50
TARGET_ERROR = 0.2
IDLE_RATE = 1e-3  # req/s: requests 1,000 s apart, each alone
PDSERVE = [sys.executable, "-m", "pdserve.cli"]


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


# A configuration run for real: (its calibration, its run at the rate)
Runner = Callable[[Deployment, float], tuple[Latencies, Latencies]]


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

    def with_overheads(step_ms: float, request_ms: float) -> Profiles:
        own = replace(profiles.role(role), step_overhead_ms=step_ms,
                      request_overhead_ms=request_ms)
        return replace(profiles, default=own) if role == "colocated" else \
            replace(profiles, decode=own)

    base = profiles.role(role)
    first = predict(dep, requests, profiles, IDLE_RATE, count=CALIBRATION_REQUESTS)
    step = max(0.0, base.step_overhead_ms + (alone.tpot_p50_ms or 0.0)
               - (first.tpot_p50_ms or 0.0)) if alone.tpot_p50_ms else base.step_overhead_ms
    second = predict(dep, requests, with_overheads(step, base.request_overhead_ms), IDLE_RATE,
                     count=CALIBRATION_REQUESTS)
    request = max(0.0, base.request_overhead_ms + (alone.ttft_p50_ms or 0.0)
                  - (second.ttft_p50_ms or 0.0)) if alone.ttft_p50_ms \
        else base.request_overhead_ms
    found = {"step_overhead_ms": step, "request_overhead_ms": request}
    if prefill_step is not None:
        found["prefill_step_overhead_ms"] = prefill_step
    if alone.shared:
        for role, (ms, cores) in alone.shared.items():
            found[f"{role}_shared_cpu_ms_per_token"], found[f"{role}_shared_cores"] = ms, cores
    elif shared_cores and alone.cpu_ms_per_token is not None:
        found.update(shared_cpu_ms_per_token=alone.cpu_ms_per_token, shared_cores=shared_cores)
    return with_overheads(step, request), found


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


def validate(configs: Sequence[Deployment], workload: Workload, profiles: Profiles, rate: float,
             count: int, run: Runner, shared_cores: float = 0.0) -> list[dict[str, object]]:
    """Per configuration: `{config, rate, requests, predicted, measured, error,
    within_target, calibration}`."""
    out: list[dict[str, object]] = []
    for dep in configs:
        alone, measured = run(dep, rate)
        calibrated, overheads = calibrate(dep, workload, profiles, alone, shared_cores)
        point = predict(dep, workload, calibrated, rate, count=count)
        predicted = Latencies(point.ttft_p50_ms, point.tpot_p50_ms, point.ttft_p99_ms,
                              point.tpot_p99_ms)
        errors = {"ttft_p50": _error(predicted.ttft_p50_ms, measured.ttft_p50_ms),
                  "tpot_p50": _error(predicted.tpot_p50_ms, measured.tpot_p50_ms)}
        out.append({"config": dep.name, "deployment": asdict(dep), "rate": rate,
                    "requests": count, "predicted": asdict(predicted),
                    "measured": asdict(measured), "error": errors,
                    "within_target": all(e is not None and abs(e) <= TARGET_ERROR
                                         for e in errors.values()),
                    "calibration": {"requests": CALIBRATION_REQUESTS, "measured": asdict(alone),
                                    **overheads}})
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
                     f"{cal['step_overhead_ms']:.2f} ms{prefill}{shared}")
    return "\n".join(lines)


class StackRunner:
    """`pdserve up` for a configuration, `pdserve bench serve` against it, then stop it."""

    def __init__(self, model: str, workload: Workload, count: int, log_dir: Path,
                 ready_s: float = 300.0):
        shape = parse_arrivals(workload.arrivals)
        if shape == 0:
            raise ValueError("pdserve bench serve has no constant arrivals; use "
                             "--arrivals poisson or gamma:SHAPE")
        self.model, self.workload, self.count = model, workload, count
        self.burstiness = shape
        self.log_dir = log_dir
        self.ready_s = ready_s

    def __call__(self, dep: Deployment, rate: float) -> tuple[Latencies, Latencies]:
        name = dep.name.replace(" ", "-")
        with self._stack(dep, name) as (target, stack_pid):
            alone = self._bench(target, f"{name}-calibration", [
                "--concurrency", "1", "--num-requests", str(CALIBRATION_REQUESTS),
                "--seed", str(self.workload.seed + CALIBRATION_SEED)])
            busy = self._bench(target, f"{name}-cpu", [
                "--concurrency", str(CPU_CONCURRENCY), "--num-requests",
                str(2 * CPU_CONCURRENCY), "--seed", str(self.workload.seed + CPU_SEED),
                "--server-cpu", target])
            # where the processes beside the workers run depends on how busy each worker's
            # core is (the scheduler puts them on whichever core is free): sampled at the rate
            shared = self._bench(target, f"{name}-cores", [
                "--rate", f"{rate:g}", "--burstiness", f"{self.burstiness:g}",
                "--num-requests", str(min(self.count, SHARED_REQUESTS)),
                "--seed", str(self.workload.seed + CORES_SEED)], sample=stack_pid)
            alone = replace(alone, cpu_ms_per_token=busy.cpu_ms_per_token, shared=shared.shared)
            loaded = self._bench(target, name, [
                "--rate", f"{rate:g}", "--burstiness", f"{self.burstiness:g}",
                "--num-requests", str(self.count), "--seed", str(self.workload.seed)])
        return alone, loaded

    def _bench(self, target: str, name: str, flags: list[str],
               sample: int | None = None) -> Latencies:
        """One `pdserve bench serve` run; with `sample` (the stack's `pdserve up` pid), where
        the stack's processes and the client ran meanwhile (`Latencies.shared`)."""
        from pdserve.plan.cores import CoreSampler

        out = self.log_dir / f"bench-{name}.json"
        cmd = [*PDSERVE, "bench", "serve", "--target", target, "--model", self.model,
               "--workload", self.workload.spec, "--json", str(out), *flags]
        with (self.log_dir / f"bench-{name}.log").open("w+") as log, \
                CoreSampler([sample] if sample else []) as sampler:
            client = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
            if sample:
                sampler.add(client.pid)
            code = client.wait(timeout=3600)
            if code != 0:
                log.seek(0)
                raise RuntimeError(f"bench serve ({name}) failed:\n{log.read()[-4000:]}")
        summary = json.loads(out.read_text())["runs"][0]["summary"]
        ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
        cpu = [summary.get(k) for k in ("server_cpu_ms_per_token", "client_cpu_ms_per_token")]
        shared = _shared(sampler, client.pid, summary) if sample else None
        prefill = summary.get("components_ms", {}).get("prefill_ms", {}).get("p50")
        return Latencies(ttft["p50"], tpot["p50"], ttft["p99"], tpot["p99"],
                         sum(c for c in cpu if c is not None) if any(cpu) else None, shared,
                         prefill or None)

    @contextmanager
    def _stack(self, dep: Deployment, name: str) -> Iterator[tuple[str, int]]:
        from pdserve.bench.loadgen.procs import free_port_block, stop_group

        base = free_port_block(50)
        cmd = [*PDSERVE, "up", "--model", self.model, "--no-demo", "--http-port", str(base),
               "--port", str(base + 1), "--metrics-port", "-1", "--prefill-port",
               str(base + 10), "--decode-port", str(base + 20), "--agent-port", str(base + 30),
               "--colocated-port", str(base + 40)]
        cmd += ["--colocated"] if dep.mode == "colocated" else \
            ["--prefill", str(dep.num_prefill), "--decode", str(dep.num_decode)]
        env = {**os.environ, "PDSERVE_COLOCATED_CHUNK_SIZE": str(dep.chunk_size),
               "PDSERVE_PREFILL_CHUNK_SIZE": str(dep.chunk_size),
               "PDSERVE_DECODE_CHUNK_SIZE": str(dep.decode_chunk_size),
               "PDSERVE_ROUTER_REMOTE_PREFILL_MIN_TOKENS": str(dep.remote_prefill_min_tokens)}
        log = self.log_dir / f"up-{name}.log"
        with log.open("wb") as sink:
            proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        try:
            _wait_ready(f"http://127.0.0.1:{base}/health", proc, self.ready_s, log)
            yield f"127.0.0.1:{base + 1}", proc.pid
        finally:
            stop_group(proc)


def _shared(sampler: CoreSampler, client: int, summary: dict[str, object]
            ) -> dict[str, list[float]]:
    """Per worker role, the CPU per output token the other processes spent on its cores. The
    client's own CPU during the run (its start-up excluded) is the bench's
    `client_cpu_ms_per_token`, split over the cores as the sampler saw it run."""
    from pdserve.plan.cores import shared_by_worker

    tokens = int(cast(int, summary.get("output_tokens") or 0))
    cpu_s = {pid: dict(per_core) for pid, per_core in sampler.cpu_s.items()}
    seen = sum(cpu_s.get(client, {}).values())
    per_token = cast(float | None, summary.get("client_cpu_ms_per_token"))
    if seen > 0 and per_token is not None:
        scale = per_token * tokens / 1e3 / seen
        cpu_s[client] = {core: s * scale for core, s in cpu_s[client].items()}
    found = shared_by_worker(cpu_s, sampler.roles, sampler.cores, tokens)
    return {role: [ms, cores] for role, (ms, cores) in found.items()}


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout_s: float, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited ({proc.returncode}) before it was ready:\n"
                               + log.read_text()[-3000:])
        try:
            with urllib.request.urlopen(url, timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # polling a starting server's health, not synchronisation
    raise RuntimeError(f"{url} not ready within {timeout_s:.0f} s; log: {log}")


def measure_profiles(model: str, progress: bool) -> Profiles:
    """The model profiled with every core (a co-located worker) and with half of them (each
    worker of `pdserve up`'s disaggregated mode)."""
    from pdserve.common.config import parse_config
    from pdserve.common.cpus import cpu_allowance
    from pdserve.plan.measure import ProfileConfig, measure

    cores = cpu_allowance()
    whole, _ = measure(parse_config(ProfileConfig, "profile", ["--model", model, "--threads",
                                                                str(cores)]), progress)
    half = whole if cores == 1 else measure(parse_config(
        ProfileConfig, "profile", ["--model", model, "--threads", str(max(1, cores // 2))]),
        progress)[0]
    return Profiles(whole, half, half)


def machine_cores() -> float:
    """The cores this process may use (the stacks' workers, router and client share them)."""
    from pdserve.common.cpus import cpu_allowance

    return float(cpu_allowance())


def log_dir() -> Path:
    return Path(tempfile.mkdtemp(prefix="pdserve-plan-validate-"))
