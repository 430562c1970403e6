"""Building pdserve's small C libraries with the system compiler, and where they are cached.

Each library is one plain C file under a `csrc/` folder, built into a shared object on first
use and cached under `$PDSERVE_CACHE_DIR/kernels` (the folder images fill ahead of time for
machines without a compiler), then loaded with ctypes by its own module (engine/kernels.py:
the attention kernel; common/fastcopy.py: the KV copy).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from pdserve.common.models import cache_dir


def kernels_dir() -> Path:
    """Where built libraries are cached, and where images put their prebuilt ones."""
    return cache_dir() / "kernels"


def compiler() -> str | None:
    """The C compiler to build with (`$CC`, else cc or gcc on PATH), None when there is none."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cpu_flags() -> str:
    """The `flags` line of /proc/cpuinfo ("" where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


def build_shared(compiler: str, source: Path | Sequence[Path], target: Path,
                 flags: Sequence[str], libs: Sequence[str] = ()) -> None:
    """Compile `source` (one C file or several) into the shared object `target`, atomically:
    a concurrent build of the same target by another process is harmless."""
    sources = [source] if isinstance(source, Path) else list(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, *map(str, sources), "-o", tmp, *libs], check=True,
                       capture_output=True, text=True, timeout=120)
        os.chmod(tmp, 0o755)  # mkstemp makes it 0600: other users (an image's) must load it
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
