"""Router replicas told of each other's placements (`--peers`).

Past 128 workers a router learns a worker's prefix cache from its Stats reads, seconds apart
(`workers / 100` s); what another replica just placed there reached it only then. With
--peers, two real routers in front of 80 + 80 simulated workers: a prompt placed by one, its
prefix is placed on the same worker by the other at once.
"""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from pdserve.v1 import router_pb2_grpc

from tests.service.test_cache_routing import _metric
from tests.service.test_sim_workers import _generate, sim_pool
from tests.support import free_port, pdserve_argv, running, wait_for

pytestmark = pytest.mark.service
WORKERS = 80  # per role: 160 > 128, so the routers read the workers' caches with their Stats


def test_a_prefix_one_router_placed_is_placed_there_by_the_other(tiny_model_dir) -> None:
    sim, prefill, decode = sim_pool(WORKERS, WORKERS, 254)
    ports, metrics = [free_port(), free_port()], [free_port(), free_port()]
    peers = ",".join(f"127.0.0.1:{p}" for p in ports)  # each router is among its peers too

    def router(i: int) -> list[str]:
        return pdserve_argv("router", "--model", str(tiny_model_dir), "--port", str(ports[i]),
                            "--http-port", "-1", "--metrics-port", str(metrics[i]),
                            "--prefill", ",".join(prefill), "--decode", ",".join(decode),
                            "--remote-prefill-min-tokens", "0", "--peers", peers)

    def scrape(i: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics[i]}/metrics", timeout=10) as r:
            return r.read().decode()

    def received(i: int) -> float:
        return _metric(scrape(i), "pdserve_router_peer_placements_received_total")

    with running(sim, decode[-1]), running(router(0), f"127.0.0.1:{ports[0]}"), \
            running(router(1), f"127.0.0.1:{ports[1]}"), \
            grpc.insecure_channel(f"127.0.0.1:{ports[0]}") as a, \
            grpc.insecure_channel(f"127.0.0.1:{ports[1]}") as b:
        one_stub, other_stub = router_pb2_grpc.RouterStub(a), router_pb2_grpc.RouterStub(b)
        for k in range(3):
            shared = [11 + (j * 7 + k * 31) % 170 for j in range(96)]  # six full pages
            before = received(1)
            _, one = _generate(one_stub, shared + [4, 5], 3)
            # Told within 0.1 s of each placement: the decode worker's, then the prefill's.
            assert wait_for(lambda n=before + 2: received(1) >= n, timeout_s=10)
            _, other = _generate(other_stub, shared + [6 + k], 3)
            assert other["prefill"] == one["prefill"], k  # where the prefix now is
        # Each found itself among its peers and stopped calling it; nothing failed.
        for i in (0, 1):
            text = scrape(i)
            assert _metric(text, "pdserve_router_peer_batches_total", result="failed") == 0
        assert _metric(scrape(0), "pdserve_router_peer_batches_total", result="sent") >= 3
