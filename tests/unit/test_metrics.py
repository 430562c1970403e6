"""The metrics module: names, the /metrics endpoint, and what the router and agent count."""

from __future__ import annotations

import dataclasses
import socket
import urllib.request

import grpc
import pytest
from pdserve.common import errors as common_errors
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.metrics import (
    AgentMetrics,
    RouterMetrics,
    WorkerMetrics,
    count_outcome,
    serve_metrics,
)
from pdserve.kvtransfer import errors
from pdserve.worker.types import WorkerStats
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from tests.unit.test_router_lifecycle import run, stack, tok  # noqa: F401 (fixtures)

pytestmark = pytest.mark.unit

FINGERPRINT = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 16)
STATS = WorkerStats(worker_id="w", role="decode", num_pages=10, free_pages=7,
                    running_sequences=2, waiting_sequences=1, reserved_tickets=1,
                    queued_prompt_tokens=33, fingerprint=FINGERPRINT)


def samples(text: str) -> dict[tuple[str, frozenset], float]:
    """{(sample name, labels): value} of a Prometheus text exposition."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def exposition(registry: CollectorRegistry) -> dict[tuple[str, frozenset], float]:
    from prometheus_client import generate_latest
    return samples(generate_latest(registry).decode())


def value(found: dict, name: str, **labels: str) -> float:
    return found.get((name, frozenset(labels.items())), 0.0)


def test_every_metric_is_prefixed_and_carries_its_unit():
    registries = [RouterMetrics().registry, WorkerMetrics("decode", lambda: STATS).registry,
                  AgentMetrics().registry]
    names = set()
    for registry in registries:
        for family in registry.collect():
            assert family.name.startswith("pdserve_"), family.name
            if family.type == "histogram":
                assert family.name.endswith(("_seconds", "_gb_per_second")), family.name
            names.add(family.name)
    for expected in ("pdserve_ttft_seconds", "pdserve_queue_seconds", "pdserve_prefill_seconds",
                     "pdserve_kv_transfer_seconds", "pdserve_decode_start_seconds",
                     "pdserve_itl_seconds", "pdserve_tpot_seconds", "pdserve_e2e_seconds",
                     "pdserve_requests", "pdserve_kv_pages_free", "pdserve_kv_pages_used",
                     "pdserve_waiting_sequences", "pdserve_kv_transfer_bytes",
                     "pdserve_kv_handoff_seconds", "pdserve_kv_transfer_gb_per_second",
                     "pdserve_kv_transfer_failures"):
        assert expected in names


def test_worker_gauges_are_read_from_stats_when_scraped():
    stats = STATS
    registry = WorkerMetrics("decode", lambda: stats).registry
    found = exposition(registry)
    assert value(found, "pdserve_kv_pages_free", role="decode") == 7
    assert value(found, "pdserve_kv_pages_used", role="decode") == 3
    assert value(found, "pdserve_kv_pages_capacity", role="decode") == 10
    assert value(found, "pdserve_queued_prompt_tokens", role="decode") == 33
    stats = dataclasses.replace(STATS, free_pages=10)
    assert value(exposition(registry), "pdserve_kv_pages_used", role="decode") == 0


def test_endpoint_serves_on_a_free_port_and_is_optional(caplog):
    metrics = RouterMetrics()
    metrics.requests.labels("ok", "OK").inc()
    endpoint = serve_metrics(metrics.registry, 0, "127.0.0.1", service="test")
    assert endpoint is not None and endpoint.port > 0
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{endpoint.port}/metrics", timeout=5) as r:
            found = samples(r.read().decode())
        assert value(found, "pdserve_requests_total", outcome="ok", code="OK") == 1
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


def test_count_outcome_labels_by_status_code():
    metrics = WorkerMetrics("prefill", lambda: STATS)
    with count_outcome(metrics.prefills):
        pass
    for exc in (common_errors.InvalidArgument("bad"), ValueError("boom")):
        with pytest.raises(type(exc)), count_outcome(metrics.prefills):
            raise exc
    found = exposition(metrics.registry)
    for code in ("OK", "INVALID_ARGUMENT", "INTERNAL"):
        assert value(found, "pdserve_prefill_requests_total", code=code) == 1


def test_agent_counts_bytes_throughput_and_failure_causes():
    metrics = AgentMetrics()
    metrics.sent("ucx", 2_000_000, 4, 0.001)
    metrics.received("ucx", 2_000_000, 4)
    for exc in (errors.StaleEpoch("x"), errors.TicketExpired("x"), errors.LayoutMismatch("x"),
                errors.TransferTimeout("x"), errors.PeerUnavailable("x"), RuntimeError("x")):
        metrics.failed(errors.cause(exc), "send")
    found = exposition(metrics.registry)
    assert value(found, "pdserve_kv_transfer_bytes_total", transport="ucx", direction="send") \
        == 2_000_000
    assert value(found, "pdserve_kv_transfer_bytes_total", transport="ucx",
                 direction="receive") == 2_000_000
    assert value(found, "pdserve_kv_transfer_gb_per_second_sum", transport="ucx") == \
        pytest.approx(2.0)
    assert value(found, "pdserve_kv_handoff_seconds_count", transport="ucx") == 1
    for cause in ("stale_epoch", "expired", "layout_mismatch", "timeout", "unreachable",
                  "internal"):
        assert value(found, "pdserve_kv_transfer_failures_total", cause=cause,
                     direction="send") == 1


def test_router_counts_each_request_once_with_its_ttft_breakdown(stack):  # noqa: F811
    script, stub, lifecycle = stack
    n = len(script.tokens)
    for _ in range(2):
        run(stub, prompt="the fox", max_tokens=n)
    with pytest.raises(grpc.RpcError):
        run(stub, prompt="")
    found = exposition(lifecycle.metrics.registry)
    assert value(found, "pdserve_requests_total", outcome="ok", code="OK") == 2
    assert value(found, "pdserve_requests_total", outcome="error", code="INVALID_ARGUMENT") == 1
    assert value(found, "pdserve_requests_in_flight") == 0
    assert value(found, "pdserve_ttft_seconds_count") == 2
    assert value(found, "pdserve_prefill_seconds_sum") == pytest.approx(0.006)  # 2 × 3 ms
    assert value(found, "pdserve_kv_transfer_seconds_sum", transport="local") == \
        pytest.approx(0.005)
    assert value(found, "pdserve_decode_start_seconds_sum") == pytest.approx(0.003)
    assert value(found, "pdserve_kv_bytes_total", transport="local") == 2 * 4096
    assert value(found, "pdserve_itl_seconds_count") == 2 * (n - 1)  # one per later message
    assert value(found, "pdserve_tpot_seconds_count") == 2
    assert value(found, "pdserve_completion_tokens_total") == 2 * n
    assert value(found, "pdserve_e2e_seconds_count", outcome="ok") == 2
    assert value(found, "pdserve_e2e_seconds_count", outcome="error") == 1
