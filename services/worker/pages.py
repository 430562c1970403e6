"""The engine's pool as a lease book's `PageStore`: reservations taken and freed on the
engine loop's thread."""

from __future__ import annotations

from pdserve.common.tickets import TicketKey
from pdserve.engine.loop import EngineLoop
from pdserve.engine.pool import OutOfPages
from pdserve.worker.leases import NoRoom


class EnginePages:
    def __init__(self, loop: EngineLoop):
        self._loop = loop

    def reserve(self, key: TicketKey, num_prompt_tokens: int) -> list[int]:
        try:
            return self._loop.submit(lambda e: e.reserve(key, num_prompt_tokens))
        except OutOfPages as exc:
            raise NoRoom(str(exc)) from None

    def free(self, key: TicketKey) -> None:
        self._loop.submit(lambda e: e.free_reservation(key))
