"""KV pools as the agent sees them: a layout fingerprint and a mapped shared-memory segment.

The agent knows byte layouts only, never the engine's classes: a pool is `num_pages` pages of
`page_bytes` bytes, page i at byte `i * page_bytes` of the segment the worker created. A
worker hands its segment over as a descriptor on the agent's local socket (nameless; the pool
lives as long as that connection, see local.py); a pool registered over gRPC by `shm_name` is
attached by name.
"""

from __future__ import annotations

import os

import numpy as np
from pdserve.common.kv.errors import BadRequest
from pdserve.common.layout import DTYPE_BYTES, LayoutFingerprint
from pdserve.common.shm import SharedSegment
from pdserve.kvtransfer.native import NativeReceiver


def check_page_bytes(fp: LayoutFingerprint, page_bytes: int) -> None:
    """Raise BadRequest when `page_bytes` contradicts the layout."""
    if page_bytes != fp.page_bytes:
        raise BadRequest(f"page_bytes {page_bytes} does not match the fingerprint: "
                         f"{fp.num_layers} layers x 2 x {fp.block_size} tokens x "
                         f"{fp.num_kv_heads} heads x {fp.head_dim} x {DTYPE_BYTES[fp.dtype]} "
                         f"bytes ({fp.dtype}) = {fp.page_bytes}")


def check_shape(num_pages: int, page_bytes: int) -> None:
    if num_pages <= 0 or page_bytes <= 0:
        raise BadRequest(f"num_pages and page_bytes must be > 0, got {num_pages} and "
                         f"{page_bytes}")


def map_by_name(shm_name: str, num_pages: int, page_bytes: int) -> SharedSegment:
    check_shape(num_pages, page_bytes)
    try:
        return SharedSegment.attach(shm_name, num_pages * page_bytes)
    except (OSError, ValueError) as exc:
        raise BadRequest(f"cannot map pool {shm_name!r}: {exc}") from None


def map_fd(fd: int, num_pages: int, page_bytes: int, *, writable: bool = True,
           populate: bool = False) -> SharedSegment:
    """Map a received descriptor (closed here when it cannot be mapped)."""
    try:
        check_shape(num_pages, page_bytes)
    except BadRequest:
        os.close(fd)
        raise
    try:
        return SharedSegment.from_fd(fd, num_pages * page_bytes, writable=writable,
                                     populate=populate)
    except (OSError, ValueError) as exc:
        raise BadRequest(f"cannot map the pool's segment: {exc}") from None


class Pool:
    """A local worker's pool: its layout and its mapped segment (which this object closes)."""

    def __init__(self, pool_id: str, worker_id: str, segment: SharedSegment, num_pages: int,
                 page_bytes: int, fingerprint: LayoutFingerprint,
                 native_writes: NativeReceiver | None = None):
        check_shape(num_pages, page_bytes)
        check_page_bytes(fingerprint, page_bytes)
        self._segment = segment
        self.pool_id = pool_id
        self.worker_id = worker_id
        self.shm_name = segment.name  # "" for a nameless segment
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.fingerprint = fingerprint
        self._data: np.ndarray | None = np.frombuffer(segment.buffer, dtype=np.uint8)
        self.address = self._data.ctypes.data  # of page 0, while the pool is open
        self._readonly_fd = -1
        # registered for native writes while mapped (its handle, generation); (-1, 0): not
        self._native = native_writes
        self.native_handle = native_writes.open_pool(self.address, num_pages * page_bytes) \
            if native_writes is not None else (-1, 0)

    def pages(self, start: int, num_pages: int) -> np.ndarray:
        """A writable uint8 view (no copy) of `num_pages` pages from page `start`."""
        if self._data is None:
            raise BadRequest(f"pool {self.pool_id} is closed")
        if start < 0 or num_pages <= 0 or start + num_pages > self.num_pages:
            raise BadRequest(f"pages {start}..{start + num_pages - 1} are outside pool "
                             f"{self.pool_id} (0..{self.num_pages - 1})")
        return self._data[start * self.page_bytes:(start + num_pages) * self.page_bytes]

    def readonly_fd(self) -> int:
        """A read-only descriptor of the segment, for a same-host peer to copy from (kept
        here, closed with the pool)."""
        if self._readonly_fd < 0 and self._segment.fd >= 0:
            self._readonly_fd = self._segment.readonly_fd()
        return self._readonly_fd

    def close(self) -> None:
        """Unmap (the worker keeps the segment). Views still held elsewhere keep it mapped."""
        self._data = None
        if self._native is not None:  # waits for native writes into it, refuses later ones
            self._native.close_pool(self.native_handle[0])
        if self._readonly_fd >= 0:
            os.close(self._readonly_fd)
            self._readonly_fd = -1
        self._segment.close()  # views still held (a write in flight) keep the mapping alive
