"""Property tests of the page-run arithmetic over seeded random handoffs."""

from __future__ import annotations

import random

import pytest
from pdserve.common.kv.runs import (
    PageRun,
    check_page_ids,
    check_spans,
    coalesce,
    expand,
    spans_of,
)

pytestmark = pytest.mark.unit

CASES = 400


def random_handoff(rng: random.Random) -> tuple[list[int], list[int], int]:
    """Source and destination page lists built from contiguous stretches and shuffled singles,
    the way an allocator with some fragmentation hands pages out."""
    pool_pages = rng.randint(1, 300)
    n = rng.randint(0, pool_pages)
    src = rng.sample(range(pool_pages), n)
    dst_free = list(range(pool_pages))
    if rng.random() < 0.5:
        src.sort()
    if rng.random() < 0.5:
        rng.shuffle(dst_free)
        dst = dst_free[:n]
    else:
        start = rng.randint(0, pool_pages - n)
        dst = list(range(start, start + n))
    return src, dst, pool_pages


@pytest.mark.parametrize("seed", range(4))
def test_every_pair_is_covered_exactly_once(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(CASES):
        src, dst, _pool = random_handoff(rng)
        runs = coalesce(src, dst)
        pairs = [(r.src_start + k, r.dst_start + k) for r in runs for k in range(r.num_pages)]
        assert sorted(pairs) == sorted(zip(src, dst))
        assert len(pairs) == len(set(pairs))


@pytest.mark.parametrize("seed", range(4))
def test_runs_are_maximal_and_ordered(seed: int) -> None:
    rng = random.Random(100 + seed)
    for _ in range(CASES):
        src, dst, _pool = random_handoff(rng)
        runs = coalesce(src, dst)
        assert all(r.num_pages > 0 for r in runs)
        assert [r.src_start for r in runs] == sorted(r.src_start for r in runs)
        ends = {(r.src_stop, r.dst_stop) for r in runs}
        # No run could be appended to another: maximal.
        assert not any((r.src_start, r.dst_start) in ends for r in runs)


def test_contiguous_handoff_is_one_run() -> None:
    assert coalesce(list(range(10, 20)), list(range(3, 13))) == [PageRun(10, 3, 10)]


def test_pairs_out_of_order_still_coalesce() -> None:
    assert coalesce([5, 4, 6], [9, 8, 10]) == [PageRun(4, 8, 3)]
    assert coalesce([1, 2, 3], [7, 5, 6]) == [PageRun(1, 7, 1), PageRun(2, 5, 2)]


def test_empty_and_invalid_inputs() -> None:
    assert coalesce([], []) == []
    with pytest.raises(ValueError, match="source pages"):
        coalesce([1, 2], [1])
    with pytest.raises(ValueError, match="destination page ids repeat"):
        coalesce([1, 2], [3, 3])


def test_expand_and_check_page_ids() -> None:
    assert expand([(4, 2), (0, 1)]) == [4, 5, 0]
    with pytest.raises(ValueError):
        expand([(3, 0)])
    check_page_ids([0, 5, 9], 10, "x")
    with pytest.raises(ValueError, match="outside the pool"):
        check_page_ids([10], 10, "page_ids")
    with pytest.raises(ValueError, match="twice"):
        check_page_ids([1, 1], 10, "page_ids")


def test_ascending_runs_take_the_fast_path_and_keep_every_check() -> None:
    """Contiguous ascending pages (the common handoff) skip the per-page loops; a bad id in
    such a run or next to one is still refused with the same message."""
    check_page_ids(list(range(3, 10)), 10, "x")
    with pytest.raises(ValueError, match="page 10 is outside the pool"):
        check_page_ids(list(range(4, 11)), 10, "x")
    with pytest.raises(ValueError, match="page -1 is outside the pool"):
        check_page_ids(list(range(-1, 3)), 10, "x")
    with pytest.raises(ValueError, match="page 4 appears twice"):
        check_page_ids([3, 4, 4, 5], 10, "x")
    assert coalesce(list(range(3, 7)), [9, 10, 11, 13]) == [PageRun(3, 9, 3), PageRun(6, 13, 1)]
    with pytest.raises(ValueError, match="destination page ids repeat"):
        coalesce([1, 2, 3], [4, 4, 5])


def test_spans_are_checked_as_their_pages_are() -> None:
    """`check_spans` refuses exactly what `check_page_ids` refuses for the same pages, with
    the same message shape, over seeded random span lists (some overlapping, some outside)."""
    rng = random.Random(7)
    for _ in range(CASES):
        num_pages = rng.randint(1, 64)
        spans = [(rng.randint(-2, num_pages), rng.randint(1, 8)) for _ in range(rng.randint(1, 4))]
        pages = expand(spans)
        try:
            check_page_ids(pages, num_pages, "x")
            expected = ""
        except ValueError as exc:
            expected = "outside" if "outside" in str(exc) else "twice"
        try:
            check_spans(spans, num_pages, "x")
            found = ""
        except ValueError as exc:
            assert str(exc).startswith("x: page ")
            found = "outside" if "outside" in str(exc) else "twice"
        assert bool(found) == bool(expected), (spans, num_pages)
        if expected == "outside":  # an overlap inside the pool is only found when in bounds
            assert found == "outside", (spans, num_pages)
    with pytest.raises(ValueError, match="a run of 0 pages at page 3"):
        check_spans([(3, 0)], 10, "x")
    with pytest.raises(ValueError, match="x: page 10 is outside the pool"):
        check_spans([(8, 3)], 10, "x")
    with pytest.raises(ValueError, match="x: page 5 appears twice"):
        check_spans([(2, 4), (5, 1)], 10, "x")


def test_spans_of_lists_consecutive_ids_in_their_order() -> None:
    assert spans_of([]) == ()
    assert spans_of(list(range(3, 9))) == ((3, 6),)
    assert spans_of((3, 4, 5)) == ((3, 3),)
    assert spans_of([7, 8, 2, 3, 4, 9]) == ((7, 2), (2, 3), (9, 1))
    rng = random.Random(3)
    for _ in range(CASES):
        src, _, _ = random_handoff(rng)
        assert expand(spans_of(src)) == src
