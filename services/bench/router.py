"""`pdserve bench router`: how many requests and workers one router process drives.

    pdserve bench router --workers 1000 --rate 500 --duration 20 --json router.json

A real router process (pinned to --router-cpus) in front of N simulated workers (`pdserve
sim`, half prefill, half decode, each on its own loopback address), driven by an open-loop
load of short requests from this process (gRPC Generate; `--api http`: the OpenAI-compatible
API's streamed /v1/completions). Reported, over the measured window:

- sustained requests/s and tokens/s, failures by error;
- router CPU per request and per streamed token (from /proc), and how busy its cores were;
- router-added latency: the client's E2E minus the time the simulated workers spent on the
  request (their ledger: the Prefill call and the Decode sequence, received to answered), so
  what remains is the router, the gRPC hops and the client's own overhead (p50/p99);
- discovery: router start -> SERVING, -> all N workers healthy, and load start -> all used;
- then --vanish of the workers are killed at once (SIGKILL) and the load goes on for
  --vanish-seconds: requests failed, and how long until the router counts them unhealthy.

The harness (simulated workers and the load) runs on the other cores; its busy share and how
late it sent requests are printed too: a saturated harness, not the router, may be the limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from pdserve.bench.loadgen.procs import free_port
from pdserve.bench.router_http import HttpLoad
from pdserve.bench.router_load import Shot, drive, prompt_ids
from pdserve.bench.router_report import Window, cpu_seconds, machine, summarize
from pdserve.common.heap import no_collection
from pdserve.common.stream_interval import MAX_INTERVAL
from pdserve.processes import Proc, Stack, _signal_group

FIRST_ADDRESS = "127.61.0.1"      # the stable workers; the vanishing ones from VANISH_ADDRESS
VANISH_ADDRESS = "127.62.0.1"
FLOORS = ("aio", "sync", "native")  # --floor: router_floor.py's kinds, csrc/router_floor.cc


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench router", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=100,
                   help="simulated workers in all, half prefill and half decode (default 100)")
    p.add_argument("--rate", type=float, default=100.0, help="requests per second (default 100)")
    p.add_argument("--duration", type=float, default=10.0,
                   help="measured seconds (default 10), after --warmup seconds")
    p.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds first (2)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length (default 32)")
    p.add_argument("--output-tokens", type=int, default=8, help="tokens per answer (default 8)")
    p.add_argument("--vanish", type=float, default=0.1,
                   help="share of the workers killed at once after the window (default 0.1; "
                        "0: none)")
    p.add_argument("--vanish-seconds", type=float, default=5.0,
                   help="seconds of load after the kill (default 5)")
    p.add_argument("--router-cpus", default="",
                   help="cores for the router, e.g. 0 (default: core 0 when there are 2 or "
                        "more; the harness gets the others)")
    p.add_argument("--harness-cpus", default="",
                   help="cores for the simulated workers and the load generator (default: "
                        "those the router does not get); they may include the router's, to "
                        "offer a router far cheaper than the harness (the native floor) more "
                        "than one harness core can: its CPU per request still counts alone, "
                        "its latency then shares a core")
    p.add_argument("--profile", default="", help="SimProfile JSON for the simulated workers")
    p.add_argument("--model", default="", help="model directory of the router's tokenizer "
                                               "(default: the built-in tiny model)")
    p.add_argument("--router-arg", action="append", default=[],
                   help="an extra router flag, e.g. --router-arg=--health-interval-s=5 "
                        "(repeatable)")
    p.add_argument("--floor", nargs="?", const=",".join(FLOORS), default="",
                   metavar="KINDS",
                   help="then run the same load through the least a router can do, each in "
                        "front of its own simulated workers, and print pdserve's cost beside "
                        "theirs: aio and sync (pdserve.bench.router_floor, Python gRPC), "
                        "native (csrc/router_floor.cc, C++ gRPC: built on first use, needs "
                        "libgrpc++-dev and protobuf-compiler-grpc); default all, or a "
                        "comma-separated subset")
    p.add_argument("--api", choices=("grpc", "http"), default="grpc",
                   help="what the load calls: the router's gRPC Generate (default) or its "
                        "OpenAI-compatible HTTP API (streamed /v1/completions on keep-alive "
                        "connections); pdserve's router only, not the floors")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens a message after the first, for pdserve's router "
                        "(--stream-interval) and the floors alike (default 1: every token)")
    p.add_argument("--remote-prefill-min-tokens", type=int, default=0, metavar="T",
                   help="prompts shorter than T are prefilled on the decode worker (no Prefill "
                        "call), for pdserve's router and the floors alike (default 0: none)")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrivals and the prompt")
    args = p.parse_args(argv)
    if args.workers < 2:
        p.error(f"--workers {args.workers}: at least 2 (a prefill and a decode worker)")
    try:
        _cores(args.router_cpus, args.harness_cpus)
    except SystemExit as exc:
        p.error(str(exc).removeprefix("pdserve bench router: "))
    args.floor = [k for k in args.floor.split(",") if k]
    for kind in args.floor:
        if kind not in FLOORS:
            p.error(f"--floor {kind}: not a floor ({', '.join(FLOORS)})")
    if args.floor and args.api != "grpc":
        p.error(f"--api {args.api} with --floor: the floor routers serve gRPC only")
    if not 0 <= args.stream_interval <= MAX_INTERVAL:
        p.error(f"--stream-interval {args.stream_interval}: must be 0..{MAX_INTERVAL}")
    if args.remote_prefill_min_tokens < 0:
        p.error(f"--remote-prefill-min-tokens {args.remote_prefill_min_tokens}: must be >= 0")
    for flag in ("--stream-interval", "--remote-prefill-min-tokens"):
        if any(a.split("=")[0] == flag for a in args.router_arg):
            p.error(f"--router-arg={flag}: give the bench's {flag} (the floors take it too)")
    if args.rate <= 0 or args.duration <= 0 or args.warmup < 0:
        p.error("--rate and --duration must be > 0, --warmup >= 0")
    if not 0 <= args.vanish < 1:
        p.error(f"--vanish {args.vanish}: a share in [0, 1)")
    if args.prompt_tokens < 1 or args.output_tokens < 1:
        p.error("--prompt-tokens and --output-tokens must be >= 1")
    return args


def _cores(spec: str, harness_spec: str = "") -> tuple[list[int], list[int]]:
    """(router cores, harness cores) out of this process's own."""
    mine = sorted(os.sched_getaffinity(0))

    def parse(flag: str, value: str) -> list[int]:
        cores = [int(c) for c in value.split(",") if c.strip()]
        if not cores or not set(cores) <= set(mine):
            raise SystemExit(f"pdserve bench router: {flag} {value}: not all of {mine}")
        return cores

    router = parse("--router-cpus", spec) if spec else mine[:1] if len(mine) > 1 else []
    if harness_spec:
        return router, parse("--harness-cpus", harness_spec)
    return router, [c for c in mine if c not in router] or mine


def _split(total: int, share: float) -> tuple[int, int, int, int]:
    """(stable prefill, stable decode, vanishing prefill, vanishing decode)."""
    prefill, decode = total // 2, total - total // 2
    gone_p, gone_d = round(prefill * share), round(decode * share)
    return prefill - gone_p, decode - gone_d, gone_p, gone_d


def _samples(metrics_url: str, family: str) -> list[Any]:
    """The samples of one metric family on the router's /metrics (raises OSError)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(metrics_url, timeout=2) as reply:
        text = reply.read().decode()
    return [s for f in text_string_to_metric_families(text) if f.name == family
            for s in f.samples]


def _healthy(metrics_url: str) -> float:
    """Workers the router counts healthy (both roles), from its /metrics."""
    return float(sum(s.value for s in _samples(metrics_url, "pdserve_workers_healthy")))


def _cache_index(metrics_url: str) -> dict[str, int] | None:
    """Workers the router's prefix-cache index knows, and the pages it says they hold."""
    try:
        samples = _samples(metrics_url, "pdserve_router_cache_index_pages")
    except OSError:
        return None
    return {"workers": len(samples), "pages": int(sum(s.value for s in samples))}


GC_SLOTS = {"pdserve_gc_pause_seconds_count": 0, "pdserve_gc_pause_seconds_sum": 1}


def _gc_pauses(metrics_url: str) -> dict[str, list[float]]:
    """The router's garbage-collection pauses so far, per generation: [collections, seconds]
    (pdserve_gc_pause_seconds); {} when it has no /metrics (a floor)."""
    try:
        samples = _samples(metrics_url, "pdserve_gc_pause_seconds")
    except OSError:
        return {}
    found: dict[str, list[float]] = {}
    for s in samples:
        if s.name in GC_SLOTS:
            found.setdefault(s.labels["generation"], [0.0, 0.0])[GC_SLOTS[s.name]] = s.value
    return found


def _wait_healthy(metrics_url: str, want: float, timeout_s: float, fewer: bool = False
                  ) -> float | None:
    """Seconds until the router counts `want` healthy workers (`fewer`: at most `want`);
    None if not within `timeout_s`. Polls every 0.1 s (a measurement, not a handshake)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        try:
            count = _healthy(metrics_url)
        except OSError:
            count = -1.0
        if count >= 0 and (count <= want if fewer else count >= want):
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def _sim(name: str, prefill: int, decode: int, first: str, ports: tuple[int, int],
         profile: str, ledger: Path, cpus: list[int]) -> Proc:
    argv = [sys.executable, "-m", "pdserve.sim.host", "--prefill", str(prefill),
            "--decode", str(decode),
            "--first-address", first, "--prefill-port", str(ports[0]),
            "--decode-port", str(ports[1]), "--timings-file", str(ledger)]
    argv += ["--profile", profile] if profile else []
    port = ports[0] if prefill else ports[1]
    return Proc(name, f"{first}:{port}", argv, cpus=cpus)


def _addresses(first: str, count: int, port: int) -> list[str]:
    import ipaddress

    start = ipaddress.IPv4Address(first)
    return [f"{start + i}:{port}" for i in range(count)]


def _router_argv(kind: str, model: str, prefill: list[str], decode: list[str],
                 ports: tuple[int, int, int], args: argparse.Namespace) -> list[str]:
    """The router's command line; `ports`: its gRPC, metrics and HTTP (-1: none) ports."""
    common = ["--port", str(ports[0]), "--prefill", ",".join(prefill), "--decode",
              ",".join(decode), "--stream-interval", str(args.stream_interval),
              "--remote-prefill-min-tokens", str(args.remote_prefill_min_tokens)]
    if kind == "native":
        from pdserve.bench.native_floor import binary

        return [str(binary()), *common]
    if kind != "pdserve":  # a floor: no metrics, no health checks, no tokenizer
        return [sys.executable, "-m", "pdserve.bench.router_floor", "--kind", kind, *common]
    return [sys.executable, "-m", "pdserve.router.main", "--model", model, *common,
            "--metrics-port", str(ports[1]), "--http-port", str(ports[2]), *args.router_arg]


def run(args: argparse.Namespace, work: Path, kind: str = "pdserve") -> dict[str, Any]:
    """One router (`kind`: pdserve's, or a floor of pdserve.bench.router_floor) in front of
    its own simulated workers, under the load of `args`."""
    from pdserve.engine import builtin

    model = args.model or str(builtin.ensure("tiny"))
    work.mkdir(parents=True, exist_ok=True)
    router_cpus, harness_cpus = _cores(args.router_cpus, args.harness_cpus)
    os.sched_setaffinity(0, harness_cpus)
    keep_p, keep_d, gone_p, gone_d = _split(args.workers, args.vanish)
    ports = (free_port(), free_port())
    procs = [_sim("sim-stable", keep_p, keep_d, FIRST_ADDRESS, ports, args.profile,
                  work / "stable.json", harness_cpus)]
    if gone_p + gone_d:
        procs.append(_sim("sim-vanish", gone_p, gone_d, VANISH_ADDRESS, ports, args.profile,
                          work / "vanish.json", harness_cpus))
    prefill = _addresses(FIRST_ADDRESS, keep_p, ports[0]) + \
        _addresses(VANISH_ADDRESS, gone_p, ports[0])
    decode = _addresses(FIRST_ADDRESS, keep_d, ports[1]) + \
        _addresses(VANISH_ADDRESS, gone_d, ports[1])
    rport, mport = free_port(), free_port()
    hport = free_port() if args.api == "http" else -1
    router = Proc("router" if kind == "pdserve" else f"floor-{kind}", f"127.0.0.1:{rport}",
                  _router_argv(kind, model, prefill, decode, (rport, mport, hport), args),
                  cpus=router_cpus)
    metrics_url = f"http://127.0.0.1:{mport}/metrics"
    sims = Stack(procs, work)
    routers = Stack([router], work)
    try:
        print(f"starting {args.workers} simulated workers ({keep_p + gone_p} prefill, "
              f"{keep_d + gone_d} decode) on cores {harness_cpus} ...", flush=True)
        sims.start(timeout_s=120)
        print(f"starting {'the router' if kind == 'pdserve' else f'the {kind} floor router'} "
              f"on cores {router_cpus or 'any'} ...", flush=True)
        started = time.monotonic()
        routers.start(timeout_s=120)
        serving_s = time.monotonic() - started
        healthy_s = _wait_healthy(metrics_url, args.workers, 60) if kind == "pdserve" else None
        all_healthy_s = None if healthy_s is None else time.monotonic() - started
        # the router's HTTP port listens before its gRPC one says SERVING
        http = HttpLoad(f"127.0.0.1:{hport}") if hport > 0 else None
        shots, window = _load(args, router, procs, model, metrics_url, keep_p + keep_d,
                              kind, http)
    finally:
        routers.stop()
        sims.stop()
    ledger: dict[str, float] = json.loads((work / "stable.json").read_text()) \
        if (work / "stable.json").is_file() else {}
    stable = frozenset(f"{role}@{a}" for role, addrs in
                       (("prefill", _addresses(FIRST_ADDRESS, keep_p, ports[0])),
                        ("decode", _addresses(FIRST_ADDRESS, keep_d, ports[1])))
                       for a in addrs)
    result = summarize(shots, ledger, stable, window, args)
    result["discovery"] = {"serving_s": serving_s, "all_healthy_s": all_healthy_s,
                           "all_used_s": result.pop("all_used_s")}
    result["machine"] = machine()
    result["router"] = kind
    result["api"], result["stream_interval"] = args.api, args.stream_interval
    result["remote_prefill_min_tokens"] = args.remote_prefill_min_tokens
    result["router_args"] = list(args.router_arg) if kind == "pdserve" else []
    return result


def _load(args: argparse.Namespace, router: Proc, procs: list[Proc], model: str,
          metrics_url: str, survivors: int, kind: str = "pdserve", http: HttpLoad | None = None
          ) -> tuple[list[Shot], Window]:
    from pdserve.router.tokenizer import Tokenizer, hide_torch

    hide_torch()
    vocab = Tokenizer.from_dir(model).vocab_size
    assert router.popen is not None
    harness = [p.popen.pid for p in procs if p.popen is not None]
    window = Window(start_s=args.warmup, end_s=args.warmup + args.duration)
    marks: dict[str, tuple[float, float, float]] = {}
    pauses: dict[str, dict[str, list[float]]] = {}

    def mark(name: str) -> None:
        assert router.popen is not None
        marks[name] = (time.monotonic(), cpu_seconds(router.popen.pid),
                       sum(map(cpu_seconds, harness)) + sum(os.times()[:2]))
        pauses[name] = _gc_pauses(metrics_url) if kind == "pdserve" else {}

    vanish = next((p for p in procs if p.name == "sim-vanish"), None)
    unhealthy: list[float | None] = []

    def kill() -> None:
        mark("end")
        if vanish is not None and vanish.popen is not None:
            _signal_group(vanish.popen, signal.SIGKILL)
            print(f"killed {args.workers - survivors} workers at once; load goes on "
                  f"{args.vanish_seconds:g} s", flush=True)
            loop = asyncio.get_running_loop()
            loop.run_in_executor(None, lambda: unhealthy.append(
                _wait_healthy(metrics_url, survivors, args.vanish_seconds + 10, fewer=True)))

    seconds = window.end_s + (args.vanish_seconds if vanish is not None else 0.0)
    print(f"load: {args.rate:g} req/s for {seconds:g} s ({args.warmup:g} s warm-up, "
          f"{args.duration:g} s measured) ...", flush=True)
    with no_collection():  # the client's own pauses would count as the router's latency
        shots = asyncio.run(drive(router.address, rate=args.rate, seconds=seconds,
                                  prompt=lambda i: prompt_ids(args.prompt_tokens, vocab,
                                                              args.seed * 1_000_003 + i),
                                  max_tokens=args.output_tokens, seed=args.seed,
                                  at=[(window.start_s, lambda: mark("start")),
                                      (window.end_s, kill)], http=http))
    if "end" not in marks:
        mark("end")
    (t0, r0, h0), (t1, r1, h1) = marks["start"], marks["end"]
    window.wall_s, window.router_cpu_s, window.harness_cpu_s = t1 - t0, r1 - r0, h1 - h0
    window.router_gc = {gen: [a - b for a, b in zip(end, pauses["start"].get(gen, [0.0, 0.0]))]
                        for gen, end in pauses.get("end", {}).items()}
    window.router_cores = len(router.cpus or os.sched_getaffinity(0))
    window.cache_index = _cache_index(metrics_url) if kind == "pdserve" else None
    window.harness_cores = len(os.sched_getaffinity(0))
    window.vanished = args.workers - survivors if vanish is not None else 0
    window.unhealthy_after_s = unhealthy[0] if unhealthy else None
    return shots, window


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from pdserve.bench.native_floor import built_or_said
    from pdserve.bench.router_report import show, show_floor

    cpus = os.sched_getaffinity(0)  # each run splits them between its router and harness
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-router-") as tmp:
        try:
            result = run(args, Path(tmp) / "pdserve")
            show(result)
            if args.floor:
                plain = argparse.Namespace(**{**vars(args), "vanish": 0.0})
                result["floor"] = {}
                for kind in args.floor:
                    os.sched_setaffinity(0, cpus)
                    if kind == "native" and not built_or_said():
                        continue
                    result["floor"][kind] = run(plain, Path(tmp) / kind, kind)
                show_floor(result)
        except (RuntimeError, TimeoutError, OSError) as exc:
            print(f"pdserve bench router: {exc}", flush=True)
            return 1
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")
    return 0 if result["completed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
