"""Prefill against the machine's GEMM rate: FLOPs of one prompt, time, GFLOPS reached.

    .venv/bin/python tools/profile_prefill.py --models bench-7m,bench-152m,smollm2 \
        --tokens 512,1024,2048,4096

For each model and prompt length: one prompt alone through the engine (co-located role, so it
runs in one step up to --budget tokens, as a lone prompt is served), timed as the median of
--repeats fresh prompts after a warm-up. FLOPs are the model's own: the GEMMs (q/k/v, o,
gate/up, down per layer, 2 per multiply-add) and causal attention (QK^T and PV over the lower
triangle: 2 * layers * heads * head_dim * n^2); the LM head runs on the last token only. The
bound beside it is what this machine's oneDNN GEMM reaches at the same M, K, N (the model's
largest projection), measured in the same run. `--profile` adds the op table of one prompt.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch


def gemm_gflops(m: int, k: int, n: int, dtype: torch.dtype, reps: int = 10) -> float:
    """The engine's own linear (oneDNN with a prepacked weight on CPU) at [m, k] x [k, n]."""
    from pdserve.engine.model import Linear

    linear = Linear(torch.randn(n, k).to(dtype), None, torch.device("cpu"))
    x = torch.randn(m, k).to(dtype)
    for _ in range(3):
        linear(x)
    start = time.perf_counter()
    for _ in range(reps):
        linear(x)
    return 2 * m * k * n * reps / (time.perf_counter() - start) / 1e9


def prefill_flops(model: Any, n: int) -> tuple[float, float]:
    """(GEMM FLOPs, attention FLOPs) of one n-token prompt (`model`: a PagedCausalLM)."""
    cfg = model.config
    h, kvh, d = model.num_heads, model.num_kv_heads, model.head_dim
    hidden, inter, layers = cfg.hidden_size, cfg.intermediate_size, model.num_layers
    per_token = hidden * (h + 2 * kvh) * d + h * d * hidden + hidden * 2 * inter + inter * hidden
    lm_head = hidden * cfg.vocab_size
    return 2.0 * (n * layers * per_token + lm_head), 2.0 * layers * h * d * n * n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="bench-7m,bench-152m,smollm2")
    parser.add_argument("--tokens", default="512,1024,2048,4096")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=4096, help="max_prefill_tokens")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    from pdserve.bench.engine_run import random_prompts
    from pdserve.engine.builtin import model_dir
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.engine import Engine
    from pdserve.engine.sampling import SamplingParams
    from pdserve.engine.setup import load_model, resolve_model_name

    lengths = [int(t) for t in args.tokens.split(",")]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}")
    print(f"{'model':>22} {'tokens':>7} {'GFLOP':>7} {'attn %':>7} {'ms':>8} {'GFLOPS':>7} "
          f"{'GEMM bound':>10} {'of bound':>8}")
    for name in args.models.split(","):
        ref = resolve_model_name(name)
        model = load_model(model_dir(ref), dtype=args.dtype,
                           model_id=ref.name if ref.builtin_size else None)
        cfg = model.config
        for n in lengths:
            if n >= model.max_context:
                continue
            pages = (n // 16 + 2) * (args.repeats + 2)
            engine = Engine(model, EngineConfig(num_pages=pages, chunk_size=args.budget,
                                                max_prefill_tokens=args.budget,
                                                max_model_len=n + 8, prefix_caching=False),
                            eos_token_ids=[])
            prompts = random_prompts(args.repeats + 1, n, model.vocab_size)
            times = []
            for i, prompt in enumerate(prompts):
                start = time.perf_counter()
                engine.add_request(str(i), prompt, params)
                while engine.has_work():
                    engine.step()
                if i:  # the first is the warm-up
                    times.append((time.perf_counter() - start) * 1e3)
            engine.close()
            gemm, attn = prefill_flops(model, n)
            ms = statistics.median(times)
            bound = gemm_gflops(min(n, args.budget), cfg.hidden_size, 2 * cfg.intermediate_size,
                                getattr(torch, args.dtype))
            reached = (gemm + attn) / ms / 1e6
            print(f"{model.model_id:>22} {n:>7} {(gemm + attn) / 1e9:>7.2f} "
                  f"{100 * attn / (gemm + attn):>6.0f}% {ms:>8.1f} {reached:>7.1f} "
                  f"{bound:>10.1f} {reached / bound:>7.0%}", flush=True)
        if args.profile:
            from torch.profiler import profile

            n = lengths[-1] if lengths[-1] < model.max_context else lengths[0]
            engine = Engine(model, EngineConfig(num_pages=n // 16 + 4, chunk_size=args.budget,
                                                max_prefill_tokens=args.budget,
                                                prefix_caching=False), eos_token_ids=[])
            engine.add_request("p", random_prompts(1, n, model.vocab_size)[0], params)
            with profile() as prof:
                while engine.has_work():
                    engine.step()
            engine.close()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


if __name__ == "__main__":
    main()
