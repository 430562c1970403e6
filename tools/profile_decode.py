"""Profile the engine's decode step: where one step at C sequences spends its time.

    .venv/bin/python tools/profile_decode.py --model bench-7m --concurrency 32

C prompts of 256 tokens are prefilled, 64 decode steps warm up, then `--steps` decode steps
run under torch.profiler. Prints the op table (self CPU time) and the shares of the families
that matter: the K/V gather (index_select), SDPA, the paged attention kernel, GEMMs, and the
time no torch op accounts for (Python and the step's own bookkeeping).
"""

from __future__ import annotations

import argparse
import time

from torch.profiler import ProfilerActivity, profile

FAMILIES = {
    "K/V gather (index_select)": ("aten::index_select",),
    "SDPA": ("aten::_scaled_dot_product", "aten::scaled_dot_product", "aten::_softmax",
             "aten::bmm", "aten::baddbmm"),
    "paged attention kernel": ("paged_attention",),
    "GEMMs (linear)": ("aten::addmm", "aten::mm", "aten::linear", "aten::matmul"),
    "K/V write (index_put)": ("aten::index_put_", "aten::_index_put_impl_"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="bench-7m")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rows", type=int, default=15)
    args = parser.parse_args()
    from pdserve.bench.engine_run import random_prompts
    from pdserve.common.layout import pages_for_tokens
    from pdserve.common.models import resolve_model_name
    from pdserve.engine.builtin import model_dir
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.model import load_model
    from pdserve.engine.sampling import SamplingParams

    ref = resolve_model_name(args.model)
    model = load_model(model_dir(ref), dtype="float32", model_id=ref.name)
    prompts = random_prompts(args.concurrency, 256, model.vocab_size)
    pages = args.concurrency * pages_for_tokens(256 + 128, 16) + 8
    engine = Engine(model, EngineConfig(num_pages=pages), eos_token_ids=[])
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    while engine.waiting:
        engine.step()
    for _ in range(64):
        engine.step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    wall_us = (time.perf_counter() - start) * 1e6
    events = prof.key_averages()
    print(events.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    total_self = sum(e.self_cpu_time_total for e in events)
    print(f"{args.model}, {args.concurrency} sequences, context ~{256 + 64}: "
          f"{wall_us / args.steps / 1e3:.2f} ms per decode step (profiled)")
    named = 0.0
    for family, names in FAMILIES.items():
        us = sum(e.self_cpu_time_total for e in events if e.key.startswith(names))
        named += us
        print(f"  {family:<28} {us / wall_us * 100:5.1f} %")
    print(f"  {'other torch ops':<28} {(total_self - named) / wall_us * 100:5.1f} %")
    print(f"  {'no torch op (Python, gaps)':<28} {(wall_us - total_self) / wall_us * 100:5.1f} %")
    engine.close()


if __name__ == "__main__":
    main()
