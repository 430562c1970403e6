"""A worker's engine-loop metrics: what each step computed and how long it took, and how long
the loop, with work waiting, gave the engine to other threads between steps.

The step times set beside `pdserve profile`'s: a step's forward is priced from what it
computed (sequences decoding and the context they attend, prompt tokens and the (query, key)
pairs their chunks attend), so from these counters' rates an operator (or `pdserve plan
--validate`) reads what the serving worker's steps cost beyond the profile's:

    mean step           = rate(pdserve_engine_step_seconds_sum[5m]) / rate(..._count[5m])
    mean decode batch   = rate(pdserve_engine_decoded_tokens_total[5m]) / rate(step count)
    loop's other time   = rate(pdserve_engine_held_seconds_total[5m])   (s per s)
"""

from __future__ import annotations

from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram

# (the buckets of every pdserve histogram of times: pdserve.common.metrics uses them too)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0)
FAST_BUCKETS = (0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS)  # handoffs, ITL: often < 1 ms
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class Step(Protocol):
    """What `EngineMetrics.observe_step` reads of an engine step (the shape of
    `pdserve.engine.engine.StepShape`, which this package does not import)."""

    @property
    def kind(self) -> str: ...
    @property
    def decodes(self) -> int: ...
    @property
    def prompt_tokens(self) -> int: ...
    @property
    def context_tokens(self) -> int: ...
    @property
    def prompt_pairs(self) -> int: ...
    @property
    def seconds(self) -> float: ...


class EngineMetrics:
    def __init__(self, r: CollectorRegistry):
        self.step_seconds = Histogram(
            "pdserve_engine_step_seconds", "engine steps (forward and sampling) by kind: decode "
            "(only sequences decoding), prefill (only prompt chunks), mixed; compare with the "
            "times `pdserve profile` measured", ("kind",), registry=r, buckets=FAST_BUCKETS)
        self.step_sequences = Histogram(
            "pdserve_engine_step_sequences", "sequences decoding a token in each step that had "
            "any (the decode batch)", registry=r, buckets=BATCH_BUCKETS)
        self.decoded = Counter("pdserve_engine_decoded_tokens", "tokens decoded (one per "
                               "sequence per step), by step kind", ("kind",), registry=r)
        self.context = Counter("pdserve_engine_context_tokens", "context tokens the decoded "
                               "tokens attended, by step kind", ("kind",), registry=r)
        self.prompt = Counter("pdserve_engine_prompt_tokens", "prompt tokens computed, by step "
                              "kind", ("kind",), registry=r)
        self.pairs = Counter("pdserve_engine_prompt_attended_pairs", "(query, key) token pairs "
                             "the prompt chunks attended, by step kind", ("kind",), registry=r)
        self.held = Counter("pdserve_engine_held_seconds", "time the engine loop, with work "
                            "waiting, spent between steps: handing the step's tokens over and "
                            "letting admissions and aborts take the engine (the threads that "
                            "stream tokens run meanwhile)", registry=r)

    def observe_step(self, step: Step) -> None:
        """An engine step, from the engine's thread."""
        kind = step.kind
        self.step_seconds.labels(kind).observe(step.seconds)
        if step.decodes:
            self.step_sequences.observe(step.decodes)
            self.decoded.labels(kind).inc(step.decodes)
            self.context.labels(kind).inc(step.context_tokens)
        if step.prompt_tokens:
            self.prompt.labels(kind).inc(step.prompt_tokens)
            self.pairs.labels(kind).inc(step.prompt_pairs)

    def observe_held(self, seconds: float) -> None:
        self.held.inc(seconds)
