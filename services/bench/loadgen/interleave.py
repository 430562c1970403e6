"""The same requests against several targets, side by side: split into rounds that every target
runs in turn (the order reversed every other round), so load that drifts on a shared machine
weighs on every target alike; optionally with the CPU seconds a server process spent during
each target's rounds (`--server-cpu`: the router serving both APIs, say)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from pdserve.bench.loadgen.cpu import cpu_seconds
from pdserve.bench.loadgen.runner import Plan, run, warm_up
from pdserve.bench.loadgen.stats import RequestRecord, Slo, summarize
from pdserve.bench.loadgen.targets import Target


@dataclasses.dataclass
class Tally:
    records: list[RequestRecord] = dataclasses.field(default_factory=list)
    seconds: float = 0.0
    cpu_s: float = 0.0
    client_cpu_s: float = 0.0


def measure(targets: Sequence[Target], plan: Plan, slo: Slo | None = None, rounds: int = 1,
            cpu_pid: int | None = None) -> list[tuple[str, dict[str, Any], list[RequestRecord]]]:
    """(target name, summary, records) per target. Warm-up requests go to every target first
    and are not measured. Each summary has `client_cpu_ms_per_token` (this process's CPU per
    output token: clients differ too); with `cpu_pid`, `server_cpu_s` (that process's user +
    system CPU during the target's rounds) and `server_cpu_ms_per_token`."""
    for target in targets:
        warm_up(target, plan)
    count = len(plan.shapes)
    rounds = max(1, min(rounds, count))
    bounds = [count * r // rounds for r in range(rounds + 1)]
    tallies = {target.name: Tally() for target in targets}
    for r in range(rounds):
        part = dataclasses.replace(plan, shapes=plan.shapes[bounds[r]:bounds[r + 1]],
                                   seed=plan.seed + r, warmup=0)
        for target in (targets if r % 2 == 0 else list(reversed(targets))):
            tally = tallies[target.name]
            before = cpu_seconds(cpu_pid) if cpu_pid is not None else 0.0
            client_before = time.process_time()
            records, took = run(target, part, "bench serve" if rounds == 1 else
                                f"round {r + 1}/{rounds}", progress=rounds == 1)
            tally.client_cpu_s += time.process_time() - client_before
            if cpu_pid is not None:
                tally.cpu_s += cpu_seconds(cpu_pid) - before
            for record in records:
                record.index += bounds[r]
            tally.records += records
            tally.seconds += took
    out = []
    for target in targets:
        tally = tallies[target.name]
        summary = summarize(tally.records, tally.seconds, slo)
        tokens = int(summary["output_tokens"])  # type: ignore[call-overload]
        summary["client_cpu_ms_per_token"] = (tally.client_cpu_s * 1e3 / tokens if tokens
                                              else None)
        if cpu_pid is not None:
            summary["server_cpu_s"] = tally.cpu_s
            summary["server_cpu_ms_per_token"] = tally.cpu_s * 1e3 / tokens if tokens else None
        out.append((target.name, summary, tally.records))
    return out
