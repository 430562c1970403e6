"""What the router learned about one request, filled in as it goes: read once at the end by
the outcome log line, the router.generate span and the metrics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass
class RequestRecord:
    request_id: str = "-"
    api: str = "grpc"  # the front door: grpc or http
    status: str = "OK"  # a gRPC status name
    error: str = ""
    trace_id: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str = ""
    prefill: str = ""  # the worker that served the successful attempt
    decode: str = ""
    attempts: int = 0
    queue_ms: float | None = None  # None until the first token was sent
    prefill_ms: float | None = None
    kv_transfer_ms: float | None = None
    kv_transfer_total_ms: float | None = None
    decode_start_ms: float | None = None
    ttft_ms: float | None = None
    kv_bytes: int = 0
    prefill_on: str = ""      # "prefill" or "decode" (no handoff)
    cached_tokens: int = 0    # prompt tokens not computed for this request
    placement: str = ""       # why these workers: candidates, cached tokens, load, the decider
    tpot_ms: float = 0.0
    e2e_ms: float = 0.0

    def fields(self) -> dict[str, Any]:
        """The set fields (no empty strings, no unset times), times rounded to the µs."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None or value == "" or (f.name == "attempts" and not value):
                continue
            out[f.name] = round(value, 3) if isinstance(value, float) else value
        return out
