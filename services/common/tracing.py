"""Distributed tracing (OpenTelemetry): one trace per request across every pdserve process.

    setup_tracing("pdserve-decode", instance_id=worker_id)   # once, at start-up
    with tracing.span("decode.reserve", kind=tracing.SERVER, request_id=rid) as span:
        ...
        span.set_attribute("kv_pages", len(page_ids))
    stub.Prefill.future(request, metadata=tracing.outgoing_metadata())
    shutdown_tracing()                                        # at exit (bounded; also atexit)

Off unless OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set: then the
SDK is not even imported, no thread runs, and every helper returns at once (spans are the
shared no-op span, metadata is None). On: finished spans go to a BatchSpanProcessor (a bounded
queue and one export thread, so the token path never waits for the collector; OTEL_BSP_*
tune it) and over OTLP/gRPC to the endpoint (`host:port` or `http://host:port`: plaintext;
`https://`: TLS). Sampling is ParentBased(TraceIdRatioBased(OTEL_TRACES_SAMPLER_ARG, default
1.0)): the router decides per request, every other service follows its caller's sampled flag.
service.name is OTEL_SERVICE_NAME, else the service's default (pdserve-router, ...).

Context travels as W3C `traceparent` (and `tracestate`): in gRPC metadata between services
(the server bootstrap runs each handler with its caller's trace as the current context, see
`traced_call` / `traced_stream`), and inside the KV write header between agents, whose data
path is not gRPC (`traceparent` / `context_from_traceparent`).

Errors go on the span with their gRPC status code (`record_error`). Spans only at phase
boundaries, never one per token.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import contextvars
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span as Span  # re-exported: callers annotate with tracing.Span
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.trace.status import Status, StatusCode
from pdserve.common import requestids

log = logging.getLogger("pdserve.tracing")

T = TypeVar("T")
SERVER, CLIENT, INTERNAL = SpanKind.SERVER, SpanKind.CLIENT, SpanKind.INTERNAL
SHUTDOWN_TIMEOUT_S = 3.0
_HEADERS = ("traceparent", "tracestate")
_PROPAGATOR = TraceContextTextMapPropagator()
_tracer: trace.Tracer | None = None  # None: tracing is off
_processor: Any = None  # the BatchSpanProcessor while tracing is on


# --- configuration ------------------------------------------------------------------------

@dataclass(frozen=True)
class TracingConfig:
    """What the standard OTEL_* variables say, validated (a bad value names its variable)."""

    endpoint: str = ""  # empty: tracing off
    service_name: str = ""
    sample_ratio: float = 1.0

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_ratio <= 1.0:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={self.sample_ratio!r}: expected a "
                             "sampling ratio in [0, 1]")

    @property
    def insecure(self) -> bool:
        return not self.endpoint.startswith("https://")

    @classmethod
    def from_env(cls, default_service: str, env: Mapping[str, str] | None = None
                 ) -> TracingConfig:
        env = os.environ if env is None else env
        endpoint = (env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
                    or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip())
        if (env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
                or env.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none"):
            endpoint = ""
        ratio_text = env.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        try:
            ratio = float(ratio_text) if ratio_text else 1.0
        except ValueError:
            raise ValueError(f"OTEL_TRACES_SAMPLER_ARG={ratio_text!r}: expected a sampling "
                             "ratio in [0, 1]") from None
        service = env.get("OTEL_SERVICE_NAME", "").strip() or default_service
        return cls(endpoint, service, ratio)


def setup_tracing(default_service: str, *, instance_id: str = "",
                  env: Mapping[str, str] | None = None) -> bool:
    """Turn tracing on for this process when an OTLP endpoint is configured; True when on.

    A bad OTEL_* value is logged and leaves tracing off (serving goes on)."""
    global _tracer, _processor
    try:
        cfg = TracingConfig.from_env(default_service, env)
    except ValueError as exc:
        log.error("tracing off: %s", exc)
        return False
    if not cfg.endpoint or _tracer is not None:
        return _tracer is not None
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    attributes = {"service.name": cfg.service_name, "service.namespace": "pdserve"}
    if instance_id:
        attributes["service.instance.id"] = instance_id
    provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False,
                              sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)))
    _processor = BatchSpanProcessor(OTLPSpanExporter(endpoint=cfg.endpoint,
                                                     insecure=cfg.insecure))
    provider.add_span_processor(_processor)
    trace.set_tracer_provider(provider)
    _tracer = provider.get_tracer("pdserve")
    atexit.register(shutdown_tracing)
    log.info("tracing on: %s spans over OTLP to %s, sampling %g", cfg.service_name,
             cfg.endpoint, cfg.sample_ratio)
    return True


def shutdown_tracing(timeout_s: float = SHUTDOWN_TIMEOUT_S) -> None:
    """Export what is queued and stop the export thread, in at most about `timeout_s`.
    Safe to call twice; spans started afterwards are no-ops."""
    global _tracer, _processor
    processor, _processor, _tracer = _processor, None, None
    if processor is None:
        return
    # The SDK's own shutdown may wait 30 s for an unreachable collector: give it `timeout_s`,
    # then shut the exporter, which ends its retries and cancels the export in flight.
    stopping = threading.Thread(target=processor.shutdown, name="otel-shutdown", daemon=True)
    stopping.start()
    stopping.join(timeout_s)
    if stopping.is_alive():
        log.warning("tracing: spans not exported within %.1fs of shutdown were dropped", timeout_s)
        with contextlib.suppress(Exception):
            processor.span_exporter.shutdown()


def enabled() -> bool:
    return _tracer is not None


# --- spans --------------------------------------------------------------------------------

def start_span(name: str, *, kind: SpanKind = INTERNAL, parent: Span | None = None,
               context: otel_context.Context | None = None, start_time_ns: int | None = None,
               **attributes: Any) -> Span:
    """A started span (end it yourself), child of `parent`, else of `context`, else of the
    current context. Safe across generator yields: it is not made current."""
    if _tracer is None:
        return trace.INVALID_SPAN
    if parent is not None:
        context = trace.set_span_in_context(parent)
    attributes = requestids.labelled(attributes)  # the client's id, and the attempt's
    return _tracer.start_span(name, context=context, kind=kind, attributes=attributes,
                              start_time=start_time_ns)


@contextlib.contextmanager
def span(name: str, *, kind: SpanKind = INTERNAL, parent: Span | None = None,
         **attributes: Any) -> Iterator[Span]:
    """A span around a block that does not yield: current inside, error recorded, ended."""
    if _tracer is None:
        yield trace.INVALID_SPAN
        return
    s = start_span(name, kind=kind, parent=parent, **attributes)
    with ending(s), current(s):
        yield s


def current(s: Span) -> contextlib.AbstractContextManager[Any]:
    """Make `s` the current span inside a block that does not yield (neither records nor ends)."""
    if _tracer is None:
        return contextlib.nullcontext(s)
    return trace.use_span(s, end_on_exit=False, record_exception=False,
                          set_status_on_exception=False)


@contextlib.contextmanager
def ending(s: Span) -> Iterator[Span]:
    """End `s` when the block exits, recording an exception first. Does not make `s` current,
    so the block may yield (a stream relayed across many messages)."""
    try:
        yield s
    except BaseException as exc:
        record_error(s, exc)
        raise
    finally:
        s.end()


def record_phase(name: str, parent: Span, start_time_ns: int, duration_ms: float,
                 **attributes: Any) -> None:
    """A finished child span for a phase measured elsewhere (for example, in the engine)."""
    if _tracer is None:
        return
    s = start_span(name, parent=parent, start_time_ns=start_time_ns, **attributes)
    s.end(end_time=start_time_ns + max(0, int(duration_ms * 1e6)))


def status_code(error: BaseException) -> grpc.StatusCode | None:
    """The gRPC status an exception stands for: its `code` (ServiceError, RpcError), CANCELLED
    for a closed stream or a cancelled future, else None (not a status-carrying error)."""
    if isinstance(error, (GeneratorExit, concurrent.futures.CancelledError,
                          grpc.FutureCancelledError)):
        return grpc.StatusCode.CANCELLED
    code = getattr(error, "code", None)
    if callable(code):
        try:
            code = code()
        except Exception:
            code = None
    if isinstance(code, str):  # a domain error (pdserve.common.errors): the status name
        return getattr(grpc.StatusCode, code, None)
    return code if isinstance(code, grpc.StatusCode) else None


def record_error(s: Span, error: BaseException | str,
                 code: grpc.StatusCode | None = None) -> None:
    """Put a failure on the span: rpc.grpc.status_code (when the error has one), error.type,
    the exception as an event, status ERROR with the message. CANCELLED (the caller went
    away) is recorded as the code only, not as an error."""
    if not s.is_recording():
        return
    message = error
    if isinstance(error, BaseException):
        code = code or status_code(error)
        message = getattr(error, "message", None) or str(error) or type(error).__name__
        details = getattr(error, "details", None)
        if callable(details):
            with contextlib.suppress(Exception):
                message = details() or message
        s.set_attribute("error.type", type(error).__name__)
    if code is not None:
        s.set_attribute("rpc.grpc.status_code", code.value[0])
    if code == grpc.StatusCode.CANCELLED:
        return
    if isinstance(error, BaseException):
        s.record_exception(error)
    s.set_status(Status(StatusCode.ERROR, f"{code.name}: {message}" if code else str(message)))


def log_fields(s: Span) -> dict[str, str]:
    """{"trace_id": hex} for a request's outcome log line when the span belongs to a trace."""
    ctx = s.get_span_context()
    return {"trace_id": trace.format_trace_id(ctx.trace_id)} if ctx.is_valid else {}


# --- propagation --------------------------------------------------------------------------

def _carrier(s: Span | None) -> dict[str, str]:
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=None if s is None else trace.set_span_in_context(s))
    return carrier


def outgoing_metadata(s: Span | None = None) -> tuple[tuple[str, str], ...] | None:
    """gRPC metadata carrying `s` (default: the current span) to the callee; None when off."""
    if _tracer is None:
        return None
    return tuple(_carrier(s).items()) or None


def traceparent(s: Span | None = None) -> str:
    """The W3C traceparent of `s` (default: the current span); "" when off or none."""
    return _carrier(s).get("traceparent", "") if _tracer is not None else ""


def context_from_traceparent(value: str) -> otel_context.Context | None:
    """The parent context a traceparent names (None when off or empty)."""
    if _tracer is None or not value:
        return None
    return _PROPAGATOR.extract({"traceparent": value})


def caller_context(headers: Mapping[str, str]) -> contextvars.Context:
    """A copy of the current context with the caller's trace (its `traceparent` /
    `tracestate` in `headers`, lower-case names) attached: run a request's work in it."""
    ctx = contextvars.copy_context()
    if _tracer is not None:
        carrier = {key: headers[key] for key in _HEADERS if key in headers}
        ctx.run(otel_context.attach, _PROPAGATOR.extract(carrier))
    return ctx


def _caller_context(servicer_context: grpc.ServicerContext) -> contextvars.Context:
    return caller_context({key: value for key, value in
                           (servicer_context.invocation_metadata() or ()) if key in _HEADERS})


def traced_call(servicer_context: grpc.ServicerContext, fn: Callable[..., T], *args: Any) -> T:
    """Run a unary handler with its caller's trace (from the call's metadata) as the current
    context; a call without traceparent starts from an empty one."""
    if _tracer is None:
        return fn(*args)
    return _caller_context(servicer_context).run(fn, *args)


def traced_stream(servicer_context: grpc.ServicerContext, responses: Iterator[T]) -> Iterator[T]:
    """Iterate a streaming handler with its caller's trace as the current context. Every step
    (and the final close) runs in one context of its own, so what the handler makes current
    stays current across its yields, whichever thread resumes it."""
    if _tracer is None:
        yield from responses
        return
    ctx = _caller_context(servicer_context)
    try:
        while True:
            try:
                item = ctx.run(next, responses)
            except StopIteration:
                return
            yield item
    finally:
        close = getattr(responses, "close", None)
        if close is not None:
            ctx.run(close)
