"""The vLLM child of `pdserve bench engine --vs-vllm` takes only the dtypes pdserve's engine
runs: vLLM's own "auto" (the model config's dtype) could compare a bf16 vLLM with an fp32
pdserve."""

from __future__ import annotations

import subprocess
import sys

from pdserve.bench.engine_vllm import VLLM_SCRIPT


def test_vllm_child_refuses_a_dtype_pdserve_does_not_run() -> None:
    done = subprocess.run([sys.executable, "-P", str(VLLM_SCRIPT), "/nonexistent", "--dtype",
                           "auto"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "argument --dtype: invalid choice: 'auto'" in done.stderr
    assert "float32" in done.stderr and "bfloat16" in done.stderr
