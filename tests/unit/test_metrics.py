"""Metric names, units, gauges read from stats, and what the counters count (no sockets)."""

from __future__ import annotations

import dataclasses

import pytest
from pdserve.common import errors as common_errors
from pdserve.common.kv import errors
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.metrics import (
    AgentMetrics,
    RouterMetrics,
    WorkerMetrics,
    count_outcome,
)
from pdserve.worker.types import WorkerStats

from tests.support import exposition, value

pytestmark = pytest.mark.unit

FINGERPRINT = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 16)
STATS = WorkerStats(worker_id="w", role="decode", num_pages=10, free_pages=7,
                    running_sequences=2, waiting_sequences=1, reserved_tickets=1,
                    queued_prompt_tokens=33, fingerprint=FINGERPRINT)


def test_every_metric_is_prefixed_and_carries_its_unit():
    registries = [RouterMetrics().registry, WorkerMetrics("decode", lambda: STATS).registry,
                  AgentMetrics().registry]
    names = set()
    for registry in registries:
        for family in registry.collect():
            assert family.name.startswith("pdserve_"), family.name
            if family.type == "histogram":
                # a time, a rate, or a count of things named in the plural (the decode batch)
                assert family.name.endswith(("_seconds", "_gb_per_second", "_sequences")), \
                    family.name
            names.add(family.name)
    for expected in ("pdserve_ttft_seconds", "pdserve_queue_seconds", "pdserve_prefill_seconds",
                     "pdserve_kv_transfer_seconds", "pdserve_decode_start_seconds",
                     "pdserve_itl_seconds", "pdserve_tpot_seconds", "pdserve_e2e_seconds",
                     "pdserve_requests", "pdserve_kv_pages_free", "pdserve_kv_pages_used",
                     "pdserve_waiting_sequences", "pdserve_kv_transfer_bytes",
                     "pdserve_kv_handoff_seconds", "pdserve_kv_transfer_gb_per_second",
                     "pdserve_kv_transfer_failures", "pdserve_engine_step_seconds",
                     "pdserve_engine_step_sequences"):
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
    metrics.sent("ucx", 2_000_000, 4, 0.001, "host-b")
    metrics.received("ucx", 2_000_000, 4, "host-a")
    metrics.received("ucx", 1_000, 1, "")  # a sender that did not name itself
    for exc in (errors.StaleEpoch("x"), errors.TicketExpired("x"), errors.LayoutMismatch("x"),
                errors.TransferTimeout("x"), errors.PeerUnavailable("x"), RuntimeError("x")):
        metrics.failed(errors.cause(exc), "send")
    found = exposition(metrics.registry)
    assert value(found, "pdserve_kv_transfer_bytes_total", transport="ucx", direction="send",
                 peer="host-b") == 2_000_000
    assert value(found, "pdserve_kv_transfer_bytes_total", transport="ucx",
                 direction="receive", peer="host-a") == 2_000_000
    assert value(found, "pdserve_kv_transfer_pages_total", transport="ucx",
                 direction="receive", peer="unknown") == 1
    assert value(found, "pdserve_kv_transfer_gb_per_second_sum", transport="ucx") == \
        pytest.approx(2.0)
    assert value(found, "pdserve_kv_handoff_seconds_count", transport="ucx") == 1
    for cause in ("stale_epoch", "expired", "layout_mismatch", "timeout", "unreachable",
                  "internal"):
        assert value(found, "pdserve_kv_transfer_failures_total", cause=cause,
                     direction="send") == 1


