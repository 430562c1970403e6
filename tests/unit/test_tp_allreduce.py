"""The tensor-parallel ranks' all-reduce through shared memory (csrc/allreduce.c): every rank
gets the sum, bit for bit the same, call after call (the two slot sets alternating); a waiting
rank stops when the group is aborted (a rank died) or a rank never arrives. Ranks are threads
here (the C side only sees a segment, a rank and a sequence number, as across processes)."""

from __future__ import annotations

import threading

import pytest
import torch
from pdserve.common.shm import SharedSegment
from pdserve.engine import tp
from pdserve.engine.tp import RankFailed, SharedReduce

SLOT = 1 << 20  # bytes: up to 256 Ki floats a call


@pytest.fixture
def segment():
    seg = SharedSegment.create(SharedReduce.segment_bytes(3, SLOT), tag="tptest")
    yield seg
    seg.close()


def _run(ranks: list[SharedReduce], tensors: list[torch.Tensor]) -> list[BaseException]:
    errors: list[BaseException] = []

    def one(r: int) -> None:
        try:
            ranks[r].all_reduce(tensors[r])
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an all-reduce did not return"
    return errors


@pytest.mark.parametrize("size", [2, 3])
def test_every_rank_gets_the_same_sum_call_after_call(segment, size):
    ranks = [SharedReduce(segment, r, size, SLOT) for r in range(size)]
    gen = torch.Generator().manual_seed(size)
    for n in (1, 1000, 64 * 1024, 7, SLOT // 4):  # small ones (GIL kept first) and a full slot
        parts = [torch.randn(n, generator=gen) for _ in range(size)]
        want = parts[0].clone()
        for p in parts[1:]:
            want += p  # rank order, as every rank sums
        got = [p.clone() for p in parts]
        assert _run(ranks, got) == []
        for r in range(size):
            assert torch.equal(got[r], want), f"rank {r}, {n} floats"


def test_a_waiting_rank_stops_when_the_group_is_aborted(segment):
    rank0 = SharedReduce(segment, 0, 2, SLOT)
    timer = threading.Timer(0.2, rank0.abort)  # as the rank watcher does when rank 1 dies
    timer.start()
    with pytest.raises(RankFailed, match="a rank exited"):
        rank0.all_reduce(torch.ones(1000))
    timer.join()


def test_a_rank_that_never_arrives_times_out(segment, monkeypatch):
    monkeypatch.setattr(tp, "COLLECTIVE_TIMEOUT_S", 0.3)
    with pytest.raises(RankFailed, match="a rank did not arrive within 0 s"):
        SharedReduce(segment, 1, 2, SLOT).all_reduce(torch.ones(SLOT // 4))


def test_a_tensor_the_slot_cannot_hold_is_refused(segment):
    with pytest.raises(ValueError, match="up to 1048576 bytes, not torch.float32 of 1048580"):
        SharedReduce(segment, 0, 2, SLOT).all_reduce(torch.ones(SLOT // 4 + 1))
