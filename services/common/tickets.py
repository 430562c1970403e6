"""The one key of a decode-side reservation, used by the decode worker's lease book, the
kvtransfer agents and the wire header between them: request id + the decode worker's epoch."""

from __future__ import annotations

from typing import NamedTuple


class TicketKey(NamedTuple):
    request_id: str
    epoch: int

    def __str__(self) -> str:
        return f"{self.request_id}@{self.epoch}"
