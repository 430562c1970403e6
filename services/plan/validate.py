"""`pdserve plan --validate`: the plan's predictions set against real stacks on this machine.

For each configuration (co-located x1 and 1 prefill + 1 decode, the two this machine can
run), `pdserve up` runs it for real and `pdserve bench serve` sends it two runs:

1. calibration: `CALIBRATION_REQUESTS` requests one at a time (seed + 1000). What a serving
   stack adds to the engine's own times at no load (router, RPCs, streaming, the worker's loop)
   is what they took beyond the simulator's prediction for the same requests alone: the TPOT
   gap becomes the decode (or co-located) worker's `step_overhead_ms`, the TTFT gap left after
   it the `request_overhead_ms`. Then a closed-loop burst (`CPU_CONCURRENCY` in flight) gives
   the router's and the client's CPU per output token, which on this machine comes out of the
   workers' cores (`SimProfile.contention`);
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
from typing import cast

from pdserve.plan.cluster import Deployment, Profiles
from pdserve.plan.search import predict
from pdserve.plan.workload import Workload, parse_arrivals

CONFIGS = (Deployment("colocated", 0, 1), Deployment("disaggregated", 1, 1))
CALIBRATION_REQUESTS = 8
CALIBRATION_SEED = 1000  # added to the workload's seed
# The router's and the client's CPU per token is measured with this many requests in flight:
# one at a time, the router's fixed background work (health checks, Stats) over a slow run
# doubled it (1.0 ms per token against ~0.5)
CPU_CONCURRENCY = 8
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


# A configuration run for real: (its calibration, its run at the rate)
Runner = Callable[[Deployment, float], tuple[Latencies, Latencies]]


def _error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or not measured:
        return None
    return predicted / measured - 1


def calibrate(dep: Deployment, workload: Workload, profiles: Profiles, alone: Latencies,
              shared_cores: float = 0.0) -> tuple[Profiles, dict[str, float]]:
    """`profiles` with the serving overheads that make the calibration requests, one at a
    time, take what they measured (`alone`); and those overheads. With `shared_cores`, the
    router's and the client's CPU per token (`alone.cpu_ms_per_token`) is taken from the
    cores the workers run on (`SimProfile.contention`): they all share this machine."""
    if shared_cores and alone.cpu_ms_per_token is not None:
        profiles = replace(profiles, default=replace(
            profiles.default, shared_cpu_ms_per_token=alone.cpu_ms_per_token,
            shared_cores=shared_cores))
    requests = replace(workload, seed=workload.seed + CALIBRATION_SEED)
    role = "colocated" if dep.mode == "colocated" else "decode"

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
    if shared_cores and alone.cpu_ms_per_token is not None:
        found.update(shared_cpu_ms_per_token=alone.cpu_ms_per_token, shared_cores=shared_cores)
    return with_overheads(step, request), found


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
        lines.append(f"{row['config']}: serving overheads from {cal['requests']:.0f} requests "
                     f"alone: request {cal['request_overhead_ms']:.2f} ms, step "
                     f"{cal['step_overhead_ms']:.2f} ms{shared}")
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
        with self._stack(dep, name) as target:
            alone = self._bench(target, f"{name}-calibration", [
                "--concurrency", "1", "--num-requests", str(CALIBRATION_REQUESTS),
                "--seed", str(self.workload.seed + CALIBRATION_SEED)])
            busy = self._bench(target, f"{name}-cpu", [
                "--concurrency", str(CPU_CONCURRENCY), "--num-requests",
                str(2 * CPU_CONCURRENCY), "--seed", str(self.workload.seed + CALIBRATION_SEED),
                "--server-cpu", target])
            alone = replace(alone, cpu_ms_per_token=busy.cpu_ms_per_token)
            loaded = self._bench(target, name, [
                "--rate", f"{rate:g}", "--burstiness", f"{self.burstiness:g}",
                "--num-requests", str(self.count), "--seed", str(self.workload.seed)])
        return alone, loaded

    def _bench(self, target: str, name: str, flags: list[str]) -> Latencies:
        out = self.log_dir / f"bench-{name}.json"
        cmd = [*PDSERVE, "bench", "serve", "--target", target, "--model", self.model,
               "--workload", self.workload.spec, "--json", str(out), *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            raise RuntimeError(f"bench serve ({name}) failed:\n{done.stdout[-2000:]}\n"
                               f"{done.stderr[-2000:]}")
        summary = json.loads(out.read_text())["runs"][0]["summary"]
        ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
        cpu = [summary.get(k) for k in ("server_cpu_ms_per_token", "client_cpu_ms_per_token")]
        return Latencies(ttft["p50"], tpot["p50"], ttft["p99"], tpot["p99"],
                         sum(c for c in cpu if c is not None) if any(cpu) else None)

    @contextmanager
    def _stack(self, dep: Deployment, name: str) -> Iterator[str]:
        from pdserve.bench.loadgen.handoff import free_port_block, stop_group

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
            yield f"127.0.0.1:{base + 1}"
        finally:
            stop_group(proc)


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
