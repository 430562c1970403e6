"""Where a request goes: pure ranking of prefill and decode workers by load.

The pool gathers the loads (health checks, worker Stats, what this router has in flight);
these functions only order them, so they can be tested alone. Both return every healthy
worker, best first: the lifecycle walks the list (a decode worker without room answers
RESOURCE_EXHAUSTED, so the next one is asked). Workers in `avoid` (they failed earlier in
the same request) come last, so a retry lands elsewhere when there is an elsewhere.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from pdserve.common.layout import pages_for_tokens

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class PrefillLoad:
    """A prefill worker as the router sees it."""

    address: str
    healthy: bool
    queued_prompt_tokens: int = 0    # from the worker's last Stats
    inflight_prompt_tokens: int = 0  # prompts this router sent it that have not returned

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens ahead of a new request: at least what this router knows it sent, or
        what the worker last reported (which includes other routers' work)."""
        return max(self.queued_prompt_tokens, self.inflight_prompt_tokens)


@dataclass(frozen=True)
class DecodeLoad:
    """A decode worker as the router sees it (`free_pages` None: no Stats yet)."""

    address: str
    healthy: bool
    free_pages: int | None = None
    running_sequences: int = 0
    waiting_sequences: int = 0
    reserved_tickets: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE

    @property
    def sequences(self) -> int:
        """Sequences that are, or soon will be, in its batch."""
        return self.running_sequences + self.waiting_sequences + self.reserved_tickets


def rank_prefill(workers: Sequence[PrefillLoad], avoid: Collection[str] = ()) -> list[str]:
    """Healthy prefill workers, fewest pending prompt tokens first."""
    healthy = [w for w in workers if w.healthy]
    healthy.sort(key=lambda w: (w.address in avoid, w.pending_tokens, w.address))
    return [w.address for w in healthy]


def rank_decode(workers: Sequence[DecodeLoad], num_prompt_tokens: int,
                avoid: Collection[str] = ()) -> list[str]:
    """Healthy decode workers: those with room for the prompt first, then the fewest
    sequences, then the most free pages. Workers whose last Stats showed too little room
    still come (last): the Stats may be stale, and Reserve gives the real answer."""
    def key(w: DecodeLoad) -> tuple[bool, bool, int, int, str]:
        fits = w.free_pages is None or w.free_pages >= pages_for_tokens(
            num_prompt_tokens, w.block_size
        )
        free = w.free_pages if w.free_pages is not None else 0
        return (w.address in avoid, not fits, w.sequences, -free, w.address)

    return [w.address for w in sorted((w for w in workers if w.healthy), key=key)]
