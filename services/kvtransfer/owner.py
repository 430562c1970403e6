"""What the agent's two halves see of the agent that owns them.

The agent (agent.py) builds its receiving side (receive.py: one sink per data path) and its
sending side (sender.py) and hands each itself. They hold it as these protocols, which list
everything they read, so neither imports the agent module back: imports run agent -> sender
-> receive -> owner, never the other way.
"""

from __future__ import annotations

from typing import Protocol

from pdserve.common.metrics import AgentMetrics
from pdserve.kvtransfer.peers import PeerDirectory
from pdserve.kvtransfer.pool import Pool
from pdserve.kvtransfer.shm import ShmSender
from pdserve.kvtransfer.tickets import TicketBook
from pdserve.kvtransfer.transport import PeerContact, Transport


class ReceivingAgent(Protocol):
    """What a sink checks an incoming write against and counts it in."""

    @property
    def agent_id(self) -> str: ...

    @property
    def epoch(self) -> int: ...

    @property
    def metrics(self) -> AgentMetrics: ...

    @property
    def tickets(self) -> TicketBook: ...

    def pool(self, pool_id: str) -> Pool:
        """The registered pool; raises UnknownPool."""
        ...


class SendingAgent(ReceivingAgent, Protocol):
    """What the sender reads besides: its peers, the paths pages can take, the defaults. The
    sender also copies into this agent's own pools, as a receiver (hence the base)."""

    @property
    def default_timeout_s(self) -> float: ...

    @property
    def peers(self) -> PeerDirectory: ...

    @property
    def ask_grants(self) -> bool: ...

    @property
    def contact(self) -> PeerContact: ...

    @property
    def shm(self) -> ShmSender | None: ...

    @property
    def transport(self) -> Transport: ...
