"""The receiving side of an agent: the `WriteSink` each data path (a transport, the same-host
copy, a local copy) hands incoming writes to.

`accept` checks a write header against what the decode worker's `expect` registered (the
destination agent's epoch, the pool, its layout and page size, the ticket's lease and its
reserved pages) and opens the write; `finish` closes it (every byte resident, or not) and
counts it under the data path's name. Nothing is written before `accept` returned.

A sink holds its agent as a `ReceivingAgent` (owner.py): what it reads, not the agent module.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.common import failpoints
from pdserve.common.kv.errors import BadRequest, StaleEpoch, cause
from pdserve.common.kv.runs import check_page_ids, check_spans
from pdserve.common.kv.wire import WriteHeader, expect_same
from pdserve.kvtransfer.owner import ReceivingAgent
from pdserve.kvtransfer.transport import IncomingWrite


class AgentSink:
    """The agent's checks and bookkeeping for writes arriving over one data path."""

    def __init__(self, agent: ReceivingAgent, transport: str):
        self._agent = agent
        self.transport = transport

    def accept(self, header: WriteHeader) -> IncomingWrite:
        """Check an incoming handoff against what `expect` registered; open the write."""
        try:
            return self._accept(header)
        except Exception as exc:
            self._agent.metrics.failed(cause(exc), "receive")
            raise

    def _accept(self, header: WriteHeader) -> IncomingWrite:
        agent = self._agent
        if header.dst_agent_epoch != agent.epoch:
            raise StaleEpoch(f"agent {agent.agent_id} is at epoch {agent.epoch}, the handoff was "
                             f"addressed to epoch {header.dst_agent_epoch}: the agent restarted "
                             "since the pages were reserved")
        pool = agent.pool(header.dst_pool_id)
        expect_same(pool.fingerprint, header.fingerprint, "destination", "source")
        if header.page_bytes != pool.page_bytes:
            raise BadRequest(f"page_bytes: source {header.page_bytes} != destination "
                             f"{pool.page_bytes}")
        try:
            check_spans(header.dst_runs, pool.num_pages, "destination pages")
        except ValueError as exc:
            raise BadRequest(str(exc) if "destination pages" in str(exc)
                             else f"destination runs: {exc}") from None
        exp = agent.tickets.begin_write(header.ticket, pool.pool_id, spans=header.dst_runs)
        failpoints.hit("kv.receive", header.ticket.request_id)
        views = [pool.pages(start, n) for start, n in header.dst_runs]  # raise if closed
        return IncomingWrite(header, views, exp.abort, exp, dst_addresses=[
            pool.address + start * pool.page_bytes for start, _ in header.dst_runs])

    def finish(self, write: IncomingWrite, ok: bool) -> None:
        agent = self._agent
        kv_bytes = write.header.kv_bytes
        try:
            agent.tickets.finish_write(write.handle, ok, kv_bytes)
        except Exception as exc:
            agent.metrics.failed(cause(exc), "receive")
            raise
        if ok:
            count_received(agent, self.transport, write.header)
        else:
            agent.metrics.failed("incomplete", "receive")


def count_received(agent: ReceivingAgent, transport: str, header: WriteHeader) -> None:
    """A write that landed whole, in the agent's byte counters."""
    agent.metrics.received(transport, header.kv_bytes, sum(n for _, n in header.dst_runs),
                           header.sender)


def check_pages(page_ids: Sequence[int], num_pages: int, what: str) -> None:
    """Raise BadRequest naming `what` unless the ids are in the pool and unique."""
    try:
        check_page_ids(page_ids, num_pages, what)
    except ValueError as exc:
        raise BadRequest(str(exc)) from None
