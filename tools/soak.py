"""Soak: a whole stack under 80% of its measured capacity for a long time, memory and pages
watched. `make soak` (SOAK_MINUTES=30 by default); on demand, never in `make test`.

    python tools/soak.py --minutes 30 [--load 0.8] [--workload fixed:128,64] [--json soak.json]

1. `pdserve up` (router, a prefill and a decode worker, two agents) on free ports.
2. Capacity: `pdserve bench serve` closed-loop at --concurrency, its completed requests/s.
3. The soak: `pdserve bench serve --rate <load x capacity>` for --minutes, open loop, while
   every process's resident anonymous memory (RssAnon: the KV pools are shared memory, whose
   pages count in VmRSS once touched) and every worker's free pages are sampled every
   --interval-s.
4. Verdict, per series: the least-squares slope over the run (per hour), the largest drift
   from the first sample after warm-up, and flat or not: RSS flat when it grows by less than
   --rss-tolerance-mb over the run (the slope x duration, and the last quarter's mean over
   the first quarter's); free pages flat when, once the load has stopped, every worker has
   exactly its starting count again and no reservation is held. Exit 1 when anything is not
   flat or a request failed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pdserve.bench.loadgen.procs import free_port_block


def rss_mb(pid: int) -> float:
    """Resident anonymous memory (RssAnon): the process's own heap, where a leak shows. The
    KV pools are shared memory and count in VmRSS as their pages are first touched, which
    is not growth (it stops at the pool's size)."""
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"RssAnon:\s+(\d+)", text).group(1)) / 1024  # type: ignore[union-attr]


def children(pid: int) -> dict[str, int]:
    """`pdserve up`'s processes by role (from their command lines)."""
    found: dict[str, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) != pid:
            continue
        module = next((c.decode() for c in cmd if c.startswith(b"pdserve.")), "")
        name = module.split(".")[1] if module else "?"
        port = cmd[cmd.index(b"--port") + 1].decode() if b"--port" in cmd else "?"
        found[f"{name}:{port}"] = int(entry.name)
    return found


def slope_per_hour(ts: list[float], ys: list[float]) -> float:
    n = len(ts)
    if n < 2:
        return 0.0
    mt, my = sum(ts) / n, sum(ys) / n
    var = sum((t - mt) ** 2 for t in ts)
    return 0.0 if var == 0 else sum((t - mt) * (y - my) for t, y in zip(ts, ys)) / var * 3600


def bench(router: str, *args: str, json_path: Path) -> dict:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "serve", "--target", router,
           "--json", str(json_path), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    print(done.stdout[-1500:], flush=True)
    if not json_path.exists():
        raise SystemExit(f"bench serve failed: {done.stderr[-2000:]}")
    return json.loads(json_path.read_text())["runs"][0]["summary"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--minutes", type=float, default=float(os.environ.get("SOAK_MINUTES", 30)))
    p.add_argument("--load", type=float, default=0.8, help="fraction of measured capacity")
    p.add_argument("--workload", default="fixed:128,64")
    p.add_argument("--concurrency", type=int, default=8, help="for measuring capacity")
    p.add_argument("--kv-cache-mb", type=int, default=512,
                   help="KV pool per worker: room for the load's bursts (SmolLM2: 0.7 MB per "
                        "16-token page), or requests are refused with RESOURCE_EXHAUSTED; at "
                        "least one full context (SmolLM2: 360 MiB), or the workers refuse to start")
    p.add_argument("--interval-s", type=float, default=10.0)
    p.add_argument("--rss-tolerance-mb", type=float, default=32.0)
    p.add_argument("--json", type=Path, help="write every sample and the verdict here")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="pdserve-soak-"))
    base = free_port_block(40)
    log = open(work / "up.log", "w")
    up = subprocess.Popen([sys.executable, "-m", "pdserve.cli", "up", "--port", str(base),
                           "--prefill-port", str(base + 10), "--decode-port", str(base + 20),
                           "--agent-port", str(base + 30), "--colocated-port", str(base + 35),
                           "--http-port", "-1", "--metrics-port", "-1",
                           "--log-dir", str(work / "logs"),
                           "--kv-cache-mb", str(args.kv_cache_mb)],
                          stdout=log, stderr=subprocess.STDOUT, text=True,
                          start_new_session=True)
    print(f"pdserve up: router 127.0.0.1:{base}, logs in {work}", flush=True)
    try:
        return soak(args, up, base, work)
    finally:
        up.terminate()
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, 9)
        log.close()


def soak(args: argparse.Namespace, up: subprocess.Popen[str], base: int, work: Path) -> int:
    import grpc
    from pdserve.common.health import wait_serving
    from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc

    router = f"127.0.0.1:{base}"
    wait_serving(router, 300, up)
    workers = {"prefill": prefill_pb2_grpc.PrefillStub(grpc.insecure_channel(
        f"127.0.0.1:{base + 10}")), "decode": decode_pb2_grpc.DecodeStub(grpc.insecure_channel(
            f"127.0.0.1:{base + 20}"))}

    def stats() -> dict[str, common_pb2.WorkerStats]:
        return {k: s.Stats(common_pb2.StatsRequest(), timeout=10) for k, s in workers.items()}

    idle_before = {k: s.free_pages for k, s in stats().items()}
    cap = bench(router, "--workload", args.workload, "--concurrency", str(args.concurrency),
                "--num-requests", "200", "--warmup", "8", json_path=work / "capacity.json")
    capacity = float(cap["request_throughput"])
    rate = args.load * capacity
    duration_s = args.minutes * 60
    print(f"capacity {capacity:.2f} req/s at concurrency {args.concurrency}; soaking at "
          f"{rate:.2f} req/s ({args.load:.0%}) for {args.minutes:g} min", flush=True)
    procs = children(up.pid)
    samples: list[dict] = []
    stop = threading.Event()

    def sample() -> None:
        t0 = time.monotonic()
        while not stop.wait(args.interval_s):
            row = {"t": time.monotonic() - t0}
            for name, pid in procs.items():
                row[f"rss_mb {name}"] = rss_mb(pid)
            for k, s in stats().items():
                row[f"free_pages {k}"] = s.free_pages
            samples.append(row)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    run = bench(router, "--workload", args.workload, "--rate", f"{rate:.3f}",
                "--num-requests", str(int(rate * duration_s * 1.5) + 10), "--warmup", "0",
                "--max-duration", str(duration_s), "--seed", "1",
                json_path=work / "soak.json")
    stop.set()
    sampler.join()
    idle_after = stats()
    verdict = judge(samples, args.rss_tolerance_mb)
    pages_flat = all(idle_after[k].free_pages == idle_before[k] for k in idle_before) and \
        idle_after["decode"].reserved_tickets == 0
    # Requests still unsent when the duration ran out are not failures.
    failed = int(run["failed"]) - int(run.get("errors", {}).get("not sent", 0))
    print(f"\nsoak: {run['completed']} requests OK, {failed} failed in "
          f"{run['duration_s']:.0f} s ({run['request_throughput']:.2f} req/s)")
    for line in verdict["lines"]:
        print(line)
    print("free pages idle before -> after: "
          + ", ".join(f"{k} {idle_before[k]} -> {idle_after[k].free_pages}" for k in idle_before)
          + f"  {'flat' if pages_flat else 'NOT FLAT'}")
    if args.json:
        args.json.write_text(json.dumps({"capacity": cap, "run": run, "samples": samples,
                                         "verdict": verdict, "pages_flat": pages_flat},
                                        indent=1))
    return 0 if verdict["flat"] and pages_flat and failed == 0 else 1


def judge(samples: list[dict], rss_tolerance_mb: float) -> dict:
    """Slope, drift and flat-or-not per sampled series (the first 10% is warm-up)."""
    steady = samples[max(1, len(samples) // 10):] or samples
    lines, flat = [], True
    for key in sorted(k for k in steady[0] if k != "t"):
        ts, ys = [s["t"] for s in steady], [s[key] for s in steady]
        slope = slope_per_hour(ts, ys)
        drift = max(abs(y - ys[0]) for y in ys)
        span_h = (ts[-1] - ts[0]) / 3600
        q = max(1, len(ys) // 4)
        growth = sum(ys[-q:]) / q - sum(ys[:q]) / q
        if key.startswith("rss_mb"):
            ok = slope * span_h < rss_tolerance_mb and growth < rss_tolerance_mb
            unit = "MB"
        else:  # free pages under load move with the requests in flight: reported only
            ok, unit = True, "pages"
        flat &= ok
        lines.append(f"{key:<32} first {ys[0]:8.1f}  last {ys[-1]:8.1f}  slope "
                     f"{slope:+8.2f} {unit}/h  max drift {drift:7.1f} {unit}  "
                     f"{'flat' if ok else 'NOT FLAT'}")
    return {"flat": flat, "lines": lines}


if __name__ == "__main__":
    sys.exit(main())
