"""The engine run both engine benchmarks time (`bench engine` against transformers, `--vs-vllm`
against vLLM): the same seeded prompts, greedy, EOS ignored, continuous batching."""

from __future__ import annotations

import statistics
import time

import torch
from pdserve.common.layout import pages_for_tokens
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model import PagedCausalLM
from pdserve.engine.sampling import SamplingParams


def random_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """`n` prompts of `length` token ids drawn past the special ids (0-2), seeded: the same
    prompts on every call, for every engine compared."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(n)]


def run_engine(model: PagedCausalLM, prompts: list[list[int]], out_tokens: int, *,
               keep_outputs: bool = False) -> tuple[float, float, list[list[int]]]:
    """(output tok/s over the whole run, median decode step ms at full batch, the output ids
    of every prompt when `keep_outputs`)."""
    block = 16
    num_pages = len(prompts) * pages_for_tokens(len(prompts[0]) + out_tokens, block) + 8
    engine = Engine(model, EngineConfig(num_pages=num_pages, block_size=block), eos_token_ids=[])
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True)
    try:
        start = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        decode_ms: list[float] = []
        produced = 0
        outputs: list[list[int]] = [[] for _ in prompts]
        while engine.has_work():
            prefilling = bool(engine.waiting)
            outs = engine.step()
            produced += len(outs)
            if keep_outputs:
                for out in outs:
                    outputs[int(out.seq_id)].append(out.token or 0)
            if not prefilling and len(outs) == len(prompts):
                decode_ms.append(outs[0].compute_ms)
        elapsed = time.perf_counter() - start
        step_ms = statistics.median(decode_ms) if decode_ms else float("nan")
        return produced / elapsed, step_ms, outputs
    finally:
        engine.close()
