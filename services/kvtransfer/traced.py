"""The receiving agent's side of a trace: one kv.receive span per incoming handoff.

Pages arrive over UCX or TCP, not gRPC, so the sender's trace context travels in the write
header (`WriteHeader.traceparent`). `traced_sink(agent)` is what the agent hands its transport:
the same `WriteSink`, with a span from `accept` (child of the sender's kv.send) to `finish`
(every byte resident, or the write failed). With tracing off it is the agent itself. A copy
between two pools of one agent does not go through the transport: its kv.send says it all.
"""

from __future__ import annotations

from pdserve.common import tracing
from pdserve.common.kv.wire import WriteHeader
from pdserve.kvtransfer.transport import IncomingWrite, WriteSink


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
