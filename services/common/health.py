"""Waiting for a gRPC server to report SERVING (bounded, fails fast when its process died)."""

from __future__ import annotations

import contextlib
import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pdserve.common.security import ChannelSecurity, open_channel

POLL_S = 0.05
# gRPC's default reconnect backoff grows to minutes: a server that takes long to start (a
# loaded machine) would be seen long after it serves. Retry connecting at least every second.
RECONNECT = (("grpc.initial_reconnect_backoff_ms", 200), ("grpc.min_reconnect_backoff_ms", 200),
             ("grpc.max_reconnect_backoff_ms", 1000))


def wait_serving(address: str, timeout_s: float = 60.0, proc: subprocess.Popen[bytes] | None = None,
                 service: str = "", security: ChannelSecurity | None = None) -> None:
    """Poll grpc.health.v1 at `address` until SERVING; TimeoutError / RuntimeError otherwise.
    `security`: call over TLS (pdserve.common.security)."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    with open_channel(address, security, RECONNECT) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"the process for {address} exited with status {proc.returncode}"
                )
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = exc.code().name
                with contextlib.suppress(grpc.FutureTimeoutError):  # block until it listens
                    grpc.channel_ready_future(channel).result(timeout=0.5)
                continue
            time.sleep(POLL_S)  # the interval of a bounded poll
    raise TimeoutError(f"{address} not SERVING after {timeout_s:.0f}s (last: {last})")
