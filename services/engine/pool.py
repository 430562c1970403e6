"""The paged KV pool and its page allocator (the layout itself is `common/layout.py`).

A page holds K and V of `block_size` consecutive tokens for all layers, contiguous:
`[num_layers, 2, block_size, num_kv_heads, head_dim]`. The pool is one tensor of `num_pages`
pages in memory the host's kvtransfer agent can map without a copy: on CPU a nameless
shared-memory segment (memfd) whose descriptor the worker hands to its agent, where page i
starts at byte `i * page_bytes`. A GPU pool is plain device memory; the agents do not move GPU
pools yet.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import torch
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.shm import SharedSegment

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}



class OutOfPages(RuntimeError):
    """Raised when an allocation needs more free pages than the pool has."""


class PageAllocator:
    """Hands out page ids to owners (a sequence id or a reservation ticket).

    Ownership is explicit: pages are freed per owner and return to the free list exactly
    once, so after any mix of finished, aborted and failed requests `num_free` is back at
    `num_pages`.
    """

    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be > 0, got {num_pages}")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._owned: dict[Hashable, list[int]] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: Hashable, n: int) -> list[int]:
        """Give `owner` n more pages (appended to what it holds); returns the new ids."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} of {self.num_pages} free")
        pages = [self._free.popleft() for _ in range(n)]
        self._owned.setdefault(owner, []).extend(pages)
        return pages

    def pages_of(self, owner: Hashable) -> list[int]:
        return list(self._owned.get(owner, ()))

    def num_pages_of(self, owner: Hashable) -> int:
        return len(self._owned.get(owner, ()))

    def owners(self) -> list[Hashable]:
        return list(self._owned)

    def owns(self, owner: Hashable) -> bool:
        return owner in self._owned

    def transfer(self, owner: Hashable, new_owner: Hashable) -> None:
        """Hand every page of `owner` to `new_owner` (a reservation becoming a sequence)."""
        if new_owner in self._owned:
            raise ValueError(f"{new_owner!r} already owns pages")
        self._owned[new_owner] = self._owned.pop(owner)

    def free(self, owner: Hashable) -> int:
        """Return every page of `owner` to the free list; a second call frees nothing."""
        pages = self._owned.pop(owner, [])
        self._free.extend(pages)
        return len(pages)


class KVPool:
    """`num_pages` pages of one layout in host-shareable memory; `tensor[page]` is one page."""

    def __init__(self, fingerprint: LayoutFingerprint, num_pages: int, device: str = "cpu",
                 *, attach_fd: int | None = None):
        self.fingerprint = fingerprint
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.page_bytes = fingerprint.page_bytes
        dtype = DTYPES[fingerprint.dtype]
        shape = (num_pages, *fingerprint.page_shape)
        self.segment: SharedSegment | None = None
        if self.device.type == "cpu":
            size = num_pages * self.page_bytes
            self.segment = (SharedSegment.from_fd(attach_fd, size) if attach_fd is not None
                            else SharedSegment.create(size, tag="kv"))
            self.tensor = torch.frombuffer(self.segment.buffer, dtype=dtype).view(shape)
        elif self.device.type == "cuda":
            if attach_fd is not None:
                raise ValueError("attaching a shared-memory descriptor is for CPU pools only")
            self.tensor = torch.zeros(shape, dtype=dtype, device=self.device)
        else:
            raise ValueError(f"unsupported device {device!r} (cpu or cuda)")

    @property
    def fd(self) -> int:
        """The descriptor of the pool's segment (-1 for a GPU pool): what the agent maps."""
        return self.segment.fd if self.segment else -1

    def close(self) -> None:
        self.tensor = None  # type: ignore[assignment]
        if self.segment is not None:
            self.segment.close()
            self.segment = None
