"""A serving worker's engine steps over a run, read from its `/metrics` before and after
(`pdserve.common.engine_metrics`), set beside what the profile prices them at.

`pdserve plan --validate` takes from them what a decoding sequence costs a step of the serving
worker beyond the profile (`SimProfile.seq_overhead_ms`): at load the worker's own threads
stream every sequence's token after each step and admit the new ones, on the worker's cores
and under its GIL, which a profile of the engine alone does not see and one request at a time
hardly shows (measured on a 1P+1D stack of bench-7m at 25 req/s: steps of ~22 sequences
took 11.6 ms, the engine's own CPU 8.5 ms, the profile 7.4, and the loop 1.6 ms more between
steps).
"""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, field, replace

from pdserve.sim.profile import SimProfile
from prometheus_client.parser import text_string_to_metric_families

KINDS = ("decode", "prefill", "mixed")
_BY_KIND = {"pdserve_engine_step_seconds_count": "steps",
            "pdserve_engine_decoded_tokens_total": "decoded",
            "pdserve_engine_context_tokens_total": "context",
            "pdserve_engine_prompt_tokens_total": "prompt",
            "pdserve_engine_prompt_attended_pairs_total": "pairs"}


@dataclass(frozen=True)
class StepTotals:
    """Totals over a worker's steps: per step kind, steps and what they computed; the steps'
    seconds, and the loop's seconds between them while work waited."""

    steps: dict[str, float] = field(default_factory=dict)
    decoded: dict[str, float] = field(default_factory=dict)
    context: dict[str, float] = field(default_factory=dict)
    prompt: dict[str, float] = field(default_factory=dict)
    pairs: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    held_s: float = 0.0

    def minus(self, before: StepTotals) -> StepTotals:
        def sub(name: str) -> dict[str, float]:
            now, then = getattr(self, name), getattr(before, name)
            return {k: now.get(k, 0.0) - then.get(k, 0.0) for k in KINDS}

        return StepTotals(sub("steps"), sub("decoded"), sub("context"), sub("prompt"),
                          sub("pairs"), self.seconds - before.seconds,
                          self.held_s - before.held_s)

    @property
    def num_steps(self) -> float:
        return sum(self.steps.values())

    @property
    def num_decoded(self) -> float:
        return sum(self.decoded.values())

    def engine_ms(self, p: SimProfile) -> float:
        """What the profile (its `step_overhead_ms` and `seq_overhead_ms` included) prices
        these steps at, the processes beside the worker not counted."""
        return sum(p.steps_ms(k, self.steps.get(k, 0.0), self.decoded.get(k, 0.0),
                              self.context.get(k, 0.0), self.prompt.get(k, 0.0),
                              self.pairs.get(k, 0.0)) for k in KINDS)


def parse(text: str) -> StepTotals:
    """The totals in a worker's `/metrics` text."""
    by_kind: dict[str, dict[str, float]] = {name: {} for name in _BY_KIND.values()}
    seconds = held_s = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in _BY_KIND and s.labels.get("kind") in KINDS:
                by_kind[_BY_KIND[s.name]][s.labels["kind"]] = s.value
            elif s.name == "pdserve_engine_step_seconds_sum":
                seconds += s.value
            elif s.name == "pdserve_engine_held_seconds_total":
                held_s = s.value
    return StepTotals(**by_kind, seconds=seconds, held_s=held_s)


def scrape(url: str, timeout_s: float = 10.0) -> StepTotals:
    with urllib.request.urlopen(url, timeout=timeout_s) as response:
        return parse(response.read().decode())


def split_overheads(loaded: StepTotals, profile: SimProfile, alone_ms: float,
                    streaming_ms: float) -> tuple[float, float]:
    """(`step_overhead_ms`, `seq_overhead_ms`): a serving worker's cost per step and per
    decoding sequence in a step beyond the profile's, such that a step of one sequence costs
    `alone_ms` more than the model (what the requests one at a time took) and the `loaded`
    steps, their loop's time between steps included, cost what they took, once the processes
    beside the worker are charged `streaming_ms` per token decoded (`Profiles.streaming_ms`).
    Without decodes beyond one a step, all of it is per step."""
    bare = replace(profile, step_overhead_ms=0.0, seq_overhead_ms=0.0)
    steps, decoded = loaded.num_steps, loaded.num_decoded
    residual = 1e3 * (loaded.seconds + loaded.held_s) - loaded.engine_ms(bare) \
        - decoded * streaming_ms
    if decoded - steps < 1.0:
        return alone_ms, 0.0
    per_seq = min(max(0.0, (residual - steps * alone_ms) / (decoded - steps)),
                  max(0.0, residual / decoded))
    return max(0.0, alone_ms - per_seq), per_seq
