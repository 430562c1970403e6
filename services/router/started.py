"""What an attempt hands the lifecycle: the first token and how it was made (`Started`), and
the decode stream that goes on from there (`DecodeStream`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pdserve.common import tracing
from pdserve.common.stream_interval import absorb
from pdserve.router.mux import SequenceStream
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
class Parked:
    """What a parking lifecycle (`Lifecycle.generate(parking=True)`) yields instead of waiting
    for its decode stream: whoever iterates it stops and calls `park(resume)`; `resume(inline)`
    comes once there is more (inline: on the thread that delivered it, which may go on
    iterating there). `stream` None: go on, but not on the delivering thread (what follows
    blocks: a release, the request's end)."""

    stream: SequenceStream | None

    def park(self, resume: Callable[[bool], None]) -> bool:
        """False when nothing is to be waited for: iterate on at once."""
        if self.stream is None:
            resume(False)
            return True
        return self.stream.park(resume)


@dataclass
class DecodeStream:
    """An open Decode call: its first message (decode_start_ms), the rest, and its span."""

    call: Any  # the grpc stream (iterator of DecodeResponse, with .cancel()), or SequenceStream
    first: decode_pb2.DecodeResponse
    span: tracing.Span

    def messages(self, parking: bool = False, on_merged: Callable[[int], None] | None = None
                 ) -> Iterator[decode_pb2.DecodeResponse | Parked]:
        """The messages; with `parking`, `Parked` before each one that has not arrived yet on
        a shared stream (instead of blocking). On a shared stream the messages that arrived
        behind one while the relay was busy come merged into it: a relay that falls behind
        sends one message for all that piled up, so its cost per token falls as load grows
        instead of its queue growing; `on_merged(n)` is told of each n merged."""
        yield self.first
        call = self.call
        if not isinstance(call, SequenceStream):
            yield from call
            return
        while True:
            if parking and not call.ready():
                yield Parked(call)
            try:
                message = next(call)
            except StopIteration:
                return
            merged = _merge_ready(call, message)
            if merged and on_merged is not None:
                on_merged(merged)
            yield message


def _merge_ready(call: SequenceStream, message: decode_pb2.DecodeResponse) -> int:
    """Append to `message` the tokens of those that arrived behind it (the relay fell behind
    the worker: one message out instead of several); how many were merged."""
    merged = 0
    while not message.finish_reason and (more := call.take_ready()) is not None:
        absorb(message, more)
        merged += 1
    return merged
