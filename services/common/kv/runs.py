"""Page-run arithmetic: (src page, dst page) pairs -> maximal contiguous runs -> byte ranges.

A handoff copies page `src[i]` of the source pool to page `dst[i]` of the destination pool.
Pages that are consecutive on both sides move as one run, so a transport sends a few large
buffers instead of one message per page. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PageRun:
    """`num_pages` pages from `src_start` (source pool) to `dst_start` (destination pool)."""

    src_start: int
    dst_start: int
    num_pages: int

    @property
    def src_stop(self) -> int:
        return self.src_start + self.num_pages

    @property
    def dst_stop(self) -> int:
        return self.dst_start + self.num_pages


def check_page_ids(page_ids: Sequence[int], num_pages: int, what: str) -> None:
    """Raise ValueError naming `what` unless every id is in [0, num_pages) and unique."""
    if not page_ids:
        return
    if _ascending_run(page_ids):  # the common case, checked in C (the loop: ~0.1 ms a handoff)
        if 0 <= page_ids[0] and page_ids[-1] < num_pages:
            return
    elif 0 <= min(page_ids) and max(page_ids) < num_pages and len(set(page_ids)) == len(
            page_ids):
        return
    seen: set[int] = set()
    for page in page_ids:
        if not 0 <= page < num_pages:
            raise ValueError(f"{what}: page {page} is outside the pool (0..{num_pages - 1})")
        if page in seen:
            raise ValueError(f"{what}: page {page} appears twice")
        seen.add(page)


def coalesce(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    """Maximal runs covering every (src, dst) pair once, ordered by source page.

    Raises ValueError when the lists differ in length or either repeats a page.
    """
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    if src_pages and _ascending_run(src_pages) and _ascending_run(dst_pages):
        return [PageRun(src_pages[0], dst_pages[0], len(src_pages))]  # the common case, in C
    for pages, side in ((src_pages, "source"), (dst_pages, "destination")):
        if len(set(pages)) != len(pages):
            raise ValueError(f"{side} page ids repeat a page")
    runs: list[PageRun] = []
    start_src = start_dst = length = 0
    for src, dst in sorted(zip(src_pages, dst_pages)):
        if length and src == start_src + length and dst == start_dst + length:
            length += 1
            continue
        if length:
            runs.append(PageRun(start_src, start_dst, length))
        start_src, start_dst, length = src, dst, 1
    if length:
        runs.append(PageRun(start_src, start_dst, length))
    return runs


def _ascending_run(pages: Sequence[int]) -> bool:
    """`pages` is first, first + 1, ... (no page twice, by construction)."""
    first, n = pages[0], len(pages)
    if pages[-1] - first != n - 1:
        return False
    if isinstance(pages, list):  # compared in C, without copying `pages` first
        return pages == list(range(first, first + n))
    if isinstance(pages, tuple):
        return pages == tuple(range(first, first + n))
    return list(pages) == list(range(first, first + n))


def spans_of(page_ids: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """`page_ids` as (start, num_pages) spans of consecutive ids, in their order."""
    if not page_ids:
        return ()
    if _ascending_run(page_ids):
        return ((page_ids[0], len(page_ids)),)
    spans: list[tuple[int, int]] = []
    start, length = page_ids[0], 1
    for page in page_ids[1:]:
        if page == start + length:
            length += 1
            continue
        spans.append((start, length))
        start, length = page, 1
    spans.append((start, length))
    return tuple(spans)


def check_spans(spans: Sequence[tuple[int, int]], num_pages: int, what: str) -> None:
    """`check_page_ids` of the pages of (start, num_pages) spans, without listing them (a
    handoff's runs are a few spans of up to thousands of pages): ValueError naming `what`
    unless every span is non-empty, inside [0, num_pages), and no two overlap."""
    for start, n in spans:
        if n <= 0:
            raise ValueError(f"a run of {n} pages at page {start}")
        if start < 0 or start + n > num_pages:
            page = start if start < 0 else max(start, num_pages)
            raise ValueError(f"{what}: page {page} is outside the pool (0..{num_pages - 1})")
    ordered = sorted(spans)
    for (a, n), (b, _) in zip(ordered, ordered[1:]):
        if b < a + n:
            raise ValueError(f"{what}: page {b} appears twice")


def expand(spans: Sequence[tuple[int, int]]) -> list[int]:
    """Page ids of (start, num_pages) spans, in order."""
    pages: list[int] = []
    for start, num_pages in spans:
        if num_pages <= 0:
            raise ValueError(f"a run of {num_pages} pages at page {start}")
        pages.extend(range(start, start + num_pages))
    return pages
