"""The sending half of the same-host copy's `shm_write` (pdserve.kvtransfer.shm has the
protocol and the receiving half): a checked connection to a same-host agent's local socket,
the request, the wait for its reply, the refusal in it. Used by a sending agent and by a
prefill worker's own same-host lane (pdserve.worker.samehost)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any

from pdserve.common import localsock
from pdserve.common.kv.errors import (
    PeerUnavailable,
    SegmentUnavailable,
    TransferTimeout,
    from_wire,
)
from pdserve.common.kv.runs import PageRun
from pdserve.common.kv.wire import LIVENESS_INTERVAL_S, WriteHeader

CONNECT_TIMEOUT_S = 2.0


def open_connection(local_socket: str, token: bytes, current_token: Callable[[], bytes]
                    ) -> socket.socket:
    """A connection to a same-host agent's local socket, checked to be that agent's: its hello
    carries the token the agent published (`token`, or `current_token()` when the agent was
    asked again). SegmentUnavailable when it cannot be reached from here or is another's."""
    try:
        sock = localsock.connect(local_socket, CONNECT_TIMEOUT_S)
    except (OSError, ValueError) as exc:
        raise SegmentUnavailable(f"its local socket {local_socket} cannot be reached "
                                 f"from here: {exc}") from None
    try:
        hello, _ = localsock.call(sock, {"op": "hello"})
        found = bytes.fromhex(str(hello.get("token", "")))
        if found != token and found != current_token():
            raise SegmentUnavailable(f"the socket {local_socket} belongs to another "
                                     f"agent ({hello.get('agent_id', '?')})")
    except (OSError, localsock.Closed, ValueError) as exc:
        sock.close()
        raise SegmentUnavailable(f"no answer on {local_socket}: {exc}") from None
    except BaseException:
        sock.close()
        raise
    return sock


def write_message(src_pool: str, src_num_pages: int, runs: list[PageRun]) -> dict[str, Any]:
    """The shm_write request for `runs` of the sender's pool (its header goes as the payload)."""
    return {"op": "shm_write", "src_pool": src_pool, "src_num_pages": src_num_pages,
            "src_runs": [[r.src_start, r.num_pages] for r in runs]}


def request_copy(sock: socket.socket, message: dict[str, Any], header: WriteHeader,
                 fds: tuple[int, ...], deadline: float, liveness: Callable[[], None],
                 receiver: str) -> dict[str, Any]:
    """Send one shm_write and wait for the receiver's reply (its refusal is in it:
    `raise_refusal`). PeerUnavailable (retryable) when the connection broke."""
    try:
        localsock.send(sock, message, header.encode(), fds)
        return wait_reply(sock, deadline, liveness)
    except (OSError, localsock.Closed, ValueError) as exc:
        raise PeerUnavailable(f"same-host connection to {receiver} broke: {exc}",
                              retryable=True) from None


def raise_refusal(reply: dict[str, Any]) -> None:
    """Raise what the receiver refused the write with (SegmentUnavailable: fall back)."""
    if reply.get("error"):
        error = from_wire(str(reply["error"]), str(reply.get("message", "")))
        if reply["error"] == "SegmentUnavailable":
            raise SegmentUnavailable(error.message)
        raise error


def wait_reply(sock: Any, deadline: float, liveness: Callable[[], None]) -> dict[str, Any]:
    """The receiver's reply; the peer's liveness is checked about once a second meanwhile."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TransferTimeout("timed out waiting for the same-host copy")
        sock.settimeout(min(LIVENESS_INTERVAL_S, remaining))
        try:
            return localsock.recv_reply(sock)[0]
        except TimeoutError:  # nothing of the reply yet: is the peer still there?
            liveness()
