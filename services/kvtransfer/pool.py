"""KV pools as the agent sees them: a layout fingerprint and a mapped shared-memory segment.

The agent knows byte layouts only, never the engine's classes: a pool is `num_pages` pages of
`page_bytes` bytes, page i at byte `i * page_bytes` of the segment the worker created.
"""

from __future__ import annotations

import logging

import numpy as np
from pdserve.common.layout import DTYPE_BYTES, LayoutFingerprint
from pdserve.common.shm import SharedSegment
from pdserve.kvtransfer.errors import BadRequest, LayoutMismatch

log = logging.getLogger("pdserve.kvtransfer")


def expect_same(mine: LayoutFingerprint, theirs: LayoutFingerprint, mine_name: str,
                theirs_name: str) -> None:
    """Raise LayoutMismatch naming each differing field as `field: mine != theirs`."""
    diffs = mine.mismatches(theirs)
    if diffs:
        raise LayoutMismatch(f"layout mismatch between {mine_name} and {theirs_name} pool: "
                             + "; ".join(diffs))


def check_page_bytes(fp: LayoutFingerprint, page_bytes: int) -> None:
    """Raise BadRequest when `page_bytes` contradicts the layout."""
    if page_bytes != fp.page_bytes:
        raise BadRequest(f"page_bytes {page_bytes} does not match the fingerprint: "
                         f"{fp.num_layers} layers x 2 x {fp.block_size} tokens x "
                         f"{fp.num_kv_heads} heads x {fp.head_dim} x {DTYPE_BYTES[fp.dtype]} "
                         f"bytes ({fp.dtype}) = {fp.page_bytes}")


class Pool:
    """A local worker's pool, attached by shared-memory name (the worker owns the segment)."""

    def __init__(self, pool_id: str, worker_id: str, shm_name: str, num_pages: int,
                 page_bytes: int, fingerprint: LayoutFingerprint):
        if num_pages <= 0 or page_bytes <= 0:
            raise BadRequest(f"num_pages and page_bytes must be > 0, got {num_pages} and "
                             f"{page_bytes}")
        check_page_bytes(fingerprint, page_bytes)
        try:
            self._segment = SharedSegment.attach(shm_name, num_pages * page_bytes)
        except (OSError, ValueError) as exc:
            raise BadRequest(f"cannot map pool {shm_name!r}: {exc}") from None
        self.pool_id = pool_id
        self.worker_id = worker_id
        self.shm_name = shm_name
        self.num_pages = num_pages
        self.page_bytes = page_bytes
        self.fingerprint = fingerprint
        self._data: np.ndarray | None = np.frombuffer(self._segment.buffer, dtype=np.uint8)

    def pages(self, start: int, num_pages: int) -> np.ndarray:
        """A writable uint8 view (no copy) of `num_pages` pages from page `start`."""
        if self._data is None:
            raise BadRequest(f"pool {self.pool_id} is closed")
        if start < 0 or num_pages <= 0 or start + num_pages > self.num_pages:
            raise BadRequest(f"pages {start}..{start + num_pages - 1} are outside pool "
                             f"{self.pool_id} (0..{self.num_pages - 1})")
        return self._data[start * self.page_bytes:(start + num_pages) * self.page_bytes]

    def close(self) -> None:
        """Unmap (the worker keeps the segment). Views still held elsewhere keep it mapped."""
        self._data = None
        try:
            self._segment.close()
        except BufferError:
            log.warning("pool %s still has views in use; it stays mapped until they go",
                        self.pool_id)
