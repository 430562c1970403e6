"""The same-host write that re-lays pages out between tensor-parallel splits: the columns a
receiving agent accepts, and the copy that fills each destination row from them."""

from __future__ import annotations

import numpy as np
import pytest
from pdserve.common import fastcopy
from pdserve.common.fastcopy import Column
from pdserve.common.kv.errors import BadRequest
from pdserve.common.kv.relayout import ColumnSpec, copy_run, parse_columns

ROWS = 64  # rows of (layer, K/V, token) a page
HEAD = 128  # bytes of one KV head's row


def _message(row_bytes: int, *columns: ColumnSpec) -> dict[str, object]:
    return {"row_bytes": row_bytes, "columns": [c.to_json() for c in columns]}


def _col(pool: str, heads: int, src_off: int, dst_off: int, width: int) -> ColumnSpec:
    return ColumnSpec(pool, 8, ROWS * heads * HEAD, heads * HEAD, src_off, dst_off, width)


def test_columns_that_fill_every_row_are_accepted_in_any_order():
    row_bytes, cols = parse_columns(_message(2 * HEAD, _col("b", 1, 0, HEAD, HEAD),
                                             _col("a", 1, 0, 0, HEAD)), ROWS * 2 * HEAD)
    assert row_bytes == 2 * HEAD and [c.pool for c in cols] == ["b", "a"]


@pytest.mark.parametrize("message,error", [
    (_message(2 * HEAD, _col("a", 1, 0, 0, HEAD)), "fill 128 of the destination's 256"),
    (_message(2 * HEAD, _col("a", 1, 0, 0, HEAD), _col("b", 1, 0, 64, HEAD)),
     "a column starts at byte 64 where 128 was next"),
    (_message(2 * HEAD, _col("a", 1, 0, 0, HEAD), _col("b", 2, 192, HEAD, HEAD)),
     "outside source pool 'b'"),
    (_message(2 * HEAD, _col("a", 1, 0, 0, HEAD),
              ColumnSpec("b", 8, 3 * ROWS * HEAD, HEAD, 0, HEAD, HEAD)),
     "not the destination's 64 rows a page"),
    (_message(3 * HEAD, _col("a", 3, 0, 0, 3 * HEAD)), "do not divide"),
    ({"row_bytes": 256, "columns": [{"pool": "a"}]}, "malformed re-layout write"),
])
def test_columns_that_do_not_fill_the_rows_exactly_are_refused_naming_why(message, error):
    with pytest.raises(BadRequest, match=error):
        parse_columns(message, ROWS * 2 * HEAD)


def _pools(n: int, heads: int, pages: int = 8) -> list[np.ndarray]:
    rng = np.random.default_rng(n * 10 + heads)
    return [rng.integers(0, 255, pages * ROWS * heads * HEAD, dtype=np.uint8) for _ in range(n)]


def _rows(pool: np.ndarray, heads: int) -> np.ndarray:
    return pool.reshape(-1, heads * HEAD)


@pytest.mark.parametrize("slice_bytes", [1 << 20, 3 * 2 * HEAD])  # whole, and in 3-row slices
def test_two_ranks_heads_land_side_by_side_in_one_rank_page(slice_bytes):
    """2 -> 1: pages 2..4 of two one-head pools into a three-page run of two-head pages."""
    a, b = _pools(2, 1)
    cols = [_col("a", 1, 0, 0, HEAD), _col("b", 1, 0, HEAD, HEAD)]
    dst = np.zeros(3 * ROWS * 2 * HEAD, np.uint8)
    assert copy_run(dst, 2 * HEAD, [a, b], cols, 2, 1 << 30, slice_bytes, lambda: False)
    want = np.concatenate([_rows(a, 1)[2 * ROWS:5 * ROWS], _rows(b, 1)[2 * ROWS:5 * ROWS]], 1)
    assert np.array_equal(dst.reshape(-1, 2 * HEAD), want)


def test_one_ranks_pages_split_between_two_ranks():
    """1 -> 2: each decode rank takes its half of every row of page 5."""
    (src,) = _pools(1, 2)
    for rank in (0, 1):
        dst = np.zeros(ROWS * HEAD, np.uint8)
        col = _col("s", 2, rank * HEAD, 0, HEAD)
        assert copy_run(dst, HEAD, [src], [col], 5, 0, 1 << 20, lambda: False)
        assert np.array_equal(dst.reshape(-1, HEAD),
                              _rows(src, 2)[5 * ROWS:6 * ROWS, rank * HEAD:(rank + 1) * HEAD])


def test_a_stop_between_slices_leaves_the_rest_unwritten():
    a, b = _pools(2, 1)
    cols = [_col("a", 1, 0, 0, HEAD), _col("b", 1, 0, HEAD, HEAD)]
    dst = np.zeros(ROWS * 2 * HEAD, np.uint8)
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 1  # the first slice goes, then the cancel is seen
    assert not copy_run(dst, 2 * HEAD, [a, b], cols, 0, 0, 16 * 2 * HEAD, stop)
    rows = dst.reshape(-1, 2 * HEAD)
    assert np.array_equal(rows[:16, :HEAD], _rows(a, 1)[:16]) and not rows[16:].any()


@pytest.mark.parametrize("total", [0, 1 << 30])  # cached copy, streaming stores
@pytest.mark.parametrize("width", [64, 96, 256, 320])  # whole lines or not, 256-byte blocks
def test_gather_rows_equals_numpy_for_every_width(total, width):
    rng = np.random.default_rng(width)
    srcs = [rng.integers(0, 255, (50, 2 * width + 32), dtype=np.uint8) for _ in range(2)]
    dst = np.zeros((50, 2 * width), np.uint8)
    fastcopy.gather_rows(dst, [Column(srcs[0], 32, 0, width), Column(srcs[1], 0, width, width)],
                         total)
    assert np.array_equal(dst[:, :width], srcs[0][:, 32:32 + width])
    assert np.array_equal(dst[:, width:], srcs[1][:, :width])
    with pytest.raises(ValueError, match="columns"):
        fastcopy.gather_rows(dst, [Column(srcs[0], 0, width + 1, width)], total)


def test_the_client_shows_each_decode_ranks_part():
    from pdserve.client import breakdown
    from pdserve.v1 import common_pb2, router_pb2

    t = router_pb2.Timing(ttft_ms=40, kv_transfer_ms=3, kv_bytes=3 << 20, kv_pages=2,
                          kv_transport="shm", kv_ranks=[
                              common_pb2.RankTransfer(decode_rank=0, prefill_rank_first=0,
                                                      prefill_rank_last=1, kv_bytes=3 << 20,
                                                      handoff_ms=2.5, total_ms=2.75,
                                                      transport="shm", relayout="receiver")])
    assert breakdown(t).splitlines()[-1] == (
        "  decode rank 0 <- prefill ranks 0..1: 3,145,728 bytes over shm, re-laid out in the "
        "receiver's copy, 2.5 ms (moving them took 2.8 ms)")


def test_without_the_native_library_the_gather_is_numpys(monkeypatch):
    monkeypatch.setattr(fastcopy, "library", lambda: None)
    rng = np.random.default_rng(7)
    srcs = [rng.integers(0, 255, (20, 192), dtype=np.uint8) for _ in range(2)]
    dst = np.zeros((20, 256), np.uint8)
    fastcopy.gather_rows(dst, [Column(srcs[0], 64, 0, 128), Column(srcs[1], 0, 128, 128)],
                         1 << 30)
    assert np.array_equal(dst, np.concatenate([srcs[0][:, 64:], srcs[1][:, :128]], 1))
