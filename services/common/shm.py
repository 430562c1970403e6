"""Shared memory a KV pool lives in, and that another process on the host maps without a copy.

A pool is a **nameless** segment (`memfd_create`): nothing appears in /dev/shm, and its memory
goes back to the system as soon as the last process holding it (the worker that made it, the
agent it handed the descriptor to over a Unix socket) exits or unmaps it, whatever kills them.
Other processes get it only as a file descriptor (`from_fd`); `readonly_fd` opens a read-only
descriptor of it for a peer that may only read (an agent on the same host copying pages out).

Named POSIX segments (/dev/shm/pdserve-*) remain for processes that attach by name (`attach`,
the `shm_name` of RegisterPool): `create_named` makes one (tests of that path), and
`sweep_stale` removes those whose creator died. Only the standard library is used, so every
layer (engine, kvtransfer) can import this.
"""

from __future__ import annotations

import mmap
import os
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "pdserve-"


class SharedSegment:
    """A mapped shared-memory segment; `buffer` is a memoryview over all of it (writable
    unless mapped read-only). `fd` stays open while the segment is (memfd segments)."""

    def __init__(self, fd: int, size: int, *, name: str = "", owner: bool = False,
                 writable: bool = True, populate: bool = False):
        try:
            actual = os.fstat(fd).st_size
            if actual < size:
                raise ValueError(f"shared-memory segment {name or 'fd'} has {actual} bytes, "
                                 f"expected {size}")
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
            self._mmap: mmap.mmap | None = mmap.mmap(fd, size, flags, prot)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.name = name
        self.owner = owner
        self.size = size
        self.writable = writable
        self.buffer = memoryview(self._mmap)

    # ---- nameless segments ---------------------------------------------------------------
    @classmethod
    def create(cls, size: int, tag: str = "kv") -> SharedSegment:
        """A new nameless segment of `size` bytes (zero-filled, pages allocated on first use)."""
        fd = os.memfd_create(f"{PREFIX}{tag}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return cls(fd, size, owner=True)

    @classmethod
    def from_fd(cls, fd: int, size: int, *, writable: bool = True,
                populate: bool = False) -> SharedSegment:
        """Map a segment received as a descriptor (this object owns `fd` from now on).
        `populate` faults every page in at once, so no handoff pays for it later."""
        return cls(fd, size, writable=writable, populate=populate)

    def readonly_fd(self) -> int:
        """A new read-only descriptor of this segment (the caller closes it)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    # ---- named segments (attach by name) -------------------------------------------------
    @classmethod
    def create_named(cls, size: int, tag: str = "pool") -> SharedSegment:
        """A named segment /dev/shm/pdserve-TAG-PID-RANDOM; unlinked by `close`."""
        sweep_stale()
        name = f"{PREFIX}{tag}-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(SHM_DIR / name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, size)
            return cls(fd, size, name=name, owner=True)
        except BaseException:
            (SHM_DIR / name).unlink(missing_ok=True)
            raise

    @classmethod
    def attach(cls, name: str, size: int) -> SharedSegment:
        if not name.startswith(PREFIX) or "/" in name:
            raise ValueError(f"shared-memory name {name!r} must start with {PREFIX!r}")
        try:
            fd = os.open(SHM_DIR / name, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(
                f"no shared-memory segment {name!r} (is its owner running?)") from None
        return cls(fd, size, name=name)

    def close(self) -> None:
        """Unlink a named segment (owner) first, then unmap and close. Safe to call twice.

        A tensor or view still exported from `buffer` keeps the mapping alive until it goes;
        the name and the descriptor are gone at once either way.
        """
        if self.owner and self.name:
            (SHM_DIR / self.name).unlink(missing_ok=True)
        self.owner = False
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if self._mmap is None:
            return
        try:
            self.buffer.release()
            self._mmap.close()
        except BufferError:
            pass
        self._mmap = None

    def __enter__(self) -> SharedSegment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def leftover_segments(pid: int | None = None) -> list[str]:
    """Names of pdserve segments in /dev/shm (for one creating pid, or all)."""
    names = sorted(p.name for p in SHM_DIR.glob(f"{PREFIX}*"))
    if pid is not None:
        names = [n for n in names if f"-{pid}-" in n]
    return names


def memfd_mappings(pid: int) -> int:
    """How many mappings of pdserve's nameless segments process `pid` holds (0 when gone)."""
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return 0
    return sum(1 for line in maps.splitlines() if f"/memfd:{PREFIX}" in line)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale() -> list[str]:
    """Unlink named segments whose creating process is gone (killed before it could clean up)."""
    removed = []
    for path in SHM_DIR.glob(f"{PREFIX}*"):
        parts = path.name.split("-")
        if len(parts) >= 4 and parts[-2].isdigit() and not _pid_alive(int(parts[-2])):
            path.unlink(missing_ok=True)
            removed.append(path.name)
    return removed
