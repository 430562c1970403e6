"""The engine's pool as a lease book's `PageStore`: reservations taken and freed on the
engine loop's thread."""

from __future__ import annotations

from pdserve.common.tickets import TicketKey
from pdserve.engine.engine import Engine
from pdserve.engine.loop import EngineLoop
from pdserve.engine.pool import OutOfPages
from pdserve.worker.leases import NoRoom, ReservedPages


class EnginePages:
    def __init__(self, loop: EngineLoop):
        self._loop = loop

    def reserve(self, key: TicketKey, num_prompt_tokens: int,
                prompt_ids: list[int] | None = None) -> ReservedPages:
        def take(e: Engine) -> ReservedPages:
            if prompt_ids is None:
                return ReservedPages(e.reserve(key, num_prompt_tokens))
            taken = e.reserve_prompt(key, prompt_ids)
            assert taken is not None  # None only with an uncached_below limit
            cached, new, boundary_key = taken
            return ReservedPages(new, cached, boundary_key)
        try:
            return self._loop.submit(take)
        except OutOfPages as exc:
            raise NoRoom(str(exc)) from None

    def free(self, key: TicketKey) -> None:
        self._loop.submit(lambda e: e.free_reservation(key))
