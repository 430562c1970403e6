"""The engine's native kernels: attention over the paged pool, read in place (CPU; K/V in
float32 or bfloat16, queries and outputs in float32).

`csrc/paged_attention.c` (rows with few new tokens: decode), `csrc/prefill_attention.c`
(prompt chunks, flash-style causal attention) and `csrc/rope_store.c` (rotary embedding and
the K/V store into pages, one pass) are plain C (no torch headers), built into one library
by the system C compiler on first use (its objects side by side: ~10 s on 2 cores of a Zen 3);
the library is cached under the pdserve cache directory, keyed by the sources, the compiler
and the CPU's flags, and loaded with ctypes. It runs its OpenMP loops on torch's own OpenMP
runtime (same `libgomp.so.1`, already loaded by torch), so kernels and GEMMs share one thread
pool. With no C compiler the engine falls back to gathering pages and calling torch's SDPA
(slower, same results), and says so once.

Images without a compiler (deploy/Containerfile) carry portable builds made ahead of time by
`python -m pdserve.engine.kernels prebuild DIR`: one per x86-64 ISA level, named by the
sources' hash and the level; with no compiler the best level this CPU supports is loaded.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import torch
from pdserve.common.native import build_shared, compiler, kernels_dir, prebuild_main
from pdserve.common.native import cpu_flags as _cpu_flags

SOURCES = tuple(Path(__file__).with_name("csrc") / name
                for name in ("paged_attention.c", "prefill_attention.c", "rope_store.c",
                             "allreduce.c"))
HEADERS = tuple(Path(__file__).with_name("csrc") / name
                for name in ("kv_types.h", "kv_instantiate.h"))
KV_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}  # pool dtypes the kernels read
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-Wno-psabi", "-shared", "-fPIC")
log = logging.getLogger("pdserve.engine.kernels")
_I64 = ctypes.c_int64
_PTR = ctypes.c_void_p
# Each entry point's arguments (one function per pool dtype: `name_f32`, `name_bf16`).
_ARGTYPES: dict[str, list[Any]] = {
    "paged_attention": [_PTR] * 8 + [_I64] * 8 + [ctypes.c_float, _I64, ctypes.c_int],
    "paged_prefill": [_PTR] * 8 + [_I64] * 8 + [ctypes.c_float, ctypes.c_int],
    "rope_store": [_PTR] * 8 + [_I64] * 5 + [ctypes.c_int],
}
PREFILL_HEAD_DIMS = (16, 32, 64, 128)  # what the prefill kernel is compiled for
PREFILL_MAX_GROUP = 16  # query heads per KV head
# Portable builds, best first: the ISA level (a -march value) and the CPU flags it needs.
PORTABLE_LEVELS: tuple[tuple[str, frozenset[str]], ...] = (
    ("x86-64-v4", frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})),
    ("x86-64-v3", frozenset({"avx2", "fma", "bmi1", "bmi2", "f16c", "movbe"})),
)
_lib: ctypes.CDLL | None = None
_tried = False


def _units() -> list[tuple[Path, tuple[str, ...]]]:
    """What to compile: each source, and one that instantiates per K/V type (kv_instantiate.h)
    once per type: the prefill kernel's eight instantiations were 13 of a 16 s build on a
    Zen 3, and two objects compile side by side."""
    units: list[tuple[Path, tuple[str, ...]]] = []
    for source in SOURCES:
        if '#include "kv_instantiate.h"' in source.read_text():
            units += [(source, ("-DKV_ONLY_F32",)), (source, ("-DKV_ONLY_BF16",))]
        else:
            units.append((source, ()))
    return units


def _build(cc: str, target: Path, flags: tuple[str, ...] = FLAGS) -> None:
    build_shared(cc, _units(), target, flags, libs=("-lmvec", "-lm"))


def _source_hash() -> str:
    h = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        h.update(source.read_bytes())
    return h.hexdigest()


def _portable_name(level: str) -> str:
    return f"paged_attention-{_source_hash()[:16]}-{level}.so"


def _prebuilt(directory: Path) -> Path | None:
    """The best portable build in `directory` that this CPU can run, if any."""
    have = set(_cpu_flags().split())
    for level, needs in PORTABLE_LEVELS:
        path = directory / _portable_name(level)
        if needs <= have and path.is_file():
            return path
    return None


def prebuild(directory: Path, cc: str = "cc") -> list[Path]:
    """Portable builds of the kernel, one per ISA level, for machines with no compiler."""
    built = []
    for level, _ in PORTABLE_LEVELS:
        flags = tuple(f"-march={level}" if f == "-march=native" else f for f in FLAGS)
        target = directory / _portable_name(level)
        _build(cc, target, flags)
        built.append(target)
    return built


def library() -> ctypes.CDLL | None:
    """The kernel library: built for this CPU on first use, or else a portable build made
    ahead of time; None when neither can be had."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PDSERVE_NO_NATIVE_ATTENTION"):
        return None
    cc = compiler()
    kernels = kernels_dir()
    if cc:
        key = hashlib.sha256(_source_hash().encode() + " ".join(FLAGS).encode() + cc.encode()
                             + _cpu_flags().encode()).hexdigest()[:16]
        target = kernels / f"paged_attention-{key}.so"
    else:
        found = _prebuilt(kernels)
        if found is None:
            log.warning("no C compiler and no prebuilt kernel for this CPU: paged attention "
                        "falls back to gather + SDPA")
            return None
        target = found
    try:
        if cc and not target.is_file():
            _build(cc, target)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("paged attention kernel unavailable (%s): falling back to gather + SDPA",
                    detail)
        return None
    _declare(lib, ("paged_prefill",))  # the others are called through gil_held(lib)
    log.info("paged attention kernel: %s", target.name)
    _lib = lib
    return lib


def prefill_kernel_suits_cpu() -> bool:
    """Whether prompts take the prefill kernel here. It is written in 16-float vectors, one
    register on AVX-512; without AVX-512 GCC (12) lowers its shuffles, compares and maxima
    lane by lane, and a 1,024-token prompt of bench-7m took 5.6x as long as gathering its pages
    for SDPA on a Zen 3 (497 against 88 ms). So there prompts take SDPA; the decode kernel
    holds its own (a 32-sequence step 14.1 ms against 14.0). `PDSERVE_PREFILL_KERNEL` 1 or 0
    overrides."""
    forced = os.environ.get("PDSERVE_PREFILL_KERNEL", "")
    if forced in ("0", "1"):
        return forced == "1"
    return "avx512f" in _cpu_flags().split()


def paged_attention(lib: ctypes.CDLL, q: torch.Tensor, out: torch.Tensor, layer_kv: torch.Tensor,
                    q_starts: torch.Tensor, q_ends: torch.Tensor, context_lens: torch.Tensor,
                    block_tables: torch.Tensor, *, num_kv_heads: int, window: int, scale: float,
                    max_context: int) -> None:
    """out[rows] = attention of q[rows] over the pages of `layer_kv`, for the sequences given:
    sequence s owns rows q_starts[s] .. q_ends[s]-1 of q [N, H, D] (and of out), both
    float32 and contiguous; `layer_kv` float32 or bfloat16 (KV_DTYPES).

    `layer_kv` is one layer's view of the pool, `pool[:, layer]`: [P, 2, block, kvh, D], whose
    pages stand `stride(0)` elements apart. Index tensors are int64 and contiguous.
    """
    num_seqs, max_pages = block_tables.shape
    k_base = layer_kv[0, 0].data_ptr()
    v_base = layer_kv[0, 1].data_ptr()
    entry = getattr(gil_held(lib), f"paged_attention_{KV_DTYPES[layer_kv.dtype]}")
    with torch.profiler.record_function("paged_attention"):
        rc = entry(
            q.data_ptr(), out.data_ptr(), k_base, v_base, q_starts.data_ptr(),
            q_ends.data_ptr(), context_lens.data_ptr(), block_tables.data_ptr(), num_seqs,
            max_pages, layer_kv.stride(0), layer_kv.shape[2], q.shape[1], num_kv_heads,
            q.shape[2], window, scale, max_context, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged attention kernel failed (code {rc})")


_held: dict[str, ctypes.PyDLL] = {}


def _declare(dll: ctypes.CDLL, names: tuple[str, ...]) -> None:
    for name in names:
        for kind in KV_DTYPES.values():
            entry = getattr(dll, f"{name}_{kind}")
            entry.argtypes, entry.restype = _ARGTYPES[name], ctypes.c_int


def gil_held(lib: ctypes.CDLL) -> ctypes.PyDLL:
    """The same library called without releasing the GIL: for the step's short calls (decode
    attention, rope; about 0.1-2 ms on the benchmark shapes), where handing the GIL to a
    serving thread and waiting to get it back costs more than the call (measured: 32
    streams' threads made a decode step 35% slower, most of it waiting for the GIL after
    each released call). Prompt-chunk attention, which can run for tens of ms, releases it."""
    held = _held.get(lib._name)
    if held is None:
        held = _held[lib._name] = ctypes.PyDLL(lib._name)
        _declare(held, ("paged_attention", "rope_store"))
    return held


def rope_store(lib: ctypes.CDLL, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               layer_kv: torch.Tensor, slot_pages: torch.Tensor, slot_offsets: torch.Tensor, *,
               num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """Rotate the q and k heads of `qkv` [N, (H + 2 KVH) * D] by `cos`/`sin` [N, D], write
    k and v into their pool slots (`layer_kv`'s pages), return q [N, H, D] in float32. All of
    qkv, cos, sin and the pool in the model's dtype (float32 or bfloat16), contiguous."""
    n = qkv.shape[0]
    q = torch.empty(n, num_heads, head_dim, dtype=torch.float32)
    entry = getattr(gil_held(lib), f"rope_store_{KV_DTYPES[layer_kv.dtype]}")
    rc = entry(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), q.data_ptr(),
               layer_kv[0, 0].data_ptr(), layer_kv[0, 1].data_ptr(), slot_pages.data_ptr(),
               slot_offsets.data_ptr(), n, num_heads, num_kv_heads, head_dim,
               layer_kv.stride(0), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"rope/store kernel failed (code {rc})")
    return q


def prefill_attention(lib: ctypes.CDLL, q: torch.Tensor, out: torch.Tensor,
                      layer_kv: torch.Tensor, q_starts: torch.Tensor, q_ends: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, *,
                      num_kv_heads: int, window: int, scale: float) -> None:
    """Causal attention for prompt chunks: `paged_attention`'s arguments and layout, for
    sequences with many new rows each (head_dim in PREFILL_HEAD_DIMS, at most
    PREFILL_MAX_GROUP query heads per KV head)."""
    num_seqs, max_pages = block_tables.shape
    entry = getattr(lib, f"paged_prefill_{KV_DTYPES[layer_kv.dtype]}")
    with torch.profiler.record_function("prefill_attention"):
        rc = entry(
            q.data_ptr(), out.data_ptr(), layer_kv[0, 0].data_ptr(), layer_kv[0, 1].data_ptr(),
            q_starts.data_ptr(), q_ends.data_ptr(), context_lens.data_ptr(),
            block_tables.data_ptr(), num_seqs, max_pages, layer_kv.stride(0),
            layer_kv.shape[2], q.shape[1], num_kv_heads, q.shape[2], window, scale,
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"prefill attention kernel failed (code {rc})")


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.engine.kernels prebuild DIR`: portable builds for images."""
    return prebuild_main("pdserve.engine.kernels", "portable builds of the attention kernel, "
                         "one per x86-64 ISA level,", prebuild, argv)


if __name__ == "__main__":
    raise SystemExit(main())
