"""Building pdserve's small C libraries with the system compiler, and where they are cached.

Each library is built from plain C files under a `csrc/` folder into a shared object on first
use and cached under `$PDSERVE_CACHE_DIR/kernels` (the folder images fill ahead of time for
machines without a compiler), then loaded with ctypes by its own module (engine/kernels.py:
the attention kernel; common/fastcopy.py: the KV copy).
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pdserve.common.models import cache_dir


def kernels_dir() -> Path:
    """Where built libraries are cached, and where images put their prebuilt ones."""
    return cache_dir() / "kernels"


def compiler() -> str | None:
    """The C compiler to build with (`$CC`, else cc or gcc on PATH), None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@functools.cache
def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ("" where there is none); read once per process (each
    attention layer asks whether its prompts take the prefill kernel)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


Unit = Path | tuple[Path, Sequence[str]]  # a source, or a source and flags of its own


def compile_objects(compiler: str, units: Sequence[tuple[Path, Sequence[str]]],
                    out_dir: Path) -> list[Path]:
    """Compile each (source, flags) into an object file in `out_dir`, as many at once as this
    process may use cores (a build's few large units are most of its time); the objects in
    the units' order. CalledProcessError of the first unit that fails."""
    objects = [out_dir / f"{i}-{source.stem}.o" for i, (source, _) in enumerate(units)]

    def one(i: int) -> None:
        source, flags = units[i]
        subprocess.run([compiler, "-c", *flags, str(source), "-o", str(objects[i])],
                       check=True, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max(1, min(len(units), len(os.sched_getaffinity(0))))) as pool:
        list(pool.map(one, range(len(units))))  # re-raises the first failure
    return objects


def build_shared(compiler: str, source: Path | Sequence[Unit], target: Path,
                 flags: Sequence[str], libs: Sequence[str] = ()) -> None:
    """Compile `source` (one C file, or several units: a file given as (path, flags) gets those
    flags too, so one file can be built as several objects) into the shared object `target`,
    each unit its own object, compiled side by side; atomically: a concurrent build of the same
    target by another process is harmless."""
    given = [source] if isinstance(source, Path) else list(source)
    units = [(u, ()) if isinstance(u, Path) else u for u in given]
    compile_flags = [f for f in flags if f != "-shared"]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as tmp:
        objects = compile_objects(compiler, [(src, [*compile_flags, *extra])
                                             for src, extra in units], Path(tmp))
        built = Path(tmp) / target.name
        subprocess.run([compiler, *flags, *map(str, objects), "-o", str(built), *libs],
                       check=True, capture_output=True, text=True, timeout=120)
        os.chmod(built, 0o755)  # other users (an image's) must load it
        os.replace(built, target)


def prebuild_main(prog: str, what: str, prebuild: Callable[[Path, str], Sequence[Path]],
                  argv: list[str] | None = None) -> int:
    """`python -m PROG prebuild DIR`: the portable builds of a library, for images without a
    compiler (DIR/kernels under a PDSERVE_CACHE_DIR is where services look); prints them."""
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m {prog}")
    commands = parser.add_subparsers(dest="command", required=True)
    cmd = commands.add_parser("prebuild", help=f"{what} into DIR (DIR/kernels under a "
                                               "PDSERVE_CACHE_DIR is where services look)")
    cmd.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    for path in prebuild(args.directory, compiler() or "cc"):
        print(path)
    return 0
