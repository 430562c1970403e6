"""The router reads a worker's health from its Stats when the worker says it there (one call
per check, not two); a worker older than that field is asked grpc.health.v1 Check as before.
Real gRPC servers on loopback, the router's real pool."""

from __future__ import annotations

from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from pdserve.router.pool import WorkerPool
from pdserve.v1 import common_pb2, decode_pb2_grpc

pytestmark = pytest.mark.unit


class _Counted(health.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self.checks = 0

    def Check(self, request, context):  # noqa: N802 (grpc's name)
        self.checks += 1
        return super().Check(request, context)


class _Decode(decode_pb2_grpc.DecodeServicer):
    def __init__(self, serving: bool | None):
        self.serving, self.stats, self.fail = serving, 0, False

    def Stats(self, request, context):  # noqa: N802
        self.stats += 1
        if self.fail:
            context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
        reply = common_pb2.WorkerStats(worker_id="d", role="decode", num_pages=8, free_pages=8)
        if self.serving is not None:  # None: a worker older than the field
            reply.serving = self.serving
        return reply


@pytest.fixture
def worker():
    """(address, its Decode servicer, its health servicer) on a real server."""
    def start(serving: bool | None):
        server = grpc.server(futures.ThreadPoolExecutor(4))
        decode, checks = _Decode(serving), _Counted()
        decode_pb2_grpc.add_DecodeServicer_to_server(decode, server)
        health_pb2_grpc.add_HealthServicer_to_server(checks, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}", decode, checks

    servers: list[grpc.Server] = []
    yield start
    for server in servers:
        server.stop(0)


def _rounds(address: str, n: int) -> WorkerPool:
    pool = WorkerPool(decode=[address], timeout_s=5.0)
    for _ in range(n):
        pool.check_now()
    return pool


def test_a_worker_whose_stats_say_serving_is_asked_only_its_stats_after_the_first_check(worker):
    address, decode, checks = worker(True)
    pool = _rounds(address, 3)
    try:
        assert pool.healthy("decode") == [address]
        assert decode.stats == 3 and checks.checks == 1  # Check once: before any Stats came
        decode.serving = False  # starting, failed or draining: what Check would say too
        pool.check_now()
        assert pool.healthy("decode") == [] and checks.checks == 1
        assert pool._workers[("decode", address)].last_error == "not SERVING"
        decode.serving = True
        pool.check_now()
        assert pool.healthy("decode") == [address]
        decode.fail = True  # no answer: unhealthy, named by what the call said
        pool.check_now()
        assert pool.healthy("decode") == [] and checks.checks == 1
        assert pool._workers[("decode", address)].last_error == "UNAVAILABLE: going away"
    finally:
        pool.close()


def test_a_worker_older_than_the_field_is_asked_check_every_time(worker):
    address, decode, checks = worker(None)
    pool = _rounds(address, 3)
    try:
        assert pool.healthy("decode") == [address]
        assert decode.stats == 3 and checks.checks == 3
        checks.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # draining, say
        pool.check_now()
        assert pool.healthy("decode") == [] and checks.checks == 4
    finally:
        pool.close()
