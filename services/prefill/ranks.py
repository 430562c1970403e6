"""A handoff between tensor-parallel layouts: each head range from the prefill rank that has
it to the decode rank that owns it.

A prefill worker of TP size P holds a prompt's KV in P pools, rank r's with KV heads
`r*K/P .. (r+1)*K/P - 1` of the model's K (every pool `[pages, layers, 2, block, heads,
head_dim]`, the same page ids in each). A decode worker of TP size D wants it in D pools cut
the same way by D. The handoff is one part per decode rank d, each its own Shipment (pipelined
with prefill, its own ticket `rank_ticket(key, d)`), sent over whichever path the agents pick:

- P == D: rank d's pool goes to rank d's pool as it is (no copy beyond the transport's).
- P != D: the pages go in pieces, each packed into rank d's layout in a small staging pool
  first (one strided copy, from each prefill rank holding part of d's heads; the next piece
  packed while one is on its way: staging.py); the transport then lands them straight in rank
  d's pages, so nothing is re-laid out after arrival.

The destination's ranks must tile the model's KV heads exactly as the layout fingerprints say
(model, dtype, layers, head size and block equal, each rank's heads a 1/D share): checked
before anything is sent, with a message naming both splits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass, replace

from pdserve.common import tracing
from pdserve.common.errors import FailedPrecondition
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey, rank_ticket
from pdserve.engine.pool import KVPool
from pdserve.prefill.shipment import Sends, Shipment
from pdserve.prefill.staging import Packed, Staging, packer, staging_pages
from pdserve.worker.agent_client import AgentClient
from pdserve.worker.samehost import SameHostLane


@dataclass
class Source:
    """A pool handoffs read from, as registered with the agent, and how its parts go."""

    pool: KVPool
    agent: AgentClient
    pool_id: str
    lane: SameHostLane | None

    @property
    def sends(self) -> Sends:
        return self.lane or self.agent

    def current_pool_id(self) -> str:
        return self.pool_id  # a new one after an agent restart

    def close(self, own_agent: bool) -> None:
        if self.lane is not None:
            self.lane.close()
        if own_agent:
            self.agent.close()


class Sources:
    """Rank 0's source (the worker's own registration), the other ranks', and staging pools
    by decode TP size; `parts` plans one handoff over them."""

    def __init__(self, worker_id: str, own: Source, rank_pools: list[KVPool],
                 connect: Callable[[], AgentClient], same_host_lane: bool):
        self.worker_id = worker_id
        self.ranks = [own]
        self._connect = connect
        self._lane = same_host_lane
        self._staging: dict[int, list[tuple[Source, Staging]]] = {}
        self._lock = threading.Lock()
        self._ahead = ThreadPoolExecutor(2, thread_name_prefix="kv-pack")
        for r, pool in enumerate(rank_pools, start=1):
            self.ranks.append(self._register(f"{worker_id}/tp{r}", pool))

    @property
    def fingerprint(self) -> LayoutFingerprint:
        return self.ranks[0].pool.fingerprint

    def needs_ranks(self, dest: Destination) -> bool:
        """False for the plain handoff (one pool each side): no part of this module's."""
        fp = dest.fingerprint
        return len(self.ranks) > 1 or bool(dest.ranks) or (fp is not None and fp.tp_size > 1)

    def parts(self, dest: Destination) -> list[tuple[Source, Destination, Packed | None]]:
        """Per decode rank: the source to send from, the rank's destination, and its packing
        through a staging pool (None: the pages are sent as they are)."""
        dests = dest.per_rank()
        check_tiling(self.fingerprint, len(self.ranks), dests)
        if len(dests) == len(self.ranks):
            return [(src, d, None) for src, d in zip(self.ranks, dests)]
        sources = [s.pool.tensor for s in self.ranks]
        out: list[tuple[Source, Destination, Packed | None]] = []
        for rank, ((stage, free), d) in enumerate(zip(self._staging_for(len(dests)), dests)):
            out.append((stage, d, Packed(stage.sends, stage.current_pool_id, free,
                                         packer(sources, stage.pool.tensor, rank, len(dests)),
                                         stage.pool.page_bytes, self._ahead)))
        return out

    def _staging_for(self, size: int) -> list[tuple[Source, Staging]]:
        with self._lock:
            if size not in self._staging:
                fp = self.fingerprint
                heads = fp.num_kv_heads * fp.tp_size // size
                made = []
                for d in range(size):
                    layout = replace(fp, num_kv_heads=heads, tp_rank=d, tp_size=size)
                    pages = staging_pages(layout.page_bytes)
                    made.append((self._register(f"{self.worker_id}/stage{size}.{d}",
                                                KVPool(layout, pages)), Staging(pages)))
                self._staging[size] = made
            return self._staging[size]

    def _register(self, name: str, pool: KVPool) -> Source:
        source = Source(pool, self._connect(), "", None)

        def registered(pool_id: str, _epoch: int) -> None:
            source.pool_id = pool_id  # again after an agent restart
        source.pool_id, _ = source.agent.register_pool(
            name, pool.fd, pool.num_pages, pool.page_bytes, pool.fingerprint,
            on_registered=registered)
        if self._lane:
            source.lane = SameHostLane(source.agent, pool.fd, pool.num_pages, pool.page_bytes,
                                       pool.fingerprint, name)
        return source

    def close(self) -> None:
        """Everything but rank 0's source (the worker's own)."""
        for source in self.ranks[1:]:
            source.close(own_agent=True)
        self._ahead.shutdown(wait=True)
        for staging in self._staging.values():
            for source, _ in staging:
                source.close(own_agent=True)
                source.pool.close()


def check_tiling(mine: LayoutFingerprint, my_ranks: int, dests: Sequence[Destination]) -> None:
    """FailedPrecondition unless `dests` are the ranks 0..D-1 of one layout like this worker's
    whose KV heads, 1/D each, tile the same heads as this worker's ranks do."""
    total = mine.num_kv_heads * my_ranks
    size = len(dests)
    for d, dest in enumerate(dests):
        fp = dest.fingerprint
        if fp is None:
            raise FailedPrecondition("the decode side's destination names no layout for rank "
                                     f"{d} of its {size} tensor-parallel ranks")
        same = replace(fp, num_kv_heads=mine.num_kv_heads, tp_rank=mine.tp_rank,
                       tp_size=mine.tp_size)
        diffs = mine.mismatches(same)
        if diffs:
            raise FailedPrecondition("layout mismatch between this prefill worker's pools and "
                                     f"the decode side's rank {d}: " + "; ".join(diffs))
        if fp.tp_rank != d or fp.tp_size != size or fp.num_kv_heads * size != total:
            raise FailedPrecondition(
                f"the decode side's tensor-parallel pools do not tile the model's {total} KV "
                f"heads: its pool {d} of {size} is rank {fp.tp_rank} of {fp.tp_size} holding "
                f"{fp.num_kv_heads} heads (this prefill worker: {my_ranks} ranks of "
                f"{mine.num_kv_heads} heads)")


class RankShipments:
    """One Shipment per decode rank, driven as one (the prefill worker's `Shipment`)."""

    def __init__(self, sources: Sources, ticket: TicketKey, destination: Destination,
                 timeout_s: float, parts: Executor, finishers: Executor):
        self._finishers = finishers
        self._prefill_tp = len(sources.ranks)
        planned = sources.parts(destination)
        self._packed = [packed for _, _, packed in planned]
        self._shipments = [
            Shipment(packed or src.sends, rank_ticket(ticket, rank), src.pool_id, dest,
                     timeout_s, parts)
            for rank, (src, dest, packed) in enumerate(planned)]

    def ship(self, complete_pages: list[int]) -> None:
        for shipment in self._shipments:
            shipment.ship(complete_pages)

    def finish(self, all_pages: list[int], kv_ready: float) -> TransferReport:
        """Every rank's rest at once; the handoff ends when the last rank's pages are in."""
        others = [self._finishers.submit(s.finish, all_pages, kv_ready)
                  for s in self._shipments[1:]]
        reports, error = [], None
        try:
            reports.append(self._shipments[0].finish(all_pages, kv_ready))
        except BaseException as exc:
            error = exc
            self.cancel()
        for future in others:
            try:
                reports.append(future.result())
            except BaseException as exc:
                error = error or exc
                self.cancel()
        if error is not None:
            raise error
        self._trace(reports)
        first = reports[0]
        return TransferReport(max(r.handoff_ms for r in reports), sum(r.kv_bytes for r in reports),
                              first.kv_pages, first.transport, sum(r.num_runs for r in reports),
                              max(r.total_ms for r in reports))

    def cancel(self) -> None:
        for shipment in self._shipments:
            shipment.cancel()

    def _trace(self, reports: list[TransferReport]) -> None:
        """A kv.rank_handoff span per decode rank under the request's: what went from which
        prefill ranks to it, how, and how long it took (its parts' time, packing included)."""
        if not tracing.enabled():
            return
        now, size = time.time_ns(), len(reports)
        for rank, (report, packed) in enumerate(zip(reports, self._packed)):
            pack_ms = packed.pack_s * 1e3 if packed else 0.0
            s = tracing.start_span(
                "kv.rank_handoff", start_time_ns=now - int(report.total_ms * 1e6),
                decode_rank=rank, decode_tp=size, prefill_tp=self._prefill_tp,
                source=f"packed from prefill ranks {rank * self._prefill_tp // size}.."
                f"{((rank + 1) * self._prefill_tp - 1) // size}" if packed
                else f"prefill rank {rank}'s pool", pack_ms=pack_ms, kv_bytes=report.kv_bytes,
                kv_pages=report.kv_pages, kv_transport=report.transport,
                handoff_ms=report.handoff_ms, total_ms=report.total_ms)
            s.end(end_time=now)
