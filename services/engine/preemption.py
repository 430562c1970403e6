"""Out of pages while sequences decode: who gives theirs up.

Every running sequence needs a page for its next token at the page boundary. When none is
free, the engine preempts: first a waiting sequence that already holds pages (a prompt
partly chunked in), else the most recently admitted running one. A preempted sequence's
pages are freed and it goes back to the front of the waiting queue, to be recomputed (prefill
over all its tokens, its cached prefix reused) when pages free up.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from pdserve.common.layout import pages_for_tokens
from pdserve.engine.pool import OutOfPages, PageAllocator
from pdserve.engine.sequence import Sequence, Status


class Engine(Protocol):
    """What preemption touches of the engine (engine.py's Engine)."""

    running: list[Sequence]
    waiting: deque[Sequence]
    allocator: PageAllocator
    num_preemptions: int


def ensure_decode_pages(engine: Engine, block: int) -> None:
    """Give every running sequence a page for its next token, preempting when out of pages."""
    allocator = engine.allocator
    for seq in list(engine.running):
        if seq.status is not Status.RUNNING:
            continue  # preempted in this loop
        if pages_for_tokens(seq.num_tokens, block) <= allocator.num_pages_of(seq.seq_id):
            continue
        while not allocator.can_allocate(1):
            victim = _pick_victim(engine)
            if victim is None:
                raise OutOfPages("a single sequence needs more pages than the pool has")
            _preempt(engine, victim)
            if victim is seq:
                break
        if seq.status is Status.RUNNING:
            allocator.allocate(seq.seq_id, 1)


def _pick_victim(engine: Engine) -> Sequence | None:
    partial = [s for s in engine.waiting if engine.allocator.owns(s.seq_id)]
    if partial:
        return partial[-1]
    return engine.running[-1] if engine.running else None


def _preempt(engine: Engine, seq: Sequence) -> None:
    engine.num_preemptions += 1
    engine.allocator.free(seq.seq_id)
    seq.num_cached = seq.num_keyed = 0
    if seq.status is Status.RUNNING:
        engine.running.remove(seq)
        seq.status = Status.WAITING
        engine.waiting.appendleft(seq)
