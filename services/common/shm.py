"""Named POSIX shared-memory segments that another process on the host can map without a copy.

A KV pool lives in one segment (/dev/shm/<name>). The creating process owns it and unlinks it
when closed; other processes (the host's kvtransfer agent, tests) attach by name. Only the
standard library is used, so every layer (engine, kvtransfer) can import this.
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-"


class SharedSegment:
    """A mapped shared-memory segment; `buffer` is a writable memoryview over all of it."""

    def __init__(self, name: str, size: int, *, create: bool):
        if not name.startswith(PREFIX):
            raise ValueError(f"shared-memory name {name!r} must start with {PREFIX!r}")
        self.name = name
        self.owner = create
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared-memory segment {name!r} (is its owner running?)") from None
        try:
            if create:
                os.ftruncate(fd, size)
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"shared-memory segment {name!r} has {actual} bytes, expected {size}")
            self.size = size
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            if create:
                path.unlink(missing_ok=True)
            raise
        os.close(fd)
        self.buffer = memoryview(self._mmap)

    @classmethod
    def create(cls, size: int, tag: str = "pool") -> SharedSegment:
        sweep_stale()
        return cls(f"{PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}", size, create=True)

    @classmethod
    def attach(cls, name: str, size: int) -> SharedSegment:
        return cls(name, size, create=False)

    def close(self) -> None:
        """Unlink the name (owner) first, then unmap. Safe to call twice.

        A tensor or view still exported from `buffer` keeps the mapping alive until it goes;
        the name is gone at once either way, so nothing is left in /dev/shm.
        """
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)
            self.owner = False
        if self._mmap is None:
            return
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            pass
        self._mmap = None  # type: ignore[assignment]  # closed: nothing maps it any more

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftover_segments(pid: int | None = None) -> list[str]:
    """Names of pdserve segments still in /dev/shm (for one creating pid, or all)."""
    names = sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}*"))
    if pid is not None:
        names = [n for n in names if f"-{pid}-" in n]
    return names


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink segments whose creating process is gone (killed before it could clean up)."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        parts = path.name.split("-")
        if len(parts) >= 4 and parts[-2].isdigit() and not _pid_alive(int(parts[-2])):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
