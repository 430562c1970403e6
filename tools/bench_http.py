"""HTTP (OpenAI-compatible) vs gRPC on one router, side by side: what the HTTP front door adds.

    .venv/bin/python tools/bench_http.py [--model tiny] [--requests 200] [--streams 32]

Brings up a disaggregated stack (`pdserve up` on free ports), then runs `pdserve bench serve`
against the router's gRPC port and its HTTP port with the same requests, interleaved:
  1. concurrency 1, one request to each API in turn: TTFT p50 as the client sees it (and as
     the router measures it), and the difference HTTP - gRPC;
  2. concurrency --streams, in rounds that alternate the APIs: the router process's CPU
     seconds per generated token for each API (from /proc), and the ratio.
Prints both tables, then a summary with the machine's load; stops the stack.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pdserve.bench.loadgen.procs import free_port_block, stop_group

PDSERVE = [sys.executable, "-m", "pdserve.cli"]


def bench(grpc: str, http: str, out: Path, *args: str) -> dict[str, dict]:
    """Run `pdserve bench serve --compare` on both APIs; {"grpc"|"http": summary}."""
    argv = [*PDSERVE, "bench", "serve", "--target", grpc, "--target", http, "--compare",
            "--server-cpu", grpc, "--json", str(out), *args]
    print("$", " ".join(argv[2:]), flush=True)
    subprocess.run(argv, check=True, timeout=1800)
    runs = json.loads(out.read_text())["runs"]
    return {("http" if r["target"].startswith("http") else "grpc"): r["summary"] for r in runs}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--requests", type=int, default=200, help="requests per API at concurrency 1")
    p.add_argument("--streams", type=int, default=32, help="concurrency of the CPU run")
    p.add_argument("--rounds", type=int, default=8, help="rounds of the CPU run")
    args = p.parse_args()
    base, metrics = free_port_block(40), free_port_block(45)
    while abs(metrics - base) < 45:
        metrics = free_port_block(45)
    work = Path(tempfile.mkdtemp(prefix="pdserve-bench-http-"))
    up = subprocess.Popen(
        [*PDSERVE, "up", "--model", args.model, "--port", str(base), "--prefill-port",
         str(base + 10), "--decode-port", str(base + 20), "--agent-port", str(base + 30),
         "--colocated-port", str(base + 35), "--http-port", str(base + 38), "--metrics-port",
         str(metrics), "--log-dir", str(work / "logs")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        assert up.stdout is not None
        for line in up.stdout:
            print(line, end="", flush=True)
            if line.startswith("pdserve is up"):
                break
        else:
            print("pdserve up did not come up", file=sys.stderr)
            return 1
        threading.Thread(target=lambda: [None for _ in up.stdout or ()], daemon=True).start()
        grpc, http = f"127.0.0.1:{base}", f"http://127.0.0.1:{base + 38}/v1"
        common = ["--model", args.model]
        one = bench(grpc, http, work / "c1.json", *common, "--workload", "fixed:64,32",
                    "--concurrency", "1", "--num-requests", str(args.requests),
                    "--interleave", str(args.requests), "--warmup", "4")
        many = bench(grpc, http, work / "cN.json", *common, "--workload", "fixed:64,64",
                     "--concurrency", str(args.streams),
                     "--num-requests", str(args.streams * 16), "--interleave", str(args.rounds),
                     "--warmup", "4")
    finally:
        stop_group(up)
    ttft = {api: s["ttft_ms"]["p50"] for api, s in one.items()}
    server = {api: s["components_ms"]["ttft_ms"]["p50"] for api, s in one.items()}
    cpu = {api: s["server_cpu_ms_per_token"] for api, s in many.items()}
    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), [])
    print(f"\nHTTP vs gRPC on one router ({args.model}; {os.cpu_count()} CPUs, "
          f"{' '.join(f for f in flags if f.startswith(('avx', 'amx')))}; load average "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())} at "
          f"{time.strftime('%H:%M:%S')}):")
    print(f"  concurrency 1, TTFT p50 (client): grpc {ttft['grpc']:.2f} ms, http "
          f"{ttft['http']:.2f} ms, http - grpc = {ttft['http'] - ttft['grpc']:+.2f} ms")
    print(f"  concurrency 1, TTFT p50 (router): grpc {server['grpc']:.2f} ms, http "
          f"{server['http']:.2f} ms, http - grpc = {server['http'] - server['grpc']:+.2f} ms")
    print(f"  concurrency {args.streams}, router CPU per token: grpc {cpu['grpc']:.3f} ms, "
          f"http {cpu['http']:.3f} ms, http / grpc = {cpu['http'] / cpu['grpc']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
