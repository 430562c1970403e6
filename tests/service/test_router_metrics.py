"""The /metrics endpoint on a real port, and what the router counts for requests through a
real gRPC stack (scripted fake workers)."""

from __future__ import annotations

import socket
import urllib.request

import grpc
import pytest
from pdserve.common.metrics import RouterMetrics, serve_metrics

from tests.fakes import run
from tests.support import exposition, samples, value

pytestmark = pytest.mark.service


def test_endpoint_serves_on_a_free_port_and_is_optional(caplog):
    metrics = RouterMetrics()
    metrics.requests.labels("ok", "OK", "grpc").inc()
    endpoint = serve_metrics(metrics.registry, 0, "127.0.0.1", service="test")
    assert endpoint is not None and endpoint.port > 0
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5) as r:
            found = samples(r.read().decode())
        assert value(found, "pdserve_requests_total", outcome="ok", code="OK", api="grpc") == 1
        # A busy port is a warning, not a failure to serve; -1 turns the endpoint off.
        assert serve_metrics(metrics.registry, endpoint.port, "127.0.0.1") is None
        assert "--metrics-port" in caplog.text
        assert serve_metrics(metrics.registry, -1) is None
    finally:
        endpoint.close()
    with socket.socket() as s:  # closed: nothing listens there any more
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the scrape left a TIME_WAIT
        s.bind(("127.0.0.1", endpoint.port))
        s.listen()


def test_router_counts_each_request_once_with_its_ttft_breakdown(stack):  # noqa: F811
    script, stub, lifecycle = stack
    n = len(script.tokens)
    for _ in range(2):
        run(stub, prompt="the fox", max_tokens=n)
    with pytest.raises(grpc.RpcError):
        run(stub, prompt="")
    found = exposition(lifecycle.metrics.registry)
    assert value(found, "pdserve_requests_total", outcome="ok", code="OK", api="grpc") == 2
    assert value(found, "pdserve_requests_total", outcome="error", code="INVALID_ARGUMENT",
                 api="grpc") == 1
    assert value(found, "pdserve_requests_in_flight") == 0
    assert value(found, "pdserve_ttft_seconds_count", api="grpc") == 2
    assert value(found, "pdserve_prefill_seconds_sum") == pytest.approx(0.006)  # 2 × 3 ms
    assert value(found, "pdserve_kv_transfer_seconds_sum", transport="local") == \
        pytest.approx(0.005)
    assert value(found, "pdserve_decode_start_seconds_sum") == pytest.approx(0.003)
    assert value(found, "pdserve_kv_bytes_total", transport="local") == 2 * 4096
    assert value(found, "pdserve_itl_seconds_count") == 2 * (n - 1)  # one per later message
    assert value(found, "pdserve_tpot_seconds_count") == 2
    assert value(found, "pdserve_completion_tokens_total") == 2 * n
    assert value(found, "pdserve_e2e_seconds_count", outcome="ok", api="grpc") == 2
    assert value(found, "pdserve_e2e_seconds_count", outcome="error", api="grpc") == 1
