"""`pdserve bench tp`: a long prompt's prefill time with tensor parallelism, against one rank.

Three engines, each in a process of its own started with the cores it may use, interleaved
round by round on the same prompts: TP 1 on one core, TP 1 on both (two threads), and TP 2
(rank 0 on the first core, rank 1 on the second, one thread each, all-reduces through shared
memory as a worker's; `PDSERVE_TP_SHARED_REDUCE=0` in the environment: over gloo). Each times
the prefill of one prompt alone, from queued to first token sampled, through the prefill engine
as a prefill worker runs it (chunks of `--chunk-size`), and for TP 2 the all-reduce time inside
it (two per layer: after attention and after the MLP). The target: TP 2 >= 1.6x faster than TP
1 on one core for prompts of 2k tokens and more; the figure against TP 1 on both cores beside
it. Needs two cores; the model's heads must divide by 2 (the default `bench-152m`: 16 heads, 4
KV heads).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from typing import Any

TARGET = 1.6
CONFIGS = ("tp1-1core", "tp1-2cores", "tp2")


def measure(config: str, model: str, prompts: list[int], reps: int, chunk: int) -> dict[str, Any]:
    """In the child: one engine for `config`, every prompt `reps` times (after one warm-up)."""
    import torch
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.setup import build_engine

    cores = sorted(os.sched_getaffinity(0))[:2]
    tp = 2 if config == "tp2" else 1
    os.sched_setaffinity(0, cores[:1] if config != "tp1-2cores" else cores)
    torch.set_num_threads(2 if config == "tp1-2cores" else 1)
    engine, _ = build_engine(model, role="prefill", num_pages=max(prompts) // 16 + 8,
                             max_model_len=max(prompts) + 1, chunk_size=chunk,
                             max_prefill_tokens=chunk, prefix_caching=False, tp=tp,
                             tp_cores=[cores[:1], cores[1:2]] if tp == 2 else None)
    rng = random.Random(0)
    out: dict[str, Any] = {"config": config, "layers": engine.model.num_layers, "prompts": {}}
    try:
        for n in [min(prompts), *prompts]:  # the first: warm-up (kernels built per shape)
            times, reduce_ms, reduces = [], [], []
            for rep in range(reps):
                ids = [rng.randrange(5, 1000) for _ in range(n)]
                rid = f"{n}-{rep}"
                timer = getattr(engine.model.tp, "timer", None)
                if timer is not None:
                    timer.take()
                started = time.perf_counter()
                engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0))
                while not any(o.token is not None for o in engine.step()):
                    pass
                times.append((time.perf_counter() - started) * 1e3)
                engine.release_prefilled(rid)
                if timer is not None:
                    calls, seconds = timer.take()
                    reduce_ms.append(seconds * 1e3)
                    reduces.append(calls)
            out["prompts"][str(n)] = {"ms": times, "allreduce_ms": reduce_ms,
                                      "allreduces": reduces}
    finally:
        engine.close()
    return out


def run(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Each config in its own process, config after config, `--rounds` times."""
    results: dict[str, dict[str, Any]] = {}
    for _ in range(args.rounds):
        for config in CONFIGS:
            print(f"  {config} ...", file=sys.stderr, flush=True)
            child = subprocess.run(
                [sys.executable, "-m", "pdserve.bench.tp", "--one", config, "--model", args.model,
                 "--prompts", args.prompts, "--reps", str(args.reps), "--chunk-size",
                 str(args.chunk_size)], capture_output=True, text=True, check=False)
            if child.returncode != 0:
                raise RuntimeError(f"{config} failed:\n{child.stderr[-3000:]}")
            got = json.loads(child.stdout.strip().splitlines()[-1])
            mine = results.setdefault(config, {"layers": got["layers"], "prompts": {}})
            for n, r in got["prompts"].items():
                into = mine["prompts"].setdefault(n, {"ms": [], "allreduce_ms": []})
                into["ms"] += r["ms"]
                into["allreduce_ms"] += r["allreduce_ms"]
    return results


def report(results: dict[str, dict[str, Any]], prompts: list[int]) -> str:
    med = {c: {n: statistics.median(results[c]["prompts"][str(n)]["ms"]) for n in prompts}
           for c in CONFIGS}
    layers = results["tp2"]["layers"]
    head = (f"{'tokens':>6} {'TP1 1 core':>11} {'TP1 2 cores':>12} {'TP2':>9} "
            f"{'TP2 vs 1 core':>13} {'vs 2 cores':>10} {'all-reduce':>10} {'per layer':>9} "
            f"{'share':>6}")
    lines = [head, "-" * len(head)]
    verdicts = []
    for n in prompts:
        one, two, tp2 = med["tp1-1core"][n], med["tp1-2cores"][n], med["tp2"][n]
        reduce_ms = statistics.median(results["tp2"]["prompts"][str(n)]["allreduce_ms"])
        lines.append(f"{n:>6} {one:>9.1f}ms {two:>10.1f}ms {tp2:>7.1f}ms {one / tp2:>12.2f}x "
                     f"{two / tp2:>9.2f}x {reduce_ms:>8.1f}ms {reduce_ms / layers:>7.2f}ms "
                     f"{reduce_ms / tp2:>6.1%}")
        if n >= 2048:
            verdicts.append(f"target TP 2 >= {TARGET}x TP 1 on one core at {n} tokens: "
                            f"{one / tp2:.2f}x {'ok' if one / tp2 >= TARGET else 'BELOW'} "
                            f"(against TP 1 on both cores: {two / tp2:.2f}x)")
    lines.append("prefill of one prompt alone, queued -> first token, medians; all-reduce: "
                 "time rank 0 spent in them during the prefill (per layer: two all-reduces)")
    return "\n".join(lines + verdicts)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench tp", description=__doc__)
    p.add_argument("--model", default="bench-152m", help="built-in size or a model directory")
    p.add_argument("--prompts", default="1024,2048,4000",
                   help="prompt lengths, comma-separated (each below the model's context: "
                   "bench-152m's is 4,096)")
    p.add_argument("--reps", type=int, default=2, help="prefills per prompt length per round")
    p.add_argument("--rounds", type=int, default=2, help="times the three configs alternate")
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (as the workers)")
    p.add_argument("--json", help="also write every sample to this file")
    p.add_argument("--one", choices=CONFIGS, help=argparse.SUPPRESS)  # the child's config
    args = p.parse_args(argv)
    try:
        args.prompt_list = [int(x) for x in args.prompts.split(",") if x]
    except ValueError:
        p.error(f"--prompts {args.prompts!r}: not comma-separated integers")
    if not args.prompt_list or min(args.prompt_list) <= 0 or args.reps <= 0 or args.rounds <= 0:
        p.error("--prompts, --reps and --rounds must be positive")
    if not args.one and len(os.sched_getaffinity(0)) < 2:
        p.error("needs two cores (this process may use "
                f"{len(os.sched_getaffinity(0))})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.model, args.prompt_list, args.reps,
                                 args.chunk_size)))
        return 0
    cores = sorted(os.sched_getaffinity(0))[:2]
    print(f"pdserve bench tp: model {args.model}, cores {cores}, prompts {args.prompts}, "
          f"{args.rounds} rounds x {args.reps} reps", file=sys.stderr)
    try:
        results = run(args)
    except KeyboardInterrupt:
        return 130
    print(f"host: {os.cpu_count()} CPUs (cores {cores}); model {args.model}; chunk "
          f"{args.chunk_size}; configs interleaved, {args.rounds} rounds x {args.reps} reps")
    print(report(results, args.prompt_list))
    if args.json:
        with open(args.json, "w") as out:
            json.dump(results, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
