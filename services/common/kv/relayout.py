"""The same-host write that re-lays pages out between tensor-parallel splits as it copies them.

A prefill worker of TP size P keeps a prompt's KV in P pools, a decode worker of TP size D
wants it in D; every pool's page is rows of (layer, K/V, token), each row that pool's KV heads
side by side. So decode rank d's page is, row by row, a few columns from one or more prefill
ranks' pages (P > D: several sources side by side; P < D: part of one source's row). A
re-layout write names those columns (`columns` in the shm_write message): the receiving agent
(pdserve.kvtransfer.shm) maps each source pool (read-only, once per connection, like any
same-host sender's) and fills each reserved page row by row from them (fastcopy.gather_rows),
the one memory copy the plain same-host write makes, so a handoff between splits costs about
what one within a split does. The sender is a prefill worker's lane (pdserve.worker.samehost).

Checked before anything is written: the columns fill every destination row exactly (no gap,
no overlap), every source has as many rows per page as the destination, every column lies in
its source's row, every source run lies in every source pool. The ticket, epoch, layout and
pages are checked by the sink as for any write; a cancel stops the copy between slices.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from pdserve.common import fastcopy
from pdserve.common.fastcopy import Column
from pdserve.common.kv.errors import BadRequest


@dataclass(frozen=True)
class ColumnSpec:
    """One source pool's column of every row: bytes src_off..src_off+width-1 of its rows
    (`row_bytes` long) go to dst_off.. of the destination's rows."""

    pool: str  # the source pool's key on the connection
    num_pages: int
    page_bytes: int
    row_bytes: int
    src_off: int
    dst_off: int
    width: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_columns(message: dict[str, Any], dst_page_bytes: int) -> tuple[int, list[ColumnSpec]]:
    """The write's destination row size and its columns, checked to fill every destination row
    exactly from sources with as many rows per page. BadRequest names what is wrong."""
    try:
        row_bytes = int(message["row_bytes"])
        columns = [ColumnSpec(str(c["pool"]), int(c["num_pages"]), int(c["page_bytes"]),
                              int(c["row_bytes"]), int(c["src_off"]), int(c["dst_off"]),
                              int(c["width"])) for c in message["columns"]]
    except (KeyError, ValueError, TypeError) as exc:
        raise BadRequest(f"malformed re-layout write: {exc!r}") from None
    if row_bytes <= 0 or dst_page_bytes % row_bytes:
        raise BadRequest(f"re-layout rows of {row_bytes} bytes do not divide the destination's "
                         f"{dst_page_bytes}-byte pages")
    rows = dst_page_bytes // row_bytes
    at = 0
    for c in sorted(columns, key=lambda c: c.dst_off):
        if c.dst_off != at or c.width <= 0:
            raise BadRequest(f"re-layout columns do not fill the destination's {row_bytes}-byte "
                             f"rows: a column starts at byte {c.dst_off} where {at} was next")
        at += c.width
        if c.row_bytes <= 0 or c.page_bytes != rows * c.row_bytes:
            raise BadRequest(f"source pool {c.pool!r} has pages of {c.page_bytes} bytes in rows "
                             f"of {c.row_bytes}: not the destination's {rows} rows a page")
        if c.src_off < 0 or c.src_off + c.width > c.row_bytes:
            raise BadRequest(f"column {c.src_off}..{c.src_off + c.width - 1} is outside source "
                             f"pool {c.pool!r}'s {c.row_bytes}-byte rows")
    if at != row_bytes:
        raise BadRequest(f"re-layout columns fill {at} of the destination's {row_bytes}-byte rows")
    return row_bytes, columns


def copy_run(dst: np.ndarray, row_bytes: int, sources: list[np.ndarray],
             columns: list[ColumnSpec], start: int, total_bytes: int, slice_bytes: int,
             stop: Callable[[], bool]) -> bool:
    """One run into `dst` (its reserved pages, contiguous) from the source pools' bytes
    (`sources`, in column order) from page `start`, `slice_bytes` of destination at a time,
    asking `stop()` before each; False when it stopped."""
    rows = dst.size // row_bytes
    into = dst.reshape(rows, row_bytes)
    per_page = columns[0].page_bytes // columns[0].row_bytes
    froms = [src[start * c.page_bytes:start * c.page_bytes + rows // per_page * c.page_bytes]
             .reshape(rows, c.row_bytes) for src, c in zip(sources, columns)]
    step = max(1, slice_bytes // row_bytes)
    for at in range(0, rows, step):
        if stop():
            return False
        fastcopy.gather_rows(into[at:at + step],
                             [Column(f[at:at + step], c.src_off, c.dst_off, c.width)
                              for f, c in zip(froms, columns)], total_bytes)
    return True
