"""The same-host copy's own cases, with real agents: where it cannot be used (the receiver's
socket unreachable from the sender, or another agent's) the handoff falls back to the network
transport and still lands byte-exact, also when a prefill worker's own lane asked for it; a
sender's pool mapped by a receiver is unmapped there once its worker is gone. (Its refusals,
cancel and restart cases run with the other transports' in test_kvtransfer.py, the lane's
too.)"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from pdserve.common.errors import ServiceError
from pdserve.common.kv.relayout import ColumnSpec
from pdserve.common.shm import memfd_mappings
from pdserve.common.wire import destination_from_pb, fingerprint_from_pb, ticket_from_pb
from pdserve.v1 import common_pb2
from pdserve.worker.samehost import Relayout, SameHostLane

from tests.service.test_kvtransfer import (
    FP,
    NUM_PAGES,
    PAGE_BYTES,
    Agent,
    Pair,
    Pool,
    agent,
    expect,
    new_ticket,
    send,
)
from tests.support import free_port, wait_for

pytestmark = pytest.mark.service


@pytest.fixture
def socket_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sockets")


def _pair(sender: Agent, receiver: Agent, src: Pool | None = None) -> Pair:
    return Pair("shm", sender, receiver, src or Pool(sender.stub, "prefill-0", seed=1,
                                                     num_pages=16),
                Pool(receiver.stub, "decode-0", seed=2, num_pages=16))


def _handoff(pair: Pair, src_pages: list[int], dst_pages: list[int]) -> str:
    ticket = new_ticket()
    expect(pair.receiver, pair.dst, ticket, dst_pages)
    report = send(pair, ticket, src_pages, dst_pages)
    for s, d in zip(src_pages, dst_pages):
        assert np.array_equal(pair.dst.page(d), pair.src.page(s)), f"page {s} -> {d}"
    return report.transport


def test_a_socket_the_sender_cannot_use_falls_back_to_the_network(socket_dir: Path) -> None:
    """As pods on one node whose socket directories are not shared: a receiver advertises a
    path that, from the sender, leads nowhere (b), or to another agent (c: to the sender)."""
    sockets = {name: socket_dir / f"{name}.sock" for name in "abc"}
    with agent(free_port(), "--transport", "tcp", "--local-socket", str(sockets["a"])) as a, \
            agent(free_port(), "--transport", "tcp", "--local-socket", str(sockets["b"])) as b, \
            agent(free_port(), "--transport", "tcp", "--local-socket", str(sockets["c"])) as c:
        first = _pair(a, b)
        pairs = [first, _pair(a, c, first.src)]
        try:
            sockets["b"].unlink()
            sockets["c"].unlink()
            sockets["c"].symlink_to(sockets["a"])
            # A worker's lane, asked first: its agent has not tried b yet and lets it try; it
            # cannot reach b's socket either, so the handoff goes through the agent.
            assert _handoff(replace(first, lane=True), [10], [11]) == "tcp"
            assert first.src._lanes[0][1].copied == 0
            for pair in pairs:
                assert _handoff(pair, [1, 2, 3], [4, 5, 6]) == "tcp"
                assert _handoff(pair, [7], [8]) == "tcp"  # remembered: no second attempt
            log = a.proc.output()
            assert log.count("not reachable on this host") == 2, log[-2000:]
            assert "cannot be reached from here" in log and "belongs to another agent" in log
        finally:
            for pair in pairs:
                pair.src.close()
                pair.dst.close()


def test_a_lane_that_cannot_reach_the_receivers_socket_sends_over_tcp_itself(socket_dir: Path
                                                                              ) -> None:
    """A worker's lane with the network on: the receiver's socket is unreachable from this
    host, so the first handoff goes through the agent and the lane asks its agent again, which
    now knows the receiver is remote and offers its TCP data port; later handoffs the lane
    sends over TCP itself, byte-exact."""
    sockets = {name: socket_dir / f"{name}.sock" for name in "ab"}
    with agent(free_port(), "--transport", "tcp", "--local-socket", str(sockets["a"])) as a, \
            agent(free_port(), "--transport", "tcp", "--local-socket", str(sockets["b"])) as b:
        pair = replace(_pair(a, b), lane=True)
        try:
            sockets["b"].unlink()
            lane = pair.src.lane(a, network=True)
            assert _handoff(pair, [1], [2]) == "tcp" and lane.copied == 0  # through the agent
            assert _handoff(pair, [3, 4, 5], [6, 7, 8]) == "tcp" and lane.copied == 1
            assert _handoff(pair, [9], [10]) == "tcp" and lane.copied == 2
            log = a.proc.output()
            assert log.count("not reachable on this host") == 1, log[-2000:]
            assert "a worker here cannot reach its local socket" in log
        finally:
            pair.src.close()
            pair.dst.close()


@pytest.mark.parametrize("lane", [False, True], ids=["agent", "lane"])
def test_a_receiver_unmaps_a_senders_pool_once_its_worker_is_gone(lane: bool) -> None:
    with agent(free_port(), "--transport", "tcp") as a, \
            agent(free_port(), "--transport", "tcp") as b:
        pair = replace(_pair(a, b), lane=lane)
        try:
            assert _handoff(pair, [0, 1], [2, 3]) == "shm"
            receiver_pid = b.proc.proc.pid
            assert memfd_mappings(receiver_pid) == 2  # its own pool, the sender's (read-only)
            pair.src.close()  # the prefill worker goes away
            assert wait_for(lambda: memfd_mappings(receiver_pid) == 1, timeout_s=10)
            assert wait_for(lambda: memfd_mappings(a.proc.proc.pid) == 0, timeout_s=10)
        finally:
            pair.src.close()
            pair.dst.close()


def _relayout_lane(src: list[Pool], sender: Agent, columns: list[tuple[int, int, int]]
                   ) -> SameHostLane:
    """A lane whose writes fill each destination row from `columns` (pool index, source
    byte, destination byte, width) of the source pools' rows, as a TP prefill worker's."""
    lanes = [pool.lane(sender) for pool in src]
    client = src[0]._lanes[0][0]
    fingerprint = fingerprint_from_pb(FP)
    assert fingerprint is not None
    specs = [ColumnSpec(lanes[i].pool_key, NUM_PAGES, PAGE_BYTES, ROW, s, d, w)
             for i, s, d, w in columns]
    lane = SameHostLane(client, src[0].segment.fd, NUM_PAGES, PAGE_BYTES, fingerprint,
                        "relayout", Relayout([(ln.pool_key, ln.readonly_fd) for ln in lanes],
                                             specs, ROW))
    src[0]._lanes.append((client, lane))  # closed with the pool (the client only once)
    return lane


ROW = 2 * 16 * 4  # a page row of FP's layout: 2 KV heads x 16 x fp32


def test_a_relayout_write_fills_each_row_from_its_sources_and_a_bad_one_lands_nothing():
    """The same-host write between TP splits: the receiving agent fills each reserved page's
    rows with head 0 of one pool and head 1 of another. Columns that do not fill the rows are
    refused naming why, nothing lands, and the ticket still takes the right write."""
    with agent(free_port(), "--transport", "tcp") as a, \
            agent(free_port(), "--transport", "tcp") as b:
        src = [Pool(a.stub, "prefill-0", seed=1), Pool(a.stub, "prefill-0/tp1", seed=3)]
        dst = Pool(b.stub, "decode-0", seed=2)
        try:
            half = ROW // 2
            bad = _relayout_lane(src, a, [(0, 0, 0, half), (1, half, half + 16, half - 16)])
            good = _relayout_lane(src, a, [(1, half, half, half), (0, 0, 0, half)])
            ticket = new_ticket()
            expect(b, dst, ticket, [7, 8, 9])
            before = dst.snapshot()
            destination = destination_from_pb(common_pb2.KVDestination(
                agent_address=b.address, pool_id=dst.pool_id, page_ids=[7, 8, 9],
                agent_epoch=dst.agent_epoch, fingerprint=FP))
            with pytest.raises(ServiceError, match="re-layout columns do not fill the "
                                                   "destination's 128-byte rows") as refused:
                bad.send(ticket_from_pb(ticket), "", [3, 4, 5], destination, 10).result()
            assert refused.value.code == "INVALID_ARGUMENT"
            assert np.array_equal(dst.snapshot(), before)
            report = good.send(ticket_from_pb(ticket), "", [3, 4, 5], destination, 10).result()
            assert report.transport == "shm" and report.kv_pages == 3
            for s, d in zip([3, 4, 5], [7, 8, 9]):
                rows = dst.page(d).reshape(-1, ROW)
                assert np.array_equal(rows[:, :half], src[0].page(s).reshape(-1, ROW)[:, :half])
                assert np.array_equal(rows[:, half:], src[1].page(s).reshape(-1, ROW)[:, half:])
        finally:
            for pool in (*src, dst):
                pool.close()
