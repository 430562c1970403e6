"""The paged KV pool and its page allocator (the layout itself is `common/layout.py`).

A page holds K and V of `block_size` consecutive tokens for all layers, contiguous:
`[num_layers, 2, block_size, num_kv_heads, head_dim]`. The pool is one tensor of `num_pages`
pages in memory the host's kvtransfer agent can map without a copy: on CPU a nameless
shared-memory segment (memfd) whose descriptor the worker hands to its agent, where page i
starts at byte `i * page_bytes`. A GPU pool is plain device memory; the agents do not move GPU
pools yet.
"""

from __future__ import annotations

import torch
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.shm import SharedSegment
from pdserve.engine.allocator import OutOfPages, PageAllocator

__all__ = ["DTYPES", "KVPool", "OutOfPages", "PageAllocator"]

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
