"""What an attempt hands the lifecycle: the first token and how it was made (`Started`), and
the decode stream that goes on from there (`DecodeStream`)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.common import tracing
from pdserve.router.reservation import ReservationHandle
from pdserve.v1 import decode_pb2, prefill_pb2


@dataclass
class Started:
    """A request whose first token is known and, unless it ended there, whose decode stream
    is open with its first message read."""

    reservation: ReservationHandle
    prefill_address: str
    prefill: prefill_pb2.PrefillResponse
    prefill_sent: float  # clock() when the successful Prefill call went out
    attempts: int
    decode: DecodeStream | None  # None when the first token ended the request
    prefill_on: str = "prefill"  # or "decode": the decode worker computed it (no handoff)
    placement: str = ""  # why these workers: the explanations of both picks

    @property
    def prefill_worker(self) -> str:
        return self.prefill.worker_id or self.prefill_address


@dataclass
class DecodeStream:
    """An open Decode call: its first message (decode_start_ms), the rest, and its span."""

    call: Any  # the grpc stream (iterator of DecodeResponse, with .cancel())
    first: decode_pb2.DecodeResponse
    span: tracing.Span

    def messages(self) -> Iterator[decode_pb2.DecodeResponse]:
        yield self.first
        yield from self.call
