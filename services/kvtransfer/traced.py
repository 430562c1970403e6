"""The receiving agent's side of a trace: one kv.receive span per incoming handoff.

Pages arrive over UCX or TCP, not gRPC, so the sender's trace context travels in the write
header (`WriteHeader.traceparent`). `traced_sink(agent)` is what the agent hands its transport:
the same `WriteSink`, with a span from `accept` (child of the sender's kv.send) to `finish`
(every byte resident, or the write failed). With tracing off it is the agent itself. A copy
between two pools of one agent does not go through the transport: its kv.send says it all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pdserve.common import tracing
from pdserve.common.handoff import TransferReport
from pdserve.kvtransfer.transport import IncomingWrite, WriteSink
from pdserve.kvtransfer.wire import WriteHeader


class TracedSink:
    """A `WriteSink` that traces each write it accepts (see the module docstring)."""

    def __init__(self, sink: WriteSink, agent_id: str, transport: str):
        self._sink = sink
        self._agent_id = agent_id
        self._transport = transport

    def accept(self, header: WriteHeader) -> IncomingWrite:
        span = tracing.start_span(
            "kv.receive", kind=tracing.SERVER,
            context=tracing.context_from_traceparent(header.traceparent),
            request_id=header.ticket.request_id, agent_id=self._agent_id,
            kv_transport=self._transport, kv_bytes=header.kv_bytes,
            kv_pages=sum(n for _, n in header.dst_runs), num_runs=len(header.dst_runs))
        try:
            write = self._sink.accept(header)
        except BaseException as exc:  # refused: nothing was written
            tracing.record_error(span, exc)
            span.end()
            raise
        write.span = span
        return write

    def finish(self, write: IncomingWrite, ok: bool) -> None:
        span = write.span if write.span is not None else tracing.start_span("kv.receive")
        with tracing.ending(span):
            self._sink.finish(write, ok)
            if not ok:
                tracing.record_error(span, "the handoff stopped before all its bytes arrived")


def traced_sink(sink: WriteSink, agent_id: str, transport: str) -> WriteSink:
    """`sink` with a kv.receive span per write when tracing is on; `sink` itself when off."""
    return TracedSink(sink, agent_id, transport) if tracing.enabled() else sink


class SendSpan:
    """The kv.send span of one SendPages (gRPC or the local socket's `send`)."""

    def __init__(self, span: Any):
        self.span = span

    def report(self, r: TransferReport) -> None:
        # handoff_ms: this agent's part; the request's kv_transfer_ms (on prefill.request and
        # router.generate) is measured by the prefill worker around its call, parts included.
        self.span.set_attributes({"kv_bytes": r.kv_bytes, "kv_pages": r.kv_pages,
                                  "kv_transport": r.transport, "num_runs": r.num_runs,
                                  "handoff_ms": r.handoff_ms})


@contextlib.contextmanager
def send_span(agent_id: str, request_id: str, dst_agent: str, kv_pages: int,
              context: Any = None) -> Iterator[SendSpan]:
    """kv.send around a block, current inside (its traceparent goes into the write header);
    a child of `context`, else of the current context (the caller's, for a gRPC call)."""
    span = tracing.start_span("kv.send", kind=tracing.SERVER, context=context,
                              request_id=request_id, agent_id=agent_id, dst_agent=dst_agent,
                              kv_pages=kv_pages)
    with tracing.ending(span), tracing.current(span):
        yield SendSpan(span)
