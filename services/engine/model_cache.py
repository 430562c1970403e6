"""Model directories made on this machine and kept under the cache directory: created once,
never seen half-written, safe when several processes ask for the same model at once.

    ensure(target, files, build)   # the complete `target`, building it first when missing

One process builds under an exclusive file lock while the others wait; the files are written
into a temporary directory beside `target` and renamed into place. A directory that lost one
of its files, and the temporary directories of crashed builds, are removed and rebuilt.
Standard library only.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

Build = Callable[[Path], None]  # writes every file of the model into the given directory


def is_complete(path: Path, files: Iterable[str]) -> bool:
    return all((path / name).is_file() for name in files)


def ensure(target: Path, files: Iterable[str], build: Build) -> Path:
    """Return `target` once it holds every one of `files`, calling `build` when it does not."""
    files = tuple(files)
    if is_complete(target, files):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.parent / f".{target.name}.lock"):
        if is_complete(target, files):
            return target
        remove_leftovers(target)
        return create(target, build)


def create(out_dir: Path, build: Build) -> Path:
    """Run `build` into a temporary directory beside `out_dir` (which must not exist or be
    empty), then rename it into place; the files are made readable by everyone."""
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        build(tmp)
        for path in tmp.iterdir():
            path.chmod(0o644)  # safetensors writes 0600; a shared cache must be readable
        tmp.chmod(0o755)
        os.rename(tmp, out_dir)  # replaces an empty out_dir
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def remove_leftovers(target: Path) -> None:
    """Under the lock: drop temp dirs of crashed builds, and a target that lost files."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        shutil.rmtree(tmp, ignore_errors=True)
    if target.exists():
        shutil.rmtree(target)


@contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive fcntl lock on `lock_path` (released when the process dies)."""
    with lock_path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
