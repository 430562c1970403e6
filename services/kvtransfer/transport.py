"""The data-path contract every transport (UCX, TCP) implements.

A transport moves the runs of one handoff from local pool memory to a remote agent's pool
memory, by buffer, and reports completion only when the receiver has acknowledged that every
byte is resident. The protocol is the same on both (see `wire`): the sender pushes a
`WriteHeader`; the receiver asks its `WriteSink` (the agent) to accept it, which checks the
ticket, the agent epoch, the pool, the pages and the layout and either refuses (a `Reply` with
the error goes back, nothing is written) or hands out the destination views; only then does the
sender send the runs, which land straight in those views; the receiver acknowledges with a
final `Reply`.

Rules every implementation keeps:
- No KV byte is copied through Python objects: sends read pool views, receives write into them.
- Every wait is bounded (the sender's timeout, carried in the header, bounds the receiver).
- The sender calls `liveness()` about once a second while it waits; the agent uses it to ask
  the control plane whether the peer restarted or vanished (peer failure is detected there).
- A receiver that sees `IncomingWrite.abort` set (the ticket was cancelled) stops writing
  before it calls `WriteSink.finish(ok=False)`; after `finish` it never touches the views.
- Errors are `pdserve.common.kv.errors` classes; refusals come back as the receiver's class.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from pdserve.common.kv.errors import KvTransferError
from pdserve.common.kv.wire import Liveness, WriteHeader

if TYPE_CHECKING:
    from pdserve.kvtransfer.native import NativeReceiver

__all__ = ["IncomingWrite", "Liveness", "PeerContact", "Transport", "WriteSink",
           "receive_deadline_s"]


@dataclass(frozen=True)
class PeerContact:
    """How to reach an agent's data path (from its AgentInfo)."""

    agent_id: str
    ucx_worker_address: bytes = b""
    tcp_address: str = ""  # host:port


@dataclass
class IncomingWrite:
    """An accepted write: destination views (one per run, in header order) and an abort flag."""

    header: WriteHeader
    dst_views: list[np.ndarray]
    abort: threading.Event
    handle: Any = None  # the sink's own record of the write
    span: Any = None  # the write's trace span (pdserve.kvtransfer.traced), None when untraced
    # the views' first bytes' addresses, when the sink knows them (a copy by address then
    # need not ask numpy for them: ~10 us each on a handoff's critical path); () if not
    dst_addresses: Sequence[int] = ()


class WriteSink(Protocol):
    """The receiving agent, as a transport sees it."""

    def accept(self, header: WriteHeader) -> IncomingWrite:
        """Check the header; return where the runs go, or raise a KvTransferError to refuse."""
        ...

    def finish(self, write: IncomingWrite, ok: bool) -> None:
        """The write ended (all bytes resident when `ok`). Raises a KvTransferError when the
        ticket was closed meanwhile; the transport reports it to the sender."""
        ...


# Counts a write a native path served: its header, and None when every byte landed.
Landed = Callable[[WriteHeader, KvTransferError | None], None]


class Transport(ABC):
    """Moves page runs between agents; one instance per agent, used from many threads."""

    name: str = ""

    @abstractmethod
    def start(self, sink: WriteSink) -> PeerContact:
        """Start receiving (incoming writes go to `sink`); return this agent's contact."""

    @abstractmethod
    def send(self, peer: PeerContact, header: WriteHeader, src_views: Sequence[np.ndarray],
             timeout_s: float, liveness: Liveness | None = None) -> None:
        """Push one handoff; return once the receiver acknowledged every byte resident.

        `src_views[i]` holds the bytes of `header.dst_runs[i]`. Raises the receiver's refusal,
        `TransferTimeout` when `timeout_s` passes, `PeerUnavailable` when the peer is gone.
        """

    def lane_terms(self) -> dict[str, int] | None:
        """What a worker of this host needs to send to this transport's peers itself (its
        settings), or None when only the agent may (default). See the local socket's `peer`."""
        return None

    def forget(self, peer: PeerContact) -> None:
        """Drop cached connections to `peer` (it restarted or failed). Default: nothing."""
        return None

    def receive_natively(self, receiver: NativeReceiver | None, landed: Landed) -> None:
        """Let the native path serve armed tickets' writes arriving here,
        counting each with `landed`. Default: not offered (the sink serves every write)."""
        return None

    @abstractmethod
    def close(self) -> None:
        """Stop receiving and release resources; bounded in time, safe to call twice."""


def receive_deadline_s(header: WriteHeader, max_s: float = 600.0) -> float:
    """How long a receiver waits for a handoff's bytes: the sender's timeout, capped."""
    return min(max(header.timeout_ms / 1e3, 0.001), max_s)
