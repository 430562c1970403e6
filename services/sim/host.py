"""`pdserve sim`: many simulated prefill and decode workers in one process, for driving a real
router at pool sizes this machine cannot run models for (see pdserve.sim.workers).

Worker i listens on the i-th loopback address from --first-address (127.0.0.0/8 is all local
on Linux), prefill workers on --prefill-port and decode workers on --decode-port, so they look
like a pool spread over hosts. It prints the address lists for `pdserve router --prefill ...
--decode ...` (and writes them as JSON with --addresses-file), then serves until interrupted.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from pdserve.common.config import option, parse_config, require


@dataclass(frozen=True)
class SimConfig:
    prefill: int = option(4, "simulated prefill workers")
    decode: int = option(4, "simulated decode workers")
    first_address: str = option("127.0.1.1", "loopback address of worker 0; worker i takes the "
                                             "i-th address after it")
    prefill_port: int = option(50061, "port of every prefill worker")
    decode_port: int = option(50071, "port of every decode worker")
    profile: str = option("", "JSON file of SimProfile fields (default: the built-in profile, "
                              "bench-7m on a 2-core machine)")
    addresses_file: str = option("", "also write {\"prefill\": [...], \"decode\": [...]} here")
    timings_file: str = option("", "at exit, write the ms the workers spent on each client "
                                   "request id here (JSON; for pdserve bench router)")

    def __post_init__(self) -> None:
        require(self.prefill >= 0 and self.decode >= 0 and self.prefill + self.decode > 0,
                "prefill/decode", (self.prefill, self.decode), "counts >= 0, at least one worker")
        try:
            first = ipaddress.IPv4Address(self.first_address)
        except ValueError:
            raise ValueError(f"first_address={self.first_address!r}: expected an IPv4 "
                             "address") from None
        count = max(self.prefill, self.decode)
        last = int(first) + max(count - 1, 0)
        require(first.is_loopback and last <= int(ipaddress.IPv4Address("127.255.255.255")),
                "first_address", self.first_address,
                f"a loopback address with room for {count} workers in 127.0.0.0/8")
        for name in ("prefill_port", "decode_port"):
            require(0 < getattr(self, name) < 65536, name, getattr(self, name), "1..65535")
        require(self.prefill_port != self.decode_port, "decode_port", self.decode_port,
                "a port other than --prefill-port")

    def addresses(self, role: str) -> list[str]:
        count, port = (self.prefill, self.prefill_port) if role == "prefill" else \
            (self.decode, self.decode_port)
        first = ipaddress.IPv4Address(self.first_address)
        return [f"{first + i}:{port}" for i in range(count)]


async def _serve(cfg: SimConfig, stop: asyncio.Event) -> int:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from pdserve.common.heap import freeze_startup_heap
    from pdserve.sim.profile import SimProfile
    from pdserve.sim.workers import Ledger, SimDecode, SimPrefill
    from pdserve.v1 import decode_pb2_grpc, prefill_pb2_grpc

    profile = SimProfile.load(cfg.profile) if cfg.profile else SimProfile()
    servers: list[grpc.aio.Server] = []
    ledger = Ledger() if cfg.timings_file else None
    try:
        for role in ("prefill", "decode"):
            for address in cfg.addresses(role):
                server = grpc.aio.server()
                name = f"{role}@{address}"
                if role == "prefill":
                    prefill_pb2_grpc.add_PrefillServicer_to_server(
                        SimPrefill(name, profile, ledger=ledger), server)
                else:
                    decode_pb2_grpc.add_DecodeServicer_to_server(
                        SimDecode(name, profile, ledger=ledger), server)
                checks = health.aio.HealthServicer()
                await checks.set("", health_pb2.HealthCheckResponse.SERVING)
                health_pb2_grpc.add_HealthServicer_to_server(checks, server)
                if server.add_insecure_port(address) == 0:
                    raise OSError(f"cannot listen on {address}")
                await server.start()
                servers.append(server)
        freeze_startup_heap("pdserve sim")
        lists = {role: cfg.addresses(role) for role in ("prefill", "decode")}
        if cfg.addresses_file:
            Path(cfg.addresses_file).write_text(json.dumps(lists))
        print(f"pdserve sim: {cfg.prefill} prefill and {cfg.decode} decode workers serving\n"
              f"  --prefill {','.join(lists['prefill'])}\n  --decode {','.join(lists['decode'])}",
              flush=True)
        await stop.wait()
        return 0
    except (OSError, RuntimeError, ValueError) as exc:
        print(f"pdserve sim: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        await asyncio.gather(*(s.stop(0) for s in servers))
        if ledger is not None:
            Path(cfg.timings_file).write_text(json.dumps(ledger))


def _raise_fd_limit(needed: int) -> None:
    """Each worker holds a listening socket and one per caller: lift the soft limit on open
    files to the hard one when the default (often 1,024) is too low; say so if even that is."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= needed:
        return
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < needed:
        print(f"pdserve sim: open files are limited to {target} (the hard limit); these workers "
              f"and their callers may need {needed}: raise `ulimit -Hn`", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(SimConfig, "sim", argv, prog="pdserve sim", description=__doc__)
    _raise_fd_limit(4 * (cfg.prefill + cfg.decode) + 64)  # listeners + a few callers each

    async def run() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        return await _serve(cfg, stop)

    return asyncio.run(run())


if __name__ == "__main__":
    sys.exit(main())
