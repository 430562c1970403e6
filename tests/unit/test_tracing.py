"""Tracing helpers: configuration from the standard variables, the KV write header's
traceparent, status codes on error spans (set-up itself: in a fresh interpreter, see
tests/service/test_fresh_interpreter.py)."""

from __future__ import annotations

import grpc
import pytest
from pdserve.common import tracing
from pdserve.common.errors import NotFound, Unavailable
from pdserve.common.kv.wire import WriteHeader
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey
from pdserve.router.cancel import ClientCancelled

pytestmark = pytest.mark.unit

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def test_config_from_the_standard_variables():
    cfg = tracing.TracingConfig.from_env("pdserve-decode", {})
    assert (cfg.endpoint, cfg.service_name, cfg.sample_ratio) == ("", "pdserve-decode", 1.0)
    cfg = tracing.TracingConfig.from_env("pdserve-decode", {
        "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317", "OTEL_SERVICE_NAME": "mine",
        "OTEL_TRACES_SAMPLER_ARG": "0.25"})
    assert (cfg.endpoint, cfg.service_name, cfg.sample_ratio) == ("http://collector:4317",
                                                                  "mine", 0.25)
    assert cfg.insecure
    assert not tracing.TracingConfig.from_env("x", {
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "https://c:4317"}).insecure
    for off in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_TRACES_EXPORTER": "none"}):
        assert not tracing.TracingConfig.from_env(
            "x", {"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317", **off}).endpoint
    for bad in ("lots", "1.5", "-0.1"):
        with pytest.raises(ValueError, match="OTEL_TRACES_SAMPLER_ARG"):
            tracing.TracingConfig.from_env("x", {"OTEL_TRACES_SAMPLER_ARG": bad})


def test_a_bad_variable_leaves_tracing_off_instead_of_failing():
    assert tracing.setup_tracing("x", env={"OTEL_EXPORTER_OTLP_ENDPOINT": "c:4317",
                                           "OTEL_TRACES_SAMPLER_ARG": "often"}) is False


def test_status_codes_of_errors():
    assert tracing.status_code(Unavailable("down")) == grpc.StatusCode.UNAVAILABLE
    assert tracing.status_code(NotFound("gone")) == grpc.StatusCode.NOT_FOUND
    assert tracing.status_code(ClientCancelled()) == grpc.StatusCode.CANCELLED
    assert tracing.status_code(GeneratorExit()) == grpc.StatusCode.CANCELLED
    assert tracing.status_code(ValueError("bug")) is None


def _header(**kw) -> WriteHeader:
    fp = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 16, 0, 1)
    return WriteHeader(xfer_id=7, ticket=TicketKey("req", 3), dst_agent_epoch=9, dst_pool_id="p",
                       fingerprint=fp, page_bytes=4096, dst_runs=((0, 2), (5, 1)),
                       timeout_ms=1000.0, **kw)


def test_the_write_header_carries_a_traceparent_and_stays_compatible():
    traced = _header(traceparent=TRACEPARENT)
    assert WriteHeader.decode(traced.encode()) == traced
    plain = _header()
    assert b"traceparent" not in plain.encode()  # untraced: the header is as before
    assert WriteHeader.decode(plain.encode()).traceparent == ""
