"""The router's heartbeat for the decode reservations it holds: leases that follow the work.

A reservation made with `renew_lease_ms` lapses on its decode worker once no renewal came for
that long. While a request is between Reserve and the start of its decode stream (queued,
prefilling, handing off), its `ReservationHandle` is held here, and one thread renews every
held ticket, in one `Decode/Renew` call per decode worker, every quarter of the lease: a
prefill longer than the lease keeps its pages, and when this router dies its reservations
come back within one lease instead of after the longest prefill it would have waited for.

A renewal that fails is logged with the decode worker it was for (at most once per worker
until one succeeds again); the lease then runs out on its own, which is what it is for.
Tickets the worker says it no longer holds are dropped, and their handle remembers it
(`not_held`), so the attempt can report it when its decode start fails.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import grpc
from pdserve.v1 import common_pb2, decode_pb2, decode_pb2_grpc

log = logging.getLogger("pdserve.router")

MIN_INTERVAL_S = 0.05


class Renewable(Protocol):
    """What the keeper needs of a reservation handle."""

    address: str
    ticket: common_pb2.Ticket
    stub: decode_pb2_grpc.DecodeStub

    def mark_not_held(self) -> None: ...


class LeaseKeeper:
    """Renews the held reservations of every decode worker in a background thread."""

    def __init__(self, renew_lease_s: float, *, rpc_timeout_s: float = 1.0):
        self.renew_lease_s = renew_lease_s
        self.interval_s = max(MIN_INTERVAL_S, renew_lease_s / 4)
        self._rpc_timeout_s = min(rpc_timeout_s, max(self.interval_s, MIN_INTERVAL_S))
        self._lock = threading.Lock()
        self._held: dict[str, dict[str, Renewable]] = {}  # address -> request id -> handle
        self._failing: set[str] = set()  # addresses whose last renewal failed (logged once)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-keeper", daemon=True)
        self._thread.start()

    def hold(self, handle: Renewable) -> None:
        with self._lock:
            self._held.setdefault(handle.address, {})[handle.ticket.request_id] = handle

    def drop(self, handle: Renewable) -> None:
        with self._lock:
            held = self._held.get(handle.address)
            if held is not None and held.get(handle.ticket.request_id) is handle:
                del held[handle.ticket.request_id]

    def held(self) -> int:
        with self._lock:
            return sum(len(held) for held in self._held.values())

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.interval_s + self._rpc_timeout_s + 1.0)

    def renew_now(self) -> None:
        """One round: a Renew call per decode worker with held tickets, in parallel, bounded."""
        with self._lock:
            rounds = [(address, list(held.values())) for address, held in self._held.items()
                      if held]
        calls = []
        for address, handles in rounds:
            request = decode_pb2.RenewRequest(tickets=[h.ticket for h in handles],
                                              renew_lease_ms=self.renew_lease_s * 1e3)
            try:  # any handle's stub reaches the worker (it may have left the pool: closed)
                calls.append((address, handles, handles[0].stub.Renew.future(
                    request, timeout=self._rpc_timeout_s)))
            except ValueError as exc:
                self._failed(address, len(handles), str(exc))
        for address, handles, call in calls:
            try:
                not_held = set(call.result().not_held)
            except grpc.RpcError as exc:
                self._failed(address, len(handles), f"{exc.code().name} {exc.details()}")
                continue
            self._failing.discard(address)
            for handle in handles:
                if handle.ticket.request_id in not_held:
                    handle.mark_not_held()
                    self.drop(handle)

    def _failed(self, address: str, count: int, why: str) -> None:
        if address not in self._failing:
            self._failing.add(address)
            log.warning("renewing %d reservation(s) on decode %s failed: %s; they lapse within "
                        "%.1f s unless a renewal gets through", count, address, why,
                        self.renew_lease_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.renew_now()
            except Exception:  # never let the heartbeat die: every lease would lapse
                log.exception("lease renewal round failed")
