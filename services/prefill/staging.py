"""Packing a handoff into another TP split's layout: a small staging pool per decode rank, and
the parts that go through it piece by piece.

A part whose pages must change layout (the prefill and decode TP sizes differ, ranks.py) goes
in pieces: each piece's pages are packed from the prefill ranks' pools into pages taken from
the decode rank's staging pool (one strided copy, the heads that rank owns), sent from there
to the rank's reserved pages, and given back once the write is over. While one piece is on its
way the next is packed on another thread, so the packing hides behind the transport except for
the first piece (1 MiB; pieces double up to 8 MiB). The staging pool is small and fixed
(`STAGING_BYTES`, populated by the agent at registration: no page faults on the way), shared by
every handoff to that layout: a piece waits for room when it is full (up to the handoff's
timeout), and only takes room for the next piece ahead when there is some, so two handoffs
never wait on each other for good.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import replace

import torch
from pdserve.common.errors import Aborted, ServiceError
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.kv.runs import coalesce
from pdserve.common.tickets import TicketKey
from pdserve.prefill.shipment import Handoff, Sends

FIRST_PIECE = 1 << 20
MAX_PIECE = 8 << 20
STAGING_BYTES = 64 << 20  # per decode rank's layout; at least two of the largest pieces


def staging_pages(page_bytes: int) -> int:
    return max(STAGING_BYTES, 2 * MAX_PIECE) // page_bytes + 2


class Staging:
    """The free pages of one staging pool (thread-safe)."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages))
        self._cond = threading.Condition()

    def take(self, n: int, timeout_s: float | None) -> list[int] | None:
        """The n lowest free pages (runs stay long); None when not free within `timeout_s`
        (0: not now)."""
        with self._cond:
            if timeout_s and not self._cond.wait_for(lambda: len(self._free) >= n, timeout_s):
                return None
            if len(self._free) < n:
                return None
            taken, self._free = self._free[:n], self._free[n:]
            return taken

    def give(self, pages: list[int]) -> None:
        with self._cond:
            self._free = sorted(self._free + pages)
            self._cond.notify_all()


def head_cuts(per_source: int, sources: int, rank: int, size: int
              ) -> list[tuple[int, int, int, int]]:
    """Where decode rank `rank` of `size`'s KV heads are among `sources` prefill ranks of
    `per_source` heads each: (source, its first head, the decode rank's head it becomes, how
    many), a contiguous range of every row of a page each."""
    per_rank = per_source * sources // size
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    cuts = []
    for s in range(sources):
        a, b = max(lo, s * per_source), min(hi, (s + 1) * per_source)
        if a < b:
            cuts.append((s, a - s * per_source, a - lo, b - a))
    return cuts


def packer(sources: list[torch.Tensor], stage: torch.Tensor, rank: int, size: int
           ) -> Callable[[list[int], list[int]], None]:
    """pack(src pages, stage pages): decode rank `rank`'s KV heads of the prefill ranks' pages
    (pools `[pages, layers, 2, block, heads, head_dim]`) into `stage`'s pages."""
    per_source, head_dim = sources[0].shape[-2], sources[0].shape[-1]
    per_rank = per_source * len(sources) // size
    cuts = head_cuts(per_source, len(sources), rank, size)
    rows = stage[0].numel() // (per_rank * head_dim)  # (layer, K/V, token) rows of a page

    def pack(src_pages: list[int], dst_pages: list[int]) -> None:
        for run in coalesce(src_pages, dst_pages):
            s0, d0, n = run.src_start, run.dst_start, run.num_pages
            into = stage[d0:d0 + n].view(n * rows, per_rank * head_dim)
            for s, src_at, dst_at, heads in cuts:
                into[:, dst_at * head_dim:(dst_at + heads) * head_dim].copy_(
                    sources[s][s0:s0 + n].view(n * rows, per_source * head_dim)
                    [:, src_at * head_dim:(src_at + heads) * head_dim])
    return pack


class Packed:
    """`Sends` for one decode rank's parts through its staging pool."""

    def __init__(self, inner: Sends, pool_id: Callable[[], str], staging: Staging,
                 pack: Callable[[list[int], list[int]], None], page_bytes: int,
                 ahead: Executor):
        self.inner, self.pool_id, self.staging = inner, pool_id, staging
        self.page_bytes, self.ahead = page_bytes, ahead
        self._pack = pack
        self.pack_s = 0.0  # packing time, all parts

    def send(self, ticket: TicketKey, src_pool_id: str, src_page_ids: list[int],
             destination: Destination, timeout_s: float) -> Handoff:
        return PackedHandoff(self, ticket, src_page_ids, destination, timeout_s)

    def pack(self, src_pages: list[int], stage_pages: list[int]) -> None:
        started = time.perf_counter()
        self._pack(src_pages, stage_pages)
        self.pack_s += time.perf_counter() - started

    def pieces(self, pages: list[int]) -> list[list[int]]:
        """`pages` cut into pieces: FIRST_PIECE's worth first, doubling up to MAX_PIECE's (and
        to half the staging pool, so the next piece can be packed while one is sent)."""
        n = max(1, FIRST_PIECE // self.page_bytes)
        most = max(1, min(MAX_PIECE // self.page_bytes, self.staging.num_pages // 2))
        out, at = [], 0
        while at < len(pages):
            n = min(n, most)
            out.append(pages[at:at + n])
            at, n = at + n, 2 * n
        return out


class PackedHandoff:
    """One part sent in pieces, each packed into staging pages first (`result()` runs it)."""

    def __init__(self, packed: Packed, ticket: TicketKey, pages: list[int], dest: Destination,
                 timeout_s: float):
        self._p, self._ticket, self._pages, self._dest = packed, ticket, pages, dest
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._current: Handoff | None = None
        self._sent: list[Handoff] = []
        self._cancelled = False

    def prepare(self) -> None:
        """Nothing: packing waits for staging pages."""

    def begin(self) -> bool:
        """Nothing (as `prepare`)."""
        return False

    def result(self) -> TransferReport:
        p = self._p
        deadline = time.monotonic() + self._timeout_s
        pieces = p.pieces(self._pages)
        reports: list[TransferReport] = []
        held = self._take(len(pieces[0]), deadline)
        p.pack(pieces[0], held)
        ahead: tuple[list[int], Future[None]] | None = None
        offset = 0
        try:
            for k, piece in enumerate(pieces):
                nxt = pieces[k + 1] if k + 1 < len(pieces) else None
                if nxt is not None:  # room for the next piece now? pack it meanwhile
                    room = p.staging.take(len(nxt), 0)
                    if room is not None:
                        ahead = room, p.ahead.submit(p.pack, nxt, room)
                dest = replace(self._dest, first_page=self._dest.first_page + offset,
                               page_ids=self._dest.page_ids[offset:offset + len(piece)])
                with self._lock:
                    if self._cancelled:
                        raise Aborted("the KV handoff was cancelled")
                    send = self._current = p.inner.send(self._ticket, p.pool_id(), held, dest,
                                                        self._timeout_s)
                reports.append(send.result())
                self._sent.append(send)
                p.staging.give(held)
                held, offset = [], offset + len(piece)
                if nxt is None:
                    break
                if ahead is None:
                    held = self._take(len(nxt), deadline)
                    p.pack(nxt, held)
                else:
                    held, future = ahead
                    ahead = None
                    future.result()
        finally:
            if ahead is not None:
                ahead[1].exception()  # wait: it writes into pages about to be given back
                held += ahead[0]
            if held:
                p.staging.give(held)
        return TransferReport(sum(r.handoff_ms for r in reports),
                              sum(r.kv_bytes for r in reports), sum(r.kv_pages for r in reports),
                              reports[-1].transport, sum(r.num_runs for r in reports),
                              sum(r.total_ms for r in reports))

    def _take(self, n: int, deadline: float) -> list[int]:
        pages = self._p.staging.take(n, max(1e-3, deadline - time.monotonic()))
        if pages is None:
            raise ServiceError(f"no room in the staging pool for {n} pages within the handoff's "
                               f"{self._timeout_s:g} s (its {self._p.staging.num_pages} pages "
                               f"are held by other handoffs)", "DEADLINE_EXCEEDED")
        return pages

    def settle(self) -> None:
        for send in self._sent:
            send.settle()

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            current = self._current
        if current is not None:
            current.cancel()
