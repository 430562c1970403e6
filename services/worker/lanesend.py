"""One handoff over a worker's own lane (pdserve.worker.samehost), or through the agent where
the lane cannot take it; `cancel()` from any thread gives up either way.

An eager TCP handoff can be made ready by `prepare()` on the request's thread while the
prompt's last chunk computes (route, runs, header, a connection) and started by `begin()` on
the engine's thread the moment its KV is ready (the bytes the socket takes without waiting, in
one call); `result()` finishes it on the request's thread. That takes the hop from the engine's
step to the request's thread and the lane's Python off the time before the first byte is on the
wire (docs/kv-transfer.md).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pdserve.common.errors import Aborted
from pdserve.common.handoff import Destination, TransferReport
from pdserve.common.kv.runs import PageRun
from pdserve.common.kv.tcpwire import Prepared
from pdserve.common.kv.wire import WriteHeader
from pdserve.common.tickets import TicketKey


@dataclass(frozen=True)
class Route:
    """A destination agent this worker copies to itself."""

    agent_id: str
    local_socket: str
    token: bytes
    sender: str  # this host's agent's id: the receiver counts the bytes as that peer's
    tcp_address: str = ""  # set: another host's agent, over TCP (pdserve.worker.netlane)
    write_bytes: int = 0
    buffer_bytes: int = 0


class Lane(Protocol):
    """What a LaneSend asks of its lane (pdserve.worker.samehost.SameHostLane)."""

    def known_route(self, dest: Destination) -> Route | None: ...

    def route(self, dest: Destination) -> Route | None: ...

    def prepare(self, s: LaneSend) -> Started | None: ...

    def copy(self, s: LaneSend) -> TransferReport: ...

    def note(self, message: dict[str, object]) -> None: ...


class Fallback(Protocol):
    """How a part goes when the lane cannot take it (the agent's `Send`, or a packed one)."""

    def prepare(self) -> None: ...

    def begin(self) -> bool: ...

    def result(self) -> TransferReport: ...

    def settle(self) -> None: ...

    def cancel(self) -> None: ...


class UseAgent(Exception):
    """The lane cannot take this handoff: send it through the agent."""


class Started:
    """What `prepare` made: the handoff's runs and header, and its connection with its bytes
    (and how many of them `begin` wrote)."""

    def __init__(self, runs: list[PageRun], header: WriteHeader, prepared: Prepared):
        self.runs, self.header, self.prepared = runs, header, prepared


class LaneSend:
    def __init__(self, lane: Lane, ticket: TicketKey, src_page_ids: list[int],
                 dest: Destination, timeout_s: float, through_agent: Callable[[], Fallback]):
        self._route: Route | None = None  # found when the part goes (None: through the agent)
        self.ticket, self.src_page_ids = ticket, src_page_ids
        self.dest, self.timeout_s = dest, timeout_s
        self._lane = lane
        self._through_agent = through_agent
        self._fallback: Fallback | None = None
        self.note: dict[str, object] | None = None  # what this host's agent is told after
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._started: Started | None = None
        self.cancelled = False

    @property
    def route(self) -> Route:
        """The lane's route (only once the lane has taken the part)."""
        assert self._route is not None
        return self._route

    def prepare(self) -> None:
        """Make the handoff ready for `begin` where the lane can (the request's thread)."""
        self._route = self._lane.route(self.dest)
        started = self._lane.prepare(self) if self._route is not None else None
        if started is None:
            return
        with self._lock:
            if not self.cancelled:
                self._started = started
                return
        started.prepared.conn.close()

    def begin(self) -> bool:
        """Write what the socket takes of a prepared handoff, without waiting (the engine's
        thread, as the KV becomes ready; True if it wrote); under the lock, so a cancel never
        closes the connection in the middle of it."""
        with self._lock:
            if self._started is None or self.cancelled:
                return False
            self._started.prepared.push()
            return not self._started.prepared.broken

    def started(self) -> Started | None:
        """What `prepare` made, taken (once) by the lane's copy."""
        with self._lock:
            started, self._started = self._started, None
        return started

    def result(self) -> TransferReport:
        if self.cancelled:
            raise Aborted("the KV handoff was cancelled")
        self._route = self._route or self._lane.route(self.dest)
        if self._route is not None:
            try:
                return self._lane.copy(self)
            except UseAgent:
                pass
        with self._lock:
            if self.cancelled:
                raise Aborted("the KV handoff was cancelled") from None
            fallback = self._fallback = self._through_agent()
        return fallback.result()

    def settle(self) -> None:
        """Tell this host's agent what the lane sent (it counts the bytes as its own)."""
        if self.note is not None:
            self._lane.note(self.note)
            self.note = None
        elif self._fallback is not None:
            self._fallback.settle()

    def attach(self, sock: socket.socket | None) -> None:
        with self._lock:
            self._sock = sock
            cancelled = self.cancelled
        if sock is not None and cancelled:
            _hang_up(sock)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            sock, fallback, started = self._sock, self._fallback, self._started
            self._started = None
        if sock is not None:
            _hang_up(sock)  # wakes the thread waiting for the receiver's reply
        if started is not None:  # prepared, never finished: nobody else holds the connection
            started.prepared.conn.close()
        if fallback is not None:
            fallback.cancel()


def _hang_up(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
