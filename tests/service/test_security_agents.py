"""kvtransfer agents with mutual TLS, as real processes: handoffs still land byte-exact over
the same-host copy, UCX and TCP; callers without a certificate from the CA are refused on the
gRPC port and on the TCP data port; a UCX write, and a same-host write on the local socket,
land only with the grant of their ticket, issued to the authenticated peer that sends it."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
from collections.abc import Iterator
from dataclasses import dataclass, replace

import grpc
import numpy as np
import pytest
from pdserve.certs import CertPaths, create
from pdserve.common import localsock
from pdserve.common.kv.errors import Unauthorized
from pdserve.common.kv.wire import WriteHeader
from pdserve.common.layout import LayoutFingerprint
from pdserve.common.security import ChannelSecurity, open_channel
from pdserve.common.shm import leftover_segments
from pdserve.common.tickets import TicketKey
from pdserve.kvtransfer.transport import IncomingWrite, PeerContact
from pdserve.v1 import common_pb2, kvtransfer_pb2, kvtransfer_pb2_grpc

from tests.service.test_kvtransfer import FP, PAGE_BYTES, Pool, agent_argv
from tests.support import ServiceProcess, free_port, running

pytestmark = pytest.mark.service
Code = grpc.StatusCode


@pytest.fixture(scope="module", autouse=True)
def no_segments_left_behind() -> Iterator[None]:
    """Torn down after every other fixture of the module: all pools must be gone by then."""
    yield
    assert leftover_segments(os.getpid()) == []


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    return create(tmp_path_factory.mktemp("ca"))


@pytest.fixture(scope="module")
def stranger(tmp_path_factory: pytest.TempPathFactory) -> CertPaths:
    """Certificates from another CA: valid-looking, not trusted by the stack."""
    return create(tmp_path_factory.mktemp("other-ca"))


def service_security(certs: CertPaths) -> ChannelSecurity:
    return ChannelSecurity(str(certs.ca), str(certs.server_cert), str(certs.server_key))


@dataclass
class TlsAgent:
    address: str
    stub: kvtransfer_pb2_grpc.KVTransferStub
    proc: ServiceProcess


@contextlib.contextmanager
def tls_agent(certs: CertPaths, transport: str) -> Iterator[TlsAgent]:
    """`transport` shm: TCP agents with the same-host copy; ucx, tcp: without it."""
    port = free_port()
    address = f"127.0.0.1:{port}"
    flags = ("--transport", "tcp") if transport == "shm" else (
        "--transport", transport, "--no-same-host-copy")
    argv = agent_argv(port, *flags, "--tls-cert", str(certs.server_cert),
                      "--tls-key", str(certs.server_key), "--tls-ca", str(certs.ca))
    security = service_security(certs)
    with running(argv, address, security=security) as proc, \
            open_channel(address, security) as channel:
        yield TlsAgent(address, kvtransfer_pb2_grpc.KVTransferStub(channel), proc)
        assert proc.stop() == 0, proc.output()[-3000:]


@dataclass
class Pair:
    transport: str
    sender: TlsAgent
    receiver: TlsAgent
    src: Pool
    dst: Pool


@contextlib.contextmanager
def agent_pair(certs: CertPaths, transport: str) -> Iterator[Pair]:
    with tls_agent(certs, transport) as sender, tls_agent(certs, transport) as receiver:
        src, dst = Pool(sender.stub, "prefill-0", seed=1), Pool(receiver.stub, "decode-0", seed=2)
        try:
            yield Pair(transport, sender, receiver, src, dst)
        finally:
            src.close()
            dst.close()


@pytest.fixture(scope="module")
def ucx_pair(certs: CertPaths) -> Iterator[Pair]:
    with agent_pair(certs, "ucx") as pair:
        yield pair


@pytest.fixture(scope="module")
def tcp_pair(certs: CertPaths) -> Iterator[Pair]:
    with agent_pair(certs, "tcp") as pair:
        yield pair


@pytest.fixture(scope="module")
def shm_pair(certs: CertPaths) -> Iterator[Pair]:
    with agent_pair(certs, "shm") as pair:
        yield pair


_tickets = iter(range(1_000_000))


def expect(pair: Pair, pages: list[int]) -> common_pb2.Ticket:
    ticket = common_pb2.Ticket(request_id=f"tls-{next(_tickets)}", epoch=3)
    pair.receiver.stub.ExpectTransfer(kvtransfer_pb2.ExpectTransferRequest(
        ticket=ticket, pool_id=pair.dst.pool_id, page_ids=pages, lease_ms=10_000), timeout=10)
    return ticket


@pytest.mark.parametrize("transport", ["shm", "ucx", "tcp"])
def test_handoff_lands_byte_exact_over_mutual_tls(transport: str,
                                                  request: pytest.FixtureRequest) -> None:
    pair: Pair = request.getfixturevalue(f"{transport}_pair")
    src_pages, dst_pages = [1, 2, 3, 9], [20, 21, 22, 40]
    ticket = expect(pair, dst_pages)
    report = pair.sender.stub.SendPages(kvtransfer_pb2.SendPagesRequest(
        ticket=ticket, src_pool_id=pair.src.pool_id, src_page_ids=src_pages,
        destination=common_pb2.KVDestination(
            agent_address=pair.receiver.address, pool_id=pair.dst.pool_id, page_ids=dst_pages,
            agent_epoch=pair.dst.agent_epoch, fingerprint=FP), timeout_ms=10_000),
        timeout=15).report
    assert report.transport == pair.transport and report.kv_bytes == 4 * PAGE_BYTES
    for s, d in zip(src_pages, dst_pages):
        assert np.array_equal(pair.dst.page(d), pair.src.page(s)), f"page {s} -> {d}"


def _call_info(address: str, security: ChannelSecurity | None) -> grpc.RpcError:
    with open_channel(address, security) as channel, pytest.raises(grpc.RpcError) as info:
        kvtransfer_pb2_grpc.KVTransferStub(channel).GetAgentInfo(
            kvtransfer_pb2.GetAgentInfoRequest(), timeout=5)
    return info.value


def test_callers_without_a_certificate_from_the_ca_are_refused(
        tcp_pair: Pair, certs: CertPaths, stranger: CertPaths) -> None:
    pair = tcp_pair  # the gRPC port does not depend on the transport
    address = pair.receiver.address
    refused = {
        "plaintext": _call_info(address, None),
        "TLS without a client certificate": _call_info(address, ChannelSecurity(str(certs.ca))),
        "a certificate from another CA": _call_info(address, ChannelSecurity(
            str(certs.ca), str(stranger.server_cert), str(stranger.server_key))),
        "a server that is not ours": _call_info(address, ChannelSecurity(
            str(stranger.ca), str(certs.server_cert), str(certs.server_key))),
    }
    for who, error in refused.items():
        assert error.code() == Code.UNAVAILABLE, (who, error.details())
    # ... while the same call with the stack's own certificate works.
    info = pair.receiver.stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(), timeout=5)
    assert info.epoch == pair.dst.agent_epoch


def test_tcp_data_port_refuses_connections_without_a_certificate_from_the_ca(
        tcp_pair: Pair, certs: CertPaths, stranger: CertPaths) -> None:
    pair = tcp_pair
    info = pair.receiver.stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(), timeout=5)
    host, _, port = info.tcp_address.rpartition(":")
    ticket = expect(pair, [5])
    header = WriteHeader(1, TicketKey(ticket.request_id, ticket.epoch), pair.dst.agent_epoch,
                         pair.dst.pool_id, _fingerprint(), PAGE_BYTES, ((5, 1),), 5_000.0)
    before = pair.dst.snapshot()
    with socket.create_connection((host, int(port)), timeout=5) as raw:  # plaintext header
        raw.sendall(header.encode() + bytes(PAGE_BYTES))
        with contextlib.suppress(ConnectionResetError):
            assert raw.recv(4096) == b""  # no "ready": the listener hung up on it
    ctx = ssl.create_default_context(cafile=str(certs.ca))
    ctx.load_cert_chain(str(stranger.client_cert), str(stranger.client_key))
    with socket.create_connection((host, int(port)), timeout=5) as raw, \
            pytest.raises((ssl.SSLError, ConnectionResetError, BrokenPipeError)):
        with ctx.wrap_socket(raw, server_hostname=host) as tls:
            tls.sendall(header.encode())
            tls.recv(4096)  # TLS 1.3: the refusal of the certificate arrives here
    assert np.array_equal(pair.dst.snapshot(), before)
    assert "refused a TCP data connection" in pair.receiver.proc.output()


class _RefuseAll:
    def accept(self, header: WriteHeader) -> IncomingWrite:
        raise Unauthorized("this test's transport receives nothing")

    def finish(self, write: IncomingWrite, ok: bool) -> None:
        return None


def _fingerprint() -> LayoutFingerprint:
    return LayoutFingerprint(FP.model_id, FP.model_revision, FP.dtype, FP.num_layers,
                             FP.num_kv_heads, FP.head_dim, FP.block_size, FP.tp_rank, FP.tp_size)


def test_a_ucx_write_lands_only_with_the_grant_of_its_ticket_for_its_sender(
        ucx_pair: Pair) -> None:
    """The UCX data path has no TLS of its own: grants guard it."""
    from pdserve.kvtransfer.ucx import UcxTransport

    pair = ucx_pair
    info = pair.receiver.stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(), timeout=5)
    peer = PeerContact(info.agent_id, ucx_worker_address=info.ucx_worker_address)
    dst_pages = [30, 31]
    ticket = expect(pair, dst_pages)
    key = TicketKey(ticket.request_id, ticket.epoch)
    header = WriteHeader(1, key, pair.dst.agent_epoch, pair.dst.pool_id, _fingerprint(),
                         PAGE_BYTES, ((30, 2),), 5_000.0)
    views = [pair.src.data[:2 * PAGE_BYTES]]
    before = pair.dst.snapshot()
    transport = UcxTransport()
    contact = transport.start(_RefuseAll())
    try:
        with pytest.raises(Unauthorized, match="carries no grant"):
            transport.send(peer, header, views, 5.0)
        # A grant issued for another UCX worker (another sender) is useless from this one,
        # and a made-up grant too.
        other = pair.receiver.stub.GrantWrite(kvtransfer_pb2.GrantWriteRequest(
            ticket=ticket, reply_to=b"another-worker"), timeout=5).grant
        with pytest.raises(Unauthorized, match="the grant does not match"):
            transport.send(peer, replace(header, xfer_id=2, grant=bytes(16)), views, 5.0)
        with pytest.raises(Unauthorized, match="another UCX worker"):
            transport.send(peer, replace(header, xfer_id=3, grant=other), views, 5.0)
        assert np.array_equal(pair.dst.snapshot(), before)  # not one byte landed

        # The ticket is bound to the first peer it was granted to.
        with pytest.raises(grpc.RpcError) as info_err:
            pair.receiver.stub.GrantWrite(kvtransfer_pb2.GrantWriteRequest(
                ticket=ticket, reply_to=contact.ucx_worker_address), timeout=5)
        assert info_err.value.code() == Code.PERMISSION_DENIED
        assert "already granted to another peer" in info_err.value.details()

        # The rightful grant (asked for by this authenticated caller, for its own worker).
        ticket2 = expect(pair, dst_pages)
        key2 = TicketKey(ticket2.request_id, ticket2.epoch)
        grant = pair.receiver.stub.GrantWrite(kvtransfer_pb2.GrantWriteRequest(
            ticket=ticket2, reply_to=contact.ucx_worker_address), timeout=5).grant
        transport.send(peer, replace(header, xfer_id=4, ticket=key2, grant=grant), views, 5.0)
        assert np.array_equal(pair.dst.data[30 * PAGE_BYTES:32 * PAGE_BYTES], views[0])
    finally:
        transport.close()
    with pytest.raises(grpc.RpcError) as unknown:
        pair.receiver.stub.GrantWrite(kvtransfer_pb2.GrantWriteRequest(
            ticket=common_pb2.Ticket(request_id="never-expected", epoch=1)), timeout=5)
    assert unknown.value.code() == Code.NOT_FOUND
    assert "unknown ticket" in unknown.value.details()


def test_a_same_host_write_lands_only_with_the_grant_of_its_ticket(shm_pair: Pair) -> None:
    """The local socket takes any process of the agent's user; under mutual TLS a write that
    arrives there still needs the grant of its ticket (asked for over mutual TLS)."""
    pair = shm_pair
    info = pair.receiver.stub.GetAgentInfo(kvtransfer_pb2.GetAgentInfoRequest(), timeout=5)
    ticket = expect(pair, [33])
    key = TicketKey(ticket.request_id, ticket.epoch)
    header = WriteHeader(1, key, pair.dst.agent_epoch, pair.dst.pool_id, _fingerprint(),
                         PAGE_BYTES, ((33, 1),), 5_000.0)
    before = pair.dst.snapshot()
    write = {"op": "shm_write", "src_pool": "forged", "src_num_pages": 8, "src_runs": [[0, 1]]}
    with localsock.connect(info.local_socket, 5) as conn:
        for grant in (b"", bytes(16)):
            fd = pair.src.segment.readonly_fd()
            reply, _ = localsock.call(conn, write, replace(header, grant=grant).encode(), (fd,))
            os.close(fd)
            assert reply["error"] == "Unauthorized", reply
    assert np.array_equal(pair.dst.snapshot(), before)
    # The agents themselves ask for the grant: their handoff lands.
    report = pair.sender.stub.SendPages(kvtransfer_pb2.SendPagesRequest(
        ticket=ticket, src_pool_id=pair.src.pool_id, src_page_ids=[4],
        destination=common_pb2.KVDestination(
            agent_address=pair.receiver.address, pool_id=pair.dst.pool_id, page_ids=[33],
            agent_epoch=pair.dst.agent_epoch, fingerprint=FP), timeout_ms=10_000),
        timeout=15).report
    assert report.transport == "shm"
    assert np.array_equal(pair.dst.page(33), pair.src.page(4))
