"""The sending side of a handoff's trace: one kv.send span per handoff, made by the sending
agent (SendPages over gRPC or its local socket's `send`) or by a prefill worker's same-host
lane. Its traceparent goes into the write header, so the receiving agent's kv.receive
(pdserve.kvtransfer.traced) is its child."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pdserve.common import tracing
from pdserve.common.handoff import TransferReport


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
