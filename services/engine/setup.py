"""Building an engine from a model name or directory: the one path every worker uses."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

from pdserve.common.cpus import format_cpu_list
from pdserve.common.models import resolve_model_name
from pdserve.engine import kernels
from pdserve.engine.builtin import model_dir
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import Engine
from pdserve.engine.model import (
    PagedCausalLM,
    check_architecture,
    gemm_rows,
    load_model,
    read_config,
)
from pdserve.engine.pool import KVPool
from pdserve.engine.sizing import PoolPlan, plan_pool
from pdserve.engine.tp import Group, Ranks, RankSpec, split_cores
from pdserve.engine.tp_shard import ShardingError, check_divisible

log = logging.getLogger("pdserve.engine")


def eos_token_ids(model_dir: Path) -> list[int]:
    """EOS ids from generation_config.json, falling back to config.json."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = model_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids += eos if isinstance(eos, list) else [eos]
                break
    return ids


def pool_plan(model: PagedCausalLM, role: str, block_size: int, num_pages: int = 0,
              kv_cache_mb: int = 0, max_model_len: int = 0) -> PoolPlan:
    """The pool and context for `model` in `role` (see sizing.py); ValueError when the flags
    cannot serve one full-context sequence."""
    return plan_pool(role=role, page_bytes=model.fingerprint(block_size).page_bytes,
                     block_size=block_size, model_context=model.max_context,
                     max_model_len=max_model_len, num_pages=num_pages, kv_cache_mb=kv_cache_mb)


def shared_slot_bytes(model: PagedCausalLM, max_step_tokens: int) -> int:
    """The shared-memory all-reduce's slot: a step's largest partial sum (rows x hidden, fp32);
    0 (gloo only) for other dtypes, without the native kernels, or with
    PDSERVE_TP_SHARED_REDUCE=0."""
    if model.dtype_name != "float32" or os.environ.get("PDSERVE_TP_SHARED_REDUCE") == "0" \
            or kernels.library() is None:
        return 0
    return gemm_rows(max_step_tokens) * int(model.config.hidden_size) * 4


def build_engine(model: str, *, role: str, dtype: str = "auto", device: str = "cpu",
                 block_size: int = 16, num_pages: int = 0, kv_cache_mb: int = 0,
                 max_model_len: int = 0, chunk_size: int = 512, max_num_seqs: int = 256,
                 max_prefill_tokens: int = 2048, prefix_caching: bool = True,
                 prompts_beside_decodes: int = 0, tp: int = 1,
                 tp_cores: list[list[int]] | None = None, tp_threads: int = 0
                 ) -> tuple[Engine, Path]:
    """The engine of a worker. Its pool holds at least one full-context sequence: sized so
    (kv_cache_mb 0 and num_pages 0), or checked (ValueError naming both numbers).

    With `tp` > 1 this process is rank 0 of `tp` (tp.py): the other ranks start on
    `tp_cores[1:]` (default: this process's cores split evenly) with `tp_threads` torch
    threads each (0: as many as its cores), each with its shard and a pool of as many pages as
    this one's (kv_cache_mb is per rank). ShardingError when `tp`
    does not divide the model's heads."""
    ref = resolve_model_name(model)
    directory = model_dir(ref)
    model_id = ref.name if ref.builtin_size else None
    group = None
    if tp > 1:
        if device != "cpu":
            raise ShardingError(f"tensor parallelism runs on CPU (gloo) only so far, not on "
                                f"{device!r}")
        check_architecture(hf_config := read_config(directory), directory)
        check_divisible(hf_config, tp)
        group = Group(0, tp)
    loaded = load_model(directory, dtype=dtype, device=device, model_id=model_id, tp=group)
    plan = pool_plan(loaded, role, block_size, num_pages, kv_cache_mb, max_model_len)
    log.info("%s", plan.describe(block_size, loaded.fingerprint(block_size).page_bytes))
    ranks = None
    if group is not None:
        cores = tp_cores or split_cores(sorted(os.sched_getaffinity(0)), tp)
        if len({c for share in cores for c in share}) < tp:
            log.warning("%d tensor-parallel ranks on %d cores: ranks share cores, and each "
                        "all-reduce waits for the slowest", tp, len({c for s in cores for c in s}))
        spec = RankSpec(str(directory), model_id, dtype, device, block_size, plan.num_pages,
                        tp, 0, tp_threads or max(1, len(cores[1])),
                        shared_slot_bytes(loaded, max(max_prefill_tokens, max_num_seqs)))
        log.info("starting tensor-parallel ranks 1..%d on cores %s", tp - 1,
                 "; ".join(format_cpu_list(c) for c in cores[1:]))
        fp = loaded.fingerprint(block_size)
        pools = [KVPool(dataclasses.replace(fp, tp_rank=r), plan.num_pages, device)
                 for r in range(1, tp)]
        ranks = Ranks.launch(group, spec, cores, pools)
    config = EngineConfig(role=role, block_size=block_size, num_pages=plan.num_pages,
                          max_model_len=plan.max_model_len, chunk_size=chunk_size,
                          max_num_seqs=max_num_seqs, max_prefill_tokens=max_prefill_tokens,
                          prefix_caching=prefix_caching,
                          prompts_beside_decodes=prompts_beside_decodes)
    return Engine(loaded, config, device=device, eos_token_ids=eos_token_ids(directory),
                  ranks=ranks), directory
