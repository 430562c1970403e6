"""The packing of a handoff between TP splits (prefill/staging.py), with a transport that lands
each piece by copying the staging pages it names: every decode rank's pages end up holding
exactly its KV heads of the prefill ranks' pages, in pieces that fit the staging pool, which
gets every page back; a full staging pool makes a piece wait, then fail naming the cause."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from pdserve.common.errors import ServiceError
from pdserve.common.handoff import Destination, TransferReport
from pdserve.prefill import staging
from pdserve.prefill.staging import Packed, Staging, packer

SHAPE = (3, 2, 4)  # layers, K/V, block: a page's rows
HEAD_DIM = 8


class Landed:
    """A Handoff that copies the named staging pages into the destination pool when run."""

    def __init__(self, sends: CopySends, pages: list[int], dest: Destination):
        self.sends, self.pages, self.dest = sends, pages, dest

    def result(self) -> TransferReport:
        with self.sends.lock:
            self.sends.in_flight += 1
            self.sends.most = max(self.sends.most, self.sends.in_flight)
        for s, d in zip(self.pages, self.dest.page_ids):
            self.sends.dest[d] = self.sends.stage[s]
        self.sends.calls.append((list(self.pages), self.dest.first_page))
        with self.sends.lock:
            self.sends.in_flight -= 1
        return TransferReport(1.0, len(self.pages) * 8, len(self.pages), "shm", 1, 1.0)

    def settle(self) -> None:
        pass

    def cancel(self) -> None:
        pass


class CopySends:
    def __init__(self, stage: torch.Tensor, dest: torch.Tensor):
        self.stage, self.dest = stage, dest
        self.calls: list[tuple[list[int], int]] = []
        self.lock = threading.Lock()
        self.in_flight = self.most = 0

    def send(self, ticket, src_pool_id, src_page_ids, destination, timeout_s):
        return Landed(self, src_page_ids, destination)


def _pools(num_pages: int, heads: int, n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return [torch.randn(num_pages, *SHAPE, heads, HEAD_DIM, generator=g) for _ in range(n)]


@pytest.mark.parametrize("prefill_tp,decode_tp", [(2, 1), (1, 2), (4, 2), (2, 4)])
def test_every_decode_rank_gets_exactly_its_heads(prefill_tp, decode_tp, monkeypatch):
    heads = 4
    monkeypatch.setattr(staging, "FIRST_PIECE", 1)  # a page a piece first, then doubling
    monkeypatch.setattr(staging, "MAX_PIECE", 1 << 30)  # then half the staging pool
    sources = _pools(40, heads // prefill_tp, prefill_tp)
    whole = torch.cat(sources, dim=-2)  # [pages, L, 2, B, heads, D]
    src_pages = [7, 8, 9, 2, 3, 30, 31, 32, 33, 34, 11]
    dst_pages = [20 + i for i in range(len(src_pages))]
    per = heads // decode_tp
    with ThreadPoolExecutor(2) as ahead:
        for rank in range(decode_tp):
            stage = torch.zeros(6, *SHAPE, per, HEAD_DIM)
            dest = torch.zeros(40, *SHAPE, per, HEAD_DIM)
            free = Staging(6)
            sends = CopySends(stage, dest)
            p = Packed(sends, lambda: "stage", free, packer(sources, stage, rank, decode_tp),
                       stage[0].numel() * 4, ahead)
            report = p.send(("r", 1), "ignored", src_pages,
                            Destination("a", 1, "pool", tuple(dst_pages), None, 5, 0),
                            10.0).result()
            want = whole[src_pages][..., rank * per:(rank + 1) * per, :]
            assert torch.equal(dest[dst_pages], want), (prefill_tp, decode_tp, rank)
            assert report.kv_pages == len(src_pages)
            sizes = [len(pages) for pages, _ in sends.calls]
            assert sizes[0] == 1 and max(sizes) <= 3 and sum(sizes) == len(src_pages)
            assert [first for _, first in sends.calls][:3] == [5, 6, 8]  # page offsets
            assert free.take(6, 0) is not None  # every staging page came back
            assert p.pack_s > 0


def test_a_full_staging_pool_makes_a_piece_wait_then_fail_naming_it(monkeypatch):
    monkeypatch.setattr(staging, "FIRST_PIECE", 1 << 30)
    sources = _pools(8, 2, 1)
    stage = torch.zeros(4, *SHAPE, 1, HEAD_DIM)
    free = Staging(4)
    held = free.take(3, 0)
    assert held is not None and free.take(2, 0) is None
    with ThreadPoolExecutor(1) as ahead:
        p = Packed(CopySends(stage, torch.zeros(8, *SHAPE, 1, HEAD_DIM)), lambda: "stage", free,
                   packer(sources, stage, 0, 2), stage[0].numel() * 4, ahead)
        send = p.send(("r", 1), "x", [0, 1], Destination("a", 1, "p", (4, 5), None), 0.2)
        with pytest.raises(ServiceError, match="no room in the staging pool for 2 pages") as e:
            send.result()
        assert e.value.code == "DEADLINE_EXCEEDED"
        free.give(held)
        send = p.send(("r", 1), "x", [0, 1], Destination("a", 1, "p", (4, 5), None), 5.0)
        assert send.result().kv_pages == 2
