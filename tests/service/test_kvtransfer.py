"""Real kvtransfer agents on loopback: handoffs land byte-exact, refusals write nothing, over
each data path: `shm` (two agents of one host: the receiver copies out of the sender's pool),
`lane` (the same, asked for by the prefill worker's own same-host lane instead of the sending
agent: pdserve.worker.samehost, run here in the test process as a worker runs it), `ucx` /
`tcp` (the same agents with the same-host copy turned off) and `tcp-lane` (tcp, sent by the
worker's own lane onto the receiver's TCP connection: pdserve.worker.netlane).

Pools are nameless segments created here and filled with known bytes; they are handed to the
agents as descriptors over their local sockets, exactly as a worker hands over its pool.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import numpy as np
import pytest
from google.protobuf import json_format
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pdserve.common import localsock
from pdserve.common.errors import ServiceError
from pdserve.common.shm import SharedSegment, leftover_segments
from pdserve.common.wire import (
    destination_from_pb,
    fingerprint_from_pb,
    report_to_pb,
    ticket_from_pb,
)
from pdserve.v1 import common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc
from pdserve.worker.agent_client import AgentClient
from pdserve.worker.samehost import LaneOptions, SameHostLane

from tests.support import ServiceProcess, free_port, running, wait_for

pytestmark = pytest.mark.service

FP = common_pb2.LayoutFingerprint(model_id="builtin-test", model_revision="r1", dtype="float32",
                                  num_layers=2, num_kv_heads=2, head_dim=16, block_size=4,
                                  tp_rank=0, tp_size=1)
PAGE_BYTES = 2 * 2 * 4 * 2 * 16 * 4  # layers x K,V x block x heads x head_dim x fp32
NUM_PAGES = 64
BIG_PAGES = 2048  # 8 MiB pools for the cancel-while-writing case
Code = grpc.StatusCode


def agent_argv(port: int, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pdserve.kvtransfer.main", "--port", str(port), *extra]


class Pool:
    """A nameless pool owned by the test, handed to an agent over its local socket (the pool
    lives on the agent as long as `conn` does, as a worker's)."""

    def __init__(self, stub: kvtransfer_pb2_grpc.KVTransferStub, worker_id: str, seed: int,
                 num_pages: int = NUM_PAGES, fingerprint: common_pb2.LayoutFingerprint = FP):
        self.segment = SharedSegment.create(num_pages * PAGE_BYTES, tag="kvtest")
        self.data = np.frombuffer(self.segment.buffer, dtype=np.uint8)
        self.data[:] = np.random.default_rng(seed).integers(0, 256, self.data.size, dtype=np.uint8)
        self.fingerprint = fingerprint
        self.conn = None
        self._lanes: list[tuple[AgentClient, SameHostLane]] = []
        try:
            address = stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(),
                                        timeout=10).local_socket
            self.conn = localsock.connect(address, 10)
            reply, _ = localsock.call(self.conn, {
                "op": "register", "worker_id": worker_id, "num_pages": num_pages,
                "page_bytes": PAGE_BYTES,
                "fingerprint": json_format.MessageToDict(fingerprint,
                                                         preserving_proto_field_name=True,
                                                         always_print_fields_with_no_presence=True)},
                fds=(self.segment.fd,))
            if reply.get("error"):
                raise RuntimeError(reply["message"])
        except BaseException:
            self.close()
            raise
        self.pool_id, self.agent_epoch = reply["pool_id"], reply["agent_epoch"]

    def page(self, i: int) -> np.ndarray:
        return self.data[i * PAGE_BYTES:(i + 1) * PAGE_BYTES]

    def snapshot(self) -> np.ndarray:
        return self.data.copy()

    def lane(self, sender: Agent, network: bool = False) -> SameHostLane:
        """This pool's worker's own lane, by way of `sender` (its host's agent): the same-host
        copy, and with `network` TCP to the receiver where the agent offers it."""
        client = AgentClient(sender.address)
        client.wait_ready(10)
        client.pool_id = self.pool_id
        fingerprint = fingerprint_from_pb(self.fingerprint)
        assert fingerprint is not None
        lane = SameHostLane(client, self.segment.fd, self.data.size // PAGE_BYTES, PAGE_BYTES,
                            fingerprint, f"worker-{self.pool_id}",
                            options=LaneOptions(network=network))
        self._lanes.append((client, lane))
        return lane

    def close(self) -> None:
        """The worker goes away: the agent drops the pool. Safe to call twice."""
        for client, lane in self._lanes:
            lane.close()
            client.close()
        self._lanes = []
        if self.conn is not None:
            self.conn.close()
            self.conn = None
        self.data = np.empty(0, dtype=np.uint8)
        self.segment.close()


@dataclass
class Agent:
    address: str
    stub: kvtransfer_pb2_grpc.KVTransferStub
    proc: ServiceProcess


@contextlib.contextmanager
def agent(port: int, *extra: str, env: dict[str, str] | None = None) -> Iterator[Agent]:
    address = f"127.0.0.1:{port}"
    with running(agent_argv(port, *extra), address, env=env) as proc, \
            grpc.insecure_channel(address) as channel:
        yield Agent(address, kvtransfer_pb2_grpc.KVTransferStub(channel), proc)
        assert proc.stop() == 0, proc.output()[-3000:]


@dataclass
class Pair:
    transport: str  # the data path handoffs take: shm, ucx or tcp
    sender: Agent
    receiver: Agent
    src: Pool
    dst: Pool
    lane: bool = False  # sent by the source pool's worker's own lane, not by SendPages


@pytest.fixture(scope="module", autouse=True)
def no_segments_left_behind() -> Iterator[None]:
    """Torn down after every other fixture of the module: all pools must be gone by then."""
    yield
    assert leftover_segments(os.getpid()) == []


PATHS = ["shm", "lane", "ucx", "tcp", "tcp-lane"]
LANES = {"lane": ("shm", True), "tcp-lane": ("tcp", True)}  # path -> (transport, lane)


@pytest.fixture(scope="module", params=PATHS)
def pair(request: pytest.FixtureRequest) -> Iterator[Pair]:
    transport, lane = LANES.get(request.param, (request.param, False))
    # The TCP agents take their transport (and the same-host copy, off) from environment twins,
    # with 4 KiB writes (a page run crosses many) and fixed 1 MiB socket buffers.
    extra, env = {
        "shm": (("--transport", "tcp"), None),
        "ucx": (("--transport", "ucx", "--no-same-host-copy"), None),
        "tcp": ((), {"PDSERVE_KVTRANSFER_TRANSPORT": "tcp",
                     "PDSERVE_KVTRANSFER_SAME_HOST_COPY": "false",
                     "PDSERVE_KVTRANSFER_TCP_WRITE_KB": "4",
                     "PDSERVE_KVTRANSFER_TCP_BUFFER_MB": "1"}),
    }[transport]
    with agent(free_port(), *extra, env=env) as sender, \
            agent(free_port(), *extra, env=env) as receiver:
        src, dst = Pool(sender.stub, "prefill-0", seed=1), Pool(receiver.stub, "decode-0", seed=2)
        try:
            yield Pair(transport, sender, receiver, src, dst, lane)
        finally:
            src.close()
            dst.close()


_tickets = iter(range(1_000_000))


def new_ticket() -> common_pb2.Ticket:
    return common_pb2.Ticket(request_id=f"req-{next(_tickets)}", epoch=7, decode_worker="decode-0")


def expect(agent: Agent, pool: Pool, ticket: common_pb2.Ticket, pages: list[int],
           lease_ms: float = 10_000) -> int:
    return agent.stub.ExpectTransfer(kvtransfer_pb2.ExpectTransferRequest(
        ticket=ticket, pool_id=pool.pool_id, page_ids=pages, lease_ms=lease_ms),
        timeout=10).agent_epoch


def send(p: Pair, ticket: common_pb2.Ticket, src_pages: list[int], dst_pages: list[int], *,
         epoch: int | None = None, fingerprint: common_pb2.LayoutFingerprint | None = FP,
         src: Pool | None = None, dst: Pool | None = None, receiver: Agent | None = None,
         timeout_ms: float = 10_000) -> common_pb2.TransferReport:
    dst, receiver = dst or p.dst, receiver or p.receiver
    destination = common_pb2.KVDestination(
        agent_address=receiver.address, pool_id=dst.pool_id, page_ids=dst_pages,
        agent_epoch=dst.agent_epoch if epoch is None else epoch)
    if fingerprint is not None:
        destination.fingerprint.CopyFrom(fingerprint)
    if p.lane:
        src = src or p.src
        lane = (src.lane(p.sender, network=p.transport == "tcp") if not src._lanes
                else src._lanes[0][1])
        handoff = lane.send(ticket_from_pb(ticket), src.pool_id, src_pages,
                            destination_from_pb(destination), timeout_ms / 1e3)
        try:
            report = handoff.result()
        except ServiceError as exc:
            raise LaneError(exc) from None
        handoff.settle()  # as a shipment does once the part is timed: the agent's note
        return report_to_pb(report)
    return p.sender.stub.SendPages(kvtransfer_pb2.SendPagesRequest(
        ticket=ticket, src_pool_id=(src or p.src).pool_id, src_page_ids=src_pages,
        destination=destination, timeout_ms=timeout_ms), timeout=timeout_ms / 1e3 + 5).report


class LaneError(grpc.RpcError):
    """The lane's error (a ServiceError: the status the agent would give) as the gRPC call's."""

    def __init__(self, exc: ServiceError):
        super().__init__(exc.message)
        self._exc = exc

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode[self._exc.code]

    def details(self) -> str:
        return self._exc.message


def rpc_error(call, *args, **kwargs) -> grpc.RpcError:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


# ---- the happy path ---------------------------------------------------------------------

def test_handoff_lands_byte_exact_and_nothing_else_changes(pair: Pair) -> None:
    src_pages, dst_pages = [3, 4, 5, 6, 40, 41, 9], [10, 11, 12, 13, 30, 31, 50]
    ticket = new_ticket()
    expect(pair.receiver, pair.dst, ticket, dst_pages)
    before = pair.dst.snapshot()
    report = send(pair, ticket, src_pages, dst_pages)
    for s, d in zip(src_pages, dst_pages):
        assert np.array_equal(pair.dst.page(d), pair.src.page(s)), f"page {s} -> {d}"
    untouched = np.ones(before.size, dtype=bool)
    for d in dst_pages:
        untouched[d * PAGE_BYTES:(d + 1) * PAGE_BYTES] = False
    assert np.array_equal(pair.dst.data[untouched], before[untouched])
    assert report.kv_bytes == len(src_pages) * PAGE_BYTES
    assert report.kv_pages == len(src_pages)
    assert report.handoff_ms > 0
    assert report.transport == pair.transport
    assert report.num_runs == 3  # 3..6 -> 10..13, 9 -> 50, 40..41 -> 30..31
    if pair.lane:  # the worker's lane copied it itself, not through the sending agent
        assert pair.src._lanes[0][1].copied == 1
    status = pair.receiver.stub.TransferStatus(
        kvtransfer_pb2.TransferStatusRequest(ticket=ticket), timeout=10)
    assert status.complete and status.kv_bytes == report.kv_bytes
    assert status.completed_unix_ms > 0


def test_agent_info_health_and_reflection(pair: Pair) -> None:
    info = pair.receiver.stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(), timeout=10)
    network = "ucx" if pair.transport == "ucx" else "tcp"  # the shm pair's agents run TCP
    assert info.transport == network
    assert info.epoch == pair.dst.agent_epoch
    assert pair.dst.pool_id in info.pool_ids
    assert bool(info.ucx_worker_address) == (network == "ucx")
    assert bool(info.tcp_address) == (network == "tcp")
    assert info.local_socket and len(info.local_token) == 16
    assert info.same_host_copy == (pair.transport == "shm")
    with grpc.insecure_channel(pair.receiver.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=10)
        names = {s.name for r in replies for s in r.list_services_response.service}
    assert {"pdserve.v1.KVTransfer", "grpc.health.v1.Health"} <= names


# ---- refusals: an error back, not one byte written ----------------------------------------

def test_cancelled_ticket_is_refused(pair: Pair) -> None:
    ticket, pages = new_ticket(), [20, 21]
    expect(pair.receiver, pair.dst, ticket, pages)
    cancel = pair.receiver.stub.CancelTransfer(
        kvtransfer_pb2.CancelTransferRequest(ticket=ticket), timeout=10)
    assert cancel.was_pending and not cancel.was_complete
    before = pair.dst.snapshot()
    err = rpc_error(send, pair, ticket, [0, 1], pages)
    assert err.code() == Code.FAILED_PRECONDITION and "cancelled" in err.details()
    assert np.array_equal(pair.dst.data, before)


def test_expired_lease_is_refused(pair: Pair) -> None:
    ticket, pages = new_ticket(), [22, 23]
    expect(pair.receiver, pair.dst, ticket, pages, lease_ms=50)
    def expired() -> bool:  # polled until the agent reports the lease gone
        try:
            pair.receiver.stub.TransferStatus(kvtransfer_pb2.TransferStatusRequest(ticket=ticket),
                                              timeout=10)
        except grpc.RpcError as exc:
            assert exc.code() == Code.FAILED_PRECONDITION and "expired" in exc.details()
            return True
        return False

    assert wait_for(expired, timeout_s=10, interval_s=0.02), "lease never expired"
    before = pair.dst.snapshot()
    err = rpc_error(send, pair, ticket, [0, 1], pages)
    assert err.code() == Code.FAILED_PRECONDITION and "expired" in err.details()
    assert np.array_equal(pair.dst.data, before)


def test_layout_mismatch_names_the_field(pair: Pair) -> None:
    other_fp = common_pb2.LayoutFingerprint()
    other_fp.CopyFrom(FP)
    other_fp.model_revision = "r2"
    odd = Pool(pair.receiver.stub, "decode-odd", seed=3, num_pages=8, fingerprint=other_fp)
    try:
        ticket, pages = new_ticket(), [1, 2]
        expect(pair.receiver, odd, ticket, pages)
        before = odd.snapshot()
        # Caught by the sender from the destination's fingerprint ...
        err = rpc_error(send, pair, ticket, [0, 1], pages, dst=odd, fingerprint=other_fp)
        assert err.code() == Code.INVALID_ARGUMENT
        assert "model_revision: 'r1' != 'r2'" in err.details()
        # ... and by the receiver against its own pool when the request carries none.
        err = rpc_error(send, pair, ticket, [0, 1], pages, dst=odd, fingerprint=None)
        assert err.code() == Code.INVALID_ARGUMENT and "model_revision" in err.details()
        assert np.array_equal(odd.data, before)
    finally:
        odd.close()


def test_pages_other_than_the_reserved_ones_are_refused(pair: Pair) -> None:
    ticket = new_ticket()
    expect(pair.receiver, pair.dst, ticket, [24, 25, 26])
    before = pair.dst.snapshot()
    err = rpc_error(send, pair, ticket, [0, 1, 2], [24, 25, 27])
    assert err.code() == Code.INVALID_ARGUMENT and "not the pages reserved" in err.details()
    assert np.array_equal(pair.dst.data, before)


def test_unknown_ticket_duplicate_write_and_bad_requests(pair: Pair) -> None:
    err = rpc_error(send, pair, new_ticket(), [0], [28])
    assert err.code() == Code.NOT_FOUND and "unknown ticket" in err.details()
    ticket = new_ticket()
    expect(pair.receiver, pair.dst, ticket, [29])
    send(pair, ticket, [0], [29])
    err = rpc_error(send, pair, ticket, [1], [29])
    assert err.code() == Code.FAILED_PRECONDITION and "already landed" in err.details()
    cancel = pair.receiver.stub.CancelTransfer(
        kvtransfer_pb2.CancelTransferRequest(ticket=ticket), timeout=10)
    assert cancel.was_complete and not cancel.was_pending
    err = rpc_error(expect, pair.receiver, pair.dst, new_ticket(), [1], lease_ms=0)
    assert err.code() == Code.INVALID_ARGUMENT and "lease_ms" in err.details()
    err = rpc_error(expect, pair.receiver, pair.dst, new_ticket(), [NUM_PAGES])
    assert err.code() == Code.INVALID_ARGUMENT and "outside the pool" in err.details()
    err = rpc_error(send, pair, new_ticket(), [0, 1], [2])
    assert err.code() == Code.INVALID_ARGUMENT


def test_cancel_returns_only_when_nothing_writes_any_more(pair: Pair) -> None:
    src = Pool(pair.sender.stub, "prefill-big", seed=4, num_pages=BIG_PAGES)
    dst = Pool(pair.receiver.stub, "decode-big", seed=5, num_pages=BIG_PAGES)
    try:
        pages = list(range(BIG_PAGES))
        ticket = new_ticket()
        expect(pair.receiver, dst, ticket, pages)
        outcome: list[object] = []
        sender = threading.Thread(target=lambda: outcome.append(_try(
            send, pair, ticket, pages, pages, src=src, dst=dst)))
        sender.start()
        pair.receiver.stub.CancelTransfer(kvtransfer_pb2.CancelTransferRequest(ticket=ticket),
                                          timeout=30)
        after_cancel = dst.snapshot()
        sender.join(timeout=30)
        assert not sender.is_alive()
        # Whatever the interleaving, nothing landed after the cancel returned ...
        assert np.array_equal(dst.data, after_cancel)
        # ... and the handoff either finished first or was refused as cancelled.
        result = outcome[0]
        if isinstance(result, grpc.RpcError):
            assert result.code() == Code.FAILED_PRECONDITION, result.details()
            assert "cancelled" in result.details()
        else:
            assert np.array_equal(dst.data, src.data)
    finally:
        src.close()
        dst.close()


@pytest.mark.parametrize("num_pages", [512, 1500])
def test_refused_handoff_lands_nothing_and_the_next_one_lands(pair: Pair, num_pages: int
                                                              ) -> None:
    """A short handoff goes right behind its header (<= 1 MiB over tcp and over ucx), and over
    tcp a longer one's first MiB too, before "ready": a refused one's head is read away (tcp)
    or swallowed by receives posted for it (ucx), never lands, and leaves the connection in
    step for the next handoff, which lands whole."""
    src = Pool(pair.sender.stub, "prefill-eager", seed=8, num_pages=BIG_PAGES)
    dst = Pool(pair.receiver.stub, "decode-eager", seed=9, num_pages=BIG_PAGES)
    try:
        pages = list(range(num_pages))  # 1 MiB: the largest eager handoff on both, above
        # UCX's rendezvous threshold; ~2.9 MiB: a head and a rest over tcp
        before = dst.snapshot()
        err = rpc_error(send, pair, new_ticket(), pages, pages, src=src, dst=dst)
        assert err.code() == Code.NOT_FOUND and "unknown ticket" in err.details()
        assert np.array_equal(dst.data, before)
        ticket = new_ticket()
        expect(pair.receiver, dst, ticket, pages)
        report = send(pair, ticket, pages, pages, src=src, dst=dst)
        assert report.kv_bytes == len(pages) * PAGE_BYTES and report.num_runs == 1
        landed = slice(0, len(pages) * PAGE_BYTES)
        assert np.array_equal(dst.data[landed], src.data[landed])
        assert np.array_equal(dst.data[landed.stop:], before[landed.stop:])
    finally:
        src.close()
        dst.close()


def _try(fn, *args, **kwargs) -> object:  # noqa: ANN001
    try:
        return fn(*args, **kwargs)
    except grpc.RpcError as exc:
        return exc


# ---- same agent, restarts, configuration ---------------------------------------------------

def test_same_agent_copies_locally(pair: Pair) -> None:
    local = Pool(pair.sender.stub, "decode-local", seed=6, num_pages=8)
    try:
        ticket = new_ticket()
        expect(pair.sender, local, ticket, [5, 6])
        report = send(pair, ticket, [7, 8], [5, 6], dst=local, receiver=pair.sender)
        assert report.transport == "local" and report.num_runs == 1
        assert np.array_equal(local.page(5), pair.src.page(7))
        assert np.array_equal(local.page(6), pair.src.page(8))
    finally:
        local.close()


def test_a_worker_lane_asks_its_agent_where_and_whether_a_destination_lives() -> None:
    """The local socket's `peer` and `alive`, as a prefill worker's TCP lane asks them: the
    route is the receiver's data port with the agent's TCP settings, offered only to a lane
    that asks for the network; `alive` says live, restarted (stale) or gone."""
    flags = ("--transport", "tcp", "--no-same-host-copy", "--tcp-write-kb", "64")
    with agent(free_port(), *flags) as a, agent(free_port(), *flags) as b:
        client = AgentClient(a.address)
        client.wait_ready(10)
        try:
            info = b.stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(), timeout=10)
            ask = {"op": "peer", "address": b.address, "epoch": info.epoch}
            assert client.call(ask, "peer") == {"usable": False}
            route = client.call({**ask, "network": True}, "peer")
            assert route["usable"] and route["tcp_address"] == info.tcp_address
            assert route["agent_id"] == info.agent_id and route["write_bytes"] == 64 << 10
            alive = {"op": "alive", "address": b.address, "epoch": info.epoch}
            assert client.call(alive, "alive") == {"alive": True, "stale": False, "message": ""}
            stale = client.call({**alive, "epoch": info.epoch + 1}, "alive")
            assert stale["stale"] and not stale["alive"] and "restarted" in stale["message"]
            gone = client.call({**alive, "address": f"127.0.0.1:{free_port()}"}, "alive", 15)
            assert not gone["alive"] and not gone["stale"] and gone["message"]
        finally:
            client.close()


@pytest.mark.parametrize("path", PATHS)
def test_restarted_receiver_refuses_old_tickets_and_sender_rehandshakes(path: str) -> None:
    port = free_port()
    transport, lane = LANES.get(path, (path, False))
    flags = ("--transport", "tcp") if transport == "shm" else (
        "--transport", transport, "--no-same-host-copy")
    with agent(free_port(), *flags) as sender:
        src = Pool(sender.stub, "prefill-r", seed=7, num_pages=8)
        try:
            with agent(port, *flags) as receiver:
                dst = Pool(receiver.stub, "decode-r", seed=8, num_pages=8)
                pair = Pair(transport, sender, receiver, src, dst, lane)
                ticket = new_ticket()
                old_epoch = expect(receiver, dst, ticket, [1])
                send(pair, ticket, [0], [1])  # the sender now caches the receiver's info
                old_ticket = new_ticket()
                expect(receiver, dst, old_ticket, [2])
                dst.close()
            with agent(port, *flags) as receiver:
                dst = Pool(receiver.stub, "decode-r", seed=9, num_pages=8)
                assert dst.agent_epoch != old_epoch
                pair = Pair(transport, sender, receiver, src, dst, lane)
                before = dst.snapshot()
                err = rpc_error(send, pair, old_ticket, [3], [2], epoch=old_epoch)
                assert err.code() == Code.FAILED_PRECONDITION, err.details()
                assert "restarted" in err.details() and str(old_epoch) in err.details()
                # The reservation did not survive the restart either.
                err = rpc_error(send, pair, old_ticket, [3], [2])
                assert err.code() == Code.NOT_FOUND
                assert np.array_equal(dst.data, before)
                ticket = new_ticket()
                expect(receiver, dst, ticket, [2])
                assert send(pair, ticket, [3], [2]).transport == transport
                if lane:  # the lane found the restarted agent and copies to it again itself
                    assert src._lanes[0][1].copied == 2
                assert np.array_equal(dst.page(2), src.page(3))
                dst.close()
        finally:
            src.close()


@pytest.mark.parametrize("argv, env, message", [
    (["--transport", "carrier-pigeon"], {}, "invalid choice"),
    (["--port", "70000"], {}, "port=70000"),
    ([], {"PDSERVE_KVTRANSFER_DATA_PORT": "-1"}, "data_port=-1"),
    (["--advertise-host", "0.0.0.0"], {}, "advertise_host"),
    (["--tcp-write-kb", "0"], {}, "tcp_write_kb=0"),
    ([], {"PDSERVE_KVTRANSFER_TCP_BUFFER_MB": "-1"}, "tcp_buffer_mb=-1"),
])
def test_bad_configuration_exits_with_a_clear_message(argv: list[str], env: dict[str, str],
                                                       message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "pdserve.kvtransfer.main", *argv],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})
    assert done.returncode == 2
    assert message in done.stderr
