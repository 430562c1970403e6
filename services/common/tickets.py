"""The one key of a decode-side reservation, used by the decode worker's lease book, the
kvtransfer agents and the wire header between them: request id + the decode worker's epoch."""

from __future__ import annotations

from typing import NamedTuple


class TicketKey(NamedTuple):
    request_id: str
    epoch: int

    def __str__(self) -> str:
        return f"{self.request_id}@{self.epoch}"


def rank_ticket(key: TicketKey, rank: int) -> TicketKey:
    """The key of a tensor-parallel decode worker's rank `rank` pool for the reservation `key`
    (rank 0: `key` itself). Each rank's pool is its own write window on the agent, so each
    needs a key of its own; sender and receiver derive it the same way."""
    return key if rank == 0 else TicketKey(f"{key.request_id}/tp{rank}", key.epoch)
