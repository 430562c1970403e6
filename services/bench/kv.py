"""`pdserve bench kv`: KV handoff time per transport, next to the bounds of the same bytes.

Starts two agents per transport on this host, hands them two pools sized for the longest
prompt as workers do (kv_rig.py), and for each prompt length measures, interleaved rep by
rep: two handoffs through each agent pair, the first since the pair's last round and one
back to back (the sending agent's `handoff_ms`: ready on P -> resident and acknowledged on
D; and `rpc ms`, the sending worker's round trip of its call), and the two bounds of
kv_baselines.py (raw TCP as fast as this machine makes it, and a memory copy into a
pre-faulted destination). The bounds' variants run back to back, so a transport is held to
them with its handoff back to back; its first one is reported beside raw TCP's first of a
round (`first ms`). Reports medians, each transport's ratio to each bound, and says
loudly when a transport beats a bound (then the bound is wrong and must be fixed).

`--netns` (root): the two agents of each pair in two network namespaces joined by a veth, so
every byte crosses that link (UCX over TCP on it, or TCP), next to raw TCP over the same link;
the namespaces are removed at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pdserve.bench import netns
from pdserve.bench.kv_baselines import BoundSamples
from pdserve.bench.kv_report import Row, report, rows
from pdserve.bench.kv_rig import NetnsPlacement, Placement, Worker
from pdserve.certs import create as create_certs
from pdserve.common.layout import DTYPE_BYTES, LayoutFingerprint, pages_for_tokens
from pdserve.common.shm import SharedSegment


@dataclass
class AgentPair:
    transport: str
    sender: Worker
    receiver: Worker


AGENT_FLAGS = {  # transport -> the agents' flags
    "shm": ("--transport", "tcp"),  # the same-host copy: the network transport is not used
    "ucx": ("--transport", "ucx", "--no-same-host-copy"),
    "tcp": ("--transport", "tcp", "--no-same-host-copy"),
    # TCP under mutual TLS (certificates made for the run, `tls_flags`): its cost against tcp
    "tcp-tls": ("--transport", "tcp", "--no-same-host-copy"),
    "local": ("--transport", "ucx"),  # both pools on one agent
}


def tls_flags(directory: str, hosts: Sequence[str]) -> tuple[str, ...]:
    """Mutual TLS for an agent: a throwaway CA and certificates for `hosts` in `directory`."""
    certs = create_certs(Path(directory), hosts)
    return ("--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key),
            "--tls-ca", str(certs.ca))


def _handoff(pair: AgentPair, ticket_no: int, pages: list[int], dst_pages: list[int],
             fp: LayoutFingerprint) -> tuple[float, float, int]:
    """One handoff as a worker makes it; returns (agent handoff_ms, the worker's round trip
    of its send call in ms, runs)."""
    request_id = f"bench-{ticket_no}"
    pair.receiver.expect(request_id, dst_pages)
    started = time.perf_counter()
    report = pair.sender.send(request_id, pages, pair.receiver.destination(dst_pages, fp))
    if report.transport != pair.transport.removesuffix("-tls"):
        raise RuntimeError(f"the {pair.transport} pair moved pages over {report.transport}")
    return report.handoff_ms, (time.perf_counter() - started) * 1e3, report.num_runs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve bench kv", description=__doc__)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPE_BYTES))
    p.add_argument("--prompts", default="16,64,256,1024,4096,8192",
                   help="prompt lengths in tokens, comma-separated")
    p.add_argument("--transports", default="shm,ucx,tcp",
                   help="shm, ucx, tcp, tcp-tls (tcp under mutual TLS), local; comma-separated")
    p.add_argument("--reps", type=int, default=9, help="measured repetitions (median reported)")
    p.add_argument("--fragmented", action="store_true",
                   help="scatter destination pages (many runs) instead of one contiguous run")
    p.add_argument("--netns", action="store_true",
                   help="agents in two network namespaces joined by a veth (root): ucx and tcp "
                        "(default; tcp-tls too when named) across that link, next to raw TCP "
                        "on it")
    p.add_argument("--in-netns", help=argparse.SUPPRESS)  # the run inside namespace a
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    if args.netns and "--transports" not in " ".join(argv or sys.argv):
        args.transports = "ucx,tcp"
    args.prompts = [int(x) for x in args.prompts.split(",") if x]
    args.transports = [x for x in args.transports.split(",") if x]
    bad = [t for t in args.transports if t not in AGENT_FLAGS
           or (args.netns and t in ("shm", "local"))]
    if bad or not args.prompts or min(args.prompts) <= 0 or args.reps <= 0:
        p.error(f"bad --transports {bad} / --prompts / --reps")
    return args


def run(args: argparse.Namespace, placement: Placement) -> list[Row]:
    fp = LayoutFingerprint("bench", "0", args.dtype, args.layers, args.kv_heads, args.head_dim,
                           args.block_size)
    page_bytes = fp.page_bytes
    max_pages = max(pages_for_tokens(n, args.block_size) for n in args.prompts)
    rng = np.random.default_rng(0)
    results: list[Row] = []
    with ExitStack() as stack:
        src_seg = stack.enter_context(SharedSegment.create(max_pages * page_bytes, "bench-src"))
        dst_seg = stack.enter_context(SharedSegment.create(max_pages * page_bytes, "bench-dst"))
        src = np.frombuffer(src_seg.buffer, dtype=np.uint8)
        dst = np.frombuffer(dst_seg.buffer, dtype=np.uint8)
        src[:] = rng.integers(0, 256, src.size, dtype=np.uint8)
        dst[:] = 0
        pairs = []
        for transport in args.transports:
            flags = AGENT_FLAGS[transport]
            if transport.endswith("-tls"):
                certs = stack.enter_context(tempfile.TemporaryDirectory(prefix="pdkv-tls-"))
                flags += tls_flags(certs, placement.hosts)
            sender_agent = stack.enter_context(placement.sender(flags))
            receiver_agent = sender_agent if transport == "local" else \
                stack.enter_context(placement.receiver(flags))
            sender = Worker(sender_agent, "bench-prefill", src_seg, max_pages, fp)
            stack.callback(sender.close)
            receiver = Worker(receiver_agent, "bench-decode", dst_seg, max_pages, fp)
            stack.callback(receiver.close)
            pairs.append(AgentPair(transport, sender, receiver))
        raw = placement.raw_tcp(max_pages * page_bytes)
        stack.callback(raw.close)
        ticket_no = 0
        for tokens in args.prompts:
            n = pages_for_tokens(tokens, args.block_size)
            pages = list(range(n))
            dst_pages = list(rng.permutation(max_pages)[:n]) if args.fragmented else pages
            dst_pages = [int(p) for p in dst_pages]
            nbytes = n * page_bytes
            samples: dict[str, list[tuple[float, float, int]]] = {p.transport: [] for p in pairs}
            firsts: dict[str, list[float]] = {p.transport: [] for p in pairs}
            # The bounds run twice a round, before and after the transports: load that comes
            # and goes on the machine then cannot make them look slower than the transports.
            bounds = BoundSamples.empty(warmup=2)
            for rep in range(args.reps + 1):  # the first round warms up and is dropped
                bounds.measure(raw, src[:nbytes], dst[:nbytes])
                for pair in pairs:
                    if rep == 0:
                        dst[:] = 0  # so the check below sees this transport's bytes
                    # the first on its connections since the last round, then one back to back,
                    # as the bounds' variants run (the one held to them)
                    ticket_no += 2
                    firsts[pair.transport].append(
                        _handoff(pair, ticket_no - 1, pages, dst_pages, fp)[0])
                    samples[pair.transport].append(_handoff(pair, ticket_no, pages, dst_pages, fp))
                    if rep == 0:
                        _verify(src, dst, pages, dst_pages, page_bytes, pair.transport)
                bounds.measure(raw, src[:nbytes], dst[:nbytes], first=True)
            results += rows(tokens, n, nbytes, samples, bounds, firsts,
                            cross_host=isinstance(placement, NetnsPlacement))
        del src, dst
    return results


def _verify(src: np.ndarray, dst: np.ndarray, pages: list[int], dst_pages: list[int],
            page_bytes: int, transport: str) -> None:
    for s, d in zip(pages, dst_pages):
        if not np.array_equal(src[s * page_bytes:(s + 1) * page_bytes],
                              dst[d * page_bytes:(d + 1) * page_bytes]):
            raise RuntimeError(f"{transport}: page {s} -> {d} did not arrive intact")


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark, print the table (and targets), optionally write JSON."""
    args = parse_args(argv)
    if args.netns and not args.in_netns:
        return netns.rerun_inside("pdserve bench kv", "pdserve.bench.kv",
                                  list(sys.argv[1:] if argv is None else argv))
    placement = Placement()
    if args.in_netns:
        netns.stop_on_sigterm()
        placement = NetnsPlacement(*netns.from_spec(args.in_netns))
    try:
        results = run(args, placement)
    except KeyboardInterrupt:  # what it started was stopped on the way out
        return 130
    print(f"host: {os.cpu_count()} CPUs; {placement.note}; medians of {args.reps} reps; "
          "GB/s = 1e9 bytes/s")
    print(report(results, cross_host=isinstance(placement, NetnsPlacement)))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"results": [dataclasses.asdict(r) for r in results]}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
