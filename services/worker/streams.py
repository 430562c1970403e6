"""Reading a sequence's outputs from the engine loop: the first token (prefill, co-located)
and the token stream (decode, co-located). One implementation for every role."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Iterator

from pdserve.common.errors import Aborted, DeadlineExceeded, Unavailable
from pdserve.engine.loop import Outputs, SequenceAborted
from pdserve.engine.sequence import StepOutput
from pdserve.worker.types import DecodeEvent


def first_output(outputs: Outputs, seq_id: str, wait_s: float,
                 on_timeout: Callable[[], object],
                 on_progress: Callable[[StepOutput], object] | None = None) -> StepOutput:
    """The sequence's first token's output, or a domain error: Aborted when it was
    cancelled, DeadlineExceeded after `wait_s` in all (after calling `on_timeout`),
    Unavailable when the engine failed. The prefill role's per-chunk outputs before it (pages
    complete so far) go to `on_progress`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            out = outputs.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            on_timeout()
            raise DeadlineExceeded(f"prefill of {seq_id} did not finish in {wait_s:g}s") from None
        if isinstance(out, SequenceAborted):
            raise Aborted(f"prefill of {seq_id} was cancelled")
        if isinstance(out, BaseException):
            raise Unavailable(str(out))
        if not out.progress:
            return out
        if on_progress is not None:
            on_progress(out)


def token_events(outputs: Outputs, seq_id: str, wait_s: float,
                 on_finish: Callable[[str], None]) -> Iterator[DecodeEvent]:
    """The sequence's tokens as stream events until it finishes; what a slow reader missed is
    coalesced into one event. `on_finish(reason)` runs once when the engine ended it ("stop",
    "length"); an abort is counted by whoever aborted it."""
    while True:
        try:
            item = outputs.get(timeout=wait_s)
        except queue.Empty:
            raise Unavailable(f"decode of {seq_id} produced nothing for {wait_s:g}s") from None
        items = [item]
        while not outputs.empty():
            items.append(outputs.get_nowait())
        tokens: list[int] = []
        for it in items:
            if isinstance(it, SequenceAborted):  # Abort from the router, or a drain
                yield DecodeEvent(tokens, "abort")
                return
            if isinstance(it, BaseException):
                raise Unavailable(str(it))
            if it.token is not None:
                tokens.append(it.token)
            if it.finish_reason:
                on_finish(it.finish_reason)
                yield DecodeEvent(tokens, it.finish_reason)
                return
        yield DecodeEvent(tokens)
