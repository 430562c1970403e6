"""The real side of `pdserve plan --validate`: `pdserve up` runs each configuration on this
machine and `pdserve bench serve` sends it the calibration runs and the measured ones
(`pdserve.plan.validate` says what each is for); the runs' logs and JSON go to a directory that
is removed when the validation succeeds and named when it fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

from pdserve.plan import steps
from pdserve.plan.cluster import Deployment, Profiles
from pdserve.plan.validate import (
    CALIBRATION_REQUESTS,
    CALIBRATION_SEED,
    CORES_SEED,
    CPU_CONCURRENCY,
    CPU_SEED,
    Latencies,
    repeat_seeds,
)
from pdserve.plan.workload import Workload, parse_arrivals

if TYPE_CHECKING:
    from pdserve.plan.cores import CoreSampler

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


class StackRunner:
    """`pdserve up` for a configuration, `pdserve bench serve` against it, then stop it."""

    def __init__(self, model: str, workload: Workload, count: int, log_dir: Path,
                 ready_s: float = 300.0, repeats: int = 1):
        if repeats < 1:
            raise ValueError(f"--validate-repeats={repeats}: at least 1")
        shape = parse_arrivals(workload.arrivals)
        if shape == 0:
            raise ValueError("pdserve bench serve has no constant arrivals; use "
                             "--arrivals poisson or gamma:SHAPE")
        self.model, self.workload, self.count = model, workload, count
        self.burstiness = shape
        self.log_dir = log_dir
        self.ready_s = ready_s
        self.seeds = repeat_seeds(workload.seed, repeats)

    def __call__(self, dep: Deployment, rate: float) -> tuple[Latencies, list[Latencies]]:
        name = dep.name.replace(" ", "-")
        with self._stack(dep, name) as (target, stack_pid, worker_metrics):
            alone = self._bench(target, f"{name}-calibration", [
                "--concurrency", "1", "--num-requests", str(CALIBRATION_REQUESTS),
                "--seed", str(self.workload.seed + CALIBRATION_SEED)])
            busy = self._bench(target, f"{name}-cpu", [
                "--concurrency", str(CPU_CONCURRENCY), "--num-requests",
                str(2 * CPU_CONCURRENCY), "--seed", str(self.workload.seed + CPU_SEED),
                "--server-cpu", target])
            # where the processes beside the workers run depends on how busy each worker's
            # core is (the scheduler puts them on whichever core is free): sampled at the rate
            # and what the decode (co-located) worker's steps took meanwhile (no warm-up
            # requests: the stack is warm, and the totals are the run's alone)
            before = steps.scrape(worker_metrics)
            shared = self._bench(target, f"{name}-cores", [
                "--rate", f"{rate:g}", "--burstiness", f"{self.burstiness:g}",
                "--num-requests", str(self.count), "--warmup", "0",
                "--seed", str(self.workload.seed + CORES_SEED)], sample=stack_pid)
            alone = replace(alone, cpu_ms_per_token=busy.cpu_ms_per_token, shared=shared.shared,
                            steps=steps.scrape(worker_metrics).minus(before))
            loaded = [self._bench(target, name if i == 0 else f"{name}-{i + 1}", [
                "--rate", f"{rate:g}", "--burstiness", f"{self.burstiness:g}",
                "--num-requests", str(self.count), "--seed", str(seed)])
                for i, seed in enumerate(self.seeds)]
        return alone, loaded

    def _bench(self, target: str, name: str, flags: list[str],
               sample: int | None = None) -> Latencies:
        """One `pdserve bench serve` run; with `sample` (the stack's `pdserve up` pid), where
        the stack's processes and the client ran meanwhile (`Latencies.shared`)."""
        from pdserve.plan.cores import CoreSampler

        out = self.log_dir / f"bench-{name}.json"
        cmd = [*PDSERVE, "bench", "serve", "--target", target, "--model", self.model,
               "--workload", self.workload.spec, "--json", str(out), *flags]
        # no sampler thread (it rescans /proc) beside the runs that are not sampled
        sampler = CoreSampler([sample]) if sample else None
        with (self.log_dir / f"bench-{name}.log").open("w+") as log, sampler or nullcontext():
            client = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
            if sampler is not None:
                sampler.add(client.pid)
            code = client.wait(timeout=3600)
            if code != 0:
                log.seek(0)
                raise RuntimeError(f"bench serve ({name}) failed:\n{log.read()[-4000:]}")
        summary = json.loads(out.read_text())["runs"][0]["summary"]
        ttft, tpot = summary["ttft_ms"], summary["tpot_ms"]
        cpu = [summary.get(k) for k in ("server_cpu_ms_per_token", "client_cpu_ms_per_token")]
        shared = _shared(sampler, client.pid, summary) if sampler is not None else None
        prefill = summary.get("components_ms", {}).get("prefill_ms", {}).get("p50")
        return Latencies(ttft["p50"], tpot["p50"], ttft["p99"], tpot["p99"],
                         sum(c for c in cpu if c is not None) if any(cpu) else None, shared,
                         prefill or None)

    @contextmanager
    def _stack(self, dep: Deployment, name: str) -> Iterator[tuple[str, int, str]]:
        """(the router's address, `pdserve up`'s pid, the decode or co-located worker's
        /metrics URL)"""
        from pdserve.bench.loadgen.procs import free_port_block, stop_group, wait_http
        from pdserve.up import metrics_offset

        base, metrics = free_port_block(50), free_port_block(50)
        worker = "colocated" if dep.mode == "colocated" else "decode-0"
        cmd = [*PDSERVE, "up", "--model", self.model, "--no-demo", "--http-port", str(base),
               "--port", str(base + 1), "--metrics-port", str(metrics), "--prefill-port",
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
            wait_http(f"http://127.0.0.1:{base}/health", proc, self.ready_s, log, "pdserve up")
            yield (f"127.0.0.1:{base + 1}", proc.pid,
                   f"http://127.0.0.1:{metrics + metrics_offset(worker)}/metrics")
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
