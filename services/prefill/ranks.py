"""A handoff between tensor-parallel layouts: each head range from the prefill rank that has
it to the decode rank that owns it.

A prefill worker of TP size P holds a prompt's KV in P pools, rank r's with KV heads
`r*K/P .. (r+1)*K/P - 1` of the model's K (every pool `[pages, layers, 2, block, heads,
head_dim]`, the same page ids in each). A decode worker of TP size D wants it in D pools cut
the same way by D. The handoff is one part per decode rank d, each its own Shipment (pipelined
with prefill, its own ticket `rank_ticket(key, d)`), sent over whichever path the agents pick:

- P == D: rank d's pool goes to rank d's pool as it is (no copy beyond the transport's).
- P != D, the decode agent on this host (the same-host lane): one write per part names, for
  each prefill rank holding some of d's heads, the columns of its rows they are; the receiving
  agent maps those pools and fills d's pages row by row from them, the one copy a handoff
  within a split makes (pdserve.common.kv.relayout).
- P != D otherwise (another host, or the lane unusable): the pages go in pieces, each packed
  into rank d's layout in a small staging pool first (one strided copy, from each prefill rank
  holding part of d's heads; the next piece packed while one is on its way: staging.py); the
  transport then lands them straight in rank d's pages, so nothing is re-laid out after
  arrival.

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
from pdserve.common.handoff import Destination, RankTransfer, TransferReport
from pdserve.common.kv.relayout import ColumnSpec
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey, rank_ticket
from pdserve.engine.pool import KVPool
from pdserve.prefill.shipment import Handoff, Sends, Shipment
from pdserve.prefill.staging import Packed, Staging, head_cuts, packer, staging_pages
from pdserve.worker.agent_client import AgentClient
from pdserve.worker.samehost import LaneOptions, Relayout, SameHostLane


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
                 connect: Callable[[], AgentClient], lanes: LaneOptions | None):
        """`lanes`: the lanes of every pool registered here (None: all through the agent)."""
        self.worker_id = worker_id
        self.ranks = [own]
        self._connect = connect
        self._lanes = lanes
        self._staging: dict[int, list[tuple[Source, Staging, SameHostLane | None]]] = {}
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

    def parts(self, dest: Destination) -> list[Part]:
        """Per decode rank: the source to send from, the rank's destination, and how its
        pages go when they must change layout."""
        dests = dest.per_rank()
        check_tiling(self.fingerprint, len(self.ranks), dests)
        if len(dests) == len(self.ranks):
            return [Part(src, d, None, None) for src, d in zip(self.ranks, dests)]
        sources = [s.pool.tensor for s in self.ranks]
        out = []
        for rank, ((stage, free, lane), d) in enumerate(zip(self._staging_for(len(dests)),
                                                              dests)):
            packed = Packed(stage.sends, stage.current_pool_id, free,
                            packer(sources, stage.pool.tensor, rank, len(dests)),
                            stage.pool.page_bytes, self._ahead)
            out.append(Part(stage, d, packed, lane))
        return out

    def _staging_for(self, size: int) -> list[tuple[Source, Staging, SameHostLane | None]]:
        with self._lock:
            if size not in self._staging:
                fp = self.fingerprint
                heads = fp.num_kv_heads * fp.tp_size // size
                made = []
                for d in range(size):
                    layout = replace(fp, num_kv_heads=heads, tp_rank=d, tp_size=size)
                    pages = staging_pages(layout.page_bytes)
                    stage = self._register(f"{self.worker_id}/stage{size}.{d}",
                                           KVPool(layout, pages))
                    made.append((stage, Staging(pages), self._relayout_lane(stage, d, size)))
                self._staging[size] = made
            return self._staging[size]

    def _relayout_lane(self, stage: Source, rank: int, size: int) -> SameHostLane | None:
        """The same-host lane whose writes re-lay this worker's ranks' pages out into decode
        rank `rank` of `size`'s (None without same-host lanes)."""
        if (self._lanes is None or not self._lanes.same_host or stage.lane is None
                or any(s.lane is None for s in self.ranks)):
            return None
        tensor = self.ranks[0].pool.tensor
        per_source, head_bytes = tensor.shape[-2], tensor.shape[-1] * tensor.element_size()
        sources, columns = [], []
        for s, src_at, dst_at, heads in head_cuts(per_source, len(self.ranks), rank, size):
            src = self.ranks[s]
            assert src.lane is not None
            sources.append((src.lane.pool_key, src.lane.readonly_fd))
            columns.append(ColumnSpec(src.lane.pool_key, src.pool.num_pages, src.pool.page_bytes,
                                      per_source * head_bytes, src_at * head_bytes,
                                      dst_at * head_bytes, heads * head_bytes))
        return SameHostLane(stage.agent, stage.pool.fd, stage.pool.num_pages,
                            stage.pool.page_bytes, stage.pool.fingerprint,
                            f"{self.worker_id}/relayout{size}.{rank}",
                            Relayout(sources, columns, stage.pool.tensor.shape[-2] * head_bytes))

    def _register(self, name: str, pool: KVPool) -> Source:
        source = Source(pool, self._connect(), "", None)

        def registered(pool_id: str, _epoch: int) -> None:
            source.pool_id = pool_id  # again after an agent restart
        source.pool_id, _ = source.agent.register_pool(
            name, pool.fd, pool.num_pages, pool.page_bytes, pool.fingerprint,
            on_registered=registered)
        if self._lanes is not None:
            source.lane = SameHostLane(source.agent, pool.fd, pool.num_pages, pool.page_bytes,
                                       pool.fingerprint, name, options=self._lanes)
        return source

    def close(self) -> None:
        """Everything but rank 0's source (the worker's own)."""
        for source in self.ranks[1:]:
            source.close(own_agent=True)
        self._ahead.shutdown(wait=True)
        for staging in self._staging.values():
            for source, _, lane in staging:
                if lane is not None:
                    lane.close()
                source.close(own_agent=True)
                source.pool.close()


@dataclass
class Part:
    """One decode rank's part of a handoff: the source registration it goes from, the rank's
    destination; when the layout changes, its packing through staging (`packed`) and the lane
    that re-lays it out in the receiver's copy instead where it can (`relayout`)."""

    source: Source
    dest: Destination
    packed: Packed | None
    relayout: SameHostLane | None

    @property
    def sends(self) -> Sends:
        if self.packed is None:
            return self.source.sends
        if self.relayout is None:
            return self.packed
        return _Relaid(self.relayout, self.packed)


class _Relaid:
    """`Sends` over a re-layout lane, packed through staging where the lane cannot go."""

    def __init__(self, lane: SameHostLane, packed: Packed):
        self._lane, self._packed = lane, packed

    def send(self, ticket: TicketKey, src_pool_id: str, src_page_ids: list[int],
             destination: Destination, timeout_s: float) -> Handoff:
        return self._lane.send(ticket, src_pool_id, src_page_ids, destination, timeout_s,
                               lambda: self._packed.send(ticket, src_pool_id, src_page_ids,
                                                         destination, timeout_s))


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
        self._packed = [part.packed for part in planned]
        self._shipments = [
            Shipment(part.sends, rank_ticket(ticket, rank), part.source.pool_id, part.dest,
                     timeout_s, parts)
            for rank, part in enumerate(planned)]

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
        ranks = tuple(self._rank(d, r) for d, r in enumerate(reports))
        self._trace(ranks)
        first = reports[0]
        return TransferReport(max(r.handoff_ms for r in reports), sum(r.kv_bytes for r in reports),
                              first.kv_pages, first.transport, sum(r.num_runs for r in reports),
                              max(r.total_ms for r in reports), ranks)

    def cancel(self) -> None:
        for shipment in self._shipments:
            shipment.cancel()

    def settle(self) -> None:
        for shipment in self._shipments:
            shipment.settle()

    def _rank(self, rank: int, report: TransferReport) -> RankTransfer:
        """Decode rank `rank`'s part: where its heads came from, how, what it took."""
        packed, p, d = self._packed[rank], self._prefill_tp, len(self._shipments)
        relayout = "" if packed is None else "staging" if packed.pack_s else "receiver"
        return RankTransfer(rank, rank * p // d, ((rank + 1) * p - 1) // d, report.kv_bytes,
                            report.handoff_ms, report.total_ms, report.transport, relayout)

    def _trace(self, ranks: tuple[RankTransfer, ...]) -> None:
        """A kv.rank_handoff span per decode rank under the request's: what went from which
        prefill ranks to it, how, and how long it took (its parts' time, packing included)."""
        if not tracing.enabled():
            return
        now, size = time.time_ns(), len(ranks)
        for r, packed in zip(ranks, self._packed):
            how = {"": "'s pool", "receiver": ", re-laid out in the receiver's copy",
                   "staging": ", packed through staging"}[r.relayout]
            s = tracing.start_span(
                "kv.rank_handoff", start_time_ns=now - int(r.total_ms * 1e6),
                decode_rank=r.decode_rank, decode_tp=size, prefill_tp=self._prefill_tp,
                source=f"prefill rank {r.prefill_rank_first}{how}" if not r.relayout else
                f"prefill ranks {r.prefill_rank_first}..{r.prefill_rank_last}{how}",
                pack_ms=packed.pack_s * 1e3 if packed else 0.0, relayout=r.relayout,
                kv_bytes=r.kv_bytes, kv_transport=r.transport, handoff_ms=r.handoff_ms,
                total_ms=r.total_ms)
            s.end(end_time=now)
