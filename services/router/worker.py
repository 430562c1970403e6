"""One worker as the router's pool holds it: its channel and stubs, and what the router knows
of it (health, last Stats, its own calls there)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from pdserve.router.calls import WorkerCalls
from pdserve.router.mux import DecodeStreams
from pdserve.router.placement import DEFAULT_BLOCK_SIZE, DecodeLoad, PrefillLoad
from pdserve.v1 import common_pb2, decode_pb2_grpc, prefill_pb2_grpc


@dataclass
class Worker:
    """One worker: its channel and stubs, and the router's latest knowledge of it."""

    address: str
    role: str  # "prefill" or "decode"
    channel: grpc.Channel
    stub: prefill_pb2_grpc.PrefillStub | decode_pb2_grpc.DecodeStub
    unary: WorkerCalls  # its unary methods, called on the caller's thread
    healthy: bool = False
    stats: common_pb2.WorkerStats | None = None
    inflight_prompt_tokens: int = 0
    placed: int = 0  # prompts sent (prefill), reservations granted (decode): spreads ties
    calls: int = 0  # this router's calls on it now (acquire .. release)
    checked: bool = False  # read at least once since it joined
    checked_at: float = 0.0  # monotonic time of its last read
    member: bool = True  # False once retired: no new calls; dropped after its last one
    last_error: str = field(default="", repr=False)
    streams: DecodeStreams | None = None  # decode: the shared stream its sequences run on

    @property
    def prefill(self) -> prefill_pb2_grpc.PrefillStub:
        assert isinstance(self.stub, prefill_pb2_grpc.PrefillStub)
        return self.stub

    @property
    def decode(self) -> decode_pb2_grpc.DecodeStub:
        assert isinstance(self.stub, decode_pb2_grpc.DecodeStub)
        return self.stub

    def prefill_load(self) -> PrefillLoad:
        """What prefill placement weighs: health, pending prompt tokens, layout, spread."""
        s = self.stats
        return PrefillLoad(self.address, self.healthy, s.queued_prompt_tokens if s else 0,
                           self.inflight_prompt_tokens,
                           (s.fingerprint.block_size if s else 0) or DEFAULT_BLOCK_SIZE,
                           self.placed)

    def decode_load(self) -> DecodeLoad:
        """What decode placement weighs: health and the last (locally adjusted) Stats."""
        s = self.stats
        if s is None:
            return DecodeLoad(self.address, self.healthy, placed=self.placed, inflight=self.calls)
        return DecodeLoad(self.address, self.healthy, s.free_pages, s.running_sequences,
                          s.waiting_sequences, s.reserved_tickets,
                          s.fingerprint.block_size or DEFAULT_BLOCK_SIZE, self.placed,
                          self.calls)
