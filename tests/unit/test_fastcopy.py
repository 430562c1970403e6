"""The streaming KV copy (pdserve.common.fastcopy, csrc/kvcopy.c): byte-exact at every size and
alignment the C code splits on, built where there is a compiler, loaded from an image's
prebuilt folder where there is none, numpy's copy where neither (or when turned off)."""

from __future__ import annotations

import numpy as np
import pytest
from pdserve.common import fastcopy

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """fastcopy as a new process finds it, with its cache under tmp_path."""
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("PDSERVE_NO_NATIVE_COPY", raising=False)
    monkeypatch.setattr(fastcopy, "_tried", False)
    monkeypatch.setattr(fastcopy, "_lib", None)
    return tmp_path


def test_the_library_is_built_for_this_machine(fresh) -> None:
    assert fastcopy.library() is not None, "a C compiler is on this machine: it must build"
    assert fastcopy.isa() in ("avx512", "avx", "sse2", "memcpy")
    assert (fresh / "kernels" / fastcopy.library_name()).is_file()


# Sizes around the 256-byte vector body and the 64-byte alignment head; offsets that misalign
# the destination, the source, or both.
@pytest.mark.parametrize("size", [0, 1, 63, 64, 65, 255, 256, 257, 4096 + 17, (1 << 20) + 3])
@pytest.mark.parametrize("dst_off,src_off", [(0, 0), (1, 0), (0, 7), (61, 3), (64, 64)])
def test_stream_copy_is_byte_exact_and_touches_nothing_else(size, dst_off, src_off) -> None:
    assert fastcopy.library() is not None
    rng = np.random.default_rng(size + dst_off)
    src = rng.integers(0, 256, size + src_off + 64, dtype=np.uint8)
    dst = np.full(size + dst_off + 64, 0xAB, dtype=np.uint8)
    fastcopy.stream_copy(dst[dst_off:dst_off + size], src[src_off:src_off + size])
    assert np.array_equal(dst[dst_off:dst_off + size], src[src_off:src_off + size])
    assert (dst[:dst_off] == 0xAB).all() and (dst[dst_off + size:] == 0xAB).all()


def test_a_handoff_copy_is_exact_on_both_sides_of_the_streaming_threshold() -> None:
    n = fastcopy.STREAM_MIN_BYTES + 4096 + 5
    src = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    for total in (fastcopy.STREAM_MIN_BYTES - 1, fastcopy.STREAM_MIN_BYTES):
        dst = np.zeros(n, dtype=np.uint8)
        fastcopy.copy(dst, src, total)
        assert np.array_equal(dst, src)


def test_stream_copy_refuses_arrays_of_different_sizes() -> None:
    with pytest.raises(ValueError, match="copy of 8 bytes into 4"):
        fastcopy.stream_copy(np.zeros(4, np.uint8), np.zeros(8, np.uint8))


def test_an_image_without_a_compiler_loads_the_prebuilt_copy(fresh, monkeypatch) -> None:
    built = fastcopy.prebuild(fresh / "kernels")  # what the Containerfile's build stage runs
    assert built.name == fastcopy.library_name()
    monkeypatch.setattr(fastcopy, "compiler", lambda: None)
    lib = fastcopy.library()
    assert lib is not None and lib._name == str(built)
    src = np.arange(1 << 16, dtype=np.uint32).view(np.uint8)
    dst = np.zeros_like(src)
    fastcopy.stream_copy(dst, src)
    assert np.array_equal(dst, src)


def test_without_compiler_or_prebuilt_build_copies_fall_back_to_numpy(fresh, monkeypatch):
    monkeypatch.setattr(fastcopy, "compiler", lambda: None)
    assert fastcopy.library() is None and fastcopy.isa() == "numpy"
    src = np.arange(1000, dtype=np.uint8)
    dst = np.zeros_like(src)
    fastcopy.stream_copy(dst, src)
    assert np.array_equal(dst, src)


def test_it_can_be_turned_off(fresh, monkeypatch) -> None:
    monkeypatch.setenv("PDSERVE_NO_NATIVE_COPY", "1")
    assert fastcopy.library() is None and fastcopy.isa() == "numpy"


@pytest.mark.parametrize("total", [1 << 10, fastcopy.STREAM_MIN_BYTES])  # cached, streamed
def test_a_copy_in_slices_is_exact_and_stops_between_slices_when_asked(total) -> None:
    rng = np.random.default_rng(total)
    src = rng.integers(0, 256, 10_000 + 3, dtype=np.uint8)
    dst = np.zeros_like(src)
    assert fastcopy.copy_in_slices(dst, src, total, 4096, lambda: False)
    assert np.array_equal(dst, src)
    asked = []

    def stop_at_third() -> bool:
        asked.append(1)
        return len(asked) == 3
    dst[:] = 0
    assert not fastcopy.copy_in_slices(dst, src, total, 4096, stop_at_third)
    assert np.array_equal(dst[:8192], src[:8192]) and not dst[8192:].any()  # two slices, no more
    with pytest.raises(ValueError, match="copy of 10003 bytes into 10002"):
        fastcopy.copy_in_slices(dst[1:], src, total, 4096, lambda: False)


def test_a_copy_in_slices_by_given_addresses_copies_between_those_addresses() -> None:
    """The receiver passes the addresses it keeps (the pool's, the mapping's) instead of asking
    numpy on the critical path: the copy lands where they point, exactly."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, fastcopy.STREAM_MIN_BYTES + 4099, dtype=np.uint8)
    dst = np.zeros(src.size + 128, dtype=np.uint8)
    part_src, part_dst = src[3:], dst[64:64 + src.size - 3]
    addresses = (dst.ctypes.data + 64, src.ctypes.data + 3)
    assert fastcopy.copy_in_slices(part_dst, part_src, src.size, 1 << 20, lambda: False,
                                   addresses)
    assert np.array_equal(part_dst, part_src)
    assert not dst[:64].any() and not dst[64 + part_src.size:].any()


def test_a_pools_address_is_where_its_pages_are() -> None:
    from pdserve.common.layout import LayoutFingerprint
    from pdserve.common.shm import SharedSegment
    from pdserve.kvtransfer.pool import Pool
    fp = LayoutFingerprint("m", "r", "float32", 2, 2, 16, 4)
    with SharedSegment.create(8 * fp.page_bytes, "test") as segment:
        pool = Pool("pool-0", "w", segment, 8, fp.page_bytes, fp)
        try:
            for page in (0, 3, 7):
                assert pool.address + page * fp.page_bytes == pool.pages(page, 1).ctypes.data
        finally:
            pool.close()
