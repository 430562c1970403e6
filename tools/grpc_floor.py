"""What Python gRPC itself costs per call, the floor under the router's CPU per request.

    .venv/bin/python tools/grpc_floor.py [--calls 2000]

A server process (pinned to core 0 when there are two or more) serves a unary method and a
server-streaming one that sends 9 small messages (a short answer: 8 tokens and the end), with
the sync (thread pool) server, with grpc.aio, and with the same handlers on pdserve's native
server (gRPC's C++ core, common/native_server.py); a grpc.aio client on the other cores makes
`--calls` calls of each, 32 at a time. Printed: the server's CPU per call from /proc, and the
client's. A router request costs at least one streamed answer served (9-10 messages) plus a
Reserve and a Prefill call and a decode stream read as a client: the sum is the floor.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from concurrent import futures
from typing import Any

import grpc
from pdserve.common import native_grpc
from pdserve.common.native_server import NativeServer
from pdserve.common.ports import free_port

PAYLOAD = b"x" * 24


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def _handlers(aio: bool) -> grpc.GenericRpcHandler:
    if aio:
        async def stream_aio(request: bytes, context: object):  # type: ignore[no-untyped-def]
            for _ in range(9):
                yield PAYLOAD

        async def unary_aio(request: bytes, context: object) -> bytes:
            return PAYLOAD

        stream, unary = stream_aio, unary_aio
    else:
        def stream_sync(request: bytes, context: object):  # type: ignore[no-untyped-def]
            yield from (PAYLOAD for _ in range(9))

        def unary_sync(request: bytes, context: object) -> bytes:
            return PAYLOAD

        stream, unary = stream_sync, unary_sync  # type: ignore[assignment]
    return grpc.method_handlers_generic_handler("floor.F", {
        "S": grpc.unary_stream_rpc_method_handler(stream),
        "U": grpc.unary_unary_rpc_method_handler(unary)})


def serve(kind: str, port: int) -> None:
    """Serve until stdin closes; print the CPU seconds used at each line read."""
    if kind in ("sync", "native"):
        server: Any = grpc.server(futures.ThreadPoolExecutor(64)) if kind == "sync" else \
            NativeServer(native_grpc.library(), max_workers=64, thread_name_prefix="floor")
        server.add_generic_rpc_handlers((_handlers(False),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        server.start()
        print("ready", flush=True)
        for _ in sys.stdin:
            print(_cpu(), flush=True)
        server.stop(0)
        return

    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers((_handlers(True),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        print("ready", flush=True)
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, sys.stdin.readline):
            print(_cpu(), flush=True)
        await server.stop(0)

    asyncio.run(run())


async def _client(port: int, method: str, calls: int) -> tuple[float, float]:
    """(calls per second, client CPU ms per call)."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = channel.unary_stream("/floor.F/S")
        unary = channel.unary_unary("/floor.F/U")
        gate = asyncio.Semaphore(32)

        async def one() -> None:
            async with gate:
                if method == "U":
                    await unary(b"")
                else:
                    async for _ in stream(b""):
                        pass

        await asyncio.gather(*(one() for _ in range(64)))  # warm the connection
        cpu, start = _cpu(), time.perf_counter()
        await asyncio.gather(*(one() for _ in range(calls)))
        return calls / (time.perf_counter() - start), (_cpu() - cpu) / calls * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=2000)
    p.add_argument("--serve", choices=["sync", "aio", "native"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return 0
    cores = sorted(os.sched_getaffinity(0))
    server_cores, client_cores = (cores[:1], cores[1:]) if len(cores) > 1 else (cores, cores)
    os.sched_setaffinity(0, client_cores)
    print(f"server on cores {server_cores}, client on {client_cores}; {args.calls} calls each, "
          "32 in flight")
    for kind in ("sync", "aio", "native"):
        port = free_port()
        server = subprocess.Popen(
            [sys.executable, __file__, "--serve", kind, "--port", str(port)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, server_cores))
        try:
            assert server.stdin is not None and server.stdout is not None
            assert server.stdout.readline().strip() == "ready"
            for method, name in (("U", "unary call"), ("S", "stream of 9 messages")):
                asyncio.run(_client(port, method, 64))  # connection and code paths warm
                server.stdin.write("\n")
                server.stdin.flush()
                before = float(server.stdout.readline())
                rate, client_ms = asyncio.run(_client(port, method, args.calls))
                server.stdin.write("\n")
                server.stdin.flush()
                server_ms = (float(server.stdout.readline()) - before) / args.calls * 1e3
                print(f"  {kind:6} server, {name:20}: server {server_ms:.3f} ms CPU per call, "
                      f"aio client {client_ms:.3f} ms, {rate:,.0f} calls/s")
        finally:
            if server.stdin is not None:
                server.stdin.close()
            server.wait(timeout=10)
    return 0


if __name__ == "__main__":
    sys.exit(main())
