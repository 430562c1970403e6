"""What a KV handoff is, as plain types shared by the workers and the kvtransfer agents:
where the pages land (`Destination`) and what moving them took (`TransferReport`).
Standard library only; the gRPC messages of the same names are their wire form."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.layout import LayoutFingerprint


@dataclass(frozen=True)
class Destination:
    """The reserved pages on a decode host: its agent, the agent's epoch when they were
    reserved, the pool and the page ids, and the pool's layout."""

    agent_address: str
    agent_epoch: int
    pool_id: str
    page_ids: tuple[int, ...]
    fingerprint: LayoutFingerprint | None


@dataclass(frozen=True)
class TransferReport:
    """One handoff as the sending agent measured it (all zero when nothing moved)."""

    handoff_ms: float = 0.0
    kv_bytes: int = 0
    kv_pages: int = 0
    transport: str = ""  # "ucx", "tcp", "local", or "" when no handoff ran
    num_runs: int = 0
