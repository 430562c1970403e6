"""Checking a profile against the engine it came from: replay a workload through the real
engine in this process and through the simulator, and compare.

The engine runs co-located, one thread owning it as `engine/loop.py`'s does: requests join at
their arrival times (between steps), every step's tokens are stamped as it ends. No RPC, no
router, no handoff: what is compared is the simulator's model of the engine's scheduling and
step times, the part a profile calibrates. `pdserve plan --validate` compares whole stacks.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pdserve.plan.cluster import Deployment, simulate
from pdserve.plan.workload import Request
from pdserve.sim.profile import SimProfile

if TYPE_CHECKING:
    from pdserve.engine.engine import Engine


@dataclass(frozen=True)
class Check:
    requests: int
    rate: float
    ttft_p50_ms: tuple[float, float]  # (measured, predicted)
    tpot_p50_ms: tuple[float, float]

    @property
    def errors(self) -> dict[str, float]:
        """Predicted / measured - 1 of each p50."""
        return {name: predicted / measured - 1 if measured else 0.0
                for name, (measured, predicted) in (("ttft_p50", self.ttft_p50_ms),
                                                    ("tpot_p50", self.tpot_p50_ms))}

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "errors": self.errors}

    def describe(self) -> str:
        e = self.errors
        return (f"check: {self.requests} requests at {self.rate:g} req/s through this engine "
                f"(co-located, in-process) vs the simulator on this profile: TTFT p50 "
                f"{self.ttft_p50_ms[0]:.1f} measured, {self.ttft_p50_ms[1]:.1f} predicted "
                f"({e['ttft_p50']:+.0%}); TPOT p50 {self.tpot_p50_ms[0]:.2f} measured, "
                f"{self.tpot_p50_ms[1]:.2f} predicted ({e['tpot_p50']:+.0%})")


def run_engine(engine: Engine, requests: list[Request], seed: int = 0
               ) -> dict[int, tuple[float, float]]:
    """(first token ms, last token ms) after its arrival, per request index."""
    from pdserve.common.sampling import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(r.prompt_tokens)] for r in requests]
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    start = time.perf_counter()
    arrived = 0
    while len(done) < len(requests):
        now = (time.perf_counter() - start) * 1e3
        while arrived < len(requests) and requests[arrived].arrival_ms <= now:
            r = requests[arrived]
            engine.add_request(str(r.index), prompts[arrived],
                               SamplingParams(max_tokens=r.output_tokens, temperature=0.0,
                                              ignore_eos=True))
            arrived += 1
        if not engine.has_work():
            # the next arrival is in the future: wait for it, as an idle worker does
            time.sleep(max(0.0, (requests[arrived].arrival_ms - now) / 1e3))
            continue
        outputs = engine.step()
        at = (time.perf_counter() - start) * 1e3
        for out in outputs:
            index = int(out.seq_id)
            first.setdefault(index, at)
            if out.finish_reason:
                done[index] = at
    return {r.index: (first[r.index] - r.arrival_ms, done[r.index] - r.arrival_ms)
            for r in requests}


def check(engine: Engine, profile: SimProfile, requests: list[Request], rate: float) -> Check:
    """Replay `requests` through `engine` (co-located, chunk and budget as configured) and
    through the simulator with `profile`; their TTFT and TPOT p50."""
    measured = run_engine(engine, requests)
    dep = Deployment("colocated", 0, 1, chunk_size=engine.config.chunk_size,
                     max_prefill_tokens=engine.config.max_prefill_tokens,
                     max_num_seqs=engine.config.max_num_seqs)
    predicted = simulate(dep, requests, profile)
    real_ttft = [measured[r.index][0] for r in requests]
    real_tpot = [(measured[r.index][1] - measured[r.index][0]) / (r.output_tokens - 1)
                 for r in requests if r.output_tokens > 1]
    sim_ttft = [o.ttft_ms for o in predicted if o.ttft_ms is not None]
    sim_tpot = [t for o in predicted if (t := o.tpot_ms) is not None]
    return Check(len(requests), rate,
                 (statistics.median(real_ttft), statistics.median(sim_ttft)),
                 (statistics.median(real_tpot) if real_tpot else 0.0,
                  statistics.median(sim_tpot) if sim_tpot else 0.0))
