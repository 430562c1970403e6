"""Where a request goes: pure ranking of prefill and decode workers by cache and load.

The pool gathers the loads (health checks, worker Stats, what this router has in flight) and
the cache index how many leading pages of the prompt each worker holds; these functions only
order them, so they can be tested alone. Both return every healthy worker, best first: the
lifecycle walks the list (a decode worker without room answers RESOURCE_EXHAUSTED, so the
next one is asked). Workers in `avoid` (they failed earlier in the same request) come last,
so a retry lands elsewhere when there is an elsewhere.

Cache-aware cost, in prompt-token equivalents, lowest first (`Weights` are router flags):

    cost = cache_weight * (prompt tokens the worker would have to compute or receive)
         + sequence_weight * (sequences in, or headed for, its batch)      [decode]
         + pending prompt tokens queued on it                               [prefill]

so a busy worker holding a long prefix may win over an idle one, but not without bound: a
decode worker with more than `max_imbalance` x the least loaded one's sequences (plus
`imbalance_slack`) is not a candidate while a less loaded one is (a hot prefix cannot pile
every request onto one worker), and one whose last Stats show no room for the pages it lacks
comes after those that have room. Every ranking comes with its explanation: per candidate its
cached tokens, load and cost, and which term decided (`locality`, `load` or `room`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from pdserve.common.layout import pages_for_tokens

DEFAULT_BLOCK_SIZE = 16
EXPLAINED = 4  # candidates a placement's explanation names


@dataclass(slots=True)  # not frozen: a frozen one costs 5x to build, per worker per request
class PrefillLoad:
    """A prefill worker as the router sees it."""

    address: str
    healthy: bool
    queued_prompt_tokens: int = 0    # from the worker's last Stats
    inflight_prompt_tokens: int = 0  # prompts this router sent it that have not returned
    block_size: int = DEFAULT_BLOCK_SIZE
    placed: int = 0  # prompts this router has sent it (spreads ties)

    @property
    def pending_tokens(self) -> int:
        """Prompt tokens ahead of a new request: at least what this router knows it sent, or
        what the worker last reported (which includes other routers' work)."""
        return max(self.queued_prompt_tokens, self.inflight_prompt_tokens)


@dataclass(slots=True)
class DecodeLoad:
    """A decode worker as the router sees it (`free_pages` None: no Stats yet)."""

    address: str
    healthy: bool
    free_pages: int | None = None
    running_sequences: int = 0
    waiting_sequences: int = 0
    reserved_tickets: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    placed: int = 0  # requests this router has placed on it (spreads ties)
    inflight: int = 0  # this router's requests on it now (placed, not ended)

    @property
    def sequences(self) -> int:
        """Sequences that are, or soon will be, in its batch: at least what this router has
        in flight there (its last Stats may be older than a burst of requests)."""
        return max(self.running_sequences + self.waiting_sequences + self.reserved_tickets,
                   self.inflight)


@dataclass(frozen=True)
class Weights:
    cache_weight: float = 1.0     # per prompt token a worker would compute or receive
    sequence_weight: float = 32.0  # per sequence in a decode worker's batch, in tokens
    max_imbalance: float = 1.5    # decode sequences over the least loaded worker's, times
    imbalance_slack: int = 4      # ... plus this many
    sample: int = 0               # > 0: weigh this many random workers (+ cache holders) only


DEFAULT_WEIGHTS = Weights()


@dataclass(slots=True)
class Candidate:
    """One worker in a placement's explanation."""

    address: str
    cached_tokens: int
    load: int          # decode: sequences in its batch; prefill: pending prompt tokens
    cost: float
    note: str = ""     # why it was pushed down: "retry", "busy", "no room"

    def describe(self) -> str:
        note = f" ({self.note})" if self.note else ""
        return f"{self.address} cached={self.cached_tokens} load={self.load} " \
               f"cost={self.cost:.0f}{note}"


class Placement:
    """A ranking, best first, with its explanation. The candidates, the deciding term and the
    explanation line are built on first use, once: a request needs the ranking at once, the
    explanation for its log line, and the rest only when asked."""

    __slots__ = ("ranked", "_rows", "_candidates", "_explained")

    def __init__(self, ranked: list[str], rows: Sequence[tuple] = ()):  # type: ignore[type-arg]
        self.ranked = ranked
        self._rows = rows  # sorted; each ends (address, cached tokens, load, cost, note)
        self._candidates: list[Candidate] | None = None
        self._explained = ""

    @property
    def candidates(self) -> list[Candidate]:
        """Every candidate, in ranked order."""
        if self._candidates is None:
            self._candidates = [Candidate(*r[-5:]) for r in self._rows]
        return self._candidates

    @property
    def decided_by(self) -> str:
        """"locality", "load", "room", "retry" or "only" (one candidate)."""
        return _decided_by(self.candidates)

    def explain(self) -> str:
        """One line: the pick, the deciding term, the best EXPLAINED candidates."""
        if not self._explained:
            self._explained = self._explain()
        return self._explained

    def _explain(self) -> str:
        if not self.ranked:
            return "no healthy worker"
        candidates = self.candidates
        more = len(candidates) - EXPLAINED
        return f"{self.ranked[0]} by {self.decided_by}: " + \
            "; ".join(c.describe() for c in candidates[:EXPLAINED]) + \
            (f"; {more} more" if more > 0 else "")


def place_prefill(workers: Sequence[PrefillLoad], num_prompt_tokens: int = 0,
                  cached_pages: Mapping[str, int] | None = None,
                  weights: Weights = DEFAULT_WEIGHTS, avoid: Collection[str] = ()) -> Placement:
    """Healthy prefill workers, cheapest first: the prompt tokens each would compute (its
    cache's leading pages excluded) plus the prompt tokens already pending on it."""
    cached_pages = cached_pages or {}
    cache_weight = weights.cache_weight
    rows = []
    for w in workers:
        if not w.healthy:
            continue
        address, pending = w.address, w.pending_tokens
        cached = cached_pages.get(address, 0) * w.block_size
        cost = cache_weight * max(0, num_prompt_tokens - cached) + pending
        retry = address in avoid
        rows.append((retry, cost, w.placed, address,  # the sort key: address is unique
                     address, cached, pending, cost, "retry" if retry else ""))
    rows.sort()
    return Placement([r[3] for r in rows], rows)


def place_decode(workers: Sequence[DecodeLoad], num_prompt_tokens: int,
                 cached_pages: Mapping[str, int] | None = None,
                 weights: Weights = DEFAULT_WEIGHTS, avoid: Collection[str] = ()) -> Placement:
    """Healthy decode workers, best first (see the module's docstring). Workers whose last
    Stats showed too little room still come (last): the Stats may be stale, and Reserve gives
    the real answer."""
    cached_pages = cached_pages or {}
    # Each worker's figures once (this runs per request over the sample of a large pool).
    figures = []  # (worker, cached pages, sequences, fits)
    least: int | None = None  # the fewest sequences of a roomy worker not avoided
    for w in workers:
        if not w.healthy:
            continue
        pages = cached_pages.get(w.address, 0)
        sequences = w.sequences
        fits = w.free_pages is None or \
            w.free_pages >= pages_for_tokens(num_prompt_tokens, w.block_size) - pages
        if fits and w.address not in avoid and (least is None or sequences < least):
            least = sequences
        figures.append((w, pages, sequences, fits))
    busy_line = least * weights.max_imbalance + weights.imbalance_slack \
        if least is not None else 0
    cache_weight, sequence_weight = weights.cache_weight, weights.sequence_weight
    rows = []
    for w, pages, sequences, fits in figures:
        address = w.address
        cached = pages * w.block_size
        cost = cache_weight * max(0, num_prompt_tokens - cached) + sequence_weight * sequences
        busy = least is not None and sequences > busy_line
        retry = address in avoid
        note = "retry" if retry else "no room" if not fits else "busy" if busy else ""
        free = w.free_pages if w.free_pages is not None else 0
        rows.append((retry, not fits, busy, cost, w.placed, -free, address,  # the sort key
                     address, cached, sequences, cost, note))
    rows.sort()
    return Placement([r[6] for r in rows], rows)


def _decided_by(candidates: list[Candidate]) -> str:
    """Which term put the first candidate first."""
    if not candidates:
        return ""
    best, rest = candidates[0], candidates[1:]
    if not rest:
        return "only"
    if best.note == "retry":
        return "retry"
    if any(c.note in ("no room", "busy") and c.cached_tokens > best.cached_tokens
           for c in rest):
        return "room"  # a worker holding more of the prompt was passed over for room
    if any(c.load < best.load for c in rest if not c.note):
        return "locality"  # it won despite more load: its cache decided
    if any(c.cached_tokens > best.cached_tokens for c in rest if not c.note):
        return "load"
    return "locality" if best.cached_tokens > max(c.cached_tokens for c in rest) else "load"


def rank_prefill(workers: Sequence[PrefillLoad], avoid: Collection[str] = ()) -> list[str]:
    """Healthy prefill workers, fewest pending prompt tokens first (no cache information)."""
    return place_prefill(workers, avoid=avoid).ranked


def rank_decode(workers: Sequence[DecodeLoad], num_prompt_tokens: int,
                avoid: Collection[str] = ()) -> list[str]:
    """Healthy decode workers: those with room for the prompt first, then the fewest
    sequences, then the most free pages (no cache information)."""
    return place_decode(workers, num_prompt_tokens, avoid=avoid).ranked
