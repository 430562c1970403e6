"""`pdserve`: one entry point, a subcommand per service plus up, generate, model and bench.

Each subcommand lives in its own module and is imported only when used, so `pdserve router`
never loads torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

from pdserve.common.models import BUILTIN_MODELS

COMMANDS: dict[str, tuple[str, str]] = {
    "up": ("pdserve.up", "run the whole stack on this machine (router, prefill, decode, agents)"),
    "generate": ("pdserve.client",
                 "send a prompt to a router, stream the text and the TTFT breakdown"),
    "router": ("pdserve.router.main", "the public API: Generate, placement, request lifecycle"),
    "prefill": ("pdserve.prefill.main", "a prefill worker: prompt -> KV pages + first token"),
    "decode": ("pdserve.decode.main", "a decode worker: paged KV pool, continuous batching"),
    "kvtransfer": ("pdserve.kvtransfer.main", "the per-host KV transfer agent (UCX or TCP)"),
    "colocated": ("pdserve.colocated.main",
                  "one engine doing prefill and decode (comparison baseline)"),
    "sim": ("pdserve.sim.host", "simulated prefill/decode workers (real protocols, profiled "
                                "times): a large pool for a real router on one machine"),
    "plan": ("pdserve.plan.command", "size prefill/decode pools: simulate configurations "
                                     "against a workload and SLOs, ranked by goodput"),
    "profile": ("pdserve.plan.measure", "time the engine's steps on this machine and write a "
                                        "profile for pdserve plan and pdserve sim"),
    "certs": ("pdserve.certs", "make a throwaway CA and certificates: pdserve certs create DIR"),
    "model": ("pdserve.engine.builtin",
              f"a built-in model ({'|'.join(BUILTIN_MODELS)}): pdserve model create NAME "
              "DIR, or pdserve model ensure NAME (the cached copy, made if missing)"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "engine": ("pdserve.bench.engine", "engine decode throughput vs transformers"),
    "kv": ("pdserve.bench.kv", "KV handoff throughput per transport vs raw TCP and memcpy"),
    "handoff": ("pdserve.bench.loadgen.handoff",
                "the KV handoff through the whole request path, as the router reports it (one "
                "page; long prompts)"),
    "router": ("pdserve.bench.router",
               "one router process in front of N simulated workers: req/s, router CPU per "
               "request and token, router-added latency, discovery, workers vanishing"),
    "tp": ("pdserve.bench.tp",
           "a long prompt's prefill with tensor parallelism (TP 2 on two cores) against TP 1 "
           "on one core and on both, with the all-reduce time"),
    "serve": ("pdserve.bench.loadgen.main",
              "latency, throughput and goodput of a deployment (gRPC or OpenAI API), side by "
              "side"),
}


def _usage(table: dict[str, tuple[str, str]], prog: str) -> str:
    width = max(len(name) for name in table)
    lines = [f"usage: {prog} COMMAND [options]   ({prog} COMMAND --help for its options)", "",
             "commands:"]
    lines += [f"  {name:<{width}}  {text}" for name, (_, text) in table.items()]
    return "\n".join(lines)


def _dispatch(table: dict[str, tuple[str, str]], prog: str, argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage(table, prog))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in table:
        print(f"{prog}: unknown command {name!r}\n\n{_usage(table, prog)}", file=sys.stderr)
        return 2
    module = importlib.import_module(table[name][0])
    return int(module.main(rest) or 0)


# OpenMP (torch's GEMMs and kernels) waits for the next parallel region by spinning ~300,000
# times by default. Where a process does not have its cores to itself (a loaded host, a pod's
# CPU quota) the spinning thread takes the CPU its peers need, and every region waits out a
# time slice: measured 2-3x slower decode on a loaded 2-core host. Too short a spin costs the
# other way: a step's ops are tens of microseconds apart (Python in between), and a thread
# that went to sleep between them must be woken for each. 20,000 (tens of microseconds)
# covers those gaps: measured on a 2-vCPU Zen 5, 32-sequence decode steps of 6.8 ms against
# 10.1 ms with a spin of 1,000 on free cores, and 19 ms against 16 ms (default: 21 ms) beside
# two busy processes. Set before torch loads; an explicit setting wins.
OPENMP_DEFAULTS = {"GOMP_SPINCOUNT": "20000"}


def _openmp_defaults() -> None:
    """Set OPENMP_DEFAULTS not set by the user; PDSERVE_OPENMP_DEFAULTS names those set here
    (so `bench engine --vs-vllm` can run vLLM with its own defaults)."""
    if "OMP_WAIT_POLICY" in os.environ or "PDSERVE_OPENMP_DEFAULTS" in os.environ:
        return
    chosen = [name for name in OPENMP_DEFAULTS if name not in os.environ]
    for name in chosen:
        os.environ[name] = OPENMP_DEFAULTS[name]
    os.environ["PDSERVE_OPENMP_DEFAULTS"] = ",".join(chosen)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    _openmp_defaults()
    if argv and argv[0] == "bench":
        if importlib.util.find_spec("pdserve.bench") is None:  # the deployment image has none
            print("pdserve bench: the benchmarks (pdserve.bench) are not installed here; install "
                  "pdserve from its source tree to run them", file=sys.stderr)
            return 2
        return _dispatch(BENCHES, "pdserve bench", argv[1:])
    if argv and argv[0] == "model":
        return _dispatch({"model": COMMANDS["model"]}, "pdserve", argv)
    table = {**COMMANDS,
             "bench": ("", "benchmarks: pdserve bench engine|kv|handoff|router|tp|serve")}
    return _dispatch(table, "pdserve", argv)


if __name__ == "__main__":
    sys.exit(main())
