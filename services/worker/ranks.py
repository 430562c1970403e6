"""A tensor-parallel worker's pools as the host's agent sees them: one registered pool per rank.

Rank 0's process made every rank's pool (engine/tp.py) and registers each with the agent on a
connection of its own (a pool lives as long as its connection), rank 0's on the worker's main
agent client. On the decode side a reservation is one write window per rank pool, under the
rank's ticket (`rank_ticket`), all opened and closed together (`RankWindows`): the lease book
sees one window, and the handoff has landed only when every rank's pages have.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from pdserve.common.handoff import Destination
from pdserve.common.tickets import TicketKey, rank_ticket
from pdserve.engine.pool import KVPool
from pdserve.worker.agent_client import AgentClient
from pdserve.worker.leases import WindowClosed, WriteWindow

log = logging.getLogger("pdserve.worker.ranks")


class RankPools:
    """Ranks 1..N-1's pools registered with the agent (rank 0's is the worker's own)."""

    def __init__(self, worker_id: str, pools: list[KVPool],
                 connect: Callable[[], AgentClient]):
        self.worker_id = worker_id
        self.pools = pools
        self.agents = [connect() for _ in pools]
        self.pool_ids = [""] * len(pools)

    def register(self) -> None:
        for i, (agent, pool) in enumerate(zip(self.agents, self.pools)):
            def registered(pool_id: str, _epoch: int, i: int = i) -> None:
                self.pool_ids[i] = pool_id  # again after an agent restart
            self.pool_ids[i], _ = agent.register_pool(
                f"{self.worker_id}/tp{i + 1}", pool.fd, pool.num_pages, pool.page_bytes,
                pool.fingerprint, on_registered=registered)

    def destinations(self) -> tuple[Destination, ...]:
        """Ranks 1..'s pools as a `Destination.ranks` names them."""
        return tuple(Destination("", 0, pool_id, (), pool.fingerprint)
                     for pool_id, pool in zip(self.pool_ids, self.pools))

    def close(self) -> None:
        for agent in self.agents:
            agent.close()


class RankWindows:
    """A tensor-parallel decode worker's write window: one per rank pool (a `WriteWindow`)."""

    def __init__(self, windows: list[WriteWindow]):
        self.windows = windows

    def open(self, key: TicketKey, page_ids: list[int], lease_s: float) -> None:
        opened: list[int] = []
        try:
            for rank, window in enumerate(self.windows):
                window.open(rank_ticket(key, rank), page_ids, lease_s)
                opened.append(rank)
        except BaseException:
            for rank in opened:  # nothing may land in pages the book gives back
                try:
                    self.windows[rank].close(rank_ticket(key, rank))
                except Exception:
                    log.exception("closing rank %d's window of %s after a refusal", rank, key)
            raise

    def close(self, key: TicketKey) -> WindowClosed:
        """Close every rank's window (all of them, also when one fails: the first error is
        raised after). Confirmed when every rank's is; landed when every rank's pages did."""
        closed: list[WindowClosed] = []
        error: Exception | None = None
        for rank, window in enumerate(self.windows):
            try:
                closed.append(window.close(rank_ticket(key, rank)))
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error
        return WindowClosed(all(c.confirmed for c in closed), all(c.landed for c in closed))


def rank_destination(dest: Destination, ranks: RankPools | None) -> Destination:
    """`dest` (rank 0's pool) with the other ranks' pools named."""
    return dest if ranks is None else replace(dest, ranks=ranks.destinations())
