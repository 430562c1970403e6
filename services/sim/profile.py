"""What a simulated worker's times are made of: linear models a real run can calibrate.

    prefill_ms(n)        = prefill_base_ms + prefill_ms_per_token * n
                           + prefill_ms_per_attended_token * n (n + 1) / 2   (one prompt alone)
    decode_step_ms(b, c) = decode_base_ms + (decode_ms_per_seq + seq_overhead_ms) * b
                           + decode_ms_per_attended_token * c   (b sequences, c context tokens)
    (each + step_overhead_ms: a serving worker's own time per step, beyond the forward;
    seq_overhead_ms: its own time per sequence decoding in a step, streaming its token)
    handoff_ms(bytes)    = handoff_base_ms + bytes / (handoff_gb_s * 1e9) * 1e3

The attention terms count (query token, key token) pairs: a prompt chunk of n tokens after s
computed ones attends to n s + n (n + 1) / 2 of them, a decode step to every sequence's
context. `step_ms` prices one engine step of decodes and prompt chunks together (what
`pdserve plan` simulates). The fields after `max_model_len` are used by `pdserve plan` only
and default to "no effect", so a profile without them times everything as before:
`request_overhead_ms` (router and RPC time in every TTFT), `step_overhead_ms` and
`seq_overhead_ms` (what a serving worker's loop, output dispatch and streaming add to each
step, and to each sequence decoding in it), `shared_cpu_ms_per_token`
and `shared_cores` (processes beside the workers on their cores, such as a router and clients
on the same machine, spending that much CPU per output token: a prefill worker's steps are
slower by 1 / (1 - their share of the `shared_cores` at the run's mean token rate), a
decoding worker's pay `shared_cpu_ms_per_token / shared_cores` more for each sequence in
them, as the tokens streamed come in bursts with its batches; 0: not modelled),
`tp_efficiency` (a worker with tensor parallelism N runs its steps 1 + tp_efficiency (N - 1)
times faster; 0: not modelled),
`devices_per_worker` (the cores or GPUs one worker of TP 1 uses, for goodput per device), and
`idle_wake_ms` with `idle_wake_half_ms`: the first step after a worker was idle for g ms takes
longer by

    wake_ms(g)           = idle_wake_ms * g / (g + idle_wake_half_ms)

(its weights and caches gone cold, its core asleep: on the 2-vCPU guests here a 32-token
step of bench-7m took ~5 ms back to back and ~10 ms after 50 ms idle; 0: not modelled).
`router_ms_per_request` and `router_ms_per_token` (the default profile's): the CPU one router
core spends on a request and on each token it streams (`pdserve bench router` measures them);
requests take a router core each in arrival order and wait for one when every core is busy
(`Deployment.routers` of them; 0: routers not modelled, never a queue).

The defaults are the bench-7m model's on a 2-vCPU AMD EPYC (Zen 5) with both cores: ~60 ms
for a 960-token prompt, ~4 ms for a decode step of a few sequences, the same-host handoff.
A profile file is JSON with any of the fields below; the others keep their defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SimProfile:
    prefill_base_ms: float = 2.0
    prefill_ms_per_token: float = 0.06
    decode_base_ms: float = 3.0
    decode_ms_per_seq: float = 0.1
    handoff_base_ms: float = 0.5
    handoff_gb_s: float = 3.0
    kv_bytes_per_token: int = 2048  # bench-7m: 4 layers x (K, V) x 2 KV heads x 32 x fp32
    block_size: int = 16
    num_pages: int = 4096
    max_model_len: int = 4096
    prefill_ms_per_attended_token: float = 0.0
    decode_ms_per_attended_token: float = 0.0
    request_overhead_ms: float = 0.0
    tp_efficiency: float = 0.0
    devices_per_worker: float = 1.0
    step_overhead_ms: float = 0.0
    seq_overhead_ms: float = 0.0
    shared_cpu_ms_per_token: float = 0.0
    shared_cores: float = 0.0
    idle_wake_ms: float = 0.0
    idle_wake_half_ms: float = 10.0
    router_ms_per_request: float = 0.0
    router_ms_per_token: float = 0.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"profile field {f.name}={value!r}: expected a number >= 0")
        for name in ("handoff_gb_s", "block_size", "num_pages", "max_model_len",
                     "devices_per_worker", "idle_wake_half_ms"):
            if getattr(self, name) <= 0:
                raise ValueError(f"profile field {name}={getattr(self, name)!r}: expected > 0")

    def prefill_ms(self, num_tokens: int) -> float:
        return self.prefill_base_ms + self.prefill_ms_per_token * num_tokens \
            + self.prefill_ms_per_attended_token * num_tokens * (num_tokens + 1) / 2 \
            + self.step_overhead_ms

    def decode_step_ms(self, batch: int, context_tokens: int = 0) -> float:
        return self.decode_base_ms + (self.decode_ms_per_seq + self.seq_overhead_ms) * batch \
            + self.decode_ms_per_attended_token * context_tokens + self.step_overhead_ms

    def step_ms(self, num_decodes: int, context_tokens: int,
                chunks: Iterable[tuple[int, int]] = ()) -> float:
        """One engine step: `num_decodes` sequences decoding over `context_tokens` tokens of
        context in all, beside prompt chunks given as (tokens computed before, chunk tokens).
        With no chunk it is `decode_step_ms`; with no decode, one chunk from 0 is `prefill_ms`."""
        tokens = attended = 0
        for start, n in chunks:
            tokens += n
            attended += n * start + n * (n + 1) // 2
        kind = "decode" if not tokens else "prefill" if not num_decodes else "mixed"
        return self.steps_ms(kind, 1, num_decodes, context_tokens, tokens, attended)

    def steps_ms(self, kind: str, steps: float, decodes: float, context_tokens: float,
                 prompt_tokens: float, prompt_pairs: float) -> float:
        """`steps` engine steps of one kind (decode, prefill or mixed, as a worker's metrics
        count them) that decoded `decodes` tokens over `context_tokens` of context and
        computed `prompt_tokens` prompt tokens attending `prompt_pairs` (query, key) pairs in
        all. A mixed step pays the larger base once and each part's per-token costs."""
        base = self.decode_base_ms if kind == "decode" else self.prefill_base_ms \
            if kind == "prefill" else max(self.prefill_base_ms, self.decode_base_ms)
        return steps * (base + self.step_overhead_ms) \
            + (self.decode_ms_per_seq + self.seq_overhead_ms) * decodes \
            + self.decode_ms_per_attended_token * context_tokens \
            + self.prefill_ms_per_token * prompt_tokens \
            + self.prefill_ms_per_attended_token * prompt_pairs

    def contention(self, output_tokens_per_s: float) -> float:
        """The share of the workers' cores that processes beside them take at this output
        rate (at most 0.9); 0 when `shared_cores` is 0."""
        if not self.shared_cores:
            return 0.0
        return min(0.9, output_tokens_per_s * self.shared_cpu_ms_per_token
                   / (1e3 * self.shared_cores))

    def router_ms(self, output_tokens: int) -> float:
        """The router CPU one request of `output_tokens` takes."""
        return self.router_ms_per_request + self.router_ms_per_token * output_tokens

    def wake_ms(self, idle_ms: float | None) -> float:
        """What the first step after `idle_ms` of idleness (None: none before it) adds."""
        if not self.idle_wake_ms:
            return 0.0
        if idle_ms is None:
            return self.idle_wake_ms
        idle_ms = max(0.0, idle_ms)
        return self.idle_wake_ms * idle_ms / (idle_ms + self.idle_wake_half_ms)

    def tp_speedup(self, tp: int) -> float:
        """How many times faster a worker with tensor parallelism `tp` steps (1 + tp_efficiency
        (tp - 1); 1.0 when tp_efficiency is 0: TP not modelled)."""
        return 1.0 + self.tp_efficiency * (tp - 1)

    def handoff_ms(self, num_bytes: int) -> float:
        return self.handoff_base_ms + num_bytes / (self.handoff_gb_s * 1e9) * 1e3

    def pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @classmethod
    def load(cls, path: str | Path) -> SimProfile:
        """A profile from a JSON file of field values; unknown fields are refused by name."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ValueError(f"profile {path}: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError(f"profile {path}: expected a JSON object of field values")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"profile {path}: unknown field(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
        return cls(**data)
