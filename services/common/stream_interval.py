"""A sequence's Decode messages, N tokens to a message (DecodeRequest.stream_interval).

    for message in every_n(messages, request.stream_interval): yield message

The first message goes out as it comes (the sequence is live: the router's TTFT waits for
it); after it, tokens are held until N are ready or the sequence finishes, and the message
that finishes it carries what is left. Each message between carries a multiple of N (N, or
more when the reader fell behind and several steps came at once; the odd rest stays held).
N of 0 or 1 changes nothing. Each message a router relays costs it a read and a write (~0.1 ms
of CPU each, Python gRPC), so N cuts its cost per token about N-fold, at the price of the
client seeing tokens in bursts of N (SGLang's and vLLM's --stream-interval). The Decode call's
own handler (real workers) and the simulated workers use the same helpers, so the simulation
streams as the workers do.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

from pdserve.common.errors import InvalidArgument
from pdserve.v1 import decode_pb2

MAX_INTERVAL = 4096


def checked(interval: int) -> int:
    """`interval` from the wire; INVALID_ARGUMENT when it is out of range."""
    if not 0 <= interval <= MAX_INTERVAL:
        raise InvalidArgument(f"stream_interval={interval}: must be 0..{MAX_INTERVAL} "
                              "(tokens per message; 0 or 1: every token)")
    return interval


def absorb(message: decode_pb2.DecodeResponse, more: decode_pb2.DecodeResponse) -> None:
    """`more`'s tokens appended to `message`, and its finish (one message out for both)."""
    message.token_ids.extend(more.token_ids)
    message.finish_reason = more.finish_reason


class _Held:
    """Tokens waiting for their message (the first message is never held)."""

    def __init__(self, interval: int):
        self.interval = interval
        self.started = False
        self.message: decode_pb2.DecodeResponse | None = None

    def add(self, message: decode_pb2.DecodeResponse) -> decode_pb2.DecodeResponse | None:
        """`message` joined to those held; the message to send now, if one is due."""
        if not self.started:
            self.started = True
            return message
        if self.message is None:
            self.message = message
        else:
            absorb(self.message, message)
        if self.message.finish_reason:
            due, self.message = self.message, None
            return due
        held = len(self.message.token_ids)
        if held < self.interval:
            return None
        # A reader that fell behind gets several steps' tokens at once: send the whole
        # multiples of N and hold the rest, so every message but the last is N-aligned.
        due, keep = self.message, held - held % self.interval
        self.message = (decode_pb2.DecodeResponse(token_ids=due.token_ids[keep:])
                        if keep < held else None)
        del due.token_ids[keep:]
        return due


def every_n(messages: Iterator[decode_pb2.DecodeResponse], interval: int
            ) -> Iterator[decode_pb2.DecodeResponse]:
    """`messages`, the first as it comes and then `interval` tokens to a message."""
    if interval <= 1:
        yield from messages
        return
    held = _Held(interval)
    for message in messages:
        if (due := held.add(message)) is not None:
            yield due
    if held.message is not None:  # ended without a finish (the caller's choice): no token lost
        yield held.message


async def every_n_async(messages: AsyncIterator[decode_pb2.DecodeResponse], interval: int
                        ) -> AsyncIterator[decode_pb2.DecodeResponse]:
    """`every_n` for an async iterator (the simulated workers)."""
    if interval <= 1:
        async for message in messages:
            yield message
        return
    held = _Held(interval)
    async for message in messages:
        if (due := held.add(message)) is not None:
            yield due
    if held.message is not None:
        yield held.message
