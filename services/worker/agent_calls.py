"""One call on the kvtransfer agent's local socket (`Call`, cancellable from another thread),
a handoff (`Send`), and a decode worker's write windows (`AgentWindow`, the lease book's
`WriteWindow`). The agent's errors come back as ServiceError with the agent's status code.

`AgentClient` (agent_client.py) builds these and hands them itself, held here as the two
protocols below: what a call and a window use of it, so this module never imports it back."""

from __future__ import annotations

import socket
import threading
from typing import Any, Protocol

from pdserve.common import localsock
from pdserve.common.errors import Aborted, ServiceError, Unavailable
from pdserve.common.handoff import TransferReport, report_from_json, ticket_to_json
from pdserve.common.tickets import TicketKey
from pdserve.worker.leases import WindowClosed


class Connections(Protocol):
    """The client's pool of connections to the agent's local socket, as a call uses it."""

    @property
    def timeout_s(self) -> float: ...

    def checkout(self) -> socket.socket:
        """An idle connection, or a new one; raises Unavailable."""
        ...

    def checkin(self, conn: socket.socket, reusable: bool) -> None:
        """Give the connection back: kept for the next call if `reusable`, else closed."""
        ...


class Caller(Protocol):
    """The client as a write window uses it: calls on the agent for its registered pool."""

    @property
    def timeout_s(self) -> float: ...

    @property
    def pool_id(self) -> str: ...

    def call(self, message: dict[str, Any], what: str,
             timeout_s: float | None = None) -> dict[str, Any]: ...


class Call:
    """One request/reply on the agent's local socket; `cancel()` (any thread) abandons it."""

    def __init__(self, client: Connections, message: dict[str, Any], what: str,
                 timeout_s: float | None):
        self._client = client
        self._message = message
        self._what = what
        self._timeout_s = timeout_s or client.timeout_s
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._cancelled = False

    def result(self) -> dict[str, Any]:
        with self._lock:
            if self._cancelled:
                raise Aborted(f"the {self._what} was cancelled")
        conn = self._client.checkout()
        with self._lock:
            self._conn = conn
        reusable = False
        try:
            conn.settimeout(self._timeout_s)
            reply, _ = localsock.call(conn, self._message)
            reusable = True
        except TimeoutError:
            raise ServiceError(f"{self._what}: the kvtransfer agent did not answer within "
                               f"{self._timeout_s:.1f}s", "DEADLINE_EXCEEDED") from None
        except (OSError, localsock.Closed, ValueError) as exc:
            if self._cancelled:
                raise Aborted(f"the {self._what} was cancelled") from None
            raise Unavailable(f"{self._what}: the kvtransfer agent's local socket failed: "
                              f"{exc}") from None
        finally:
            with self._lock:
                self._conn = None
            self._client.checkin(conn, reusable and not self._cancelled)
        raise_for(reply, self._what)
        return reply

    def cancel(self) -> None:
        with self._lock:
            self._cancelled = True
            conn = self._conn
        if conn is not None:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the thread waiting in result()
            except OSError:
                pass


def raise_for(reply: dict[str, Any], what: str) -> None:
    if reply.get("error"):
        raise ServiceError(f"{what} failed: {reply.get('message', '')}",
                           str(reply.get("code", "INTERNAL")))


class Send:
    """A handoff: `result()` runs it (in the calling thread), `cancel()` gives up."""

    def __init__(self, call: Call):
        self._call = call

    def prepare(self) -> None:
        """Nothing: the agent's handoff starts in `result`."""

    def begin(self) -> bool:
        """Nothing (as `prepare`)."""
        return False

    def result(self) -> TransferReport:
        """The sending agent's report. Raises `Aborted` once cancelled, `ServiceError` with
        the agent's status when the handoff failed."""
        return report_from_json(self._call.result()["report"])

    def settle(self) -> None:
        """Nothing: the agent counted the handoff itself."""

    def cancel(self) -> None:
        self._call.cancel()


class AgentWindow:
    """A decode worker's write windows on its agent (the lease book's `WriteWindow`)."""

    def __init__(self, agent: Caller):
        self._agent = agent

    def open(self, key: TicketKey, page_ids: list[int], lease_s: float) -> None:
        self._agent.call({"op": "expect", "ticket": ticket_to_json(key),
                          "pool_id": self._agent.pool_id, "page_ids": page_ids,
                          "lease_ms": lease_s * 1e3}, "ExpectTransfer")

    def close(self, key: TicketKey) -> WindowClosed:
        """CancelTransfer: answers once no write for the ticket is in flight. An agent that is
        gone (UNAVAILABLE) cannot write either: confirmed, nothing landed."""
        try:
            # The agent may wait for an in-flight write to stop before it answers (its
            # --cancel-wait-s); give it longer than that, so "timed out" means it could not.
            reply = self._agent.call({"op": "cancel", "ticket": ticket_to_json(key)},
                                     "CancelTransfer", timeout_s=2 * self._agent.timeout_s)
        except ServiceError as exc:
            if exc.code == "UNAVAILABLE":
                return WindowClosed(confirmed=True, landed=False)
            raise
        return WindowClosed(confirmed=True, landed=bool(reply["was_complete"]))
