"""vLLM's offline engine as a child process of `pdserve bench engine --vs-vllm`.

Run by vLLM's own interpreter (`/work/vllm-venv/bin/python vllm_offline.py MODEL_DIR ...`), so
this file imports nothing from pdserve. It loads the model once, then answers one JSON line
per request on stdin (`{"prompts": [[ids]], "max_tokens": N}`) with one line on stdout,
`RESULT {"elapsed_s": ..., "outputs": [[ids]]}`: greedy, EOS ignored, prompts given as token
ids (the same ids pdserve gets). Anything else vLLM prints is just log.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from typing import Any


def main() -> int:
    parser = argparse.ArgumentParser(description="vLLM's offline engine for `pdserve bench "
                                     "engine --vs-vllm` (one JSON request per stdin line)")
    parser.add_argument("model_dir", help="a local Hugging Face model directory")
    parser.add_argument("--max-model-len", type=int, default=1024,
                        help="vLLM's max_model_len (default 1024)")
    parser.add_argument("--max-num-seqs", type=int, default=256,
                        help="vLLM's max_num_seqs: sequences in one batch (default 256)")
    parser.add_argument("--dtype", default="float32",
                        choices=("float32", "bfloat16", "float16"),
                        help="the weights' dtype in vLLM: the one pdserve's engine runs (never "
                             "vLLM's auto, the model config's, which may differ)")
    args = parser.parse_args()
    vllm: Any = importlib.import_module("vllm")
    llm = vllm.LLM(model=args.model_dir, dtype=args.dtype, seed=0,
                   max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   enable_prefix_caching=False)  # a repeated prompt must not skip its prefill
    print("READY", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        params = vllm.SamplingParams(temperature=0.0, max_tokens=request["max_tokens"],
                                     min_tokens=request["max_tokens"], ignore_eos=True)
        prompts = [{"prompt_token_ids": ids} for ids in request["prompts"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        result = {"elapsed_s": elapsed, "outputs": [list(o.outputs[0].token_ids) for o in outs]}
        print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
