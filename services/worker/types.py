"""What the Prefill and Decode APIs carry, as plain types: the servicers convert the wire
form to these and back (convert.py); the workers never see protobuf."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.sampling import SamplingParams
from pdserve.common.tickets import TicketKey


@dataclass(frozen=True)
class PrefillRequest:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    ticket: TicketKey
    destination: Destination


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    finish_reason: str | None  # set when the first token already ends the request
    queue_ms: float
    prefill_ms: float
    transfer: TransferReport
    cached_tokens: int = 0  # leading prompt tokens this worker's prefix cache supplied
    # Bookkeeping that is no part of the answer (the lane's notes to this host's agent), for
    # the servicer to run once the answer is on its way: on a VM's vCPU each note wakes the
    # agent ahead of the reply (~0.3 ms of TTFT). None: nothing.
    after_reply: Callable[[], None] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Reservation:
    """Pages reserved on a decode worker: the ticket to quote, and where the KV must land."""

    ticket: TicketKey
    destination: Destination
    renew_s: float = 0.0  # the renewal period granted (0: the lease is not renewable)
    cached_tokens: int = 0  # leading prompt tokens whose KV this worker holds already
    prefilling_here: bool = False  # the worker started the prompt itself (no pages to fill)


@dataclass(frozen=True)
class PrefillHere:
    """Reserve's offer to skip the handoff: when the worker lacks fewer than `below_tokens`
    of the prompt, it starts computing them at once with `params`."""

    below_tokens: int
    params: SamplingParams


@dataclass(frozen=True)
class DecodeRequest:
    ticket: TicketKey
    prompt_ids: list[int]
    first_token: int
    params: SamplingParams
    local_prefill: bool = False  # compute the prompt here (no handoff; first_token unset)


@dataclass(frozen=True)
class DecodeEvent:
    """One message of a decode stream: tokens, and on the first message the start latency."""

    token_ids: list[int]
    finish_reason: str = ""
    decode_start_ms: float = 0.0
    prefill_ms: float = 0.0   # local prefill's first message: its compute
    queue_ms: float = 0.0     # ... and its wait before computing
    cached_tokens: int = 0    # ... and the prompt tokens its reservation held cached


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    role: str
    num_pages: int
    free_pages: int
    running_sequences: int
    waiting_sequences: int
    queued_prompt_tokens: int
    fingerprint: LayoutFingerprint
    reserved_tickets: int = 0
    cached_pages: int = 0
    max_model_len: int = 0  # prompt + output tokens of the longest sequence served
