"""What a sync gRPC client pays per unary call when its channels are idle, as a router's are in
front of 1,000 workers (each one called every few seconds).

    .venv/bin/python tools/grpc_idle_channels.py [--calls 4000] [--channels 2,1000]

A health server (pinned to core 1 when there are two or more) answers; 8 client threads (on
core 0) make `--calls` Check calls in all, spread over N channels, each to its own loopback
address (127.0.x.y: distinct connections), as `.future().result()` (what the router does, so
that a client's cancel can interrupt the call) and as a blocking call. Printed: the client's
CPU per call. A `.future()` call on a channel with no other call in flight starts a thread to
poll that channel, and ends it after; a blocking call polls its own queue on the calling
thread, but nothing can cancel it.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pdserve.common.ports import free_port

THREADS = 8


def _serve(port: int) -> None:
    if len(os.sched_getaffinity(0)) >= 2:
        os.sched_setaffinity(0, {1})
    server = grpc.server(futures.ThreadPoolExecutor(THREADS))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"0.0.0.0:{port}")
    server.start()
    server.wait_for_termination()


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def measure(port: int, channels: int, calls: int, mode: str) -> float:
    """Client CPU ms per call over `channels` channels."""
    chans = [grpc.insecure_channel(f"127.0.{i // 250}.{i % 250 + 1}:{port}")
             for i in range(channels)]
    stubs = [health_pb2_grpc.HealthStub(c) for c in chans]
    request = health_pb2.HealthCheckRequest()
    for stub in stubs:  # connected before the clock starts
        stub.Check(request, timeout=10)

    def work(k: int) -> None:
        for i in range(calls // THREADS):
            stub = stubs[(k * 7919 + i * 13) % channels]
            if mode == "future":
                stub.Check.future(request, timeout=10).result()
            else:
                stub.Check(request, timeout=10)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(THREADS)]
    start = _cpu()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    used = _cpu() - start
    for c in chans:
        c.close()
    return used / (calls // THREADS * THREADS) * 1e3


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=4000)
    parser.add_argument("--channels", default="2,1000")
    args = parser.parse_args()
    port = free_port()
    pid = os.fork()
    if pid == 0:
        try:
            _serve(port)
        finally:
            os._exit(0)
    try:
        if len(os.sched_getaffinity(0)) >= 2:
            os.sched_setaffinity(0, {0})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the server's port answers
            try:
                with grpc.insecure_channel(f"127.0.0.1:{port}") as probe:
                    grpc.channel_ready_future(probe).result(timeout=1)
                break
            except grpc.FutureTimeoutError:
                continue
        for n in (int(x) for x in args.channels.split(",")):
            for mode in ("future", "blocking"):
                print(f"{n:>5} channels, {mode:<8}: {measure(port, n, args.calls, mode):.3f} "
                      "ms of client CPU per call", flush=True)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
