"""KV pools as the agent sees them: a layout fingerprint and a mapped shared-memory segment.

The agent knows byte layouts only, never the engine's classes: a pool is `num_pages` pages of
`page_bytes` bytes, page i at byte `i * page_bytes` of the segment the worker created.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
from pdserve.common.shm import SharedSegment
from pdserve.kvtransfer.errors import BadRequest, LayoutMismatch

log = logging.getLogger("pdserve.kvtransfer")

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class Fingerprint:
    """Everything that decides whether two pools hold pages of the same shape and meaning."""

    model_id: str
    model_revision: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    tp_rank: int
    tp_size: int

    def mismatches(self, other: Fingerprint) -> list[str]:
        """`field: mine != theirs` for every field that differs (empty when compatible)."""
        return [f"{f.name}: {getattr(self, f.name)!r} != {getattr(other, f.name)!r}"
                for f in dataclasses.fields(self) if getattr(self, f.name) != getattr(other, f.name)]

    def expect_same(self, other: Fingerprint, mine: str, theirs: str) -> None:
        """Raise LayoutMismatch naming each differing field as `field: mine != theirs`."""
        if self == other:
            return
        diffs = self.mismatches(other)
        if diffs:
            raise LayoutMismatch(f"layout mismatch between {mine} and {theirs} pool: "
                                 + "; ".join(diffs))

    def check(self, page_bytes: int) -> None:
        """Raise BadRequest when fields are missing or `page_bytes` contradicts the layout."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size"):
            if getattr(self, name) <= 0:
                raise BadRequest(f"fingerprint.{name} must be > 0, got {getattr(self, name)}")
        if not self.dtype:
            raise BadRequest("fingerprint.dtype is empty")
        if not 0 <= self.tp_rank < self.tp_size:
            raise BadRequest(f"fingerprint.tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")
        itemsize = DTYPE_BYTES.get(self.dtype.removeprefix("torch."))
        if itemsize is not None:
            expected = (self.num_layers * 2 * self.block_size * self.num_kv_heads
                        * self.head_dim * itemsize)
            if page_bytes != expected:
                raise BadRequest(f"page_bytes {page_bytes} does not match the fingerprint: "
                                 f"{self.num_layers} layers x 2 x {self.block_size} tokens x "
                                 f"{self.num_kv_heads} heads x {self.head_dim} x {itemsize} "
                                 f"bytes ({self.dtype}) = {expected}")


class Pool:
    """A local worker's pool, attached by shared-memory name (the worker owns the segment)."""

    def __init__(self, pool_id: str, worker_id: str, shm_name: str, num_pages: int,
                 page_bytes: int, fingerprint: Fingerprint):
        if num_pages <= 0 or page_bytes <= 0:
            raise BadRequest(f"num_pages and page_bytes must be > 0, got {num_pages} and "
                             f"{page_bytes}")
        fingerprint.check(page_bytes)
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
