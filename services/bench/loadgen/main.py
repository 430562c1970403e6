"""`pdserve bench serve`: latency, throughput and goodput of a serving deployment.

    pdserve bench serve --target localhost:50051 --workload fixed:256,128 --concurrency 8
    pdserve bench serve --target http://localhost:8000/v1 --rate 4 --slo ttft:500,tpot:50
    pdserve bench serve --target grpc://a:50051 --target http://b:8000/v1 --compare ...
    pdserve bench serve --target localhost:50051 --sweep 1,2,4,8 --slo ttft:500,tpot:50

Targets: a pdserve router over gRPC (`HOST:PORT` or `grpc://HOST:PORT`; its TTFT components are
recorded) or any OpenAI-compatible server (`http://HOST:PORT/v1`: pdserve's HTTP API, vLLM,
SGLang). Every request is greedy with EOS ignored, its prompt given as token ids of exactly
the workload's length (the vocabulary comes from `--model`), so the same seed sends the same
requests to every target.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path
from typing import Any

from pdserve.bench.loadgen import report, sessions
from pdserve.bench.loadgen.arrivals import Arrivals
from pdserve.bench.loadgen.cpu import pid_listening_on
from pdserve.bench.loadgen.interleave import measure
from pdserve.bench.loadgen.runner import Plan, run
from pdserve.bench.loadgen.stats import RequestRecord, Slo, max_rate_at, summarize
from pdserve.bench.loadgen.targets import Target, make_target
from pdserve.bench.loadgen.workload import Vocabulary, parse_workload, shapes
from pdserve.client import add_security_flags, security_from_args

WORKLOAD_HELP = ("fixed:IN,OUT | uniform:IN_LO-IN_HI,OUT_LO-OUT_HI | chat[:IN_MEDIAN,OUT_MEDIAN] "
                 "(long-tailed) | mixed:SHORT,LONG,SHARE,OUT (SHARE of prompts are LONG) | "
                 "prefix:PREFIX,SUFFIX,OUT[,GROUPS] (a shared PREFIX, unique SUFFIXes) | "
                 "multiturn:TURNS,FIRST,ADD,OUT (conversations re-sending their history plus "
                 "ADD tokens each turn, turns in order; TTFT per turn and the server's cache "
                 "hit rate are reported)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", required=True,
                   help="HOST:PORT / grpc://HOST:PORT (pdserve router) or http://HOST:PORT/v1 "
                        "(OpenAI-compatible); repeat with --compare")
    p.add_argument("--compare", action="store_true",
                   help="run the same workload against every --target and print ratios")
    p.add_argument("--model", default="tiny",
                   help="model directory (or tiny/small) whose tokenizer.json gives the prompt "
                        "vocabulary (default tiny); also the OpenAI model name unless "
                        "--served-model is given")
    p.add_argument("--served-model", help="model name for OpenAI targets (default: the first "
                                          "listed by /v1/models)")
    p.add_argument("--workload", default="fixed:256,128", help=WORKLOAD_HELP)
    p.add_argument("--num-requests", type=int, default=100, help="measured requests (default 100)")
    p.add_argument("--warmup", type=int, default=2,
                   help="unrecorded requests first, of the workload's lengths but prompts of "
                   "their own (none of the measured prompts is cached by them; default 2)")
    p.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    p.add_argument("--rate", type=float, help="open loop: requests per second")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of inter-arrival times: 1 = Poisson, < 1 burstier")
    p.add_argument("--sweep", help="comma-separated rates: one open-loop run per rate, SLO "
                                   "attainment per rate (needs --slo)")
    p.add_argument("--slo", help="objectives in ms, e.g. ttft:500,tpot:50[,e2e:10000]")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-duration", type=float, default=600.0,
                   help="stop sending after this many seconds per run (default 600)")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, s (default 300)")
    p.add_argument("--max-context", type=int, help="clip prompt + output to this many tokens")
    p.add_argument("--interleave", type=int, default=1, metavar="ROUNDS",
                   help="with --compare: split the requests into ROUNDS rounds that every target "
                        "runs in turn, so drifting load on a shared machine weighs on all alike")
    p.add_argument("--server-cpu", metavar="HOST:PORT",
                   help="also report the CPU seconds (per output token) of the local process "
                        "listening on HOST:PORT during each target's requests (from /proc)")
    p.add_argument("--json", type=Path, help="write every record and the summaries here")
    p.add_argument("--plots", type=Path,
                   help="PNG prefix for latency CDFs, TTFT breakdown, attainment vs rate")
    add_security_flags(p)  # --tls, --tls-ca, ..., --api-key (env PDSERVE_API_KEY)
    return p.parse_args(argv)


def _main_sessions(args: argparse.Namespace) -> int:
    """prefix and multiturn workloads: closed loop over sessions, each target in turn."""
    try:
        sessions.parse(args.workload)
        if args.rate or args.sweep or args.interleave != 1:
            raise ValueError(f"{args.workload.partition(':')[0]} workloads run closed loop: "
                             "--concurrency only (no --rate, --sweep or --interleave)")
        vocab = vocabulary(args.model)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 2
    plan = sessions.sessions(args.workload, args.num_requests, args.seed, vocab)
    concurrency = args.concurrency or 4
    warm = Plan(shapes("fixed:16,4", args.warmup, args.seed + 99), vocab,
                Arrivals.parse(1, None, 1.0), seed=args.seed + 99, warmup=0)
    runs: list[tuple[str, dict[str, Any], list[RequestRecord]]] = []
    for spec in args.target:
        try:
            target = make_target(spec, args.served_model, security_from_args(args), args.api_key)
        except (ValueError, ConnectionError, OSError) as exc:
            print(f"pdserve bench serve: target {spec}: {exc}", file=sys.stderr)
            return 2
        try:
            if args.warmup:
                run(target, warm, "warm-up", progress=False)
            records, took = sessions.run_sessions(target, plan, concurrency, args.timeout,
                                                  args.max_duration)
        finally:
            target.close()
        runs.append((target.name, summarize(records, took), records))
    print()
    print(f"workload {args.workload}, {sum(len(s.turns) for s in plan)} requests in "
          f"{len(plan)} sessions, {concurrency} at once, seed {args.seed}")
    print(report.table([(name, summary) for name, summary, _ in runs]))
    if args.json:
        meta = {"workload": args.workload, "num_requests": args.num_requests, "seed": args.seed,
                "concurrency": concurrency, "machine": platform.machine(),
                "processor": _cpu_flags(), "time": time.time()}
        report.write_json(args.json, meta, runs)
        print(f"records and summaries: {args.json}")
    return 0 if all(s["completed"] == s["requests"] for _, s, _ in runs) else 1


def vocabulary(model: str) -> Vocabulary:
    from pdserve.common.models import resolve_model_name
    from pdserve.router.main import model_dir

    return Vocabulary.from_model_dir(model_dir(resolve_model_name(model)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if sessions.is_session_workload(args.workload):
        return _main_sessions(args)
    try:
        parse_workload(args.workload)
        slo = Slo.parse(args.slo) if args.slo else None
        rates = [float(r) for r in args.sweep.split(",")] if args.sweep else []
        if rates and slo is None:
            raise ValueError("--sweep needs --slo (attainment is measured against it)")
        if len(args.target) > 1 and not args.compare:
            raise ValueError("several --target values need --compare")
        if args.num_requests <= 0:
            raise ValueError(f"--num-requests={args.num_requests}: must be > 0")
        arrivals = Arrivals.parse(args.concurrency, args.rate if not rates else rates[0],
                                  args.burstiness)
        if args.interleave < 1 or (args.interleave > 1 and (not args.compare or rates)):
            raise ValueError(f"--interleave={args.interleave}: >= 1, and > 1 only with "
                             "--compare (no --sweep)")
        cpu_pid = pid_listening_on(args.server_cpu) if args.server_cpu else None
        vocab = vocabulary(args.model)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 2
    plan = Plan(shapes(args.workload, args.num_requests, args.seed, args.max_context), vocab,
                arrivals, seed=args.seed, warmup=args.warmup, max_duration_s=args.max_duration,
                timeout_s=args.timeout)
    runs: list[tuple[str, dict[str, Any], list[RequestRecord]]] = []
    sweeps: list[tuple[str, list[float], list[float]]] = []
    targets: list[Target] = []
    try:
        for spec in args.target:
            try:
                targets.append(make_target(spec, args.served_model, security_from_args(args),
                                           args.api_key))
            except (ValueError, ConnectionError, OSError) as exc:
                print(f"pdserve bench serve: target {spec}: {exc}", file=sys.stderr)
                return 2
        if not rates:
            runs = measure(targets, plan, slo, args.interleave, cpu_pid)
        for target in targets if rates else []:
            attainment = []
            for rate in rates:
                arrivals = Arrivals(rate=rate, burstiness=args.burstiness)
                point = Plan(**{**plan.__dict__, "arrivals": arrivals})
                records, took = run(target, point, f"rate {rate:g}")
                summary = summarize(records, took, slo)
                attainment.append(float(summary["attainment"]))  # type: ignore[arg-type]
                runs.append((f"{target.name} @{rate:g}/s", summary, records))
            best = max_rate_at(rates, attainment)
            sweeps.append((target.name, rates, attainment))
            print(f"{target.name}: highest rate with >= 90% SLO attainment ({slo}): "
                  f"{'none measured' if best is None else f'{best:.2f} req/s'}")
    finally:
        for target in targets:
            target.close()
    print()
    print(f"workload {args.workload}, {args.num_requests} requests, "
          f"{arrivals if not rates else 'sweep'}, "
          f"seed {args.seed}"
          + (f", interleaved in {args.interleave} rounds" if args.interleave > 1 else "")
          + (f", server CPU of pid {cpu_pid} ({args.server_cpu})" if cpu_pid else ""))
    print(report.table([(name, summary) for name, summary, _ in runs]))
    meta = {"workload": args.workload, "num_requests": args.num_requests, "seed": args.seed,
            "arrivals": str(arrivals), "slo": str(slo) if slo else None, "sweep": rates,
            "machine": platform.machine(), "processor": _cpu_flags(), "time": time.time()}
    if args.json:
        report.write_json(args.json, meta, runs)
        print(f"records and summaries: {args.json}")
    if args.plots:
        written = report.plots(args.plots, runs, sweeps)
        print("plots: " + (", ".join(map(str, written)) if written
                           else "none (install matplotlib for plots)"))
    return 0 if all(s["completed"] for _, s, _ in runs) else 1


def _cpu_flags() -> str:
    """The CPU model and its SIMD flags (figures are only comparable within one machine)."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")]
    return f"{model} ({' '.join(simd)})"


if __name__ == "__main__":
    sys.exit(main())

