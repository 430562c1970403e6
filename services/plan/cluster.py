"""A simulated deployment: the router's placement over simulated engines, one run of requests.

What the router does, as `router/attempts.py` does it, placing with the real ranking functions
of `router/placement.py` (fed the loads the router would see, exactly and without delay):

- every request first gets a decode (or co-located) worker: `place_decode`, the first in the
  ranking with fewer than `max_num_seqs` sequences live (running, waiting or reserved) takes it;
  when none has room the request fails (RESOURCE_EXHAUSTED), as a real one would;
- co-located: the worker computes the prompt itself (started at Reserve);
- disaggregated: an uncached part shorter than `remote_prefill_min_tokens` is computed by the
  decode worker itself (its chunk `decode_chunk_size`, one prompt beside its decodes);
  otherwise `place_prefill` picks a prefill worker, which computes it and ships the KV, and the
  decode worker admits the sequence between two of its steps once the KV has landed.

Every request's TTFT also carries `request_overhead_ms` (router and RPCs) from the decode or
co-located workers' profile, and, where the default profile prices a router's CPU
(`SimProfile.router_ms`), its wait for one of the deployment's `routers`: each request holds a
router core for its CPU, in arrival order, and waits while all of them are taken (the
`request_overhead_ms` measured alone holds the CPU already: only the wait is added).
Prefill and decode workers may have profiles of their own (`Profiles`: other hardware, or
other cores); a prefill worker's profile also prices its handoffs.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pdserve.plan.engine_model import EngineParams, EngineSim, Events, Job
from pdserve.plan.workload import Request
from pdserve.router.placement import DecodeLoad, PrefillLoad, place_decode, place_prefill
from pdserve.sim.profile import SimProfile

MODES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class Deployment:
    """One configuration to simulate: `num_prefill` + `num_decode` workers (co-located:
    `num_decode` workers doing both, `num_prefill` 0), each with tensor parallelism `tp`."""

    mode: str = "disaggregated"
    num_prefill: int = 1
    num_decode: int = 1
    chunk_size: int = 512           # prefill and co-located workers' --chunk-size
    tp: int = 1
    max_prefill_tokens: int = 2048
    max_num_seqs: int = 256
    decode_chunk_size: int = 64     # decode workers' --chunk-size (their own short prompts)
    remote_prefill_min_tokens: int = 256  # the router's flag
    prefill_age_ms: float = 1000.0
    routers: int = 1                # router replicas (one core each) in front of the workers

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode={self.mode!r}: expected one of {MODES}")
        want_prefill = self.mode == "disaggregated"
        if want_prefill != (self.num_prefill > 0) or self.num_decode <= 0:
            want = ">= 1 and >= 1" if want_prefill else "0 and >= 1"
            raise ValueError(f"{self.mode}: num_prefill={self.num_prefill}, num_decode="
                             f"{self.num_decode}: expected {want}")
        for name in ("chunk_size", "tp", "max_prefill_tokens", "max_num_seqs",
                     "decode_chunk_size", "routers"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)!r}: expected > 0")

    @property
    def workers(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def name(self) -> str:
        tp = f" tp{self.tp}" if self.tp > 1 else ""
        if self.mode == "colocated":
            return f"colocated x{self.num_decode} chunk {self.chunk_size}{tp}"
        return f"{self.num_prefill}P+{self.num_decode}D chunk {self.chunk_size}{tp}"


@dataclass(frozen=True)
class Outcome:
    """One request as its client would see it (times in ms from its arrival)."""

    index: int
    prompt_tokens: int
    output_tokens: int
    ok: bool
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    workers: str = ""

    @property
    def tpot_ms(self) -> float | None:
        if self.ttft_ms is None or self.e2e_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Profiles:
    """The profile of each kind of worker: `default` for co-located workers and for prefill or
    decode workers that have none of their own."""

    default: SimProfile
    prefill: SimProfile | None = None
    decode: SimProfile | None = None

    @classmethod
    def of(cls, profile: SimProfile | Profiles) -> Profiles:
        return profile if isinstance(profile, Profiles) else cls(profile)

    def role(self, role: str) -> SimProfile:
        own = self.prefill if role == "prefill" else self.decode if role == "decode" else None
        return own or self.default

    def contention(self, role: str, output_tokens_per_s: float) -> float:
        """The share of a `role` worker's cores that processes beside it take
        (`SimProfile.contention`): its own profile's, where that has `shared_cores`, else the
        default profile's."""
        own = self.role(role)
        return (own if own.shared_cores else self.default).contention(output_tokens_per_s)

    @property
    def shares_cores(self) -> bool:
        """Some kind's workers share their cores with the router and clients."""
        return any(p is not None and p.shared_cores > 0
                   for p in (self.default, self.prefill, self.decode))

    def streaming_ms(self, role: str) -> float:
        """What the processes beside a `role` worker spend on its cores per output token, per
        core (`SimProfile.contention`'s cost): a decoding worker pays it for every token of
        its steps, so that it grows with a step's batch as the tokens those processes stream do."""
        own = self.role(role)
        p = own if own.shared_cores else self.default
        return p.shared_cpu_ms_per_token / p.shared_cores if p.shared_cores else 0.0

    def devices(self, dep: Deployment) -> float:
        """Cores or GPUs the deployment takes (workers x TP x each one's devices_per_worker)."""
        if dep.mode == "colocated":
            return dep.num_decode * dep.tp * self.default.devices_per_worker
        return dep.tp * (dep.num_prefill * self.role("prefill").devices_per_worker
                         + dep.num_decode * self.role("decode").devices_per_worker)


class Stop(Exception):
    """A run gave up early: more requests missed their objectives than it may."""


@dataclass(frozen=True)
class EarlyStop:
    """Stop a run once more than `max_misses` requests have missed an objective."""

    ttft_ms: float | None
    tpot_ms: float | None
    max_misses: int


class _Router:
    def __init__(self, dep: Deployment, profiles: Profiles, events: Events,
                 stop: EarlyStop | None, tokens_per_s: float = 0.0):
        self.dep, self.events, self.stop = dep, events, stop
        self.misses = 0
        role = "colocated" if dep.mode == "colocated" else "decode"
        # The processes beside the workers (router, agents, clients) stream the decoding
        # workers' tokens: on a decoding worker's cores they cost each step as much per token
        # as it has sequences (a burst's big batches pay more); a prefill worker's cores they
        # take a share of at the run's mean rate.
        prefill_slow = 1.0 - profiles.contention("prefill", tokens_per_s)
        callbacks = {"on_first_token": self._first_token, "on_done": self._done,
                     "on_handed_off": self._handed_off}
        decode_profile, prefill_profile = profiles.role(role), profiles.role("prefill")
        decode_profile = replace(decode_profile, seq_overhead_ms=decode_profile.seq_overhead_ms
                                 + profiles.streaming_ms(role))
        if dep.mode == "colocated":
            decode = EngineParams(role, dep.chunk_size, dep.max_prefill_tokens,
                                  dep.max_num_seqs, 0, dep.prefill_age_ms,
                                  decode_profile.tp_speedup(dep.tp))
        else:
            decode = EngineParams(role, dep.decode_chunk_size, dep.max_prefill_tokens,
                                  dep.max_num_seqs, 1, dep.prefill_age_ms,
                                  decode_profile.tp_speedup(dep.tp))
        prefill = EngineParams("prefill", dep.chunk_size, dep.max_prefill_tokens,
                               dep.max_num_seqs, 0, dep.prefill_age_ms,
                               prefill_profile.tp_speedup(dep.tp) * prefill_slow)
        self.decoders = {f"{role}{i}": EngineSim(f"{role}{i}", decode, decode_profile, events,
                                                 **callbacks)
                         for i in range(dep.num_decode)}
        self.prefillers = {f"prefill{i}": EngineSim(f"prefill{i}", prefill, prefill_profile,
                                                    events, **callbacks)
                           for i in range(dep.num_prefill)}
        self.placed = dict.fromkeys(self.decoders, 0)
        self.inflight = dict.fromkeys(self.decoders, 0)
        self.prefill_tokens = dict.fromkeys(self.prefillers, 0)
        self.prefill_placed = dict.fromkeys(self.prefillers, 0)
        self.decoder_of: dict[int, EngineSim] = {}
        self.prefiller_of: dict[int, EngineSim] = {}
        self.failed: list[Job] = []
        # the router's and RPCs' time in every TTFT: the decode (co-located) profile carries it.
        # Where the router and the clients share the workers' cores, that work (measured
        # alone) competes there with busy workers: it is stretched by the workers' busy share
        # so far (1 + u: half a core while they run)
        self.request_overhead_ms = decode_profile.request_overhead_ms
        self._overhead_ms = self.request_overhead_ms if profiles.shares_cores else 0.0
        self._started_ms: float | None = None
        self._stretched: dict[int, float] = {}

    def _stretch_ms(self, now_ms: float) -> float:
        if not self._overhead_ms or self._started_ms is None or now_ms <= self._started_ms:
            return 0.0
        engines = [*self.decoders.values(), *self.prefillers.values()]
        busy = sum(e.busy_ms for e in engines) / (len(engines) * (now_ms - self._started_ms))
        return self._overhead_ms * min(1.0, busy)

    def arrive(self, job: Job) -> None:
        if self._started_ms is None:
            self._started_ms = self.events.now_ms
        decode = self._reserve(job)
        if decode is None:
            self.failed.append(job)
            self._miss()
            return
        uncached = job.prompt_tokens - job.cached_tokens
        if self.dep.mode == "colocated" or uncached < self.dep.remote_prefill_min_tokens:
            decode.add_prompt(job)
            return
        decode.reserved += 1
        prefill = self._pick_prefill(uncached)
        self.prefill_tokens[prefill.name] += uncached
        self.prefiller_of[job.index] = prefill
        prefill.add_prompt(job)

    def _reserve(self, job: Job) -> EngineSim | None:
        if len(self.decoders) == 1:
            ranked = list(self.decoders)
        else:
            loads = [DecodeLoad(name, True, running_sequences=len(e.running) + len(e.joining),
                                waiting_sequences=len(e.waiting), reserved_tickets=e.reserved,
                                placed=self.placed[name], inflight=self.inflight[name])
                     for name, e in self.decoders.items()]
            ranked = place_decode(loads, job.prompt_tokens).ranked
        for name in ranked:
            engine = self.decoders[name]
            if engine.live < self.dep.max_num_seqs:
                self.placed[name] += 1
                self.inflight[name] += 1
                self.decoder_of[job.index] = engine
                return engine
        return None

    def _pick_prefill(self, uncached: int) -> EngineSim:
        if len(self.prefillers) == 1:
            return next(iter(self.prefillers.values()))
        loads = [PrefillLoad(name, True, queued_prompt_tokens=e.queued_prompt_tokens,
                             inflight_prompt_tokens=self.prefill_tokens[name],
                             placed=self.prefill_placed[name])
                 for name, e in self.prefillers.items()]
        chosen = place_prefill(loads, uncached).ranked[0]
        self.prefill_placed[chosen] += 1
        return self.prefillers[chosen]

    def _handed_off(self, job: Job, at_ms: float) -> None:
        self.events.at(at_ms, self._land, job)

    def _land(self, job: Job) -> None:
        prefill = self.prefiller_of.pop(job.index)
        self.prefill_tokens[prefill.name] -= job.prompt_tokens - job.cached_tokens
        self.decoder_of[job.index].admit(job)

    def _first_token(self, job: Job, at_ms: float) -> None:
        self._stretched[job.index] = extra = self._stretch_ms(at_ms)
        at_ms += extra
        job.first_token_ms = at_ms
        limit = self.stop.ttft_ms if self.stop else None
        if limit is not None and at_ms - job.arrival_ms > limit:
            self._miss()

    def _done(self, job: Job, at_ms: float) -> None:
        at_ms += self._stretched.pop(job.index, 0.0)  # as late as its first token came
        job.done_ms = at_ms
        decode = self.decoder_of.pop(job.index)
        self.inflight[decode.name] -= 1
        limit = self.stop.tpot_ms if self.stop else None
        first = job.first_token_ms
        ttft_limit = self.stop.ttft_ms if self.stop else None
        if limit is not None and first is not None and job.output_tokens > 1 and \
                (at_ms - first) / (job.output_tokens - 1) > limit and \
                not (ttft_limit is not None and first - job.arrival_ms > ttft_limit):
            self._miss()  # (a TTFT miss was counted already)

    def _miss(self) -> None:
        self.misses += 1
        if self.stop is not None and self.misses > self.stop.max_misses:
            raise Stop


Watch = Callable[[Events, _Router], None]


def router_waits(requests: Sequence[Request], profile: SimProfile, routers: int) -> list[float]:
    """How long each request waits for one of `routers` router cores (ms, in request order):
    in arrival order, each takes the core that frees first for `profile.router_ms` of its
    output tokens. All 0 where the profile prices no router CPU."""
    if not (profile.router_ms_per_request or profile.router_ms_per_token):
        return [0.0] * len(requests)
    free = [0.0] * routers  # when each core is next free (a heap)
    waits = [0.0] * len(requests)
    for i in sorted(range(len(requests)), key=lambda i: requests[i].arrival_ms):
        arrival = requests[i].arrival_ms
        start = max(arrival, heapq.heappop(free))
        waits[i] = start - arrival
        heapq.heappush(free, start + profile.router_ms(requests[i].output_tokens))
    return waits


def output_tokens_per_s(requests: Sequence[Request]) -> float:
    """The requests' output tokens over their arrivals' span (what `contention` is priced at)."""
    span_s = (requests[-1].arrival_ms - requests[0].arrival_ms) / 1e3 if requests else 0.0
    return sum(r.output_tokens for r in requests) / span_s if span_s > 0 else 0.0


def simulate(dep: Deployment, requests: Sequence[Request], profile: SimProfile | Profiles,
             stop: EarlyStop | None = None, watch: Watch | None = None) -> list[Outcome]:
    """Run `requests` through `dep`; every request's outcome, in request order. Raises `Stop`
    when `stop` is given and more requests than it allows miss an objective. `watch(events,
    router)` is called before the run starts (it may schedule events of its own, to read the
    workers' queues: `plan/signals.py`)."""
    events = Events()
    profiles = Profiles.of(profile)
    router = _Router(dep, profiles, events, stop, output_tokens_per_s(requests))
    overhead = router.request_overhead_ms
    jobs = [Job(r.index, r.arrival_ms - overhead, r.prompt_tokens, r.output_tokens,
                r.cached_tokens, r.cached_tokens) for r in requests]
    for job, request, wait in zip(jobs, requests,
                                  router_waits(requests, profiles.default, dep.routers)):
        events.at(request.arrival_ms + wait, router.arrive, job)
    if watch is not None:
        watch(events, router)
    events.run()
    failed = {job.index for job in router.failed}
    out = []
    for job in jobs:
        first, done = job.first_token_ms, job.done_ms
        if job.index in failed or first is None or done is None:
            out.append(Outcome(job.index, job.prompt_tokens, job.output_tokens, False))
            continue
        out.append(Outcome(job.index, job.prompt_tokens, job.output_tokens, True,
                           first - job.arrival_ms, done - job.arrival_ms,
                           " -> ".join(job.workers)))
    return out
