"""One simulated engine: the real engine's step loop (`engine/engine.py`) timed by a profile.

A step decodes one token of every running sequence and computes prompt chunks under the step's
token budget, planned as `Engine._plan_prefill` plans them:

- budget `max_prefill_tokens` less the decodes; a chunk is at most `chunk_size` tokens while
  sequences decode (and always on a prefill worker), else up to the whole budget;
- co-located and decode roles take waiting prompts in arrival order, at most
  `prompts_beside_decodes` of them beside decodes (0: no limit), while fewer than
  `max_num_seqs` sequences would be live;
- the prefill role takes them shortest remaining first, those waiting `prefill_age_ms` or
  longer first of all (oldest first), and plans at most one prompt it cannot finish in the
  step (`engine/prefill_order.py`).

A prompt whose last chunk ends gets its first token at the step's end; on a co-located or
decode engine it decodes from the next step on. A prefill engine ships each chunk's KV as the
chunk ends (the handoff is pipelined with the next chunks, one request's shipments one after
the other) and the request is handed off when its last shipment lands. Sequences handed to a
decode engine join between steps, as the engine loop admits them. Pages, preemption and
sampling are not modelled: every sequence fits.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.sim.profile import SimProfile

ROLES = ("colocated", "prefill", "decode")


class Events:
    """A clock and its future events, in time order (ties in the order they were scheduled).

    An event scheduled `quiet` touches only its own engine (a decode step's end), so other
    engines may run their steps past it without an event each (`next_loud_ms`)."""

    def __init__(self) -> None:
        self.now_ms = 0.0
        self._heap: list[tuple[float, int, bool, Callable[..., None], tuple[Any, ...]]] = []
        self._loud: list[float] = []
        self._count = 0

    def at(self, time_ms: float, fn: Callable[..., None], *args: Any,
           quiet: bool = False) -> None:
        heapq.heappush(self._heap, (time_ms, self._count, quiet, fn, args))
        if not quiet:
            heapq.heappush(self._loud, time_ms)
        self._count += 1

    def next_loud_ms(self) -> float:
        """When the next event that may touch any engine happens (inf: none is scheduled)."""
        return self._loud[0] if self._loud else math.inf

    def run(self) -> None:
        while self._heap:
            self.now_ms, _, quiet, fn, args = heapq.heappop(self._heap)
            if not quiet:
                heapq.heappop(self._loud)
            fn(*args)


@dataclass(eq=False)
class Job:
    """One request's state on the engines it visits."""

    index: int
    arrival_ms: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    computed: int = 0          # prompt tokens whose KV exists (cached ones included)
    queued_ms: float = 0.0     # when it joined its current engine's waiting queue
    shipped_ms: float = 0.0    # prefill role: when its last shipment so far lands
    finish_step: int = -1      # decoding: the step that gives its last token
    first_token_ms: float | None = None
    done_ms: float | None = None
    workers: list[str] = field(default_factory=list)

    @property
    def uncomputed(self) -> int:
        return self.prompt_tokens - self.computed


@dataclass(frozen=True)
class EngineParams:
    role: str = "colocated"
    chunk_size: int = 512
    max_prefill_tokens: int = 2048
    max_num_seqs: int = 256
    prompts_beside_decodes: int = 0
    prefill_age_ms: float = 1000.0
    speedup: float = 1.0  # step times are divided by this (tensor parallelism, if modelled)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role={self.role!r}: expected one of {ROLES}")
        for name in ("chunk_size", "max_prefill_tokens", "max_num_seqs", "speedup"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected > 0")


Callback = Callable[[Job, float], None]


class EngineSim:
    """A simulated engine on `events`; `on_first_token(job, t)`, `on_done(job, t)` and (prefill
    role) `on_handed_off(job, t)` report what happens to each job."""

    def __init__(self, name: str, params: EngineParams, profile: SimProfile, events: Events, *,
                 on_first_token: Callback, on_done: Callback, on_handed_off: Callback):
        self.name = name
        self.params = params
        self.profile = profile
        self.events = events
        self._on_first_token = on_first_token
        self._on_done = on_done
        self._on_handed_off = on_handed_off
        self.waiting: list[Job] = []   # prompts not fully computed, in arrival order
        self.running: list[Job] = []   # decoding in the current step
        self.joining: list[Job] = []   # decode from the next step on
        self.reserved = 0              # decode role: handoffs on their way here
        self.stepping = False
        self.step_end_ms = 0.0
        self.steps = 0                 # steps taken (the current one's index while stepping)
        self._context = 0              # context tokens of the running sequences
        self._finishing: dict[int, list[Job]] = {}
        self.busy_ms = 0.0
        self._idle_since: float | None = None  # when its last step ended (None: none yet)

    # ---- what the router sees ---------------------------------------------------------
    @property
    def live(self) -> int:
        """Sequences running, joining, waiting or reserved (a decode worker's Reserve limit)."""
        return len(self.running) + len(self.joining) + len(self.waiting) + self.reserved

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(job.uncomputed for job in self.waiting)

    # ---- work in ------------------------------------------------------------------------
    def add_prompt(self, job: Job) -> None:
        """A prompt to compute from `job.computed` on (queued at the current time)."""
        job.queued_ms = self.events.now_ms
        job.workers.append(self.name)
        self.waiting.append(job)
        self._wake()

    def admit(self, job: Job) -> None:
        """Decode role: a sequence whose KV has landed joins between steps; its first token
        reaches the stream when it is in the batch (at the current step's end, or now)."""
        self.reserved -= 1
        job.workers.append(self.name)
        self._on_first_token(job, self.step_end_ms if self.stepping else self.events.now_ms)
        self._join(job)

    def _join(self, job: Job) -> None:
        if job.output_tokens <= 1:
            self._on_done(job, self.step_end_ms if self.stepping else self.events.now_ms)
            return
        self.joining.append(job)
        self._wake()

    def _wake(self) -> None:
        if not self.stepping:
            self._start_step()

    # ---- stepping -----------------------------------------------------------------------
    def _start_step(self) -> None:
        now = self.events.now_ms
        for job in self.joining:  # it needs output_tokens - 1 more tokens, one per step
            job.finish_step = self.steps + job.output_tokens - 2
            self._finishing.setdefault(job.finish_step, []).append(job)
            self._context += job.prompt_tokens + 1
        self.running += self.joining
        self.joining.clear()
        plan = self._plan(now)
        if not plan and not self.running:
            if self.stepping:
                self._idle_since = now
            self.stepping = False
            return
        if not self.stepping:  # woken from idle: the first step starts that much later
            wake = self.profile.wake_ms(None if self._idle_since is None
                                        else now - self._idle_since)
            now += wake
            self.busy_ms += wake
        self.stepping = True
        speedup = self.params.speedup
        if not plan and not self.waiting:
            now = self._decode_ahead(now)
        cost = self.profile.step_ms(len(self.running), self._context,
                                    [(job.computed, n) for job, n in plan]) / speedup
        self.busy_ms += cost
        self.step_end_ms = now + cost
        self.events.at(self.step_end_ms, self._end_step, plan,
                       quiet=self.params.role != "prefill")

    def _decode_ahead(self, now: float) -> float:
        """Decode-only steps that neither end a sequence nor outlast the next event are taken
        here, back to back, without an event each; returns when the next step starts."""
        batch = len(self.running)
        until = self.events.next_loud_ms()
        first_finish = min(self._finishing)
        while self.steps < first_finish:
            cost = self.profile.decode_step_ms(batch, self._context) / self.params.speedup
            if now + cost >= until:
                break
            now += cost
            self.busy_ms += cost
            self._context += batch
            self.steps += 1
        return now

    def _plan(self, now: float) -> list[tuple[Job, int]]:
        p = self.params
        decodes = len(self.running)
        prefill = p.role == "prefill"
        chunk_size = p.chunk_size if decodes or prefill else p.max_prefill_tokens
        budget = p.max_prefill_tokens - decodes
        live = decodes
        most = p.prompts_beside_decodes if decodes else 0
        plan: list[tuple[Job, int]] = []
        partial = False
        for job in self._order(now) if prefill else self.waiting:
            if budget <= 0 or (not prefill and live >= p.max_num_seqs):
                break
            if most and len(plan) == most:
                break
            if partial and job.uncomputed > budget:
                continue
            n = min(job.uncomputed, chunk_size, budget)
            partial = prefill and (partial or n < job.uncomputed)
            plan.append((job, n))
            budget -= n
            live += 1
        return plan

    def _order(self, now: float) -> list[Job]:
        """`engine/prefill_order.py`: aged prompts oldest first, then shortest remaining."""
        aged = [j for j in self.waiting if now - j.queued_ms >= self.params.prefill_age_ms]
        fresh = [j for j in self.waiting if now - j.queued_ms < self.params.prefill_age_ms]
        return aged + sorted(fresh, key=lambda j: j.uncomputed)

    def _end_step(self, plan: list[tuple[Job, int]]) -> None:
        now = self.events.now_ms
        self._context += len(self.running)
        done = self._finishing.pop(self.steps, None)
        if done:
            ending = set(done)
            self.running = [job for job in self.running if job not in ending]
            for job in done:
                self._context -= job.prompt_tokens + job.output_tokens
                self._on_done(job, now)
        for job, n in plan:
            job.computed += n
            if self.params.role == "prefill":
                kv_bytes = n * self.profile.kv_bytes_per_token
                job.shipped_ms = max(job.shipped_ms, now) + self.profile.handoff_ms(kv_bytes)
            if job.computed < job.prompt_tokens:
                continue
            self.waiting.remove(job)
            if self.params.role == "prefill":
                self._on_handed_off(job, job.shipped_ms)
            else:
                self._on_first_token(job, now)
                self._join(job)
        self.steps += 1
        self._start_step()
