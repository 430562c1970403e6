"""The router's public API as plain types: what a client asks (`GenerateInput`) and what its
stream carries (`Delta`, `Timing`, `Finish`).

Both front doors (gRPC `pdserve.v1.Router/Generate`, and any other) turn their wire form into
a `GenerateInput`, hand it to `Lifecycle.generate`, and turn each `StreamEvent` back into
their wire form. Nothing here knows protobuf or HTTP. Unset optional fields (`None`) take the
documented defaults in `validation.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.handoff import RankTransfer


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerateInput:
    """One client request, as sent: nothing validated or defaulted yet."""

    prompt: str = ""
    token_ids: tuple[int, ...] = ()
    messages: tuple[ChatMessage, ...] = ()
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    request_id: str = ""
    model: str = ""


@dataclass(frozen=True)
class Delta:
    """New output: the text for `token_ids` (may be "" while a character or a possible stop
    string is held back)."""

    request_id: str
    text: str
    token_ids: tuple[int, ...]


@dataclass
class Timing:
    """The TTFT breakdown of one request (sent once, right after the first delta)."""

    request_id: str
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    kv_transfer_ms: float = 0.0  # the handoff's part after prefill (what TTFT pays)
    decode_start_ms: float = 0.0
    ttft_ms: float = 0.0
    kv_bytes: int = 0
    kv_pages: int = 0
    kv_transport: str = ""
    prefill_worker: str = ""
    decode_worker: str = ""
    attempts: int = 1
    kv_transfer_total_ms: float = 0.0  # the whole transfer (pipelined: mostly during prefill)
    cached_tokens: int = 0          # prompt tokens whose KV this request did not compute
    prefill_cached_tokens: int = 0  # ... held by the prefill side's prefix cache
    decode_cached_tokens: int = 0   # ... held by the decode worker (not shipped)
    prompt_pages: int = 0           # the prompt's pages; kv_pages of them crossed to decode
    prefill_on: str = "prefill"     # "prefill" (the prefill pool) or "decode" (no handoff)
    kv_ranks: tuple[RankTransfer, ...] = ()  # tensor-parallel workers: each decode rank's part


@dataclass(frozen=True)
class Finish:
    """The last event of a successful stream."""

    request_id: str
    finish_reason: str  # "stop" or "length"
    prompt_tokens: int
    completion_tokens: int
    e2e_ms: float
    tpot_ms: float
    itl_mean_ms: float
    itl_max_ms: float


StreamEvent = Delta | Timing | Finish
