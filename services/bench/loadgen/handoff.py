"""`pdserve bench handoff`: the KV handoff as the router reports it, request by request.

Starts one `pdserve up` stack per path (`shm`: the default on one host, the prefill worker
handing its pages to the decode side's agent itself; `agent`: the same through the prefill
host's agent, `--no-same-host-lane`; `ucx`, `tcp`: `--no-same-host-copy`; `nopipe`: shm with
`--no-pipeline-handoff`), all at once on free ports, and sends them the same requests in turn
(interleaved, one at a time), greedy, one output token beyond the first: short prompts whose
KV is one page, and long prompts prefilled in chunks (`--chunk-size`), whose pages ship chunk
by chunk while prefill still runs. Reports, from each request's Timing: `kv_transfer_ms` (KV
ready on prefill -> every page resident on decode, through the whole request path and every
process on it) and
`kv_transfer_total_ms` (the time spent moving pages, all parts summed), p50 and p90, and the
targets: a one-page handoff's kv_transfer_ms p50 <= 1 ms; with long prompts, the exposed
handoff <= 20% of the whole transfer. `--netns` (root): the ucx and tcp stacks across two hosts,
network namespaces joined by a veth: the router, the prefill worker and its agent on one, the
decode worker and its agent on the other (removed at the end, whatever happens).
`--target HOST:PORT` measures a running router instead (one path: whatever it uses).

Every stack started here prefills every prompt on the prefill side (router
`--remote-prefill-min-tokens 0`): served traffic computes a short uncached prompt on the decode
worker, with no handoff to measure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field

import grpc
from pdserve.bench import netns
from pdserve.bench.loadgen.handoff_netns import TRANSPORTS, netns_stack
from pdserve.bench.loadgen.procs import free_port_block, stop_group
from pdserve.common.health import wait_serving
from pdserve.v1 import router_pb2, router_pb2_grpc

PATHS = {  # stack -> extra `pdserve up` flags
    "shm": (),
    "ucx": ("--transport", "ucx", "--no-same-host-copy"),
    "tcp": ("--transport", "tcp", "--no-same-host-copy"),
    "nopipe": ("--no-pipeline-handoff",),
    "agent": ("--no-same-host-lane",),
    # Between tensor-parallel splits (prefill TP -> decode TP), unpipelined like `nopipe`, the
    # 1 -> 1 baseline they are compared with: the handoff alone, after prefill.
    "tp2-1": ("--no-pipeline-handoff", "--prefill-tp", "2"),
    "tp1-2": ("--no-pipeline-handoff", "--decode-tp", "2"),
    "tp2-2": ("--no-pipeline-handoff", "--prefill-tp", "2", "--decode-tp", "2"),
}
TP_TARGET = 0.8  # a handoff between splits, in bandwidth, against nopipe's (>= 16 MiB)
ONE_PAGE_TARGET_MS = 1.0
EXPOSED_TARGET = 0.2


@dataclass
class Sample:
    kv_transfer_ms: float
    kv_transfer_total_ms: float
    prefill_ms: float
    ttft_ms: float
    kv_pages: int
    kv_bytes: int
    kv_transport: str


@dataclass
class Result:
    path: str
    prompt_tokens: int
    samples: list[Sample] = field(default_factory=list)

    def p(self, name: str, q: float) -> float:
        values = sorted(getattr(s, name) for s in self.samples)
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    def median(self, name: str) -> float:
        return statistics.median(getattr(s, name) for s in self.samples) if self.samples else 0.0


@contextmanager
def stack(path: str, model: str, chunk_size: int, log_dir: str) -> Iterator[str]:
    """`pdserve up` for one path, on free ports; yields the router's address."""
    base = free_port_block(40)
    argv = [sys.executable, "-m", "pdserve.cli", "up", "--model", model, "--port", str(base),
            "--prefill-port", str(base + 10), "--decode-port", str(base + 20),
            "--agent-port", str(base + 30), "--colocated-port", str(base + 35),
            "--http-port", "-1", "--metrics-port", "-1", "--log-dir", os.path.join(log_dir, path),
            *PATHS[path]]
    env = {**os.environ, "PDSERVE_PREFILL_CHUNK_SIZE": str(chunk_size),
           "PDSERVE_ROUTER_REMOTE_PREFILL_MIN_TOKENS": "0"}  # see the module docstring
    output = os.path.join(log_dir, f"{path}.out")
    with open(output, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    router = f"127.0.0.1:{base}"
    try:
        try:
            wait_serving(router, 600, proc)
        except RuntimeError as exc:
            with open(output, errors="replace") as out:
                raise RuntimeError(f"the {path} stack did not come up ({exc}):\n"
                                   f"{out.read()[-3000:]}") from None
        yield router
    finally:
        stop_group(proc)


def one_request(stub: router_pb2_grpc.RouterStub, token_ids: list[int]) -> Sample:
    timing = None
    for msg in stub.Generate(router_pb2.GenerateRequest(
            token_ids=token_ids, max_tokens=2, temperature=0.0, ignore_eos=True), timeout=600):
        if msg.WhichOneof("kind") == "timing":
            timing = msg.timing
    if timing is None:
        raise RuntimeError("the stream had no Timing")
    return Sample(timing.kv_transfer_ms, timing.kv_transfer_total_ms, timing.prefill_ms,
                  timing.ttft_ms, timing.kv_pages, timing.kv_bytes, timing.kv_transport)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench handoff", description=__doc__)
    p.add_argument("--model", default="small", help="built-in size or a model directory")
    p.add_argument("--paths", default="",
                   help=f"stacks to start, comma-separated: {', '.join(PATHS)} (default: all; "
                   f"with --netns: {', '.join(TRANSPORTS)})")
    p.add_argument("--netns", action="store_true",
                   help="the prefill and decode sides on two hosts: network namespaces joined "
                   "by a veth (root; removed at the end)")
    p.add_argument("--in-netns", help=argparse.SUPPRESS)  # the run inside namespace a
    p.add_argument("--target", default="", help="measure this running router instead")
    p.add_argument("--short-tokens", type=int, default=8, help="the one-page prompt")
    p.add_argument("--short-reps", type=int, default=40)
    p.add_argument("--long-tokens", type=int, default=4096, help="0: no long prompts")
    p.add_argument("--long-reps", type=int, default=3)
    p.add_argument("--chunk-size", type=int, default=512, help="prefill chunk (started stacks)")
    p.add_argument("--warmup", type=int, default=3, help="requests per stack not counted")
    p.add_argument("--json", help="also write every sample to this file")
    args = p.parse_args(argv)
    allowed = TRANSPORTS if args.netns else tuple(PATHS)
    args.paths = [x for x in (args.paths or ",".join(allowed)).split(",") if x]
    bad = [x for x in args.paths if x not in allowed]
    if args.netns and args.target:
        p.error("--netns starts its own stacks: not with --target")
    if bad or args.short_reps <= 0 or args.long_reps < 0 or args.short_tokens <= 0:
        p.error(f"bad --paths {bad} / --short-reps / --long-reps / --short-tokens")
    return args


def run(args: argparse.Namespace) -> list[Result]:
    rng = random.Random(0)
    prompts = [("short", args.short_tokens, args.short_reps)]
    if args.long_tokens:
        prompts.append(("long", args.long_tokens, args.long_reps))
    with ExitStack() as exits:
        if args.target:
            routers = {"target": args.target}
        elif args.in_netns:
            link, log_dir = netns.from_spec(args.in_netns)
            routers = {p: exits.enter_context(netns_stack(p, i, args.model, args.chunk_size,
                                                          log_dir, link))
                       for i, p in enumerate(args.paths)}
        else:
            log_dir = exits.enter_context(tempfile.TemporaryDirectory(prefix="pdserve-bench-"))
            routers = {p: exits.enter_context(stack(p, args.model, args.chunk_size, log_dir))
                       for p in args.paths}
        stubs = {p: router_pb2_grpc.RouterStub(exits.enter_context(grpc.insecure_channel(a)))
                 for p, a in routers.items()}
        results: list[Result] = []
        for _, tokens, reps in prompts:
            by_path = {p: Result(p, tokens) for p in stubs}
            for rep in range(args.warmup + reps):
                ids = [rng.randrange(5, 1000) for _ in range(tokens)]
                for path, stub in stubs.items():  # the same prompt on every path, in turn
                    sample = one_request(stub, ids)
                    if rep >= args.warmup:
                        by_path[path].samples.append(sample)
            results += by_path.values()
    return results


def gbps(r: Result) -> float:
    """The handoff's bandwidth: bytes over the time spent moving them (medians)."""
    return r.samples[0].kv_bytes / max(r.median("kv_transfer_total_ms"), 1e-9) / 1e6


def report(results: list[Result]) -> str:
    head = (f"{'path':>7} {'tokens':>6} {'pages':>5} {'MiB':>7} {'via':>4} "
            f"{'kv_transfer p50':>15} {'p90':>7} {'total p50':>9} {'GB/s':>6} {'exposed':>7} "
            f"{'prefill p50':>11} {'ttft p50':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        s = r.samples[0]
        exposed = r.median("kv_transfer_ms") / max(r.median("kv_transfer_total_ms"), 1e-9)
        lines.append(f"{r.path:>7} {r.prompt_tokens:>6} {s.kv_pages:>5} "
                     f"{s.kv_bytes / 2**20:>7.2f} {s.kv_transport:>4} "
                     f"{r.median('kv_transfer_ms'):>15.3f} {r.p('kv_transfer_ms', 0.9):>7.3f} "
                     f"{r.median('kv_transfer_total_ms'):>9.3f} {gbps(r):>6.2f} {exposed:>7.2f} "
                     f"{r.median('prefill_ms'):>11.1f} {r.median('ttft_ms'):>8.1f}")
    lines.append("ms; kv_transfer: KV ready on prefill -> resident on decode, as the router "
                 "reports it; total: time spent moving pages (all parts); exposed = "
                 "kv_transfer / total (medians)")
    for r in results:
        if not r.samples[0].kv_pages:
            lines.append(f"{r.path}: no handoff to measure at {r.prompt_tokens} tokens: the "
                         "router had the decode worker compute these prompts (set its "
                         "--remote-prefill-min-tokens to 0)")
        elif r.samples[0].kv_pages == 1:
            got = r.median("kv_transfer_ms")
            lines.append(f"target one-page kv_transfer_ms p50 <= {ONE_PAGE_TARGET_MS:g} ms "
                         f"({r.path}, {r.samples[0].kv_transport}): {got:.3f} ms "
                         f"{'ok' if got <= ONE_PAGE_TARGET_MS else 'ABOVE'}")
        elif r.path.startswith("tp"):
            base = next((b for b in results if b.path == "nopipe"
                         and b.prompt_tokens == r.prompt_tokens), None)
            if base is not None and r.samples[0].kv_bytes >= 16 << 20:
                ratio = gbps(r) / max(gbps(base), 1e-9)
                lines.append(f"target {r.path} handoff >= {TP_TARGET}x nopipe's (1 -> 1) "
                             f"bandwidth at {r.samples[0].kv_bytes / 2**20:.0f} MiB: {ratio:.2f}x "
                             f"{'ok' if ratio >= TP_TARGET else 'BELOW'}")
        elif r.path != "nopipe":
            share = r.median("kv_transfer_ms") / max(r.median("kv_transfer_total_ms"), 1e-9)
            lines.append(f"target {r.prompt_tokens}-token prompts: exposed handoff <= "
                         f"{EXPOSED_TARGET:.0%} of the whole transfer ({r.path}): {share:.2f} "
                         f"{'ok' if share <= EXPOSED_TARGET else 'ABOVE'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.netns and not args.in_netns:
        return netns.rerun_inside("pdserve bench handoff", "pdserve.bench.loadgen.handoff",
                                  list(sys.argv[1:] if argv is None else argv))
    if args.in_netns:
        netns.stop_on_sigterm()
    try:
        results = run(args)
    except KeyboardInterrupt:  # what it started was stopped on the way out
        return 130
    where = "one host"
    if args.in_netns:
        where = ("two hosts (network namespaces joined by a veth; "
                 f"{netns.from_spec(args.in_netns)[0].cpus_note()})")
    print(f"host: {os.cpu_count()} CPUs; {where}; model {args.model}; chunk {args.chunk_size}; "
          f"interleaved, one request at a time; medians of {args.short_reps} (short) and "
          f"{args.long_reps} (long) requests")
    print(report(results))
    if args.json:
        with open(args.json, "w") as out:
            json.dump([asdict(r) for r in results], out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
