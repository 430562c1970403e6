"""What a KV handoff is, as plain types shared by the workers and the kvtransfer agents:
where the pages land (`Destination`) and what moving them took (`TransferReport`).
Standard library only; the gRPC messages of the same names are their wire form, and the
`*_to_json` / `*_from_json` pairs their form on the local socket between a worker and its
agent (pdserve.common.localsock)."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from pdserve.common.layout import LayoutFingerprint
from pdserve.common.tickets import TicketKey


@dataclass(frozen=True)
class Destination:
    """The reserved pages on a decode host: its agent, the agent's epoch when they were
    reserved, the pool and the page ids, and the pool's layout."""

    agent_address: str
    agent_epoch: int
    pool_id: str
    page_ids: tuple[int, ...]
    fingerprint: LayoutFingerprint | None
    # Prefix reuse: the decode side holds the prompt's first `first_page` pages already, so
    # page_ids[i] receives prompt page first_page + i; `boundary_key` is the prefix-cache key
    # of page first_page - 1 (0 when first_page is 0), for the sender to check.
    first_page: int = 0
    boundary_key: int = 0
    # A tensor-parallel decode worker (fingerprint.tp_size D > 1): the pools of its ranks
    # 1..D-1 (the same agent, epoch and page ids; each holds its own KV heads). This one is
    # rank 0's. The handoff is complete when every rank's pool has every page.
    ranks: tuple[Destination, ...] = ()

    def per_rank(self) -> list[Destination]:
        """Rank 0's destination and the others', each one pool (no `ranks` of its own)."""
        if not self.ranks:
            return [self]
        return [dataclasses.replace(self, ranks=()),
                *(dataclasses.replace(self, pool_id=r.pool_id, fingerprint=r.fingerprint)
                  for r in self.ranks)]


@dataclass(frozen=True)
class RankTransfer:
    """One decode rank's part of a handoff between tensor-parallel workers."""

    decode_rank: int
    prefill_rank_first: int  # the prefill ranks its KV heads came from
    prefill_rank_last: int
    kv_bytes: int
    handoff_ms: float
    total_ms: float
    transport: str
    # "" (no change of layout: equal splits), "receiver" (re-laid out in the receiving
    # agent's copy), "staging" (packed into the decode rank's layout on the prefill side)
    relayout: str


@dataclass(frozen=True)
class TransferReport:
    """One handoff as the sending agent measured it (all zero when nothing moved)."""

    handoff_ms: float = 0.0
    kv_bytes: int = 0
    kv_pages: int = 0
    transport: str = ""  # "shm", "ucx", "tcp", "local", or "" when no handoff ran
    num_runs: int = 0
    # The whole transfer's duration: time spent moving pages (per part, send -> resident,
    # summed). With pipelining (pages shipped chunk by chunk while prefill still runs)
    # `handoff_ms` is only its exposed part: KV of the whole prompt ready -> every page
    # resident. An agent's own report of one SendPages has the two equal.
    total_ms: float = 0.0
    ranks: tuple[RankTransfer, ...] = ()  # a handoff between tensor-parallel workers


def ticket_to_json(key: TicketKey) -> dict[str, Any]:
    return {"request_id": key.request_id, "epoch": key.epoch}


def ticket_from_json(obj: Any) -> TicketKey:
    """Raises ValueError (or KeyError/TypeError) on a malformed ticket."""
    return TicketKey(str(obj["request_id"]), int(obj["epoch"]))


def fingerprint_to_json(fp: LayoutFingerprint | None) -> dict[str, Any] | None:
    return None if fp is None else _fingerprint_json(fp)


def fingerprint_from_json(obj: Any) -> LayoutFingerprint | None:
    return None if obj is None else _fingerprint(**obj)


# A worker has one layout: made into JSON (and validated back) once, not once per handoff.
@functools.lru_cache(maxsize=64)
def _fingerprint_json(fp: LayoutFingerprint) -> dict[str, Any]:
    return dataclasses.asdict(fp)  # shared: callers only serialize it


@functools.lru_cache(maxsize=64)
def _fingerprint(**fields: Any) -> LayoutFingerprint:
    return LayoutFingerprint(**fields)


def destination_to_json(d: Destination) -> dict[str, Any]:
    return {"agent_address": d.agent_address, "agent_epoch": d.agent_epoch,
            "pool_id": d.pool_id, "page_ids": list(d.page_ids),
            "fingerprint": fingerprint_to_json(d.fingerprint), "first_page": d.first_page,
            "boundary_key": d.boundary_key,
            "ranks": [{"pool_id": r.pool_id, "fingerprint": fingerprint_to_json(r.fingerprint)}
                      for r in d.ranks]}


def destination_from_json(obj: Any) -> Destination:
    return Destination(str(obj["agent_address"]), int(obj["agent_epoch"]), str(obj["pool_id"]),
                       tuple(int(p) for p in obj["page_ids"]),
                       fingerprint_from_json(obj.get("fingerprint")),
                       int(obj.get("first_page", 0)), int(obj.get("boundary_key", 0)),
                       tuple(Destination("", 0, str(r["pool_id"]), (),
                                         fingerprint_from_json(r.get("fingerprint")))
                             for r in obj.get("ranks", ())))


def report_to_json(r: TransferReport) -> dict[str, Any]:
    return {"handoff_ms": r.handoff_ms, "kv_bytes": r.kv_bytes, "kv_pages": r.kv_pages,
            "transport": r.transport, "num_runs": r.num_runs, "total_ms": r.total_ms}


def report_from_json(obj: Any) -> TransferReport:
    return TransferReport(float(obj["handoff_ms"]), int(obj["kv_bytes"]), int(obj["kv_pages"]),
                          str(obj["transport"]), int(obj["num_runs"]),
                          float(obj.get("total_ms", obj["handoff_ms"])))
