"""Tracing set-up and helpers: off by default at no cost, on with an endpoint, bounded shutdown;
the KV write header's traceparent; status codes on error spans. Set-up is per process, so
those checks run in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import grpc
import pytest
from pdserve.common import tracing
from pdserve.common.errors import NotFound, Unavailable
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.wire import WriteHeader
from pdserve.router.cancel import ClientCancelled

from tests.support import free_port

pytestmark = pytest.mark.unit

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _run(script: str, **env: str) -> str:
    """Run `script` in a fresh interpreter with only these OTEL_* variables; its stdout."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], env={**clean, **env},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_without_an_endpoint_tracing_is_a_no_op():
    out = _run("""
        import sys, threading
        from pdserve.common import tracing
        assert tracing.setup_tracing("pdserve-test") is False
        assert not tracing.enabled()
        assert not [m for m in sys.modules if m.startswith("opentelemetry.sdk")]
        assert not [t.name for t in threading.enumerate() if t.name.startswith("Otel")]
        with tracing.span("x", request_id="r") as s:
            assert not s.is_recording()
            assert tracing.outgoing_metadata() is None and tracing.traceparent() == ""
        assert tracing.start_span("y") is tracing.start_span("z")  # the one shared no-op span
        assert tracing.log_fields(s) == {}
        tracing.shutdown_tracing()
        print("ok")
    """)
    assert out.strip() == "ok"


def test_with_an_endpoint_spans_are_batched_sampled_and_shut_down_in_bounded_time():
    # Nothing listens on the port: export fails in the background, never in the caller.
    out = _run(f"""
        import threading, time
        from pdserve.common import tracing
        assert tracing.setup_tracing("pdserve-test", instance_id="t-1") is True
        assert [t.name for t in threading.enumerate() if t.name.startswith("OtelBatch")]
        root = tracing.start_span("root")  # ratio 0: a new trace is not sampled
        assert not root.is_recording()
        parent = tracing.context_from_traceparent("{TRACEPARENT}")
        child = tracing.start_span("child", context=parent)  # the caller sampled it: recorded
        assert child.is_recording()
        with tracing.current(child):
            md = dict(tracing.outgoing_metadata())
        assert md["traceparent"].split("-")[1] == "{TRACEPARENT.split('-')[1]}"
        assert tracing.traceparent(child) == md["traceparent"]
        assert tracing.log_fields(child) == {{"trace_id": "{TRACEPARENT.split('-')[1]}"}}
        child.end()
        started = time.monotonic()
        tracing.shutdown_tracing(timeout_s=2.0)
        assert time.monotonic() - started < 4.0
        assert not tracing.enabled()
        print("ok")
    """, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}",
        OTEL_TRACES_SAMPLER_ARG="0")
    assert out.strip().splitlines()[-1] == "ok"


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
