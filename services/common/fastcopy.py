"""Copies of KV pages between pools with streaming stores (csrc/kvcopy.c), for big handoffs.

A cached copy (numpy's, glibc's memcpy below its streaming threshold) reads every destination
line before writing it and pushes everything else out of the caches. For a handoff of many
megabytes that the copying process never reads again, streaming stores move the same bytes
with a third less memory traffic (19-22 GB/s against 12-15 for memcpy at 24-192 MiB on this
project's 2-vCPU VMs, whose CPUID reports a 320 MiB cache, so glibc never streams below 240
MiB) and leave the caches to the processes that come next. Small copies stay cached: they fit
in the caches, and the decode step reads those pages next.

The library is built on first use with the system compiler (one portable build: the vector
width is chosen at run time) or loaded from the images' prebuilt folder; with neither, or with
`PDSERVE_NO_NATIVE_COPY=1`, `copy` is numpy's and `isa()` says "numpy".
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pdserve.common.native import build_shared, compiler, kernels_dir, prebuild_main

SOURCE = Path(__file__).with_name("csrc") / "kvcopy.c"
FLAGS = ("-O2", "-shared", "-fPIC", "-pthread")  # portable: kvcopy.c picks the vector width itself
STREAM_MIN_BYTES = 8 << 20  # handoffs from this size up stream; smaller ones stay cached
log = logging.getLogger("pdserve.common.fastcopy")
_lib: ctypes.CDLL | None = None
_tried = False


def library_name() -> str:
    return f"kvcopy-{hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]}.so"


def prebuild(directory: Path, cc: str = "cc") -> Path:
    """The portable build, into `directory` (images: where `library()` looks)."""
    target = directory / library_name()
    build_shared(cc, SOURCE, target, FLAGS)
    return target


def library() -> ctypes.CDLL | None:
    """The copy library, built or found once per process; None when it cannot be had."""
    global _lib, _tried
    if _tried:
        return _lib
    _tried = True
    if os.environ.get("PDSERVE_NO_NATIVE_COPY"):
        return None
    target = kernels_dir() / library_name()
    try:
        if not target.is_file():
            cc = compiler()
            if cc is None:
                log.info("no C compiler and no prebuilt %s: KV copies use numpy", target.name)
                return None
            prebuild(target.parent, cc)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("streaming KV copy unavailable (%s): KV copies use numpy",
                    getattr(exc, "stderr", "") or exc)
        return None
    lib.pdserve_stream_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    lib.pdserve_stream_copy.restype = ctypes.c_int
    lib.pdserve_stream_copy_isa.restype = ctypes.c_char_p
    sizes = ctypes.POINTER(ctypes.c_size_t)
    lib.pdserve_gather_rows.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                                        ctypes.c_int, sizes, sizes, sizes, sizes, ctypes.c_int]
    lib.pdserve_gather_rows.restype = ctypes.c_int
    _lib = lib
    return lib


def isa() -> str:
    """The loop streaming copies run here: "avx512", "avx", "sse2", "memcpy" or "numpy"."""
    lib = library()
    return lib.pdserve_stream_copy_isa().decode() if lib is not None else "numpy"


def stream_copy(dst: np.ndarray, src: np.ndarray) -> None:
    """dst[:] = src with streaming stores (numpy's copy where the library is missing). Both
    are contiguous uint8 arrays of one size that do not overlap."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    lib = library()
    if lib is None:
        np.copyto(dst, src)
        return
    if not (dst.flags.c_contiguous and src.flags.c_contiguous):
        raise ValueError("stream_copy needs contiguous arrays")
    lib.pdserve_stream_copy(dst.ctypes.data, src.ctypes.data, src.nbytes)


def copy(dst: np.ndarray, src: np.ndarray, total_bytes: int) -> None:
    """One piece of a handoff of `total_bytes`: streamed when the handoff is big, else numpy's
    cached copy."""
    if total_bytes >= STREAM_MIN_BYTES:
        stream_copy(dst, src)
    else:
        np.copyto(dst, src)


def copy_in_slices(dst: np.ndarray, src: np.ndarray, total_bytes: int, slice_bytes: int,
                   stop: Callable[[], bool], addresses: tuple[int, int] | None = None) -> bool:
    """`copy` of one piece of a handoff of `total_bytes`, `slice_bytes` at a time, asking
    `stop()` before each slice; False when it stopped early (dst then holds part of src).
    Contiguous uint8 arrays of one size that do not overlap. The slices' addresses are worked
    out here, not by slicing arrays: this runs on a handoff's critical path. `addresses`:
    (dst, src) first bytes' addresses when the caller has them (numpy takes ~1 us warm, ~10
    cold, to say); dst and src still keep the memory mapped while the copy runs."""
    if dst.nbytes != src.nbytes:
        raise ValueError(f"copy of {src.nbytes} bytes into {dst.nbytes}")
    lib = library() if total_bytes >= STREAM_MIN_BYTES else None
    if lib is None or not (dst.flags.c_contiguous and src.flags.c_contiguous):
        for at in range(0, dst.nbytes, slice_bytes):
            if stop():
                return False
            np.copyto(dst[at:at + slice_bytes], src[at:at + slice_bytes])
        return True
    d, s = addresses if addresses is not None else (dst.ctypes.data, src.ctypes.data)
    n = dst.nbytes
    for at in range(0, n, slice_bytes):
        if stop():
            return False
        lib.pdserve_stream_copy(d + at, s + at, min(slice_bytes, n - at))
    return True


@dataclass(frozen=True)
class Column:
    """Bytes `src_off` .. `src_off + width - 1` of every row of `src` (a C-contiguous 2-D uint8
    array: a run of pages as rows of (layer, K/V, token)), bound for `dst_off` in the
    destination's rows: one rank's KV heads in another tensor-parallel layout."""

    src: np.ndarray
    src_off: int
    dst_off: int
    width: int


def gather_rows(dst: np.ndarray, columns: Sequence[Column], total_bytes: int) -> None:
    """Fill `dst` (a C-contiguous 2-D uint8 array) column by column from `columns`, row by row
    (the destination written in order). Streamed when the handoff of `total_bytes` is big, as
    `copy` is."""
    rows, width = dst.shape
    for c in columns:
        if c.src.shape[0] != rows or c.dst_off + c.width > width or min(
                c.dst_off, c.src_off, c.width) < 0 or c.src_off + c.width > c.src.shape[1]:
            raise ValueError(f"columns {c.src_off}+{c.width} of {c.src.shape} into "
                             f"{c.dst_off}+{c.width} of {dst.shape}")
    lib = library()
    if lib is None or not all(a.flags.c_contiguous for a in (dst, *(c.src for c in columns))):
        for c in columns:
            np.copyto(dst[:, c.dst_off:c.dst_off + c.width],
                      c.src[:, c.src_off:c.src_off + c.width])
        return
    n = len(columns)
    vec = ctypes.c_size_t * n
    lib.pdserve_gather_rows(dst.ctypes.data, width, rows, n,
                            vec(*(c.src.ctypes.data + c.src_off for c in columns)),
                            vec(*(c.src.shape[1] for c in columns)),
                            vec(*(c.dst_off for c in columns)), vec(*(c.width for c in columns)),
                            int(total_bytes >= STREAM_MIN_BYTES))


def main(argv: list[str] | None = None) -> int:
    """`python -m pdserve.common.fastcopy prebuild DIR`: the portable build, for images."""
    return prebuild_main("pdserve.common.fastcopy", "the portable build of the streaming KV "
                         "copy", lambda directory, cc: [prebuild(directory, cc)], argv)


if __name__ == "__main__":
    raise SystemExit(main())
